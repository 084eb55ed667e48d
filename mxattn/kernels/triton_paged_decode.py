"""Triton decode kernel over the paged MXFP8 KV cache: the FP8 bytes go to the tensor cores as they are.

The exact paged kernel (`triton_paged_attention._paged_attn_kernel`) dequantizes every K and V tile to bf16
before its two products, the dense forward's data path: at decode sizes (a few query rows per KV head) that
costs far more than the products, about 32 element operations per query row and key. This kernel keeps the
recipe and changes only where the power-of-two scales are applied:

* Q K^T: for each 32-wide block b along D, S_b = Q8_b K8_b^T on the f16 tensor cores (E4M3 -> F16 is exact
  and so is every product of two E4M3 values; sums in fp32), then S = sum_b S_b * 2^eq_b * 2^ek_b, with Q's
  row-wise scales per row and K's per key (batched 3-D dots over the D blocks);
* P V: P * 256 is rounded to E4M3 as in the recipe; for each 32-token block c of the KV block,
  O_c = P8_c V8_c on the tensor cores, then O += sum_c O_c * 2^ev_c with V's column-wise scales per column;
* the softmax step is the shared `softmax_block` on S.

Every product is exact in both kernels and each runs the same softmax and P rounding, so the two agree to the
order of the fp32 additions (a partial sum per 32-block here), the agreement the split passes already have with
the single pass (tests: `tests/kvcache/test_kvcache_gpu.py`). Scales: 2^(e - 127) in fp32 (E8M0 0 as the
subnormal 2^-127, 255 as NaN: a NaN block gives NaN as on the dequantizing path).

Passes, grid and split-KV bookkeeping are the exact kernel's (`SINGLE`, `MAX_PASS`, `SPLIT_PASS`; its module
docstring says why split KV needs the maximum pass): this kernel is its drop-in for the 16-row decode tile.
"""

import triton
import triton.language as tl

from .triton_common import (block_max, kv_block_range, mask_logits, quantize_cols, quantize_rows, softmax_block,
                            softmax_start)

SINGLE, MAX_PASS, SPLIT_PASS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


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
def _block_pages(j, slot, len_kv, PT, spt, PAGE, BN: tl.constexpr, WHOLE_PAGES: tl.constexpr):
    """The page (int64) and in-page row of each token of KV block j [BN]; tokens at or past len_kv get page 0
    (their loads are masked)."""
    cols = j * BN + tl.arange(0, BN)
    if WHOLE_PAGES:  # the block lies in one page: one page-table read
        page = tl.zeros([BN], tl.int64) + tl.load(PT + slot * spt + (j * BN) // PAGE).to(tl.int64)
    else:
        page = tl.load(PT + slot * spt + cols // PAGE, mask=cols < len_kv, other=0).to(tl.int64)
    return page, cols % PAGE


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
             BN: tl.constexpr):
    """(Q8_b K8_b^T) * 2^eq_b * 2^ek_b fp32 [BM, BN]: D block b of Q K^T for one KV block (keys not valid: 0)."""
    d = b * 32 + tl.arange(0, 32)
    base = page * skd_p + row * skd_n + hk * skd_h                                 # [BN]
    k = tl.load(KD + base[:, None] + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
    ek = tl.load(KS + page * sks_p + row * sks_n + hk * sks_h + b, mask=valid & (b * 32 < D),
                 other=127).to(tl.int32)
    return tl.dot(qb, tl.trans(k.to(tl.float16))) * sqb[:, None] * e8m0_factor(ek)[None, :]


@triton.jit
def _decode_scores(q0, q1, q2, q3, s0, s1, s2, s3, j, page, row, hk, len_kv, KD, skd_p, skd_h, skd_n,
                   KS, sks_p, sks_h, sks_n, D, BN: tl.constexpr, NB: tl.constexpr):
    """S fp32 [BM, BN] = Q K^T of KV block j from Q's D blocks (q_b E4M3 values as f16 [BM, 32], s_b their
    scales [BM]; NB of them used) and K's bytes and scales in the pages (keys at or past len_kv: 0)."""
    valid = j * BN + tl.arange(0, BN) < len_kv
    k_args = (page, row, valid, hk, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, D)
    s = _qk_part(q0, s0, 0, *k_args, BN)
    if NB > 1:
        s += _qk_part(q1, s1, 1, *k_args, BN)
    if NB > 2:
        s += _qk_part(q2, s2, 2, *k_args, BN)
        s += _qk_part(q3, s3, 3, *k_args, BN)
    return s


@triton.jit
def _pv_part(pc, c, j, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h, svs_n,
             VT, svt_s, svt_h, svt_n, D, BN: tl.constexpr, DP: tl.constexpr, OPEN: tl.constexpr):
    """(P8_c V8_c) * 2^ev_c fp32 [BM, DP]: 32-token block c of KV block j (pc: its E4M3 P * 256 as f16
    [BM, 32]); sealed blocks from the pages, the open one (OPEN, tokens sealed .. len_kv) quantized here from
    the rows the cache keeps; tokens past len_kv are zeros."""
    blk = j * BN + c * 32
    t = blk + tl.arange(0, 32)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    page = tl.load(PT + slot * spt + blk // PAGE, mask=blk < sealed, other=0).to(tl.int64)
    row = t % PAGE
    v = tl.load(VD + page * svd_p + hk * svd_h + row[:, None] * svd_n + offs_d[None, :],
                mask=(t < sealed)[:, None] & d_ok[None, :], other=0.0)
    ev = tl.load(VS + page * svs_p + hk * svs_h + ((blk % PAGE) // 32) * svs_n + offs_d, mask=d_ok & (blk < sealed),
                 other=127).to(tl.int32)
    if OPEN:
        if blk == sealed:  # the open block: quantized column-wise from its rows, as the cache defines it
            raw = tl.load(VT + slot * svt_s + hk * svt_h + (t - sealed)[:, None] * svt_n + offs_d[None, :],
                          mask=(t < len_kv)[:, None] & d_ok[None, :], other=0.0)
            vq, vqe = quantize_cols(raw.to(tl.float32), 32, DP)
            v = vq
            ev = tl.reshape(vqe, (DP,))
    return tl.dot(pc, v.to(tl.float16)) * e8m0_factor(ev)[None, :]


@triton.jit
def _decode_values(p, j, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h, svs_n,
                   VT, svt_s, svt_h, svt_n, D, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
                   OPEN: tl.constexpr):
    """P V of KV block j, fp32 [BM, DP]: p fp32 [BM, BN] (P * 256) rounded to E4M3, by 32-token blocks."""
    p4 = tl.permute(tl.reshape(round_p_to_f16(p), (BM, 2, 2, 32)), (0, 3, 1, 2))   # [BM, 32, c // 2, c % 2]
    even, odd = tl.split(p4)
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    v_args = (j, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h, svs_n,
              VT, svt_s, svt_h, svt_n, D)
    o = _pv_part(p0, 0, *v_args, BN, DP, OPEN)
    o += _pv_part(p1, 1, *v_args, BN, DP, OPEN)
    o += _pv_part(p2, 2, *v_args, BN, DP, OPEN)
    o += _pv_part(p3, 3, *v_args, BN, DP, OPEN)
    return o


@triton.jit
def _decode_blocks(acc, m_i, l_i, qs, j0, j1, pos, slot, hk, len_kv, sealed, offset, LB, qk_scale,
                   PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n,
                   VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE,
                   HAS_LB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, NB: tl.constexpr,
                   WHOLE_PAGES: tl.constexpr, MAX_ONLY: tl.constexpr, OPEN: tl.constexpr):
    """The online softmax over KV blocks j0 .. j1 (in order) for query positions pos [BM], every block masked
    (length, causal bottom-right, window); qs: Q's D blocks and scales (`_q_block`); MAX_ONLY: only the running
    max of the logits."""
    for j in range(j0, j1):
        page, row = _block_pages(j, slot, len_kv, PT, spt, PAGE, BN, WHOLE_PAGES)
        qk = _decode_scores(*qs, j, page, row, hk, len_kv, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, D,
                            BN, NB)
        cols = j * BN + tl.arange(0, BN)
        if MAX_ONLY:
            m_i = block_max(mask_logits(qk, pos, cols, len_kv, offset, LB, 0, True, HAS_LB, True), m_i, qk_scale)
        else:
            p, alpha, m_i, l_i = softmax_block(qk, m_i, l_i, pos, cols, len_kv, qk_scale, offset, LB, 0, True,
                                               HAS_LB, True)
            pv = _decode_values(p, j, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n,
                                VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, BM, BN, DP, OPEN)
            acc = acc * alpha[:, None] + pv
    return acc, m_i, l_i


@triton.jit
def _paged_decode_kernel(
        Q, O, MP, MF, LP, OP, CU_Q, SLOTS, SEQ_LENS, SINK, PT, KD, KS, VD, VS, VT,
        sq_t, sq_h, so_t, so_h, spt,
        skd_p, skd_h, skd_n, sks_p, sks_h, sks_n,
        svd_p, svd_h, svd_n, svs_p, svs_h, svs_n, svt_s, svt_h, svt_n,
        T, HQ, HKV, GROUP, D, PAGE, qk_scale, LB, N_SPLITS,
        HAS_LB: tl.constexpr, HAS_SINK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
        GP: tl.constexpr, EVEN_D: tl.constexpr, WHOLE_PAGES: tl.constexpr, PASS: tl.constexpr):
    """`_paged_attn_kernel`'s arguments, grid and passes (see it), computed on the FP8 operands (module
    docstring). EVEN_D is accepted for the common launch and unused (every load is masked along D)."""
    NB: tl.constexpr = DP // 32
    TQ: tl.constexpr = BM // GP
    tile = tl.program_id(0) // N_SPLITS
    split = tl.program_id(0) % N_SPLITS
    pid = tl.program_id(1)
    chunks = tl.cdiv(GROUP, GP)
    b = (pid // (HKV * chunks)).to(tl.int64)
    hk = ((pid // chunks) % HKV).to(tl.int64)
    chunk = pid % chunks
    first = tl.load(CU_Q + b)
    len_q = tl.load(CU_Q + b + 1) - first
    t0 = tile * TQ
    if t0 >= len_q:
        return
    slot = tl.load(SLOTS + b).to(tl.int64)
    len_kv = tl.load(SEQ_LENS + slot)
    sealed = len_kv - len_kv % 32
    offset = len_kv - len_q  # causal, bottom-right: the last query sees every key
    r = tl.arange(0, BM)
    pos = t0 + r // GP
    g = chunk * GP + r % GP
    row_ok = (pos < len_q) & (g < GROUP)
    head = hk * GROUP + tl.where(g < GROUP, g, 0)
    tok = first.to(tl.int64) + pos
    offs_d = tl.arange(0, DP)
    q_ok = row_ok[:, None] & (offs_d < D)[None, :]
    q0, s0 = _q_block(Q, tok, head, sq_t, sq_h, row_ok, 0, D, BM)
    q1, s1 = _q_block(Q, tok, head, sq_t, sq_h, row_ok & (NB > 1), 1, D, BM)
    q2, s2 = _q_block(Q, tok, head, sq_t, sq_h, row_ok & (NB > 2), 2, D, BM)
    q3, s3 = _q_block(Q, tok, head, sq_t, sq_h, row_ok & (NB > 2), 3, D, BM)
    qs = (q0, q1, q2, q3, s0, s1, s2, s3)

    lo, mask_hi, full_lo, full_hi, hi = kv_block_range(t0, len_kv, offset, LB, 0, HAS_LB, True, TQ, BN)
    js = lo // BN
    je = tl.cdiv(hi, BN)
    if PASS != SINGLE:  # this split's blocks
        per = tl.cdiv(je - js, N_SPLITS)
        js = js + split * per
        je = tl.minimum(js + per, je)
    m_i, l_i, acc = softmax_start(SINK, head, HAS_SINK, BM, DP)
    part = (split * T + tok) * HQ + head     # [BM] index into MP / MF / LP
    if PASS == MAX_PASS:
        m_i = tl.full([BM], float("-inf"), tl.float32)
    if PASS == SPLIT_PASS:
        for s in range(0, split):
            m_i = tl.maximum(m_i, tl.load(MP + part - (split - s) * T * HQ, mask=row_ok, other=float("-inf")))
        if split > 0:
            l_i = tl.zeros([BM], tl.float32)
    pages = (PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, VD, svd_p, svd_h, svd_n,
             VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE)
    max_only: tl.constexpr = PASS == MAX_PASS
    # blocks wholly in sealed V blocks, then the block(s) reaching the open one
    j_open = tl.maximum(tl.minimum(sealed // BN, je), js)
    acc, m_i, l_i = _decode_blocks(acc, m_i, l_i, qs, js, j_open, pos, slot, hk, len_kv, sealed, offset, LB,
                                   qk_scale, *pages, HAS_LB, BM, BN, DP, NB, WHOLE_PAGES, max_only, False)
    acc, m_i, l_i = _decode_blocks(acc, m_i, l_i, qs, j_open, je, pos, slot, hk, len_kv, sealed, offset, LB,
                                   qk_scale, *pages, HAS_LB, BM, BN, DP, NB, WHOLE_PAGES, max_only, True)
    if PASS == MAX_PASS:
        tl.store(MP + part, m_i, mask=row_ok)
    elif PASS == SPLIT_PASS:
        tl.store(MF + part, m_i, mask=row_ok)
        tl.store(LP + part, l_i, mask=row_ok)
        tl.store(OP + part[:, None] * DP + offs_d[None, :], acc, mask=row_ok[:, None])
    else:
        has = (l_i != 0.0) & row_ok
        denom = tl.where(has, l_i, 1.0)
        o = tl.where(has[:, None], acc / denom[:, None], 0.0)
        tl.store(O + tok[:, None] * so_t + head[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=q_ok)


__all__ = ["e8m0_factor", "round_p_to_f16"]
