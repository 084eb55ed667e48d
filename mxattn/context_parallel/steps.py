"""Partial attention calls on parts of the sequence (the all_gather and p2p comm types): the rows each reads,
the backend that runs it, its parameters, and the merge of partial results by their log-sum-exp."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from ..backends import choose_backend, get_backend, v_padding
from ..backends.base import AttentionParams, Problem
from ..layouts import narrow_o, widen_v
from ..mask import MaskSpec
from .checks import CPCall
from .seqs import Side, step_seqinfo, take


class Step(NamedTuple):
    """One partial call: the rows of its queries and of its keys and values, its backend and parameters
    (forward; backward writes unrounded float32), and the zero channels V gets for that backend (`v_padding`:
    MLA's V on a backend of one head dim; O, dO and dV are cut back or widened to match)."""

    q: Side
    kv: Side
    backend: str
    forward: AttentionParams
    backward: AttentionParams
    v_pad: int = 0

    def run_forward(self, q, k, v) -> Tuple[torch.Tensor, torch.Tensor]:
        """(o [B,Hq,n,Dv] in forward.out_dtype, stats [B,Hq,n,1] fp32) of the backend on the step's rows of q and
        of k, v ([B, H, S, D] tensors the sides index). Nothing is kept: the backward remakes it (`saved_for`)."""
        o, stats, _ = get_backend(self.backend).forward(*self._operands(q, k, v), self.forward)
        return narrow_o(o, self.v_pad), stats

    def saved_for(self, q, k, v):
        """The copies the backend's forward keeps for its backward, made from the same inputs without the
        attention (`AttentionBackend.saved_for_backward`)."""
        return get_backend(self.backend).saved_for_backward(*self._operands(q, k, v), self.forward)

    def run_backward(self, saved, o, stats, do) -> Tuple[torch.Tensor, ...]:
        """(dq, dk, dv in float32[, dsink]) from `saved_for`'s copies; o, stats, do: the step's query rows."""
        if self.v_pad:
            o, do = widen_v(o, self.v_pad), widen_v(do, self.v_pad)
        grads = get_backend(self.backend).backward(saved, o, stats, do, self.backward)
        return (*grads[:2], narrow_o(grads[2], self.v_pad), *grads[3:])

    def _operands(self, q, k, v):
        v = take(v, self.kv.rows)
        return take(q, self.q.rows), take(k, self.kv.rows), widen_v(v, self.v_pad) if self.v_pad else v


def plan_step(call: CPCall, q: torch.Tensor, k: torch.Tensor, q_side: Side, kv_side: Side, mask: MaskSpec,
              sink: Optional[torch.Tensor], fp32_forward: bool) -> Optional[Step]:
    """The Step of a partial call of q's rows q_side on k's (and v's) rows kv_side with `mask` (q, k: [B, H, S, D]
    tensors like those the step will read), or None when a side has no valid row (nothing to compute). The
    backend is chosen as `mxfp8_attention` chooses, among those that write float32 where this call needs it
    (the forward when fp32_forward, the backward always). sink: the sink logits the partial call takes (None
    when the caller adds the sink itself). Raises MXFP8NotSupportedError when no backend can run it."""
    if q_side.empty or kv_side.empty:
        return None
    seq = step_seqinfo(q_side, kv_side, call.seqs.packed, q.device)
    out_fwd = torch.float32 if fp32_forward else call.kernel_dtype
    softmax_type = call.softmax_type if sink is not None else "vanilla"
    sink_grad = sink is not None and sink.requires_grad and call.needs_backward
    packed = seq is not None and seq.packed
    problem = Problem(device=q.device, dtype=q.dtype, batch=seq.batch if seq is not None else q.shape[0],
                      heads_q=q.shape[1], heads_kv=k.shape[1], seqlen_q=seq.max_seqlen_q if packed else q_side.count,
                      seqlen_kv=seq.max_seqlen_kv if packed else kv_side.count, head_dim=q.shape[3],
                      head_dim_v=call.head_dim_v, mask=mask,
                      varlen=None if seq is None else seq.kind, needs_backward=call.needs_backward,
                      out_dtype=torch.float32 if (fp32_forward or call.needs_backward) else call.kernel_dtype,
                      softmax_type=softmax_type)
    name = choose_backend(call.backend, problem)
    forward = AttentionParams(softmax_scale=call.softmax_scale, mask=mask, out_dtype=out_fwd, seq=seq, sink=sink,
                              sink_requires_grad=sink_grad, needs_backward=False)  # (saved_for remakes the copies)
    backward = AttentionParams(softmax_scale=call.softmax_scale, mask=mask, out_dtype=torch.float32, seq=seq,
                               sink=sink, sink_requires_grad=sink_grad)
    return Step(q_side, kv_side, name, forward, backward, v_padding(name, problem))


def merge_at(acc_o: torch.Tensor, acc_lse: torch.Tensor, rows, o: torch.Tensor, lse: torch.Tensor) -> None:
    """`merge_into` of a partial result of the rows `rows` (a Side's) of acc_o [B,Hq,S,D], acc_lse [B,Hq,S,1]."""
    if isinstance(rows, slice):
        merge_into(acc_o[:, :, rows], acc_lse[:, :, rows], o, lse)
        return
    part_o, part_lse = acc_o.index_select(2, rows), acc_lse.index_select(2, rows)
    merge_into(part_o, part_lse, o, lse)
    acc_o.index_copy_(2, rows, part_o)
    acc_lse.index_copy_(2, rows, part_lse)


def merge_into(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a partial result (o [..., D] fp32, lse [..., 1] fp32, over a disjoint key set) into the running one,
    in place: lse = logaddexp, each O weighted by exp(its lse - the new lse). Rows that have seen no key keep
    -inf and O = 0."""
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isneginf(new), torch.zeros((), device=new.device), new)
    acc_o.mul_(torch.exp(acc_lse - safe)).add_(o * torch.exp(lse - safe))
    acc_lse.copy_(new)


def add_sink(acc_o: torch.Tensor, acc_lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Fold the sink logits (fp32 [Hq]: a key with no value in every row's softmax) into a merged result
    (acc_o [B,Hq,S,D], acc_lse [B,Hq,S,1] fp32), in place. Rows that saw no key are padding (self-attention: a
    valid query sees itself): they keep lse -inf and O = 0, as the single call leaves them."""
    logits = torch.where(torch.isneginf(acc_lse), acc_lse, sink.view(1, -1, 1, 1).expand_as(acc_lse))
    merge_into(acc_o, acc_lse, torch.zeros((), device=acc_o.device), logits)


def fold_back(x: torch.Tensor, kernel_dtype: torch.dtype, input_dtype: torch.dtype) -> torch.Tensor:
    """An unrounded float32 result rounded once to the kernels' output dtype, then given the inputs' dtype (as
    `mxfp8_attention` hands back O and gradients)."""
    x = x.to(kernel_dtype)
    return x if x.dtype == input_dtype else x.to(input_dtype)
