"""Hopper (sm_90a) Gluon MXFP8 attention forward, warp-specialised (issue 24): every P recipe (P_MODE / PS: fixed256,
lazy16, none), either scale rule (the quantizer's), bf16 V on the bf16-K/V variant; bf16 or fp16 O.

Scope: dense, padded and packed batches (any [B, H, S, D] strides with a unit stride along D: bhsd or bshd views;
a variable-length batch's lengths from its cu_seqlens, VARLEN; PACKED: thd, each sequence read and written from its
first row, and a KV block running past its keys never brings the next sequence's V), any band of a
dense caller (its offset; `right_bound` None or any int: causal-style, `left_bound` None or an int: sliding
window, keys kept where col > row + offset - left_bound), attention sinks (fp32 [Hq] logits joining every row's
softmax as the Triton forward's `softmax_start`), head dims 64 and 128, MHA and GQA, bf16 output and fp32 stats. It reads the operands of the Triton forward's FP8 data path
(`triton_attention_fwd.attention_fwd` with k_scale given): Q and K row-wise E4M3 with compact E8M0 scales, V
column-wise seq-major (`SeqMajorColumns`), and computes the same numbers; or (KV_BF16, k_scale None) those of
its bf16-scratch path: Q as before, K and V as the exact bf16 dequantizations the quantizer writes, TMA'd
straight into the bf16 ring by `_producer_bf16` (no FP8 ring, no dequantization on chip), the consumers
unchanged:

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
  visited (`_kv_block_range`, shared with the producer: [lo, hi) of triton_common.band_block_range); the rings
  and turns count visited blocks. With a sink the softmax starts from it (max = sink, sum = 1). Epilogue in
  registers (a row that met no key: O = 0, stats = -inf or, with a sink, the sink, as in the Triton kernel).
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

import functools
from typing import Optional

import torch
import triton
from triton.runtime.jit import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..runtime.recipe_flags import DEFAULT_FLAGS, P_MODE_BF16, P_MODE_LAZY16, KernelRecipe
from ..runtime.triton_launch import cdiv, launch
from .triton_attention_fwd import _check_sink, check_seq
from ..seqinfo import grid_rows, grid_sequences, kernel_cu_seqlens
from .triton_common import (E4M3_TO_BF16_ASM, E4M3_TO_BF16_CONSTRAINTS, E4M3_TO_BF16_PACK, LAZY_THRESHOLD,
                            ROUND_P_ASM, ROUND_P_CONSTRAINTS, ROUND_P_PACK)

#: KV block of the online softmax (fixed by the recipe) and the query rows of one CTA (two consumer warpgroups)
BLOCK_N = 128
BLOCK_M = 128
#: warps of each partition (two consumer warpgroups, one producer warpgroup)
PARTITION_WARPS = 4
#: registers per thread (setmaxnreg) of the second consumer warpgroup and of the producer; the default partition
#: (the first consumer warpgroup) gets what is left of the 504 a thread of each of the three warpgroups has
CONSUMER_REGS = 232
PRODUCER_REGS = 32
#: (bf16 stages, fp8 stages) of the rings by head dim: D128 bf16 K+V = 64 KiB a stage, fp8 = 32 KiB
STAGES = {64: (3, 3), 128: (2, 2)}
#: bf16 stages of the bf16-K/V variant (KV_BF16: TMA straight into the ring, no FP8 ring) by head dim
BF16_KV_STAGES = {64: 4, 128: 3}
#: head dims where the backend's bf16-scratch forward runs the bf16-K/V variant rather than the Triton kernel
BF16_KV_FASTER_HEAD_DIMS = (64, 128)
#: the two consumer warpgroups alternate their GEMM issues (FA3's ping-pong) by default; config can turn it off
PINGPONG = True
#: rows of one dequantization chunk in the producer (bounds its registers)
CHUNK_ROWS = 32
SUPPORTED_HEAD_DIMS = (64, 128)

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


# --------------------------------------------------------------------------- element helpers (triton_common's)
@gluon.jit
def _e4m3_to_bf16_biased(x):
    """uint8 E4M3 patterns -> bf16 x * 2^-120, exactly (integer ops; triton_common.e4m3_to_bf16_biased)."""
    return gl.inline_asm_elementwise(asm=E4M3_TO_BF16_ASM, constraints=E4M3_TO_BF16_CONSTRAINTS, args=[x],
                                     dtype=gl.bfloat16, is_pure=True, pack=E4M3_TO_BF16_PACK)


@gluon.jit
def _round_p_to_bf16(p):
    """fp32 p in [0, 448] -> bf16 E4M3(p) (RNE, saturating; triton_common.round_p_to_bf16)."""
    return gl.inline_asm_elementwise(asm=ROUND_P_ASM, constraints=ROUND_P_CONSTRAINTS, args=[p], dtype=gl.bfloat16,
                                     is_pure=True, pack=ROUND_P_PACK)


@gluon.jit
def _dequant3(x, s):
    """x uint8 E4M3 [R, C // 32, 32], s uint8 E8M0 [R, C // 32] (SliceLayout(2, x's)) -> bf16 [R, C // 32, 32]:
    e4m3_to_bf16_biased(x) * f1 * f2 as triton_common.dequant_rows (f1 = 2^(min(e, 134) - 7), f2 the rest, NaN
    for e = 255)."""
    e = s.to(gl.int16)
    f1 = ((gl.minimum(e, 134) + 120) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
    f2 = gl.where(e == 255, 0x7FC0, (gl.maximum(e, 134) - 7) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
    y = _e4m3_to_bf16_biased(x)
    return y * gl.expand_dims(f1, 2) * gl.expand_dims(f2, 2)


@constexpr_function
def _chunk_layouts(C, warps):
    """(2-D, 3-D) blocked layouts of a [rows, C] FP8 chunk, 16 contiguous bytes per thread along C, the 3-D one the
    [rows, C // 32, 32] view with the same thread mapping (one MX block = two threads)."""
    tc = C // 16
    l2 = gl.BlockedLayout([1, 16], [32 // tc, tc], [warps, 1], [1, 0])
    l3 = gl.BlockedLayout([1, 1, 16], [32 // tc, C // 32, 2], [warps, 1, 1], [2, 1, 0])
    return l2, l3


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


# --------------------------------------------------------------------------- partitions
@gluon.jit
def _tile_of_program(HQ, HAS_RB: gl.constexpr):
    """(query tile, b, hq) of this program; causal-style bands number programs heaviest tile first
    (triton_common.program_prologue's BY_TILE)."""
    tile = gl.program_id(0)
    pid_bh = gl.program_id(1)
    if HAS_RB:
        n_tiles = gl.num_programs(0)
        n_bh = gl.num_programs(1)
        linear = pid_bh * n_tiles + tile
        tile = n_tiles - 1 - linear // n_bh
        pid_bh = linear % n_bh
    return tile, pid_bh // HQ, pid_bh % HQ


@gluon.jit
def _kv_blocks(m0, SKV, offset, RB, HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """Number of KV blocks the CTA's query rows [m0, m0 + BM) meet (from block 0)."""
    hi = SKV
    if HAS_RB:
        hi = gl.minimum(SKV, gl.maximum(m0 + BM + offset + RB, 0))
    return gl.cdiv(hi, BN)


@gluon.jit
def _kv_block_range(m0, SKV, offset, LB, RB, HAS_LB: gl.constexpr, HAS_RB: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr):
    """(lo, n): the CTA's query rows [m0, m0 + BM) visit the KV blocks lo, lo + 1, ..., lo + n - 1, in that order
    (triton_common.band_block_range's [lo, hi) at the same tile, in blocks). The producer and both consumer
    warpgroups take the range from here, and index their rings by the count i = j - lo of visited blocks. With
    HAS_LB (keys kept where col > row + offset - LB) the first block is the one holding column
    m0 + offset - LB + 1 (or 0); without it lo is the constant 0."""
    hi_blk = _kv_blocks(m0, SKV, offset, RB, HAS_RB, BM, BN)
    lo = 0
    n = hi_blk
    if HAS_LB:
        lo = gl.maximum(m0 + offset - LB + 1, 0) // BN
        n = gl.maximum(hi_blk - lo, 0)
    return lo, n


@gluon.jit
def _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr):
    """(len_q, len_kv, offset) of batch b: with VARLEN (a padded batch: sequence b is rows 0 .. len of batch b,
    lengths from the int32 cu_seqlens CU_Q / CU_KV) its lengths and, with BOTTOM_RIGHT, its own diagonal offset
    len_kv - len_q (triton_common.seq_prologue's); else the tensors' SQ, SKV and the offset passed in."""
    len_q = SQ
    len_kv = SKV
    if VARLEN:
        len_q = gl.load(CU_Q + b + 1) - gl.load(CU_Q + b)
        len_kv = gl.load(CU_KV + b + 1) - gl.load(CU_KV + b)
        if BOTTOM_RIGHT:
            offset = len_kv - len_q
    return len_q, len_kv, offset


@gluon.jit
def _seq_rows(CU_Q, CU_KV, b, PACKED: gl.constexpr):
    """(bt, q0, kv0, kvb0) of sequence b: the tensors' batch index, the sequence's first query and key rows and
    the first column block of V's seq-major data (triton_common.seq_span's): in a packed batch (thd, the tensors'
    batch 0) q0 = cu_q[b], kv0 = cu_kv[b] and kvb0 = kv0 // 32 + b (V quantized per sequence: segments restart at
    each sequence's first key); else (b, 0, 0, 0)."""
    bt = b
    q0 = 0
    kv0 = 0
    kvb0 = 0
    if PACKED:
        bt = b * 0
        q0 = gl.load(CU_Q + b)
        kv0 = gl.load(CU_KV + b)
        kvb0 = kv0 // 32 + b
    return bt, q0, kv0, kvb0


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


@gluon.jit
def _visited_blocks(m_cta, len_q, len_kv, offset, LB, RB, HAS_LB: gl.constexpr, HAS_RB: gl.constexpr,
                    BM: gl.constexpr, BN: gl.constexpr, VARLEN: gl.constexpr):
    """`_kv_block_range` of the CTA's rows [m_cta, m_cta + BM) over its sequence's len_kv keys, none where the
    tile starts past the sequence's len_q rows (VARLEN: a padded tile; its rows get O = 0 and stats = -inf): the
    range all three partitions walk."""
    lo, n = _kv_block_range(m_cta, len_kv, offset, LB, RB, HAS_LB, HAS_RB, BM, BN)
    if VARLEN:
        n = n * (m_cta < len_q).to(gl.int32)
    return lo, n


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
    SINK holds fp32 [HQ] sink logits (else unread). The new run-time arguments (LB, SINK, CU_Q, CU_KV) follow the
    old ones, so a variant without them keeps its parameter offsets (and its machine code).
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


# --------------------------------------------------------------------------- host side
@functools.lru_cache(maxsize=None)
def tma_layouts(d: int):
    """(K tile layout, V^T tile layout) of the FP8 TMA descriptors at head dim d (blocks [1,1,BN,D], [1,1,D,BN]);
    cached per d (building them costs 10-20 us of host time per call)."""
    return (gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, d], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([1, 1, d, BLOCK_N], gl.float8e4nv))


@functools.lru_cache(maxsize=None)
def bf16_kv_tma_layout(d: int):
    """The layout of the bf16 K and V tiles' TMA descriptors (blocks [1,1,BN,D]) of the bf16-K/V variant."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, d], gl.bfloat16)


def recipe_reason(flags: KernelRecipe, bf16_kv: bool) -> Optional[str]:
    """Why the Gluon forward does not run recipe `flags` (one sentence), or None: it takes every P rounding
    (fixed256, lazy16 with its lazy running max and 2^4 scale, none) with either scale rule (the quantizer applies
    it: this kernel quantizes nothing); bf16 V (v_operand="bf16") on the bf16-K/V variant (bf16_kv: K's exact
    bf16 dequantization and V as it is), not on FP8 K/V (that path runs the Triton forward)."""
    if (flags.p_mode, flags.log2_ps) not in ((0, 8.0), (P_MODE_LAZY16, 4.0), (P_MODE_BF16, 8.0)):
        return f"the Gluon forward takes P's recipes fixed256, lazy16 and none, got {flags.p_mode, flags.log2_ps}"
    if flags.v_raw and not bf16_kv:
        return "on FP8 K/V the Gluon forward reads V as MXFP8 (v_operand='bf16' runs the Triton forward there)"
    return None


def unsupported_reason(q_data, k_scale, v, *, left_bound=None, seq=None, bottom_right=False, sink=None,
                       flags: KernelRecipe = DEFAULT_FLAGS, out=None, k_data=None) -> Optional[str]:
    """None where `attention_fwd_gluon` runs the call, else why not (one sentence). With k_data given, also
    whether TMA can address K's and V's bytes (16-byte aligned, strides multiples of 16 bytes) and the grid
    fits CUDA's y limit: the checks a caller choosing between this kernel and another needs. k_scale None: the
    bf16-K/V variant (k_data and v the bf16 dequantizations of K and V)."""
    reason = recipe_reason(flags, k_scale is None)
    if reason is not None:
        return reason
    if bottom_right and seq is None:
        return "bottom_right is for variable-length (padded) calls"
    if q_data.shape[3] not in SUPPORTED_HEAD_DIMS:
        return f"the Gluon forward takes head dims {SUPPORTED_HEAD_DIMS}, got {q_data.shape[3]}"
    if out is not None and out.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon forward writes bf16 or fp16 O, got {out.dtype}"
    if k_scale is None:
        for name, t in (("k_data", k_data), ("v", v)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16):
                return f"with bf16 K/V (k_scale None) {name} must be a bf16 tensor [B, Hkv, Skv, D]"
        operands = (("k_data", k_data), ("v", v))
    else:
        if isinstance(v, torch.Tensor) or not isinstance(getattr(v, "data", None), torch.Tensor):
            return "v must be V's column-wise copy as SeqMajorColumns"
        operands = (("k_data", k_data), ("v.data", v.data))
    if k_data is not None:
        for name, t in operands:
            size = t.element_size()
            if t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:3]):
                return (f"{name} must be 16-byte aligned with strides multiple of 16 bytes (TMA), got strides "
                        f"{tuple(t.stride())}")
        n_seq = grid_sequences(seq, q_data.shape[0])
        if n_seq * q_data.shape[1] > 65535:
            return (f"{n_seq} x {q_data.shape[1]} (sequences x query heads) programs exceed the CUDA grid's "
                    "y limit 65535; split the batch")
    return None


def takes(q_data, k_scale, v, **kwargs) -> bool:
    """Whether the triton backend runs this kernel for a forward: it takes the call (`unsupported_reason`, same
    arguments, k_data given) and, for bf16 K/V, the head dim is one where it is the faster kernel
    (BF16_KV_FASTER_HEAD_DIMS; on FP8 K/V it is faster at every head dim it takes)."""
    if k_scale is None and q_data.shape[3] not in BF16_KV_FASTER_HEAD_DIMS:
        return False
    return unsupported_reason(q_data, k_scale, v, **kwargs) is None


def attention_fwd_gluon(q_data, q_scale, k_data, k_scale, v, *, softmax_scale: float,
                        offset: int, left_bound, right_bound, out: torch.Tensor, stats: torch.Tensor,
                        config=None, seq=None, bottom_right: bool = False, sink: Optional[torch.Tensor] = None,
                        flags: KernelRecipe = DEFAULT_FLAGS, checked: bool = False) -> None:
    """Launch the Gluon forward: `triton_attention_fwd.attention_fwd`'s arguments on its FP8 data path, or with
    k_scale None on its bf16-K/V path (k_data and v bf16 [B,Hkv,Skv,D], the exact dequantizations of K row-wise
    and V column-wise, unit stride along D, 16-byte aligned with 16-byte multiple strides: the KV_BF16 variant).

    q_data [B,Hq,Sq,D] float8_e4m3fn, q_scale [B,Hq,Sq,D/32] E8M0 (uint8 or float8_e8m0fnu bytes), row-wise;
    k_data [B,Hkv,Skv,D] e4m3 and k_scale [B,Hkv,Skv,D/32] likewise; v V's column-wise copy as `SeqMajorColumns`
    (data [B,Hkv,D,L] e4m3, unit stride along L, scales [B,Hkv,L/32,D]). Any strides with a unit stride along the
    last axis (bhsd or bshd views); FP8 data 16-byte aligned with 16-byte multiple strides (TMA). out [B,Hq,Sq,D]
    bf16 or fp16, stats [B,Hq,Sq,1] fp32 (natural log-sum-exp, -inf for rows without keys). offset: the diagonal
    offset (0 top-left); right_bound None (no mask) or an int (causal: 0); left_bound None or an int (sliding
    window: keys kept where col > row + offset - left_bound); Hq a multiple of Hkv (GQA). sink: None or fp32 [Hq]
    contiguous sink logits on q's device (they join every row's softmax; a row without keys gets O = 0 and stats
    = its sink, as the Triton forward computes it).
    config: optional (bf16 stages >= 2, fp8 stages (unused with bf16 K/V)[, pingpong]) override (benchmark sweeps,
    A/B of the schedule).
    seq: None (dense) or a variable-length batch's SeqInfo (cu_seqlens_q / _kv int32 [B + 1]): padded (packed
    False: sequence b is rows 0 .. len of batch b; padding rows O = 0 and stats = -inf) or packed (thd: the
    tensors' batch 1, sequence b rows cu[b] .. cu[b + 1], V's seq-major copy quantized per sequence; rows past
    the last sequence untouched): masks and KV blocks per sequence, as the Triton forward; bottom_right (with
    seq, offset 0): each sequence's diagonal offset is len_kv - len_q.
    Raises ValueError for what it does not take: head dims other than 64/128,
    bf16 V on FP8 K/V (`recipe_reason`), out neither bf16 nor fp16, K/V bytes TMA cannot address,
    a malformed sink. checked: the
    caller has just had `unsupported_reason(..., k_data=k_data, out=out)` answer None for these arguments (not
    asked again)."""
    reason = None if checked else unsupported_reason(q_data, k_scale, v, left_bound=left_bound, seq=seq,
                                                     bottom_right=bottom_right, sink=sink, flags=flags, out=out)
    if reason is not None:
        raise ValueError(reason)
    if sink is not None:
        _check_sink(sink, q_data)
    seq = check_seq(seq, q_data, k_data, bottom_right, offset)
    B, HQ, SQ, D = q_data.shape
    HKV, SKV = k_data.shape[1], k_data.shape[2]
    if HKV == 0 or HQ % HKV:
        raise ValueError(f"q heads ({HQ}) must be a multiple of k/v heads ({HKV})")
    kv_bf16 = k_scale is None
    if kv_bf16:  # bf16 K and V [B, HKV, SKV, D]; the scale operands are unread (k_data stands in)
        if tuple(k_data.shape) != (B, HKV, SKV, D) or tuple(v.shape) != (B, HKV, SKV, D):
            raise ValueError(f"bf16 k_data and v must both be [{B}, {HKV}, Skv, {D}], got {tuple(k_data.shape)} "
                             f"and {tuple(v.shape)}")
        # the scale operands are unread, except VS in a packed batch: the producer loads V's tail blocks itself
        v_data, ks = v, k_data
        vs = v if seq is not None and seq.packed else k_data
    else:
        v_data, vs = v.data, v.scale.view(torch.uint8)
        L = v_data.shape[3]
        if tuple(v_data.shape) != (B, HKV, D, L) or L < SKV or L % 32 or tuple(vs.shape) != (B, HKV, L // 32, D):
            raise ValueError(f"v.data must be [{B}, {HKV}, {D}, L >= {SKV}] (L a multiple of 32) and v.scale "
                             f"[{B}, {HKV}, L/32, {D}], got {tuple(v_data.shape)} and {tuple(vs.shape)}")
        ks = k_scale.view(torch.uint8)
    qs = q_scale.view(torch.uint8)
    for name, t in (("q_data", q_data), ("q_scale", qs), ("k_data", k_data), ("k_scale", ks), ("v.data", v_data),
                    ("v.scale", vs), ("out", out)):
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along its last axis, got strides {tuple(t.stride())}")
    packed = seq is not None and bool(seq.packed)
    if SKV == 0:  # no key: the Triton forward's O = 0 and stats (TMA cannot describe an empty tensor)
        if packed:
            out.masked_fill_((torch.arange(SQ, device=out.device) < seq.cu_seqlens_q[-1]).view(1, 1, SQ, 1), 0.0)
        else:
            out.zero_()
        if seq is not None and seq.packed:  # the sequences' rows (up to cu_q[-1]) only: -inf or the sink's stats
            rows = (torch.arange(SQ, device=out.device) < seq.cu_seqlens_q[-1]).view(1, 1, SQ, 1)
            fill = torch.tensor(float("-inf"), device=stats.device) if sink is None else \
                _sink_stats(sink, flags.log2_ps).view(1, -1, 1, 1)
            stats.copy_(torch.where(rows, fill, stats))
        elif sink is None:
            stats.fill_(float("-inf"))
        elif seq is None:
            stats.copy_(_sink_stats(sink, flags.log2_ps).view(1, -1, 1, 1).expand_as(stats))
        else:  # a padded batch: its sequences' rows get the sink's stats, the padding rows -inf
            cu = seq.cu_seqlens_q.to(torch.int64)
            valid = torch.arange(SQ, device=cu.device)[None, :] < (cu[1:] - cu[:-1])[:, None]  # [B, SQ]
            stats.copy_(torch.where(valid[:, None, :, None], _sink_stats(sink, flags.log2_ps).view(1, -1, 1, 1),
                                    torch.tensor(float("-inf"), device=stats.device)))
        return
    reason = None if checked else unsupported_reason(q_data, k_scale, v, k_data=k_data)  # TMA, grid's y limit
    if reason is not None:
        raise ValueError(reason)
    if B * HQ == 0 or SQ == 0:
        return
    default = (BF16_KV_STAGES[D], 1) if kv_bf16 else STAGES[D]
    ns, nf, pingpong = (*default, PINGPONG) if config is None else (*config, PINGPONG)[:3]
    if ns < 2 or nf < 1:
        raise ValueError(f"config needs at least two bf16 stages and one fp8 stage (a consumer holds block j - 1's V "
                         f"stage while it reads block j's K), got {ns} and {nf}")
    if kv_bf16:
        k_layout = v_layout = bf16_kv_tma_layout(D)
        v_block = [1, 1, BLOCK_N, D]
    else:
        k_layout, v_layout = tma_layouts(D)
        v_block = [1, 1, D, BLOCK_N]
    k_desc = TensorDescriptor(k_data, list(k_data.shape), list(k_data.stride()), [1, 1, BLOCK_N, D], k_layout)
    v_desc = TensorDescriptor(v_data, list(v_data.shape), list(v_data.stride()), v_block, v_layout)
    has_rb = right_bound is not None
    has_lb = left_bound is not None
    grid = (cdiv(grid_rows(seq, "q", SQ), BLOCK_M), grid_sequences(seq, B) * HQ)
    launch(  # Triton's dispatcher on a signature's first call, then the cached compiled kernel (`triton_launch`)
        _gluon_attn_fwd_kernel, grid,
        q_data, qs, k_desc, ks, v_desc, vs, out, stats,
        *q_data.stride()[:3], *qs.stride()[:3],
        *ks.stride()[:3], *vs.stride()[:3],
        *out.stride()[:3], *stats.stride()[:3],
        HQ, HQ // HKV, SQ, SKV, float(softmax_scale) * LOG2E, int(offset), int(right_bound) if has_rb else 0,
        int(left_bound) if has_lb else 0, stats if sink is None else sink,  # (SINK unread without a sink)
        *kernel_cu_seqlens(seq, stats),  # (unread for a dense call)
        HAS_RB=has_rb, BM=BLOCK_M, BN=BLOCK_N, D=D, NS=ns, NF=nf, CH=CHUNK_ROWS, PINGPONG=pingpong,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, HAS_LB=has_lb, HAS_SINK=sink is not None,
        KV_BF16=kv_bf16, VARLEN=seq is not None, BOTTOM_RIGHT=seq is not None and bool(bottom_right),
        PACKED=packed, P_MODE=flags.p_mode, PS=flags.log2_ps, num_warps=PARTITION_WARPS)


def _sink_stats(sink: torch.Tensor, log2_ps: float = 8.0) -> torch.Tensor:
    """The stats of a row that meets no key, [Hq], as the kernels' epilogue computes them from the sink's start
    (max m = sink * LOG2E, sum 2^log2_ps): (m + log2_ps - log2_ps) * LN2, each step one fp32 operation."""
    f32 = dict(dtype=torch.float32, device=sink.device)
    m = sink * torch.tensor(LOG2E, **f32)
    return (m + log2_ps - log2_ps) * torch.tensor(LN2.value, **f32)


#: the integer arguments Triton's launcher sees as multiples of 16 in a typical call (D 64/128, S a multiple of 16):
#: every stride except the K/Q scale rows' (D / 32 bytes) and the stats' row stride (1)
DIVISIBLE_INTS = ("sqb", "sqh", "sqs", "sqsb", "sqsh", "sksb", "sksh", "svsb", "svsh", "svss", "sob", "soh", "sos",
                  "slb", "slh", "SQ", "SKV")


def compile_sm90(d: int = 128, has_rb: bool = False, stages=None, regs=(CONSUMER_REGS, PRODUCER_REGS),
                 pingpong: bool = None, has_lb: bool = False, has_sink: bool = False, kv_bf16: bool = False,
                 varlen: bool = False, bottom_right: bool = False, packed: bool = False,
                 flags: KernelRecipe = DEFAULT_FLAGS, o_dtype: str = "bf16"):
    """The kernel compiled for sm_90a without a GPU (Triton's compiler and its ptxas) -> CompiledKernel (asm:
    ttgir, llir, ptx, cubin; metadata: shared memory). Pointers and DIVISIBLE_INTS as the launcher sees them in a
    typical call (16-byte aligned, multiples of 16); the stats' row stride stays a run-time i32 (the launcher
    specialises a 1 to a constant). has_lb / has_sink: the sliding-window and sink variants (LB a run-time i32,
    SINK an fp32 pointer). kv_bf16: the bf16-K/V variant (stages: its bf16 stages, an int). varlen /
    bottom_right: the padded-batch variant (CU_Q, CU_KV int32 pointers) and its per-sequence offset; packed (with
    varlen): the packed-batch variant (with kv_bf16, VS a bf16 pointer: V's tail blocks)."""
    fn = _gluon_attn_fwd_kernel
    if kv_bf16:
        ns, nf = (stages if stages is not None else BF16_KV_STAGES[d]), 1
        layout = bf16_kv_tma_layout(d)
        desc = f"tensordesc<bf16[1, 1, {BLOCK_N}, {d}],{layout!r}>"
        types = dict(k_desc=desc, v_desc=desc, **(dict(VS="*bf16") if packed else {}))
    else:
        ns, nf = stages if stages is not None else STAGES[d]
        k_layout, v_layout = tma_layouts(d)
        types = dict(k_desc=f"tensordesc<fp8e4nv[1, 1, {BLOCK_N}, {d}],{k_layout!r}>",
                     v_desc=f"tensordesc<fp8e4nv[1, 1, {d}, {BLOCK_N}],{v_layout!r}>")
    types = {"VS": "*u8", **types}
    types.update(Q="*fp8e4nv", QS="*u8", KS="*u8", O=f"*{o_dtype}", LSE="*fp32", SINK="*fp32", qk_scale="fp32",
                 CU_Q="*i32", CU_KV="*i32")
    constexprs = dict(HAS_RB=has_rb, BM=BLOCK_M, BN=BLOCK_N, D=d, NS=ns, NF=nf, CH=CHUNK_ROWS,
                      PINGPONG=PINGPONG if pingpong is None else pingpong,
                      CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], HAS_LB=has_lb, HAS_SINK=has_sink,
                      KV_BF16=kv_bf16, VARLEN=varlen, BOTTOM_RIGHT=bottom_right, PACKED=packed,
                      P_MODE=flags.p_mode, PS=flags.log2_ps)
    return compile_gluon_sm90(fn, types, constexprs, DIVISIBLE_INTS, PARTITION_WARPS)


def compile_gluon_sm90(fn, types: dict, constexprs: dict, divisible_ints, num_warps: int):
    """A Gluon kernel compiled for sm_90a without a GPU (Triton's compiler and its ptxas) -> CompiledKernel: the
    parameters in `types` (name -> Triton type string) typed so, the others i32 (constexprs: name -> value);
    every pointer and the ints named in divisible_ints marked multiples of 16, as the launcher sees them in a
    typical call."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    names = fn.arg_names
    signature = {p.name: ("constexpr" if p.is_constexpr else types.get(p.name, "i32")) for p in fn.params}
    divisible = [n for n, t in signature.items() if t.startswith("*")] + list(divisible_ints)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(c),): v for c, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


__all__ = ["attention_fwd_gluon", "unsupported_reason", "takes", "compile_sm90", "BLOCK_M", "BLOCK_N", "STAGES",
           "BF16_KV_STAGES", "BF16_KV_FASTER_HEAD_DIMS"]
