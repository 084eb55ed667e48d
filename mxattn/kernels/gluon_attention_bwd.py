"""Hopper (sm_90a) Gluon dK/dV kernel of the MXFP8 attention backward, warp-specialised, for the bf16-scratch
data path (mode "pre" of `triton_attention_bwd.attention_bwd`), every recipe variant's backward (RECIPE).
`dkdv_gluon` takes what `triton_attention_bwd._launch_dkdv` takes in mode "pre" and writes the same dK, dV;
`attention_bwd` runs it on Hopper for the chunks it `takes` (those where it is the faster kernel).

Scope: dense, padded and packed batches (a padded batch's lengths from its cu_seqlens, VARLEN: masks and query
blocks per sequence, bottom-right offsets per sequence, the padding key rows' dK = dV = 0; a packed batch, PACKED:
each sequence's K / V / dK / dV / LSE / delta rows from its first, its query-side scratch gapped by `bwd_prep`
(PACKED_GAP zero rows after each sequence, so no TMA tile reads another sequence's rows)), no mask, a causal-style band
(offset, right bound) and / or a sliding window (HAS_LB: keys kept where key > query + offset - left bound; the
query range of a KV tile ends before its last key - offset + left bound), head dims 64 and 128, MHA and GQA (the
CTA walks its KV head's group of query heads in order, as the Triton kernel). Sinks (passed to the kernel: the
backward keeps them in the stats) are refused (`unsupported_reason`); recipe variants are taken through the RECIPE
constexpr (`recipe_bits`: P rounded to bf16, dS rounded to bf16, the floor scale rule for dS's blocks, V a bf16
tensor read as it is; bf16 V not with a packed batch), each the Triton kernel's switch of the same name.

Inputs (mode "pre"): the query-side operands are the prep pass's bf16 scratch (`bwd_prep`: Q row- and
column-wise, dO row- and column-wise, each the exact dequantization of its MXFP8 copy, contiguous
[B, Hc, SQ, D]); K and V are FP8 row-wise (MXFP8Tensor) and are dequantized exactly to bf16 once per CTA
(`gluon_attention_fwd._dequant3`, triton_common.dequant_rows' arithmetic) into shared memory.

Numerics (the default recipe's; the variants switch P's and dS's roundings as the Triton kernel does): per element
the operations of `triton_attention_bwd._dkdv_block` (PRE), in the same order: S^T = K Q^T (bf16 wgmma, fp32), P^T =
exp2(S^T * qk_scale - lse * LOG2E) (rows without keys: lse -inf read as +inf), masked to 0 outside the band / past
the sequences; dV += E4M3(P^T * 256) dO_col (P rounded as round_p_to_bf16, equal to the Triton kernel's
`.to(float8e4nv).to(bfloat16)` on [0, 448]); dP^T = V dO^T; dS^T = P^T * (dP^T - delta) * sm_scale; dS
quantize-dequantized along s_q in blocks of 32 (qdq_rows on the [keys, queries] tile: int max of |bits|, the
round-up scale rule, E4M3 RNE, back to bf16); dK += dS_c^T Q_col; dV stored times 1/256. The query blocks here have
64 rows (`schedule`: 32 at D128 in some variants; the Triton kernel's are 32): the qdq blocks are the same
(32-aligned), and both GEMM chains add k16 slices of queries in ascending order into the same fp32 accumulator, so
dK and dV should agree bit for bit up to the tensor cores' internal sum order (tested on the GPU in
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
  After the last block its dK GEMM (`deferred_tail`). With DEFER off (the wide schedule at D128), each block's GEMMs are
  waited for within its step (its dV GEMM under dS) and its own stage released at the end. dK and dV stay in registers (D / 2 fp32 registers per thread
  each); the epilogue stores them. Registers per consumer thread: 240 (setmaxnreg), no spills at D64 / D128 in
  the offline sm_90a build.
* the producer warpgroup (24 registers): for t = 0, 1, ... over (query head of the group, query block) in the
  consumers' order, waits "empty" of stage t % NS and TMA-loads the four bf16 tiles [BLOCK_M, D] (4-D
  descriptors: rows past SQ read as zeros) and, with STATS_LOADS 5, the block's LSE and delta (3-D descriptors,
  [BLOCK_M] fp32 each) with one expect-tx "ready" arrival.

The protocol is simulated in tests/triton/test_gluon_bwd_protocol.py.
"""

import functools
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from .gluon_attention_fwd import (_chunk_layouts, _dequant3, _round_p_to_bf16, _seq_lengths, _seq_rows,
                                  compile_gluon_sm90)
from ..runtime.recipe_flags import DEFAULT_FLAGS, KernelRecipe
from ..runtime.triton_launch import cdiv, launch
from .triton_attention_fwd import check_seq
from .triton_bwd_prep import PACKED_GAP
from ..seqinfo import grid_rows, grid_sequences, kernel_cu_seqlens

#: key rows of one CTA (the Triton dK/dV kernel's BN in mode "pre": the same grid)
BLOCK_N = 128
#: query rows of one streamed block by head dim (a multiple of 32: whole qdq blocks of dS) in the narrow schedule
#: (`schedule`): each thread of a consumer holds BLOCK_M / 4 columns of S^T / dP^T next to dK and dV (D / 2 fp32
#: registers each); every variant builds without spills with these
BLOCK_M = {64: 64, 128: 32}
PARTITION_WARPS = 4
#: setmaxnreg of the second consumer warpgroup and of the producer; the default partition (first consumer) gets
#: what is left of 504 per thread
CONSUMER_REGS = 240
PRODUCER_REGS = 24
#: stages of the query-side ring by head dim: a stage holds four bf16 [BLOCK_M, D] tiles (D128: 64 KiB, D64:
#: 32 KiB) next to the CTA's bf16 K and V (D128: 64 KiB, D64: 32 KiB)
STAGES = {64: 4, 128: 4}
SUPPORTED_HEAD_DIMS = (64, 128)
#: software-pipelined dK (`_q_step`'s DEFER): query block t's dK GEMM is issued in step t + 1 after its S^T and dP^T,
#: and runs with the dV GEMM under the softmax and dS, stage t released at the end of step t + 1 (needs two stages
#: or more); each accumulator gets the same GEMMs in the same order, so dK and dV are the same bits. By head dim
#: (no wgmma serialisation by ptxas at either: checked offline, tests/triton/test_gluon_bwd_gpu.py). Measured on
#: an H200 (session 35, gluon_bwd_bench.py --variant waited:defer=0 --variant pipelined:defer=1, interleaved, same
#: bits): D128 0.85 of the waited kernel's time (B2 H16 S4096 dense; B8 H16 S1024 0.86), causal 0.97, GQA causal
#: S8192 0.99; D64 0.98-1.01
DEFER_WAITS = {64: True, 128: True}
#: the wide schedule by head dim, (block_m, stages, defer): 64-row query blocks at D128 fit the consumers' registers
#: only with the waited schedule (DEFER off; the pipelined dK makes ptxas serialise the wgmmas or spill) and two
#: stages (193 KB of shared memory), and only where the producer TMA-loads the LSE / delta (STATS 5) without a window
#: (the window and STATS 0 / 4 builds keep 56-136 stack bytes, with STL / LDL in the block loops; the padded ones
#: 16 bytes, none in the block loops, and causal bottom-right 56, a few LDL per masked block). Offline sm_90a SASS per
#: 64 queries and consumer warp: 712 instructions against 854 for two 32-row blocks (dense); the causal build keeps
#: 40 stack bytes of loop bounds (28 STL / LDL, one per masked block, none in the unmasked loop). Measured on an
#: H200 (session 38, gluon_bwd_bench.py, interleaved rounds, same bits), wide over narrow: B2 H16 S4096 D128 0.833
#: of the time, causal 0.906, B1 H32/8 S8192 causal 0.847, B8 H16 S1024 0.848; padded batches (session 39,
#: gluon_bwd_bench.py --padded, lengths S .. S - S/2B, causal bottom-right): B2 H16 S4096 0.857, causal 0.900,
#: B8 H16 S1024 0.886, B8 H16/4 S1024 causal 0.879. Packed batches keep the narrow schedule (`schedule`)
WIDE_SCHEDULE = {128: (64, 2, False)}


def schedule(d: int, stats_mode: int, packed: bool = False, has_lb: bool = False):
    """(block_m, stages, defer) of the dK/dV kernel at head dim d: WIDE_SCHEDULE[d] for a dense or padded batch
    without a window whose LSE / delta the producer TMA-loads (stats_mode 5), else (BLOCK_M[d], STAGES[d],
    DEFER_WAITS[d]): windows, modes 0 / 4 and packed batches (whose 64-row D128 builds keep 32-104 stack bytes,
    the causal ones with STL / LDL in the block loops; their 32-row builds none)."""
    if d in WIDE_SCHEDULE and stats_mode == 5 and not has_lb and not packed:
        return WIDE_SCHEDULE[d]
    return BLOCK_M[d], STAGES[d], DEFER_WAITS[d]


def resolve_schedule(d, stats_mode, packed, has_lb, block_m, stages, defer):
    """(block_m, stages or None for STAGES[d], defer) of a launch: `schedule`, or with any of block_m / stages /
    defer given (sweeps), those over the narrow schedule's."""
    if block_m is None and stages is None and defer is None:
        return schedule(d, stats_mode, packed, has_lb)
    return (BLOCK_M[d] if block_m is None else int(block_m), stages,
            DEFER_WAITS[d] if defer is None else bool(defer))
#: where a query block's LSE and delta come from (`_q_step`'s STATS; A/B runs; the same bits in every mode): 0 the
#: consumers' global loads in the step (session 35; the offline SASS has the LSE load's use, so its L2 latency,
#: between the S^T GEMM's first and second wgmma), 4 copied one step ahead by each consumer into shared memory
#: (cp.async), 5 TMA-loaded by the producer with the block's tiles (the fallback to 4 where TMA cannot describe
#: them: `stats_tma_ok`). Session 36 removed modes 1 (both loads at the step's start: 0.90-1.13 of mode 0's time)
#: and 2 / 3 (one step ahead in registers: spill at D128). Measured on an H200, gluon_bwd_bench.py's interleaved
#: rounds: mode 4 over mode 0 (session 36) D128 B2 H16 S4096 0.955, causal 0.835, B8 H16 S1024 0.936, B1 H32/8
#: S8192 causal 0.765; D64 B4 H16 S2048 0.791, B8 H16/4 S1024 causal 0.805, B16 H8 S512 0.961; mode 5 over mode 4
#: (session 37) D128 B2 H16 S4096 0.931, causal 0.905, B8 H16 S1024 0.936, B1 H32/8 S8192 causal 0.966; D64 B4 H16
#: S2048 0.896, B8 H16/4 S1024 causal 0.870
STATS_LOADS = {64: 5, 128: 5}
#: the modes `dkdv_gluon`'s stats_loads takes
STATS_MODES = (0, 4, 5)
#: head dims where the backward may run this kernel rather than the Triton one (`takes`, with MIN_QUERY_ROWS and
#: MHA_MIN_QUERY_ROWS)
FASTER_HEAD_DIMS = (64, 128)
#: per head dim, the fewest query rows a KV block must stream (the query length times the queries per KV head,
#: half of it under a causal band) for this kernel to beat the Triton one with GQA. Measured on an H200 (session
#: 31, gluon_bwd_bench.py, gluon / triton kernel time; benchmarks/results/nvidia-h200/session31/dkdv_bench.txt):
#: D128 causal S512 (256 rows) 1.33, dense S512 and causal S1024 (512) 1.00-1.01, dense S1024 0.90, causal S1024
#: GQA 16:4 (2048) 0.67; with the pipelined dK (session 35) causal S512 1.41, dense S512 0.93, causal S1024 1.01.
#: D64 GQA (session 35, before STATS_LOADS 4, which made it 0.79-0.96 of its time): from 1024 rows (group 4 causal
#: S512 0.82, group 2 dense S512 0.96; group 2 causal S1024 0.89, group 4 causal S1024 0.62, group 8 0.60)
MIN_QUERY_ROWS = {64: 1024, 128: 512}
#: the same for MHA (one query head per KV head: the CTA dequantizes its K / V tile for one head's queries only).
#: D64, measured on an H200 (session 36, STATS_LOADS 4, gluon / triton kernel time): B4 H16 S2048 dense (2048 rows)
#: 0.87, B16 H8 S512 dense (512 rows) 1.36 (session 35, before: 1.03-1.18 from 512 to 4096 rows); so from 2048
MHA_MIN_QUERY_ROWS = {64: 2048, 128: 512}

#: the bits of the backward kernels' RECIPE constexpr (`recipe_bits`): the recipe's backward switches
#: (`recipe_flags.KernelRecipe.bwd`); 0 is the default recipe, whose builds are the kernels' code without switches
P_BF16_BIT = gl.constexpr(1)
DS_BF16_BIT = gl.constexpr(2)
FLOOR_BIT = gl.constexpr(4)
V_RAW_BIT = gl.constexpr(8)


def recipe_bits(flags: KernelRecipe) -> int:
    """The RECIPE constexpr of a recipe's backward switches: P rounded to bf16 (p_quant "none"), dS rounded to bf16
    (ds_quant "bf16"), the OCP scale rule for dS's blocks (scale_rounding "floor"), V a bf16 tensor (v_operand
    "bf16"; the dK/dV kernel reads it as it is)."""
    sw = flags.bwd()
    return ((P_BF16_BIT.value if sw["P_BF16"] else 0) | (DS_BF16_BIT.value if sw["DS_BF16"] else 0)
            | (FLOOR_BIT.value if sw["FLOOR"] else 0) | (V_RAW_BIT.value if sw["V_RAW"] else 0))


LOG2E = 1.4426950408889634
LOG2E_K = gl.constexpr(LOG2E)
P_SCALE_K = gl.constexpr(256.0)
P_DESCALE_K = gl.constexpr(1.0 / 256.0)
WG0 = gl.constexpr(0)
WG1 = gl.constexpr(1)


# --------------------------------------------------------------------------- element helpers (triton_common's)
@constexpr_function
def _acc_layout(N, warps):
    """The wgmma accumulator layout of an [64, N] fp32 tile of one warpgroup (`warps` warps, m64 nN k16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, N, 16])


@gluon.jit
def _scale_exponent(abits, FLOOR: gl.constexpr = False):
    """triton_common.scale_exponent_from_bits: bits of amax -> E8M0 biased exponent (int32), the round-up rule, or
    with FLOOR the OCP rule (amax's exponent field minus 8, clamped to [0, 254], NaN 255)."""
    expo = (abits >> 23) & 0xFF
    mant = abits & 0x7FFFFF
    if FLOOR:
        e = gl.minimum(gl.maximum(expo - 8, 0), 254)
        return gl.where((expo == 255) & (mant != 0), 255, e)
    e = gl.minimum(gl.maximum(expo - 8 + (mant > 0x600000).to(gl.int32), 0), 254)
    return gl.where(expo == 255, gl.where(mant != 0, 255, 254), e)


@gluon.jit
def _qdq_cols32(x, BM: gl.constexpr, FLOOR: gl.constexpr = False):
    """triton_common.qdq_rows on the [keys, queries] tile x (fp32, BM queries) with blocks of 32 along the queries
    (axis 1) -> bf16 tile: the int max of |bits| per block, the round-up scale rule, E4M3 (RNE) and back. The
    [R, BM / 32, 32] view is a register relabelling of the wgmma accumulator layout (a quad of threads holds a
    block's 32 columns of a row: two shuffles per max), and so is the conversion of the result to the next
    GEMM's A operand (no shared memory in the SASS of the loop). FLOOR: the OCP scale rule (elements past 448
    saturate, as the Triton kernels' conversion does)."""
    R: gl.constexpr = x.shape[0]
    x3 = gl.reshape(x, [R, BM // 32, 32])
    e = gl.expand_dims(_scale_exponent(gl.max(x3.to(gl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), FLOOR), 2)
    inv = gl.where(e >= 254, 0x400000, (254 - e) << 23).to(gl.float32, bitcast=True)  # 2^(127 - e)
    q = (x3 * inv).to(gl.float8e4nv)
    pw = gl.where(e == 0, 0x400000, e << 23).to(gl.float32, bitcast=True)  # 2^(e - 127)
    return gl.reshape((q.to(gl.float32) * pw).to(gl.bfloat16), [R, BM])


@gluon.jit
def _ds_operand(ds, BM: gl.constexpr, RECIPE: gl.constexpr, layout: gl.constexpr):
    """dS [rows, BM] (fp32) as the next GEMM takes it, bf16 in `layout` (its A operand's): quantize-dequantized in
    blocks of 32 along axis 1 (`_qdq_cols32`, with RECIPE's scale rule), or with RECIPE's DS_BF16 bit rounded to
    bf16 (RNE)."""
    if (RECIPE & DS_BF16_BIT) != 0:
        return gl.convert_layout(ds.to(gl.bfloat16), layout)
    return gl.convert_layout(_qdq_cols32(ds, BM, (RECIPE & FLOOR_BIT) != 0), layout)


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
def issue_s_dp(a_s, b_s, a_dp, b_dp, s_zero):
    """S = a_s b_s and dP = a_dp b_dp issued as async wgmma (operands in shared memory, fresh fp32 accumulators
    like s_zero) -> (S, dP's token): S waited for, dP still in flight (`warpgroup_mma_wait` it)."""
    s_tok = warpgroup_mma(a_s, b_s, gl.zeros_like(s_zero), use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(a_dp, b_dp, gl.zeros_like(s_zero), use_acc=False, is_async=True)
    return warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, )), dp_tok


@gluon.jit
def release(empty, s):
    """A consumer warpgroup done with ring stage s (every GEMM reading it waited for): its "empty" arrival."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def gemm_release(acc, a, b, empty, s):
    """acc + a b (a from registers, b ring stage s's tile in shared memory) issued, waited for, then stage s
    released -> the new acc (the waited kernels' last GEMM of a step, and the deferred one after the last step)."""
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(a, b, acc, is_async=True), ))
    release(empty, s)
    return acc


@gluon.jit
def deferred_tail(t, acc, a, ring, empty, ROWS: gl.constexpr, D: gl.constexpr, NS: gl.constexpr):
    """DEFER, after a consumer's last step (t steps taken): the last step's deferred GEMM, acc + a (its quantized
    dS, registers) times its stage of `ring` ([NS, .., ROWS, D] tiles), then that stage released -> acc."""
    if t > 0:
        sp = (t - 1) % NS
        acc = gemm_release(acc, a, ring.index(sp).reshape([ROWS, D]), empty, sp)
    return acc


@gluon.jit
def _copy_stats(lse_dst, del_dst, lse_h, del_h, cols, ok, sls):
    """Asynchronous copies (cp.async, one group) of the LSE and delta of query rows `cols` of one head into the
    shared [BM] buffers lse_dst / del_dst (zeros where not ok: such columns are masked or never used). Each thread
    copies the columns it reads back (cols' layout), so its own wait_group is all the reader needs."""
    async_copy.async_copy_global_to_shared(lse_dst, lse_h + cols * sls, mask=ok)
    async_copy.async_copy_global_to_shared(del_dst, del_h + cols, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _log2_lse(lse):
    """LSE (natural log) -> log2 units for exp2, -inf (a row without keys) read as +inf (its P is 0)."""
    lse = lse * LOG2E_K
    return gl.where(lse == float("-inf"), float("inf"), lse)


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


# --------------------------------------------------------------------------- host side
@functools.lru_cache(maxsize=None)
def stats_tma_layout():
    """Shared layout of the LSE / delta TMA descriptors (STATS 5): blocks [1, 1, block_m] fp32, no swizzle (the
    same at every block_m)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def stats_tma_ok(t) -> bool:
    """Whether a TMA descriptor can describe t [B, H, SQ] fp32 (16-byte aligned, unit stride along SQ, the other
    strides multiples of 16 bytes)."""
    return (t.dtype == torch.float32 and t.dim() == 3 and t.stride(2) == 1 and t.data_ptr() % 16 == 0
            and not any(x % 4 for x in t.stride()[:2]))


@functools.lru_cache(maxsize=None)
def tma_layout(d: int, block_m: Optional[int] = None):
    """Shared layout of the bf16 scratch tiles' TMA descriptors at head dim d (block [1, 1, block_m, d],
    block_m BLOCK_M[d] by default)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M[d] if block_m is None else block_m, d],
                                                gl.bfloat16)


def _scratch_ok(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.dim() == 4 and t.stride(3) == 1
            and t.data_ptr() % 16 == 0 and not any(s % 8 for s in t.stride()[:3]))


def call_reason(kernel: str, left_bound, seq, bottom_right, sink, flags: KernelRecipe,
                window: bool = False) -> Optional[str]:
    """Why the Gluon backward kernel `kernel` ("dK/dV", "dQ") refuses a call's recipe, batch or mask (one
    sentence), or None: both take every recipe's backward switches (`recipe_bits`; bf16 V not with a packed batch,
    whose gapped scratch `kv_prep` does not write for it), dense and padded batches (with their per-sequence
    bottom-right offsets), packed ones on gapped scratch (`packed_scratch_reason`), no mask or a causal-style band
    (and, where `window`, a sliding window), no sinks."""
    if flags.v_raw and seq is not None and seq.packed:
        return f"the Gluon {kernel} kernel does not take a packed batch with bf16 V (v_operand='bf16')"
    if bottom_right and seq is None:
        return "bottom_right is for variable-length (padded) calls"
    if left_bound is not None and not window:
        return f"the Gluon {kernel} kernel takes no mask or a causal-style band only (no sliding window)"
    if sink is not None:
        return f"the Gluon {kernel} kernel is not built for attention sinks"
    return None


def packed_scratch_reason(name: str, scratch, rows: int, seq) -> Optional[str]:
    """Why `scratch` (a bf16 [1, H, R, D] tensor) is not a packed batch's gapped scratch over `rows` packed rows
    (R = rows + PACKED_GAP * sequences: `triton_bwd_prep.bwd_prep` / `kv_prep` with gap=PACKED_GAP), or None (also
    for a dense or padded call, seq None or not packed)."""
    if seq is None or not seq.packed or scratch is None:
        return None
    want = rows + PACKED_GAP * grid_sequences(seq, 1)
    if scratch.dim() != 4 or scratch.shape[2] != want:
        return (f"{name} of a packed batch must be the gapped scratch (bwd_prep / kv_prep gap=PACKED_GAP) of "
                f"{want} rows, got shape {tuple(scratch.shape)}")
    return None


def layout_reason(scratch, grid_bh, heads: str) -> Optional[str]:
    """Why a Gluon backward kernel cannot launch on its operands (one sentence), or None: the first of `scratch`
    ((name, bf16 tensor or None)) that a TMA descriptor cannot describe, or a grid of grid_bh = (batch, heads)
    programs along y (`heads`: "KV" or "query") past CUDA's limit."""
    for name, t in scratch:
        if t is not None and not _scratch_ok(t):
            return (f"{name} must be 16-byte aligned with unit stride along D and strides multiple of 16 bytes "
                    f"(TMA), got strides {tuple(t.stride())}")
    if grid_bh[0] * grid_bh[1] > 65535:
        return (f"{grid_bh[0]} x {grid_bh[1]} (batch x {heads} heads) programs exceed the CUDA grid's y limit 65535; "
                "split the batch")
    return None


def ring_stages(stages, default: int, defer: bool = False) -> int:
    """The ring depth of a launch: the override `stages` (>= 1, >= 2 with deferred waits, else ValueError) or the
    kernel's default."""
    ns = default if stages is None else int(stages)
    least = 2 if defer else 1
    if ns < least:
        raise ValueError(f"stages must be >= {least}{' with deferred GEMM waits' if defer else ''}, got {ns}")
    return ns


def sequences_by_heads(seq, batch: int, heads: int):
    """(sequences, heads) along a Gluon backward grid's y axis: a packed batch's sequences, else the batch."""
    return grid_sequences(seq, batch), heads


def check_delta(delta, SQ: int) -> None:
    """Raise ValueError unless delta [B, H, SQ] has the unit stride along SQ that the kernels assume."""
    if delta.stride(2) != 1 and SQ > 1:
        raise ValueError(f"delta must have unit stride along SQ, got strides {tuple(delta.stride())}")


def unsupported_reason(q_r, k_row, v_row, *, left_bound=None, seq=None, bottom_right=False, sink=None,
                       flags: KernelRecipe = DEFAULT_FLAGS, q_c=None, do_r=None, do_c=None) -> Optional[str]:
    """None where `dkdv_gluon` runs the call, else why not (one sentence). q_r (and q_c, do_r, do_c where given):
    the "pre" backward's bf16 scratch; k_row, v_row: K's and V's row-wise MXFP8Tensors."""
    reason = call_reason("dK/dV", left_bound, seq, bottom_right, sink, flags, window=True)
    if reason is not None:
        return reason
    for name, t in (("q_r", q_r), ("q_c", q_c), ("do_r", do_r), ("do_c", do_c)):
        if t is None and name != "q_r":
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
            return f"{name} must be the bf16 scratch of the 'pre' backward (mode 'pre' only)"
    if q_r.shape[3] not in SUPPORTED_HEAD_DIMS:
        return f"the Gluon dK/dV kernel takes head dims {SUPPORTED_HEAD_DIMS}, got {q_r.shape[3]}"
    if isinstance(k_row, torch.Tensor) or not isinstance(getattr(k_row, "data", None), torch.Tensor):
        return "k_row must be an FP8 row-wise MXFP8Tensor"
    if flags.v_raw:
        if not isinstance(v_row, torch.Tensor) or v_row.dtype != torch.bfloat16 or \
                tuple(v_row.shape) != tuple(k_row.data.shape):
            return "with bf16 V (v_operand='bf16') v_row must be a bf16 tensor of k_row's shape"
    elif isinstance(v_row, torch.Tensor) or not isinstance(getattr(v_row, "data", None), torch.Tensor):
        return "v_row must be an FP8 row-wise MXFP8Tensor"
    return layout_reason((("q_r", q_r), ("q_c", q_c), ("do_r", do_r), ("do_c", do_c)),
                         sequences_by_heads(seq, k_row.data.shape[0], k_row.data.shape[1]), "KV")


def takes(q_r, k_row, v_row, right_bound=None, left_bound=None, **kwargs) -> bool:
    """Whether `attention_bwd` runs this kernel for a chunk: it takes the call (`unsupported_reason`, same
    arguments) at a head dim where it is the faster kernel (FASTER_HEAD_DIMS) with query rows per KV block enough to
    repay its set-up (query length times queries per KV head, halved under a causal band, i.e. right_bound not
    None; under a sliding window its width plus BLOCK_N where fewer, the rows a KV block meets:
    MIN_QUERY_ROWS with GQA, MHA_MIN_QUERY_ROWS with one query head per KV head). The window's threshold is this
    reasoning's, not a measurement."""
    d = q_r.shape[3]
    if d not in FASTER_HEAD_DIMS:
        return False
    hkv = getattr(getattr(k_row, "data", None), "shape", (0, 0))[1]
    group = q_r.shape[1] // hkv if hkv else 1
    if left_bound is not None and int(left_bound) + BLOCK_N < q_r.shape[2]:
        rows = (int(left_bound) + BLOCK_N) * group
    else:
        rows = q_r.shape[2] * group
        rows = rows if right_bound is None else rows // 2
    least = MIN_QUERY_ROWS[d] if group > 1 else MHA_MIN_QUERY_ROWS[d]
    return rows >= least and unsupported_reason(q_r, k_row, v_row, left_bound=left_bound, **kwargs) is None


def dkdv_gluon(q_r, q_c, k_row, v_row, do_r, do_c, stats, delta, dk, dv, *, softmax_scale: float, offset: int,
               left_bound=None, right_bound=None, seq=None, bottom_right: bool = False,
               flags: KernelRecipe = DEFAULT_FLAGS, stages: Optional[int] = None, block_m: Optional[int] = None,
               defer: Optional[bool] = None, stats_loads: Optional[int] = None, checked: bool = False) -> None:
    """The dK/dV pass of the "pre" backward for one chunk of heads: what `triton_attention_bwd._launch_dkdv`
    takes in mode "pre" (q_r, q_c, do_r, do_c the chunk's bf16 scratch [B, Hc, SQ, D] from `bwd_prep`; k_row,
    v_row the chunk's KV heads of K's and V's row-wise MXFP8Tensors; stats [B, Hc, SQ, 1] fp32 and delta
    [B, Hc, SQ] fp32 (unit stride along SQ) the chunk's slices; dk, dv [B, Hkv_c, SKV, D] with unit stride along
    D) and the same mask arguments; writes dk and dv. stages: ring stages override (>= 1, >= 2 with deferred
    waits); block_m: query rows per streamed block override (a multiple of 32; sweeps); defer: the
    software-pipelined dK GEMM on or off (A/B runs, same bits); without any of these three `schedule` picks them,
    with some the others are the narrow schedule's (BLOCK_M, STAGES, DEFER_WAITS); stats_loads:
    where the LSE / delta come from (A/B runs; one of STATS_MODES, STATS_LOADS[D] by default, same bits). seq: None
    (dense) or a padded batch's SeqInfo (sequence b is rows 0 .. len of batch b; bottom_right with it: each
    sequence's diagonal offset len_kv - len_q, offset 0): masks and query blocks per sequence, the padding key rows'
    dK = dV = 0; or a packed batch's (thd: K, V, dk, dv [1, Hkv_c, TKV, D], stats [1, Hc, TQ, 1], delta [1, Hc, TQ],
    the scratch gapped, [1, Hc, TQ + PACKED_GAP * B, D]: `bwd_prep`'s gap): each sequence's dK, dV rows written,
    the rows between or after them untouched. Raises ValueError for what it does not take (`unsupported_reason`)."""
    reason = None if checked else unsupported_reason(q_r, k_row, v_row, left_bound=left_bound, seq=seq,
                                                     bottom_right=bottom_right, flags=flags, q_c=q_c, do_r=do_r,
                                                     do_c=do_c)
    if reason is not None:
        raise ValueError(reason)
    B, HQ, SQ, D = q_r.shape
    v_raw = bool(flags.v_raw)
    k_data = k_row.data
    v_data = v_row if v_raw else v_row.data
    HKV, SKV = k_data.shape[1], k_data.shape[2]
    packed = seq is not None and bool(seq.packed)
    rows_q = stats.shape[2]  # the LSE's query rows (a packed batch's scratch has PACKED_GAP more per sequence)
    if not checked:
        check_seq(seq, stats if packed else q_r, k_data, bottom_right, offset)
        reason = packed_scratch_reason("q_r", q_r, rows_q, seq)
        if reason is not None:
            raise ValueError(reason)
    if HKV == 0 or HQ % HKV:
        raise ValueError(f"q heads ({HQ}) must be a multiple of k/v heads ({HKV})")
    for name, t in (("q_c", q_c), ("do_r", do_r), ("do_c", do_c)):
        if tuple(t.shape) != (B, HQ, SQ, D):
            raise ValueError(f"{name} must have q_r's shape {(B, HQ, SQ, D)}, got {tuple(t.shape)}")
    ks = k_row.scale.view(torch.uint8)
    vs = ks if v_raw else v_row.scale.view(torch.uint8)  # (V_RAW: VS unread)
    for name, t in (("k_row.data", k_data), ("k_row.scale", ks), ("v_row.data", v_data), ("v_row.scale", vs),
                    ("dk", dk), ("dv", dv)):
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along its last axis, got strides {tuple(t.stride())}")
    check_delta(delta, rows_q)
    if B * HKV == 0 or SKV == 0:
        return
    if rows_q == 0:  # no query: zero gradients (TMA cannot describe an empty tensor)
        dk.zero_()
        dv.zero_()
        return
    st = STATS_LOADS[D] if stats_loads is None else int(stats_loads)
    if st not in STATS_MODES:
        raise ValueError(f"stats_loads must be one of {STATS_MODES}, got {stats_loads!r}")
    lse3 = stats[..., 0]  # [B, Hc, SQ] (strides slb, slh, sls)
    if st == 5 and (packed or not (stats_tma_ok(lse3) and stats_tma_ok(delta))):
        # TMA cannot describe them (SQ not a multiple of 4, or an offset view), or a packed batch's blocks would start
        # at rows TMA cannot begin a box at (its sequences' first rows: the innermost dimension's box start must
        # be 16-byte aligned; on an H200 such a launch stopped with an illegal instruction): the consumers copy them
        st = 4
    has_rb = right_bound is not None
    has_lb = left_bound is not None
    bm, stages, defer = resolve_schedule(D, st, packed, has_lb, block_m, stages, defer)
    ns = ring_stages(stages, STAGES[D], defer)
    if bm < 32 or bm % 32:
        raise ValueError(f"block_m must be a positive multiple of 32, got {bm}")
    layout = tma_layout(D, bm)
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bm, D], layout)
             for t in (q_r, q_c, do_r, do_c)]
    grid = (cdiv(grid_rows(seq, "kv", SKV), BLOCK_N), grid_sequences(seq, B) * HKV)
    if st == 5:
        sl = stats_tma_layout()
        descs += [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bm], sl) for t in (lse3, delta)]
    else:
        descs += descs[:2]
    launch(
        _gluon_dkdv_kernel, grid,
        *descs, k_data, ks, v_data, vs, stats, delta, dk, dv,
        *k_data.stride()[:3], *ks.stride()[:3], *v_data.stride()[:3], *vs.stride()[:3],
        *stats.stride()[:3], delta.stride(0), delta.stride(1), *dk.stride()[:3], *dv.stride()[:3],
        HKV, HQ // HKV, SQ, SKV, float(softmax_scale) * LOG2E, float(softmax_scale), int(offset),
        int(right_bound) if has_rb else 0, *kernel_cu_seqlens(seq, stats),  # (unread for a dense call)
        int(left_bound) if has_lb else 0,
        HAS_RB=has_rb, BM=bm, BN=BLOCK_N, D=D, NS=ns, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, DEFER=defer,
        STATS=st, VARLEN=seq is not None, BOTTOM_RIGHT=seq is not None and bool(bottom_right), HAS_LB=has_lb,
        PACKED=packed, GAP=PACKED_GAP if packed else 0, RECIPE=recipe_bits(flags), num_warps=PARTITION_WARPS)


#: the integer arguments Triton's launcher sees as multiples of 16 in a typical call (D 64/128, S a multiple of 16):
#: every stride except the scales' rows' (D / 32 bytes), the stats' row stride (1), and the head counts
DIVISIBLE_INTS = ("skb", "skh", "sks", "sksb", "sksh", "svb", "svh", "svs", "svsb", "svsh", "slb", "slh", "sdelb",
                  "sdelh", "sdkb", "sdkh", "sdks", "sdvb", "sdvh", "sdvs", "SQ", "SKV")


def compile_sm90(d: int = 128, has_rb: bool = False, stages=None, regs=(CONSUMER_REGS, PRODUCER_REGS),
                 dk_dtype: str = "bf16", unit_stats: bool = True, block_m: Optional[int] = None,
                 defer: Optional[bool] = None, stats_loads: Optional[int] = None, varlen: bool = False,
                 bottom_right: bool = False, has_lb: bool = False, packed: bool = False,
                 flags: KernelRecipe = DEFAULT_FLAGS):
    """The kernel compiled for sm_90a without a GPU (Triton's compiler and its ptxas) -> CompiledKernel, as
    `gluon_attention_fwd.compile_sm90` (pointers and DIVISIBLE_INTS as the launcher sees them in a typical
    call). packed (varlen implied): the packed-batch variant (PACKED, GAP); flags: a recipe's (RECIPE)."""
    varlen = varlen or packed
    fn = _gluon_dkdv_kernel
    st = (4 if packed else STATS_LOADS[d]) if stats_loads is None else stats_loads  # (packed: `dkdv_gluon`'s 4)
    bm, stages, defer = resolve_schedule(d, st, packed, has_lb, block_m, stages, defer)
    ns = stages if stages is not None else STAGES[d]
    layout = tma_layout(d, bm)
    desc = f"tensordesc<bf16[1, 1, {bm}, {d}],{layout!r}>"
    sdesc = f"tensordesc<fp32[1, 1, {bm}],{stats_tma_layout()!r}>" if st == 5 else desc
    types = dict(qr_desc=desc, qc_desc=desc, dor_desc=desc, doc_desc=desc, lse_desc=sdesc, del_desc=sdesc,
                 K="*fp8e4nv", KS="*u8", V="*bf16" if flags.v_raw else "*fp8e4nv",
                 VS="*u8", LSE="*fp32", DELTA="*fp32", DK=f"*{dk_dtype}", DV=f"*{dk_dtype}", qk_scale="fp32",
                 sm_scale="fp32", CU_Q="*i32", CU_KV="*i32")
    constexprs = dict(HAS_RB=has_rb, BM=bm, BN=BLOCK_N, D=d, NS=ns, CONSUMER_REGS=regs[0],
                      PRODUCER_REGS=regs[1], DEFER=defer,
                      STATS=st, VARLEN=varlen, BOTTOM_RIGHT=bottom_right, HAS_LB=has_lb, PACKED=packed,
                      GAP=PACKED_GAP if packed else 0, RECIPE=recipe_bits(flags))
    if unit_stats:  # the launcher's specialisation of the stats' row stride 1 (contiguous [B, H, S, 1] stats)
        constexprs["sls"] = 1
    return compile_gluon_sm90(fn, types, constexprs, DIVISIBLE_INTS, PARTITION_WARPS)


__all__ = ["dkdv_gluon", "takes", "unsupported_reason", "compile_sm90", "FASTER_HEAD_DIMS", "MHA_MIN_QUERY_ROWS",
           "MIN_QUERY_ROWS", "BLOCK_M", "BLOCK_N", "STAGES", "DEFER_WAITS", "STATS_LOADS",
           "STATS_MODES", "WIDE_SCHEDULE", "schedule", "resolve_schedule"]
