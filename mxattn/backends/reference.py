"""The `reference` backend: `ref.mxfp8_ref` on any device (CPU included), bit-exact by construction.

Inputs are quantized with `mxattn.quantize_mxfp8` (bit-identical to ref's own quantizer) and the quantized
bytes go through ref's `sdpa_fwd_quantized` / `sdpa_bwd_quantized`, so results equal `ref` exactly.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ref import mxfp8_ref

from ..formats import quantize_mxfp8
from .base import AttentionBackend, AttentionParams, SavedForBackward


def _ref_mask_kwargs(params: AttentionParams) -> dict:
    mask = params.mask
    return dict(attn_scale=params.softmax_scale, causal=mask.causal,
                diagonal_alignment=mask.diagonal_alignment,
                window=(mask.left_bound, mask.right_bound), out_dtype=params.out_dtype)


class ReferenceBackend(AttentionBackend):
    """Pure PyTorch emulation of the cuDNN MXFP8 recipe; slow, exact, runs anywhere."""

    name = "reference"
    supported_head_dims = None

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        return True, "pure PyTorch; runs on any device"

    def forward(self, q, k, v, params: AttentionParams):
        saved = SavedForBackward(
            q_row=quantize_mxfp8(q, axis=-1), q_col=quantize_mxfp8(q, axis=-2),
            k_row=quantize_mxfp8(k, axis=-1), k_col=quantize_mxfp8(k, axis=-2),
            v_row=quantize_mxfp8(v, axis=-1))
        v_col = quantize_mxfp8(v, axis=-2)
        o, stats = mxfp8_ref.sdpa_fwd_quantized(
            saved.q_row.data, saved.q_row.scale, saved.k_row.data, saved.k_row.scale,
            v_col.data, v_col.scale, **_ref_mask_kwargs(params))
        return o, stats, saved

    def backward(self, saved: SavedForBackward, o, stats, do, params: AttentionParams):
        do_row, do_col = quantize_mxfp8(do, axis=-1), quantize_mxfp8(do, axis=-2)
        pair = lambda t: (t.data, t.scale)  # noqa: E731
        return mxfp8_ref.sdpa_bwd_quantized(
            q_row=pair(saved.q_row), q_col=pair(saved.q_col), k_row=pair(saved.k_row),
            k_col=pair(saved.k_col), v_row=pair(saved.v_row), o=o, do=do,
            do_row=pair(do_row), do_col=pair(do_col), stats=stats, **_ref_mask_kwargs(params))
