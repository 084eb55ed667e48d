"""The decode data path of the paged attention kernel over the MXFP8 KV cache: the FP8 bytes go to the tensor
cores as they are.

`triton_paged_attention._paged_attn_kernel` has two data paths behind one prologue and epilogue (programs,
lengths, query rows, split ranges, stores). The exact one dequantizes every K and V tile to bf16 before its two
products, the dense forward's data path: at decode sizes (a few query rows per KV head) that costs far more
than the products, about 32 element operations per query row and key. The decode path (DECODE, the 16-row
decode tile), whose per-block work is here (`_q_block`, `_block_pages`, `_decode_scores`, `_decode_values`,
`_store_scores`, `_load_scores`), keeps the recipe and changes only where the power-of-two scales are applied:

* Q K^T: for each 32-wide block b along D, S_b = Q8_b K8_b^T on the f16 tensor cores (E4M3 -> F16 is exact
  and so is every product of two E4M3 values; sums in fp32), then S = sum_b S_b * 2^eq_b * 2^ek_b, with Q's
  row-wise scales per row and K's per key (batched 3-D dots over the D blocks);
* P V: P * 256 is rounded to E4M3 as in the recipe; for each 32-token block c of the KV block,
  O_c = P8_c V8_c on the tensor cores, then O += sum_c O_c * 2^ev_c with V's column-wise scales per column;
* the softmax step is the shared `softmax_block` on S.

Every product is exact on both paths and each runs the same softmax and P rounding, so the two agree to the
order of the fp32 additions (a partial sum per 32-block here), the agreement the split passes already have with
the single pass (tests: `tests/kvcache/test_kvcache_gpu.py`). Scales: 2^(e - 127) in fp32 (E8M0 0 as the
subnormal 2^-127, 255 as NaN: a NaN block gives NaN as on the dequantizing path). Passes, grid and split-KV
bookkeeping are the kernel's, the same on both paths (`triton_paged_attention`'s module docstring says why split
KV needs the maximum pass).

Split KV stores the logits (STORE_S): the maximum pass computes every block's S (`_decode_scores`) for its row
maxima anyway, so it also writes S, unmasked, to a workspace (`_store_scores`: fp32, one row per query token and
head, one column per key position), and the split pass reads it back (`_load_scores`) instead of gathering K's
bytes and scales from the pages and multiplying again: the same fp32 values, so the same P and O bit for bit, for
a few query rows' loads and stores per key instead of Q K^T a second time. Without STORE_S (the launcher's
fallback above its workspace cap) the split pass recomputes S.
"""

import triton
import triton.language as tl

from .triton_common import quantize_cols, quantize_rows


@triton.jit
def e8m0_factor(e):
    """int32 tile of E8M0 exponents -> fp32 2^(e - 127) (0 gives the subnormal 2^-127, 255 NaN)."""
    bits = tl.where(e == 0, 0x400000, e << 23)
    bits = tl.where(e == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_p_to_f16(p):
    """fp32 tile p in [0, 448] -> f16 tile E4M3(p) (round to nearest even with saturation, the recipe's rounding
    of P * 256, as `round_p_to_bf16`), exactly: E4M3 values, subnormals included, are F16 numbers."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 h;
        cvt.rn.satfinite.e4m3x2.f32 h, $2, $1;
        cvt.rn.f16x2.e4m3x2 $0, h;
        }""",
        constraints="=r,r,r", args=[p], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def e4m3_to_f16(x):
    """E4M3 tile -> f16 tile (exact), two elements per conversion instruction. Written as inline assembly so
    the compiler keeps the conversion where it is written (before a tile goes through shared memory to the
    tensor cores, which then read 16-bit rows, transposed where needed, instead of single bytes)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def e4m3_pairs_to_f16(w, R: tl.constexpr, C: tl.constexpr):
    """int16 tile [R, C // 2] holding pairs of E4M3 bytes (a row of C bytes read two at a time) -> f16 [R, C]
    (exact). The pairs are converted where they were loaded, a row-major tile, before any transposition: the
    tensor cores' transposed operand loads move 16-bit values (ldmatrix .trans), never single bytes."""
    lo, hi = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t;
        cvt.rn.f16x2.e4m3x2 t, $2;
        mov.b32 {$0, $1}, t;
        }""",
        constraints="=h,=h,h", args=[w], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.reshape(tl.join(lo, hi), (R, C))


@triton.jit
def _block_pages(j, slot, len_kv, PT, spt, PAGE, BN: tl.constexpr, WHOLE_PAGES: tl.constexpr):
    """KV block j's pages: (its page, int64, when the block lies in one page (WHOLE_PAGES), else 0; the page of
    each token [BN] (the scalar page under WHOLE_PAGES), tokens at or past len_kv on page 0; the in-page row of
    each token [BN])."""
    cols = j * BN + tl.arange(0, BN)
    if WHOLE_PAGES:  # one page-table read for the block
        pg = tl.load(PT + slot * spt + (j * BN) // PAGE).to(tl.int64)
        page = pg
    else:
        pg = tl.zeros([], tl.int64)
        page = tl.load(PT + slot * spt + cols // PAGE, mask=cols < len_kv, other=0).to(tl.int64)
    return pg, page, cols % PAGE


@triton.jit
def _q_block(Q, tok, head, sq_t, sq_h, row_ok, b, D, BM: tl.constexpr):
    """Q's D block b of rows (tok, head) [BM], quantized row-wise: (E4M3 values as f16 [BM, 32], their scales
    fp32 [BM]); zeros (scale 2^-127) past D."""
    d = b * 32 + tl.arange(0, 32)
    x = tl.load(Q + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=row_ok[:, None] & (d < D)[None, :],
                other=0.0)
    qq, qe = quantize_rows(x.to(tl.float32), BM, 32)
    return qq.to(tl.float16), tl.reshape(e8m0_factor(qe), (BM,))


@triton.jit
def _qk_part(qb, sqb, b, page, row, valid, hk, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, D,
             BN: tl.constexpr, TAIL: tl.constexpr, EVEN_D: tl.constexpr):
    """(Q8_b K8_b^T) * 2^eq_b * 2^ek_b fp32 [BM, BN]: D block b of Q K^T for one KV block. TAIL: keys not
    `valid` read as 0 (else every key is valid)."""
    d = b * 32 + tl.arange(0, 32)
    base = page * skd_p + row * skd_n + hk * skd_h                                 # [BN]
    k_ptrs = KD + base[:, None] + d[None, :]
    s_ptrs = KS + page * sks_p + row * sks_n + hk * sks_h + b
    if TAIL:
        k = tl.load(k_ptrs, mask=valid[:, None] & (d < D)[None, :], other=0.0)
        ek = tl.load(s_ptrs, mask=valid & (b * 32 < D), other=127)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        ek = tl.load(s_ptrs)
    else:
        k = tl.load(k_ptrs, mask=(d < D)[None, :], other=0.0)
        ek = tl.load(s_ptrs, mask=(tl.zeros([BN], tl.int32) + b * 32) < D, other=127)
    return tl.dot(qb, tl.trans(e4m3_to_f16(k))) * sqb[:, None] * e8m0_factor(ek.to(tl.int32))[None, :]


@triton.jit
def _decode_scores(q0, q1, q2, q3, s0, s1, s2, s3, j, page, row, hk, len_kv, KD, skd_p, skd_h, skd_n,
                   KS, sks_p, sks_h, sks_n, D, BN: tl.constexpr, NB: tl.constexpr, TAIL: tl.constexpr,
                   EVEN_D: tl.constexpr):
    """S fp32 [BM, BN] = Q K^T of KV block j from Q's D blocks (q_b E4M3 values as f16 [BM, 32], s_b their
    scales [BM]; NB of them used) and K's bytes and scales in the pages (TAIL: keys at or past len_kv: 0)."""
    valid = j * BN + tl.arange(0, BN) < len_kv
    k_args = (page, row, valid, hk, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, D)
    s = _qk_part(q0, s0, 0, *k_args, BN, TAIL, EVEN_D)
    if NB > 1:
        s += _qk_part(q1, s1, 1, *k_args, BN, TAIL, EVEN_D)
    if NB > 2:
        s += _qk_part(q2, s2, 2, *k_args, BN, TAIL, EVEN_D)
        s += _qk_part(q3, s3, 3, *k_args, BN, TAIL, EVEN_D)
    return s


@triton.jit
def _store_scores(SW, s_row, s_ok, j, qk, BN: tl.constexpr):
    """Write KV block j's logits qk fp32 [BM, BN] (as `_decode_scores` returns them, before any mask) to the
    workspace: row r's at SW[s_row[r] + j * BN .. + BN] (s_row: the row's offset, (token * HQ + head) * SW_N), rows
    s_ok only. The maximum pass's half of STORE_S; `_load_scores` is the split pass's."""
    cols = j * BN + tl.arange(0, BN)
    tl.store(SW + s_row[:, None] + cols[None, :], qk, mask=s_ok[:, None])


@triton.jit
def _load_scores(SW, s_row, s_ok, j, BN: tl.constexpr):
    """KV block j's logits fp32 [BM, BN] as `_store_scores` wrote them (the very bits `_decode_scores` gave the
    maximum pass, but for -0 read as +0); 0 in rows not s_ok. Returned as S + 0 x 0 on the tensor cores (a
    [BM, 16] x [16, BN] product of zeros, a few MMA instructions): that anchors S in the MMA accumulator layout,
    where `_decode_scores` leaves it; a loaded S otherwise takes the layout of P's MMA operand, which repeats
    every row in every warp, and the softmax runs four times over (sm_90 build: 1769 -> 1215 instructions per
    block and warp with the product, 1501 without)."""
    cols = j * BN + tl.arange(0, BN)
    s = tl.load(SW + s_row[:, None] + cols[None, :], mask=s_ok[:, None], other=0.0)
    return tl.dot(tl.zeros([s_row.shape[0], 16], tl.float16), tl.zeros([16, BN], tl.float16), s)


@triton.jit
def _pv_part(pc, c, j, pg, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h,
             svs_n, VT, svt_s, svt_h, svt_n, D, BN: tl.constexpr, DP: tl.constexpr, WHOLE_PAGES: tl.constexpr,
             TAIL: tl.constexpr, EVEN_D: tl.constexpr):
    """(P8_c V8_c) * 2^ev_c fp32 [BM, DP]: 32-token block c of KV block j (pc: its E4M3 P * 256 as f16
    [BM, 32]; pg: the block's page under WHOLE_PAGES). Sealed blocks come from the pages; TAIL: the block may
    reach past the sealed ones: the open block (tokens sealed .. len_kv) is quantized here from the rows the
    cache keeps, later tokens are zeros (else every token is sealed)."""
    blk = j * BN + c * 32
    t = blk + tl.arange(0, 32)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    if WHOLE_PAGES:
        page = pg
    elif TAIL:
        page = tl.load(PT + slot * spt + blk // PAGE, mask=blk < sealed, other=0).to(tl.int64)
    else:
        page = tl.load(PT + slot * spt + blk // PAGE).to(tl.int64)
    s_ptrs = VS + page * svs_p + hk * svs_h + ((blk % PAGE) // 32) * svs_n + offs_d
    if TAIL:
        v_ptrs = VD + page * svd_p + hk * svd_h + (t % PAGE)[:, None] * svd_n + offs_d[None, :]
        v = e4m3_to_f16(tl.load(v_ptrs, mask=(t < sealed)[:, None] & d_ok[None, :], other=0.0))
        ev = tl.load(s_ptrs, mask=d_ok & (blk < sealed), other=127).to(tl.int32)
        if blk == sealed:  # the open block: quantized column-wise from its rows, as the cache defines it
            raw = tl.load(VT + slot * svt_s + hk * svt_h + (t - sealed)[:, None] * svt_n + offs_d[None, :],
                          mask=(t < len_kv)[:, None] & d_ok[None, :], other=0.0)
            vq, vqe = quantize_cols(raw.to(tl.float32), 32, DP)
            v = e4m3_to_f16(vq)
            ev = tl.reshape(vqe, (DP,))
    elif EVEN_D:  # two bytes at a time (D even, every stride of the pages even)
        offs_w = tl.arange(0, DP // 2)
        w_ptrs = VD.to(tl.pointer_type(tl.int16), bitcast=True) + (page * svd_p + hk * svd_h) // 2 \
            + ((t % PAGE) * (svd_n // 2))[:, None] + offs_w[None, :]
        v = e4m3_pairs_to_f16(tl.load(w_ptrs), 32, DP)
        ev = tl.load(s_ptrs).to(tl.int32)
    else:
        v_ptrs = VD + page * svd_p + hk * svd_h + (t % PAGE)[:, None] * svd_n + offs_d[None, :]
        v = e4m3_to_f16(tl.load(v_ptrs, mask=d_ok[None, :], other=0.0))
        ev = tl.load(s_ptrs, mask=d_ok, other=127).to(tl.int32)
    return tl.dot(pc, v) * e8m0_factor(ev)[None, :]


@triton.jit
def _decode_values(p, j, pg, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h,
                   svs_n, VT, svt_s, svt_h, svt_n, D, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
                   WHOLE_PAGES: tl.constexpr, TAIL: tl.constexpr, EVEN_D: tl.constexpr):
    """P V of KV block j, fp32 [BM, DP]: p fp32 [BM, BN] (P * 256) rounded to E4M3, by 32-token blocks."""
    p4 = tl.permute(tl.reshape(round_p_to_f16(p), (BM, 2, 2, 32)), (0, 3, 1, 2))   # [BM, 32, c // 2, c % 2]
    even, odd = tl.split(p4)
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    v_args = (j, pg, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h, svs_n,
              VT, svt_s, svt_h, svt_n, D)
    o = _pv_part(p0, 0, *v_args, BN, DP, WHOLE_PAGES, TAIL, EVEN_D)
    o += _pv_part(p1, 1, *v_args, BN, DP, WHOLE_PAGES, TAIL, EVEN_D)
    o += _pv_part(p2, 2, *v_args, BN, DP, WHOLE_PAGES, TAIL, EVEN_D)
    o += _pv_part(p3, 3, *v_args, BN, DP, WHOLE_PAGES, TAIL, EVEN_D)
    return o


__all__ = ["e8m0_factor", "round_p_to_f16"]
