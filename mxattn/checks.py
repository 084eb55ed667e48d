"""Argument checks shared by the backends and the kernel entry points (raised before any kernel runs)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


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
