"""The "triton" AttentionBackend: cuDNN's MXFP8 attention numerics on GPUs without MXFP8 tensor cores.

Forward: the fused Triton quantizer turns Q, K, V into row-wise and column-wise MXFP8 (one read each, one
launch for the three) and the forward kernel runs on Q/K row-wise and V column-wise. K and V reach it as their
exact bf16 dequantizations written by the quantizer (scratch freed after the kernel; the faster path) or, for
head dims above 128 and problems whose scratch would exceed its budget, as FP8 (V's column-wise copy
seq-major) dequantized on chip (`fwd_streams_bf16` chooses); on Hopper the FP8 path runs the Gluon
warp-specialised forward where it takes the call (`_gluon_forward`, same numbers). Q row+col, K row+col, V row are kept for backward
(nothing without a backward).
Backward: one prep pass computes delta = rowsum(O * dO) and, on the bf16-scratch path, quantizes dO both ways
and dequantizes it and Q's copies to bf16 scratch; then the dK/dV kernel and the dQ kernel run (deterministic:
no atomics, fixed summation order, also for GQA); on Hopper the bf16-scratch path runs the Gluon warp-specialised
dK/dV and dQ kernels on each head chunk they take (`_gluon_backward`, `_gluon_dq`; same numbers). See
mxattn/kernels/.
Variable lengths (`params.seq`, padded or packed): every kernel reads the per-sequence offsets and lengths
itself (grids sized by the longest sequence); results equal the reference backend's sequence-by-sequence run.
Already-quantized inputs (`forward_quantized`): the forward kernel alone, on the given bytes in the form the
problem's data path reads (no quantizer launch; K and V dequantized to bf16 with torch ops, or V laid out
seq-major), equal to `forward` bit for bit.

This module imports without triton or a GPU; the kernels are imported on first use.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional, Tuple

import torch

from .. import kvcache_step
from ..checks import check_bhsd_tensor
from ..constants import INPUT_DTYPES, KERNEL_OUT_DTYPES, MX_BLOCK
from ..devices import device_guard
from ..errors import MXFP8NotSupportedError
from ..formats import MXFP8Tensor, segment_rows
from ..layouts import empty_bhsd
from ..seqinfo import SeqInfo, grid_rows, quantizer_args, zero_padding
from ..runtime.affine_plan import AffinePlanCache
from ..runtime.launch_plan import plan_key
from ..runtime.plan_cache import PlanCache
from ..runtime.recipe_flags import DEFAULT_FLAGS, kernel_recipe, unsupported_reason
from .base import (AttentionBackend, AttentionParams, CacheCall, SavedForBackward, check_forward_quantized,
                   sink_grad_from_delta)

# q, k, v go only through the quantizer, which reads fp32 too; O and dO are the kernels' own output dtype
#: lowest compute capability whose Triton supports E4M3 conversions (float8e4nv)
MIN_CAPABILITY = (8, 9)


_KERNELS = None
#: availability of each CUDA device index (read once: decode steps choose a backend per new KV length)
_CUDA_AVAILABILITY = {}


def _kernels():
    """(triton_quantize, triton_attention_fwd, triton_attention_bwd), imported on first use."""
    global _KERNELS
    if _KERNELS is None:
        from ..kernels import triton_attention_bwd, triton_attention_fwd, triton_quantize
        _KERNELS = (triton_quantize, triton_attention_fwd, triton_attention_bwd)
    return _KERNELS


def _inner_unit(x: torch.Tensor) -> torch.Tensor:
    """x itself when its D axis has unit stride (what the kernels need), else a contiguous copy."""
    return x if x.stride(3) == 1 or x.shape[3] == 1 else x.contiguous()


def _v_copy(v: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """V rounded to bfloat16 as the bf16-V recipe keeps it: a copy, in params.saved_layout when one is asked for."""
    out = _like(v, torch.bfloat16) if params.saved_layout is None else \
        empty_bhsd(tuple(v.shape), params.saved_layout, torch.bfloat16, v.device)
    return out.copy_(v)


def _like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised tensor of x's shape: x's strides when x is dense with a unit D stride, else contiguous."""
    out = torch.empty_like(x, dtype=dtype, memory_format=torch.preserve_format)
    return out if out.stride(3) == 1 or out.shape[3] == 1 else torch.empty(x.shape, dtype=dtype, device=x.device)


def _mask_args(params: AttentionParams, s_q: int, s_kv: int):
    """Band-mask and length arguments of the attention kernels. A variable-length call gets the diagonal
    offset per sequence in the kernels (bottom_right); a dense one gets it here."""
    m = params.mask
    if params.seq is not None:
        return dict(offset=0, bottom_right=m.bottom_right, left_bound=m.left_bound, right_bound=m.right_bound,
                    seq=params.seq)
    return dict(offset=m.offset(s_q, s_kv), left_bound=m.left_bound, right_bound=m.right_bound)


def _attend(like: torch.Tensor, q_data: torch.Tensor, q_scale: torch.Tensor, kv_operands, skv: int,
            params: AttentionParams, flags) -> Tuple[torch.Tensor, torch.Tensor]:
    """(o, stats) of the forward kernel on Q's row-wise bytes and scales [B,Hq,Sq,*] and kv_operands() = (k, k
    scales or None, v) in a form `attention_fwd` takes (called only when there is something to compute); O laid
    out like `like`. No key anywhere (skv = 0): O = 0, stats = the sink alone (or -inf)."""
    B, hq, sq, _ = q_data.shape
    o = _like(like, params.out_dtype)
    stats = torch.empty((B, hq, sq, 1), dtype=torch.float32, device=q_data.device)
    sink = None if params.sink is None else params.sink.float().contiguous()
    if skv == 0:
        o.zero_()
        if sink is None:
            stats.fill_(float("-inf"))
        else:
            stats.copy_(sink.view(1, -1, 1, 1).expand_as(stats))
    elif sq > 0 and B * hq > 0:
        k_data, k_scale, v = kv_operands()
        forward_kernel(q_data, q_scale, k_data, k_scale, v, softmax_scale=params.softmax_scale, out=o, stats=stats,
                       sink=sink, flags=flags, **_mask_args(params, sq, skv))
    return o, stats


def forward_kernel(q_data, q_scale, k_data, k_scale, v, *, out: torch.Tensor, sink=None, flags=DEFAULT_FLAGS,
                   **kwargs) -> None:
    """The forward kernel the backend runs on these operands (`triton_attention_fwd.attention_fwd`'s arguments,
    either data path): the Gluon warp-specialised forward where it `takes` the call on this device
    (`_gluon_forward`), else the Triton forward. Writes out and kwargs["stats"]."""
    gluon = _gluon_forward(q_data.device)
    if gluon is not None and gluon.takes(
            q_data, k_scale, v, k_data=k_data, left_bound=kwargs.get("left_bound"), seq=kwargs.get("seq"),
            bottom_right=kwargs.get("bottom_right", False), sink=sink, flags=flags, out=out):
        gluon.attention_fwd_gluon(q_data, q_scale, k_data, k_scale, v, out=out, sink=sink, flags=flags,
                                  checked=True, **kwargs)
    else:
        _kernels()[1].attention_fwd(q_data, q_scale, k_data, k_scale, v, out=out, sink=sink, flags=flags, **kwargs)


#: the Gluon warp-specialised forward (`mxattn.kernels.gluon_attention_fwd`) runs the forward on Hopper (SM 9.0)
#: where it `takes` the call (every P recipe, bf16 V on the bf16-scratch path, dense, padded and packed batches,
#: any band incl. sliding windows, attention sinks, head dims 64/128, bf16 or fp16 O): it is faster than the Triton
#: forward on the FP8 data path and, as its bf16-K/V variant, on the bf16-scratch path, with the same numbers (the
#: same operations per element; O within one bf16 ulp in the tests). MXATTN_GLUON_FWD=0 in the environment keeps
#: the Triton forward everywhere.
GLUON_FORWARD = os.environ.get("MXATTN_GLUON_FWD", "1") != "0"
#: the Gluon warp-specialised dK/dV kernel (`mxattn.kernels.gluon_attention_bwd`) runs the bf16-scratch backward's
#: dK/dV pass on Hopper where it takes the chunk and is the faster kernel (`takes`: every recipe's backward
#: switches, dense, padded and packed batches, no mask or a causal-style band, head dim 128, or 64 with GQA), dK and
#: dV bit-equal to the Triton kernel's; likewise its Gluon dQ kernel (`mxattn.kernels.gluon_attention_dq`: the same
#: refusals, head dims 64 and 128), dQ bit-equal. MXATTN_GLUON_BWD=0 in the environment keeps the Triton kernels
#: for both passes.
GLUON_BACKWARD = os.environ.get("MXATTN_GLUON_BWD", "1") != "0"
#: per (module name, CUDA device index): the Gluon module where its kernels run there, else None (read once)
_GLUON = {}


def _gluon_module(device: torch.device, name: str, enabled: bool):
    """`mxattn.kernels.<name>` (a Gluon Hopper module) when its kernels can run on `device` (a CUDA SM 9.0 GPU,
    a Triton with Gluon's Hopper API) and `enabled`, else None."""
    if not enabled or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (name, index) not in _GLUON:
        module = None
        if torch.cuda.get_device_capability(index) == (9, 0):
            try:
                module = importlib.import_module(f"..kernels.{name}", __package__)
            except ImportError:  # a Triton without Gluon's Hopper API: the Triton kernels
                module = None
        _GLUON[(name, index)] = module
    return _GLUON[(name, index)]


def _gluon_forward(device: torch.device):
    """`mxattn.kernels.gluon_attention_fwd` where it runs on `device` and GLUON_FORWARD is on, else None."""
    return _gluon_module(device, "gluon_attention_fwd", GLUON_FORWARD)


def _gluon_backward(device: torch.device):
    """`mxattn.kernels.gluon_attention_bwd` where it runs on `device` and GLUON_BACKWARD is on, else None."""
    return _gluon_module(device, "gluon_attention_bwd", GLUON_BACKWARD)


def _gluon_dq(device: torch.device):
    """`mxattn.kernels.gluon_attention_dq` where it runs on `device` and GLUON_BACKWARD is on, else None."""
    return _gluon_module(device, "gluon_attention_dq", GLUON_BACKWARD)


def _bf16_scratch(x: MXFP8Tensor) -> torch.Tensor:
    """x's exact bf16 dequantization, contiguous [B, H, S, D] (what the quantizer's row_dequant / col_dequant
    hold for the same bytes)."""
    return x.dequantize(torch.bfloat16).contiguous()


def seq_major_columns(v: MXFP8Tensor, seq: Optional[SeqInfo]):
    """V's column-wise copy [B,H,S,D] (blocks along S; segmented for a packed batch) as the forward kernel's
    FP8 V operand, `SeqMajorColumns` (data [B,H,D,L], unit stride along L = 32 * the scale rows; sequence b's
    row n at column 32 * its first block row + n; zeros after each sequence's end up to its last block's end,
    and in a padded batch on the padding rows, which are never read as values): the bytes the fused quantizer
    writes with col_seq_major=True. Torch ops, no host copy."""
    from ..kernels.triton_quantize import SeqMajorColumns
    B, H, S, D = v.shape
    n_blocks = v.scale.shape[2]
    buf = torch.zeros((B, H, D, n_blocks * MX_BLOCK), dtype=torch.uint8, device=v.data.device)
    rows = buf.transpose(2, 3)  # [B, H, L, D] view
    data = v.data.view(torch.uint8)
    if seq is not None and seq.packed:
        _, block0, within = segment_rows(v.segments, S)
        rows.index_copy_(2, block0 * MX_BLOCK + within, data)
    else:
        rows[:, :, :S].copy_(zero_padding(data, seq, "kv"))
    return SeqMajorColumns(buf.view(torch.float8_e4m3fn), _inner_unit(v.scale))


#: launch plans by call signature (`launch_plan`: checks, choices and allocations done once, the
#: compiled kernels launched directly with the new tensors' addresses)
_PLANS = PlanCache()
#: plans of one-launch forwards (decode steps) over every KV length (`affine_plan`: the body's integers are
#: affine in the KV length: its size, strides and diagonal offset)
_AFFINE_PLANS = AffinePlanCache()


def _forward_key(roots, params: AttentionParams):
    """The plan key (family, sizes) of a forward call on roots (q, k, v, sink, cu_seqlens_q, cu_seqlens_kv)."""
    return _key("fwd", roots, params, params.needs_backward)


def _backward_key(roots, params: AttentionParams):
    """The plan key of a backward call's kernels (dq, dk, dv, delta)."""
    return _key("bwd", roots, params)


def _key(kind: str, roots, params: AttentionParams, *extra):
    """(family: what every call of a layer shares, sizes: the roots' shapes and strides, how they share
    storage, the longest sequences). Variable-length calls are keyed like dense ones: their host path reads
    the lengths' shapes and the longest sequences, never the lengths themselves (their tensors are roots)."""
    seq = params.seq
    return plan_key((kind, params.softmax_scale, params.mask, params.out_dtype, params.recipe, *extra,
                     None if seq is None else seq.packed), roots,
                    None if seq is None else (seq.max_seqlen_q, seq.max_seqlen_kv))


def _one_launch_prefix(params: AttentionParams) -> tuple:
    """The affine plan key of a one-launch forward, but for its roots (`AffinePlanCache.run_keyed`'s prefix; the
    roots q, k, v, sink, cu_seqlens_q, cu_seqlens_kv are keyed as `roots_key` with K's and V's length n at dim
    2): what `_forward_key`'s family holds and each root's shape and strides, K's and V's with n left out and
    each stride that is a multiple of n written as that multiple (transformers' cache, re-made each step, has
    strides that grow with n; views of a preallocated buffer keep theirs): calls whose roots differ only in n
    share a key, calls on differently laid-out caches do not. The plan itself checks every integer
    (`affine_plan`). A variable-length call adds its longest query (its grid's rows); no launch of this path
    reads the longest key."""
    seq = params.seq
    return ("fwd1", params.softmax_scale, params.mask, params.out_dtype, params.recipe,
            None if seq is None else (seq.packed, seq.max_seqlen_q))


class SavedWithBF16V(SavedForBackward):
    """What the triton backend keeps for backward under the bf16-V recipe (`Recipe(v_operand="bf16")`): the
    MXFP8 copies of Q and K as `SavedForBackward`, and in v_row V rounded to bfloat16 [B,Hkv,Skv,D] (a copy,
    never quantized)."""

    def tensors(self):
        out = []
        for t in (self.q_row, self.q_col, self.k_row, self.k_col):
            out += [t.data, t.scale]
        return (*out, self.v_row)

    @classmethod
    def from_tensors(cls, flat, seq=None) -> "SavedWithBF16V":
        # the base class's inverse on the eight MXFP8 tensors (its v_row slot filled with q_row's, then replaced)
        base = SavedForBackward.from_tensors((*flat[:8], flat[0], flat[1]), seq)
        return cls(base.q_row, base.q_col, base.k_row, base.k_col, flat[8])

    @classmethod
    def fake_tensors(cls, q, k, v, seq=None):
        return (*SavedForBackward.fake_tensors(q, k, v, seq)[:8], torch.empty_like(v, dtype=torch.bfloat16))


def _seq_roots(params: AttentionParams) -> tuple:
    seq = params.seq
    return (None, None) if seq is None else (seq.cu_seqlens_q, seq.cu_seqlens_kv)


class TritonBackend(AttentionBackend):
    """MXFP8 attention through Triton kernels (Hopper, Ada; exact BF16 dequantization + BF16 tensor cores)."""

    name = "triton"
    supported_head_dims = (32, 64, 96, 128, 192, 256)
    input_dtypes = INPUT_DTYPES
    replays_ops = True
    # float32 outputs serve partial results merged later (context parallelism); the kernels cast on store
    output_dtypes = KERNEL_OUT_DTYPES + (torch.float32,)
    takes_stats_grad = True

    @classmethod
    def supports_recipe(cls, recipe) -> Tuple[bool, str]:
        """Every MXFP8 recipe runs as constexpr specialisations of the kernels (`runtime.recipe_flags`; the
        default recipe's machine code is unchanged by them); scaling="per_tensor" is refused with the reason."""
        reason = unsupported_reason(recipe)
        if reason is None:
            return True, "the default recipe" if recipe.is_default else f"the recipe {recipe.differences()}"
        return False, f"{reason}: use backend='reference', or 'auto' to route it there"

    @classmethod
    def saved_format_for(cls, recipe) -> type:
        """`SavedWithBF16V` under the bf16-V recipe, else `SavedForBackward`."""
        return SavedWithBF16V if recipe.v_operand == "bf16" else cls.saved_format

    @classmethod
    def supports_cache(cls, call: CacheCall) -> Tuple[bool, str]:
        ok, why = cls.availability(call.q.device)
        refusal = cls.v_dim_refusal(call.cache.head_dim, call.cache.head_dim_v)
        if ok and refusal:
            return False, refusal
        if ok and call.cache.head_dim > 128:
            return False, f"the paged Triton kernel takes head dims up to 128, the cache has {call.cache.head_dim}"
        return ok, why

    def attend_cache(self, call: CacheCall):
        """One `PagedStep`: the append's and the attention's launches, replayed per signature."""
        step = kvcache_step.PagedStep(call.q, call.cache, call.slots, call.cu, call.cu_seqlens_q, call.k_new,
                                      call.v_new, call.softmax_scale, call.left_bound, call.softmax_type,
                                      call.num_splits, call.kernel_dtype, call.out_dtype)
        return step._run(call.cache, call.q, call.k_new, call.v_new, call.sink), step

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        """(ok, reason). Needs a CUDA device of compute capability >= 8.9 and an importable triton."""
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as exc:
            return False, f"not a device: {exc}"
        if device.type != "cuda":
            return False, f"the triton backend runs on CUDA devices only, got device type {device.type!r}"
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return False, f"triton is not installed ({exc})"
        if not torch.cuda.is_available():
            return False, "CUDA is not available (no NVIDIA driver or GPU visible to torch)"
        index = device.index if device.index is not None else torch.cuda.current_device()
        known = _CUDA_AVAILABILITY.get(index)
        if known is None:  # a GPU's capability and the kernels' import do not change within a process
            known = _CUDA_AVAILABILITY[index] = cls._cuda_availability(index)
        return known

    @classmethod
    def _cuda_availability(cls, index: int) -> Tuple[bool, str]:
        """`availability` of CUDA device `index` (torch sees CUDA), read off the device once."""
        if index >= torch.cuda.device_count():
            return False, f"CUDA device {index} does not exist ({torch.cuda.device_count()} visible)"
        cap = torch.cuda.get_device_capability(index)
        if cap < MIN_CAPABILITY:
            return False, (f"compute capability {cap[0]}.{cap[1]} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: "
                           "Triton's E4M3 conversions need Ada (8.9), Hopper (9.0) or newer")
        try:
            _kernels()
        except Exception as exc:  # pragma: no cover - a broken triton install
            return False, f"the Triton kernels failed to import: {type(exc).__name__}: {exc}"
        return True, f"CUDA device {index} ({torch.cuda.get_device_name(index)}, sm_{cap[0]}{cap[1]}) with triton"

    # ------------------------------------------------------------------ checks

    def _check_common(self, params: AttentionParams, d: int) -> None:
        if not isinstance(params, AttentionParams):
            raise TypeError(f"params must be an AttentionParams, got {type(params).__name__}")
        if params.out_dtype not in self.output_dtypes:
            raise TypeError(f"params.out_dtype must be one of {self.output_dtypes}, got {params.out_dtype}")
        if d not in self.supported_head_dims:
            raise MXFP8NotSupportedError(
                f"head_dim {d} is not supported by the triton backend (supported: {self.supported_head_dims})")

    # ------------------------------------------------------------------ forward

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
                ) -> Tuple[torch.Tensor, torch.Tensor, SavedForBackward]:
        """q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] bf16/fp16/fp32 CUDA (any strides; a packed batch as [1,H,T,D]
        views) -> (o [B,Hq,Sq,D] params.out_dtype, stats [B,Hq,Sq,1] fp32 log-sum-exp (-inf for rows that keep
        nothing, and for padding rows), SavedForBackward, or None when not params.needs_backward).
        A call replays the launches recorded for its signature (`_PLANS`, `mxattn.runtime.launch_plan`)."""
        roots = (q, k, v, params.sink, *_seq_roots(params))
        body = lambda: self._forward_flat(q, k, v, params)  # noqa: E731
        with device_guard(q.device):
            if self._one_launch_config(q, k, v, params) is not None:  # one plan for every KV length
                o, stats = _AFFINE_PLANS.run_keyed(_one_launch_prefix(params), 2, k.shape[2], body, roots,
                                                   lambda: _PLANS.run(_forward_key(roots, params), body, roots))
                return o, stats, None
            o, stats, *saved = _PLANS.run(_forward_key(roots, params), body, roots)
        if not saved:
            return o, stats, None
        return o, stats, self.saved_format_for(params.recipe).from_tensors(saved, params.seq)

    def forward_affine_in_kv_length(self, q, k, v, params: AttentionParams) -> bool:
        """True for the one-launch forward (`_one_launch_config`): its integers are affine in the KV length."""
        return self._one_launch_config(q, k, v, params) is not None

    @staticmethod
    def _one_launch_config(q, k, v, params: AttentionParams):
        """The forward kernel's configuration when the call runs as one launch that quantizes as it reads (no
        backward, something to compute, queries within one tile: decode steps and short chunks), else None.
        Reads shapes only (not the KV length beyond its being non-zero), so one affine plan serves every length."""
        if params.needs_backward or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return None
        B, hq, sq, d = q.shape
        if k.shape[2] == 0 or sq == 0 or B * hq == 0:
            return None
        return _kernels()[1].quantizing_fwd_config(grid_rows(params.seq, "q", sq), d, max(q.dtype, k.dtype, v.dtype,
                                                                                   key=lambda t: t.itemsize))

    def _forward_flat(self, q, k, v, params: AttentionParams) -> list:
        """`_forward` as a flat list: [o, stats, *saved.tensors()]."""
        o, stats, saved = self._forward(q, k, v, params)
        return [o, stats, *(saved.tensors() if saved is not None else ())]

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
                 ) -> Tuple[torch.Tensor, torch.Tensor, SavedForBackward]:
        """`forward`'s checks and launches."""
        self._check_inputs(q, k, v, params)
        B, hq, sq, d = q.shape
        hkv, skv = k.shape[1], k.shape[2]
        tq, tf, _ = _kernels()
        bwd = params.needs_backward  # without a backward pass only the forward's copies are made
        flags = kernel_recipe(params.recipe)
        config = self._one_launch_config(q, k, v, params)
        if config is not None:  # one query tile (decode steps): one launch that quantizes as it reads
            return (*self._forward_quantizing(q, k, v, params, config), None)
        kv_bf16 = tf.fwd_streams_bf16(B, hkv, skv, d)  # the problem's data path: bf16 scratch or FP8 on chip
        kv_args = dict(quantizer_args(params.seq, "kv"), data_layout=params.saved_layout)
        # one launch for the three; V's row=kv_bf16 without a backward too: the quantizer refuses col_dequant
        # without row (a Triton 3.6 sm_90 miscompile of that one combination), so V's row-wise copy is written
        # and dropped there. The bf16-V recipe quantizes Q and K only; V is read in bf16 (a copy when kept).
        v_bf16 = None
        if flags.v_raw:
            v_bf16 = _v_copy(v, params) if bwd or v.dtype != torch.bfloat16 else _inner_unit(v)
        qq, kq, vq = tq.quantize_qkv(
            _inner_unit(q), _inner_unit(k), None if flags.v_raw else _inner_unit(v),
            dict(col=bwd, data_layout=params.saved_layout, **quantizer_args(params.seq, "q")),
            dict(col=bwd, row_dequant=kv_bf16, **kv_args),
            None if flags.v_raw else dict(row=bwd or kv_bf16, col_seq_major=not kv_bf16, col_dequant=kv_bf16,
                                          **kv_args), floor=flags.floor)
        v_arg = v_bf16 if flags.v_raw else vq.col_dequant if kv_bf16 else vq.col_seq_major
        k_args = (kq.row_dequant, None) if kv_bf16 else (kq.row.data, kq.row.scale)
        o, stats = _attend(q, qq.row.data, qq.row.scale, lambda: (*k_args, v_arg), skv, params, flags)
        if not bwd:
            return o, stats, None
        saved = self.saved_format_for(params.recipe)(q_row=qq.row, q_col=qq.col, k_row=kq.row, k_col=kq.col,
                                                     v_row=v_bf16 if flags.v_raw else vq.row)
        return o, stats, saved

    def saved_for_backward(self, q, k, v, params: AttentionParams) -> SavedForBackward:
        """`forward`'s saved copies, the same bytes, from one quantizing launch and no attention
        (`AttentionBackend.saved_for_backward`)."""
        self._check_inputs(q, k, v, params)
        flags = kernel_recipe(params.recipe)
        kv_args = dict(quantizer_args(params.seq, "kv"), data_layout=params.saved_layout)
        with device_guard(q.device):
            qq, kq, vq = _kernels()[0].quantize_qkv(
                _inner_unit(q), _inner_unit(k), None if flags.v_raw else _inner_unit(v),
                dict(data_layout=params.saved_layout, **quantizer_args(params.seq, "q")), kv_args,
                None if flags.v_raw else dict(col=False, **kv_args), floor=flags.floor)
            v_row = _v_copy(v, params) if flags.v_raw else vq.row
        return self.saved_format_for(params.recipe)(q_row=qq.row, q_col=qq.col, k_row=kq.row, k_col=kq.col,
                                                    v_row=v_row)

    def _check_inputs(self, q, k, v, params: AttentionParams) -> None:
        """The forward's argument checks: q [B,Hq,Sq,D], k = v [B,Hkv,Skv,D] on one CUDA device, Hkv | Hq."""
        for t, n in ((q, "q"), (k, "k"), (v, "v")):
            check_bhsd_tensor(t, n, INPUT_DTYPES)
        B, hq, sq, d = q.shape
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[0] != B or k.shape[3] != d:
            raise ValueError(f"k must be [B={B}, Hkv, Skv, D={d}], got {tuple(k.shape)}")
        hkv = k.shape[1]
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
        self._check_common(params, d)
        for t, n in ((q, "q"), (k, "k"), (v, "v")):  # after the shape checks, so those are testable on the CPU
            check_bhsd_tensor(t, n, INPUT_DTYPES, "cuda")
        if not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")

    def _forward_quantizing(self, q, k, v, params: AttentionParams, config) -> Tuple[torch.Tensor, torch.Tensor]:
        """(o, stats) of a call without a backward whose queries fit one tile: the forward kernel quantizes Q, K
        and V as it reads them (`attention_fwd_quantizing`; equal to the two-launch path bit for bit)."""
        _, tf, _ = _kernels()
        B, hq, sq, _d = q.shape
        o = _like(q, params.out_dtype)
        stats = torch.empty((B, hq, sq, 1), dtype=torch.float32, device=q.device)
        sink = None if params.sink is None else params.sink.float().contiguous()
        tf.attention_fwd_quantizing(_inner_unit(q), _inner_unit(k), _inner_unit(v),
                                    softmax_scale=params.softmax_scale, out=o, stats=stats, sink=sink,
                                    config=config, flags=kernel_recipe(params.recipe),
                                    **_mask_args(params, sq, k.shape[2]))
        return o, stats

    # ------------------------------------------------------------------ already-quantized inputs

    def forward_quantized(self, q: MXFP8Tensor, k: MXFP8Tensor, v, params: AttentionParams
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
        """`AttentionBackend.forward_quantized` on CUDA tensors: the forward kernel (`attention_fwd`) takes Q's
        bytes and scales as they are, and K and V in the form `forward` would give them for the problem
        (`fwd_streams_bf16`): their exact bf16 dequantizations (`MXFP8Tensor.dequantize`, the values the
        quantizer's row_dequant / col_dequant hold) or their FP8 bytes dequantized on chip (K as it is, V laid
        out seq-major: `seq_major_columns`); under the bf16-V recipe V as it is. So O and stats equal `forward`'s
        bit for bit on the inputs these bytes are the quantization of (no quantizer launch: one kernel, plus the
        torch ops of the dequantization or the seq-major copy)."""
        check_forward_quantized(q, k, v, params)
        _, _, _, d = q.shape
        self._check_common(params, d)
        for t, n in ((q.data, "q.data"), (k.data, "k.data"), (v.data if isinstance(v, MXFP8Tensor) else v, "v")):
            check_bhsd_tensor(t, n, (t.dtype,), "cuda")
        flags = kernel_recipe(params.recipe)
        B, hkv, skv, _ = k.shape
        kv_bf16 = _kernels()[1].fwd_streams_bf16(B, hkv, skv, d)  # the data path `forward` takes

        def kv_operands():
            if flags.v_raw:
                v_arg = _inner_unit(v)
            else:
                v_arg = _bf16_scratch(v) if kv_bf16 else seq_major_columns(v, params.seq)
            if kv_bf16:
                return _bf16_scratch(k), None, v_arg
            return _inner_unit(k.data), _inner_unit(k.scale), v_arg

        with device_guard(q.device):
            return _attend(q.data, _inner_unit(q.data), _inner_unit(q.scale), kv_operands, skv, params, flags)

    # ------------------------------------------------------------------ backward

    def backward(self, saved: SavedForBackward, o: torch.Tensor, stats: torch.Tensor, do: torch.Tensor,
                 params: AttentionParams, dstats: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
        """saved (from forward), o/do [B,Hq,Sq,D] bf16/fp16, stats [B,Hq,Sq,1] fp32 -> (dq [B,Hq,Sq,D],
        dk, dv [B,Hkv,Skv,D]) in params.out_dtype, then dsink [Hq] fp32 when params.sink_requires_grad (the
        kernels need nothing else for a sink: it lives in the stats). dstats: None, or the gradient of the
        returned stats, fp32 like stats (delta - dstats after the prep pass). Deterministic (params.deterministic
        is always honoured)."""
        roots = (*saved.tensors(), o, stats, do, *_seq_roots(params)) if isinstance(saved, self.saved_format) \
            else None
        # a call with dstats subtracts it on the host side, which a recorded plan cannot replay: it runs unplanned
        key = _backward_key(roots, params) if roots is not None and dstats is None else None
        with device_guard(o.device):
            *grads, delta = _PLANS.run(key, lambda: self._grads(saved, o, stats, do, params, dstats), roots)
        if params.sink_requires_grad:
            dsink = (sink_grad_from_delta(delta, stats, params.sink.float()) if delta is not None
                     else torch.zeros_like(params.sink, dtype=torch.float32))
            return tuple(grads) + (dsink,)
        return tuple(grads)

    def _grads(self, saved: SavedForBackward, o: torch.Tensor, stats: torch.Tensor, do: torch.Tensor,
               params: AttentionParams, dstats: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(dq, dk, dv, delta fp32 [B,Hq,Sq] or None when there was nothing to compute)."""
        if not isinstance(saved, self.saved_format):
            raise TypeError(f"saved must be a {self.saved_format.__name__}, got {type(saved).__name__}")
        check_bhsd_tensor(o, "o", KERNEL_OUT_DTYPES, "cuda")
        check_bhsd_tensor(do, "do", KERNEL_OUT_DTYPES, "cuda")
        B, hq, sq, d = saved.q_row.data.shape
        hkv, skv = saved.k_row.data.shape[1], saved.k_row.data.shape[2]
        for t, n in ((o, "o"), (do, "do")):
            if tuple(t.shape) != (B, hq, sq, d):
                raise ValueError(f"{n} must have shape {(B, hq, sq, d)}, got {tuple(t.shape)}")
        if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32 or \
                tuple(stats.shape) != (B, hq, sq, 1):
            raise ValueError(f"stats must be a float32 tensor of shape {(B, hq, sq, 1)}")
        if stats.device != do.device:
            raise ValueError(f"stats must be on {do.device}, got {stats.device}")
        if dstats is not None and (not isinstance(dstats, torch.Tensor) or dstats.dtype != torch.float32 or
                                   tuple(dstats.shape) != (B, hq, sq, 1) or dstats.device != do.device):
            raise ValueError(f"dstats must be a float32 tensor of shape {(B, hq, sq, 1)} on {do.device}")
        self._check_common(params, d)
        tq, _, tb = _kernels()
        dq = _like(do, params.out_dtype)
        dk = _like(saved.k_row.data, params.out_dtype)
        dv = _like(saved.v_row.data, params.out_dtype)
        if sq == 0 or skv == 0 or B * hq == 0:  # O = 0: delta is -dstats alone (a sink's gradient reads it)
            return dq.zero_(), dk.zero_(), dv.zero_(), None if dstats is None else -dstats[..., 0]
        flags = kernel_recipe(params.recipe)
        parts = [saved.q_row, saved.q_col, saved.k_row, saved.k_col, saved.v_row]
        parts = [_inner_unit(p) if isinstance(p, torch.Tensor) else p if p.data.stride(3) == 1 else
                 type(p)(p.data.contiguous(), p.scale, p.axis, p.segments) for p in parts]
        do = _inner_unit(do)
        ds = None if dstats is None else dstats[..., 0]
        if tb.bwd_streams_bf16(B, hq, saved.k_row.data.shape[1], sq, skv, d):
            # bf16 scratch per chunk of heads; dO is quantized chunk by chunk inside
            delta = tb.attention_bwd(*parts, None, None, o, do, stats, softmax_scale=params.softmax_scale,
                                     dq=dq, dk=dk, dv=dv, mode="pre", dstats=ds, flags=flags, gluon_dkdv=_gluon_backward(o.device),
                                     gluon_dq=_gluon_dq(o.device), **_mask_args(params, sq, skv))
        else:
            do_q = tq.quantize_rowcol(do, floor=flags.floor, **quantizer_args(params.seq, "q"))
            delta = tb.attention_bwd(*parts, do_q.row, do_q.col, o, do, stats, softmax_scale=params.softmax_scale,
                                     dq=dq, dk=dk, dv=dv, mode="fp8", dstats=ds, flags=flags, **_mask_args(params, sq, skv))
        return dq, dk, dv, delta


__all__ = ["TritonBackend", "SavedWithBF16V", "MIN_CAPABILITY", "seq_major_columns"]
