"""How the reference backend quantizes each operand under a `Recipe`, and the options it hands `ref` for it.

Operands are [B, H, S, D] tensors. Under ``scaling="mxfp8"`` a row-wise copy (blocks along D) and a column-wise
copy (blocks along S, restarting at each sequence of a packed batch) are `MXFP8Tensor`s with the recipe's scale
rounding; under ``"per_tensor"`` one `PerTensorFP8` serves both (dense batches only). The bf16-V variant keeps V
as a bfloat16 tensor. Padding rows of a padded batch are zeroed first (NaN there must reach no scale).

`SavedInputs` is what the reference backend keeps for backward under a non-default recipe: the (padding-zeroed)
high-precision inputs, quantized again in the backward (quantization is deterministic, so the backward sees the
forward's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from ..formats import MXFP8Tensor, quantize_mxfp8
from ..per_tensor import PerTensorFP8, quantize_per_tensor
from ..recipe import Recipe
from ..seqinfo import SeqInfo, zero_padding

#: one quantized operand: MXFP8 (blocks of 32), per-tensor FP8, or a bfloat16 tensor (the bf16-V variant)
Operand = Union[MXFP8Tensor, PerTensorFP8, torch.Tensor]


def quantize_rowcol(x: torch.Tensor, seq: Optional[SeqInfo], which: str, recipe: Recipe
                    ) -> Tuple[Operand, Operand]:
    """(row-wise, column-wise) copies of x [B, H, S, D] under the recipe's scaling and scale rounding."""
    x = zero_padding(x, seq, which)
    if recipe.scaling == "per_tensor":
        both = quantize_per_tensor(x)
        return both, both
    return _mxfp8(x, -1, recipe), _mxfp8(x, -2, recipe, seq, which)


def _mxfp8(x: torch.Tensor, axis: int, recipe: Recipe, seq: Optional[SeqInfo] = None, which: str = "q"
           ) -> MXFP8Tensor:
    """MXFP8 copy of x (padding already zeroed) blocked along `axis` with the recipe's scale rounding; with seq,
    blocks along S restart at the sequences of side `which` of a packed batch."""
    segments = seq.segments(which) if seq is not None else None
    return quantize_mxfp8(x, axis=axis, segments=segments, scale_rounding=recipe.scale_rounding)


def v_operands(v: torch.Tensor, seq: Optional[SeqInfo], recipe: Recipe) -> Tuple[Operand, Operand]:
    """(V for dO V^T, V for P V): quantized row-wise and column-wise, or (bf16-V variant) V rounded to bfloat16
    for both."""
    if recipe.v_operand == "bf16":
        vb = _bf16_v(v, seq)
        return vb, vb
    return quantize_rowcol(v, seq, "kv", recipe)


def _bf16_v(v: torch.Tensor, seq: Optional[SeqInfo]) -> torch.Tensor:
    return zero_padding(v, seq, "kv").to(torch.bfloat16)


def forward_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: Optional[SeqInfo], recipe: Recipe
                     ) -> Tuple[MXFP8Tensor, MXFP8Tensor, Operand]:
    """The forward's operands alone, as `quantize_rowcol` / `v_operands` make them (the same bytes): Q and K
    row-wise (Q K^T), V column-wise or, under the bf16-V variant, in bfloat16 (P V). MXFP8 scaling only."""
    v_col = _bf16_v(v, seq) if recipe.v_operand == "bf16" else \
        _mxfp8(zero_padding(v, seq, "kv"), -2, recipe, seq, "kv")
    return _mxfp8(zero_padding(q, seq, "q"), -1, recipe), _mxfp8(zero_padding(k, seq, "kv"), -1, recipe), v_col


def pair(x: Operand) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The (data, scale) pair `ref` takes for an operand: (fp8, E8M0 scale), (fp8, fp32 scale_inv) or
    (bfloat16 tensor, None)."""
    if isinstance(x, MXFP8Tensor):
        return x.data, x.scale
    if isinstance(x, PerTensorFP8):
        return x.data, x.scale_inv
    return x, None


def ref_forward_options(recipe: Recipe) -> dict:
    """`ref.sdpa_fwd_quantized`'s recipe options for `recipe` (P's rounding; operands come quantized)."""
    if recipe.p_quant == "lazy16":
        return dict(p_format="e4m3", p_scale=16.0, rescale_threshold=4.0)
    if recipe.p_quant == "none":
        return dict(p_format="bf16")
    return dict(p_format="e4m3", p_scale=256.0, rescale_threshold=None)


def ref_backward_options(recipe: Recipe) -> dict:
    """`ref.sdpa_bwd_quantized`'s recipe options for `recipe` (P's and dS's rounding)."""
    p_format = "bf16" if recipe.p_quant == "none" else "e4m3"  # lazy16's backward is fixed256's
    return dict(p_format=p_format, p_scale=256.0, ds_format=recipe.ds_quant, scaling=recipe.scaling,
                scale_rounding=recipe.scale_rounding)


@dataclass
class SavedInputs:
    """The reference backend's saved format under a non-default recipe: q [B,Hq,Sq,D], k, v [B,Hkv,Skv,D] as the
    forward received them (padding rows of a padded batch zeroed), copies. See `SavedForBackward` for the three
    methods a saved format has."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v

    @classmethod
    def from_tensors(cls, flat, seq: Optional[SeqInfo] = None) -> "SavedInputs":
        return cls(*flat)

    @classmethod
    def fake_tensors(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: Optional[SeqInfo] = None
                     ) -> Tuple[torch.Tensor, ...]:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: Optional[SeqInfo]) -> "SavedInputs":
        """Copies of q, k, v with a padded batch's padding rows zeroed (never the caller's tensors: the custom
        op's outputs may not alias its inputs)."""
        return cls(*(zero_padding(x, seq, w).clone() for x, w in ((q, "q"), (k, "kv"), (v, "kv"))))


__all__ = ["Operand", "SavedInputs", "forward_operands", "pair", "quantize_rowcol", "ref_backward_options",
           "ref_forward_options", "v_operands", "zero_padding"]
