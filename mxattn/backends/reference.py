"""The `reference` backend: `ref.mxfp8_ref` on any device (CPU included), bit-exact by construction.

Inputs are quantized with `mxattn.quantize_mxfp8` (bit-identical to ref's own quantizer) and the quantized
bytes go through ref's `sdpa_fwd_quantized` / `sdpa_bwd_quantized`, so results equal `ref` exactly. A padded
or packed batch (`params.seq`) runs sequence by sequence on views of the quantized tensors: padding rows are
read as zeros, column-wise blocks of a packed batch restart at each sequence (`formats` segments).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from ref import mxfp8_ref

from ..formats import BLOCK_SIZE, MXFP8Tensor, quantize_mxfp8
from ..seqinfo import SeqInfo
from .base import AttentionBackend, AttentionParams, SavedForBackward


def _ref_mask_kwargs(params: AttentionParams) -> dict:
    mask = params.mask
    return dict(attn_scale=params.softmax_scale, diagonal_alignment=mask.diagonal_alignment,
                window=(mask.left_bound, mask.right_bound), out_dtype=params.out_dtype, sink=params.sink)


def _zero_padding(x: torch.Tensor, seq: Optional[SeqInfo], which: str) -> torch.Tensor:
    """x with the padding rows of a padded batch set to 0 (NaN there must not reach a scale)."""
    if seq is None or seq.packed:
        return x
    return torch.where(seq.valid_rows(which, x.shape[2]), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _quantize(x: torch.Tensor, seq: Optional[SeqInfo], which: str) -> Tuple[MXFP8Tensor, MXFP8Tensor]:
    """(row-wise, column-wise) MXFP8 copies of x [B,H,S,D]; column blocks restart at each packed sequence."""
    x = _zero_padding(x, seq, which)
    return quantize_mxfp8(x, axis=-1), quantize_mxfp8(x, axis=-2, segments=seq.segments(which) if seq else None)


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

    def mx(self, x: MXFP8Tensor, which: str, b: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(data, scale) of sequence b of an MXFP8 copy (row- or column-wise)."""
        if x.axis == 3:
            return self.rows(x.data, which, b), self.rows(x.scale, which, b)
        if self.seq.packed:
            part = x.segment(b, self.cu[which])
            return part.data, part.scale
        n = self.length(which, b)
        return x.data[b:b + 1, :, :n], x.scale[b:b + 1, :, :-(-n // BLOCK_SIZE)]


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
    """Pure PyTorch emulation of the cuDNN MXFP8 recipe; slow, exact, runs anywhere."""

    name = "reference"
    supported_head_dims = None

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        return True, "pure PyTorch; runs on any device"

    def forward(self, q, k, v, params: AttentionParams):
        seq = params.seq
        (q_row, q_col), (k_row, k_col) = _quantize(q, seq, "q"), _quantize(k, seq, "kv")
        v_row, v_col = _quantize(v, seq, "kv")
        saved = SavedForBackward(q_row=q_row, q_col=q_col, k_row=k_row, k_col=k_col, v_row=v_row)
        if seq is None:
            o, stats = mxfp8_ref.sdpa_fwd_quantized(q_row.data, q_row.scale, k_row.data, k_row.scale,
                                                    v_col.data, v_col.scale, **_ref_mask_kwargs(params))
            return o, stats, saved
        B, H, S, D = q.shape
        o = torch.zeros((B, H, S, v.shape[3]), dtype=params.out_dtype, device=q.device)
        stats = torch.full((B, H, S, 1), float("-inf"), dtype=torch.float32, device=q.device)

        def one(seqs: _Sequences, b: int) -> None:
            o_b, stats_b = mxfp8_ref.sdpa_fwd_quantized(*seqs.mx(q_row, "q", b), *seqs.mx(k_row, "kv", b),
                                                        *seqs.mx(v_col, "kv", b), **_ref_mask_kwargs(params))
            seqs.rows(o, "q", b).copy_(o_b)
            seqs.rows(stats, "q", b).copy_(stats_b)

        def only_sink(seqs: _Sequences, b: int) -> None:  # no keys: the sink alone, O = 0, stats = sink
            rows = seqs.rows(stats, "q", b)
            rows.copy_(params.sink.view(1, -1, 1, 1).expand_as(rows))

        _per_sequence(seq, one, only_sink if params.sink is not None else None)
        return o, stats, saved

    def backward(self, saved: SavedForBackward, o, stats, do, params: AttentionParams):
        seq = params.seq
        do_row, do_col = _quantize(do, seq, "q")
        pair = lambda t: (t.data, t.scale)  # noqa: E731
        if seq is None:
            grads = mxfp8_ref.sdpa_bwd_quantized(
                q_row=pair(saved.q_row), q_col=pair(saved.q_col), k_row=pair(saved.k_row),
                k_col=pair(saved.k_col), v_row=pair(saved.v_row), o=o, do=do,
                do_row=pair(do_row), do_col=pair(do_col), stats=stats, **_ref_mask_kwargs(params))
            return grads if params.sink_requires_grad else grads[:3]
        dq = torch.zeros(saved.q_row.shape, dtype=params.out_dtype, device=do.device)
        dk = torch.zeros(saved.k_row.shape, dtype=params.out_dtype, device=do.device)
        dv = torch.zeros(saved.v_row.shape, dtype=params.out_dtype, device=do.device)
        dsink = None if params.sink is None else torch.zeros_like(params.sink, dtype=torch.float32)

        def one(seqs: _Sequences, b: int) -> None:
            grads = mxfp8_ref.sdpa_bwd_quantized(
                q_row=seqs.mx(saved.q_row, "q", b), q_col=seqs.mx(saved.q_col, "q", b),
                k_row=seqs.mx(saved.k_row, "kv", b), k_col=seqs.mx(saved.k_col, "kv", b),
                v_row=seqs.mx(saved.v_row, "kv", b), o=seqs.rows(o, "q", b), do=seqs.rows(do, "q", b),
                do_row=seqs.mx(do_row, "q", b), do_col=seqs.mx(do_col, "q", b), stats=seqs.rows(stats, "q", b),
                **_ref_mask_kwargs(params))
            for out, g, which in zip((dq, dk, dv), grads, ("q", "kv", "kv")):
                seqs.rows(out, which, b).copy_(g)
            if dsink is not None:
                dsink.add_(grads[3])

        _per_sequence(seq, one)  # sequences with no keys have O = 0, so delta = 0: no dsink either
        return (dq, dk, dv, dsink) if params.sink_requires_grad else (dq, dk, dv)
