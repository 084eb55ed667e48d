"""A transformers KV cache that stores keys and values in MXFP8 (about 0.53x of a bf16 cache's bytes).

>>> from mxattn.integrations.hf_cache import MXFP8Cache
>>> out = model.generate(**batch, past_key_values=MXFP8Cache(), max_new_tokens=64)

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

from ..formats import MXFP8Tensor, cat_bytes, quantize_mxfp8
from ..kvcache import seal_value_blocks

try:
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as exc:  # pragma: no cover - transformers is an optional dependency
    raise ImportError("mxattn.integrations.hf_cache needs transformers >= 5.0: pip install -e '.[hf]'") from exc


def _cat(a, b, dim):
    """b after a (None: nothing yet) along dim, for 1-byte MXFP8 data and scales."""
    return b if a is None else cat_bytes([a, b], dim=dim)


class MXFP8CacheLayer(DynamicLayer):
    """One layer's MXFP8 storage ([batch, kv_heads, seq, head_dim] tensors, as transformers hands them)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
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

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("MXFP8Cache does not reorder, crop or repeat its layers (beam search, assisted "
                                  "decoding); use transformers' DynamicCache there")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = offload = prefetch = _unsupported

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None


class MXFP8Cache(Cache):
    """A transformers `Cache` whose layers store K and V in MXFP8 (`MXFP8CacheLayer`); pass it as
    `past_key_values` to `generate` or a forward call."""

    def __init__(self):
        super().__init__(layer_class_to_replicate=MXFP8CacheLayer)

    def nbytes(self) -> int:
        """Bytes held by all layers between steps."""
        return sum(layer.nbytes() for layer in self.layers)


__all__ = ["MXFP8Cache", "MXFP8CacheLayer"]
