"""Error measures used by the demo, the samples and the tests."""

from __future__ import annotations

import torch


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over all elements, computed in float64 (0 when both are zero)."""
    x, ref = x.double(), ref.double()
    denom = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / denom if denom > 0 else diff


def max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| in float64."""
    return (x.double() - ref.double()).abs().max().item()


def bf16_ulp(r: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at each value of r (any float tensor; fp32 result; 2^-133 for subnormals; at exactly zero
    2^-8, as torch.frexp gives zero the exponent 0: a coarse unit where the reference is zero)."""
    _, e = torch.frexp(r.float())
    return torch.ldexp(torch.ones_like(r, dtype=torch.float32), (e - 8).clamp(min=-133))


def bf16_ulps(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|x - ref| in units of ref's BF16 ulp, elementwise (fp32): 0 where equal, 1 for a neighbouring BF16 value."""
    return (x.float() - ref.float()).abs() / bf16_ulp(ref)
