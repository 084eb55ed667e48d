"""Argument checks shared by the backends and the kernel entry points (raised before any kernel runs)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .constants import ATTENTION_FP8_DTYPE
from .formats import MXFP8Tensor, scale_shape
from .layouts import check_format, check_qkv_shapes, seq_axis


def check_bhsd_tensor(x, name: str, dtypes: Tuple[torch.dtype, ...], device_type: Optional[str] = None) -> None:
    """Raise TypeError/ValueError naming `name` unless x is a 4-D [B, H, S, D] tensor of one of `dtypes`
    (and, if given, on a device of `device_type`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {dtypes}, got {x.dtype}")
    if device_type is not None and x.device.type != device_type:
        raise ValueError(f"{name} must be on a {device_type.upper()} device, got {x.device}")


# --------------------------------------------------------------------------- already-quantized inputs


def check_no_grad(name: str, t: torch.Tensor) -> None:
    """Raise ValueError naming `name` when t requires grad under grad mode (the quantized-input path has no
    autograd)."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but attention on already-quantized inputs is an inference path "
                         "without autograd: detach it (or run under torch.no_grad()), or call mxfp8_attention on "
                         "the high-precision tensors for a differentiable call")


def _check_mxfp8(x, name: str, ndim: int, axis: int, along: str) -> None:
    """x an MXFP8Tensor of rank ndim, E4M3 elements, compact E8M0 scales shaped and placed as its data's,
    blocked along `axis` (described by `along`; unsegmented along D, the last axis), needing no gradient."""
    if not isinstance(x, MXFP8Tensor):
        raise TypeError(f"{name} must be an mxattn.MXFP8Tensor (an already-quantized input), got "
                        f"{type(x).__name__}")
    data, scale = x.data, x.scale
    if not isinstance(data, torch.Tensor) or data.dtype != ATTENTION_FP8_DTYPE:
        raise TypeError(f"{name}.data must hold E4M3 elements ({ATTENTION_FP8_DTYPE}), got "
                        f"{getattr(data, 'dtype', type(data).__name__)}")
    if data.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(data.shape)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"{name}.scale must be a torch.float8_e8m0fnu tensor, got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    if x.axis != axis:
        raise ValueError(f"{name} must have its blocks of 32 along {along}, got blocks along axis {x.axis}")
    if x.segments is not None and axis == ndim - 1:
        raise ValueError(f"{name}.segments must be None: row-wise blocks (along D) never cross tokens")
    expected = scale_shape(data.shape, axis, x.segments)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}.scale has shape {tuple(scale.shape)}, expected {expected} for data "
                         f"{tuple(data.shape)} blocked along axis {axis}")
    if scale.device != data.device:
        raise ValueError(f"{name}.scale is on {scale.device} but {name}.data on {data.device}")
    check_no_grad(f"{name}.data", data)


def check_quantized_inputs(q, k, v, qkv_format: str, recipe) -> None:
    """Check already-quantized q, k, v given in `qkv_format` (`mxfp8_attention_quantized`'s inputs, and as
    [B, H, S, D] views with qkv_format "bhsd" `AttentionBackend.forward_quantized`'s): q and k `MXFP8Tensor`s
    with E4M3 elements blocked along D (the last axis), v blocked along S (the sequence axis: the P V product's
    blocks), or under the recipe's bf16-V variant (`Recipe(v_operand="bf16")`) a bfloat16 tensor; shapes as
    `check_qkv_shapes` wants them; nothing requiring grad. V's segments: `check_quantized_segments`.
    recipe: an `mxattn.Recipe` (per-tensor scaling has no MXFP8 inputs). Raises TypeError/ValueError naming
    the argument and what was expected."""
    check_format(qkv_format)
    if recipe.scaling != "mxfp8":
        raise ValueError(f"recipe: scaling={recipe.scaling!r} has no MXFP8 inputs (one FP32 scale per tensor); "
                         "already-quantized inputs are MXFP8 (scaling='mxfp8')")
    ndim = 3 if qkv_format == "thd" else 4
    d_axis, s_axis = ndim - 1, seq_axis(qkv_format)
    of = f"of a {qkv_format} tensor"
    _check_mxfp8(q, "q", ndim, d_axis, f"D (axis {d_axis} {of}, row-wise)")
    _check_mxfp8(k, "k", ndim, d_axis, f"D (axis {d_axis} {of}, row-wise)")
    if recipe.v_operand == "bf16":
        if not isinstance(v, torch.Tensor) or v.dtype != torch.bfloat16:
            got = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
            raise TypeError(f"v must be a torch.bfloat16 tensor under Recipe(v_operand='bf16') (V is never "
                            f"quantized there), got {got}")
        if v.dim() != ndim:
            raise ValueError(f"v must be {ndim}-D, got shape {tuple(v.shape)}")
        check_no_grad("v", v)
    else:
        _check_mxfp8(v, "v", ndim, s_axis, f"S (axis {s_axis} {of}, column-wise: the blocks the P V product "
                                           "reads)")
    check_qkv_shapes(q, k, v, qkv_format)


def check_quantized_segments(v, cu_seqlens_kv: Optional[torch.Tensor]) -> None:
    """Raise ValueError unless v's column-wise blocks restart exactly at the sequences of a packed batch
    (`MXFP8Tensor.segments` equal to cu_seqlens_kv, the lengths in effect for K and V) or, for a dense or padded
    batch (cu_seqlens_kv None), v is unsegmented (a bfloat16 v passes)."""
    if not isinstance(v, MXFP8Tensor):
        return
    if cu_seqlens_kv is None:
        if v.segments is not None:
            raise ValueError("v.segments must be None for a dense or padded batch (blocks restart at sequence "
                             "starts only in a packed thd batch)")
        return
    if v.segments is None:
        raise ValueError("v of a packed (thd) batch must be quantized per sequence: its segments must be "
                         "cu_seqlens_kv (mxattn.quantize_mxfp8(v, axis=0, segments=cu_seqlens_kv)), got None")
    if v.segments is not cu_seqlens_kv and (
            v.segments.shape != cu_seqlens_kv.shape or
            not torch.equal(v.segments.to(device=cu_seqlens_kv.device, dtype=cu_seqlens_kv.dtype), cu_seqlens_kv)):
        raise ValueError("v.segments must equal cu_seqlens_kv (v's column-wise blocks restart at each sequence "
                         f"start), got {v.segments.tolist()} and {cu_seqlens_kv.tolist()}")


def resolved_softmax_scale(softmax_scale, head_dim) -> float:
    """The softmax scale of a call: 1/sqrt(head_dim) (Q's and K's head dim, symbolic under torch.compile with a
    dynamic head dim) for None, else softmax_scale itself after checking it is a positive finite number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not (isinstance(softmax_scale, (int, float))
                                               and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    return softmax_scale
