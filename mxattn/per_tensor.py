"""Per-tensor FP8: one FP32 scale for a whole tensor (Transformer Engine's current scaling), the pre-MX baseline
of `Recipe(scaling="per_tensor")`.

Rule (E4M3 elements, as the MXFP8 recipe uses, so that only the scale granularity differs):

* ``amax = max |x|`` over the whole tensor, in FP32 (exact; NaN propagates);
* ``scale = 448 / amax`` (an FP32 division), except 1 when amax is 0 or +inf, and the largest FP32 number
  when the quotient overflows (amax below about 1.3e-36); a NaN amax gives a NaN scale;
* elements: ``E4M3(saturate(float32(x) * scale))``, the product rounded to FP32 first, then round to nearest
  even (NaN stays NaN);
* value: ``float32(element) * scale_inv`` with ``scale_inv = 1 / scale`` in FP32 (scales need not be powers
  of two, so neither the element product nor the dequantization is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import INPUT_DTYPES

E4M3_MAX = 448.0


@dataclass
class PerTensorFP8:
    """data: float8_e4m3fn, the original tensor's shape; scale_inv: float32 0-d tensor (value = data *
    scale_inv), on data's device."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        """float32 data * scale_inv, data's shape."""
        return self.data.to(torch.float32) * self.scale_inv


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """float32 0-d scale of a float32 0-d amax (module docstring)."""
    quotient = torch.full((), E4M3_MAX, dtype=torch.float32, device=amax.device) / amax
    scale = torch.where(torch.isinf(quotient), torch.finfo(torch.float32).max, quotient)
    return torch.where((amax == 0) | (amax == float("inf")), 1.0, scale)


@torch.no_grad()
def quantize_per_tensor(x: torch.Tensor) -> PerTensorFP8:
    """x: bf16/fp16/fp32, any shape and strides, non-empty -> PerTensorFP8 (data contiguous)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must have dtype bfloat16, float16 or float32, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError("x must be non-empty (its scale comes from its largest magnitude)")
    amax = torch.linalg.vector_norm(x, ord=float("inf")).to(torch.float32)
    scale = scale_from_amax(amax)
    data = (x.to(torch.float32) * scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
    return PerTensorFP8(data=data, scale_inv=torch.reciprocal(scale))


__all__ = ["PerTensorFP8", "quantize_per_tensor", "scale_from_amax"]
