"""The custom ops' arguments by name: the one place their order is written, and the codec between them and the
library's vocabulary (`MaskSpec`, `SeqInfo`, the sink, the encoded `Recipe`, `AttentionParams`, `Problem`).

A torch custom op takes flat arguments of a few types, so a call's mask crosses the op boundary as its band
(bottom_right, left_bound, right_bound), its lengths as a `SeqInfo`'s five fields and its recipe as the string
`Recipe.encode` gives. `FwdArgs.encode` flattens once on the way in; `mask()`, `seq()`, `params()` and `problem()`
rebuild on the way out, and the ops read fields by name (`args.sink`), never by position.
"""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor

from .backends.base import AttentionParams, Problem
from .mask import MaskSpec
from .recipe import DEFAULT_RECIPE_KEY, Recipe
from .seqinfo import SeqInfo


def _mask(args) -> MaskSpec:
    """The band mask the fields bottom_right, left_bound, right_bound encode (one shared MaskSpec per band:
    the ops decode it on every call; traced code builds it: Dynamo warns about lru_cache wrappers)."""
    band = _band.__wrapped__ if torch.compiler.is_compiling() else _band
    return band(args.bottom_right, args.left_bound, args.right_bound)


@functools.lru_cache(maxsize=256)
def _band(bottom_right: bool, left_bound: Optional[int], right_bound: Optional[int]) -> MaskSpec:
    return MaskSpec(diagonal_alignment="bottom_right" if bottom_right else "top_left", left_bound=left_bound,
                    right_bound=right_bound)


def _seq(args) -> Optional[SeqInfo]:
    """The SeqInfo the five length fields encode (None for a dense call)."""
    if args.cu_seqlens_q is None:
        return None
    return SeqInfo(args.cu_seqlens_q, args.cu_seqlens_kv, args.max_seqlen_q, args.max_seqlen_kv, args.packed)


def _params(args, needs_backward: bool = True, sink_requires_grad: bool = False,
            saved_layout: Optional[str] = None) -> AttentionParams:
    """The backend's AttentionParams of the call."""
    return AttentionParams(softmax_scale=args.softmax_scale, mask=_mask(args), out_dtype=args.out_dtype,
                           seq=_seq(args), sink=args.sink, sink_requires_grad=sink_requires_grad,
                           needs_backward=needs_backward, recipe=Recipe.decode(args.recipe),
                           saved_layout=saved_layout)


def _seq_fields(seq: Optional[SeqInfo]) -> tuple:
    """(cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed) of seq; a dense call's placeholders."""
    if seq is None:
        return None, None, 0, 0, False
    return seq.cu_seqlens_q, seq.cu_seqlens_kv, seq.max_seqlen_q, seq.max_seqlen_kv, seq.packed


#: the fields both ops take, in this order, after their own leading ones: the forward's options (qkv_format:
#: the layout the op returns its tensors in), lengths and sink. Each op class below spells its fields as the
#: `__annotations__` dict that `NamedTuple` reads (fields in insertion order; a class attribute named like a
#: field is its default), so this run is written once and both classes stay plain NamedTuples.
_OPTIONS = {"softmax_scale": float, "bottom_right": bool, "left_bound": Optional[int],
            "right_bound": Optional[int], "out_dtype": torch.dtype, "qkv_format": str, "backend": str,
            "cu_seqlens_q": Optional[Tensor], "cu_seqlens_kv": Optional[Tensor], "max_seqlen_q": int,
            "max_seqlen_kv": int, "packed": bool, "sink": Optional[Tensor]}


class FwdArgs(NamedTuple):
    """`mxattn::attention_fwd`'s arguments, in order. q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] views (a packed batch
    [1,H,T,D]); qkv_format: the layout O is written in; sink None or fp32 [Hq]."""

    __annotations__ = {"q": Optional[Tensor], "k": Optional[Tensor], "v": Optional[Tensor], **_OPTIONS,
                       "recipe": str}
    recipe = DEFAULT_RECIPE_KEY

    mask = _mask
    seq = _seq
    params = _params

    @classmethod
    def encode(cls, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor], *, softmax_scale: float,
               mask: MaskSpec, out_dtype: torch.dtype, qkv_format: str, backend: str, seq: Optional[SeqInfo],
               sink: Optional[Tensor], recipe: str = DEFAULT_RECIPE_KEY) -> "FwdArgs":
        """The op's arguments of a call given in the library's vocabulary (q, k, v may be None in a template
        filled per call with `with_tensors`)."""
        return cls(q, k, v, float(softmax_scale), mask.diagonal_alignment == "bottom_right", mask.left_bound,
                   mask.right_bound, out_dtype, qkv_format, backend, *_seq_fields(seq), sink, recipe)

    def with_tensors(self, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor]) -> "FwdArgs":
        """This template with a call's tensors (per call on the planned path: built without `_replace`)."""
        return tuple.__new__(FwdArgs, (q, k, v, *self[3:_SINK], sink, *self[_SINK + 1:]))

    def without_tensors(self) -> "FwdArgs":
        """The options alone (what an autograd context keeps beside its saved tensors)."""
        return tuple.__new__(FwdArgs, (None, None, None, *self[3:_CU_Q], None, None, *self[_CU_KV + 1:_SINK], None,
                                       *self[_SINK + 1:]))

    def problem(self, softmax_type: str, needs_backward: bool, quantized: bool = False) -> Problem:
        """The backend choice's Problem of this call (softmax_type: TE's name for what the sink is; quantized:
        q, k, v are the data of already-quantized inputs, `AttentionBackend.forward_quantized`)."""
        q, k, seq = self.q, self.k, self.seq()
        packed = seq is not None and seq.packed
        return Problem(device=q.device, dtype=q.dtype, batch=seq.batch if seq is not None else q.shape[0],
                       heads_q=q.shape[1], heads_kv=k.shape[1],
                       seqlen_q=seq.max_seqlen_q if packed else q.shape[2],
                       seqlen_kv=seq.max_seqlen_kv if packed else k.shape[2], head_dim=q.shape[3],
                       mask=self.mask(), varlen=None if seq is None else ("packed" if packed else "padded"),
                       needs_backward=needs_backward, out_dtype=self.out_dtype, softmax_type=softmax_type,
                       recipe=self.recipe, quantized=quantized)

    def backward_args(self, do: Tensor, o: Tensor, stats: Tensor, saved: List[Tensor], kv_shape: List[int],
                      sink_requires_grad: bool, cu_seqlens: Optional[tuple] = None,
                      sink: Optional[Tensor] = None) -> "BwdArgs":
        """The backward op's arguments for this forward call's options and its lengths and sink: this call's
        own, or, given cu_seqlens (cu_seqlens_q, cu_seqlens_kv) and sink, those (options kept without their
        tensors, `without_tensors`)."""
        cu_q, cu_kv = (self.cu_seqlens_q, self.cu_seqlens_kv) if cu_seqlens is None else cu_seqlens
        return BwdArgs(do, o, stats, saved, kv_shape, self.softmax_scale, self.bottom_right, self.left_bound,
                       self.right_bound, self.out_dtype, self.qkv_format, self.backend, cu_q, cu_kv,
                       self.max_seqlen_q, self.max_seqlen_kv, self.packed, self.sink if sink is None else sink,
                       sink_requires_grad, self.recipe)

    def packed_backward_args(self, do: Tensor, o: Tensor, block: Tensor, kv_shape: List[int],
                             input_dtype: torch.dtype, sink_requires_grad: bool, cu_seqlens: tuple,
                             sink: Optional[Tensor]) -> "PackedBwdArgs":
        """The packed backward op's arguments for this forward call's options (kept without their tensors), K's
        shape, the inputs' dtype, its lengths (cu_seqlens_q, cu_seqlens_kv) and sink."""
        return PackedBwdArgs(do, o, block, kv_shape, input_dtype, self.softmax_scale, self.bottom_right,
                             self.left_bound, self.right_bound, self.out_dtype, self.qkv_format, self.backend,
                             *cu_seqlens, self.max_seqlen_q, self.max_seqlen_kv, self.packed, sink,
                             sink_requires_grad, self.recipe)


class PackedBwdArgs(NamedTuple):
    """`mxattn::attention_bwd_packed`'s arguments, in order: dO, O [B,Hq,Sq,D], the forward's block (stats and the
    saved tensors, `mxattn.runtime.saved_block`), K's shape, the inputs' dtype, then `BwdArgs`' fields after K's shape."""

    __annotations__ = {"do": Tensor, "o": Tensor, "block": Tensor, "kv_shape": List[int], "input_dtype": torch.dtype,
                       **_OPTIONS, "sink_requires_grad": bool, "recipe": str}
    recipe = DEFAULT_RECIPE_KEY

    mask = _mask
    seq = _seq
    params = _params

    def unpacked(self, stats: Tensor, saved: List[Tensor]) -> "BwdArgs":
        """The `BwdArgs` of this call given the block's stats and saved tensors (`saved_block.unpack`)."""
        return BwdArgs(self.do, self.o, stats, saved, self.kv_shape, *self[5:])


class BwdArgs(NamedTuple):
    """`mxattn::attention_bwd`'s arguments, in order: dO, O [B,Hq,Sq,D], stats [B,Hq,Sq,1], the backend's saved
    tensors, K's shape, then the forward's options (qkv_format: the layout dQ, dK, dV are returned in), lengths and
    sink, and whether the sink needs a gradient."""

    __annotations__ = {"do": Tensor, "o": Tensor, "stats": Tensor, "saved": List[Tensor], "kv_shape": List[int],
                       **_OPTIONS, "sink_requires_grad": bool, "recipe": str}
    recipe = DEFAULT_RECIPE_KEY

    mask = _mask
    seq = _seq
    params = _params


#: where the sink sits among the forward op's arguments (its gradient's slot)
SINK_INDEX = _SINK = FwdArgs._fields.index("sink")
_CU_Q, _CU_KV = FwdArgs._fields.index("cu_seqlens_q"), FwdArgs._fields.index("cu_seqlens_kv")

__all__ = ["FwdArgs", "BwdArgs", "PackedBwdArgs", "SINK_INDEX"]
