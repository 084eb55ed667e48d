"""`DotProductAttention`: an nn.Module with Transformer Engine's arguments, running MXFP8 attention."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from .attention import mxfp8_attention
from .constants import SOFTMAX_TYPES
from .context_parallel.api import context_parallel_attention
from .context_parallel.checks import resolve_group
from .layouts import check_format
from .mask import resolve_mask, te_window
from .recipe import Recipe, resolve_recipe
from .seqinfo import cu_seqlens_from_padding_mask
from .tensor_cache import TensorValueCache


class DotProductAttention(nn.Module):
    """MXFP8 scaled-dot-product attention (no parameters, except the learnable sink logits).

    forward(query, key, value, ...): tensors in `qkv_format` ("bshd", "sbhd", "bhsd", "thd") with
    `num_attention_heads` query heads, `num_gqa_groups` key/value heads and head sizes `kv_channels`: an int for
    query, key and value, or as in Transformer Engine a (k_channels, v_channels) pair, query's and key's head size
    then value's (MLA: (192, 128); such calls run on the reference backend). Returns [b, s, h*d_v] for bshd,
    [s, b, h*d_v] for sbhd, [t, h*d_v] for thd (Transformer Engine's convention) and [b, h, s, d_v] for bhsd, in
    the inputs' dtype (d_v: value's head size). forward takes TE's per-call arguments: qkv_format,
    attn_mask_type, window_size, bottom_right_diagonal, cu_seqlens_q/kv, cu_seqlens_q/kv_padded (thd: the
    padded sequences' offsets; without context parallelism only where they equal cu_seqlens_q/kv, no padding
    between sequences), max_seqlen_q/kv, and attention_mask (bool, True = masked out, [b, 1, 1, s_kv] or
    [b, s_kv], right padding; turned into cu_seqlens).
    window_size and bottom_right_diagonal mean what they mean in TE's module and `mxfp8_attention`: the
    window is checked against attn_mask_type here (TE's warnings and errors) and kept as TE runs it; a
    forward's own window_size / bottom_right_diagonal replace the module's, a forward's attn_mask_type is
    checked with the window it uses.
    recipe: None (the default recipe) or an `mxattn.Recipe` variant used by every call (checked here).
    After `set_context_parallel_group`, forward takes this rank's shards of the sequence and runs
    `mxattn.context_parallel_attention` with cu_seqlens_q/kv and cu_seqlens_q/kv_padded as it takes them (the
    whole sequences' lengths); max_seqlen_q/kv are then not needed and ignored, attention_mask and return_lse
    are refused.
    """

    #: the group once `set_context_parallel_group` set one of more than one rank (a `ContextParallelGroup`, which
    #: a deep copy of the module shares), else None
    _context_parallel = None

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "bshd", attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, softmax_scale: Optional[float] = None,
                 backend: str = "auto", softmax_type: str = "vanilla", recipe: Optional[Recipe] = None,
                 bottom_right_diagonal: Optional[bool] = None):
        super().__init__()
        if attention_dropout != 0.0:
            raise NotImplementedError(f"attention_dropout={attention_dropout}: mxattn has no dropout in the "
                                      "fused MXFP8 kernels; use 0.0")
        if not isinstance(num_attention_heads, int) or num_attention_heads < 1:
            raise ValueError(f"num_attention_heads must be a positive int, got {num_attention_heads!r}")
        self.k_channels, self.v_channels = _channels(kv_channels)
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if not isinstance(num_gqa_groups, int) or num_gqa_groups < 1 or num_attention_heads % num_gqa_groups:
            raise ValueError(f"num_gqa_groups must divide num_attention_heads ({num_attention_heads}), "
                             f"got {num_gqa_groups!r}")
        check_format(qkv_format)
        resolve_mask(attn_mask_type, window_size, bottom_right_diagonal)  # checked now, not at the first call
        self.num_attention_heads = num_attention_heads
        self.kv_channels = kv_channels if isinstance(kv_channels, int) else (self.k_channels, self.v_channels)
        self.num_gqa_groups = num_gqa_groups
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        # the window TE keeps (its check's result); None stays None, so a forward with another mask type
        # gets that type's default window rather than a warning about this one's
        self.window_size = None if window_size is None else te_window(attn_mask_type, window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.recipe = recipe
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
        self.softmax_type = softmax_type
        # TE's learnable sink: one logit per query head, zeros at init (the only parameter, so state_dict
        # gains exactly `softmax_offset`)
        self.softmax_offset = (nn.Parameter(torch.zeros(num_attention_heads, dtype=torch.float32))
                               if softmax_type == "learnable" else None)

    def _check_heads(self, name: str, x: torch.Tensor, heads: int, size: int, qkv_format: str) -> None:
        """ValueError unless x (query, key or value) has `heads` heads of `size` (its kv_channels entry)."""
        if isinstance(x, torch.Tensor) and x.dim() == (3 if qkv_format == "thd" else 4):
            h, d = (x.shape[1], x.shape[3]) if qkv_format == "bhsd" else (x.shape[-2], x.shape[-1])
            if h != heads or d != size:
                raise ValueError(f"{name} has {h} heads of size {d}; this module expects {heads} heads of size {size} "
                                 f"(kv_channels={self.kv_channels}, qkv_format={qkv_format!r})")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None, qkv_format: Optional[str] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                bottom_right_diagonal: Optional[bool] = None, return_lse: bool = False):
        """The attention output (the class docstring's shapes), or with return_lse=True (output, lse): lse the
        float32 log-sum-exp of the softmax per query row and head, [b, h, s_q] ([h, t_q] for thd), differentiable
        (`mxfp8_attention`'s return_lse)."""
        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        check_format(qkv_format)
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        window_size = self.window_size if window_size is None else window_size
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        self._check_heads("query", query, self.num_attention_heads, self.k_channels, qkv_format)
        self._check_heads("key", key, self.num_gqa_groups, self.k_channels, qkv_format)
        self._check_heads("value", value, self.num_gqa_groups, self.v_channels, qkv_format)
        lengths = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                       cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded)
        if self._context_parallel is not None:
            refused = dict(attention_mask=attention_mask, return_lse=return_lse or None)
            return self._context_parallel_forward(query, key, value, qkv_format, attn_mask_type, window_size, lengths,
                                                  refused)
        _check_no_padding_between(cu_seqlens_q, cu_seqlens_q_padded, "q")
        _check_no_padding_between(cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv, cu_seqlens_kv_padded, "kv")
        if attention_mask is not None:
            if cu_seqlens_q is not None or cu_seqlens_kv is not None:
                raise ValueError("pass either attention_mask or cu_seqlens_q/cu_seqlens_kv, not both")
            if qkv_format == "thd":
                raise ValueError("attention_mask does not apply to qkv_format='thd' (use cu_seqlens_q/kv)")
            cu_seqlens_q, cu_seqlens_kv = self._lengths_from_mask(attention_mask, query, key, qkv_format)
        out = mxfp8_attention(query, key, value, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                              window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                              softmax_scale=self.softmax_scale, backend=self.backend,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                              max_seqlen_kv=max_seqlen_kv, softmax_type=self.softmax_type,
                              softmax_offset=None if self.softmax_offset is None else self.softmax_offset.float(),
                              recipe=self._call_recipe, return_lse=return_lse)
        out, lse = out if return_lse else (out, None)
        if qkv_format != "bhsd":
            out = out.reshape(*out.shape[:-2], -1)
        return (out, lse) if return_lse else out

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream=None, cp_comm_type: str = "p2p"
                                   ) -> None:
        """Run forward context-parallel over cp_group (Transformer Engine's method): forward then takes this rank's
        shards of query, key, value in TE's load-balanced layout (`mxattn.context_parallel.shard_sequence`) and
        returns this rank's output shard (`mxattn.context_parallel_attention`'s arguments and limits). cp_group
        None or of one rank: the ordinary path."""
        self._context_parallel = resolve_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def _context_parallel_forward(self, query, key, value, qkv_format, attn_mask_type, window_size, lengths,
                                  refused):
        given = [name for name, value_ in refused.items() if value_ is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: not available under context parallelism (give the whole "
                             "sequences' lengths as cu_seqlens_q/kv, and cu_seqlens_q/kv_padded for thd)")
        if not self.recipe.is_default:
            raise ValueError(f"recipe={self.recipe}: context parallelism runs the default recipe")
        cp = self._context_parallel
        out = context_parallel_attention(
            query, key, value, cp_group=cp.group, cp_global_ranks=cp.global_ranks, cp_comm_type=cp.comm_type,
            cp_stream=cp.stream, qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            softmax_scale=self.softmax_scale, softmax_type=self.softmax_type,
            softmax_offset=None if self.softmax_offset is None else self.softmax_offset.float(), backend=self.backend,
            **lengths)
        return out if qkv_format == "bhsd" else out.reshape(*out.shape[:-2], -1)

    @staticmethod
    def _lengths_from_mask(attention_mask, query, key, qkv_format):
        """TE's padding mask (True = masked out): [b, 1, 1, s] / [b, s] for self-attention, or a pair
        (q mask, kv mask) -> (cu_seqlens_q, cu_seqlens_kv)."""
        seq_axis = {"bshd": 1, "sbhd": 0, "bhsd": 2}[qkv_format]
        masks = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask, attention_mask)
        if len(masks) != 2:
            raise ValueError("attention_mask must be a tensor or a (q mask, kv mask) pair")
        cus = []
        for m, x, name in zip(masks, (query, key), ("q", "kv")):
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                raise TypeError(f"attention_mask ({name}) must be a bool tensor (True = masked out)")
            m2 = m.reshape(m.shape[0], m.shape[-1]) if m.dim() == 4 and m.shape[1] == m.shape[2] == 1 else m
            if m2.dim() != 2 or m2.shape[1] != x.shape[seq_axis]:
                raise ValueError(f"attention_mask ({name}) must be [b, 1, 1, s] or [b, s] with s = "
                                 f"{x.shape[seq_axis]}, got {tuple(m.shape)}")
            cus.append(cu_seqlens_from_padding_mask(~m2, f"attention_mask ({name})"))
        return cus[0], cus[1]

    @property
    def recipe(self) -> Recipe:
        """The `mxattn.Recipe` every call uses (assignable: None or a Recipe, checked)."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Optional[Recipe]) -> None:
        self._recipe = resolve_recipe(recipe)
        # what each call passes: None for the default, so a compiled forward touches no Recipe object
        self._call_recipe = None if self._recipe.is_default else self._recipe

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
                f"num_gqa_groups={self.num_gqa_groups}, qkv_format={self.qkv_format!r}, "
                f"attn_mask_type={self.attn_mask_type!r}, window_size={self.window_size}, "
                + ("" if self.bottom_right_diagonal is None else
                   f"bottom_right_diagonal={self.bottom_right_diagonal}, ")
                + f"backend={self.backend!r}, softmax_type={self.softmax_type!r}"
                + ("" if self.recipe.is_default else f", recipe={self.recipe}"))


def _channels(kv_channels) -> Tuple[int, int]:
    """(k_channels, v_channels) of TE's kv_channels: an int for both, or a pair of positive ints."""
    pair = tuple(kv_channels) if isinstance(kv_channels, (tuple, list)) else (kv_channels, kv_channels)
    if len(pair) != 2 or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in pair):
        raise ValueError(f"kv_channels must be a positive int or a (k_channels, v_channels) pair of positive ints, "
                         f"got {kv_channels!r}")
    return pair


def _check_no_padding_between(cu: Optional[torch.Tensor], padded: Optional[torch.Tensor], side: str) -> None:
    """Without context parallelism the sequences of a packed batch lie back to back: cu_seqlens_{side}_padded,
    when given, must equal cu_seqlens_{side} (ValueError otherwise)."""
    if padded is None or padded is cu or torch.compiler.is_compiling():  # (compiled: unread, as seqinfo's lengths)
        return
    # (the values read once per pair of tensors: every layer of a model passes the same ones)
    if not _SAME_LENGTHS.get((cu, padded), None, lambda: _equal_lengths(cu, padded)):
        raise ValueError(f"cu_seqlens_{side}_padded must equal cu_seqlens_{side} (no padding between sequences) "
                         f"outside context parallelism, where mxattn packs sequences back to back")


#: whether a (cu_seqlens, cu_seqlens_padded) pair holds equal values, by the tensors (`TensorValueCache`)
_SAME_LENGTHS = TensorValueCache()


def _equal_lengths(cu: Optional[torch.Tensor], padded: torch.Tensor) -> bool:
    return cu is not None and padded.shape == cu.shape and torch.equal(padded.to(cu.device), cu)
