"""The decode/append attention call over an `mxattn.MXFP8KVCache` (serving): `mxfp8_attention_with_kvcache` and the
`PagedStep` one triton call works out, which the other layers of a model's decode step run.

The backend is chosen as for every call (`mxattn.backends.pick_cache_backend`): `cudnn` (Blackwell: cuDNN's paged
MXFP8 graph, where cuDNN accepts it), `triton` (CUDA: one kernel reads the pages' FP8 bytes and scales, run as a
`mxattn.PagedStep`), `reference` (any device: `ref.mxfp8_ref` on the stored bytes). The cache, its storage and the
semantics of its bytes: `mxattn.kvcache`.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import torch

from .backends import CacheCall, check_backend_name, get_backend, pick_cache_backend
from .checks import resolved_softmax_scale
from .constants import MAX_KV_SPLITS
from .kvcache import _DTYPES, MXFP8KVCache
from .kvcache_step import PagedStep
from .mask import resolve_mask
from .sinks import sink_logits


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
                                 backend: str = "auto", return_step: bool = False,
                                 bottom_right_diagonal: Optional[bool] = None):
    """Append, then attend: the newest queries of a batch of cached sequences (decode, chunked prefill,
    speculative tokens), no padding of the batch.

    q: [T, Hq, D] (thd), the new tokens' queries of every sequence in `slots` order; cu_seqlens_q: int32 [B+1]
    splitting T by sequence (B = len(slots)), on q's device or on the CPU (then read on the host without a
    device-to-host copy; it goes to the device from pinned memory, without waiting). k_new, v_new: None or
    [T, Hkv, D] and [T, Hkv, Dv] (the cache's head_dim and head_dim_v, dtype and device), written to the sequences
    before attending (`append_batch`: all or nothing). Each sequence's queries attend its cached tokens
    with a causal mask aligned bottom-right (the last query sees every key): Transformer Engine's
    ``padding_causal_bottom_right``, which TE's KV-cache path runs. window_size: TE's window for that mask type,
    (-1, 0) or (left >= 0, 0), with TE's checks (`mxfp8_attention`: (-1, -1) and (left, right != 0) warn and
    run with right 0; (-1, right > 0) raises). bottom_right_diagonal: None or True (TE's meaning: the diagonal
    is bottom-right); False, a top-left diagonal, is nothing a cache step can mean (the queries are the newest
    tokens) and raises ValueError. Attention sinks: softmax_type / softmax_offset as in `mxfp8_attention`.
    Returns O [T, Hq, Dv] in out_dtype (default q's). Inference only (no autograd). A cache whose V has another
    head dim than K (MLA) is served by the reference backend (the paged kernels refuse it, with the reason).
    backend: "triton" (CUDA, head dims up to 128: the kernel reads the pages' FP8 bytes and scales once per KV
    head, `mxattn.kernels.triton_paged_attention`), "reference" (any device: `ref.mxfp8_ref` on the stored
    bytes), "cudnn" (Blackwell with cuDNN >= 9.21: cuDNN's paged MXFP8 SDPA graph reads the pages,
    `mxattn.backends.cudnn.paged`; its forward recipe agrees with the others to the tolerance the dense cudnn
    backend keeps against `ref`, not bit for bit; elsewhere MXFP8NotSupportedError with the reason, before
    anything is written), or "auto" (the first of cudnn, triton, reference that serves the call, with a one-time
    warning when it is not cudnn, as for `mxfp8_attention`).
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
    if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
        raise TypeError(f"bottom_right_diagonal must be None, True or False, got {bottom_right_diagonal!r}")
    if bottom_right_diagonal is False:
        raise ValueError("bottom_right_diagonal=False aligns the diagonal top-left, which a KV-cache call cannot "
                         "mean: its queries are each sequence's newest tokens, so the diagonal ends at the last "
                         "key (bottom-right, TE's padding_causal_bottom_right); pass None or True")
    o, step = _attend(q, cache, slots, cu_seqlens_q, k_new, v_new, softmax_scale, window_size, softmax_type,
                      softmax_offset, out_dtype, num_splits, backend)
    return (o, step) if return_step else o


def _attend(q, cache, slots, cu_seqlens_q, k_new, v_new, softmax_scale, window_size, softmax_type, softmax_offset,
            out_dtype, num_splits, backend) -> Tuple[torch.Tensor, Optional["PagedStep"]]:
    """`mxfp8_attention_with_kvcache` -> (O, the `PagedStep` the triton backend ran, else None)."""
    check_backend_name(backend)
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
    band = resolve_mask("padding_causal_bottom_right", window_size).band
    out_dtype = q.dtype if out_dtype is None else out_dtype
    sink = sink_logits(softmax_type, softmax_offset, hq, q.device)
    kernel_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    scale = cache.head_dim ** -0.5 if softmax_scale is None else resolved_softmax_scale(softmax_scale, None)
    if out_dtype not in _DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_KV_SPLITS}] (0: choose), got "
                         f"{num_splits!r}")
    if cache.device != q.device:
        raise ValueError(f"q must be on the cache's device ({cache.device}), got {q.device}")
    call = CacheCall(q, cache, slots, cu, cu_seqlens_q, k_new, v_new, scale, band.left_bound, softmax_type, sink,
                     num_splits, kernel_dtype, out_dtype)
    name = pick_cache_backend(backend, call)   # (every refusal before anything is written)
    o, step = get_backend(name).attend_cache(call)
    return (o if o.dtype == out_dtype else o.to(out_dtype)), step


__all__ = ["PagedStep", "mxfp8_attention_with_kvcache"]
