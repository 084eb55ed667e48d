"""`DotProductAttention`: an nn.Module with Transformer Engine's arguments, running MXFP8 attention."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .attention import mxfp8_attention
from .layouts import check_format
from .mask import mask_from_te


class DotProductAttention(nn.Module):
    """MXFP8 scaled-dot-product attention with no parameters.

    forward(query, key, value): tensors in `qkv_format` ("bshd", "sbhd", "bhsd") with `num_attention_heads`
    query heads, `num_gqa_groups` key/value heads and head size `kv_channels`. Returns [b, s, h*d] for bshd,
    [s, b, h*d] for sbhd (Transformer Engine's convention) and [b, h, s, d] for bhsd.
    """

    def __init__(self, num_attention_heads: int, kv_channels: int, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "bshd", attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, softmax_scale: Optional[float] = None,
                 backend: str = "auto"):
        super().__init__()
        if attention_dropout != 0.0:
            raise NotImplementedError(f"attention_dropout={attention_dropout}: mxattn has no dropout in the "
                                      "fused MXFP8 kernels; use 0.0")
        if not isinstance(num_attention_heads, int) or num_attention_heads < 1:
            raise ValueError(f"num_attention_heads must be a positive int, got {num_attention_heads!r}")
        if not isinstance(kv_channels, int) or kv_channels < 1:
            raise ValueError(f"kv_channels must be a positive int, got {kv_channels!r}")
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if not isinstance(num_gqa_groups, int) or num_gqa_groups < 1 or num_attention_heads % num_gqa_groups:
            raise ValueError(f"num_gqa_groups must divide num_attention_heads ({num_attention_heads}), "
                             f"got {num_gqa_groups!r}")
        check_format(qkv_format)
        mask_from_te(attn_mask_type, window_size)  # validates both now, not at the first call
        self.num_attention_heads = num_attention_heads
        self.kv_channels = kv_channels
        self.num_gqa_groups = num_gqa_groups
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = None if window_size is None else tuple(window_size)
        self.softmax_scale = softmax_scale
        self.backend = backend

    def _check_heads(self, name: str, x: torch.Tensor, heads: int) -> None:
        if isinstance(x, torch.Tensor) and x.dim() == 4:
            h, d = (x.shape[1], x.shape[3]) if self.qkv_format == "bhsd" else (x.shape[2], x.shape[3])
            if h != heads or d != self.kv_channels:
                raise ValueError(f"{name} has {h} heads of size {d}; this module expects {heads} heads of "
                                 f"size kv_channels={self.kv_channels} (qkv_format={self.qkv_format!r})")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        self._check_heads("query", query, self.num_attention_heads)
        self._check_heads("key", key, self.num_gqa_groups)
        self._check_heads("value", value, self.num_gqa_groups)
        out = mxfp8_attention(query, key, value, qkv_format=self.qkv_format, attn_mask_type=self.attn_mask_type,
                              window_size=self.window_size, softmax_scale=self.softmax_scale,
                              backend=self.backend)
        if self.qkv_format == "bhsd":
            return out
        return out.reshape(*out.shape[:2], -1)

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
                f"num_gqa_groups={self.num_gqa_groups}, qkv_format={self.qkv_format!r}, "
                f"attn_mask_type={self.attn_mask_type!r}, window_size={self.window_size}, "
                f"backend={self.backend!r}")
