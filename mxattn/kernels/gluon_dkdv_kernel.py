"""Device code of the Hopper (sm_90a) Gluon dK/dV kernel of the MXFP8 attention backward: the warp-specialised
kernel `_gluon_dkdv_kernel`, its producer and consumer partitions and their block walk (`gluon_attention_bwd` checks
the operands, picks the schedule and launches it; `gluon_bwd_common` holds what the dQ kernel shares).

Inputs (mode "pre"): the query-side operands are the prep pass's bf16 scratch (`bwd_prep`: Q row- and
column-wise, dO row- and column-wise, each the exact dequantization of its MXFP8 copy, contiguous
[B, Hc, SQ, D]); K and V are FP8 row-wise (MXFP8Tensor) and are dequantized exactly to bf16 once per CTA
(`gluon_common._dequant3`, triton_common.dequant_rows' arithmetic) into shared memory.

Numerics (the default recipe's; the variants switch P's and dS's roundings as the Triton kernel does): per element
the operations of `triton_attention_bwd._dkdv_block` (PRE), in the same order: S^T = K Q^T (bf16 wgmma, fp32), P^T =
exp2(S^T * qk_scale - lse * LOG2E) (rows without keys: lse -inf read as +inf), masked to 0 outside the band / past
the sequences; dV += E4M3(P^T * 256) dO_col (P rounded as round_p_to_bf16, equal to the Triton kernel's
`.to(float8e4nv).to(bfloat16)` on [0, 448]); dP^T = V dO^T; dS^T = P^T * (dP^T - delta) * sm_scale; dS
quantize-dequantized along s_q in blocks of 32 (qdq_rows on the [keys, queries] tile: int max of |bits|, the
round-up scale rule, E4M3 RNE, back to bf16); dK += dS_c^T Q_col; dV stored times 1/256. The query blocks here have
64 rows (`gluon_attention_bwd.schedule`: 32 at D128 in some variants; the Triton kernel's are 32): the qdq blocks
are the same (32-aligned), and both GEMM chains add k16 slices of queries in ascending order into the same fp32
accumulator, so dK and dV should agree bit for bit up to the tensor cores' internal sum order (tested on the GPU in
tests/triton/test_gluon_bwd_gpu.py: bit-equal in >= 99%, within one bf16 ulp).

Structure (FlashAttention-3's backward without its dQ): a CTA owns BLOCK_N = 128 key rows of one (batch, KV
head); three partitions of one warpgroup each (`gl.warp_specialize`, setmaxnreg CONSUMER_REGS / PRODUCER_REGS,
the default partition what is left):

* two consumer warpgroups (the default partition and a worker), 64 key rows each: their K and V rows
  dequantized into the CTA's bf16 K / V tiles in shared memory (the wgmma A operands), then per streamed query
  block t (`_q_step`, DEFER on: the default at D64): wait "ready"; block t's LSE read from shared memory, where
  the producer loaded it and delta with the tiles (STATS_LOADS; or each consumer copies them one step ahead); issue
  S^T and dP^T (async, A from shared memory, m64 n=BLOCK_M) and block t - 1's dK GEMM (A = its quantized dS^T,
  kept in registers); P^T, the dV GEMM (A = rounded P^T from registers, n = D); wait for dP^T; dS^T and its qdq
  while the dK and dV GEMMs run; wait for both, release block t - 1's stage ("empty", one arrival per warpgroup).
  After the last block its dK GEMM (`deferred_tail`). With DEFER off (the wide schedule at D128), each block's
  GEMMs are waited for within its step (its dV GEMM under dS) and its own stage released at the end. dK and dV stay
  in registers (D / 2 fp32 registers per thread each); the epilogue stores them. Registers per consumer thread: 240
  (setmaxnreg), no spills at D64 / D128 in the offline sm_90a build.
* the producer warpgroup (24 registers): for t = 0, 1, ... over (query head of the group, query block) in the
  consumers' order, waits "empty" of stage t % NS and TMA-loads the four bf16 tiles [BLOCK_M, D] (4-D
  descriptors: rows past SQ read as zeros) and, with STATS_LOADS 5, the block's LSE and delta (3-D descriptors,
  [BLOCK_M] fp32 each) with one expect-tx "ready" arrival.

The protocol is simulated in tests/triton/test_gluon_bwd_protocol.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gluon_bwd_common import (P_BF16_BIT, V_RAW_BIT, WG0, WG1, _acc_layout, _ds_operand, _log2_lse, deferred_tail,
                               issue_s_dp, release)
from .gluon_common import _chunk_layouts, _dequant3, _round_p_to_bf16, _seq_lengths, _seq_rows

#: P's scale in the dV GEMM (E4M3(P * 256), triton_common.P_SCALE) and its inverse, applied to dV in the epilogue
P_SCALE_K = gl.constexpr(256.0)
P_DESCALE_K = gl.constexpr(1.0 / 256.0)


# --------------------------------------------------------------------------- element helpers and block walk
@gluon.jit
def _p_operand(p, RECIPE: gl.constexpr):
    """P times 256 (fp32) as the dV GEMM takes it, bf16: E4M3-rounded (`_round_p_to_bf16`), or with RECIPE's P_BF16
    bit rounded to bf16 (RNE; `triton_attention_bwd._dkdv_block`'s P_BF16)."""
    if (RECIPE & P_BF16_BIT) != 0:
        return p.to(gl.bfloat16)
    return _round_p_to_bf16(p)


@gluon.jit
def _kv_tile_of_program(HKV, HAS_RB: gl.constexpr):
    """(KV tile, b, hk) of this program, triton_common.program_prologue's for the KV side (BY_TILE with a
    causal-style band: tile-major, the first KV tiles (the heaviest) first)."""
    tile = gl.program_id(0)
    pid_bh = gl.program_id(1)
    if HAS_RB:
        n_tiles = gl.num_programs(0)
        n_bh = gl.num_programs(1)
        linear = pid_bh * n_tiles + tile
        tile = linear // n_bh
        pid_bh = linear % n_bh
    return tile, pid_bh // HKV, pid_bh % HKV


@gluon.jit
def _q_block_range(n0, SQ, SKV, offset, RB, HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, LB=0,
                   HAS_LB: gl.constexpr = False):
    """triton_common.band_block_range(KV_TILE): the query rows [lo, hi) that the keys
    [n0, n0 + BN) meet, in blocks of BM from lo (a multiple of BM); blocks [lo, mask_hi) and
    [max(full_hi, mask_hi), hi) need the mask, [full_lo, full_hi) are kept whole -> (lo, mask_hi, full_lo,
    full_hi, hi). The three ranges together are [lo, hi) in ascending order (the producer walks that)."""
    zero = n0 * 0
    lo = zero
    hi = zero + SQ
    full_lo = zero
    full_hi = zero + (SQ // BM) * BM
    if HAS_RB:
        lo = (gl.maximum(n0 - offset - RB, 0) // BM) * BM
        full_lo = ((gl.maximum(n0 + BN - 1 - offset - RB, 0) + BM - 1) // BM) * BM
    if HAS_LB:  # a sliding window (keys kept where key > query + offset - LB): no query at or past the tile's last
        # key - offset + LB, and whole blocks only below its first key - offset + LB
        hi = gl.minimum(SQ, gl.maximum(n0 + BN - 1 - offset + LB, 0))
        full_hi = gl.minimum(full_hi, (gl.maximum(n0 - offset + LB - 1, 0) // BM) * BM)
    if n0 + BN > SKV:
        full_hi = zero
    full_lo = gl.maximum(full_lo, lo)
    if full_hi <= full_lo:
        full_lo = hi
        full_hi = hi
    mask_hi = gl.minimum(full_lo, hi)
    return lo, mask_hi, full_lo, full_hi, hi


@gluon.jit
def _tile_q_range(n0, len_q, len_kv, offset, RB, HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  VARLEN: gl.constexpr, LB=0, HAS_LB: gl.constexpr = False):
    """`_q_block_range` of the keys [n0, n0 + BN) over a sequence's len_q queries and len_kv keys; VARLEN (a
    padded batch): no query block for a tile past the sequence's keys (its rows are padding: dK = dV = 0). The
    range the producer and both consumer warpgroups walk."""
    lo, mask_hi, full_lo, full_hi, hi = _q_block_range(n0, len_q, len_kv, offset, RB, HAS_RB, BM, BN, LB, HAS_LB)
    if VARLEN:
        if n0 >= len_kv:
            mask_hi = lo
            full_lo = lo
            full_hi = lo
            hi = lo
    return lo, mask_hi, full_lo, full_hi, hi


# --------------------------------------------------------------------------- partitions
@gluon.jit
def _producer(qr_desc, qc_desc, dor_desc, doc_desc, lse_desc, del_desc, qr, qc, dor, doc, lse_s, del_s, ready, empty,
              HKV, GROUP, SQ, SKV, offset, RB, CU_Q, CU_KV, LB, HAS_RB: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr, STATS: gl.constexpr, VARLEN: gl.constexpr,
              BOTTOM_RIGHT: gl.constexpr, HAS_LB: gl.constexpr, PACKED: gl.constexpr = False,
              GAP: gl.constexpr = 0):
    """The producer warpgroup: stage t % NS gets the t-th query block the consumers visit (query head
    hk * GROUP + t // n_blk, rows lo + (t % n_blk) * BM), once both consumer warpgroups released it. PACKED: the
    scratch tiles from the sequence's gapped rows (cu_q[b] + GAP * b on), the LSE / delta from its packed rows."""
    tile, b, hk = _kv_tile_of_program(HKV, HAS_RB)
    len_q, len_kv, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)
    bt, q0, kv0, kvb0 = _seq_rows(CU_Q, CU_KV, b, PACKED)
    qs0 = q0  # the sequence's first scratch row
    if PACKED:
        qs0 = q0 + GAP * b
    lo, mask_hi, full_lo, full_hi, hi = _tile_q_range(tile * BN, len_q, len_kv, offset, RB, HAS_RB, BM, BN, VARLEN,
                                                      LB, HAS_LB)
    n_blk = gl.cdiv(gl.maximum(hi - lo, 0), BM)
    for t in range(GROUP * n_blk):
        g = t // n_blk
        m0 = lo + (t - g * n_blk) * BM
        hq = hk * GROUP + g
        s = t % NS
        mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)  # passes at once on a fresh barrier (first round)
        bar = ready.index(s)
        if STATS == 5:  # four bf16 tiles, the block's LSE and delta
            mbarrier.expect(bar, 4 * BM * D * 2 + 2 * BM * 4)
            tma.async_copy_global_to_shared(lse_desc, [bt, hq, q0 + m0], bar, lse_s.index(s))
            tma.async_copy_global_to_shared(del_desc, [bt, hq, q0 + m0], bar, del_s.index(s))
        else:
            mbarrier.expect(bar, 4 * BM * D * 2)  # four bf16 tiles
        tma.async_copy_global_to_shared(qr_desc, [bt, hq, qs0 + m0, 0], bar, qr.index(s))
        tma.async_copy_global_to_shared(dor_desc, [bt, hq, qs0 + m0, 0], bar, dor.index(s))
        tma.async_copy_global_to_shared(doc_desc, [bt, hq, qs0 + m0, 0], bar, doc.index(s))
        tma.async_copy_global_to_shared(qc_desc, [bt, hq, qs0 + m0, 0], bar, qc.index(s))


@gluon.jit
def _load_kv_rows(X, XS, dst, base, sbase, sxs, sxss, n0, SKV, R: gl.constexpr, D: gl.constexpr,
                  num_warps: gl.constexpr):
    """Rows [n0, n0 + R) of an FP8 row-wise [.., SKV, D] tensor (X at its head, scales XS likewise) dequantized
    exactly to bf16 into the shared tile dst [R, D]; rows past SKV as zeros (triton_bwd_tiles._row_tile)."""
    lx: gl.constexpr = _chunk_layouts(D, num_warps)[1]
    lxs: gl.constexpr = gl.SliceLayout(2, lx)
    xr = n0 + gl.arange(0, R, layout=gl.SliceLayout(1, lxs))
    xb = gl.arange(0, D // 32, layout=gl.SliceLayout(0, lxs))
    xe = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, lx)))
    ok2 = gl.expand_dims(xr < SKV, 1) & gl.expand_dims(xb >= 0, 0)
    offs2 = gl.expand_dims(xr.to(gl.int64) * sxs, 1) + gl.expand_dims(xb * 32, 0)
    offs = gl.expand_dims(offs2, 2) + gl.expand_dims(gl.expand_dims(xe, 0), 1)
    ok = gl.expand_dims(ok2, 2) & gl.expand_dims(gl.expand_dims(xe >= 0, 0), 1)
    x8 = gl.load(X.cast(gl.pointer_type(gl.uint8)) + base + offs, mask=ok, other=0)
    xs = gl.load(XS + sbase + gl.expand_dims(xr.to(gl.int64) * sxss, 1) + gl.expand_dims(xb, 0), mask=ok2,
                 other=127)
    dst.store(gl.reshape(_dequant3(x8, xs), [R, D]))


@gluon.jit
def _load_bf16_rows(X, dst, base, sxs, n0, SKV, R: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """Rows [n0, n0 + R) of a bf16 [.., SKV, D] tensor (X at its head) into the shared tile dst [R, D]; rows past SKV
    as zeros (`_load_kv_rows` for the bf16-V recipe)."""
    tc: gl.constexpr = D // 8
    lx: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tc, tc], [num_warps, 1], [1, 0])
    xr = n0 + gl.arange(0, R, layout=gl.SliceLayout(1, lx))
    xd = gl.arange(0, D, layout=gl.SliceLayout(0, lx))
    ok = gl.expand_dims(xr < SKV, 1) & gl.expand_dims(xd >= 0, 0)
    x = gl.load(X + base + gl.expand_dims(xr.to(gl.int64) * sxs, 1) + gl.expand_dims(xd, 0), mask=ok, other=0.0)
    dst.store(x)


@gluon.jit
def _copy_stats(lse_dst, del_dst, lse_h, del_h, cols, ok, sls):
    """Asynchronous copies (cp.async, one group) of the LSE and delta of query rows `cols` of one head into the
    shared [BM] buffers lse_dst / del_dst (zeros where not ok: such columns are masked or never used). Each thread
    copies the columns it reads back (cols' layout), so its own wait_group is all the reader needs."""
    async_copy.async_copy_global_to_shared(lse_dst, lse_h + cols * sls, mask=ok)
    async_copy.async_copy_global_to_shared(del_dst, del_h + cols, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _q_steps(t, start, stop, dk, dv, dsq, lse_c, del_c, kw, vw, qr, qc, dor, doc, ready, empty, lse_h, del_h, sls,
             slh, sdelh, g, GROUP, lo, hi, rows_k, cols0, SQ, SKV, qk_scale, sm_scale, offset, RB, s_zero,
             MASK: gl.constexpr, HAS_RB: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
             a_op: gl.constexpr, DEFER: gl.constexpr, STATS: gl.constexpr, LB=0, HAS_LB: gl.constexpr = False,
             PACKED: gl.constexpr = False, RECIPE: gl.constexpr = 0):
    """`_q_step` for the query blocks m0 in range(start, stop, BM), t counting on -> (t, dk, dv, dsq)."""
    for m0 in range(start, stop, BM):
        dk, dv, dsq = _q_step(t, m0, dk, dv, dsq, lse_c, del_c, kw, vw, qr, qc, dor, doc, ready, empty, lse_h, del_h,
                              sls, slh, sdelh, g, GROUP, lo, hi, rows_k, cols0, SQ, SKV, qk_scale, sm_scale, offset,
                              RB, s_zero, MASK, HAS_RB, BM, D, NS, a_op, DEFER, STATS, LB, HAS_LB, PACKED, RECIPE)
        t += 1
    return t, dk, dv, dsq


@gluon.jit
def _q_step(t, m0, dk, dv, dsq, lse_c, del_c, kw, vw, qr, qc, dor, doc, ready, empty, lse_h, del_h, sls, slh,
            sdelh, g, GROUP, lo, hi, rows_k, cols0, SQ, SKV, qk_scale, sm_scale, offset, RB, s_zero,
            MASK: gl.constexpr, HAS_RB: gl.constexpr, BM: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
            a_op: gl.constexpr, DEFER: gl.constexpr, STATS: gl.constexpr, LB=0, HAS_LB: gl.constexpr = False,
            PACKED: gl.constexpr = False, RECIPE: gl.constexpr = 0):
    """The t-th visited query block (rows [m0, m0 + BM) of head g, at lse_h / del_h) of a consumer warpgroup:
    `_dkdv_block`'s arithmetic on its 64 keys (kw, vw: its K / V rows in shared memory) -> (dk, dv, dsq).
    DEFER (software-pipelined dK): dsq is block t - 1's quantized dS^T, whose dK GEMM is issued here right after
    this block's S^T and dP^T (t = 0: dsq is zeros and adds exact zeros), so it and this block's dV GEMM run under
    the softmax and dS; both are waited for before the step ends (no wgmma in flight across steps), then stage
    (t - 1) % NS is released; this block's dS^T is returned for the next step (`deferred_tail` issues the last one).
    Else every GEMM of the block is issued and waited for here (the dV GEMM runs on under dS, waited for with the
    dK GEMM) and stage t % NS released at the end.
    STATS, where the block's LSE and delta come from (`STATS_LOADS`): 0 global loads, the LSE at the step's start,
    delta after the dV GEMM's issue (lse_c / del_c unused); 4 shared memory, copied one step ahead by this
    warpgroup: lse_c / del_c are its two-slot buffers, slot t % 2 holds this block's (copied a step ago), the next
    block's copies (rows m0 + BM of head g, or rows lo of head g + 1 after head g's last block; none after the last
    head) go to the other slot; 5 shared memory, loaded by the producer with the block's tiles: lse_c / del_c are
    the [NS, 1, 1, BM] rings, stage s holds this block's. PACKED (STATS 5): the producer's LSE / delta past the
    sequence's queries are the next sequence's; delta is read as 0 there (P is masked to 0 and dP^T is 0 on the
    gapped scratch's zero rows, so dS^T = 0 even where that delta is not finite)."""
    s = t % NS
    cols = m0 + cols0  # query rows
    c_ok = cols < SQ
    if STATS == 4:  # lse_c / del_c: this warpgroup's [2, BM] buffers in shared memory, slot t % 2 is block t's
        async_copy.wait_group(0)  # block t's copies (issued a step ago) have landed
        lse_raw = lse_c.index(t % 2).load(cols0.type.layout)
        nm0 = m0 + BM
        wrap = nm0 >= hi
        n_cols = gl.where(wrap, lo, nm0) + cols0
        n_ok = (n_cols < SQ) & ((nm0 < hi) | (g + 1 < GROUP))
        step = wrap.to(gl.int64)
        _copy_stats(lse_c.index((t + 1) % 2), del_c.index((t + 1) % 2), lse_h + step * slh, del_h + step * sdelh,
                    n_cols, n_ok, sls)
    elif STATS == 0:
        lse = _log2_lse(gl.load(lse_h + cols * sls, mask=c_ok, other=float("inf")))
    mbarrier.wait(ready.index(s), (t // NS) & 1)
    if STATS == 5:  # lse_c / del_c: the rings' [NS, 1, 1, BM] LSE / delta tiles the producer loaded with the block's
        lse_raw = lse_c.index(s).reshape([BM]).load(cols0.type.layout)
    q_t = qr.index(s).reshape([BM, D]).permute((1, 0))
    do_t = dor.index(s).reshape([BM, D]).permute((1, 0))
    if DEFER:
        sp = gl.where(t > 0, t + NS - 1, t) % NS  # block t - 1's stage (block 0's at t = 0: finite values)
        s_tok = warpgroup_mma(kw, q_t, gl.zeros_like(s_zero), use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(vw, do_t, gl.zeros_like(s_zero), use_acc=False, is_async=True)
        dk = warpgroup_mma(dsq, qc.index(sp).reshape([BM, D]), dk, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok, ))  # in flight: dP^T(t), dK(t - 1)
    else:
        st, dp_tok = issue_s_dp(kw, q_t, vw, do_t, s_zero)
    if STATS != 0:
        lse = _log2_lse(lse_raw)
    p = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))  # P^T [keys, queries]
    if MASK:
        keep = gl.expand_dims(rows_k < SKV, 1) & gl.expand_dims(c_ok, 0)
        if HAS_RB:
            keep = keep & (gl.expand_dims(rows_k, 1) <= gl.expand_dims(cols, 0) + offset + RB)
        if HAS_LB:
            keep = keep & (gl.expand_dims(rows_k, 1) > gl.expand_dims(cols, 0) + offset - LB)
        p = gl.where(keep, p, 0.0)
    pq = gl.convert_layout(_p_operand(p * P_SCALE_K, RECIPE), a_op)
    dv = warpgroup_mma(pq, doc.index(s).reshape([BM, D]), dv, is_async=True)
    if DEFER:
        dp = warpgroup_mma_wait(num_outstanding=2, deps=(dp_tok, ))  # dK(t - 1) and dV(t) run on under dS
    else:
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, ))  # dV(t) runs on under dS
    if STATS == 0:
        delta = gl.load(del_h + cols, mask=c_ok, other=0.0)
    elif STATS == 4:
        delta = del_c.index(t % 2).load(cols0.type.layout)
    elif STATS == 5:
        delta = del_c.index(s).reshape([BM]).load(cols0.type.layout)
        if PACKED:
            delta = gl.where(c_ok, delta, 0.0)
    ds = p * (dp - gl.expand_dims(delta, 0)) * sm_scale
    ds_a = _ds_operand(ds, BM, RECIPE, a_op)
    if DEFER:
        dk, dv, dsq, pq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, dsq, pq))
        if t > 0:
            release(empty, sp)
        dsq = ds_a
    else:
        dk = warpgroup_mma(ds_a, qc.index(s).reshape([BM, D]), dk, is_async=True)
        dk, dv, pq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, pq))
        release(empty, s)
    return dk, dv, dsq


@gluon.jit
def _consumer(K, KS, V, VS, LSE, DELTA, DK, DV, kb, vb, qr, qc, dor, doc, lse_s, del_s, ready, empty,
              skb, skh, sks, sksb, sksh, skss, svb, svh, svs, svsb, svsh, svss,
              slb, slh, sls, sdelb, sdelh, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
              HKV, GROUP, SQ, SKV, qk_scale, sm_scale, offset, RB, CU_Q, CU_KV, LB,
              HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
              WG: gl.constexpr, DEFER: gl.constexpr, STATS: gl.constexpr, VARLEN: gl.constexpr,
              BOTTOM_RIGHT: gl.constexpr, HAS_LB: gl.constexpr, PACKED: gl.constexpr = False,
              RECIPE: gl.constexpr = 0):
    """Consumer warpgroup WG: key rows [tile * BN + 64 WG, + 64) of the CTA. K, V dequantized into its own
    shared K / V tiles (kb / vb index WG), then the query blocks of every query head of the group (`_q_step`), dK and dV
    accumulated in registers and stored at the end. PACKED: K, V, dK, dV rows from the sequence's first key row,
    the LSE / delta from its first query row (the tensors' batch 0); dK, dV stored for its own keys only."""
    nw: gl.constexpr = gl.num_warps()
    BNW: gl.constexpr = BN // 2
    s_layout: gl.constexpr = _acc_layout(BM, nw)
    a_layout: gl.constexpr = _acc_layout(D, nw)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_a: gl.constexpr = gl.SliceLayout(1, a_layout)
    col_a: gl.constexpr = gl.SliceLayout(0, a_layout)

    tile, b, hk = _kv_tile_of_program(HKV, HAS_RB)
    # VARLEN: from here on SQ is the sequence's queries and len_kv its keys (masks, blocks); SKV stays the
    # tensors' rows (the epilogue writes the padding rows' zeros)
    SQ, len_kv, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)
    bt, q0, kv0, kvb0 = _seq_rows(CU_Q, CU_KV, b, PACKED)
    n_cta = tile * BN
    n0 = n_cta + WG * BNW
    b64 = bt.to(gl.int64)
    hk64 = hk.to(gl.int64)
    kv64 = kv0.to(gl.int64)  # PACKED: the sequence's first key and query rows of the packed tensors (else 0)
    q64 = q0.to(gl.int64)
    kw = kb.index(WG)
    vw = vb.index(WG)
    if PACKED:
        _load_kv_rows(K, KS, kw, b64 * skb + hk64 * skh + kv64 * sks, b64 * sksb + hk64 * sksh + kv64 * skss, sks,
                      skss, n0, len_kv, BNW, D, nw)
        _load_kv_rows(V, VS, vw, b64 * svb + hk64 * svh + kv64 * svs, b64 * svsb + hk64 * svsh + kv64 * svss, svs,
                      svss, n0, len_kv, BNW, D, nw)
    else:
        _load_kv_rows(K, KS, kw, b64 * skb + hk64 * skh, b64 * sksb + hk64 * sksh, sks, skss, n0, len_kv, BNW, D, nw)
        if (RECIPE & V_RAW_BIT) != 0:  # V a bf16 tensor, read as it is
            _load_bf16_rows(V, vw, b64 * svb + hk64 * svh, svs, n0, len_kv, BNW, D, nw)
        else:
            _load_kv_rows(V, VS, vw, b64 * svb + hk64 * svh, b64 * svsb + hk64 * svsh, svs, svss, n0, len_kv, BNW, D,
                          nw)
    fence_async_shared()  # the generic-proxy stores before this warpgroup's wgmma (async proxy) reads
    gl.thread_barrier()

    rows_k = n0 + gl.arange(0, BNW, layout=row_s)
    cols0 = gl.arange(0, BM, layout=col_s)
    dk = gl.zeros([BNW, D], gl.float32, a_layout)
    dv = gl.zeros([BNW, D], gl.float32, a_layout)
    s_zero = gl.zeros([BNW, BM], gl.float32, s_layout)
    dsq = gl.zeros([BNW, BM], gl.bfloat16, a_op)  # DEFER: the previous block's dS^T (none yet: zeros)
    # the CTA's query blocks (both warpgroups and the producer walk the same ones: a block masked for the CTA's
    # 128 keys is masked for each warpgroup's 64, a no-op where it keeps everything)
    lo, mask_hi, full_lo, full_hi, hi = _tile_q_range(n_cta, SQ, len_kv, offset, RB, HAS_RB, BM, BN, VARLEN, LB,
                                                      HAS_LB)
    hq0 = (hk * GROUP).to(gl.int64)
    if STATS == 4:  # shared buffers of the LSE and delta (two slots), the first block's copies issued
        stats_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        lse_c = gl.allocate_shared_memory(gl.float32, [2, BM], stats_layout)
        del_c = gl.allocate_shared_memory(gl.float32, [2, BM], stats_layout)
        lse_0 = LSE + b64 * slb + hq0 * slh
        del_0 = DELTA + b64 * sdelb + hq0 * sdelh
        if PACKED:
            lse_0 += q64 * sls
            del_0 += q64
        _copy_stats(lse_c.index(0), del_c.index(0), lse_0, del_0, lo + cols0, (lo + cols0 < SQ) & (lo < hi), sls)
    elif STATS == 5:  # the producer's rings
        lse_c = lse_s
        del_c = del_s
    else:  # unused: each step loads its own
        lse_c = gl.zeros([BM], gl.float32, col_s)
        del_c = gl.zeros([BM], gl.float32, col_s)
    t = 0
    for g in range(GROUP):
        hq64 = hq0 + g
        lse_h = LSE + b64 * slb + hq64 * slh
        del_h = DELTA + b64 * sdelb + hq64 * sdelh
        if PACKED:
            lse_h += q64 * sls
            del_h += q64
        t, dk, dv, dsq = _q_steps(
            t, lo, mask_hi, dk, dv, dsq, lse_c, del_c, kw, vw, qr, qc, dor, doc, ready, empty, lse_h, del_h, sls,
            slh, sdelh, g, GROUP, lo, hi, rows_k, cols0, SQ, len_kv, qk_scale, sm_scale, offset, RB, s_zero, True,
            HAS_RB, BM, D, NS, a_op, DEFER, STATS, LB, HAS_LB, PACKED, RECIPE)
        t, dk, dv, dsq = _q_steps(
            t, full_lo, full_hi, dk, dv, dsq, lse_c, del_c, kw, vw, qr, qc, dor, doc, ready, empty, lse_h, del_h,
            sls, slh, sdelh, g, GROUP, lo, hi, rows_k, cols0, SQ, len_kv, qk_scale, sm_scale, offset, RB, s_zero,
            False, HAS_RB, BM, D, NS, a_op, DEFER, STATS, LB, HAS_LB, PACKED, RECIPE)
        t, dk, dv, dsq = _q_steps(
            t, gl.maximum(full_hi, mask_hi), hi, dk, dv, dsq, lse_c, del_c, kw, vw, qr, qc, dor, doc, ready, empty,
            lse_h, del_h, sls, slh, sdelh, g, GROUP, lo, hi, rows_k, cols0, SQ, len_kv, qk_scale, sm_scale, offset,
            RB, s_zero, True, HAS_RB, BM, D, NS, a_op, DEFER, STATS, LB, HAS_LB, PACKED, RECIPE)
    if STATS == 4:
        async_copy.wait_group(0)  # the copies issued in the last step (for no block) land before the exit
    if DEFER:
        dk = deferred_tail(t, dk, dsq, qc, empty, BM, D, NS)

    rows = n0 + gl.arange(0, BNW, layout=row_a)
    offs_d = gl.arange(0, D, layout=col_a)
    if PACKED:  # the sequence's own keys (the next rows are the next sequence's), from its first row
        ok = gl.expand_dims(rows < len_kv, 1) & gl.expand_dims(offs_d >= 0, 0)
        r64 = gl.expand_dims(rows.to(gl.int64) + kv64, 1)
    else:  # the tensors' rows (a padded sequence's padding rows get zeros)
        ok = gl.expand_dims(rows < SKV, 1) & gl.expand_dims(offs_d >= 0, 0)
        r64 = gl.expand_dims(rows.to(gl.int64), 1)
    gl.store(DK + b64 * sdkb + hk64 * sdkh + r64 * sdks + gl.expand_dims(offs_d, 0),
             dk.to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + b64 * sdvb + hk64 * sdvh + r64 * sdvs + gl.expand_dims(offs_d, 0),
             (dv * P_DESCALE_K).to(DV.dtype.element_ty), mask=ok)


@gluon.jit
def _gluon_dkdv_kernel(
        qr_desc, qc_desc, dor_desc, doc_desc, lse_desc, del_desc, K, KS, V, VS, LSE, DELTA, DK, DV,
        skb, skh, sks, sksb, sksh, skss, svb, svh, svs, svsb, svsh, svss,
        slb, slh, sls, sdelb, sdelh, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
        HKV, GROUP, SQ, SKV, qk_scale, sm_scale, offset, RB, CU_Q, CU_KV, LB,
        HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DEFER: gl.constexpr, STATS: gl.constexpr,
        VARLEN: gl.constexpr = False, BOTTOM_RIGHT: gl.constexpr = False, HAS_LB: gl.constexpr = False,
        PACKED: gl.constexpr = False, GAP: gl.constexpr = 0, RECIPE: gl.constexpr = 0):
    """Grid (cdiv(SKV, BN), B * HKV), 4 warps per partition. qr/qc/dor/doc_desc: TMA descriptors of the bf16
    scratch [B, Hc, SQ, D] (Q row-wise, Q column-wise, dO row-wise, dO column-wise dequantizations; block
    [1, 1, BM, D]); K, V [B, HKV, SKV, D] e4m3 row-wise with scales KS, VS [B, HKV, SKV, D/32] u8; LSE
    [B, Hc, SQ, 1] fp32 (natural log), DELTA [B, Hc, SQ] fp32; DK, DV [B, HKV, SKV, D]. HAS_RB: causal-style
    band (keys kept where key <= query + offset + RB). PACKED (a packed batch, VARLEN too): grid (tiles of the
    longest sequence's keys, sequences * HKV); K, V, DK, DV [1, HKV, TKV, D], LSE [1, Hc, TQ, 1], DELTA [1, Hc, TQ]
    packed, the scratch gapped ([1, Hc, TQ + GAP * B, D]: `triton_bwd_prep.bwd_prep`'s gap). RECIPE: the recipe's
    backward switches (`recipe_bits`); with its V_RAW bit V is a bf16 [B, HKV, SKV, D] tensor (VS unread; not built
    with PACKED)."""
    # K and V as two [BN / 2, D] tiles each, one per consumer warpgroup (indexed like ring stages, not row-sliced)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN // 2, D], gl.bfloat16)
    kb = gl.allocate_shared_memory(gl.bfloat16, [2, BN // 2, D], kv_layout)
    vb = gl.allocate_shared_memory(gl.bfloat16, [2, BN // 2, D], kv_layout)
    qr = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BM, D], qr_desc.layout)
    qc = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BM, D], qc_desc.layout)
    dor = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BM, D], dor_desc.layout)
    doc = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BM, D], doc_desc.layout)
    if STATS == 5:  # the LSE / delta of each stage's block, loaded by the producer with the tiles
        lse_s = gl.allocate_shared_memory(gl.float32, [NS, 1, 1, BM], lse_desc.layout)
        del_s = gl.allocate_shared_memory(gl.float32, [NS, 1, 1, BM], del_desc.layout)
    else:
        lse_s = qr
        del_s = qr
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (K, KS, V, VS, LSE, DELTA, DK, DV, kb, vb, qr, qc, dor, doc, lse_s, del_s, ready, empty,
                     skb, skh, sks, sksb, sksh, skss, svb, svh, svs, svsb, svsh, svss,
                     slb, slh, sls, sdelb, sdelh, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                     HKV, GROUP, SQ, SKV, qk_scale, sm_scale, offset, RB, CU_Q, CU_KV, LB, HAS_RB, BM, BN, D,
                     NS, WG0, DEFER, STATS, VARLEN, BOTTOM_RIGHT, HAS_LB, PACKED, RECIPE)),
        (_consumer, (K, KS, V, VS, LSE, DELTA, DK, DV, kb, vb, qr, qc, dor, doc, lse_s, del_s, ready, empty,
                     skb, skh, sks, sksb, sksh, skss, svb, svh, svs, svsb, svsh, svss,
                     slb, slh, sls, sdelb, sdelh, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                     HKV, GROUP, SQ, SKV, qk_scale, sm_scale, offset, RB, CU_Q, CU_KV, LB, HAS_RB, BM, BN, D,
                     NS, WG1, DEFER, STATS, VARLEN, BOTTOM_RIGHT, HAS_LB, PACKED, RECIPE)),
        (_producer, (qr_desc, qc_desc, dor_desc, doc_desc, lse_desc, del_desc, qr, qc, dor, doc, lse_s, del_s, ready,
                     empty, HKV, GROUP, SQ, SKV, offset, RB, CU_Q, CU_KV, LB, HAS_RB, BM, BN, D, NS, STATS, VARLEN,
                     BOTTOM_RIGHT, HAS_LB, PACKED, GAP)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])

    for i in gl.static_range(NS):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
