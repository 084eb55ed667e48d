"""Hopper (sm_90a) Gluon MXFP8 attention forward, host side: which calls it takes (`unsupported_reason`, `takes`),
its schedule (ring stages, ping-pong), the launch (`attention_fwd_gluon`) and the offline sm_90a build
(`compile_sm90`). The warp-specialised kernel is `gluon_fwd_kernel`'s: every P recipe (P_MODE / PS: fixed256,
lazy16, none), either scale rule (the quantizer's), bf16 V on the bf16-K/V variant; bf16 or fp16 O.

Scope: dense, padded and packed batches (any [B, H, S, D] strides with a unit stride along D: bhsd or bshd views;
a variable-length batch's lengths from its cu_seqlens, VARLEN; PACKED: thd, each sequence read and written from its
first row, and a KV block running past its keys never brings the next sequence's V), any band of a
dense caller (its offset; `right_bound` None or any int: causal-style, `left_bound` None or an int: sliding
window, keys kept where col > row + offset - left_bound), attention sinks (fp32 [Hq] logits joining every row's
softmax as the Triton forward's `softmax_start`), head dims 64 and 128, MHA and GQA, bf16 output and fp32 stats.
"""

import functools
from typing import Optional

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..runtime.recipe_flags import DEFAULT_FLAGS, P_MODE_BF16, P_MODE_LAZY16, KernelRecipe
from ..runtime.triton_launch import cdiv, launch
from .gluon_fwd_kernel import LN2, LOG2E, _gluon_attn_fwd_kernel
from .triton_attention_fwd import _check_sink, check_seq
from ..seqinfo import grid_rows, grid_sequences, kernel_cu_seqlens

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


@functools.lru_cache(maxsize=None)
def tma_layouts(d: int):
    """(K tile layout, V^T tile layout) of the FP8 TMA descriptors at head dim d (blocks [1,1,BN,D], [1,1,D,BN]);
    cached per d (building them costs host time on every call)."""
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
    comparisons of the schedule).
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
