"""Hopper (sm_90a) Gluon dQ kernel of the MXFP8 attention backward, host side: which calls it takes
(`unsupported_reason`, `takes`), its tiles and ring stages, the launch (`dq_gluon`) and the offline sm_90a build
(`compile_sm90`). The warp-specialised kernel is `gluon_dq_kernel`'s, for the bf16-scratch data path (mode "pre" of
`triton_attention_bwd.attention_bwd`), every recipe variant's backward. `dq_gluon` takes what
`triton_attention_bwd._launch_dq` takes in mode "pre" and writes the same dQ; `attention_bwd` (gluon_dq) runs it
for each head chunk it `takes`.

Scope: dense, padded and packed batches (VARLEN: each sequence's lengths from cu_seqlens, bottom-right offsets per
sequence, padding rows dQ = 0; PACKED: LSE / delta / dQ rows from each sequence's first, the scratch gapped by
`bwd_prep` / `kv_prep`), no mask, a causal-style band (offset, right bound; negative offsets included:
rows without keys get dQ = 0) and / or a sliding window (HAS_LB: the KV walk starts at the window's first block,
blocks cut by its left edge masked), head dims 64 and 128, MHA and GQA (query head hq reads KV head hq // GROUP).
Sinks (passed to the kernel: the backward keeps them in the stats) are refused (`unsupported_reason`); recipe
variants through RECIPE (`gluon_bwd_common.recipe_bits`: dS rounded to bf16 or its blocks' scale rule; a bf16 V
is the vr scratch as `kv_prep` hands it, not with a packed batch).
"""

import functools
from typing import Optional

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# partition warps, setmaxnreg of the consumers / the producer, head dims: the dK/dV kernel's
from .gluon_attention_bwd import (CONSUMER_REGS, PARTITION_WARPS, PRODUCER_REGS, SUPPORTED_HEAD_DIMS, call_reason,
                                  check_delta, layout_reason, packed_scratch_reason, ring_stages, sequences_by_heads)
from .gluon_attention_fwd import compile_gluon_sm90
from .gluon_bwd_common import LOG2E, recipe_bits
from .gluon_dq_kernel import _gluon_dq_kernel
from ..runtime.recipe_flags import DEFAULT_FLAGS, KernelRecipe
from ..runtime.triton_launch import cdiv, launch
from .triton_attention_fwd import check_seq
from .triton_bwd_prep import PACKED_GAP
from ..seqinfo import grid_rows, grid_sequences, kernel_cu_seqlens

#: query rows of one CTA: two consumer warpgroups of 64 (the Triton dQ kernel's BM in mode "pre": the same grid)
BLOCK_M = 128
#: keys of one streamed KV block by head dim (a multiple of 32: whole qdq blocks of dS). Each consumer thread
#: holds BLOCK_N / 2 fp32 registers of S and of dP next to dQ's D / 2
BLOCK_N = {64: 128, 128: 64}
#: head dims where the backward runs this kernel rather than the Triton dQ kernel (`takes`), from enough keys on
#: (MIN_KEYS): it is the faster one at both, with dQ bit-equal to the Triton kernel's
FASTER_HEAD_DIMS = (64, 128)
#: per head dim, the fewest keys a query block must stream (the KV length, half of it under a causal band) for
#: this kernel to beat the Triton dQ kernel: its warp-specialised pipeline costs a set-up that short rows do not
#: repay, more so at D64
MIN_KEYS = {64: 2048, 128: 512}
#: stages of the KV ring by head dim: a stage holds three bf16 [BLOCK_N, D] tiles (48 KiB at D128 and D64) next
#: to the CTA's bf16 Q and dO (D128: 64 KiB, D64: 32 KiB)
STAGES = {64: 3, 128: 3}
#: software-pipelined dQ (`_kv_step`'s DEFER): KV block t's dQ GEMM is issued in step t + 1 after its S and dP and
#: runs under the softmax and dS, stage t released at the end of step t + 1 (needs two stages or more); the dQ
#: accumulator gets the same GEMMs in the same order, so dQ is the same bits. Off by default: slower at D128 (the
#: dK/dV kernel's pipelined dK gains, its GEMMs being smaller next to the softmax), and at D64 (KV blocks of 128
#: keys: S, dP and the carried dS take 160 registers a thread) ptxas serialises the wgmmas. A launch option (`defer`)
DEFER_WAITS = {64: False, 128: False}


@functools.lru_cache(maxsize=None)
def tma_layout(rows: int, d: int):
    """Shared layout of a bf16 scratch tile's TMA descriptor (block [1, 1, rows, d])."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, d], gl.bfloat16)


def unsupported_reason(q_r, k_r, k_c, v_r, do_r, *, left_bound=None, seq=None, bottom_right=False, sink=None,
                       flags: KernelRecipe = DEFAULT_FLAGS) -> Optional[str]:
    """None where `dq_gluon` runs the call, else why not (one sentence). q_r, do_r: the "pre" backward's bf16
    scratch of Q and dO [B, Hc, SQ, D]; k_r, k_c, v_r: `kv_prep`'s bf16 scratch [B, Hkv_c, SKV, D]."""
    reason = call_reason("dQ", left_bound, seq, bottom_right, sink, flags, window=True)
    if reason is not None:
        return reason
    ops = (("q_r", q_r), ("k_r", k_r), ("k_c", k_c), ("v_r", v_r), ("do_r", do_r))
    for name, t in ops:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.dim() != 4:
            return f"{name} must be 4-D bf16 scratch of the 'pre' backward (mode 'pre' only)"
    if q_r.shape[3] not in SUPPORTED_HEAD_DIMS:
        return f"the Gluon dQ kernel takes head dims {SUPPORTED_HEAD_DIMS}, got {q_r.shape[3]}"
    return layout_reason(ops, sequences_by_heads(seq, q_r.shape[0], q_r.shape[1]), "query")


def takes(q_r, k_r, k_c, v_r, do_r, right_bound=None, left_bound=None, **kwargs) -> bool:
    """Whether `attention_bwd` runs this kernel for a chunk: it takes the call (`unsupported_reason`, same
    arguments) at a head dim where it is the faster kernel (FASTER_HEAD_DIMS) with keys enough to repay its
    set-up (MIN_KEYS: the KV length, halved under a causal band, i.e. right_bound not None; under a sliding window
    its width plus BLOCK_M where fewer, the keys a query tile meets: this reasoning's, not a measurement)."""
    d = q_r.shape[3]
    if d not in FASTER_HEAD_DIMS:
        return False
    if left_bound is not None and int(left_bound) + BLOCK_M < k_r.shape[2]:
        keys = int(left_bound) + BLOCK_M
    else:
        keys = k_r.shape[2] if right_bound is None else k_r.shape[2] // 2
    return keys >= MIN_KEYS[d] and unsupported_reason(q_r, k_r, k_c, v_r, do_r, left_bound=left_bound,
                                                      **kwargs) is None


def dq_gluon(q_r, k_r, k_c, v_r, do_r, stats, delta, dq, *, softmax_scale: float, offset: int, left_bound=None,
             right_bound=None, seq=None, bottom_right: bool = False, flags: KernelRecipe = DEFAULT_FLAGS,
             stages: Optional[int] = None, defer: Optional[bool] = None, block_n: Optional[int] = None,
             checked: bool = False) -> None:
    """The dQ pass of the "pre" backward for one chunk of heads: the tensors `triton_attention_bwd._launch_dq`
    takes in mode "pre", in its order (q_r, do_r [B, Hc, SQ, D] the chunk's bf16 scratch from `bwd_prep`; k_r,
    k_c, v_r [B, Hkv_c, SKV, D] the chunk's bf16 scratch from `kv_prep`; stats [B, Hc, SQ, 1] fp32 and delta
    [B, Hc, SQ] fp32 (unit stride along SQ) the chunk's slices; dq [B, Hc, SQ, D] with unit stride along D, e.g.
    a head slice of the full dQ) and attention_bwd's mask arguments; writes dq. stages: ring stages override
    (>= 1, >= 2 with deferred waits); defer: the software-pipelined dQ GEMM on or off (comparisons; DEFER_WAITS[D]
    by default, same bits); block_n: keys per KV block override (a multiple of 32; sweeps, BLOCK_N[D] by
    default). seq: None (dense) or a padded batch's SeqInfo (bottom_right with it: each sequence's offset
    len_kv - len_q, offset 0): masks and KV blocks per sequence, the padding rows' dQ = 0; or a packed batch's
    (thd: stats [1, Hc, TQ, 1], delta [1, Hc, TQ], dq [1, Hc, TQ, D] packed; the scratch gapped, q_r / do_r
    [1, Hc, TQ + PACKED_GAP * B, D] and k_r / k_c / v_r [1, Hkv_c, TKV + PACKED_GAP * B, D]: `bwd_prep` /
    `kv_prep` with gap): each sequence's dQ rows written, the rows between or after them untouched. Raises
    ValueError for what it does not take (`unsupported_reason`)."""
    reason = None if checked else unsupported_reason(q_r, k_r, k_c, v_r, do_r, left_bound=left_bound, seq=seq,
                                                     bottom_right=bottom_right, flags=flags)
    if reason is not None:
        raise ValueError(reason)
    B, HQ, SQ, D = q_r.shape
    HKV, SKV = k_r.shape[1], k_r.shape[2]
    packed = seq is not None and bool(seq.packed)
    gap = PACKED_GAP if packed else 0
    rows_q = stats.shape[2]  # the packed rows (the gapped scratch has gap more per sequence)
    n_keys = SKV - gap * grid_sequences(seq, B)  # the key rows, 0: no key
    if HKV == 0 or HQ % HKV:
        raise ValueError(f"q heads ({HQ}) must be a multiple of k/v heads ({HKV})")
    for name, t, want in (("do_r", do_r, (B, HQ, SQ, D)), ("dq", dq, (B, HQ, rows_q, D)),
                          ("k_c", k_c, (B, HKV, SKV, D)), ("v_r", v_r, (B, HKV, SKV, D))):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if dq.stride(3) != 1:
        raise ValueError(f"dq must have unit stride along D, got strides {tuple(dq.stride())}")
    check_delta(delta, rows_q)
    if not checked:
        check_seq(seq, q_r, k_r, bottom_right, offset)
        reason = packed_scratch_reason("q_r", q_r, rows_q, seq)
        if reason is None and n_keys < 0:
            reason = f"k_r of a packed batch must be the gapped scratch (kv_prep gap=PACKED_GAP), got {SKV} rows"
        if reason is not None:
            raise ValueError(reason)
    if dq.numel() == 0 or n_keys == 0:  # no key: zero gradient (TMA cannot describe an empty tensor)
        dq.zero_()
        return
    defer = DEFER_WAITS[D] if defer is None else bool(defer)
    ns = ring_stages(stages, STAGES[D], defer)
    bn = BLOCK_N[D] if block_n is None else int(block_n)
    if bn < 32 or bn % 32 or (packed and bn > PACKED_GAP):
        raise ValueError(f"block_n must be a positive multiple of 32{' up to PACKED_GAP' if packed else ''}, "
                         f"got {bn}")
    q_layout, kv_layout = tma_layout(BLOCK_M // 2, D), tma_layout(bn, D)
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK_M // 2, D], q_layout)
             for t in (q_r, do_r)]
    descs += [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bn, D], kv_layout) for t in (k_r, v_r, k_c)]
    has_rb = right_bound is not None
    has_lb = left_bound is not None
    launch(
        _gluon_dq_kernel, (cdiv(grid_rows(seq, "q", rows_q), BLOCK_M), grid_sequences(seq, B) * HQ),
        *descs, stats, delta, dq, *stats.stride()[:3], delta.stride(0), delta.stride(1), *dq.stride()[:3],
        HQ, HQ // HKV, SQ, SKV, float(softmax_scale) * LOG2E, float(softmax_scale), int(offset),
        int(right_bound) if has_rb else 0, *kernel_cu_seqlens(seq, stats),  # (unread for a dense call)
        int(left_bound) if has_lb else 0,
        HAS_RB=has_rb, BM=BLOCK_M, BN=bn, D=D, NS=ns, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        DEFER=defer, VARLEN=seq is not None, BOTTOM_RIGHT=seq is not None and bool(bottom_right), HAS_LB=has_lb,
        PACKED=packed, GAP=gap, RECIPE=recipe_bits(flags), num_warps=PARTITION_WARPS)


#: the integer arguments Triton's launcher sees as multiples of 16 in a typical call (D 64/128, S a multiple of 16):
#: every stride except the stats' row stride (1), and the head counts
DIVISIBLE_INTS = ("slb", "slh", "sdelb", "sdelh", "sdqb", "sdqh", "sdqs", "SQ", "SKV")


def compile_sm90(d: int = 128, has_rb: bool = False, stages=None, regs=(CONSUMER_REGS, PRODUCER_REGS),
                 dq_dtype: str = "bf16", unit_stats: bool = True, block_n: Optional[int] = None,
                 defer: Optional[bool] = None, varlen: bool = False, bottom_right: bool = False,
                 has_lb: bool = False, packed: bool = False, flags: KernelRecipe = DEFAULT_FLAGS):
    """The kernel compiled for sm_90a without a GPU (Triton's compiler and its ptxas) -> CompiledKernel, as
    `gluon_attention_bwd.compile_sm90` (pointers and DIVISIBLE_INTS as the launcher sees them in a typical
    call). block_n: KV block override (offline sweeps; dq_gluon runs BLOCK_N[d]). varlen / bottom_right: the
    padded-batch variant; packed (varlen implied) the packed-batch one (PACKED, GAP)."""
    varlen = varlen or packed
    ns = stages if stages is not None else STAGES[d]
    bn = BLOCK_N[d] if block_n is None else block_n
    defer = DEFER_WAITS[d] if defer is None else defer
    q_desc = f"tensordesc<bf16[1, 1, {BLOCK_M // 2}, {d}],{tma_layout(BLOCK_M // 2, d)!r}>"
    kv_desc = f"tensordesc<bf16[1, 1, {bn}, {d}],{tma_layout(bn, d)!r}>"
    types = dict(q_desc=q_desc, do_desc=q_desc, kr_desc=kv_desc, vr_desc=kv_desc, kc_desc=kv_desc, LSE="*fp32",
                 DELTA="*fp32", DQ=f"*{dq_dtype}", qk_scale="fp32", sm_scale="fp32", CU_Q="*i32", CU_KV="*i32")
    constexprs = dict(HAS_RB=has_rb, BM=BLOCK_M, BN=bn, D=d, NS=ns, CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1],
                      DEFER=defer, VARLEN=varlen, BOTTOM_RIGHT=bottom_right, HAS_LB=has_lb, PACKED=packed,
                      GAP=PACKED_GAP if packed else 0, RECIPE=recipe_bits(flags))
    if unit_stats:  # the launcher's specialisation of the stats' row stride 1 (contiguous [B, H, S, 1] stats)
        constexprs["sls"] = 1
    return compile_gluon_sm90(_gluon_dq_kernel, types, constexprs, DIVISIBLE_INTS, PARTITION_WARPS)


__all__ = ["dq_gluon", "takes", "unsupported_reason", "compile_sm90", "FASTER_HEAD_DIMS", "MIN_KEYS", "BLOCK_M", "BLOCK_N",
           "STAGES", "DEFER_WAITS"]
