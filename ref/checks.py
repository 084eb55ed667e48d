"""Argument validation shared by the reference emulator's dense and varlen entry points.

The recipe (quantization, masks, forward, backward, variants) is documented in the docstring of
``ref/mxfp8_ref.py``, the public module; "module docstring" below means that one. Never imports ``mxattn``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- validation


def _check_float_tensor(x, name: str, ndim: Optional[int] = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float16/bfloat16/float32/float64, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")


def _norm_axis(axis, ndim: int) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis: expected an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis: expected a value in [{-ndim}, {ndim - 1}], got {axis}")
    return axis % ndim


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected float16/bfloat16/float32/float64, got {out_dtype!r}")


def _check_p_scale(p_scale) -> float:
    if isinstance(p_scale, bool) or not isinstance(p_scale, (int, float)) or not p_scale > 0 or math.isinf(p_scale):
        raise ValueError(f"p_scale: expected a finite positive number, got {p_scale!r}")
    return float(p_scale)


def _check_device(t: torch.Tensor, name: str, device: torch.device, like: str) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {like}'s device {device}, got one on {t.device}")


def _check_rescale_threshold(rescale_threshold) -> None:
    if rescale_threshold is not None and not (isinstance(rescale_threshold, (int, float)) and rescale_threshold >= 0):
        raise ValueError(f"rescale_threshold: expected None or a number >= 0, got {rescale_threshold!r}")


_CHOICES = {
    "p_format": ("e4m3", "bf16"),
    "v_format": ("fp8", "bf16"),
    "ds_format": ("fp8", "bf16"),
    "scale_rounding": ("ceil", "floor"),
    "scaling": ("mxfp8", "per_tensor"),
}


def _check_choice(value, name: str) -> str:
    """One of the recipe options (module docstring); raises naming the option."""
    allowed = _CHOICES[name]
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
    return value


def _check_scaling(scaling, scale_rounding) -> None:
    _check_choice(scaling, "scaling")
    _check_choice(scale_rounding, "scale_rounding")
    if scaling == "per_tensor" and scale_rounding != "ceil":
        raise ValueError(f"scale_rounding: {scale_rounding!r} rounds MXFP8 block scales; scaling='per_tensor' "
                         "has FP32 scales (use 'ceil')")


def _check_shapes(q, k, v, names=("q", "k", "v")) -> Tuple[int, int, int, int, int, int, int]:
    """Shapes (and one device) of q [B,Hq,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv]; returns (B,Hq,Hkv,Sq,Skv,D,Dv)."""
    nq, nk, nv = names
    for t, n in ((q, nq), (k, nk), (v, nv)):
        if t.dim() != 4:
            raise ValueError(f"{n}: expected a 4-D [B, H, S, D] tensor, got shape {tuple(t.shape)}")
        _check_device(t, n, q.device, nq)
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Skv, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{nk}: expected [B={B}, Hkv, Skv, D={D}], got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, Hkv, Skv):
        raise ValueError(f"{nv}: expected [B={B}, Hkv={Hkv}, Skv={Skv}, Dv], got {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{nk}: number of heads {Hkv} must divide the query heads {Hq} (GQA/MQA)")
    if min(B, Hq, Sq, Skv, D, v.shape[3]) == 0:
        raise ValueError(f"{nq}/{nk}/{nv}: empty dimensions are not supported: {tuple(q.shape)}, {tuple(k.shape)}")
    return B, Hq, Hkv, Sq, Skv, D, v.shape[3]


def _check_sink(sink, hq: int, device: torch.device):
    """None, or a float32/float64 [Hq] tensor on ``device`` (the sink logits)."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or sink.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"sink: expected a float32/float64 tensor of shape [{hq}], got "
                        f"{getattr(sink, 'dtype', type(sink).__name__)}")
    if tuple(sink.shape) != (hq,):
        raise ValueError(f"sink: expected shape ({hq},) (one logit per query head), got {tuple(sink.shape)}")
    _check_device(sink, "sink", device, "q")
    return sink


def _attn_scale(attn_scale, d: int) -> float:
    if attn_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(attn_scale, bool) or not isinstance(attn_scale, (int, float)) or not math.isfinite(attn_scale):
        raise ValueError(f"attn_scale: expected a finite number or None, got {attn_scale!r}")
    return float(attn_scale)
