"""The backend side of `mxfp8_attention(..., return_lse=True)`: O and the softmax statistics (log-sum-exp), both
differentiable (the checks and the encoding of the call are `mxattn.attention`'s).

The statistics are the `stats` every backend's forward returns ([B, Hq, Sq, 1] fp32, the sink counted). Their
gradient dLSE enters the backward as delta = rowsum(O * dO) - dLSE (d lse / d S = P), which the backends with
`takes_stats_grad` take as `dstats`; the backend choice sees `Problem.stats_grad` and picks one of those when a
gradient will be wanted. The call runs eagerly (`_AttentionLSE` calls the chosen backend's forward and backward
directly, outside the custom ops); under torch.compile it is a graph break.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .backends import choose_backend, get_backend, v_padding
from .layouts import narrow_o, widen_v
from .op_args import FwdArgs


@torch.compiler.disable  # eager only: the backend's forward and backward are called without the custom ops
def attention_with_lse(args: FwdArgs, softmax_type: str) -> Tuple[Tensor, Tensor]:
    """(O [B, Hq, Sq, D] in args.out_dtype, lse) of the forward call args (`mxattn.attention.encode_call`'s, on
    [B, H, S, D] views, not empty), on the backend args.backend names or "auto" chooses, differentiable in q, k,
    v and a learnable sink. lse: fp32 log-sum-exp of the scaled scores per query row and head, the sink counted,
    [B, Hq, Sq] ([Hq, T_q] for a packed batch); -inf in rows with no key (the sink logit with a sink) and in
    padding rows."""
    needs = ops.needs_backward(args.q, args.k, args.v, args.sink)
    problem = dataclasses.replace(args.problem(softmax_type, needs), stats_grad=needs)
    args = args._replace(backend=choose_backend(args.backend, problem))
    v_pad = v_padding(args.backend, problem)
    if v_pad:
        args = args._replace(v=widen_v(args.v, v_pad))
    if needs:
        o, stats = _AttentionLSE.apply(args.without_tensors(), args.q, args.k, args.v, args.sink, args.cu_seqlens_q,
                                       args.cu_seqlens_kv)
    else:
        o, stats, _ = _forward(args, needs_backward=False)
    return narrow_o(o, v_pad), lse_layout(stats, args.packed)


def lse_layout(stats: Tensor, packed: bool) -> Tensor:
    """stats [B, Hq, Sq, 1] (a packed batch [1, Hq, T, 1]) as FlashAttention lays softmax_lse out: [B, Hq, Sq],
    or [Hq, T] packed (views)."""
    return stats[0, :, :, 0] if packed else stats[..., 0]


def empty_lse(qb: Tensor, sink: Optional[Tensor], qkv_format: str) -> Tensor:
    """lse of a call with nothing to compute (qb [B, Hq, Sq, D], a packed batch [1, Hq, T, D]): the sink logit in
    every row (differentiable with a learnable sink), else -inf."""
    b, h, s = qb.shape[:3]
    if sink is None:
        stats = torch.full((b, h, s, 1), float("-inf"), dtype=torch.float32, device=qb.device)
    else:
        stats = sink.view(1, h, 1, 1).expand(b, h, s, 1).clone()
    return lse_layout(stats, qkv_format == "thd")


def _forward(args: FwdArgs, needs_backward: bool):
    """(o, stats, saved) of the chosen backend's forward on args' tensors (saved None without a backward)."""
    return get_backend(args.backend).forward(args.q, args.k, args.v, args.params(needs_backward))


class _AttentionLSE(torch.autograd.Function):
    """(O, stats) of the chosen backend, both differentiable. Arguments: the forward op's options (`FwdArgs`
    without tensors), then q, k, v [B, H, S, D] views, the sink (None or fp32 [Hq]) and cu_seqlens_q/kv (None
    for a dense batch)."""

    @staticmethod
    def forward(ctx, options: FwdArgs, q, k, v, sink, cu_seqlens_q, cu_seqlens_kv):
        args = options._replace(q=q, k=k, v=v, sink=sink, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)
        o, stats, saved = _forward(args, needs_backward=True)
        saved = saved.tensors()
        ctx.options, ctx.n_saved = options, len(saved)
        ctx.input_dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(o, stats, *saved, sink, cu_seqlens_q, cu_seqlens_kv)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros
        return o, stats

    @staticmethod
    def backward(ctx, grad_o, grad_stats):
        o, stats, *rest = ctx.saved_tensors
        saved, (sink, cu_q, cu_kv) = rest[:ctx.n_saved], rest[ctx.n_saved:]
        sink_requires_grad = sink is not None and ctx.needs_input_grad[4]
        args = ctx.options._replace(sink=sink, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        params = args.params(sink_requires_grad=sink_requires_grad)
        backend = get_backend(args.backend)
        saved = backend.saved_format_for(params.recipe).from_tensors(saved, params.seq)
        if grad_o is None:  # only lse reaches the loss
            grad_o = torch.zeros_like(o)
        # (dstats only where there is one: backends without takes_stats_grad take no such argument)
        if grad_stats is not None:  # a row that keeps no key has lse = -inf, whatever the inputs: no gradient there
            # (a logsumexp merge over such rows hands back NaN, which delta - dstats would spread to every row)
            grad_stats = grad_stats.masked_fill(torch.isneginf(stats), 0.0)
        extra = {} if grad_stats is None else {"dstats": grad_stats}
        dq, dk, dv, *dsink = backend.backward(saved, o, stats, grad_o, params, **extra)
        dq, dk, dv = (g if g.dtype == dt else g.to(dt) for g, dt in zip((dq, dk, dv), ctx.input_dtypes))
        return None, dq, dk, dv, (dsink[0] if sink_requires_grad else None), None, None


__all__ = ["attention_with_lse", "empty_lse", "lse_layout"]
