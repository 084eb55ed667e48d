"""cp_comm_type="p2p": ring attention, K/V blocks passed around the ranks (Transformer Engine's scheme).

At step i rank r holds the K/V block of rank s = (r - i) mod cp (two chunks, as that rank holds them); the next
block's send/receive is issued before this step's compute. Causal: step 0 is the local queries on the local
block with a top-left causal mask; from s < r all local queries attend the first half of s's block, from s > r
the second half of the local queries attends s's whole block, both unmasked. No mask: everything on everything.
With padding (cu_seqlens, thd) each step is a padded or packed call on its rows' valid lengths (`seqs`), and a
step with no valid query or key computes nothing. Partial outputs are float32 with their log-sum-exp, merged in
float32 (the sink, left out of the partial calls, joins the merged log-sum-exp once) and rounded once.
Backward: the K/V blocks go round the ring a second time, and each step remakes its operands' FP8 copies from
them (`saved_for_backward`: the bytes the forward would have kept), so a rank holds one block's copies at a time,
not the whole sequence's. Each step's backward takes the final (rounded) O and the global log-sum-exp as the
single call's does; dQ sums locally in float32, dK/dV partials in float32 travel a second ring behind their block
to its owner (one hop more than the blocks did) and are rounded once; the sink's gradient comes from the global
log-sum-exp, this rank's query rows' share.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..backends.base import sink_grad_from_delta
from ..mask import MaskSpec
from . import comm
from .checks import CPCall
from .seqs import add_at, take
from .steps import Step, add_sink, fold_back, merge_at, plan_step


def plan(call: CPCall, q, k) -> List[Optional[Step]]:
    """The ring's steps on this rank (q, k: [B, H, S, D] views of the local shards); None for a step with
    nothing to compute (its block still travels)."""
    cp, r, seqs = call.cp_size, call.rank, call.seqs
    mine = (r, 2 * cp - 1 - r)
    steps = []
    for i in range(cp):
        s = (r - i) % cp
        theirs = (s, 2 * cp - 1 - s)
        if not call.causal:
            rows, keys, mask = mine, theirs, MaskSpec()
        elif i == 0:
            rows, keys, mask = mine, theirs, MaskSpec(causal=True)
        elif s < r:
            rows, keys, mask = mine, theirs[:1], MaskSpec()
        else:
            rows, keys, mask = mine[1:], theirs, MaskSpec()
        steps.append(plan_step(call, q, k, seqs.side(rows, False, q.device), seqs.side(keys, False, q.device),
                               mask, None, fp32_forward=True))
    return steps


class RingAttention(torch.autograd.Function):
    """O [B, Hq, S, D] (kernel dtype) of this rank's queries; arguments: the CPCall, its steps (`plan`), then the
    [B, H, S, D] views of the local q, k, v and the sink logits (or None)."""

    @staticmethod
    def forward(ctx, call: CPCall, steps: List[Optional[Step]], q, k, v, sink):
        B, Hq, rows = q.shape[0], q.shape[1], q.shape[2]
        acc_o = torch.zeros((B, Hq, rows, v.shape[3]), dtype=torch.float32, device=q.device)
        acc_lse = torch.full((B, Hq, rows, 1), float("-inf"), dtype=torch.float32, device=q.device)
        for step, k_s, v_s in _blocks_around(call, steps, k, v):
            o_i, lse_i = step.run_forward(q, k_s, v_s)
            merge_at(acc_o, acc_lse, step.q.rows, o_i, lse_i)
        if sink is not None:
            add_sink(acc_o, acc_lse, sink)
        o = acc_o.to(call.kernel_dtype)
        if call.needs_backward:
            ctx.call, ctx.steps, ctx.has_sink = call, steps, sink is not None
            ctx.save_for_backward(o, acc_lse, q, k, v, *((sink,) if sink is not None else ()))
        return o

    @staticmethod
    def backward(ctx, do):
        call, steps = ctx.call, ctx.steps
        o, lse, q, k, v, *rest = ctx.saved_tensors
        sink = rest[0] if ctx.has_sink else None
        ring = _ring(call, _GRAD_TAG)
        dq = torch.zeros(o.shape[:3] + (k.shape[3],), dtype=torch.float32, device=do.device)
        n_k = k.numel()
        pending = None
        for step, k_s, v_s in _blocks_around(call, steps, k, v, skip_empty=False):
            if step is not None:
                rows = step.q.rows
                dq_i, dk_i, dv_i = step.run_backward(step.saved_for(q, k_s, v_s), take(o, rows), take(lse, rows),
                                                     take(do, rows))[:3]
                add_at(dq, rows, dq_i)
            # the block's dK/dV so far arrives from the previous rank (this step's partial was computed meanwhile)
            if pending is None:
                acc = torch.zeros(n_k + v.numel(), dtype=torch.float32, device=do.device)
            else:
                acc = pending.wait()
            if step is not None:
                add_at(acc[:n_k].view(k.shape), step.kv.rows, dk_i)
                add_at(acc[n_k:].view(v.shape), step.kv.rows, dv_i)
            pending = ring.exchange(acc)
        mine = pending.wait()
        dk, dv = mine[:n_k].view(k.shape), mine[n_k:].view(v.shape)
        dsink = None
        if ctx.has_sink and ctx.needs_input_grad[5]:
            delta = (o.float() * do.float()).sum(dim=-1)
            dsink = sink_grad_from_delta(delta, lse, sink)
        return (None, None, fold_back(dq, call.kernel_dtype, q.dtype), fold_back(dk, call.kernel_dtype, k.dtype),
                fold_back(dv, call.kernel_dtype, v.dtype), dsink)


#: message tags of the two rings the backward runs at once (K/V blocks, and the dK/dV partials behind them)
_BLOCK_TAG, _GRAD_TAG = 1, 2


def _ring(call: CPCall, tag: int) -> comm.Ring:
    return comm.Ring(call.group, call.global_ranks, call.rank, call.cp_stream, tag=tag)


def _blocks_around(call: CPCall, steps: List[Optional[Step]], k, v, skip_empty: bool = True):
    """(step, k block, v block) for each step in turn, the blocks passed around the ring: step i gets rank
    (r - i) mod cp's, and the next block's send/receive is issued before step i is computed. skip_empty: leave
    out the steps with nothing to compute (their blocks still travel); else they come as (None, None, None)."""
    ring = _ring(call, _BLOCK_TAG)
    likes = [(k.shape, k.dtype), (v.shape, v.dtype)]
    block = comm.pack_bytes([k, v])
    for i, step in enumerate(steps):
        # a fresh buffer each step: a backend may keep what it was given
        pending = ring.exchange(block) if i + 1 < len(steps) else None
        if step is not None:
            yield (step, *comm.unpack_bytes(block, likes))
        elif not skip_empty:
            yield None, None, None
        if pending is not None:
            block = pending.wait()
