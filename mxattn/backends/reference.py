"""The `reference` backend: `ref.mxfp8_ref` on any device (CPU included), bit-exact by construction.

Inputs are quantized with `mxattn.quantize_mxfp8` (bit-identical to ref's own quantizer) and the quantized
bytes go through ref's `sdpa_fwd_quantized` / `sdpa_bwd_quantized`, so results equal `ref` exactly. A padded
or packed batch (`params.seq`) runs sequence by sequence on views of the quantized tensors: padding rows are
read as zeros, column-wise blocks of a packed batch restart at each sequence (`formats` segments).

Every `Recipe` runs here (`recipe_operands` quantizes the operands as the recipe says and names ref's options
for it). The default recipe keeps the MXFP8 copies for backward (`SavedForBackward`); any other keeps the
inputs (`SavedInputs`) and quantizes them again in the backward.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from ref import mxfp8_ref

from ..constants import ceil_div
from ..formats import BLOCK_SIZE, MXFP8Tensor
from ..recipe import Recipe, check_recipe_varlen
from ..seqinfo import SeqInfo
from .base import AttentionBackend, AttentionParams, SavedForBackward, check_forward_quantized
from .recipe_operands import (Operand, SavedInputs, pair, quantize_rowcol, ref_backward_options,
                              ref_forward_options, v_operands)


def _ref_mask_kwargs(params: AttentionParams) -> dict:
    mask = params.mask
    return dict(attn_scale=params.softmax_scale, diagonal_alignment=mask.diagonal_alignment,
                window=(mask.left_bound, mask.right_bound), out_dtype=params.out_dtype, sink=params.sink)


class _Sequences:
    """Views of one sequence of a padded or packed batch (host offsets read once)."""

    def __init__(self, seq: SeqInfo):
        self.seq = seq
        self.cu = dict(zip(("q", "kv"), seq.host_offsets()))

    def __iter__(self) -> Iterator[Tuple[int, int, int]]:
        for b in range(self.seq.batch):
            yield b, self.length("q", b), self.length("kv", b)

    def length(self, which: str, b: int) -> int:
        return self.cu[which][b + 1] - self.cu[which][b]

    def rows(self, t: torch.Tensor, which: str, b: int) -> torch.Tensor:
        """The [1, H, len, *] rows of sequence b of a plain [B, H, S, *] tensor."""
        if self.seq.packed:
            return t[:, :, self.cu[which][b]:self.cu[which][b + 1]]
        return t[b:b + 1, :, :self.length(which, b)]

    def mx(self, x: Operand, which: str, b: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(data, scale) of sequence b of an MXFP8 copy (row- or column-wise), or (rows, None) of a bfloat16
        operand (the bf16-V variant). Per-tensor operands have no sequences (`check_recipe_varlen`)."""
        if not isinstance(x, MXFP8Tensor):
            return self.rows(x, which, b), None
        if x.axis == 3:
            return self.rows(x.data, which, b), self.rows(x.scale, which, b)
        if self.seq.packed:
            part = x.segment(b, self.cu[which])
            return part.data, part.scale
        n = self.length(which, b)
        return x.data[b:b + 1, :, :n], x.scale[b:b + 1, :, :ceil_div(n, BLOCK_SIZE)]


def _per_sequence(seq: SeqInfo, body: Callable[[_Sequences, int], None],
                  no_keys: Optional[Callable[[_Sequences, int], None]] = None) -> None:
    """body(seqs, b) for every sequence with queries and keys; no_keys(seqs, b) for those with queries only.
    Outputs start as zeros / -inf stats, which is what an empty sequence keeps."""
    seqs = _Sequences(seq)
    for b, len_q, len_kv in seqs:
        if len_q > 0 and len_kv > 0:
            body(seqs, b)
        elif len_q > 0 and no_keys is not None:
            no_keys(seqs, b)


class ReferenceBackend(AttentionBackend):
    """Pure PyTorch emulation of the cuDNN MXFP8 recipe and of every `Recipe` variant; slow, exact, runs
    anywhere."""

    name = "reference"
    supported_head_dims = None

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        return True, "pure PyTorch; runs on any device"

    @classmethod
    def supports_recipe(cls, recipe: Recipe) -> Tuple[bool, str]:
        return True, "every recipe"

    @classmethod
    def saved_format_for(cls, recipe: Recipe) -> type:
        return cls.saved_format if recipe.is_default else SavedInputs

    def forward(self, q, k, v, params: AttentionParams):
        seq, recipe = params.seq, params.recipe
        check_recipe_varlen(recipe.encode(), None if seq is None else ("packed" if seq.packed else "padded"),
                            "params.recipe")
        q_row, q_col = quantize_rowcol(q, seq, "q", recipe)
        k_row, k_col = quantize_rowcol(k, seq, "kv", recipe)
        v_row, v_col = v_operands(v, seq, recipe)
        if recipe.is_default:
            saved = SavedForBackward(q_row=q_row, q_col=q_col, k_row=k_row, k_col=k_col, v_row=v_row)
        else:
            saved = SavedInputs.of(q, k, v, seq) if params.needs_backward else None
        return (*self._forward_on(q_row, k_row, v_col, params), saved)

    def forward_quantized(self, q, k, v, params: AttentionParams):
        """`forward`'s emulation on the given bytes (`AttentionBackend.forward_quantized`)."""
        check_forward_quantized(q, k, v, params)
        return self._forward_on(q, k, v, params)

    def _forward_on(self, q_row: Operand, k_row: Operand, v_col: Operand, params: AttentionParams
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(o, stats) of `ref`'s forward on the operands of Q K^T (row-wise Q, K) and P V (column-wise V, or V in
        bf16), [B, H, S, D], sequence by sequence for a padded or packed batch."""
        seq = params.seq
        opts = dict(_ref_mask_kwargs(params), **ref_forward_options(params.recipe))
        if seq is None:
            return mxfp8_ref.sdpa_fwd_quantized(*pair(q_row), *pair(k_row), *pair(v_col), **opts)
        B, H, S, _ = q_row.shape
        device = q_row.data.device
        o = torch.zeros((B, H, S, v_col.shape[3]), dtype=params.out_dtype, device=device)
        stats = torch.full((B, H, S, 1), float("-inf"), dtype=torch.float32, device=device)

        def one(seqs: _Sequences, b: int) -> None:
            o_b, stats_b = mxfp8_ref.sdpa_fwd_quantized(*seqs.mx(q_row, "q", b), *seqs.mx(k_row, "kv", b),
                                                        *seqs.mx(v_col, "kv", b), **opts)
            seqs.rows(o, "q", b).copy_(o_b)
            seqs.rows(stats, "q", b).copy_(stats_b)

        def only_sink(seqs: _Sequences, b: int) -> None:  # no keys: the sink alone, O = 0, stats = sink
            rows = seqs.rows(stats, "q", b)
            rows.copy_(params.sink.view(1, -1, 1, 1).expand_as(rows))

        _per_sequence(seq, one, only_sink if params.sink is not None else None)
        return o, stats

    def backward(self, saved, o, stats, do, params: AttentionParams):
        seq, recipe = params.seq, params.recipe
        if recipe.is_default:
            parts = (saved.q_row, saved.q_col, saved.k_row, saved.k_col, saved.v_row)
        else:
            v_row, _ = v_operands(saved.v, seq, recipe)
            parts = (*quantize_rowcol(saved.q, seq, "q", recipe), *quantize_rowcol(saved.k, seq, "kv", recipe), v_row)
        q_row, q_col, k_row, k_col, v_row = parts
        do_row, do_col = quantize_rowcol(do, seq, "q", recipe)
        opts = dict(_ref_mask_kwargs(params), **ref_backward_options(recipe))
        if seq is None:
            grads = mxfp8_ref.sdpa_bwd_quantized(
                q_row=pair(q_row), q_col=pair(q_col), k_row=pair(k_row), k_col=pair(k_col), v_row=pair(v_row),
                o=o, do=do, do_row=pair(do_row), do_col=pair(do_col), stats=stats, **opts)
            return grads if params.sink_requires_grad else grads[:3]
        dq = torch.zeros(q_row.shape, dtype=params.out_dtype, device=do.device)
        dk = torch.zeros(k_row.shape, dtype=params.out_dtype, device=do.device)
        dv = torch.zeros(v_row.shape, dtype=params.out_dtype, device=do.device)
        dsink = None if params.sink is None else torch.zeros_like(params.sink, dtype=torch.float32)

        def one(seqs: _Sequences, b: int) -> None:
            grads = mxfp8_ref.sdpa_bwd_quantized(
                q_row=seqs.mx(q_row, "q", b), q_col=seqs.mx(q_col, "q", b),
                k_row=seqs.mx(k_row, "kv", b), k_col=seqs.mx(k_col, "kv", b),
                v_row=seqs.mx(v_row, "kv", b), o=seqs.rows(o, "q", b), do=seqs.rows(do, "q", b),
                do_row=seqs.mx(do_row, "q", b), do_col=seqs.mx(do_col, "q", b), stats=seqs.rows(stats, "q", b),
                **opts)
            for out, g, which in zip((dq, dk, dv), grads, ("q", "kv", "kv")):
                seqs.rows(out, which, b).copy_(g)
            if dsink is not None:
                dsink.add_(grads[3])

        _per_sequence(seq, one)  # sequences with no keys have O = 0, so delta = 0: no dsink either
        return (dq, dk, dv, dsink) if params.sink_requires_grad else (dq, dk, dv)
