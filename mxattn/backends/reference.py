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

from typing import Callable, List, Optional, Tuple

import torch

from ref import mxfp8_ref

from ..constants import ceil_div
from ..formats import BLOCK_SIZE, MXFP8Tensor
from ..recipe import Recipe, check_recipe_varlen
from ..seqinfo import SeqInfo
from ..formats import quantize_mxfp8
from ..kvcache_step import check_queries
from .base import AttentionBackend, AttentionParams, CacheCall, SavedForBackward, check_forward_quantized
from .recipe_operands import (Operand, SavedInputs, pair, quantize_rowcol, ref_backward_options,
                              ref_forward_options, v_operands)


def _ref_mask_kwargs(params: AttentionParams) -> dict:
    mask = params.mask
    return dict(attn_scale=params.softmax_scale, diagonal_alignment=mask.diagonal_alignment,
                window=(mask.left_bound, mask.right_bound), out_dtype=params.out_dtype, sink=params.sink)


def _mx(seq: SeqInfo, x: Operand, b: int, cu: List[int]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(data, scale) of sequence b of an MXFP8 copy (row- or column-wise) [B, H, S, D], or (rows, None) of a
    bfloat16 operand (the bf16-V variant); cu: the cu_seqlens of x's side as a Python list (`host_offsets`).
    Per-tensor operands have no sequences (`check_recipe_varlen`)."""
    if not isinstance(x, MXFP8Tensor):
        return seq.rows_of(x, b, cu), None
    if x.axis == 3:
        return seq.rows_of(x.data, b, cu), seq.rows_of(x.scale, b, cu)
    if seq.packed:
        part = x.segment(b, cu)
        return part.data, part.scale
    n = cu[b + 1] - cu[b]
    return x.data[b:b + 1, :, :n], x.scale[b:b + 1, :, :ceil_div(n, BLOCK_SIZE)]


def _per_sequence(seq: SeqInfo, body: Callable[[int, List[int], List[int]], None],
                  no_keys: Optional[Callable[[int, List[int], List[int]], None]] = None) -> None:
    """body(b, cu_q, cu_kv) for every sequence b with queries and keys, no_keys(b, cu_q, cu_kv) for those with
    queries only (cu_q, cu_kv: `SeqInfo.host_offsets`, read once). Outputs start as zeros / -inf stats, which is
    what an empty sequence keeps."""
    cu_q, cu_kv = seq.host_offsets()
    for b in range(seq.batch):
        len_q, len_kv = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        if len_q > 0 and len_kv > 0:
            body(b, cu_q, cu_kv)
        elif len_q > 0 and no_keys is not None:
            no_keys(b, cu_q, cu_kv)


class ReferenceBackend(AttentionBackend):
    """Pure PyTorch emulation of the cuDNN MXFP8 recipe and of every `Recipe` variant; slow, exact, runs
    anywhere."""

    name = "reference"
    supported_head_dims = None
    output_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    takes_stats_grad = True
    supports_distinct_v_dim = True

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        return True, "pure PyTorch; runs on any device"

    @classmethod
    def supports_recipe(cls, recipe: Recipe) -> Tuple[bool, str]:
        return True, "every recipe"

    @classmethod
    def saved_format_for(cls, recipe: Recipe) -> type:
        return cls.saved_format if recipe.is_default else SavedInputs

    @classmethod
    def supports_cache(cls, call: CacheCall) -> Tuple[bool, str]:
        return True, "pure PyTorch over the cache's stored bytes; runs on any device"

    def attend_cache(self, call: CacheCall):
        """Each sequence's queries against its cached bytes through `ref.mxfp8_ref`, one sequence at a time."""
        q, cache, slots, cu = call.q, call.cache, call.slots, call.cu
        if call.k_new is not None:
            cache._append(slots, call.k_new, call.v_new, cu)
        check_queries(cache, slots, cu, [cache._lens[s] for s in slots])
        out = torch.zeros((*q.shape[:2], cache.head_dim_v), dtype=call.kernel_dtype, device=q.device)
        for slot, a, b in zip(slots, cu, cu[1:]):
            if b == a:
                continue
            q_row = quantize_mxfp8(q[a:b].transpose(0, 1).unsqueeze(0), axis=-1)
            k_row, v_col = cache.keys(slot), cache.values(slot)
            o, _ = mxfp8_ref.sdpa_fwd_quantized(q_row.data, q_row.scale, k_row.data, k_row.scale, v_col.data,
                                                v_col.scale, attn_scale=call.softmax_scale,
                                                diagonal_alignment="bottom_right", window=(call.left_bound, 0),
                                                out_dtype=call.kernel_dtype, sink=call.sink)
            out[a:b] = o[0].transpose(0, 1)
        return out, None

    def forward(self, q, k, v, params: AttentionParams):
        q_row, q_col, k_row, k_col, v_row, v_col = self._operands(q, k, v, params)
        if params.recipe.is_default:
            saved = SavedForBackward(q_row=q_row, q_col=q_col, k_row=k_row, k_col=k_col, v_row=v_row)
        else:
            saved = SavedInputs.of(q, k, v, params.seq) if params.needs_backward else None
        return (*self._forward_on(q_row, k_row, v_col, params), saved)

    def saved_for_backward(self, q, k, v, params: AttentionParams):
        """`forward`'s saved copies (`AttentionBackend.saved_for_backward`): its quantizations, no attention."""
        if not params.recipe.is_default:
            check_recipe_varlen(params.recipe.encode(), None if params.seq is None else params.seq.kind,
                                "params.recipe")
            return SavedInputs.of(q, k, v, params.seq)
        q_row, q_col, k_row, k_col, v_row, _ = self._operands(q, k, v, params)
        return SavedForBackward(q_row=q_row, q_col=q_col, k_row=k_row, k_col=k_col, v_row=v_row)

    @staticmethod
    def _operands(q, k, v, params: AttentionParams) -> tuple:
        """(q_row, q_col, k_row, k_col, v_row, v_col): the quantized operands of the forward and the backward."""
        seq, recipe = params.seq, params.recipe
        check_recipe_varlen(recipe.encode(), None if seq is None else seq.kind, "params.recipe")
        return (*quantize_rowcol(q, seq, "q", recipe), *quantize_rowcol(k, seq, "kv", recipe),
                *v_operands(v, seq, recipe))

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

        def one(b: int, cu_q: List[int], cu_kv: List[int]) -> None:
            o_b, stats_b = mxfp8_ref.sdpa_fwd_quantized(*_mx(seq, q_row, b, cu_q), *_mx(seq, k_row, b, cu_kv),
                                                        *_mx(seq, v_col, b, cu_kv), **opts)
            seq.rows_of(o, b, cu_q).copy_(o_b)
            seq.rows_of(stats, b, cu_q).copy_(stats_b)

        def only_sink(b: int, cu_q: List[int], cu_kv: List[int]) -> None:  # no keys: sink alone, O = 0, stats = sink
            rows = seq.rows_of(stats, b, cu_q)
            rows.copy_(params.sink.view(1, -1, 1, 1).expand_as(rows))

        _per_sequence(seq, one, only_sink if params.sink is not None else None)
        return o, stats

    def backward(self, saved, o, stats, do, params: AttentionParams, dstats=None):
        """`AttentionBackend.backward` through `ref`'s backward (dstats handed on: ref subtracts it from delta),
        sequence by sequence for a padded or packed batch."""
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
                o=o, do=do, do_row=pair(do_row), do_col=pair(do_col), stats=stats, dstats=dstats, **opts)
            return grads if params.sink_requires_grad else grads[:3]
        dq = torch.zeros(q_row.shape, dtype=params.out_dtype, device=do.device)
        dk = torch.zeros(k_row.shape, dtype=params.out_dtype, device=do.device)
        dv = torch.zeros(v_row.shape, dtype=params.out_dtype, device=do.device)
        dsink = None if params.sink is None else torch.zeros_like(params.sink, dtype=torch.float32)

        def one(b: int, cu_q: List[int], cu_kv: List[int]) -> None:
            grads = mxfp8_ref.sdpa_bwd_quantized(
                q_row=_mx(seq, q_row, b, cu_q), q_col=_mx(seq, q_col, b, cu_q),
                k_row=_mx(seq, k_row, b, cu_kv), k_col=_mx(seq, k_col, b, cu_kv),
                v_row=_mx(seq, v_row, b, cu_kv), o=seq.rows_of(o, b, cu_q), do=seq.rows_of(do, b, cu_q),
                do_row=_mx(seq, do_row, b, cu_q), do_col=_mx(seq, do_col, b, cu_q),
                stats=seq.rows_of(stats, b, cu_q),
                dstats=None if dstats is None else seq.rows_of(dstats, b, cu_q), **opts)
            for out, g, cu in zip((dq, dk, dv), grads, (cu_q, cu_kv, cu_kv)):
                seq.rows_of(out, b, cu).copy_(g)
            if dsink is not None:
                dsink.add_(grads[3])

        def only_sink(b: int, cu_q: List[int], cu_kv: List[int]) -> None:  # stats = sink: dstats is its gradient
            dsink.add_(seq.rows_of(dstats, b, cu_q).sum(dim=(0, 2, 3)))

        # sequences with no keys have O = 0, so delta = 0: their dsink is their dstats alone
        _per_sequence(seq, one, only_sink if dsink is not None and dstats is not None else None)
        return (dq, dk, dv, dsink) if params.sink_requires_grad else (dq, dk, dv)
