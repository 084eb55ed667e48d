"""cp_comm_type="all_gather": K and V gathered over the ranks, each local query chunk attends a key prefix.

Forward: all_gather K, V (their own dtype); the query chunk c (global offset a = c * L) attends keys [0, a + L)
of its sequence with a bottom-right causal diagonal (a causal window carries over as is), or every key without a
mask. With padding (cu_seqlens, thd) each partial call runs on its rows' valid lengths (`seqs`): the bottom-right
diagonal then sits at each sequence's own offset, as a prefix keeps it. Each partial call walks its keys from 0
in the order the single-device call does and quantizes the same 32-token blocks, so O equals that call's bit for
bit.
Backward: K and V are gathered again and each chunk's FP8 copies remade from them (`saved_for_backward`, the
bytes the forward would have kept), so between the passes a rank holds its own shards only. Each chunk's backward
writes dQ (its own rows: equal to the single call's after one rounding) and
partial dK, dV over its prefix in float32; the ranks' partials are summed in float32 by one reduce-scatter back
to the owners' chunks and rounded once. The sink's gradient (learnable) is this rank's query rows' share.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..mask import MaskSpec
from . import comm
from .checks import CPCall
from .layout import local_chunks
from .seqs import add_at, put, take
from .steps import Step, fold_back, plan_step


def plan(call: CPCall, q, k) -> List[Optional[Step]]:
    """The Steps of this rank's two query chunks (q, k: [B, H, S, D] views of the local shards); None for a
    chunk without valid queries."""
    seqs, steps = call.seqs, []
    for c in local_chunks(call.cp_size, call.rank):
        keys = range(c + 1) if call.causal else range(2 * call.cp_size)
        steps.append(plan_step(call, q, k, seqs.side([c], False, q.device), seqs.side(keys, True, q.device),
                               _prefix_mask(call.band, c == 0), call.sink, fp32_forward=False))
    return steps


def _prefix_mask(band: MaskSpec, own_chunk: bool) -> MaskSpec:
    """The band of a query chunk on a key prefix ending with it: the causal diagonal (and window) bottom-right,
    which is top-left when the prefix is the chunk itself (own_chunk); no mask stays none."""
    if band.is_unmasked:
        return band
    alignment = "top_left" if own_chunk else "bottom_right"
    return MaskSpec(diagonal_alignment=alignment, left_bound=band.left_bound, right_bound=band.right_bound)


class AllGatherAttention(torch.autograd.Function):
    """O [B, Hq, S, D] (kernel dtype) of this rank's query chunks; arguments: the CPCall, its Steps, then the
    [B, H, S, D] views of the local q, k, v and the sink logits (or None)."""

    @staticmethod
    def forward(ctx, call: CPCall, steps: List[Optional[Step]], q, k, v, sink):
        k_all, v_all = _gathered(call, k, v)
        o = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=call.kernel_dtype, device=q.device)
        stats = []
        for step in steps:
            if step is None:
                continue
            o_i, stats_i = step.run_forward(q, k_all, v_all)
            put(o, step.q.rows, o_i)
            stats.append(stats_i)
        if call.needs_backward:
            ctx.call, ctx.steps, ctx.has_sink = call, steps, sink is not None
            ctx.save_for_backward(o, q, k, v, *stats)
        return o

    @staticmethod
    def backward(ctx, do):
        call, seqs = ctx.call, ctx.call.seqs
        o, q, k, v, *stats = ctx.saved_tensors
        k_all, v_all = _gathered(call, k, v)  # again: the forward kept none of the sequence's K/V
        B, Hkv, S = k.shape[0], k.shape[1], call.cp_size * k.shape[2]
        dq = torch.zeros(o.shape[:3] + (k.shape[3],), dtype=torch.float32, device=do.device)
        dk_all = torch.zeros((B, Hkv, S, k.shape[3]), dtype=torch.float32, device=do.device)
        dv_all = torch.zeros((B, Hkv, S, v.shape[3]), dtype=torch.float32, device=do.device)
        dsink = torch.zeros(o.shape[1] if ctx.has_sink else 0, dtype=torch.float32, device=do.device)
        stats = iter(stats)
        for step in ctx.steps:
            if step is None:
                continue
            rows, keys = step.q.rows, step.kv.rows
            grads = step.run_backward(step.saved_for(q, k_all, v_all), take(o, rows), next(stats), take(do, rows))
            put(dq, rows, grads[0])  # (each query row is one step's: its dQ as that step wrote it)
            add_at(dk_all, keys, grads[1])
            add_at(dv_all, keys, grads[2])
            if step.backward.sink_requires_grad:
                dsink += grads[3]
            del grads
        # rank j's piece: its shard of dK and dV
        pieces = [torch.cat([dk.reshape(-1), dv.reshape(-1)]) for dk, dv in zip(seqs.pieces(dk_all),
                                                                                 seqs.pieces(dv_all))]
        mine = comm.reduce_scatter(pieces, call.group)
        n_k = k.numel()
        dk, dv = mine[:n_k].view(k.shape), mine[n_k:].view(v.shape)
        sink_grad = dsink if ctx.has_sink and ctx.needs_input_grad[5] else None
        return (None, None, fold_back(dq, call.kernel_dtype, q.dtype), fold_back(dk, call.kernel_dtype, k.dtype),
                fold_back(dv, call.kernel_dtype, v.dtype), sink_grad)


def _gathered(call: CPCall, k, v):
    """(k, v) [B, Hkv, cp * S, D] of the whole sequence from every rank's shard, in sequence order."""
    likes = [(k.shape, k.dtype), (v.shape, v.dtype)]
    parts = [comm.unpack_bytes(flat, likes) for flat in comm.all_gather(comm.pack_bytes([k, v]), call.group)]
    return call.seqs.gathered([p[0] for p in parts]), call.seqs.gathered([p[1] for p in parts])
