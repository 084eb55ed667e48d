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
