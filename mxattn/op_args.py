"""The custom ops' arguments by name: the one place their order is written, and the codec between them and the
library's vocabulary (`MaskSpec`, `SeqInfo`, the sink, the encoded `Recipe`, `AttentionParams`, `Problem`).

A torch custom op takes flat arguments of a few types, so a call's mask crosses the op boundary as its band
(bottom_right, left_bound, right_bound), its lengths as a `SeqInfo`'s five fields and its recipe as the string
`Recipe.encode` gives. `FwdArgs.encode` flattens once on the way in; `mask()`, `seq()`, `params()` and `problem()`
rebuild on the way out, and the ops read fields by name (`args.sink`), never by position.
"""

from __future__ import annotations

import dataclasses
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
    """The backend's AttentionParams of the call: the mask, lengths and recipe decoded, every field that
    AttentionParams and the op's arguments both name (`_PARAM_FIELDS`) as it is."""
    return AttentionParams(mask=_mask(args), seq=_seq(args), sink_requires_grad=sink_requires_grad,
                           needs_backward=needs_backward, recipe=Recipe.decode(args.recipe),
                           saved_layout=saved_layout, **{name: getattr(args, name) for name in _PARAM_FIELDS})


def _seq_fields(seq: Optional[SeqInfo]) -> dict:
    """The five length fields of seq by name; a dense call's placeholders."""
    if seq is None:
        return dict(cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=0, max_seqlen_kv=0, packed=False)
    return dict(cu_seqlens_q=seq.cu_seqlens_q, cu_seqlens_kv=seq.cu_seqlens_kv, max_seqlen_q=seq.max_seqlen_q,
                max_seqlen_kv=seq.max_seqlen_kv, packed=seq.packed)


#: the fields both ops take, in this order, after their own leading ones: the forward's options (qkv_format:
#: the layout the op returns its tensors in), lengths and sink. Each op class below spells its fields as the
#: `__annotations__` dict that `NamedTuple` reads (fields in insertion order; a class attribute named like a
#: field is its default), so this run is written once and both classes stay plain NamedTuples.
_OPTIONS = {"softmax_scale": float, "bottom_right": bool, "left_bound": Optional[int],
            "right_bound": Optional[int], "out_dtype": torch.dtype, "qkv_format": str, "backend": str,
            "cu_seqlens_q": Optional[Tensor], "cu_seqlens_kv": Optional[Tensor], "max_seqlen_q": int,
            "max_seqlen_kv": int, "packed": bool, "sink": Optional[Tensor]}


class FwdArgs(NamedTuple):
    """`mxattn::attention_fwd`'s arguments, in order. q [B,Hq,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv] views (a
    packed batch [1,H,T,*]); qkv_format: the layout O [B,Hq,Sq,Dv] is written in; sink None or fp32 [Hq]."""

    __annotations__ = {"q": Tensor, "k": Tensor, "v": Tensor, **_OPTIONS, "recipe": str}
    recipe = DEFAULT_RECIPE_KEY

    mask = _mask
    seq = _seq
    params = _params

    @classmethod
    def encode(cls, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor], *, mask: MaskSpec,
               seq: Optional[SeqInfo], **options) -> "FwdArgs":
        """The op's arguments of a call given in the library's vocabulary: the mask, the lengths and every other
        field by its name (q, k, v may be None in a template filled per call with `with_tensors`)."""
        options["softmax_scale"] = float(options["softmax_scale"])
        return cls(q=q, k=k, v=v, bottom_right=mask.diagonal_alignment == "bottom_right",
                   left_bound=mask.left_bound, right_bound=mask.right_bound, **_seq_fields(seq), **options)

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
                       head_dim_v=self.v.shape[3],
                       mask=self.mask(), varlen=None if seq is None else ("packed" if packed else "padded"),
                       needs_backward=needs_backward, softmax_type=softmax_type, quantized=quantized,
                       **{name: getattr(self, name) for name in _PROBLEM_FIELDS})

    def backward_args(self, do: Tensor, o: Tensor, stats: Tensor, saved: List[Tensor], kv_shape: List[int],
                      sink_requires_grad: bool, cu_seqlens: Optional[tuple] = None,
                      sink: Optional[Tensor] = None) -> "BwdArgs":
        """The backward op's arguments for this forward call's options and its lengths and sink: this call's
        own, or, given cu_seqlens (cu_seqlens_q, cu_seqlens_kv) and sink, those (options kept without their
        tensors, `without_tensors`)."""
        options = self._options()
        if cu_seqlens is not None:
            options["cu_seqlens_q"], options["cu_seqlens_kv"] = cu_seqlens
        if sink is not None:
            options["sink"] = sink
        return BwdArgs(do=do, o=o, stats=stats, saved=saved, kv_shape=kv_shape, sink_requires_grad=sink_requires_grad,
                       **options)

    def packed_backward_args(self, do: Tensor, o: Tensor, block: Tensor, kv_shape: List[int],
                             input_dtype: torch.dtype, sink_requires_grad: bool, cu_seqlens: tuple,
                             sink: Optional[Tensor]) -> "PackedBwdArgs":
        """The packed backward op's arguments for this forward call's options (kept without their tensors), K's
        shape, the inputs' dtype, its lengths (cu_seqlens_q, cu_seqlens_kv) and sink."""
        options = self._options()
        options["cu_seqlens_q"], options["cu_seqlens_kv"] = cu_seqlens
        options["sink"] = sink
        return PackedBwdArgs(do=do, o=o, block=block, kv_shape=kv_shape, input_dtype=input_dtype,
                             sink_requires_grad=sink_requires_grad, **options)

    def _options(self) -> dict:
        """The shared fields (`_OPTIONS`) and the recipe, by name: what the backward ops take after their own."""
        return {name: getattr(self, name) for name in OPTION_FIELDS}

class PackedBwdArgs(NamedTuple):
    """`mxattn::attention_bwd_packed`'s arguments, in order: dO, O [B,Hq,Sq,Dv], the forward's block (stats and
    the saved tensors, `mxattn.runtime.saved_block`), K's shape, the inputs' dtype, then `BwdArgs`' fields after
    K's shape."""

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
    """`mxattn::attention_bwd`'s arguments, in order: dO, O [B,Hq,Sq,Dv], stats [B,Hq,Sq,1], the backend's saved
    tensors, K's shape, then the forward's options (qkv_format: the layout dQ, dK, dV are returned in), lengths and
    sink, and whether the sink needs a gradient."""

    __annotations__ = {"do": Tensor, "o": Tensor, "stats": Tensor, "saved": List[Tensor], "kv_shape": List[int],
                       **_OPTIONS, "sink_requires_grad": bool, "recipe": str}
    recipe = DEFAULT_RECIPE_KEY

    mask = _mask
    seq = _seq
    params = _params


#: the fields every op takes after its own leading ones, the recipe last (what `FwdArgs._options` hands on)
OPTION_FIELDS = (*_OPTIONS, "recipe")

#: the non-tensor options the op bodies read, for plan keys (lengths and tensors are keyed apart: `op_plans`)
PLAN_OPTION_FIELDS = tuple(name for name in OPTION_FIELDS if _OPTIONS.get(name, str) not in (
    Tensor, Optional[Tensor]) and not name.startswith("max_seqlen"))

_SCHEMA_TYPES = {Tensor: "Tensor", Optional[Tensor]: "Tensor?", List[Tensor]: "Tensor[]", float: "float",
                 bool: "bool", int: "SymInt", Optional[int]: "SymInt?", List[int]: "SymInt[]",
                 torch.dtype: "ScalarType", str: "str"}


def schema(args_class) -> str:
    """The torch.library schema of an op's arguments, from its NamedTuple's fields, types and defaults."""
    defaults = args_class._field_defaults
    parts = []
    for name, kind in args_class.__annotations__.items():
        default = f'="{defaults[name]}"' if name in defaults else ""
        parts.append(f"{_SCHEMA_TYPES[kind]} {name}{default}")
    return ", ".join(parts)


#: the fields AttentionParams and Problem take from the op's arguments as they are (a new option in `_OPTIONS`
#: named like a field of either reaches the backends with no other edit)
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionParams)
                      if f.name in OPTION_FIELDS and f.name not in ("recipe", "sink_requires_grad"))
_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(Problem) if f.name in OPTION_FIELDS)

#: where the sink sits among the forward op's arguments (its gradient's slot)
SINK_INDEX = _SINK = FwdArgs._fields.index("sink")
_CU_Q, _CU_KV = FwdArgs._fields.index("cu_seqlens_q"), FwdArgs._fields.index("cu_seqlens_kv")

__all__ = ["FwdArgs", "BwdArgs", "PackedBwdArgs", "OPTION_FIELDS", "PLAN_OPTION_FIELDS", "SINK_INDEX", "schema"]
