"""qkv_format handling: every layout becomes a [B, H, S, D] *view* (never a copy), and back."""

from __future__ import annotations

from typing import Tuple

import torch

QKV_FORMATS = ("bshd", "sbhd", "bhsd", "thd")
# permutation taking a tensor in `format` order to [B, H, S, D]
_TO_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
# permutation taking [B, H, S, D] back to `format` order
_FROM_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}


def check_format(qkv_format: str) -> None:
    """Raise ValueError unless qkv_format is one of bshd, sbhd, bhsd."""
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")


def to_bhsd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """View a 4-D tensor given in `qkv_format` as [B, H, S, D]."""
    return x.permute(_TO_BHSD[qkv_format])


def bhsd_shape(x: torch.Tensor, qkv_format: str) -> Tuple[int, ...]:
    """The [B, H, S, D] shape of a tensor given in `qkv_format` ([T, H, D] for thd reads as [1, H, T, D]),
    without making a view."""
    shape = x.shape
    if qkv_format == "thd":
        return (1, shape[1], shape[0], shape[2])
    return tuple([shape[i] for i in _TO_BHSD[qkv_format]])


def from_bhsd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """View a [B, H, S, D] tensor in `qkv_format` order."""
    return x.permute(_FROM_BHSD[qkv_format])


def dense_strides_bhsd(shape_bhsd: Tuple[int, int, int, int], qkv_format: str) -> Tuple[int, ...]:
    """Strides of a [B, H, S, D] view whose memory is dense in `qkv_format` order (no allocation)."""
    physical = [shape_bhsd[i] for i in _FROM_BHSD[qkv_format]]
    strides, step = [0] * 4, 1
    for axis in reversed(range(4)):
        strides[axis] = step
        step *= max(physical[axis], 1)
    return tuple(strides[i] for i in _TO_BHSD[qkv_format])


def empty_bhsd(shape_bhsd: Tuple[int, int, int, int], qkv_format: str, dtype, device) -> torch.Tensor:
    """An uninitialised [B, H, S, D] view whose memory is dense in `qkv_format` order."""
    physical = [shape_bhsd[i] for i in _FROM_BHSD[qkv_format]]
    return to_bhsd(torch.empty(physical, dtype=dtype, device=device), qkv_format)
