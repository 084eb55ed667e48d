"""Device code of the Hopper (sm_90a) Gluon MXFP8 attention forward: the warp-specialised kernel
`_gluon_attn_fwd_kernel`, its producer and consumer partitions and their helpers (`gluon_attention_fwd` checks the
operands, picks the schedule and launches it).

Operands: those of the Triton forward's FP8 data path (`triton_attention_fwd.attention_fwd` with k_scale given): Q
and K row-wise E4M3 with compact E8M0 scales, V column-wise seq-major (`SeqMajorColumns`); the kernel computes the
same numbers. KV_BF16 (k_scale None) reads those of its bf16-scratch path instead: Q as before, K and V as the exact
bf16 dequantizations the quantizer writes, TMA'd straight into the bf16 ring by `_producer_bf16` (no FP8 ring, no
dequantization on chip), the consumers unchanged:

* every operand tile is dequantized exactly to BF16 (`_dequant_chunk`: the integer E4M3 -> BF16 expansion and the
  two BF16 power-of-two factors of `triton_common.dequant_rows`), never written to HBM in bf16;
* S = Q K^T on the BF16 tensor cores (wgmma, fp32 accumulation), the online softmax in base 2 over 128-wide KV
  blocks in ascending order, with `softmax_block`'s arithmetic (running max, alpha = exp2(m_old - m_new),
  P * 256 = exp2(s * scale - (m - 8)), sums of the unrounded P);
* P * 256 rounded to E4M3 (`round_p_to_bf16`'s conversion sequence) and O += P V on the tensor cores (A from
  registers), the accumulator rescaled by alpha first; O = acc / l and stats = (m + log2 l - 8) ln 2.

Structure (FlashAttention-3's): a CTA owns BLOCK_M = 128 query rows of one (batch, query head); three partitions
of one warpgroup (4 warps) each (`gl.warp_specialize`, 384 threads, setmaxnreg 240 / 232 / 32):

* two consumer warpgroups (the default partition and a worker), 64 rows each: Q's rows dequantized once into
  registers (the wgmma A operand); per KV block j: wait for the block's bf16 K and V tiles ("ready"), issue
  S_j = Q K_j^T and O += P_{j-1} V_{j-1} (async wgmma, P from registers), take S_j, run the softmax of block j
  under the P V GEMM, then release block j - 1's stage ("empty", one arrival per warpgroup) and rescale O by
  alpha_j. With PINGPONG the two warpgroups alternate their GEMM issues (mbarrier "turns"), so one's softmax runs
  under the other's GEMMs. Whole blocks run a loop without mask code, the Skv tail and the causal diagonal a
  masked one (with a window, also the blocks cut by its left edge, before them). A window moves the first block
  visited (`gluon_common._kv_block_range`, shared with the producer: [lo, hi) of
  triton_common.band_block_range); the rings and turns count visited blocks. With a sink the softmax starts from
  it (max = sink, sum = 1). Epilogue in registers (a row that met no key: O = 0, stats = -inf or, with a sink, the
  sink, as in the Triton kernel).
* the producer warpgroup (few registers): TMA loads (4-D descriptors, any bhsd/bshd strides) of the FP8 K tile
  [BN, D] and V tile [D, BN] (V is seq-major, so the tile is V^T with keys contiguous) into a ring of NF stages
  (mbarrier with expected bytes); the E8M0 scales of the next block prefetched into registers, then shared
  memory; both tiles dequantized in 32-row chunks into a ring of NS bf16 stages in NVMMA-swizzled shared memory
  (the wgmma B operands, K^T and V as permuted views); async-proxy fence, partition barrier, "ready".

The protocol (rings, releases, turns) is simulated under random interleavings in
tests/triton/test_gluon_fwd_protocol.py; the bf16 ring needs NS >= 2 (a consumer holds block j - 1's V stage while
it reads block j's K).

Numerics: the same operations in the same order as the Triton kernel per element, with the same wgmma shapes
(m64n128k16 for S, n = D for P V, each row inside one warp); any difference left is in the last bit of an FP32
sum, which bounds the difference of O to about one bf16 ulp (tests/triton/test_gluon_fwd_gpu.py). At D64 the
Triton forward's query tile has 64 rows, a warpgroup's, while both warpgroups here visit the blocks of the CTA's
128 rows: a block only the other warpgroup meets is masked whole for this one's rows, a no-op on finite numbers
(alpha = 1 and P = 0 once a row has a finite max, else the state stays 0; with the sink -inf the sum of a row
without keys becomes 0 instead of 1, giving the same O = 0 and stats = -inf).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.runtime.jit import constexpr_function

from ..runtime.recipe_flags import P_MODE_BF16, P_MODE_LAZY16
from .gluon_common import (_chunk_layouts, _dequant3, _round_p_to_bf16, _seq_lengths, _seq_rows, _tile_of_program,
                           _visited_blocks)
from .triton_common import LAZY_THRESHOLD

LOG2E = 1.4426950408889634
#: LOG2E for the kernel (the sink logits' conversion to log2 units, triton_common.softmax_start's)
LOG2E_K = gl.constexpr(LOG2E)
LN2 = gl.constexpr(0.6931471805599453)
#: P_MODE values (recipe_flags') and the lazy16 max's threshold (triton_common's) as the kernel's constexprs
P_LAZY16_K = gl.constexpr(P_MODE_LAZY16)
P_BF16_K = gl.constexpr(P_MODE_BF16)
LAZY_THRESHOLD_K = gl.constexpr(LAZY_THRESHOLD.value)
#: the consumer warpgroups' indices (rows [64 WG, 64 WG + 64) of the CTA's tile)
WG0 = gl.constexpr(0)
WG1 = gl.constexpr(1)


# --------------------------------------------------------------------------- operand loads
@gluon.jit
def _dequant_chunk(src, dst, sc, r0, CH: gl.constexpr, C: gl.constexpr, num_warps: gl.constexpr, ncol=0,
                   MASK_COLS: gl.constexpr = False):
    """Rows [r0, r0 + CH) of the FP8 tile `src` (shared, [R, C], E8M0 scales along C in blocks of 32: `sc`, shared
    [R, C // 32] u8) dequantized into the same rows of the bf16 tile `dst` (shared, NVMMA). MASK_COLS: columns from
    ncol on are written as zeros (a packed batch's tail block: the next sequence's keys)."""
    l2: gl.constexpr = _chunk_layouts(C, num_warps)[0]
    l3: gl.constexpr = _chunk_layouts(C, num_warps)[1]
    x = src.slice(r0, CH, dim=0).load(l2)
    if MASK_COLS:  # the E4M3 bits of zero, so NaN or Inf codes there dequantize to 0 too
        cols = gl.arange(0, C, layout=gl.SliceLayout(0, l2))
        x = gl.where(gl.expand_dims(cols < ncol, 0), x, gl.zeros_like(x))
    x3 = gl.convert_layout(gl.reshape(x.to(gl.uint8, bitcast=True), [CH, C // 32, 32]), l3)
    s = sc.slice(r0, CH, dim=0).load(gl.SliceLayout(2, l3))
    y = gl.reshape(_dequant3(x3, s), [CH, C])
    dst.slice(r0, CH, dim=0).store(y)


@constexpr_function
def _scale_layout(R, C, warps):
    """Blocked layout of an [R, C] u8 scale tile read from global memory by `warps` warps (C contiguous)."""
    tc = min(C, 32)
    return gl.BlockedLayout([1, 1], [32 // tc, tc], [warps, 1], [1, 0])


@gluon.jit
def _load_scales(KS, VS, ks_base, vs_base, skss, svss, n0, SKV, BN: gl.constexpr, D: gl.constexpr,
                 num_warps: gl.constexpr):
    """E8M0 scales of KV block n0 from global memory: K's [BN, D/32] (rows past SKV read as 127) and V's
    [BN/32, D] (blocks starting past SKV read as 127), in blocked layouts (stored to shared memory later)."""
    lk: gl.constexpr = _scale_layout(BN, D // 32, num_warps)
    lv: gl.constexpr = _scale_layout(BN // 32, D, num_warps)
    kr = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, lk))
    kc = gl.arange(0, D // 32, layout=gl.SliceLayout(0, lk))
    k_ok = gl.expand_dims(kr < SKV, 1) & gl.expand_dims(kc >= 0, 0)
    ks = gl.load(ks_base + gl.expand_dims(kr * skss, 1) + gl.expand_dims(kc, 0), mask=k_ok, other=127)
    vr = n0 // 32 + gl.arange(0, BN // 32, layout=gl.SliceLayout(1, lv))
    vc = gl.arange(0, D, layout=gl.SliceLayout(0, lv))
    v_ok = gl.expand_dims(vr * 32 < SKV, 1) & gl.expand_dims(vc >= 0, 0)
    vs = gl.load(vs_base + gl.expand_dims(vr * svss, 1) + gl.expand_dims(vc, 0), mask=v_ok, other=127)
    return ks, vs


@constexpr_function
def _tail_layout(D, warps):
    """Blocked layout of a [rows, D] bf16 tile loaded from global memory by `warps` warps (16-byte vectors)."""
    return gl.BlockedLayout([1, 8], [256 // D, D // 8], [warps, 1], [1, 0])


@gluon.jit
def _load_tail_rows(V, dst, b64, hk64, svb, svh, svs, row0, n0, len_kv, BN: gl.constexpr, D: gl.constexpr,
                    num_warps: gl.constexpr):
    """Rows [n0, n0 + BN) of a sequence's bf16 V [.., rows, D] (its first row row0) into the bf16 tile `dst`
    (shared, NVMMA, [BN, D]) by ordinary loads, rows from len_kv on as zeros: a packed batch's tail block, whose
    TMA box would bring the next sequence's rows (a NaN there times P = 0 would reach this sequence's O)."""
    RCH: gl.constexpr = 16
    lt: gl.constexpr = _tail_layout(D, num_warps)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, lt))
    for c in gl.static_range(BN // RCH):
        r = n0 + c * RCH + gl.arange(0, RCH, layout=gl.SliceLayout(1, lt))
        ptrs = V + b64 * svb + hk64 * svh + gl.expand_dims((row0 + r).to(gl.int64) * svs, 1) + gl.expand_dims(cols, 0)
        x = gl.load(ptrs, mask=gl.expand_dims(r < len_kv, 1) & gl.expand_dims(cols >= 0, 0), other=0.0)
        dst.slice(c * RCH, RCH, dim=0).store(x)


# --------------------------------------------------------------------------- partitions
@gluon.jit
def _issue_tma(k_desc, v_desc, k8, v8, bar, b, hk, n0, BN: gl.constexpr, D: gl.constexpr, kv0=0, vc0=0):
    """TMA of KV block n0's FP8 K tile (rows kv0 + n0 ...) and V^T tile (columns vc0 + n0 ...) onto `bar`."""
    mbarrier.expect(bar, BN * D * 2)  # one FP8 K tile and one FP8 V tile
    tma.async_copy_global_to_shared(k_desc, [b, hk, kv0 + n0, 0], bar, k8)
    tma.async_copy_global_to_shared(v_desc, [b, hk, 0, vc0 + n0], bar, v8)


@gluon.jit
def _producer(k_desc, v_desc, KS, VS, k8, v8, ksc, vsc, kb, vb, fp8_ready, ready, empty,
              sksb, sksh, skss, svsb, svsh, svss, HQ, GROUP, SQ, SKV, offset, RB, LB, CU_Q, CU_KV,
              HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
              NS: gl.constexpr, NF: gl.constexpr, CH: gl.constexpr, HAS_LB: gl.constexpr, VARLEN: gl.constexpr,
              BOTTOM_RIGHT: gl.constexpr, PACKED: gl.constexpr):
    """The producer warpgroup: TMA of FP8 K/V tiles NF blocks ahead, their scales one block ahead (registers,
    then shared memory), dequantization into the bf16 ring once the consumers freed it. Block lo + j (the j-th
    visited, `_kv_block_range`) goes to FP8 stage j % NF and bf16 stage j % NS. PACKED: the sequence's rows from
    its first (`_seq_rows`); V's columns past its keys are written as zeros (the next sequence's)."""
    nw: gl.constexpr = gl.num_warps()
    tile, b, hq = _tile_of_program(HQ, HAS_RB)
    hk = hq // GROUP
    m0 = tile * BM
    len_q, SKV, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)  # SKV: its keys
    lo, n_blk = _visited_blocks(m0, len_q, SKV, offset, LB, RB, HAS_LB, HAS_RB, BM, BN, VARLEN)
    bt, q0, kv0, kvb0 = _seq_rows(CU_Q, CU_KV, b, PACKED)
    b64 = bt.to(gl.int64)
    hk64 = hk.to(gl.int64)
    # the scales are addressed from block lo on (rows past SKV - lo * BN read as 127): the row indices of the loop
    # below stay those of a range from block 0, whose registers the producer's 32 hold
    ks_base = KS + b64 * sksb + hk64 * sksh + (lo * BN) * skss
    vs_base = VS + b64 * svsb + hk64 * svsh + (lo * (BN // 32)) * svss
    if PACKED:
        ks_base = ks_base + kv0.to(gl.int64) * skss
        vs_base = vs_base + kvb0.to(gl.int64) * svss
    skv_lo = SKV - lo * BN
    for i in gl.static_range(NF):
        if i < n_blk:
            _issue_tma(k_desc, v_desc, k8.index(i), v8.index(i), fp8_ready.index(i), bt, hk, (lo + i) * BN, BN, D,
                       kv0, kvb0 * 32)
    ks_next, vs_next = _load_scales(KS, VS, ks_base, vs_base, skss, svss, 0, skv_lo, BN, D, nw)
    for j in range(n_blk):  # the j-th visited block, block lo + j
        f = j % NF
        s = j % NS
        ksc.store(ks_next)  # this block's scales (the previous block's dequantization is done: barrier below)
        vsc.store(vs_next)
        ks_next, vs_next = _load_scales(KS, VS, ks_base, vs_base, skss, svss, (j + 1) * BN, skv_lo, BN, D, nw)
        gl.thread_barrier()
        mbarrier.wait(fp8_ready.index(f), (j // NF) & 1)
        mbarrier.wait(empty.index(s), ((j // NS) & 1) ^ 1)  # passes at once on a fresh barrier (first round)
        k_src = k8.index(f).reshape([BN, D])
        v_src = v8.index(f).reshape([D, BN])
        for c in gl.static_range(BN // CH):  # K [BN, D]: scales along D, one row per key
            _dequant_chunk(k_src, kb.index(s), ksc, c * CH, CH, D, nw)
        vsc_t = vsc.permute((1, 0))
        for c in gl.static_range(D // CH):  # V^T [D, BN]: scales along the keys ([BN/32, D] in shared memory)
            _dequant_chunk(v_src, vb.index(s), vsc_t, c * CH, CH, BN, nw, skv_lo - j * BN, PACKED)
        fence_async_shared()  # the generic-proxy stores before the consumers' wgmma (async proxy) reads
        gl.thread_barrier()  # every producer warp done with stage s, FP8 stage f and the scales
        mbarrier.arrive(ready.index(s), count=1)
        jn = j + NF
        if jn < n_blk:  # refill FP8 stage f
            _issue_tma(k_desc, v_desc, k8.index(f), v8.index(f), fp8_ready.index(f), bt, hk, (lo + jn) * BN, BN, D,
                       kv0, kvb0 * 32)


@gluon.jit
def _producer_bf16(k_desc, v_desc, kb, vb, ready, empty, HQ, GROUP, SQ, SKV, offset, RB, LB, CU_Q, CU_KV,
                   V, svb, svh, svs,
                   HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
                   HAS_LB: gl.constexpr, VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, PACKED: gl.constexpr):
    """The producer warpgroup of the bf16-K/V variant (KV_BF16): TMA of the bf16 K and V tiles [BN, D] of block
    lo + j straight into bf16 stage j % NS once the consumers freed it (one expect-tx "ready" arrival per stage;
    rows past SKV read as zeros). PACKED: the sequence's rows from its first (`_seq_rows`); a block running past
    its keys gets V by ordinary loads from V (strides svb, svh, svs; zeros past the keys, `_load_tail_rows`),
    stored and fenced before the K tile's TMA arms "ready"."""
    nw: gl.constexpr = gl.num_warps()
    tile, b, hq = _tile_of_program(HQ, HAS_RB)
    hk = hq // GROUP
    len_q, len_kv, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)
    lo, n_blk = _visited_blocks(tile * BM, len_q, len_kv, offset, LB, RB, HAS_LB, HAS_RB, BM, BN, VARLEN)
    bt, q0, kv0, kvb0 = _seq_rows(CU_Q, CU_KV, b, PACKED)
    for j in range(n_blk):
        s = j % NS
        n0 = (lo + j) * BN
        mbarrier.wait(empty.index(s), ((j // NS) & 1) ^ 1)  # passes at once on a fresh barrier (first round)
        if PACKED:
            if n0 + BN > len_kv:  # the tail block: V rows past the sequence as zeros, K by TMA (masked logits)
                _load_tail_rows(V, vb.index(s).reshape([BN, D]), bt.to(gl.int64), hk.to(gl.int64), svb, svh, svs,
                                kv0, n0, len_kv, BN, D, nw)
                fence_async_shared()  # the generic-proxy stores before the consumers' wgmma reads
                gl.thread_barrier()
                mbarrier.expect(ready.index(s), BN * D * 2)
                tma.async_copy_global_to_shared(k_desc, [bt, hk, kv0 + n0, 0], ready.index(s), kb.index(s))
            else:
                mbarrier.expect(ready.index(s), 2 * BN * D * 2)
                tma.async_copy_global_to_shared(k_desc, [bt, hk, kv0 + n0, 0], ready.index(s), kb.index(s))
                tma.async_copy_global_to_shared(v_desc, [bt, hk, kv0 + n0, 0], ready.index(s), vb.index(s))
        else:
            mbarrier.expect(ready.index(s), 2 * BN * D * 2)  # one bf16 K tile and one bf16 V tile
            tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], ready.index(s), kb.index(s))
            tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], ready.index(s), vb.index(s))


@gluon.jit
def _k_operand(kb, s, BN: gl.constexpr, D: gl.constexpr, KV_BF16: gl.constexpr):
    """K_s^T [D, BN], the S GEMM's B operand, from bf16 stage s: [BN, D] dequantized by the producer, or the
    TMA'd [1, 1, BN, D] tile (KV_BF16)."""
    if KV_BF16:
        op = kb.index(s).reshape([BN, D]).permute((1, 0))
    else:
        op = kb.index(s).permute((1, 0))
    return op


@gluon.jit
def _v_operand(vb, s, BN: gl.constexpr, D: gl.constexpr, KV_BF16: gl.constexpr):
    """V_s [BN, D], the P V GEMM's B operand, from bf16 stage s: V^T [D, BN] dequantized by the producer, or the
    TMA'd [1, 1, BN, D] tile (KV_BF16)."""
    if KV_BF16:
        op = vb.index(s).reshape([BN, D])
    else:
        op = vb.index(s).permute((1, 0))
    return op


@gluon.jit
def _softmax_step(qk, m_i, l_i, rows, cols0, n0, m0, SKV, offset, RB, qk_scale, HAS_RB: gl.constexpr,
                  BN: gl.constexpr, p_op: gl.constexpr, MASK: gl.constexpr = True, LB=0,
                  HAS_LB: gl.constexpr = False, BMW: gl.constexpr = 64, P_MODE: gl.constexpr = 0,
                  PS: gl.constexpr = 8.0):
    """One KV block (keys [n0, n0 + BN)) of the online softmax, triton_common.softmax_block's arithmetic for the
    default recipe: the masked logits qk (keys past SKV; with HAS_RB keys above the diagonal col > row + offset +
    RB; with HAS_LB keys left of the window col <= row + offset - LB; only blocks that need it are masked),
    running max (log2 units), alpha, P * 256 and the running sum of the unrounded P -> (E4M3(P * 256) as bf16 in
    the P V GEMM's A layout p_op, alpha, new max, new sum). m0: the first query row of the warpgroup's tile (BMW
    rows). MASK False: the caller knows every element of the block is kept (no mask code at all; masking such a
    block would change nothing)."""
    need_mask = n0 + BN > SKV
    if HAS_RB:
        need_mask = need_mask | (n0 + BN - 1 > m0 + offset + RB)
    if HAS_LB:
        need_mask = need_mask | (n0 <= m0 + BMW - 1 + offset - LB)
    if MASK and need_mask:
        cols = n0 + cols0
        keep = gl.expand_dims(cols < SKV, 0)
        if HAS_RB and HAS_LB:
            # row + offset - LB < col <= row + offset + RB from one value per row (registers: the masked loop
            # before the mask-free one holds this): 0 <= col - (row + offset - LB + 1) <= RB + LB - 1, the same
            # set in int32 at these sizes
            rel = gl.expand_dims(cols, 0) - gl.expand_dims(rows + (offset - LB + 1), 1)
            keep = keep & (rel >= 0) & (rel <= RB + LB - 1)
        elif HAS_RB:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + offset + RB)
        elif HAS_LB:
            keep = keep & (gl.expand_dims(cols, 0) > gl.expand_dims(rows, 1) + offset - LB)
        qk = gl.where(keep, qk, float("-inf"))
    if P_MODE == P_LAZY16_K:  # the running max moves only past LAZY_THRESHOLD (triton_common.softmax_block's)
        m_blk = gl.max(qk, axis=1) * qk_scale
        m_new = gl.where((m_i == float("-inf")) | (m_blk - m_i > LAZY_THRESHOLD_K), m_blk, m_i)
    else:
        m_new = gl.maximum(m_i, gl.max(qk, axis=1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_use - PS, 1))  # P * 2^PS (256; lazy16: 16)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    if P_MODE == P_BF16_K:  # p_quant "none": P * 256 rounded to bf16 (RNE; triton_common.round_p's P_BF16)
        return gl.convert_layout(p.to(gl.bfloat16), p_op), alpha, m_new, l_i
    return gl.convert_layout(_round_p_to_bf16(p), p_op), alpha, m_new, l_i


@gluon.jit
def _turn_wait(turn, WG: gl.constexpr, e, PINGPONG: gl.constexpr):
    """Ping-pong (FlashAttention-3's inter-warpgroup schedule): before its e-th GEMM issue, consumer warpgroup WG
    waits for the other warpgroup's (e - 1 + WG)-th issue, so the two alternate on the tensor cores and one's
    softmax runs under the other's GEMMs. WG 0's first wait passes at once (parity 1 on a fresh barrier)."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (e + 1 - WG) & 1)


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: after issuing its GEMMs, warpgroup WG hands the turn to the other one."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _kv_step(j, q, pq, acc, m_i, l_i, kb, vb, ready, empty, turn, rows, cols0, m0, SKV, offset, RB, qk_scale, s_zero,
             HAS_RB: gl.constexpr, BN: gl.constexpr, NS: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr,
             MASK: gl.constexpr, p_op: gl.constexpr, row_o: gl.constexpr, lo=0, LB=0, HAS_LB: gl.constexpr = False,
             BMW: gl.constexpr = 64, D: gl.constexpr = 128, KV_BF16: gl.constexpr = False,
             P_MODE: gl.constexpr = 0, PS: gl.constexpr = 8.0):
    """The j-th visited KV block (j >= 1; block lo + j, keys from (lo + j) * BN, lo the range's first block) of a
    consumer warpgroup: S_j = Q K_j^T issued with O += P_{j-1} V_{j-1} (acc already rescaled by block j - 1's
    alpha), the softmax of block j under the latter, stage (j - 1) % NS released, O rescaled by alpha_j -> (P_j
    rounded, O, m, l). The rings and turns count visited blocks (j), the mask sees key positions ((lo + j) * BN);
    HAS_LB: the block may be cut by the window's left edge (LB)."""
    s = j % NS
    sp = (j - 1) % NS
    mbarrier.wait(ready.index(s), (j // NS) & 1)
    _turn_wait(turn, WG, j, PINGPONG)
    qk_t = warpgroup_mma(q, _k_operand(kb, s, BN, D, KV_BF16), s_zero, use_acc=False, is_async=True)
    acc_t = warpgroup_mma(pq, _v_operand(vb, sp, BN, D, KV_BF16), acc, is_async=True)
    _turn_pass(turn, WG, PINGPONG)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk_t, ))
    pq, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, cols0, (lo + j) * BN, m0, SKV, offset, RB, qk_scale,
                                        HAS_RB, BN, p_op, MASK, LB, HAS_LB, BMW, P_MODE, PS)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t, ))
    gl.thread_barrier()  # the warpgroup is done with stage (j - 1) % NS
    mbarrier.arrive(empty.index(sp), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    return pq, acc, m_i, l_i


@gluon.jit
def _consumer(Q, QS, O, LSE, kb, vb, ready, empty, turn,
              sqb, sqh, sqs, sqsb, sqsh, sqss, sob, soh, sos, slb, slh, sls,
              HQ, SQ, SKV, qk_scale, offset, RB, LB, SINK, CU_Q, CU_KV,
              HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, NS: gl.constexpr,
              PINGPONG: gl.constexpr, WG: gl.constexpr, HAS_LB: gl.constexpr, HAS_SINK: gl.constexpr,
              KV_BF16: gl.constexpr, VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, PACKED: gl.constexpr,
              P_MODE: gl.constexpr = 0, PS: gl.constexpr = 8.0):
    """Consumer warpgroup WG (4 warps) of the CTA: query rows [tile * BM + 64 WG, + 64). Q dequantized into
    registers, then per KV block S = Q K^T, the online softmax, P rounding and O = O * alpha + P V; the epilogue
    writes its rows of O (bf16) and of the stats. The S GEMM of block j is issued together with the P V GEMM of
    block j - 1, and the softmax of block j runs under the latter (FlashAttention-3's intra-warpgroup overlap);
    with PINGPONG the two warpgroups also alternate their GEMM issues (`_turn_wait`). The arithmetic and its
    order per element are unchanged. HAS_SINK: the softmax starts from the head's sink logit (max = sink in log2
    units, sum = 1 in units of P's scale 256: triton_common.softmax_start), so a row that meets no key ends with
    O = 0 and stats = the sink through the ordinary epilogue, as in the Triton kernel. PACKED: the sequence's rows
    from its first (`_seq_rows`), and only its own rows are read and written (the next rows are another
    sequence's)."""
    nw: gl.constexpr = gl.num_warps()
    BMW: gl.constexpr = BM // 2  # two consumer warpgroups of 4 warps
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[nw, 1],
                                                       instr_shape=[16, D, 16])
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    tile, b, hq = _tile_of_program(HQ, HAS_RB)
    # VARLEN: from here on SKV is the sequence's keys (masks, blocks); SQ stays the tensors' rows (loads, stores)
    len_q, SKV, offset = _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN, BOTTOM_RIGHT)
    bt, q0, kv0, kvb0 = _seq_rows(CU_Q, CU_KV, b, PACKED)
    n_rows = SQ  # the rows this program may read and write: the tensors' (padding rows included), or its sequence's
    if PACKED:
        n_rows = len_q
    m_cta = tile * BM
    m0 = m_cta + WG * BMW
    b64 = bt.to(gl.int64)
    hq64 = hq.to(gl.int64)

    # Q [BMW, D] FP8 + scales -> bf16 registers (the S GEMM's A operand)
    lq: gl.constexpr = _chunk_layouts(D, nw)[1]
    lqs: gl.constexpr = gl.SliceLayout(2, lq)
    qr = m0 + gl.arange(0, BMW, layout=gl.SliceLayout(1, lqs))
    qb = gl.arange(0, D // 32, layout=gl.SliceLayout(0, lqs))
    qe = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, lq)))
    q_ok2 = gl.expand_dims(qr < n_rows, 1) & gl.expand_dims(qb >= 0, 0)
    q_offs2 = gl.expand_dims((q0 + qr).to(gl.int64) * sqs, 1) + gl.expand_dims(qb * 32, 0)
    q_offs = gl.expand_dims(q_offs2, 2) + gl.expand_dims(gl.expand_dims(qe, 0), 1)
    q_ok = gl.expand_dims(q_ok2, 2) & gl.expand_dims(gl.expand_dims(qe >= 0, 0), 1)
    q8 = gl.load(Q.cast(gl.pointer_type(gl.uint8)) + b64 * sqb + hq64 * sqh + q_offs, mask=q_ok, other=0)
    qsc = gl.load(QS + b64 * sqsb + hq64 * sqsh + gl.expand_dims((q0 + qr).to(gl.int64) * sqss, 1)
                  + gl.expand_dims(qb, 0), mask=q_ok2, other=127)
    q = gl.convert_layout(gl.reshape(_dequant3(q8, qsc), [BMW, D]), q_op)

    rows = m0 + gl.arange(0, BMW, layout=row_s)
    cols0 = gl.arange(0, BN, layout=col_s)
    if HAS_SINK:  # triton_common.softmax_start: the sink joins first
        m_i = gl.zeros([BMW], gl.float32, row_s) + gl.load(SINK + hq) * LOG2E_K
        if PS == 8.0:
            l_i = gl.full([BMW], 256.0, gl.float32, row_s)  # 2^PS
        else:  # lazy16
            l_i = gl.full([BMW], 16.0, gl.float32, row_s)
    else:
        m_i = gl.full([BMW], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BMW], gl.float32, row_s)
    acc = gl.zeros([BMW, D], gl.float32, o_layout)
    s_zero = gl.zeros([BMW, BN], gl.float32, s_layout)

    # the CTA's blocks lo, ..., lo + n_blk - 1 (the producer's); j below counts them (ring stages, turns)
    lo, n_blk = _visited_blocks(m_cta, len_q, SKV, offset, LB, RB, HAS_LB, HAS_RB, BM, BN, VARLEN)
    if n_blk > 0:
        mbarrier.wait(ready.index(0), 0)
        _turn_wait(turn, WG, 0, PINGPONG)
        qk_t = warpgroup_mma(q, _k_operand(kb, 0, BN, D, KV_BF16), s_zero, use_acc=False, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk_t, ))
        pq, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, cols0, lo * BN, m0, SKV, offset, RB, qk_scale,
                                            HAS_RB, BN, p_op, True, LB, HAS_LB, BMW, P_MODE, PS)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        # visited blocks [j_lb, n_full) (counted from lo) are kept whole for every row of the warpgroup (no mask
        # code), the others need the mask: [1, j_lb) cut by the window's left edge (HAS_LB), [n_full, n_blk) by
        # the right edge or the end of the keys
        n_full = gl.minimum(n_blk, SKV // BN - lo)
        if HAS_RB:
            n_full = gl.minimum(n_full, gl.maximum(m0 + offset + RB + 1, 0) // BN - lo)
        j_lb = 1
        if HAS_LB:
            # the first block whose keys all lie right of the left edge for the warpgroup's last row
            j_lb = gl.maximum(gl.minimum(gl.cdiv(gl.maximum(m0 + BMW + offset - LB, 0), BN) - lo, n_blk), 1)
            for j in range(1, j_lb):
                pq, acc, m_i, l_i = _kv_step(j, q, pq, acc, m_i, l_i, kb, vb, ready, empty, turn, rows, cols0, m0,
                                             SKV, offset, RB, qk_scale, s_zero, HAS_RB, BN, NS, PINGPONG, WG, True,
                                             p_op, row_o, lo, LB, HAS_LB, BMW, D, KV_BF16, P_MODE, PS)
        for j in range(j_lb, n_full):
            pq, acc, m_i, l_i = _kv_step(j, q, pq, acc, m_i, l_i, kb, vb, ready, empty, turn, rows, cols0, m0, SKV,
                                         offset, RB, qk_scale, s_zero, HAS_RB, BN, NS, PINGPONG, WG, False, p_op,
                                         row_o, lo, LB, HAS_LB, BMW, D, KV_BF16, P_MODE, PS)
        for j in range(gl.maximum(n_full, j_lb), n_blk):  # (from j_lb on no key is left of the window: no LB mask)
            pq, acc, m_i, l_i = _kv_step(j, q, pq, acc, m_i, l_i, kb, vb, ready, empty, turn, rows, cols0, m0, SKV,
                                         offset, RB, qk_scale, s_zero, HAS_RB, BN, NS, PINGPONG, WG, True, p_op,
                                         row_o, lo, 0, False, 64, D, KV_BF16, P_MODE, PS)
        sl = (n_blk - 1) % NS  # the last visited block's stage
        _turn_wait(turn, WG, n_blk, PINGPONG)
        acc_t = warpgroup_mma(pq, _v_operand(vb, sl, BN, D, KV_BF16), acc, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_t, ))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(sl), count=1)

    has = l_i != 0.0  # a NaN row (l_i NaN) stays NaN
    if VARLEN:
        has = has & (rows < len_q)  # padding rows of a padded tile: O = 0, stats = -inf (the Triton forward's)
    denom = gl.where(has, l_i, 1.0)
    has_o = gl.convert_layout(has, row_o)
    o = gl.where(gl.expand_dims(has_o, 1), acc / gl.expand_dims(gl.convert_layout(denom, row_o), 1), 0.0)
    lse = gl.where(has, (m_i + gl.log2(denom) - PS) * LN2, float("-inf"))
    rows_o = m0 + gl.arange(0, BMW, layout=row_o)
    offs_d = gl.arange(0, D, layout=col_o)
    o_ptrs = (O + b64 * sob + hq64 * soh + gl.expand_dims((q0 + rows_o).to(gl.int64) * sos, 1)
              + gl.expand_dims(offs_d, 0))
    gl.store(o_ptrs, o.to(O.dtype.element_ty),
             mask=gl.expand_dims(rows_o < n_rows, 1) & gl.expand_dims(offs_d >= 0, 0))
    gl.store(LSE + b64 * slb + hq64 * slh + (q0 + rows).to(gl.int64) * sls, lse, mask=rows < n_rows)


@gluon.jit
def _gluon_attn_fwd_kernel(
        Q, QS, k_desc, KS, v_desc, VS, O, LSE,
        sqb, sqh, sqs, sqsb, sqsh, sqss,
        sksb, sksh, skss, svsb, svsh, svss,
        sob, soh, sos, slb, slh, sls,
        HQ, GROUP, SQ, SKV, qk_scale, offset, RB, LB, SINK, CU_Q, CU_KV,
        HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
        NS: gl.constexpr, NF: gl.constexpr, CH: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, HAS_LB: gl.constexpr = False, HAS_SINK: gl.constexpr = False,
        KV_BF16: gl.constexpr = False, VARLEN: gl.constexpr = False, BOTTOM_RIGHT: gl.constexpr = False,
        PACKED: gl.constexpr = False, P_MODE: gl.constexpr = 0, PS: gl.constexpr = 8.0):
    """Grid (cdiv(SQ, BM), B * HQ), 4 warps per partition: consumer warpgroup 0 (the default partition),
    consumer warpgroup 1 and the producer (workers). Q [B,HQ,SQ,D] e4m3 (strides sqb, sqh, sqs, unit along D)
    with scales QS [B,HQ,SQ,D/32] u8; k_desc a TMA descriptor of K [B,HKV,SKV,D] e4m3 (block [1,1,BN,D]) with
    scales KS [B,HKV,SKV,D/32]; v_desc one of V's seq-major data [B,HKV,D,L] e4m3 (block [1,1,D,BN]) with
    scales VS [B,HKV,L/32,D]; O [B,HQ,SQ,D] bf16, LSE [B,HQ,SQ,1] fp32. HAS_RB: causal-style band (keys kept
    where col <= row + offset + RB); HAS_LB: sliding window (keys kept where col > row + offset - LB); HAS_SINK:
    SINK holds fp32 [HQ] sink logits (else unread). The variants' run-time arguments (LB, SINK, CU_Q, CU_KV) come
    last, so a build without them keeps its parameter offsets (and its machine code).
    VARLEN: a padded batch, sequence b rows 0 .. len of batch b with lengths from the int32 [B + 1] cu_seqlens
    CU_Q / CU_KV (else unread): masks and KV blocks per sequence, its padding rows O = 0 and stats = -inf, tiles
    past its queries visit no block; BOTTOM_RIGHT: each sequence's diagonal offset is len_kv - len_q.
    PACKED (with VARLEN): a packed batch (thd: the tensors' batch 0, sequence b rows cu[b] .. cu[b + 1], V's
    seq-major data and scales segmented per sequence), grid (tiles of the longest sequence, sequences * HQ); only
    the sequence's own rows are read and written, and a KV block running past its keys gets zeros for V there
    (never the next sequence's values: each sequence's numbers are a dense call's on it alone).
    KV_BF16: k_desc and v_desc describe bf16 K and V [B,HKV,SKV,D] (blocks [1,1,BN,D]: the exact dequantizations
    the quantizer writes on the bf16-scratch path), TMA'd straight into the bf16 ring (`_producer_bf16`; NF, CH,
    KS, VS and their strides unused); the consumers' arithmetic is the same."""
    if KV_BF16:
        kb = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BN, D], k_desc.layout)
        vb = gl.allocate_shared_memory(gl.bfloat16, [NS, 1, 1, BN, D], v_desc.layout)
    else:
        k8 = gl.allocate_shared_memory(gl.float8e4nv, [NF, 1, 1, BN, D], k_desc.layout)
        v8 = gl.allocate_shared_memory(gl.float8e4nv, [NF, 1, 1, D, BN], v_desc.layout)
        kb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16)
        vb_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, BN], gl.bfloat16)
        kb = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, D], kb_layout)
        vb = gl.allocate_shared_memory(gl.bfloat16, [NS, D, BN], vb_layout)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        ksc = gl.allocate_shared_memory(gl.uint8, [BN, D // 32], plain)
        vsc = gl.allocate_shared_memory(gl.uint8, [BN // 32, D], plain)
        fp8_ready = gl.allocate_shared_memory(gl.int64, [NF, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    if not KV_BF16:
        for i in gl.static_range(NF):
            mbarrier.init(fp8_ready.index(i), count=1)
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()

    if KV_BF16:
        gl.warp_specialize([
            (_consumer, (Q, QS, O, LSE, kb, vb, ready, empty, turn,
                         sqb, sqh, sqs, sqsb, sqsh, sqss, sob, soh, sos, slb, slh, sls,
                         HQ, SQ, SKV, qk_scale, offset, RB, LB, SINK, CU_Q, CU_KV, HAS_RB, BM, BN, D, NS,
                         PINGPONG, WG0, HAS_LB, HAS_SINK, KV_BF16, VARLEN, BOTTOM_RIGHT, PACKED, P_MODE, PS)),
            (_consumer, (Q, QS, O, LSE, kb, vb, ready, empty, turn,
                         sqb, sqh, sqs, sqsb, sqsh, sqss, sob, soh, sos, slb, slh, sls,
                         HQ, SQ, SKV, qk_scale, offset, RB, LB, SINK, CU_Q, CU_KV, HAS_RB, BM, BN, D, NS,
                         PINGPONG, WG1, HAS_LB, HAS_SINK, KV_BF16, VARLEN, BOTTOM_RIGHT, PACKED, P_MODE, PS)),
            (_producer_bf16, (k_desc, v_desc, kb, vb, ready, empty, HQ, GROUP, SQ, SKV, offset, RB, LB, CU_Q,
                              CU_KV, VS, svsb, svsh, svss, HAS_RB, BM, BN, D, NS, HAS_LB, VARLEN, BOTTOM_RIGHT,
                              PACKED)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (Q, QS, O, LSE, kb, vb, ready, empty, turn,
                         sqb, sqh, sqs, sqsb, sqsh, sqss, sob, soh, sos, slb, slh, sls,
                         HQ, SQ, SKV, qk_scale, offset, RB, LB, SINK, CU_Q, CU_KV, HAS_RB, BM, BN, D, NS,
                         PINGPONG, WG0, HAS_LB, HAS_SINK, KV_BF16, VARLEN, BOTTOM_RIGHT, PACKED, P_MODE, PS)),
            (_consumer, (Q, QS, O, LSE, kb, vb, ready, empty, turn,
                         sqb, sqh, sqs, sqsb, sqsh, sqss, sob, soh, sos, slb, slh, sls,
                         HQ, SQ, SKV, qk_scale, offset, RB, LB, SINK, CU_Q, CU_KV, HAS_RB, BM, BN, D, NS,
                         PINGPONG, WG1, HAS_LB, HAS_SINK, KV_BF16, VARLEN, BOTTOM_RIGHT, PACKED, P_MODE, PS)),
            (_producer, (k_desc, v_desc, KS, VS, k8, v8, ksc, vsc, kb, vb, fp8_ready, ready, empty,
                         sksb, sksh, skss, svsb, svsh, svss, HQ, GROUP, SQ, SKV, offset, RB, LB, CU_Q, CU_KV,
                         HAS_RB, BM, BN, D, NS, NF, CH, HAS_LB, VARLEN, BOTTOM_RIGHT, PACKED)),
        ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])

    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
    if not KV_BF16:
        for i in gl.static_range(NF):
            mbarrier.invalidate(fp8_ready.index(i))
    for i in gl.static_range(NS):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
