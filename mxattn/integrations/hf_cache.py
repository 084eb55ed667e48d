"""transformers KV caches that store keys and values in MXFP8 (about 0.53x of a bf16 cache's bytes).

>>> from mxattn.integrations.hf_cache import MXFP8Cache, MXFP8PagedCache, cache_kwargs
>>> out = model.generate(**batch, **cache_kwargs(MXFP8Cache()), max_new_tokens=64)
>>> out = model.generate(**batch, **cache_kwargs(MXFP8PagedCache(max_cache_len=4096)), max_new_tokens=64)

(`cache_kwargs(c)` is ``{"past_key_values": c}``, or ``{"cache": c}`` on the transformers versions that renamed
the argument and warn that `past_key_values` is deprecated.)

`MXFP8PagedCache` (attn_implementation registered by `mxattn.integrations.transformers.register`, eager
generation): each layer is an `mxattn.MXFP8KVCache` with one sequence slot per batch row, holding only each row's
real tokens (left padding is not stored), and mxattn's attention function reads its pages directly through
`mxattn.mxfp8_attention_with_kvcache` (the Triton paged kernel on CUDA, the reference elsewhere): no bf16 copy of
the cache is made at any step. The step's new keys and values reach the pages inside the attention call, where
the mask says which tokens are real; a layer whose keys were not read that way (another attention function)
raises at its next update rather than attend the new tokens alone. Attention equals `mxfp8_attention` over each
sequence's real tokens (V's blocks of 32 from its first real token), so generation equals a bf16
`DynamicCache` under the same attention function bit for bit on the reference backend. Masks read: causal with
left padding (what `generate` builds), optionally a sliding window; anything else raises `UnsupportedMaskError`.

`MXFP8Cache` works under any attention function:
Each layer keeps K row-wise (blocks of 32 along the head dim; a token's bytes never change) and V column-wise in
blocks of 32 tokens from position 0, the open block in the model's dtype until it fills, as `mxattn.MXFP8KVCache`
does. `update` returns the exact dequantizations (plus the open block), so any attention implementation reads it.
With mxattn's MXFP8 attention the cache changes nothing: quantizing a dequantized MXFP8 block again gives the
same values, so attention over this cache equals attention over a bf16 `DynamicCache` bit for bit (bf16 and fp32
models; unpadded batches, or right padding, where blocks start at each sequence's first token as in the attention
call). With left padding the V blocks of a batch row start at its first, padded, position, so a sequence's V
shares scales with padding rows there (a valid MXFP8 cache, but not the same bytes as the sequence alone).
The dequantized K/V are made per layer at each step (transient); what stays between steps is the MXFP8 storage.
Beam search reordering, cropping and offloading are not supported (they raise).
"""

from __future__ import annotations

import torch

import functools
from typing import Optional

from ..constants import MX_BLOCK, ceil_div
from ..devices import host_to_device
from ..formats import MXFP8Tensor, cat_bytes, quantize_mxfp8
from ..kvcache import MXFP8KVCache, seal_value_blocks
from ..kvcache_call import mxfp8_attention_with_kvcache
from ..tensor_cache import TensorValueCache
from .hf_masks import UnsupportedMaskError

try:
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as exc:  # pragma: no cover - transformers is an optional dependency
    raise ImportError("mxattn.integrations.hf_cache needs transformers >= 5.0: pip install -e '.[hf]'") from exc


def cache_kwargs(cache) -> dict:
    """The keyword argument that hands a KV cache to `generate` or a model's forward, as the installed transformers
    names it: ``{"cache": cache}`` where `generate` takes `cache` (the versions that deprecated `past_key_values`),
    else ``{"past_key_values": cache}``."""
    return {_cache_keyword(): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword() -> str:
    """"cache" or "past_key_values": the name transformers' generation gives the KV cache (read from its
    `prepare_inputs_for_generation`, the function every model's generation step passes the cache to)."""
    import inspect
    from transformers.generation.utils import GenerationMixin
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cat(a, b, dim):
    """b after a (None: nothing yet) along dim, for 1-byte MXFP8 data and scales."""
    return b if a is None else cat_bytes([a, b], dim=dim)


class _AppendOnlyLayer(DynamicLayer):
    """A cache layer that only grows: beam search's reordering, cropping, repeating and offloading raise."""

    cache_name = "this cache"

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(f"{self.cache_name} does not reorder, crop or repeat its layers (beam search, "
                                  "assisted decoding); use transformers' DynamicCache there")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = offload = prefetch = _unsupported

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None


class MXFP8CacheLayer(_AppendOnlyLayer):
    """One layer's MXFP8 storage ([batch, kv_heads, seq, head_dim] tensors, as transformers hands them)."""

    cache_name = "MXFP8Cache"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # the model's dtype, set here (transformers' DynamicLayer stopped setting it in 5.24)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.k_data = self.k_scale = self.v_data = self.v_scale = None
        self.v_open = value_states[..., :0, :]
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; return (keys, values) of every cached token, dequantized, in the model's dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = quantize_mxfp8(key_states, axis=-1)
        self.k_data, self.k_scale = _cat(self.k_data, k.data, -2), _cat(self.k_scale, k.scale, -2)
        v, rest = seal_value_blocks(self.v_open, value_states)
        if v is not None:
            self.v_data, self.v_scale = _cat(self.v_data, v.data, -2), _cat(self.v_scale, v.scale, -2)
        self.v_open = rest.clone()
        self.length += key_states.shape[-2]
        keys = MXFP8Tensor.unchecked(self.k_data, self.k_scale, self.k_data.dim() - 1).dequantize(self.dtype)
        if self.v_data is None:
            return keys, self.v_open
        sealed = MXFP8Tensor.unchecked(self.v_data, self.v_scale, self.v_data.dim() - 2).dequantize(self.dtype)
        return keys, torch.cat([sealed, self.v_open], dim=-2)

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def nbytes(self) -> int:
        """Bytes held between steps (MXFP8 data, scales and the open V block)."""
        return sum(t.numel() * t.element_size() for t in (self.k_data, self.k_scale, self.v_data, self.v_scale,
                                                          self.v_open) if t is not None)


class MXFP8Cache(Cache):
    """A transformers `Cache` whose layers store K and V in MXFP8 (`MXFP8CacheLayer`); pass it to `generate` or a
    forward call as `past_key_values` (or `cache`, where transformers renamed it: `cache_kwargs`)."""

    def __init__(self):
        super().__init__(layer_class_to_replicate=MXFP8CacheLayer)

    def nbytes(self) -> int:
        """Bytes held by all layers between steps."""
        return sum(layer.nbytes() for layer in self.layers)


_EAGER_ONLY = ("MXFP8PagedCache runs eagerly: its pages are updated in place with host-side bookkeeping, so under "
               "torch.compile its update and attention leave the graph (a graph break per layer); with "
               "fullgraph=True use transformers' StaticCache, or compile without fullgraph")


def _eager_only(fn):
    """`fn` run outside torch.compile's graphs, with _EAGER_ONLY as the reason Dynamo prints under fullgraph. In
    eager code it is called directly (Dynamo's disabled-function wrapper costs several microseconds per call, and a
    decode step makes two such calls per layer); under compilation, through that wrapper (a graph break)."""
    try:
        disabled = torch.compiler.disable(fn, reason=_EAGER_ONLY)
    except TypeError:                       # torch before `reason=`
        disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)
    return run


class MXFP8PagedLayer(_AppendOnlyLayer):
    """One layer's paged MXFP8 storage: an `MXFP8KVCache` of page_size-token pages, one slot per batch row, room
    for max_cache_len tokens per row. `update` keeps the step's new keys and values for mxattn's attention
    function, which appends each row's real tokens and attends (`attend`)."""

    cache_name = "MXFP8PagedCache"

    def __init__(self, page_size: int, max_cache_len: int, steps: Optional[dict] = None):
        super().__init__()
        self.page_size, self.max_cache_len = page_size, max_cache_len
        #: the current step's work shared by the model's layers (`attend`): {call signature: (mask, new tokens,
        #: PagedStep)}, one dict per `MXFP8PagedCache`
        self.steps = {} if steps is None else steps

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        pages = ceil_div(self.max_cache_len, self.page_size)
        self.store = MXFP8KVCache(b * pages, self.page_size, h, d, max_sequences=b, dtype=key_states.dtype,
                                  device=key_states.device, head_dim_v=value_states.shape[-1])
        self.slots = [self.store.new_sequence() for _ in range(b)]
        self.positions = 0      # positions transformers counts (left padding included)
        self.pending = None     # the step's new (keys, values), until `attend` stores them
        self.first_real = None  # each row's first real position (after its left padding), from the first step
        self.is_initialized = True

    @_eager_only
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Keep the new tokens (keys [B, Hkv, S, D], values [B, Hkv, S, Dv]) for `attend`; return them, marked as
        this layer's."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise RuntimeError(
                "MXFP8PagedCache: the previous step's keys and values of this layer were never stored, because "
                "the attention function did not get them: it was not mxattn's (the paged cache is read by it "
                "alone; register it with mxattn.integrations.transformers.register() and load the model with that "
                "attn_implementation), or the model caches something else than the keys and values it attends "
                "(MLA models such as DeepSeek-V3 cache compressed latents: use transformers' DynamicCache there)")
        if self.positions + key_states.shape[-2] > self.max_cache_len:
            raise ValueError(f"MXFP8PagedCache holds max_cache_len={self.max_cache_len} positions per row; this "
                             f"step would reach {self.positions + key_states.shape[-2]}")
        self.pending = (key_states, value_states)
        self.positions += key_states.shape[-2]
        key_states._mxattn_paged_layer = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.positions if self.is_initialized else 0

    def nbytes(self) -> int:
        """Bytes of the layer's pages, scales and open V blocks."""
        return self.store.nbytes() if self.is_initialized else 0

    @_eager_only
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], *, scaling: Optional[float], sliding_window: Optional[int],
               softmax_kwargs: dict, backend: str) -> torch.Tensor:
        """Store the step's real tokens and attend: query [B, Hq, Sq, D], key/value the tensors `update`
        returned, attention_mask None or bool [B, 1, Sq, positions] -> O [B, Sq, Hq, Dv] (zeros on padding
        rows)."""
        if self.pending is None or key is not self.pending[0]:
            raise RuntimeError("MXFP8PagedCache: these keys are not the ones this layer's update returned")
        b, hq, sq, _ = query.shape
        sink_offset = softmax_kwargs.get("softmax_offset")

        def real(x, rows):  # [B, H, Sq, D] -> the real tokens [T, H, D] (a view for a decode step without padding)
            x = x.select(2, 0) if sq == 1 else x.transpose(1, 2).reshape(b * sq, x.shape[1], x.shape[3])
            return x if rows is None else x.index_select(0, rows)

        # every layer of a step makes this call on a cache in the same state: the first works out the step
        # (checks, new tokens, pages, launch shape), the others run it (`mxattn.PagedStep`)
        signature = (self.positions, id(attention_mask), sliding_window, scaling, backend, sink_offset is None,
                     query.shape, query.dtype, query.device, key.shape, key.dtype)
        shared = self.steps.get(signature)
        if shared is not None and shared[0] is attention_mask and shared[2].before == self.store.state:
            _, new, step = shared
            self.pending, self.first_real = None, new.first
            q, k, v = real(query, new.rows), real(key, new.rows), real(value, new.rows)
            # (the signature fixes q's, k's and v's shapes, dtypes and device: only a sink needs run's checks)
            o = step._run(self.store, q, k, v, None) if sink_offset is None else step.run(self.store, q, k, v,
                                                                                         sink_offset)
        else:
            new, o, step = self._attend_first(query, key, value, attention_mask, real, scaling, sliding_window,
                                              softmax_kwargs, backend)
            if step is not None:
                if self.steps and next(iter(self.steps))[0] != self.positions:
                    self.steps.clear()   # (an earlier step's)
                self.steps[signature] = (attention_mask, new, step)
        rows, dv = new.rows, o.shape[-1]
        if rows is not None:
            o = o.new_zeros((b * sq, hq, dv)).index_copy(0, rows, o)
        return o.view(b, sq, hq, dv)

    def _attend_first(self, query, key, value, attention_mask, real, scaling, sliding_window, softmax_kwargs,
                      backend):
        """`attend` worked out from the mask and the cache -> (the step's new tokens, O [T, Hq, Dv], the
        `PagedStep` the other layers can run, or None)."""
        b, hq, sq, d = query.shape
        new = _new_tokens_per_row(attention_mask, b, sq, self.positions, sliding_window, query.device,
                                  self.first_real)
        lengths = [self.store._lens[slot] for slot in self.slots]     # (slots checked when taken)
        for row, (n, real_len) in enumerate(zip(new.counts, new.lengths)):
            if lengths[row] + n != real_len:
                raise UnsupportedMaskError(
                    f"row {row}: the mask gives it {real_len} real positions, the cache holds {lengths[row]} and "
                    f"this step adds {n}: MXFP8PagedCache reads left padding only (padding before each row's first "
                    "token, as generate builds it)")
        self.pending, self.first_real = None, new.first
        window = None if not sliding_window else (int(sliding_window) - 1, 0)
        o, step = mxfp8_attention_with_kvcache(
            real(query, new.rows), self.store, self.slots, cu_seqlens_q=new.cu_seqlens,
            k_new=real(key, new.rows), v_new=real(value, new.rows), softmax_scale=scaling, window_size=window,
            backend=backend, return_step=True, **softmax_kwargs)
        return new, o, step



class _NewTokens:
    """Which of a step's tokens are real, per row: first (each row's first real position), counts (real new
    tokens), lengths (real positions after the step), rows (int64 indices into the step's [B * Sq] tokens, row by
    row, on the device; None when every token is real) and cu_seqlens (int32 [B + 1] on the CPU); host ints where not said."""

    def __init__(self, first, positions: int, sq: int, device):
        self.first = tuple(first)
        self.counts = [min(sq, max(0, positions - f)) for f in first]
        self.lengths = [max(0, positions - f) for f in first]
        self.rows = None if all(n == sq for n in self.counts) else host_to_device(
            [r * sq + j for r, n in enumerate(self.counts) for j in range(sq - n, sq)], torch.int64, device)
        cu = [0]
        for n in self.counts:
            cu.append(cu[-1] + n)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32)  # on the CPU: read without a device sync


#: the step's token facts by mask (every layer of a step hands over the same mask)
_STEPS = TensorValueCache()


def _new_tokens_per_row(mask: Optional[torch.Tensor], b: int, sq: int, positions: int,
                        sliding_window: Optional[int], device: torch.device, first: Optional[tuple]) -> _NewTokens:
    """The real tokens of a step of Sq new positions ending at `positions` (first: each row's first real position
    when an earlier step found it), read off transformers' boolean mask (None: every token real), after checking
    that the mask is causal with left padding (and the sliding window)."""
    if mask is None:
        first = first if first is not None else (0,) * b
        return _STEPS.get((), (b, sq, positions, first, device), lambda: _NewTokens(first, positions, sq, device))
    return _STEPS.get((mask,), (b, sq, positions, sliding_window, first),
                      functools.partial(_read_mask, mask, b, sq, positions, sliding_window, first))


def _read_mask(mask: torch.Tensor, b: int, sq: int, positions: int, sliding_window: Optional[int],
               first: Optional[tuple]) -> _NewTokens:
    if mask.dtype != torch.bool or tuple(mask.shape) not in ((b, 1, sq, positions), (b, sq, positions)):
        raise UnsupportedMaskError(f"MXFP8PagedCache reads boolean masks [B, 1, Sq, kv] = {(b, 1, sq, positions)} "
                                   f"(transformers' SDPA masks), got {mask.dtype} {tuple(mask.shape)}")
    m = mask.reshape(b, sq, positions)
    if first is None:  # the first step (prefill): each row's first key that any of its queries sees
        seen = m.any(1)
        start = torch.where(seen.any(-1), seen.int().argmax(-1), torch.full_like(seen[:, 0], positions,
                                                                                   dtype=torch.long))
    else:
        start = torch.tensor(first, dtype=torch.long, device=m.device)
    kpos = torch.arange(positions, device=m.device).view(1, 1, -1)
    qpos = (positions - sq + torch.arange(sq, device=m.device)).view(1, sq, 1)
    expected = (kpos <= qpos) & (kpos >= start.view(b, 1, 1)) & (qpos >= start.view(b, 1, 1))
    if sliding_window:
        expected &= qpos - kpos < int(sliding_window)
    if not torch.equal(m, expected):
        raise UnsupportedMaskError("MXFP8PagedCache reads causal masks with left padding (and a sliding window), "
                                   "as generate builds them; this mask is another")
    return _NewTokens(start.tolist() if first is None else first, positions, sq, mask.device)


class MXFP8PagedCache(Cache):
    """A transformers `Cache` of paged MXFP8 layers (`MXFP8PagedLayer`) read directly by mxattn's attention
    function; pass it to `generate` (eager; as `past_key_values` or `cache`: `cache_kwargs`) of a model whose
    attn_implementation is registered by `mxattn.integrations.transformers.register`. max_cache_len: positions per
    batch row (prompt, its left padding and the new tokens); page_size: tokens per page, a multiple of 32."""

    def __init__(self, max_cache_len: int, page_size: int = 256):
        for name, value in (("max_cache_len", max_cache_len), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if page_size % MX_BLOCK:
            raise ValueError(f"page_size must be a multiple of {MX_BLOCK}, got {page_size}")
        super().__init__(layer_class_to_replicate=functools.partial(MXFP8PagedLayer, page_size, max_cache_len, {}))

    def nbytes(self) -> int:
        """Bytes held by all layers (pages allocated for max_cache_len positions per row)."""
        return sum(layer.nbytes() for layer in self.layers)

    def bf16_nbytes(self) -> int:
        """Bytes bf16 K and V pages of the same capacity would take."""
        return sum(layer.store.bf16_nbytes() for layer in self.layers if layer.is_initialized)


__all__ = ["MXFP8Cache", "MXFP8CacheLayer", "MXFP8PagedCache", "MXFP8PagedLayer", "cache_kwargs"]
