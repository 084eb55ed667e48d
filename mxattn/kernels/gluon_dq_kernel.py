"""Device code of the Hopper (sm_90a) Gluon dQ kernel of the MXFP8 attention backward: the warp-specialised kernel
`_gluon_dq_kernel`, its producer and consumer partitions (`gluon_attention_dq` checks the operands and launches it;
`gluon_bwd_common` holds what it shares with the dK/dV kernel).

Inputs (mode "pre"): every operand is bf16 scratch, the exact dequantization of its MXFP8 copy: Q and dO
row-wise from `bwd_prep` ([B, Hc, SQ, D], the chunk's query heads), K row-wise, K column-wise and V row-wise from
`kv_prep` ([B, Hkv_c, SKV, D], the chunk's KV heads).

Numerics: per element the operations of `triton_attention_bwd._dq_block` (PRE, default recipe), in the same
order: S = Q K^T (bf16 wgmma, fp32), P = exp2(S * qk_scale - lse * LOG2E) (rows without keys: lse -inf read as
+inf, so P = 0), masked to 0 outside the band / past SKV; dP = dO V^T; dS = P * (dP - delta) * sm_scale; dS
quantize-dequantized along the keys in blocks of 32 (qdq_rows on the [queries, keys] tile:
`gluon_bwd_common._qdq_cols32`); dQ += dS_qdq K_col; dQ stored in bf16. The query tile is the Triton kernel's
(BLOCK_M = 128 rows, the same grid and program order); the KV blocks have BLOCK_N[D] keys (the Triton kernel's
BN differs) but the qdq blocks are the same (32-aligned) and both dQ GEMM chains add k16 slices of keys in
ascending order into the same fp32 accumulator, and a block masked here but not there (or the reverse) keeps
every pair: dQ should agree bit for bit up to the tensor cores' internal sum order (tested on the GPU in
tests/triton/test_gluon_dq_gpu.py: bit-equal in >= 99%, within one bf16 ulp).

Structure (FlashAttention-3's dQ side, Q-stationary): a CTA owns BLOCK_M = 128 query rows of one (batch, query
head); three partitions of one warpgroup each (`gl.warp_specialize`, setmaxnreg CONSUMER_REGS / PRODUCER_REGS,
the default partition what is left):

* the producer warpgroup: TMA-loads the CTA's Q and dO rows once (a [64, D] tile each per consumer warpgroup
  whose rows start before SQ, one expect-tx arrival on "q_ready"), then for t = 0, 1, ... over the KV blocks
  the CTA visits (block t: `_kv_blocks`, from 0) waits "empty" of stage t % NS and TMA-loads the three bf16
  tiles K_r, V_r, K_c [BLOCK_N, D] (4-D descriptors: rows past SQ / SKV read as zeros) with one expect-tx
  arrival on "ready".
* two consumer warpgroups (the default partition and a worker), 64 query rows each: LSE and delta of their
  rows in registers, wait "q_ready", then per KV block: wait "ready", issue S and dP (async wgmma, A = their Q /
  dO rows from shared memory, B = K_r^T / V_r^T), P, the mask (blocks past `_kv_full_blocks` only), dS and its
  qdq, the dQ GEMM (A = dS_qdq from registers, B = K_c), wait, release the stage ("empty", one arrival per
  warpgroup). dQ stays in registers (D / 2 fp32 registers per thread) and is stored at the end.

The ring protocol is the dK/dV kernel's (one extra one-shot barrier for Q / dO); simulated with the KV block
walk in tests/triton/test_gluon_dq_protocol.py.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gluon_bwd_common import (WG0, WG1, _acc_layout, _ds_operand, _log2_lse, deferred_tail, gemm_release, issue_s_dp,
                               release)
from .gluon_common import _seq_lengths, _seq_rows, _tile_of_program, _visited_blocks


# --------------------------------------------------------------------------- partitions
@gluon.jit
def _kv_full_blocks(m0, SKV, offset, RB, HAS_RB: gl.constexpr, BN: gl.constexpr):
    """KV blocks [0, n_full) that every query row [m0, m0 + BM) keeps whole (triton_common.band_block_range's
    full_hi / BN for a query tile without a left bound); the CTA's blocks from n_full on need the mask."""
    n_full = SKV // BN
    if HAS_RB:
        n_full = gl.minimum(n_full, gl.maximum(m0 + offset + RB + 1, 0) // BN)
    return n_full


@gluon.jit
def _producer(q_desc, do_desc, kr_desc, vr_desc, kc_desc, q_s, do_s, kr, vr, kc, q_ready, ready, empty,
              HQ, GROUP, SQ, SKV, offset, RB, CU_Q, CU_KV, LB, HAS_RB: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr, VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
              HAS_LB: gl.constexpr, PACKED: gl.constexpr = False, GAP: gl.constexpr = 0):
    """The producer warpgroup: the CTA's Q and dO rows once, then stage t % NS gets KV block t, once both
    consumer warpgroups released the stage. PACKED: every tile from the sequence's gapped scratch rows (query
    rows from cu_q[b] + GAP * b, key rows from cu_kv[b] + GAP * b); a tile past the sequence's queries reads the
    zero rows after them (it visits no KV block and stores nothing)."""
    tile, b, hq = _tile_of_program(HQ, HAS_RB)
    m0 = tile * BM
    hk = hq // GROUP
    BMW: gl.constexpr = BM // 2
    if PACKED:  # both halves, from rows inside the sequence or its GAP (>= BM) zero rows: never out of bounds
        len_q, len_kv, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)
        bt, q0, kv0, kvb0 = _seq_rows(CU_Q, CU_KV, b, PACKED)
        qs = q0 + GAP * b + gl.minimum(m0, len_q)
        ks0 = kv0 + GAP * b
        mbarrier.expect(q_ready, 4 * BMW * D * 2)
        tma.async_copy_global_to_shared(q_desc, [bt, hq, qs, 0], q_ready, q_s.index(0))
        tma.async_copy_global_to_shared(do_desc, [bt, hq, qs, 0], q_ready, do_s.index(0))
        tma.async_copy_global_to_shared(q_desc, [bt, hq, qs + BMW, 0], q_ready, q_s.index(1))
        tma.async_copy_global_to_shared(do_desc, [bt, hq, qs + BMW, 0], q_ready, do_s.index(1))
    else:
        # Q and dO, a bf16 [BMW, D] tile each per consumer warpgroup; none for the second one where its rows all
        # lie past SQ (no TMA box wholly out of bounds; that warpgroup's rows are never stored)
        if m0 + BMW < SQ:
            mbarrier.expect(q_ready, 4 * BMW * D * 2)
        else:
            mbarrier.expect(q_ready, 2 * BMW * D * 2)
        tma.async_copy_global_to_shared(q_desc, [b, hq, m0, 0], q_ready, q_s.index(0))
        tma.async_copy_global_to_shared(do_desc, [b, hq, m0, 0], q_ready, do_s.index(0))
        if m0 + BMW < SQ:
            tma.async_copy_global_to_shared(q_desc, [b, hq, m0 + BMW, 0], q_ready, q_s.index(1))
            tma.async_copy_global_to_shared(do_desc, [b, hq, m0 + BMW, 0], q_ready, do_s.index(1))
        len_q, len_kv, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)
    lo, n_blk = _visited_blocks(m0, len_q, len_kv, offset, LB, RB, HAS_LB, HAS_RB, BM, BN, VARLEN)
    for t in range(n_blk):  # the t-th visited block, block lo + t (lo 0 without a window)
        s = t % NS
        mbarrier.wait(empty.index(s), ((t // NS) & 1) ^ 1)  # passes at once on a fresh barrier (first round)
        bar = ready.index(s)
        mbarrier.expect(bar, 3 * BN * D * 2)  # three bf16 tiles
        if PACKED:
            tma.async_copy_global_to_shared(kr_desc, [bt, hk, ks0 + (lo + t) * BN, 0], bar, kr.index(s))
            tma.async_copy_global_to_shared(vr_desc, [bt, hk, ks0 + (lo + t) * BN, 0], bar, vr.index(s))
            tma.async_copy_global_to_shared(kc_desc, [bt, hk, ks0 + (lo + t) * BN, 0], bar, kc.index(s))
        else:
            tma.async_copy_global_to_shared(kr_desc, [b, hk, (lo + t) * BN, 0], bar, kr.index(s))
            tma.async_copy_global_to_shared(vr_desc, [b, hk, (lo + t) * BN, 0], bar, vr.index(s))
            tma.async_copy_global_to_shared(kc_desc, [b, hk, (lo + t) * BN, 0], bar, kc.index(s))


@gluon.jit
def _kv_step(t, dq, dsq, qw, dow, kr, vr, kc, ready, empty, lse, delta, rows, cols0, SKV, qk_scale, sm_scale,
             offset, RB, s_zero, MASK: gl.constexpr, HAS_RB: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
             NS: gl.constexpr, a_op: gl.constexpr, DEFER: gl.constexpr, lo=0, LB=0, HAS_LB: gl.constexpr = False,
             RECIPE: gl.constexpr = 0):
    """The t-th visited KV block (block lo + t, keys [(lo + t) * BN, + BN); lo the window's first block, 0
    without one; t counts ring stages) of a consumer warpgroup: `_dq_block`'s arithmetic on its 64 query rows
    (qw, dow: its Q / dO rows in shared memory) -> (dq, dsq). HAS_LB: keys kept where key > query + offset - LB.
    DEFER (software-pipelined dQ, as the dK/dV kernel's dK): dsq is block t - 1's quantized dS, whose dQ GEMM is
    issued right after this block's S and dP (t = 0: zeros, exact zeros added) and runs under the softmax and dS;
    waited for before the step ends, then stage (t - 1) % NS released; this block's dS is returned
    (`deferred_tail` issues the last one). Else the block's dQ GEMM is issued and waited for here and stage
    t % NS released at the end."""
    s = t % NS
    mbarrier.wait(ready.index(s), (t // NS) & 1)
    k_t = kr.index(s).reshape([BN, D]).permute((1, 0))
    v_t = vr.index(s).reshape([BN, D]).permute((1, 0))
    if DEFER:
        sp = gl.where(t > 0, t + NS - 1, t) % NS  # block t - 1's stage (block 0's at t = 0: finite values)
        s_tok = warpgroup_mma(qw, k_t, gl.zeros_like(s_zero), use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(dow, v_t, gl.zeros_like(s_zero), use_acc=False, is_async=True)
        dq = warpgroup_mma(dsq, kc.index(sp).reshape([BN, D]), dq, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=2, deps=(s_tok, ))  # in flight: dP(t), dQ(t - 1)
    else:
        st, dp_tok = issue_s_dp(qw, k_t, dow, v_t, s_zero)
    p = gl.exp2(st * qk_scale - gl.expand_dims(lse, 1))  # P [queries, keys]
    if MASK:
        cols = (lo + t) * BN + cols0
        keep = gl.expand_dims(cols < SKV, 0) & gl.expand_dims(rows >= 0, 1)
        if HAS_RB:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + offset + RB)
        if HAS_LB:
            keep = keep & (gl.expand_dims(cols, 0) > gl.expand_dims(rows, 1) + offset - LB)
        p = gl.where(keep, p, 0.0)
    if DEFER:
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, ))  # dQ(t - 1) runs on under dS
    else:
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
    ds = p * (dp - gl.expand_dims(delta, 1)) * sm_scale
    ds_a = _ds_operand(ds, BN, RECIPE, a_op)  # blocks of 32 along the keys (or bf16: RECIPE)
    if DEFER:
        dq, dsq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dsq))
        if t > 0:
            release(empty, sp)
        dsq = ds_a
    else:
        dq = gemm_release(dq, ds_a, kc.index(s).reshape([BN, D]), empty, s)
    return dq, dsq


@gluon.jit
def _consumer(LSE, DELTA, DQ, q_s, do_s, kr, vr, kc, q_ready, ready, empty,
              slb, slh, sls, sdelb, sdelh, sdqb, sdqh, sdqs, HQ, SQ, SKV, qk_scale, sm_scale, offset, RB, CU_Q,
              CU_KV, LB, HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
              WG: gl.constexpr, DEFER: gl.constexpr, VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
              HAS_LB: gl.constexpr, PACKED: gl.constexpr = False, RECIPE: gl.constexpr = 0):
    """Consumer warpgroup WG: query rows [tile * BM + 64 WG, + 64) of the CTA's head; the CTA's KV blocks
    (`_kv_step`, unmasked ones first), dQ accumulated in registers and stored at the end. PACKED: the LSE, delta
    and dQ rows from the sequence's first query row (the tensors' batch 0), dQ stored for its own rows only."""
    nw: gl.constexpr = gl.num_warps()
    BMW: gl.constexpr = BM // 2
    s_layout: gl.constexpr = _acc_layout(BN, nw)
    a_layout: gl.constexpr = _acc_layout(D, nw)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)

    tile, b, hq = _tile_of_program(HQ, HAS_RB)
    # VARLEN: len_q / SKV the sequence's queries / keys (LSE, masks, blocks); SQ stays the tensors' rows (stores)
    len_q, SKV, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)
    m_cta = tile * BM
    hq64 = hq.to(gl.int64)
    rows = m_cta + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_layout))
    r_ok = rows < len_q  # padding rows: LSE +inf, so P = dS = 0 and their dQ rows 0
    if PACKED:
        bt, q0, kv0, kvb0 = _seq_rows(CU_Q, CU_KV, b, PACKED)
        b64 = bt.to(gl.int64)
        q64 = q0.to(gl.int64)
        lse = _log2_lse(gl.load(LSE + b64 * slb + hq64 * slh + (q64 + rows) * sls, mask=r_ok, other=float("inf")))
        delta = gl.load(DELTA + b64 * sdelb + hq64 * sdelh + q64 + rows, mask=r_ok, other=0.0)
    else:
        b64 = b.to(gl.int64)
        lse = _log2_lse(gl.load(LSE + b64 * slb + hq64 * slh + rows * sls, mask=r_ok, other=float("inf")))
        delta = gl.load(DELTA + b64 * sdelb + hq64 * sdelh + rows, mask=r_ok, other=0.0)
    cols0 = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    dq = gl.zeros([BMW, D], gl.float32, a_layout)
    s_zero = gl.zeros([BMW, BN], gl.float32, s_layout)
    # the CTA's KV blocks (both warpgroups and the producer walk the same ones: a block kept whole for the CTA's
    # 128 rows is for each warpgroup's 64, and the mask is a no-op where it keeps everything)
    lo, n_blk = _visited_blocks(m_cta, len_q, SKV, offset, LB, RB, HAS_LB, HAS_RB, BM, BN, VARLEN)
    n_full = _kv_full_blocks(m_cta, SKV, offset, RB, HAS_RB, BN)  # (a block index, from 0)
    if VARLEN:  # (a tile past the sequence's queries visits no block)
        n_full = gl.minimum(n_full, n_blk)
    j_lb = 0
    if HAS_LB:  # visited blocks from here on: [0, j_lb) cut by the window's left edge for some row, masked;
        # [j_lb, n_full) kept whole; [max(n_full, j_lb), n_blk) masked (`gluon_fwd_kernel._consumer`'s walk)
        n_full = gl.minimum(gl.maximum(n_full - lo, 0), n_blk)
        j_lb = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(m_cta + BM + offset - LB, 0), BN) - lo, n_blk), 0)
    qw = q_s.index(WG).reshape([BMW, D])
    dow = do_s.index(WG).reshape([BMW, D])
    mbarrier.wait(q_ready, 0)
    dsq = gl.zeros([BMW, BN], gl.bfloat16, a_op)  # DEFER: the previous block's dS (none yet: zeros)
    if HAS_LB:
        for t in range(0, j_lb):
            dq, dsq = _kv_step(t, dq, dsq, qw, dow, kr, vr, kc, ready, empty, lse, delta, rows, cols0, SKV,
                               qk_scale, sm_scale, offset, RB, s_zero, True, HAS_RB, BN, D, NS, a_op, DEFER, lo, LB,
                               HAS_LB, RECIPE)
        n_full = gl.maximum(n_full, j_lb)
    for t in range(j_lb, n_full):
        dq, dsq = _kv_step(t, dq, dsq, qw, dow, kr, vr, kc, ready, empty, lse, delta, rows, cols0, SKV, qk_scale,
                           sm_scale, offset, RB, s_zero, False, HAS_RB, BN, D, NS, a_op, DEFER, lo, LB, HAS_LB,
                           RECIPE)
    for t in range(n_full, n_blk):
        dq, dsq = _kv_step(t, dq, dsq, qw, dow, kr, vr, kc, ready, empty, lse, delta, rows, cols0, SKV, qk_scale,
                           sm_scale, offset, RB, s_zero, True, HAS_RB, BN, D, NS, a_op, DEFER, lo, LB, HAS_LB,
                           RECIPE)
    if DEFER:
        dq = deferred_tail(n_blk, dq, dsq, kc, empty, BN, D, NS)

    rows_o = m_cta + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, a_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, a_layout))
    if PACKED:  # the sequence's own rows (the next rows are the next sequence's)
        ok = gl.expand_dims(rows_o < len_q, 1) & gl.expand_dims(offs_d >= 0, 0)
        gl.store(DQ + b64 * sdqb + hq64 * sdqh + gl.expand_dims((rows_o.to(gl.int64) + q64) * sdqs, 1)
                 + gl.expand_dims(offs_d, 0), dq.to(DQ.dtype.element_ty), mask=ok)
    else:
        ok = gl.expand_dims(rows_o < SQ, 1) & gl.expand_dims(offs_d >= 0, 0)
        gl.store(DQ + b64 * sdqb + hq64 * sdqh + gl.expand_dims(rows_o.to(gl.int64) * sdqs, 1)
                 + gl.expand_dims(offs_d, 0), dq.to(DQ.dtype.element_ty), mask=ok)


@gluon.jit
def _gluon_dq_kernel(
        q_desc, do_desc, kr_desc, vr_desc, kc_desc, LSE, DELTA, DQ,
        slb, slh, sls, sdelb, sdelh, sdqb, sdqh, sdqs,
        HQ, GROUP, SQ, SKV, qk_scale, sm_scale, offset, RB, CU_Q, CU_KV, LB,
        HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DEFER: gl.constexpr,
        VARLEN: gl.constexpr = False, BOTTOM_RIGHT: gl.constexpr = False, HAS_LB: gl.constexpr = False,
        PACKED: gl.constexpr = False, GAP: gl.constexpr = 0, RECIPE: gl.constexpr = 0):
    """Grid (cdiv(SQ, BM), B * HQ), 4 warps per partition. q_desc, do_desc: TMA descriptors of the bf16 scratch
    [B, HQ, SQ, D] (Q and dO row-wise; block [1, 1, BM / 2, D]); kr_desc, vr_desc, kc_desc: of the bf16 scratch
    [B, HKV, SKV, D] (K row-wise, V row-wise, K column-wise; block [1, 1, BN, D]); LSE [B, HQ, SQ, 1] fp32
    (natural log), DELTA [B, HQ, SQ] fp32; DQ [B, HQ, SQ, D] (unit stride along D). HAS_RB: causal-style band
    (keys kept where key <= query + offset + RB). PACKED (a packed batch, VARLEN too): grid (tiles of the longest
    sequence's queries, sequences * HQ); LSE [1, HQ, TQ, 1], DELTA [1, HQ, TQ], DQ [1, HQ, TQ, D] packed, the
    scratch gapped (query side [1, HQ, TQ + GAP * B, D], key side [1, HKV, TKV + GAP * B, D]: `bwd_prep` /
    `kv_prep` with gap). RECIPE: the recipe's backward switches (`gluon_bwd_common.recipe_bits`: dS rounded to
    bf16, or its blocks' scale rule; a bf16 V arrives as the vr scratch)."""
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2, 1, 1, BM // 2, D], q_desc.layout)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [2, 1, 1, BM // 2, D], do_desc.layout)
    kr = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BN, D], kr_desc.layout)
    vr = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BN, D], vr_desc.layout)
    kc = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BN, D], kc_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (LSE, DELTA, DQ, q_s, do_s, kr, vr, kc, q_ready, ready, empty,
                     slb, slh, sls, sdelb, sdelh, sdqb, sdqh, sdqs, HQ, SQ, SKV, qk_scale, sm_scale, offset, RB,
                     CU_Q, CU_KV, LB, HAS_RB, BM, BN, D, NS, WG0, DEFER, VARLEN, BOTTOM_RIGHT, HAS_LB, PACKED,
                     RECIPE)),
        (_consumer, (LSE, DELTA, DQ, q_s, do_s, kr, vr, kc, q_ready, ready, empty,
                     slb, slh, sls, sdelb, sdelh, sdqb, sdqh, sdqs, HQ, SQ, SKV, qk_scale, sm_scale, offset, RB,
                     CU_Q, CU_KV, LB, HAS_RB, BM, BN, D, NS, WG1, DEFER, VARLEN, BOTTOM_RIGHT, HAS_LB, PACKED,
                     RECIPE)),
        (_producer, (q_desc, do_desc, kr_desc, vr_desc, kc_desc, q_s, do_s, kr, vr, kc, q_ready, ready, empty,
                     HQ, GROUP, SQ, SKV, offset, RB, CU_Q, CU_KV, LB, HAS_RB, BM, BN, D, NS, VARLEN, BOTTOM_RIGHT,
                     HAS_LB, PACKED, GAP)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(q_ready)
    for i in gl.static_range(NS):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
