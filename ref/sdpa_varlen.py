"""Variable-length entry points: sdpa_fwd_varlen / sdpa_bwd_varlen (packed "thd" or padded layouts).

The recipe (quantization, masks, forward, backward, variants) is documented in the docstring of
``ref/mxfp8_ref.py``, the public module; "module docstring" below means that one. Never imports ``mxattn``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .checks import (_attn_scale, _check_choice, _check_device, _check_float_tensor, _check_out_dtype,
                     _check_p_scale, _check_rescale_threshold, _check_scaling, _check_sink)
from .masks import _resolve_mask
from .sdpa_dense import sdpa_bwd, sdpa_fwd


# --------------------------------------------------------------------------- variable lengths
#
# Each sequence of a varlen batch is computed by the dense functions (ref/sdpa_dense.py) on that sequence alone
# (a contiguous copy of its rows), so MXFP8 blocks along S start at the sequence's own first row, the
# masks use the sequence's own s_q and s_kv, and nothing outside the sequence (neighbours in a pack,
# padding rows, even NaN there) can reach its result. Outputs start as O = 0, stats = -inf and zero
# gradients; a sequence with no query rows or no keys is skipped and keeps them.
#
# layout "thd":          q [T_q, Hq, D], k [T_kv, Hkv, D], v [T_kv, Hkv, Dv]; sequence b is rows
#                        cu[b]:cu[b+1]; cu[-1] must equal T. stats [T_q, Hq].
# layout "bhsd_padded":  q [B, Hq, Sq_max, D], k [B, Hkv, Skv_max, D], v [B, Hkv, Skv_max, Dv]; sequence b
#                        is rows 0:len_b of batch b with len_b = cu[b+1] - cu[b] <= S_max. stats [B, Hq, Sq_max, 1].
#
# Internally every tensor is seen as a [B', H, S', *] view: thd [T, H, D] as [1, H, T, D] (stats [T, H] as
# [1, H, T, 1]), padded tensors as they are. Sequence b is then view[batch:batch+1, :, start:start+length].

_LAYOUTS = ("thd", "bhsd_padded")


class _Seq(NamedTuple):
    """Where sequence b lives in the [B', H, S', *] views."""
    batch: int  # index along B' (always 0 for thd)
    q0: int  # first query row
    len_q: int
    kv0: int  # first key row
    len_kv: int


def _check_layout(layout) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'thd' or 'bhsd_padded', got {layout!r}")


def _bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The [B', H, S', *] view of a varlen tensor (no copy)."""
    if layout == "bhsd_padded":
        return x
    if x.dim() == 2:  # thd stats [T, H]
        return x.transpose(0, 1).unsqueeze(0).unsqueeze(-1)
    return x.transpose(0, 1).unsqueeze(0)  # thd [T, H, D]


def _rows(x4: torch.Tensor, seq: _Seq, which: str) -> torch.Tensor:
    """View [1, H, len, *] of sequence ``seq``'s query ("q") or key ("kv") rows of a [B', H, S', *] view."""
    start, length = (seq.q0, seq.len_q) if which == "q" else (seq.kv0, seq.len_kv)
    return x4[seq.batch:seq.batch + 1, :, start:start + length]


def _check_cu_seqlens(cu, name: str) -> list:
    """Host list of a cumulative-lengths tensor [B+1] (int32/int64, starts at 0, non-decreasing)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected an int32/int64 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name}: expected a 1-D tensor [B+1] with B >= 1, got shape {tuple(cu.shape)}")
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {vals[0]}")
    for b in range(len(vals) - 1):
        if vals[b + 1] < vals[b]:
            raise ValueError(f"{name}: must be non-decreasing, got entry {b + 1} = {vals[b + 1]} "
                             f"after entry {b} = {vals[b]}")
    return vals


def _varlen_operands(layout: str, q, k, v):
    """Validate q, k, v of a varlen call; return their [B', H, S', D] views and the head dim D."""
    _check_layout(layout)
    ndim, form = (3, "[T, H, D]") if layout == "thd" else (4, "[B, H, S_max, D]")
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float_tensor(t, n)
        if t.dim() != ndim:
            raise ValueError(f"{n}: layout {layout!r} expects a {ndim}-D {form} tensor, got shape {tuple(t.shape)}")
        _check_device(t, n, q.device, "q")
    q4, k4, v4 = _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout)
    B, Hq, _, D = q4.shape
    Bk, Hkv, Skv, Dk = k4.shape
    if Bk != B:
        raise ValueError(f"k: batch {Bk} differs from q's batch {B}")
    if Dk != D:
        raise ValueError(f"k: head dim {Dk} differs from q's head dim {D}")
    if tuple(v4.shape[:3]) != (B, Hkv, Skv):
        raise ValueError(f"v: expected the sequence and head dims of k {tuple(k.shape)[:-1]}, got {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k: number of heads {Hkv} must divide the query heads {Hq} (GQA/MQA)")
    if min(Hq, D, v4.shape[3]) == 0:
        raise ValueError(f"q/k/v: empty head or head dimensions are not supported: {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    return q4, k4, v4, D


def _varlen_sequences(layout: str, cu_seqlens_q, cu_seqlens_kv, q4, k4) -> list:
    """Validate the cumulative lengths against the [B', H, S', D] views of q and k; one _Seq per sequence."""
    cq = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    ck = _check_cu_seqlens(cu_seqlens_kv, "cu_seqlens_kv")
    if len(ck) != len(cq):
        raise ValueError(f"cu_seqlens_kv: expected {len(cq)} entries (B = {len(cq) - 1} sequences, as in "
                         f"cu_seqlens_q), got {len(ck)}")
    batch = len(cq) - 1
    if layout == "thd":
        for cu, name, total, t in ((cq, "cu_seqlens_q", q4.shape[2], "q"), (ck, "cu_seqlens_kv", k4.shape[2], "k")):
            if cu[-1] != total:
                raise ValueError(f"{name}: last entry {cu[-1]} must equal the total length T = {total} of {t}")
        return [_Seq(0, cq[b], cq[b + 1] - cq[b], ck[b], ck[b + 1] - ck[b]) for b in range(batch)]
    if batch != q4.shape[0]:
        raise ValueError(f"cu_seqlens_q: expected B+1 = {q4.shape[0] + 1} entries for q's batch B = {q4.shape[0]}, "
                         f"got {len(cq)}")
    for cu, name, s_max, t in ((cq, "cu_seqlens_q", q4.shape[2], "q"), (ck, "cu_seqlens_kv", k4.shape[2], "k")):
        for b in range(batch):
            if cu[b + 1] - cu[b] > s_max:
                raise ValueError(f"{name}: sequence {b} has length {cu[b + 1] - cu[b]} > S_max = {s_max} of {t}")
    return [_Seq(b, 0, cq[b + 1] - cq[b], 0, ck[b + 1] - ck[b]) for b in range(batch)]


def _check_common_options(attn_scale, causal, diagonal_alignment, window, out_dtype, p_scale, recipe) -> None:
    """Validate the options up front: a batch of empty sequences never reaches the dense checks. recipe: the
    variant options (p_format, v_format, ds_format, scaling, scale_rounding) given."""
    _resolve_mask(causal, diagonal_alignment, window, 1, 1)
    _check_out_dtype(out_dtype)
    _check_p_scale(p_scale)
    _attn_scale(attn_scale, 1)
    for name, value in recipe.items():
        if name not in ("scaling", "scale_rounding"):
            _check_choice(value, name)
    _check_scaling(recipe["scaling"], recipe["scale_rounding"])
    if recipe["scaling"] == "per_tensor":
        raise ValueError("scaling: 'per_tensor' has no variable-length form (one scale per tensor would couple "
                         "the sequences); use the dense functions")


def sdpa_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, *, layout="thd", attn_scale=None, causal=False,
                    diagonal_alignment="top_left", window=(None, None), out_dtype=torch.bfloat16, p_scale=256.0,
                    quantize_inputs=True, rescale_threshold=None, sink=None, p_format="e4m3", v_format="fp8",
                    scaling="mxfp8", scale_rounding="ceil"):
    """Variable-length forward: ``sdpa_fwd`` on each sequence alone (see the section comment above).
    sink: None or the [Hq] sink logits; a sequence with queries but no keys then gets stats = sink.
    p_format, v_format, scaling, scale_rounding: the recipe variants of ``sdpa_fwd`` (scaling "mxfp8" only).

    layout "thd": q [T_q, Hq, D], k [T_kv, Hkv, D], v [T_kv, Hkv, Dv]; returns (o [T_q, Hq, Dv], stats [T_q, Hq]).
    layout "bhsd_padded": q [B, Hq, Sq_max, D], k/v [B, Hkv, Skv_max, *]; returns (o [B, Hq, Sq_max, Dv],
    stats [B, Hq, Sq_max, 1]); rows past a sequence's length are O = 0, stats = -inf.
    cu_seqlens_q / cu_seqlens_kv: int32/int64 [B+1], cumulative lengths from 0. Masks apply per sequence
    (bottom_right offset len_kv[b] - len_q[b]). Rows with no key to attend give O = 0 and stats = -inf.
    o is out_dtype; stats float32 (float64 for quantize_inputs=False with float64 q, k, v, as in ``sdpa_fwd``).
    """
    q4, k4, v4, _ = _varlen_operands(layout, q, k, v)
    seqs = _varlen_sequences(layout, cu_seqlens_q, cu_seqlens_kv, q4, k4)
    recipe = dict(p_format=p_format, v_format=v_format, scaling=scaling, scale_rounding=scale_rounding)
    _check_common_options(attn_scale, causal, diagonal_alignment, window, out_dtype, p_scale, recipe)
    _check_rescale_threshold(rescale_threshold)
    all64 = all(t.dtype == torch.float64 for t in (q, k, v))
    stats_dtype = torch.float64 if not quantize_inputs and all64 else torch.float32
    lead = q.shape[:-1]  # [T_q, Hq] or [B, Hq, Sq_max]
    o = torch.zeros(*lead, v.shape[-1], dtype=out_dtype, device=q.device)
    stats = torch.full(lead if layout == "thd" else (*lead, 1), float("-inf"), dtype=stats_dtype, device=q.device)
    o4, stats4 = _bhsd(o, layout), _bhsd(stats, layout)
    opts = dict(attn_scale=attn_scale, causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                out_dtype=out_dtype, p_scale=p_scale, quantize_inputs=quantize_inputs,
                rescale_threshold=rescale_threshold, sink=_check_sink(sink, q4.shape[1], q.device), **recipe)
    for seq in seqs:
        if seq.len_q > 0 and seq.len_kv == 0 and sink is not None:  # only the sink in the softmax
            _rows(stats4, seq, "q").copy_(sink.view(1, -1, 1, 1).expand_as(_rows(stats4, seq, "q")))
        if seq.len_q == 0 or seq.len_kv == 0:
            continue  # no query rows, or nothing to attend: O = 0, stats = -inf (or the sink)
        o_b, stats_b = sdpa_fwd(_rows(q4, seq, "q").contiguous(), _rows(k4, seq, "kv").contiguous(),
                                _rows(v4, seq, "kv").contiguous(), **opts)
        _rows(o4, seq, "q").copy_(o_b)
        _rows(stats4, seq, "q").copy_(stats_b)
    return o, stats


def sdpa_bwd_varlen(q, k, v, o, do, stats, cu_seqlens_q, cu_seqlens_kv, *, layout="thd", attn_scale=None,
                    causal=False, diagonal_alignment="top_left", window=(None, None), out_dtype=torch.bfloat16,
                    p_scale=256.0, quantize_inputs=True, sink=None, p_format="e4m3", v_format="fp8",
                    ds_format="fp8", scaling="mxfp8", scale_rounding="ceil", dstats=None):
    """Variable-length backward: ``sdpa_bwd`` on each sequence alone (see the section comment above).
    With sink [Hq] a fourth result dsink [Hq] (summed over the sequences) follows. dstats: None or the gradient
    of the forward's stats, shaped like stats (``sdpa_bwd``'s dstats, per sequence; a sequence with queries but
    no keys has stats = sink, so its dstats goes to dsink whole).
    p_format, v_format, ds_format, scaling, scale_rounding: the recipe variants of ``sdpa_bwd`` ("mxfp8" only).

    q, k, v, cu_seqlens_*, layout as in ``sdpa_fwd_varlen``; o, do shaped like q with v's head dim;
    stats as returned by ``sdpa_fwd_varlen`` (thd [T_q, Hq], padded [B, Hq, Sq_max, 1]) or None (recomputed).
    Returns (dq, dk, dv) shaped like q, k, v in out_dtype; padding rows and sequences with no query rows or
    no keys get zero gradients.
    """
    q4, k4, v4, _ = _varlen_operands(layout, q, k, v)
    want = (*q.shape[:-1], v.shape[-1])
    for t, n in ((o, "o"), (do, "do")):
        _check_float_tensor(t, n)
        if tuple(t.shape) != want:
            raise ValueError(f"{n}: expected shape {want} (q's rows and heads, v's head dim), got {tuple(t.shape)}")
        _check_device(t, n, q.device, "q")
    want_stats = tuple(q.shape[:-1]) if layout == "thd" else (*q.shape[:-1], 1)
    for t, n in ((stats, "stats"), (dstats, "dstats")):
        if t is not None:
            _check_float_tensor(t, n)
            if tuple(t.shape) != want_stats:
                raise ValueError(f"{n}: expected shape {want_stats}, got {tuple(t.shape)}")
            _check_device(t, n, q.device, "q")
    seqs = _varlen_sequences(layout, cu_seqlens_q, cu_seqlens_kv, q4, k4)
    recipe = dict(p_format=p_format, v_format=v_format, ds_format=ds_format, scaling=scaling,
                  scale_rounding=scale_rounding)
    _check_common_options(attn_scale, causal, diagonal_alignment, window, out_dtype, p_scale, recipe)
    dq, dk, dv = (torch.zeros(t.shape, dtype=out_dtype, device=q.device) for t in (q, k, v))
    o4, do4, dq4, dk4, dv4 = (_bhsd(t, layout) for t in (o, do, dq, dk, dv))
    stats4 = None if stats is None else _bhsd(stats, layout)
    dstats4 = None if dstats is None else _bhsd(dstats, layout)
    opts = dict(attn_scale=attn_scale, causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                out_dtype=out_dtype, p_scale=p_scale, quantize_inputs=quantize_inputs,
                sink=_check_sink(sink, q4.shape[1], q.device), **recipe)
    dsink = None if sink is None else torch.zeros(sink.shape, dtype=sink.dtype, device=q.device)
    for seq in seqs:
        dstats_b = None if dstats4 is None else _rows(dstats4, seq, "q").contiguous()
        if seq.len_q > 0 and seq.len_kv == 0 and dsink is not None and dstats_b is not None:
            dsink += dstats_b.sum(dim=(0, 2, 3)).to(dsink.dtype)  # stats = sink in these rows
        if seq.len_q == 0 or seq.len_kv == 0:
            continue  # no query rows, or nothing to attend (O = 0, so delta = 0): zero gradients
        stats_b = None if stats4 is None else _rows(stats4, seq, "q").contiguous()
        dq_b, dk_b, dv_b, *dsink_b = sdpa_bwd(_rows(q4, seq, "q").contiguous(), _rows(k4, seq, "kv").contiguous(),
                                    _rows(v4, seq, "kv").contiguous(), _rows(o4, seq, "q").contiguous(),
                                    _rows(do4, seq, "q").contiguous(), stats_b, dstats=dstats_b, **opts)
        _rows(dq4, seq, "q").copy_(dq_b)
        _rows(dk4, seq, "kv").copy_(dk_b)
        _rows(dv4, seq, "kv").copy_(dv_b)
        if dsink is not None:
            dsink += dsink_b[0].to(dsink.dtype)
    return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)
