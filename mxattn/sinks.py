"""Attention sinks as Transformer Engine names them (`softmax_type`, `softmax_offset`): the checked sink logits."""

from __future__ import annotations

from typing import Optional

import torch

from .constants import SOFTMAX_TYPES


def sink_logits(softmax_type: str, softmax_offset, heads: int, device: torch.device) -> Optional[torch.Tensor]:
    """The sink logits, fp32 [heads] on `device`, of TE's softmax_type: None for "vanilla", zeros for "off-by-one",
    softmax_offset for "learnable" (checked). Raises TypeError/ValueError naming the argument."""
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
    if softmax_type != "learnable":
        if softmax_offset is not None:
            raise ValueError(f"softmax_offset is only used with softmax_type='learnable', got softmax_type="
                             f"{softmax_type!r}")
        return None if softmax_type == "vanilla" else torch.zeros(heads, dtype=torch.float32, device=device)
    if not isinstance(softmax_offset, torch.Tensor):
        raise TypeError(f"softmax_type='learnable' needs softmax_offset, a float32 tensor of shape [{heads}], "
                        f"got {type(softmax_offset).__name__}")
    if softmax_offset.dtype != torch.float32:
        raise TypeError(f"softmax_offset must have dtype torch.float32, got {softmax_offset.dtype}")
    if tuple(softmax_offset.shape) != (heads,):
        raise ValueError(f"softmax_offset must have shape ({heads},) (one logit per query head), got "
                         f"{tuple(softmax_offset.shape)}")
    if softmax_offset.device != device:
        raise ValueError(f"softmax_offset must be on q's device ({device}), got {softmax_offset.device}")
    return softmax_offset


__all__ = ["sink_logits"]
