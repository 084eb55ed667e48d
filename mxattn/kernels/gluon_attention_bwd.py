"""Hopper (sm_90a) Gluon dK/dV kernel of the MXFP8 attention backward, host side: which calls it takes
(`unsupported_reason`, `takes`), its schedule (`schedule`: query block rows, ring stages, deferred dK GEMM, where the
LSE / delta come from), the launch (`dkdv_gluon`) and the offline sm_90a build (`compile_sm90`); also the call checks
the Gluon dQ launcher shares (`call_reason`, `layout_reason`, `packed_scratch_reason`, `ring_stages`). The
warp-specialised kernel is `gluon_dkdv_kernel`'s, for the bf16-scratch data path (mode "pre" of
`triton_attention_bwd.attention_bwd`), every recipe variant's backward (RECIPE). `dkdv_gluon` takes what
`triton_attention_bwd._launch_dkdv` takes in mode "pre" and writes the same dK, dV; `attention_bwd` runs it on
Hopper for the chunks it `takes` (those where it is the faster kernel).

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
"""

import functools
from typing import Optional

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gluon_attention_fwd import compile_gluon_sm90
from .gluon_bwd_common import LOG2E, recipe_bits
from .gluon_dkdv_kernel import _gluon_dkdv_kernel
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
#: or more); each accumulator gets the same GEMMs in the same order, so dK and dV are the same bits. On at both head
#: dims: ptxas does not serialise the wgmmas there (tests/triton/test_gluon_bwd_gpu.py), and the overlap is faster
#: at D128, on par at D64
DEFER_WAITS = {64: True, 128: True}
#: the wide schedule by head dim, (block_m, stages, defer): 64-row query blocks at D128 need fewer instructions per
#: query than two 32-row blocks and run faster, but fit the consumers' registers only with the waited schedule
#: (DEFER off: the pipelined dK makes ptxas serialise the wgmmas or spill), two stages (193 KB of shared memory) and
#: the producer TMA-loading the LSE / delta (STATS 5) without a window: the other builds keep loop bounds on the
#: stack inside the block loops. Packed batches keep the narrow schedule (`schedule`)
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


#: where a query block's LSE and delta come from (`_q_step`'s STATS; the same bits in every mode): 0 the consumers'
#: global loads in the step (the LSE load's L2 latency lands between the S^T GEMM's two wgmmas), 4 copied one step
#: ahead by each consumer into shared memory (cp.async), 5 TMA-loaded by the producer with the block's tiles (the
#: fallback to 4 where TMA cannot describe them: `stats_tma_ok`). 5 is the fastest at both head dims, 4 next
STATS_LOADS = {64: 5, 128: 5}
#: the modes `dkdv_gluon`'s stats_loads takes
STATS_MODES = (0, 4, 5)
#: head dims where the backward may run this kernel rather than the Triton one (`takes`, with MIN_QUERY_ROWS and
#: MHA_MIN_QUERY_ROWS)
FASTER_HEAD_DIMS = (64, 128)
#: per head dim, the fewest query rows a KV block must stream (the query length times the queries per KV head,
#: half of it under a causal band) for this kernel to beat the Triton one with GQA: the CTA's set-up (its K / V
#: tiles dequantized into shared memory, the pipeline filled) is repaid only over enough query blocks
MIN_QUERY_ROWS = {64: 1024, 128: 512}
#: the same for MHA (one query head per KV head: the CTA dequantizes its K / V tile for one head's queries only,
#: so at D64 it takes more rows to repay)
MHA_MIN_QUERY_ROWS = {64: 2048, 128: 512}


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
    software-pipelined dK GEMM on or off (comparisons, same bits); without any of these three `schedule` picks them,
    with some the others are the narrow schedule's (BLOCK_M, STAGES, DEFER_WAITS); stats_loads:
    where the LSE / delta come from (comparisons; one of STATS_MODES, STATS_LOADS[D] by default, same bits). seq: None
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
        # be 16-byte aligned, else the launch faults with an illegal instruction): the consumers copy them
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
