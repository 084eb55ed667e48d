"""MXFP8 block quantization (E4M3 elements, E8M0 scales), P rounding and per-tensor FP8.

The recipe (quantization, masks, forward, backward, variants) is documented in the docstring of
``ref/mxfp8_ref.py``, the public module; "module docstring" below means that one. Never imports ``mxattn``.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from .checks import _check_choice, _check_float_tensor, _norm_axis


BLOCK_SIZE = 32
E4M3_MAX = 448.0
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------- MXFP8 quantization


def _exp2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact FP32 2^k for an integer tensor k, on k's device.

    Built from the IEEE bit pattern (no exp2 call, so every device gives the same bits):
    normal for -126 <= k <= 127, subnormal for -149 <= k <= -127, 0 below -149, +inf above 127.
    """
    k = k.to(torch.int32)
    normal = ((k.clamp(-126, 127) + 127) << 23).view(torch.float32)
    subnormal = (torch.ones_like(k) << (k.clamp(-149, -127) + 149)).view(torch.float32)
    out = torch.where(k >= -126, normal, subnormal)
    out = torch.where(k < -149, 0.0, out)
    return torch.where(k > 127, float("inf"), out)


def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Round-up E8M0 biased exponent (int32) of FP32 ``amax`` / 448 (spec section 2)."""
    descale = amax.to(torch.float32) / E4M3_MAX
    bits = descale.view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    e = e.clamp(0, 254)
    e = torch.where(descale <= 2.0**-127, 0, e)
    return torch.where(torch.isnan(descale), 255, e).to(torch.int32)


def _scale_exponent_floor(amax: torch.Tensor) -> torch.Tensor:
    """OCP ("floor") E8M0 biased exponent (int32) of FP32 ``amax``: its exponent field minus 8 (E4M3's largest
    power of two is 2^8), clamped to [0, 254]; NaN gives 255 (+inf has field 255, so 247)."""
    a = amax.to(torch.float32)
    e = (((a.view(torch.int32) >> 23) & 0xFF) - 8).clamp(0, 254)
    return torch.where(torch.isnan(a), 255, e).to(torch.int32)


def _quantize_blocks(x32: torch.Tensor, scale_rounding: str = "ceil") -> Tuple[torch.Tensor, torch.Tensor]:
    """x32 fp32 [..., n] with n % 32 == 0 -> (fp8 e4m3 data [..., n], int32 exponents [..., n/32])."""
    blocks = x32.unflatten(-1, (-1, BLOCK_SIZE))
    amax = blocks.abs().amax(dim=-1)
    e = _scale_exponent(amax) if scale_rounding == "ceil" else _scale_exponent_floor(amax)
    rcp = torch.where(e == 255, float("nan"), _exp2_f32(127 - e))
    y = (blocks * rcp.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).flatten(-2), e


def quantize(x: torch.Tensor, axis: int = -1, *, scale_rounding: str = "ceil") -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (E4M3 elements, E8M0 scales) quantization along ``axis``.

    x: float16/bfloat16/float32/float64 tensor of any shape (cast to FP32 first).
    scale_rounding: "ceil" (round-up, spec section 2) or "floor" (OCP, module docstring).
    Returns (data, scale): data torch.float8_e4m3fn with x's shape (contiguous);
    scale torch.float8_e8m0fnu with x's shape except ceil(n/32) at ``axis``
    (contiguous). A length n that is not a multiple of 32 pads the last block with zeros.
    """
    _check_choice(scale_rounding, "scale_rounding")
    _check_float_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError("x: expected at least a 1-D tensor, got a scalar")
    ax = _norm_axis(axis, x.dim())
    n = x.shape[ax]
    if n == 0:
        raise ValueError(f"x: axis {ax} has length 0")
    xl = x.movedim(ax, -1).to(torch.float32)
    pad = (-n) % BLOCK_SIZE
    if pad:
        xl = F.pad(xl, (0, pad))
    data, e = _quantize_blocks(xl, scale_rounding)
    data = data[..., :n].movedim(-1, ax).contiguous()
    scale = e.to(torch.uint8).view(torch.float8_e8m0fnu).movedim(-1, ax).contiguous()
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """FP32 value of MXFP8 ``data`` (fp8, any shape) with compact ``scale`` along ``axis``.

    scale: torch.float8_e8m0fnu (or uint8 holding the exponent bytes) with data's
    shape except ceil(n/32) at ``axis``. Returns float32 data * 2^(e-127) (e = 255 -> NaN).
    """
    if not isinstance(data, torch.Tensor) or data.dtype not in _FP8_DTYPES:
        raise TypeError(f"data: expected a float8_e4m3fn/float8_e5m2 tensor, got {getattr(data, 'dtype', type(data))}")
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scale: expected a float8_e8m0fnu (or uint8) tensor, got {getattr(scale, 'dtype', type(scale))}")
    if data.dim() == 0:
        raise ValueError("data: expected at least a 1-D tensor, got a scalar")
    ax = _norm_axis(axis, data.dim())
    n = data.shape[ax]
    want = list(data.shape)
    want[ax] = -(-n // BLOCK_SIZE)
    if list(scale.shape) != want:
        raise ValueError(f"scale: expected shape {tuple(want)} for data {tuple(data.shape)} along axis {ax}, got {tuple(scale.shape)}")
    e = scale.view(torch.uint8).to(torch.int32)
    s = torch.where(e == 255, float("nan"), _exp2_f32(e - 127))
    s = s.repeat_interleave(BLOCK_SIZE, dim=ax).narrow(ax, 0, n)
    return data.to(torch.float32) * s


def _qdq(x: torch.Tensor, axis: int, scale_rounding: str = "ceil") -> torch.Tensor:
    """Quantize-dequantize round trip in FP32 (used for dS)."""
    return dequantize(*quantize(x, axis, scale_rounding=scale_rounding), axis)


def _quant_p(p: torch.Tensor, p_scale: float) -> torch.Tensor:
    """Fixed-scale E4M3 rounding of probabilities: E4M3(P * p_scale) / p_scale, saturating."""
    return (p * p_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(p.dtype) / p_scale


def _round_p(p: torch.Tensor, p_format: str, p_scale: float) -> torch.Tensor:
    """P as the P V / P^T dO products take it: fixed-scale E4M3 ("e4m3") or rounded to bfloat16 ("bf16")."""
    if p_format == "bf16":
        return p.to(torch.bfloat16).to(p.dtype)
    return _quant_p(p, p_scale)


# --------------------------------------------------------------------------- per-tensor FP8 (the baseline)

_FP32_MAX = torch.finfo(torch.float32).max


def _per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 0-d scale 448 / amax of an FP32 0-d amax (1 for amax 0 or +inf, FP32 max on overflow, NaN stays)."""
    scale = torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device) / amax
    scale = torch.where(torch.isinf(scale), _FP32_MAX, scale)
    return torch.where((amax == 0) | torch.isinf(amax), 1.0, scale)


def _per_tensor_from_amax(x32: torch.Tensor, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 data of FP32 x32, FP32 0-d scale_inv) with the scale of ``amax``."""
    scale = _per_tensor_scale(amax)
    data = (x32 * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, torch.ones((), dtype=torch.float32, device=x32.device) / scale


def quantize_per_tensor(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 (Transformer Engine's current scaling, module docstring) of x (any shape, cast to FP32).

    Returns (data torch.float8_e4m3fn with x's shape (contiguous), scale_inv float32 0-d): the value of an
    element is float(data) * scale_inv (an FP32 product)."""
    _check_float_tensor(x, "x")
    if x.numel() == 0:
        raise ValueError("x: expected a non-empty tensor")
    x32 = x.to(torch.float32).contiguous()
    return _per_tensor_from_amax(x32, x32.abs().amax())


def _qdq_per_tensor(x32: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor quantize-dequantize of FP32 x32 with the scale of ``amax`` (dS over all its chunks)."""
    data, scale_inv = _per_tensor_from_amax(x32, amax)
    return data.to(torch.float32) * scale_inv
