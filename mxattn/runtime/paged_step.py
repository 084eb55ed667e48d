"""One call of `mxattn.mxfp8_attention_with_kvcache` on the triton backend, replayed per signature.

A call's device work is a few launches: the append of the new tokens (`triton_paged_append`: one or two) and
the attention passes (`triton_paged_attention`: one, or three with split KV). Their host path (Triton's argument
handling at each launch, the tile, grid and split choices, the stride lists, the allocations) depends only on the
call's signature, so it is recorded once (`launch_plan.record`) and replayed at later calls with the new tensors'
addresses: a decode loop makes the same call at every step and in every layer, each with another cache of the
same geometry.

The signature: the cache's geometry (`MXFP8KVCache.storage_key`: its tensors' shapes, strides, dtypes and
alignment, fixed for its life), q's, k_new's and v_new's shapes, strides and dtypes,
how many sequences, the longest query run, the append's launch shape (`append_shape`), the split count (resolved
from the longest cached sequence before the key is made), with splits the bucket of the longest cached sequence
(`score_columns`: the logits workspace's size and row stride), the scale, window, sink and output dtype. What the
kernels read from memory (lengths, page tables, the offsets in `meta`) is never baked in: those are roots.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .launch_plan import plan_key
from .plan_cache import PlanCache
from ..kernels.triton_paged_append import paged_append
from ..kernels.triton_paged_attention import paged_attention_fwd, score_columns

#: recorded steps; a family (one layer geometry and options) must replay 16 times per recording to keep
#: recording new sizes (chunked prefill of ever new lengths stops recording by itself)
STEPS = PlanCache(max_entries=256, min_replays=16)


def paged_step(cache, q: torch.Tensor, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
               cu: torch.Tensor, slots: torch.Tensor, meta: Optional[torch.Tensor], n_seq: int,
               max_seqlen_q: int, append_shape: Optional[Tuple[int, bool]], *, softmax_scale: float,
               left_bound: Optional[int], sink: Optional[torch.Tensor], num_splits: int, max_seqlen_kv: int,
               out_dtype: torch.dtype, fixed_key: Optional[tuple] = None) -> torch.Tensor:
    """Append (when k_new is given) then attend, as launches: q [T, Hq, D] (unit stride along D); k_new, v_new
    [T, Hkv, D] in the cache's dtype (unit stride along D) or None; cu int32 [n_seq + 1] and slots int32
    [n_seq] on the device (views of meta when the append made it); meta: the append's int32 metadata
    (`MXFP8KVCache._step_meta`) or None; append_shape: (blocks, deferred tails) of `paged_append`, or None;
    num_splits: resolved (>= 1); max_seqlen_kv: the longest sequence after the append. Returns O [T, Hq, D]
    in out_dtype (bf16 or fp16). The caller has checked everything and mapped the pages. fixed_key: `step_key`
    of the call's options and of (cu, slots, meta) when the caller made all three (separate allocations: no other
    root lies in their storage), so that the key of each call reads only q, k_new, v_new and sink (a step runs
    once per layer)."""
    call_roots = (q, k_new, v_new, cu, slots, meta, sink)
    if fixed_key is None:
        key = plan_key(step_options(cache, n_seq, max_seqlen_q, append_shape, softmax_scale, left_bound, num_splits,
                                    max_seqlen_kv, out_dtype), call_roots)
    else:
        key = plan_key(fixed_key, (q, k_new, v_new, sink))
    roots = call_roots + cache.storage

    def body():
        if append_shape is not None:
            paged_append(cache, k_new, v_new, meta, n_seq, *append_shape)
        o = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        paged_attention_fwd(q, cu, max_seqlen_q, slots, cache, softmax_scale=softmax_scale, left_bound=left_bound,
                            out=o, sink=sink, num_splits=num_splits, max_seqlen_kv=max_seqlen_kv)
        return [o]

    return STEPS.run(key, body, roots)[0]


def step_options(cache, n_seq: int, max_seqlen_q: int, append_shape, softmax_scale: float,
                 left_bound: Optional[int], num_splits: int, max_seqlen_kv: int, out_dtype: torch.dtype) -> tuple:
    """What `paged_step`'s key holds besides its roots (the module docstring's signature)."""
    return ("paged step", n_seq, max_seqlen_q, append_shape, float(softmax_scale), left_bound, num_splits,
            score_columns(max_seqlen_kv) if num_splits > 1 else 0, out_dtype, cache.storage_key)


def step_key(options: tuple, cu: torch.Tensor, slots: torch.Tensor, meta: torch.Tensor) -> tuple:
    """`paged_step`'s fixed_key: its options (`step_options`) and what the key needs of the step's offsets (cu and
    slots: views of meta), made once per step."""
    return options + (plan_key((), (cu, slots, meta)),)


__all__ = ["paged_step", "step_key", "step_options", "STEPS"]
