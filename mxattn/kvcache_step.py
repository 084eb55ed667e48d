"""`PagedStep`: one triton-backend call over an `mxattn.MXFP8KVCache`, worked out once and run on every layer's
cache in the same state (a model's decode step). The launches it replays: `mxattn.runtime.paged_step`."""

from __future__ import annotations

from typing import List, Optional

import torch

from .kvcache import MXFP8KVCache, _device_ints, _unit_stride
from .sinks import sink_logits


def check_queries(cache: MXFP8KVCache, slots: List[int], cu: List[int], lengths: List[int]) -> None:
    """ValueError unless each sequence holds at least as many tokens as it has queries (cu: host offsets)."""
    for slot, a, b, n in zip(slots, cu, cu[1:], lengths):
        if n < b - a:
            raise ValueError(f"sequence in slot {slot} holds {n} tokens, fewer than its {b - a} queries")


class PagedStep:
    """One triton-backend call of `mxfp8_attention_with_kvcache`, worked out once from checked arguments and the
    cache's state: the pages its new tokens take, the lengths, the append's launch shape and the split count.
    `run` carries it out on that cache, or on any other cache in the same state (`MXFP8KVCache.state`: the same
    geometry, sequences, pages and lengths) with arguments of the same shapes, dtypes and device: every layer of
    a model updates its cache alike in a decode step, so one step serves them all
    (`mxattn.integrations.hf_cache.MXFP8PagedCache`)."""

    def __init__(self, q: torch.Tensor, cache: MXFP8KVCache, slots: List[int], cu: List[int],
                 cu_seqlens_q: torch.Tensor, k_new, v_new, scale: float, left_bound: Optional[int],
                 softmax_type: str, num_splits: int, kernel_dtype: torch.dtype, out_dtype: torch.dtype):
        from .kernels.triton_paged_attention import split_count
        from .runtime.paged_step import step_key, step_options
        n = len(slots)
        self.before = cache.state
        self.table, self.entries, self.commit = [], None, None
        if k_new is not None:
            slots, cu, starts, counts, self.table = cache._plan_pages(slots, k_new, v_new, cu)
            lengths = [st + c for st, c in zip(starts, counts)]  # (>= each sequence's queries: its new tokens)
            self.append_shape = cache._append_shape(starts, counts)
            self.meta = cache._step_meta(cu, slots, starts)
            self.cu_dev, self.slot_dev = self.meta[:n + 1], self.meta[n + 1:2 * n + 1]
            self.commit = (slots, starts, counts)
            self.own_offsets = True     # (cu, slots, meta: made here, see `step_key`)
        else:
            lengths = [cache._lens[s] for s in slots]
            check_queries(cache, slots, cu, lengths)
            self.append_shape = self.meta = None
            self.cu_dev = cu_seqlens_q if cu_seqlens_q.device == q.device else _device_ints(tuple(cu), q.device)
            self.slot_dev = cache.slot_tensor(slots)
            self.own_offsets = False  # (cu_seqlens_q may be the caller's tensor: each call's key reads it)
        self.n = n
        self.max_q = max(b - a for a, b in zip(cu, cu[1:])) if slots else 0
        self.max_kv = max(lengths, default=0)
        self.splits = split_count(q, cache.kv_heads, n, self.max_q, num_splits, self.max_kv) \
            if q.shape[0] and n and self.max_q else 1
        self.scale, self.left_bound, self.softmax_type = scale, left_bound, softmax_type
        self.kernel_dtype, self.out_dtype = kernel_dtype, out_dtype
        self.fixed_key = step_key(step_options(cache, n, self.max_q, self.append_shape, scale, left_bound, self.splits,
                                               self.max_kv, kernel_dtype), self.cu_dev, self.slot_dev, self.meta) \
            if self.own_offsets else None
        self.q_facts = (q.shape, q.dtype, q.device)
        self.kv_facts = None if k_new is None else (k_new.shape, k_new.dtype, v_new.shape, v_new.dtype)

    def run(self, cache: MXFP8KVCache, q: torch.Tensor, k_new: Optional[torch.Tensor] = None,
            v_new: Optional[torch.Tensor] = None, softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step on `cache` (in the state the step was worked out from): q [T, Hq, D], k_new/v_new [T, Hkv, D]
        (given as they were then) and softmax_offset (fp32 [Hq], with softmax_type "learnable") of this cache's
        layer -> O [T, Hq, D] in out_dtype. Raises, before anything is written, when the cache's state or an
        argument's shape, dtype or device is not the step's."""
        if (q.shape, q.dtype, q.device) != self.q_facts:
            raise ValueError(f"PagedStep.run: q must be {self.q_facts}, got {(q.shape, q.dtype, q.device)}")
        if (k_new is None) != (self.kv_facts is None) or (v_new is None) != (self.kv_facts is None) or (
                k_new is not None and (k_new.shape, k_new.dtype, v_new.shape, v_new.dtype) != self.kv_facts):
            raise ValueError(f"PagedStep.run: k_new and v_new must be as when the step was worked out "
                             f"({'None' if self.kv_facts is None else self.kv_facts})")
        sink = sink_logits(self.softmax_type, softmax_offset, q.shape[1], q.device)
        return self._run(cache, q, k_new, v_new, sink)

    def _run(self, cache: MXFP8KVCache, q: torch.Tensor, k_new: Optional[torch.Tensor],
             v_new: Optional[torch.Tensor], sink: Optional[torch.Tensor]) -> torch.Tensor:
        """`run` on checked arguments (sink: fp32 [Hq] or None): the append's and the attention's launches as one
        replayed step (`mxattn.runtime.paged_step`)."""
        from .runtime.paged_step import paged_step
        if cache._state != self.before:
            raise RuntimeError("PagedStep.run: the cache is not in the state this step was worked out from")
        if self.table:
            self.entries = cache._map_pages(self.table, self.entries)
        if k_new is not None:
            k_new, v_new = _unit_stride(k_new), _unit_stride(v_new)
        q = _unit_stride(q)
        o = paged_step(cache, q, k_new, v_new, self.cu_dev, self.slot_dev, self.meta, self.n, self.max_q,
                       self.append_shape, softmax_scale=self.scale, left_bound=self.left_bound,
                       sink=None if sink is None else sink.contiguous(), num_splits=self.splits,
                       max_seqlen_kv=self.max_kv, out_dtype=self.kernel_dtype, fixed_key=self.fixed_key)
        if self.commit is not None:
            cache._commit(*self.commit)
        return o if o.dtype == self.out_dtype else o.to(self.out_dtype)


__all__ = ["PagedStep", "check_queries"]
