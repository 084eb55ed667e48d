"""`mxfp8_attention`: the differentiable functional API (validation, layout, backend choice)."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import ops
from .backends import backend_class, resolve_backend_name
from .errors import MXFP8NotSupportedError
from .layouts import check_format, from_bhsd, to_bhsd
from .mask import MaskSpec, mask_from_te

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16)


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; mxattn accepts {', '.join(map(str, INPUT_DTYPES))} "
                        "(it quantizes them to MXFP8 itself)")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D, got shape {tuple(x.shape)}")


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str) -> None:
    """Check q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] (given in `qkv_format` order); raise TypeError/ValueError naming
    the argument."""
    check_format(qkv_format)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    (b, hq, sq, d), (bk, hk, sk, dk) = to_bhsd(q, qkv_format).shape, to_bhsd(k, qkv_format).shape
    bv, hv, sv, dv = to_bhsd(v, qkv_format).shape
    where = f"(shapes read as [B, H, S, D] from qkv_format={qkv_format!r})"
    if not (b == bk == bv):
        raise ValueError(f"batch size mismatch: q {b}, k {bk}, v {bv} {where}")
    if sk != sv:
        raise ValueError(f"sequence length mismatch: k {sk}, v {sv} {where}")
    if not (d == dk == dv):
        raise ValueError(f"head_dim mismatch: q {d}, k {dk}, v {dv} {where}")
    if hk != hv:
        raise ValueError(f"k and v must have the same number of heads, got k {hk}, v {hv} {where}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be divisible by key/value heads ({hk}) {where}")
    if sq == 0 or sk == 0 or b == 0:
        raise ValueError(f"empty input: q has S={sq}, k/v have S={sk}, batch {b} {where}")
    if d == 0 or hq == 0:
        raise ValueError(f"empty input: head_dim {d}, heads {hq} {where}")


def check_backend_limits(backend: str, head_dim: int, dtype: torch.dtype) -> None:
    """Raise ValueError/TypeError if `backend` cannot run `head_dim` or inputs of `dtype`, listing what it can."""
    cls = backend_class(backend)
    supported = cls.supported_head_dims
    if supported is not None and head_dim not in supported:
        raise ValueError(f"head_dim {head_dim} is not supported by backend {backend!r}; supported: "
                         f"{', '.join(map(str, supported))}")
    if dtype not in cls.input_dtypes:
        raise TypeError(f"backend {backend!r} takes q, k, v in {', '.join(map(str, cls.input_dtypes))}; got {dtype}")


@torch.compiler.assume_constant_result
def _choose_backend(backend: str, device: str, head_dim: int, dtype: torch.dtype) -> str:
    """Concrete backend name for (backend, device, head_dim, dtype); a constant under torch.compile (the choice
    and its checks run once at trace time, with no graph break)."""
    name = resolve_backend_name(backend, torch.device(device))
    check_backend_limits(name, head_dim, dtype)
    return name


def mxfp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qkv_format: str = "bshd",
                    attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None,
                    softmax_scale: Optional[float] = None, backend: str = "auto",
                    out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Scaled-dot-product attention with Q, K, V (and dO in backward) in MXFP8, differentiable.

    q: [B, Sq, Hq, D] (bshd), [Sq, B, Hq, D] (sbhd) or [B, Hq, Sq, D] (bhsd); k, v: the same with Hkv heads
    (Hq % Hkv == 0) and Skv positions. dtypes bf16, fp16 or fp32 (one for all three). Returns O in q's layout
    and shape, dtype `out_dtype` (default: q's dtype for bf16/fp16, bf16 for fp32).
    attn_mask_type: "no_mask", "causal" (top-left diagonal) or "causal_bottom_right"; window_size=(left, right)
    as in Transformer Engine (-1 = unbounded). softmax_scale defaults to 1/sqrt(D).
    backend: "auto" (cudnn on Blackwell, else triton on CUDA, else reference), "cudnn", "triton", "reference".
    NaN in an input gives NaN in the outputs that depend on it (the MXFP8 block holding it has a NaN scale).
    """
    validate_inputs(q, k, v, qkv_format)
    mask = mask_from_te(attn_mask_type, window_size)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if out_dtype is None:
        out_dtype = q.dtype if q.dtype in OUTPUT_DTYPES else torch.bfloat16
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    name = _choose_backend(backend, str(q.device), head_dim, q.dtype)
    return _run(to_bhsd(q, qkv_format), to_bhsd(k, qkv_format), to_bhsd(v, qkv_format), float(softmax_scale),
                mask, out_dtype, qkv_format, name)


def _run(q, k, v, softmax_scale: float, mask: MaskSpec, out_dtype, qkv_format: str, backend: str):
    out = ops.attention_fwd(q, k, v, softmax_scale, mask.causal, mask.diagonal_alignment == "bottom_right",
                            mask.left_bound, mask.right_bound, out_dtype, qkv_format, backend)
    return from_bhsd(out[0], qkv_format)


__all__ = ["mxfp8_attention", "validate_inputs", "check_backend_limits", "MXFP8NotSupportedError"]
