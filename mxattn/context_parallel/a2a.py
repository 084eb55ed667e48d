"""cp_comm_type="a2a" (Ulysses): an all-to-all trades the sequence split for a head split, the ordinary
`mxfp8_attention` runs on whole sequences for this rank's Hq/cp query heads and Hkv/cp key/value heads, and a
second all-to-all trades back. Every rank then computes exactly what the single-device call computes for its
heads, so O and every gradient equal that call's bit for bit (any backend; the Triton kernels on GPUs).

Padded batches (bshd/sbhd with cu_seqlens) run the ordinary padded call on the whole sequences. A packed batch
(thd) runs the ordinary packed call on its valid tokens (gathered out of the padded sequences, blocks restarting
at each sequence, as the single call on the unpadded batch does), O scattered back with zeros in the padding.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..attention import mxfp8_attention
from ..backends import choose_backend
from ..backends.base import Problem
from ..layouts import from_bhsd, to_bhsd
from . import comm
from .checks import CPCall


def check_backend(call: CPCall, q, k) -> str:
    """The backend the per-rank call will run (MXFP8NotSupportedError when none can); q, k: [B, H, S, D]."""
    cp, seqs = call.cp_size, call.seqs
    packed = seqs.packed
    problem = Problem(device=q.device, dtype=q.dtype, batch=seqs.batch, heads_q=q.shape[1] // cp,
                      heads_kv=k.shape[1] // cp, seqlen_q=max(seqs.lengths, default=0) if packed else cp * seqs.local,
                      seqlen_kv=max(seqs.lengths, default=0) if packed else cp * seqs.local, head_dim=q.shape[3],
                      head_dim_v=call.head_dim_v, mask=call.band,
                      varlen=None if seqs.lengths is None else ("packed" if packed else "padded"),
                      needs_backward=call.needs_backward, out_dtype=call.kernel_dtype, softmax_type=call.softmax_type)
    return choose_backend(call.backend, problem)  # (mxfp8_attention pads V where the choice asks for it)


def _head_slice(rank: int, heads: int, cp: int) -> slice:
    n = heads // cp
    return slice(rank * n, (rank + 1) * n)


def seq_to_heads(tensors: Sequence[torch.Tensor], call: CPCall) -> List[torch.Tensor]:
    """Local shards [B, H, S, D] (each its own H, D, dtype) -> this rank's head group gathered over the ranks
    [B, H/cp, cp * S, D], as `Seqs.gathered` lays it out (bshd/sbhd: the whole sequence in order)."""
    cp = call.cp_size
    send = torch.stack([comm.pack_bytes([t[:, _head_slice(j, t.shape[1], cp)] for t in tensors])
                        for j in range(cp)])
    recv = comm.all_to_all(send, call.group)
    likes = [((t.shape[0], t.shape[1] // cp, t.shape[2], t.shape[3]), t.dtype) for t in tensors]
    parts = [comm.unpack_bytes(recv[i], likes) for i in range(cp)]
    return [call.seqs.gathered([p[n] for p in parts]) for n in range(len(tensors))]


def heads_to_seq(tensors: Sequence[torch.Tensor], call: CPCall) -> List[torch.Tensor]:
    """The inverse of `seq_to_heads`: [B, h, cp * S, D] of this rank's heads -> local shards [B, h * cp, S, D]."""
    cp = call.cp_size
    pieces = [call.seqs.pieces(t) for t in tensors]  # (each tensor cut once: rank j's shard of each)
    send = torch.stack([comm.pack_bytes([p[j] for p in pieces]) for j in range(cp)])
    recv = comm.all_to_all(send, call.group)
    likes = [((t.shape[0], t.shape[1], t.shape[2] // cp, t.shape[3]), t.dtype) for t in tensors]
    parts = [comm.unpack_bytes(recv[i], likes) for i in range(cp)]
    return [torch.cat([p[n] for p in parts], dim=1) for n in range(len(tensors))]


class SeqToHeads(torch.autograd.Function):
    """(q, k, v) local shards -> gathered q, k, v of this rank's heads; backward the inverse all-to-all (one
    collective each way)."""

    @staticmethod
    def forward(ctx, call: CPCall, q, k, v):
        ctx.call = call
        ctx.likes = [(x.shape, x.dtype) for x in (q, k, v)]
        return tuple(seq_to_heads([q, k, v], call))

    @staticmethod
    def backward(ctx, *grads):
        cp = ctx.call.cp_size
        device = next(g.device for g in grads if g is not None)
        dqkv = [g if g is not None else torch.zeros((s[0], s[1] // cp, s[2] * cp, s[3]), dtype=dtype, device=device)
                for g, (s, dtype) in zip(grads, ctx.likes)]
        return (None, *heads_to_seq(dqkv, ctx.call))


class HeadsToSeq(torch.autograd.Function):
    """O [B, Hq/cp, cp * S, D] of this rank's heads -> this rank's shard [B, Hq, S, D]; backward the inverse."""

    @staticmethod
    def forward(ctx, call: CPCall, o):
        ctx.call = call
        return heads_to_seq([o], call)[0]

    @staticmethod
    def backward(ctx, do):
        return None, seq_to_heads([do], ctx.call)[0]


def attend_whole(call: CPCall, q, k, v, sink: Optional[torch.Tensor]) -> torch.Tensor:
    """`mxfp8_attention` on whole sequences laid out as `Seqs.gathered` lays them out (q, k, v [B, h, S, D] views;
    S = cp * the shard's tokens), O the same way in q's dtype; sink: the logits of these heads or None."""
    options = dict(attn_mask_type=call.attn_mask_type, window_size=call.window, softmax_scale=call.softmax_scale,
                   backend=call.backend, softmax_type=call.softmax_type, softmax_offset=sink)
    if not call.seqs.packed:
        return mxfp8_attention(q, k, v, qkv_format="bhsd", cu_seqlens_q=call.cu_seqlens,
                               cu_seqlens_kv=call.cu_seqlens, **options)
    # the valid tokens, one packed segment per sequence: what the single call on the unpadded batch reads
    rows = call.seqs.whole(q.device).rows
    o = mxfp8_attention(*(from_bhsd(x.index_select(2, rows), "thd") for x in (q, k, v)), qkv_format="thd",
                        cu_seqlens_q=call.cu_seqlens, cu_seqlens_kv=call.cu_seqlens,
                        max_seqlen_q=max(call.seqs.lengths), max_seqlen_kv=max(call.seqs.lengths), **options)
    o = to_bhsd(o, "thd")
    return o.new_zeros(q.shape[:3] + (o.shape[3],)).index_copy(2, rows, o)


def run(call: CPCall, q, k, v, softmax_offset: Optional[torch.Tensor]) -> torch.Tensor:
    """O [B, Hq, S, D] in q's dtype of the local q, k, v ([B, H, S, D] views); softmax_offset: the learnable
    sink logits fp32 [Hq] (None for the other softmax types), of which this rank uses its heads' slice (so its
    gradient is that slice's)."""
    q_all, k_all, v_all = SeqToHeads.apply(call, q, k, v)
    sink = None
    if call.softmax_type == "learnable":
        sink = softmax_offset[_head_slice(call.rank, softmax_offset.shape[0], call.cp_size)]
    return HeadsToSeq.apply(call, attend_whole(call, q_all, k_all, v_all, sink))
