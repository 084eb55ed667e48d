"""The decode/append attention call over an `mxattn.MXFP8KVCache` (serving): `mxfp8_attention_with_kvcache` and the
`PagedStep` one triton call works out, which the other layers of a model's decode step run.

Backends: `reference` (any device: `ref.mxfp8_ref` on the stored bytes), `triton` (CUDA: one kernel reads the
pages' FP8 bytes and scales, `mxattn.kernels.triton_paged_attention`) and `cudnn` (Blackwell: cuDNN's paged MXFP8
graph, `mxattn.backends.cudnn.paged`; MXFP8NotSupportedError with the reason elsewhere). The cache, its storage
and the semantics of its bytes: `mxattn.kvcache`. The Triton kernels the triton backend
launches: `mxattn.runtime.paged_step` (the append and attention launches of one call, replayed per signature).
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

from ref import mxfp8_ref

from .attention import _sink
from .constants import MAX_KV_SPLITS
from .errors import MXFP8NotSupportedError
from .formats import quantize_mxfp8
from .kvcache import _DTYPES, MXFP8KVCache, _device_ints, _unit_stride
from .mask import MaskSpec, resolve_mask


def _inference(fn):
    """fn run without autograd (grad mode switched off only where it is on: generation already runs without)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


@_inference
def mxfp8_attention_with_kvcache(q: torch.Tensor, cache: MXFP8KVCache, slots: Sequence[int], *,
                                 cu_seqlens_q: torch.Tensor, k_new: Optional[torch.Tensor] = None,
                                 v_new: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                                 window_size: Optional[Tuple[int, int]] = None, softmax_type: str = "vanilla",
                                 softmax_offset: Optional[torch.Tensor] = None,
                                 out_dtype: Optional[torch.dtype] = None, num_splits: int = 0,
                                 backend: str = "auto", return_step: bool = False):
    """Append, then attend: the newest queries of a batch of cached sequences (decode, chunked prefill,
    speculative tokens), no padding of the batch.

    q: [T, Hq, D] (thd), the new tokens' queries of every sequence in `slots` order; cu_seqlens_q: int32 [B+1]
    splitting T by sequence (B = len(slots)), on q's device or on the CPU (then read on the host without a
    device-to-host copy; it goes to the device from pinned memory, without waiting). k_new, v_new: None or
    [T, Hkv, D] (the cache's dtype and device), written to the sequences before attending (`append_batch`: all
    or nothing). Each sequence's queries attend its cached tokens
    with a causal mask aligned bottom-right (the last query sees every key), optionally a sliding window
    (TE's window_size=(left, 0)) and attention sinks (softmax_type / softmax_offset as in `mxfp8_attention`).
    Returns O [T, Hq, D] in out_dtype (default q's). Inference only (no autograd).
    backend: "triton" (CUDA, head dims up to 128: the kernel reads the pages' FP8 bytes and scales once per KV
    head, `mxattn.kernels.triton_paged_attention`), "reference" (any device: `ref.mxfp8_ref` on the stored
    bytes), "cudnn" (Blackwell with cuDNN >= 9.21: cuDNN's paged MXFP8 SDPA graph reads the pages,
    `mxattn.backends.cudnn.paged`; its forward recipe agrees with the others to the tolerance the dense cudnn
    backend keeps against `ref`, not bit for bit; elsewhere MXFP8NotSupportedError with the reason, before
    anything is written), or "auto" (triton where it runs, else reference with a one-time warning; auto does not
    pick cudnn).
    num_splits (triton): how many programs share one sequence's keys (flash-decoding). 1: one program per
    sequence and KV head, equal bit for bit to the triton backend's `mxfp8_attention` over the same tokens.
    n > 1: n splits; every P is still rounded against the sequential pass's running max (a first pass finds each
    split's max), so the result equals the one-split result to fp32 rounding (the splits' sums are added in
    another order), not bit for bit. 0 (default): 1 when the call already fills the GPU, else enough splits to
    fill it, each keeping 1k+ tokens (fast decode at small batches and long contexts). Other than 1, a decode
    step (at most 16 query rows per KV head) also takes a 16-row tile whose MMA sums in another order: the same
    fp32-rounding agreement (at most one bf16 ulp apart in the GPU tests). The reference backend is always
    sequential.
    return_step: also return the `PagedStep` the triton backend ran (None on the others): a model's other layers,
    whose caches are in the same state as this one, run it (`PagedStep.run`) instead of working the step out again
    -> (O, step)."""
    o, step = _attend(q, cache, slots, cu_seqlens_q, k_new, v_new, softmax_scale, window_size, softmax_type,
                      softmax_offset, out_dtype, num_splits, backend)
    return (o, step) if return_step else o


def _attend(q, cache, slots, cu_seqlens_q, k_new, v_new, softmax_scale, window_size, softmax_type, softmax_offset,
            out_dtype, num_splits, backend) -> Tuple[torch.Tensor, Optional["PagedStep"]]:
    """`mxfp8_attention_with_kvcache` -> (O, the `PagedStep` the triton backend ran, else None)."""
    if backend not in ("auto", "reference", "triton", "cudnn"):
        raise ValueError(f"backend must be one of ('auto', 'cudnn', 'triton', 'reference'), got {backend!r}")
    if not isinstance(cache, MXFP8KVCache):
        raise TypeError(f"cache must be an MXFP8KVCache, got {type(cache).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != cache.head_dim:
        raise ValueError(f"q must be [T, Hq, {cache.head_dim}], got {tuple(getattr(q, 'shape', ()))}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be bf16, fp16 or fp32, got {q.dtype}")
    hq = q.shape[1]
    if hq % cache.kv_heads:
        raise ValueError(f"query heads ({hq}) must be divisible by the cache's kv_heads ({cache.kv_heads})")
    slots = list(slots)
    if (not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dtype != torch.int32
            or cu_seqlens_q.shape != (len(slots) + 1,)):
        raise ValueError(f"cu_seqlens_q must be an int32 tensor of len(slots) + 1 = {len(slots) + 1} offsets")
    if cu_seqlens_q.device not in (q.device, torch.device("cpu")):
        raise ValueError(f"cu_seqlens_q must be on q's device ({q.device}) or the CPU, got {cu_seqlens_q.device}")
    cu = cu_seqlens_q.tolist()  # (a CPU tensor is read without waiting for the device)
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to T={q.shape[0]}, got {cu}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is not None and (k_new.dim() != 3 or k_new.shape[0] != q.shape[0]):
        raise ValueError(f"k_new must be [T={q.shape[0]}, {cache.kv_heads}, {cache.head_dim}], got "
                         f"{tuple(k_new.shape)}")
    if k_new is None:   # (else the append checks them)
        cache._check_slots(slots)
    band = resolve_mask("causal_bottom_right", window_size).band
    out_dtype = q.dtype if out_dtype is None else out_dtype
    sink = _sink(softmax_type, softmax_offset, hq, q.device)
    kernel_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    scale = cache.head_dim ** -0.5 if softmax_scale is None else softmax_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_KV_SPLITS}] (0: choose), got "
                         f"{num_splits!r}")
    name = _cache_backend(backend, q, cache)
    if name == "cudnn":   # cuDNN's verdict on the graph and the device, before anything is written
        cudnn_args = dict(attn_scale=scale, mask=MaskSpec(diagonal_alignment="bottom_right",
                                                          left_bound=band.left_bound, right_bound=0),
                          sink=sink is not None, out_dtype=kernel_dtype)
        _require_cudnn(q, cu, cache, slots, **cudnn_args)
    if name == "triton":
        step = PagedStep(q, cache, slots, cu, cu_seqlens_q, k_new, v_new, scale, band.left_bound, softmax_type,
                         num_splits, kernel_dtype, out_dtype)
        return step._run(cache, q, k_new, v_new, sink), step
    if k_new is not None:
        cache._append(slots, k_new, v_new, cu)
    _check_queries(cache, slots, cu, [cache._lens[s] for s in slots])
    if name == "cudnn":
        from .backends.cudnn.paged import cudnn_paged_forward
        o = cudnn_paged_forward(q, cu, cache, slots, **dict(cudnn_args, sink=sink))
        return (o if o.dtype == out_dtype else o.to(out_dtype)), None
    out = torch.zeros(q.shape, dtype=out_dtype, device=q.device)
    for slot, a, b in zip(slots, cu, cu[1:]):
        if b == a:
            continue
        q_row = quantize_mxfp8(q[a:b].transpose(0, 1).unsqueeze(0), axis=-1)
        k_row, v_col = cache.keys(slot), cache.values(slot)
        o, _ = mxfp8_ref.sdpa_fwd_quantized(q_row.data, q_row.scale, k_row.data, k_row.scale, v_col.data,
                                            v_col.scale, attn_scale=scale, diagonal_alignment="bottom_right",
                                            window=(band.left_bound, band.right_bound), out_dtype=kernel_dtype,
                                            sink=sink)
        out[a:b] = o[0].transpose(0, 1).to(out_dtype)
    return out, None


def _check_queries(cache: MXFP8KVCache, slots: List[int], cu: List[int], lengths: List[int]) -> None:
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
        from .runtime.paged_step import step_key, step_options
        from .kernels.triton_paged_attention import split_count
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
            _check_queries(cache, slots, cu, lengths)
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
        sink = _sink(self.softmax_type, softmax_offset, q.shape[1], q.device)
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


_WARNED = set()


def _require_cudnn(q: torch.Tensor, cu: List[int], cache: MXFP8KVCache, slots: List[int], **kw) -> None:
    """MXFP8NotSupportedError naming why cuDNN's paged MXFP8 graph cannot serve this call (before any write)."""
    try:
        from .backends.cudnn.paged import paged_config_of, require_paged_graph
    except ImportError as exc:
        raise MXFP8NotSupportedError(f"backend 'cudnn' needs the cuDNN frontend (pip install "
                                     f"nvidia-cudnn-frontend): {exc}") from None
    require_paged_graph(paged_config_of(q, cu, cache, slots, **kw), q.device)


def _cache_backend(backend: str, q: torch.Tensor, cache: MXFP8KVCache) -> str:
    """"triton" or "reference" for a cache call ("auto" takes triton where it runs; raises for "triton" where
    it cannot run, naming why)."""
    if cache.device != q.device:
        raise ValueError(f"q must be on the cache's device ({cache.device}), got {q.device}")
    if backend == "reference":
        return backend
    if backend == "cudnn":
        return backend
    from .backends.triton_backend import TritonBackend
    ok, why = TritonBackend.availability(q.device)
    if ok and cache.head_dim > 128:
        ok, why = False, f"the paged Triton kernel takes head dims up to 128, the cache has {cache.head_dim}"
    if ok:
        return "triton"
    if backend == "triton":
        raise MXFP8NotSupportedError(f"backend 'triton' cannot read the KV cache here: {why}")
    if (q.device.type, why) not in _WARNED:
        _WARNED.add((q.device.type, why))
        warnings.warn(f"mxattn: backend='auto' of mxfp8_attention_with_kvcache runs on 'reference' ({why})",
                      RuntimeWarning, stacklevel=3)
    return "reference"


__all__ = ["PagedStep", "mxfp8_attention_with_kvcache"]
