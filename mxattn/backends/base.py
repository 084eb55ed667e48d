"""The small typed interface every attention backend implements.

Tensors cross this interface as [B, H, S, D] views (any strides). A backend quantizes its own inputs, so it
can use a fused quantizer, and hands back exactly what the backward pass needs (`SavedForBackward`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..formats import MXFP8Tensor
from ..mask import MaskSpec


@dataclass(frozen=True)
class AttentionParams:
    """Everything besides the tensors that a forward/backward call needs."""

    softmax_scale: float
    mask: MaskSpec
    out_dtype: torch.dtype = torch.bfloat16
    deterministic: bool = True


@dataclass
class SavedForBackward:
    """FP8 copies kept from the forward pass (compact E8M0 scales), never the high-precision inputs.

    q_row, k_row, v_row: blocks along D; q_col, k_col: blocks along S. Each data tensor is [B, H, S, D].
    """

    q_row: MXFP8Tensor
    q_col: MXFP8Tensor
    k_row: MXFP8Tensor
    k_col: MXFP8Tensor
    v_row: MXFP8Tensor

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """Flat (data, scale) tuple in field order, for autograd's save_for_backward."""
        out = []
        for t in (self.q_row, self.q_col, self.k_row, self.k_col, self.v_row):
            out += [t.data, t.scale]
        return tuple(out)

    @classmethod
    def from_tensors(cls, flat) -> "SavedForBackward":
        """Inverse of `tensors()`."""
        axes = (3, 2, 3, 2, 3)
        parts = [MXFP8Tensor(flat[2 * i], flat[2 * i + 1], axis) for i, axis in enumerate(axes)]
        return cls(*parts)


class AttentionBackend(abc.ABC):
    """One way of running MXFP8 attention. Subclasses set `name` and `supported_head_dims`."""

    name: str = ""
    #: head dims this backend runs; None means any.
    supported_head_dims: Optional[Tuple[int, ...]] = None
    #: dtypes of q, k, v this backend takes
    input_dtypes: Tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

    @classmethod
    @abc.abstractmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        """(usable on `device`, human-readable reason). Never raises."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
                ) -> Tuple[torch.Tensor, torch.Tensor, SavedForBackward]:
        """q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] high precision -> (o [B,Hq,Sq,D] out_dtype, stats [B,Hq,Sq,1] fp32,
        saved)."""

    @abc.abstractmethod
    def backward(self, saved: SavedForBackward, o: torch.Tensor, stats: torch.Tensor, do: torch.Tensor,
                 params: AttentionParams) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """o, do [B,Hq,Sq,D] (bf16/fp16), stats [B,Hq,Sq,1] fp32 -> (dq [B,Hq,Sq,D], dk, dv [B,Hkv,Skv,D]) in
        params.out_dtype."""
