"""The `torch.library` ops (forward, backward) and the autograd.Function that makes them differentiable.

`mxattn::attention_fwd` returns O, stats and, flat, what the backend keeps for backward (its `saved_format`: the
FP8 copies by default); `mxattn::attention_fwd_no_grad` returns O alone (nothing kept: the backend may skip
the column-wise copies); `mxattn::attention_bwd` turns the kept tensors and dO into dQ, dK, dV.
`mxattn::attention_fwd_packed` / `attention_bwd_packed` do the same with stats and the kept tensors in one uint8
block (`mxattn.runtime.saved_block`): compiled graphs use them (two outputs and saved tensors instead of a dozen, fewer
allocations and arguments per call) unless the backend says otherwise (`packs_compiled_saved`). The ops are
defined with `torch.library.Library` (schema, one kernel for every device, a fake kernel for tracing) and are
not differentiable themselves: `attention` wraps them in an autograd.Function, which eager mode runs without
the dispatcher (the kernels' bodies called directly) and `torch.compile` traces into its graphs, forward and
backward, calling the ops (fullgraph, no graph breaks). This costs a compiled model a few microseconds of
dispatch per call where `torch.library.custom_op`'s Python wrappers (autograd, defaults, alias checks) cost
tens.

Tensors are [B, H, S, D] views (a packed batch as [1, H, T, D]); the arguments are `mxattn.op_args.FwdArgs` /
`BwdArgs` (the mask as its band, the lengths as a `SeqInfo`'s fields, the numerics as the `Recipe.encode`
string, the default recipe when left out), which also decode them; nothing here reads an argument by position.
The concrete backend is chosen by the caller (`mxattn.attention`) and passed by name. What the fake kernels
promise (O, dQ, dK, dV dense in qkv_format order, the saved copies as `saved_format.fake_tensors` lays them
out) the real kernels deliver: a backend's tensor laid out otherwise is copied.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import op_plans
from .runtime import saved_block
from .backends import backend_class, get_backend
from .compile_marks import constant_result
from .layouts import dense_strides_bhsd, empty_bhsd, from_bhsd, to_bhsd
from .op_args import BwdArgs, FwdArgs, PackedBwdArgs, schema
from .recipe import Recipe
from .seqinfo import SeqInfo

#: the ops' schemas, written once: by the argument classes (`mxattn.op_args`)
_FWD_ARGUMENTS, _BWD_ARGUMENTS, _BWD_PACKED_ARGUMENTS = schema(FwdArgs), schema(BwdArgs), schema(PackedBwdArgs)

_LIB = torch.library.Library("mxattn", "DEF")
_LIB.define(f"attention_fwd({_FWD_ARGUMENTS}) -> Tensor[]")
_LIB.define(f"attention_fwd_no_grad({_FWD_ARGUMENTS}) -> Tensor")
_LIB.define(f"attention_bwd({_BWD_ARGUMENTS}) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define(f"attention_fwd_packed({_FWD_ARGUMENTS}) -> Tensor[]")
_LIB.define(f"attention_bwd_packed({_BWD_PACKED_ARGUMENTS}) -> (Tensor, Tensor, Tensor, Tensor)")


def _saved_format(backend: str, recipe: str) -> type:
    """The saved format of backend `backend` for the encoded recipe."""
    return get_backend(backend).saved_format_for(Recipe.decode(recipe))


# --------------------------------------------------------------------------- promised layouts


def _conform(t: Tensor, shape, stride) -> Tensor:
    """t laid out as (shape, stride) promise: t itself, a free re-striding when only the strides of size-1
    axes differ, else a copy."""
    if t.stride() == stride:
        return t
    if all(a == b or n == 1 for a, b, n in zip(t.stride(), stride, shape)):
        return t.as_strided(shape, stride)
    return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _as_faked(saved, saved_format, q: Tensor, k: Tensor, v: Tensor, seq: Optional[SeqInfo]) -> List[Tensor]:
    """The saved tensors in the layouts the fake kernel promises (`saved_format.fake_tensors`, which follows
    `torch.empty_like` of q, k, v): a compiled graph asserts them. Backends may lay their copies out otherwise
    for input views that are not dense (k, v from `unbind`); those few are copied, the rest pass through. The
    promised layouts are computed once per signature (on the meta device)."""
    key = (saved_format, *(x.shape for x in (q, k, v)), *(x.stride() for x in (q, k, v)), q.dtype,
           None if seq is None else (seq.packed, seq.cu_seqlens_q.shape, seq.cu_seqlens_kv.shape))
    expected = _FAKED_LAYOUTS.get(key)
    if expected is None:
        metas = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") for x in (q, k, v)]
        expected = tuple((e.shape, e.stride(), e.dtype) for e in saved_format.fake_tensors(*metas, seq))
        if len(_FAKED_LAYOUTS) >= 1024:
            _FAKED_LAYOUTS.clear()
        _FAKED_LAYOUTS[key] = expected
    out = []
    for t, (shape, stride, dtype) in zip(saved, expected):
        if t.shape != shape or t.dtype != dtype:
            raise RuntimeError(f"backend saved a tensor {tuple(t.shape)} {t.dtype} where its saved_format's "
                               f"fake_tensors promise {tuple(shape)} {dtype}")
        out.append(_conform(t, shape, stride))
    return out


#: the saved tensors' promised (shape, stride, dtype) by call signature (`_as_faked`)
_FAKED_LAYOUTS: dict = {}


def _grad_shapes(args) -> Tuple[tuple, tuple, tuple]:
    """The shapes of dQ [B,Hq,Sq,Dqk], dK (kv_shape, [B,Hkv,Skv,Dqk]) and dV [B,Hkv,Skv,Dv] from what a backward
    op has (`BwdArgs` or `PackedBwdArgs`): dO [B,Hq,Sq,Dv] and K's shape."""
    return saved_block.shapes(args.do.shape, args.kv_shape, args.do.shape[3])


def _grad_strides(args: BwdArgs) -> Tuple[tuple, tuple, tuple]:
    """The strides the backward op promises for dQ, dK and dV (`_grad_shapes`): dense in qkv_format order, like O
    (what the kernels write when Q, K, V and dO share that layout, as in a transformer; traced constants only: a
    compiled graph may hand dO over in other strides than it was traced with)."""
    return tuple(dense_strides_bhsd(tuple(shape), args.qkv_format) for shape in _grad_shapes(args))


# --------------------------------------------------------------------------- the ops' bodies and fakes


def _fwd_impl(args: FwdArgs, needs_backward: bool = True, eager: bool = False):
    """The forward op's body: [o, stats, *saved] (needs_backward=False: O alone, the backend skipping what only a
    backward pass needs). O is dense in qkv_format order, with exactly the strides the fake kernels promise;
    eager: O as the backend wrote it when that is q's layout (the triton kernels follow q's, e.g. bhsd views of
    a bshd tensor, as torch SDPA's output does: no copy, so the call stays replayable) or when only the strides of
    size-1 axes differ. Replayed per
    signature where the backend allows it (`op_plans`)."""
    out = op_plans.run_forward(args, (needs_backward, eager), lambda: _fwd_body(args, needs_backward, eager))
    return out if needs_backward else out[0]


def _fwd_body(args: FwdArgs, needs_backward: bool, eager: bool, saved_layout: Optional[str] = None) -> list:
    """`_fwd_impl`'s work, always as a flat list ([o] without a backward); saved_layout: the layout the backend is
    asked to keep its saved tensors in (`AttentionParams.saved_layout`)."""
    o, stats, saved = get_backend(args.backend).forward(
        args.q, args.k, args.v, args.params(needs_backward, saved_layout=saved_layout))
    dense = dense_strides_bhsd(tuple(o.shape), args.qkv_format)
    if o.stride() != dense and not (eager and _follows(o, args.q)):  # (eager: O in q's layout, as SDPA's)
        if all(a == b or n == 1 for a, b, n in zip(o.stride(), dense, o.shape)):
            if not eager:  # only size-1 axes differ (a packed batch's B, a decode step's S): a free view
                o = o.as_strided(o.shape, dense)
        else:  # backends that ignore q's layout
            o = empty_bhsd(tuple(o.shape), args.qkv_format, args.out_dtype, o.device).copy_(o)
    if not needs_backward:
        return [o]
    return [o, stats.contiguous(), *saved.tensors()]


def _follows(o: Tensor, q: Tensor) -> bool:
    """Whether O [B,H,S,D] is laid out as q is: dense, its axes in the order of q's strides (the triton kernels
    write O so for bhsd views of a bshd tensor, as torch SDPA returns them)."""
    order = sorted(range(4), key=lambda i: (-q.stride(i), i))
    if sorted(range(4), key=lambda i: (-o.stride(i), i)) != order:
        return False
    expected = 1
    for i in reversed(order):
        if o.shape[i] != 1 and o.stride(i) != expected:
            return False
        expected *= o.shape[i]
    return True


def _fwd_kernel(*inputs) -> List[Tensor]:
    """`mxattn::attention_fwd`: q [B,Hq,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv], sink None or fp32 [Hq] ->
    [o [B,Hq,Sq,Dv] dense in qkv_format order, stats [B,Hq,Sq,1] fp32, then the backend's saved tensors
    (`saved_format_for(recipe).tensors()`)]."""
    args = FwdArgs(*inputs)
    return op_plans.run_forward(args, "op", lambda: _fwd_op_body(args))


def _fwd_op_body(args: FwdArgs) -> List[Tensor]:
    o, stats, *saved = _fwd_impl(args)
    return [o, stats, *_as_faked(saved, _saved_format(args.backend, args.recipe), args.q, args.k, args.v,
                                 args.seq())]


def _fwd_fake(*inputs) -> List[Tensor]:
    args = FwdArgs(*inputs)
    return [_fwd_no_grad_fake(*inputs), args.q.new_empty((*args.q.shape[:3], 1), dtype=torch.float32),
            *_saved_format(args.backend, args.recipe).fake_tensors(args.q, args.k, args.v, args.seq())]


def _fwd_no_grad_kernel(*inputs) -> Tensor:
    """`mxattn::attention_fwd_no_grad`: O alone ([B,Hq,Sq,Dv] dense in qkv_format order)."""
    return _fwd_impl(FwdArgs(*inputs), needs_backward=False)


def _fwd_no_grad_fake(*inputs) -> Tensor:
    args = FwdArgs(*inputs)
    return empty_bhsd((*args.q.shape[:3], args.v.shape[3]), args.qkv_format, args.out_dtype, args.q.device)


def _bwd_impl(args: BwdArgs, promised: bool = True, after=None):
    """The backward op's body: (dq, dk, dv, dsink). promised: dq, dk, dv laid out as `_grad_strides` says (the
    op's promise); False leaves them in the layout the backend wrote, which the eager path hands to autograd.
    Replayed per signature where the backend allows it (`op_plans`; after: the eager forward's trace)."""
    return tuple(op_plans.run_backward(args, promised, lambda: _bwd_body(args, promised), after,
                                       carve=not promised))  # (unpromised: eager, not returned by an op)


def _bwd_body(args: BwdArgs, promised: bool):
    params = args.params(sink_requires_grad=args.sink_requires_grad)
    be = get_backend(args.backend)
    saved_format = be.saved_format_for(params.recipe)
    dq, dk, dv, *dsink = be.backward(saved_format.from_tensors(args.saved, params.seq), args.o, args.stats,
                                     args.do, params)
    if args.sink_requires_grad:
        dsink = dsink[0]
    else:  # (the op returns a tensor; the eager path reads none)
        dsink = args.stats.new_empty((0,), dtype=torch.float32) if promised else None
    if promised:
        q_strides, k_strides, v_strides = _grad_strides(args)
        dq = _conform(dq, dq.shape, q_strides)
        dk, dv = _conform(dk, dk.shape, k_strides), _conform(dv, dv.shape, v_strides)
    return dq, dk, dv, dsink


def _bwd_kernel(*inputs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """`mxattn::attention_bwd`: dO, O [B,Hq,Sq,Dv], stats [B,Hq,Sq,1], the backend's saved tensors (as the
    forward op returned them) and K's shape [B,Hkv,Skv,D] -> (dq, dk, dv) in out_dtype, dense in qkv_format
    order, and dsink (fp32 [Hq] when sink_requires_grad, else an empty tensor)."""
    return _bwd_impl(BwdArgs(*inputs))


def _bwd_fake(*inputs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _grads_fake(BwdArgs(*inputs))


def _grads_fake(args) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """What either backward op returns for args (`BwdArgs` or `PackedBwdArgs`): dQ, dK, dV shaped as q, k, v
    (`_grad_shapes`), dense in qkv_format order, and dsink ([Hq] fp32, or empty)."""
    do, fmt = args.do, args.qkv_format
    dq, dk, dv = (empty_bhsd(tuple(shape), fmt, args.out_dtype, do.device) for shape in _grad_shapes(args))
    dsink = do.new_empty((do.shape[1] if args.sink_requires_grad else 0,), dtype=torch.float32)
    return dq, dk, dv, dsink


def _fwd_packed_kernel(*inputs) -> List[Tensor]:
    """`mxattn::attention_fwd_packed`: as `attention_fwd`, but [o, block]: stats and the saved tensors in one
    uint8 block laid out as `saved_block.layout_for` says (q, k, v of one dtype)."""
    args = FwdArgs(*inputs)
    return op_plans.run_forward_packed(args, lambda: _fwd_body(args, True, False, saved_layout=args.qkv_format),
                                       lambda: _block_layout(args)[1])


def _block_layout(args: FwdArgs):
    """(id, layout) of the forward call args' block (`saved_block.layout_for`)."""
    return saved_block.layout_for(_saved_format(args.backend, args.recipe), args.q.shape, args.k.shape,
                                  args.v.shape, args.q.dtype, args.qkv_format, args.seq())


def _fwd_packed_fake(*inputs) -> List[Tensor]:
    args = FwdArgs(*inputs)
    layout = saved_block.fake_layout(_saved_format(args.backend, args.recipe), args.q, args.k, args.v,
                                     args.qkv_format, args.seq())
    return [_fwd_no_grad_fake(*inputs), args.q.new_empty((layout.nbytes,), dtype=torch.uint8)]


def _bwd_packed_kernel(*inputs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """`mxattn::attention_bwd_packed`: `attention_bwd` on the packed forward's block (`PackedBwdArgs`)."""
    args = PackedBwdArgs(*inputs)
    layout_id, layout = saved_block.layout_for(_saved_format(args.backend, args.recipe), *_grad_shapes(args),
                                               args.input_dtype, args.qkv_format, args.seq())
    return op_plans.run_backward_from_block(args, layout_id, layout, lambda unpacked: _bwd_body(unpacked, True))


def _bwd_packed_fake(*inputs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _grads_fake(PackedBwdArgs(*inputs))


for _name, _kernel, _fake in (("attention_fwd", _fwd_kernel, _fwd_fake),
                              ("attention_fwd_no_grad", _fwd_no_grad_kernel, _fwd_no_grad_fake),
                              ("attention_bwd", _bwd_kernel, _bwd_fake),
                              ("attention_fwd_packed", _fwd_packed_kernel, _fwd_packed_fake),
                              ("attention_bwd_packed", _bwd_packed_kernel, _bwd_packed_fake)):
    _LIB.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"mxattn::{_name}", _fake, lib=_LIB)

#: the ops (their default overloads)
attention_fwd = torch.ops.mxattn.attention_fwd.default
attention_fwd_no_grad = torch.ops.mxattn.attention_fwd_no_grad.default
attention_bwd = torch.ops.mxattn.attention_bwd.default
attention_fwd_packed = torch.ops.mxattn.attention_fwd_packed.default
attention_bwd_packed = torch.ops.mxattn.attention_bwd_packed.default


@constant_result
def packs_compiled_saved(backend: str) -> bool:
    """Whether compiled calls on `backend` (a concrete name) use the packed ops (`saved_block`): the backend's
    `packs_compiled_saved` (a constant of the trace)."""
    return bool(getattr(backend_class(backend), "packs_compiled_saved", True))


# --------------------------------------------------------------------------- autograd


#: where the tensors sit among the forward op's arguments
_TENSOR_SLOTS = tuple(FwdArgs._fields.index(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_kv", "sink"))


#: `_distinct_tensors`' answer for three distinct q, k, v without lengths or sink
_PLAIN = (0, 1, 2, None, None, None)


def _distinct_tensors(args: FwdArgs) -> Tuple[list, tuple]:
    """(the distinct tensors among args' tensor arguments, for each tensor slot the index of its tensor there
    or None): Dynamo traces no autograd.Function given one tensor twice (k is v, cu_seqlens_kv is
    cu_seqlens_q), so `_Attention` takes each tensor once."""
    q, k, v = args.q, args.k, args.v
    if args.cu_seqlens_q is None and args.sink is None and q is not k and q is not v and k is not v:
        return [q, k, v], _PLAIN  # the common call, without the general walk below
    distinct, where = [], []
    for slot in _TENSOR_SLOTS:
        t = args[slot]
        index = None
        if t is not None:
            index = next((j for j, u in enumerate(distinct) if u is t), None)
            if index is None:
                index = len(distinct)
                distinct.append(t)
        where.append(index)
    return distinct, tuple(where)


class _Attention(torch.autograd.Function):
    """O of the forward op, differentiable. Arguments: the op's options (`FwdArgs` without tensors), where each
    tensor argument is among the distinct tensors (`_distinct_tensors`), then those tensors. Eager: the ops'
    bodies called directly (no dispatcher), O alone returned (stats and the saved copies stay on ctx, so
    autograd wires one output instead of a dozen); under torch.compile Dynamo traces forward and backward,
    which call the ops."""

    @staticmethod
    def forward(ctx, options: FwdArgs, where: tuple, layout: Optional[str], *tensors):
        if where == _PLAIN:
            args = options.with_tensors(*tensors, None)
        else:
            values = list(options)
            for slot, index in zip(_TENSOR_SLOTS, where):
                values[slot] = None if index is None else tensors[index]
            args = FwdArgs(*values)
        if layout is not None:  # q, k, v (and O, dO, dQ, dK, dV) in a dense layout: viewed here, not as nodes
            args = args.with_tensors(to_bhsd(args.q, layout), to_bhsd(args.k, layout), to_bhsd(args.v, layout),
                                     args.sink)
        ctx.packed = False
        if torch.compiler.is_compiling():
            ctx.trace = None
            if args.q.dtype == args.k.dtype == args.v.dtype and packs_compiled_saved(args.backend):
                (o, stats), saved = attention_fwd_packed(*args), ()  # (stats: the block of stats and saved)
                ctx.packed = True
            else:
                o, stats, *saved = attention_fwd(*args)
        else:  # the trace lets the backward find its plan from the forward's (`op_plans.run_backward`); a
            # replay may keep stats and the saved copies packed in one block (then `stats`, `saved` empty): not
            # under saved-tensor hooks (checkpointing matches the tensors a recomputation saves to the first's)
            (o, stats, *saved), ctx.trace = op_plans.run_forward_traced(args, (True, True),
                                                                        lambda: _fwd_body(args, True, True),
                                                                        carve=True, packed=_no_saved_hooks())
        ctx.options, ctx.where, ctx.layout = options, where, layout
        ctx.input_dtypes = (args.q.dtype, args.k.dtype, args.v.dtype)
        ctx.kv_shape = list(args.k.shape)
        ctx.has_seq, ctx.has_sink = args.cu_seqlens_q is not None, args.sink is not None
        ctx.save_for_backward(o, stats, *saved, *((args.cu_seqlens_q, args.cu_seqlens_kv) if ctx.has_seq else ()),
                              *((args.sink,) if ctx.has_sink else ()))
        return o if layout is None else from_bhsd(o, layout)

    @staticmethod
    def backward(ctx, grad_o):
        layout = ctx.layout
        if layout is not None:
            grad_o = to_bhsd(grad_o, layout)
        o, stats, *rest = ctx.saved_tensors
        sink = rest[-1] if ctx.has_sink else None  # (not list.pop: Dynamo traces the saved tensors as a tuple)
        rest = rest[:-1] if ctx.has_sink else rest
        saved, cu = (rest[:-2], rest[-2:]) if ctx.has_seq else (rest, (None, None))
        where = ctx.where
        sink_requires_grad = ctx.has_sink and ctx.needs_input_grad[3 + where[5]]
        if ctx.packed:  # (compiled: `stats` is the block)
            dq, dk, dv, dsink = attention_bwd_packed(*ctx.options.packed_backward_args(
                grad_o, o, stats, ctx.kv_shape, ctx.input_dtypes[0], sink_requires_grad, cu, sink))
        elif torch.compiler.is_compiling():
            dq, dk, dv, dsink = attention_bwd(*ctx.options.backward_args(grad_o, o, stats, list(saved), ctx.kv_shape,
                                                                         sink_requires_grad, cu_seqlens=cu,
                                                                         sink=sink))
        elif ctx.trace.__class__ is op_plans.Packed:  # (stats: the block; views of it made only if needed)
            dq, dk, dv, dsink = op_plans.run_backward_packed(
                ctx.trace, stats, grad_o, o, (sink, *cu), sink_requires_grad, False,
                lambda stats, saved: ctx.options.backward_args(grad_o, o, stats, saved, ctx.kv_shape,
                                                               sink_requires_grad, cu_seqlens=cu, sink=sink),
                lambda args: _bwd_body(args, False))
        else:  # gradients in the layout the backend wrote them (no copies)
            args = ctx.options.backward_args(grad_o, o, stats, list(saved), ctx.kv_shape, sink_requires_grad,
                                             cu_seqlens=cu, sink=sink)
            dq, dk, dv, dsink = _bwd_impl(args, promised=False, after=ctx.trace)
        if layout is not None:
            dq, dk, dv = from_bhsd(dq, layout), from_bhsd(dk, layout), from_bhsd(dv, layout)
        grads = [None] * (len(ctx.needs_input_grad) - 3)
        pairs = [(where[0], dq, ctx.input_dtypes[0]), (where[1], dk, ctx.input_dtypes[1]),
                 (where[2], dv, ctx.input_dtypes[2])]
        if sink_requires_grad:
            pairs.append((where[5], dsink, torch.float32))
        for index, g, dtype in pairs:
            g = g if g.dtype == dtype else g.to(dtype)
            grads[index] = g if grads[index] is None else grads[index] + g
        return (None, None, None, *grads)


def _no_saved_hooks() -> bool:
    """True when no saved-tensor hooks are active (False if torch cannot tell)."""
    return _top_saved_hooks is not None and _top_saved_hooks(False) is None


try:  # (private: torch's own `saved_tensors_hooks` keeps its stack there)
    _top_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    _top_saved_hooks(False)
except (AttributeError, TypeError):
    _top_saved_hooks = None

#: eager calls enter `_Attention` through autograd's C entry point (what `Function.apply` calls after its Python
#: checks, which serve functorch transforms and Dynamo: both keep `_Attention.apply`); a few us less per call
_apply_attention = super(torch.autograd.Function, _Attention).apply
_are_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def needs_backward(*tensors: Optional[Tensor]) -> bool:
    """True when autograd will want gradients of a call on these tensors (grad mode on and one of them, None
    allowed, requires grad): the one rule the backend choice and the eager path both use."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def attention(args: FwdArgs, layout: Optional[str] = None) -> Tensor:
    """O [B,Hq,Sq,Dv] of the forward op on args, differentiable when a gradient is needed; else a forward that
    keeps nothing for backward (the backend may then skip the column-wise copies). Eager calls run the bodies
    directly; under torch.compile the ops are traced. layout (a dense qkv_format, differentiable calls only):
    args' q, k, v are given in that layout, and O is returned in it (the views made inside the autograd node:
    no layout nodes in the graph, whose backward would cost host time per call)."""
    if needs_backward(args.q, args.k, args.v, args.sink):
        tensors, where = _distinct_tensors(args)
        if torch.compiler.is_compiling() or _are_functorch_transforms_active():
            return _Attention.apply(args.without_tensors(), where, layout, *tensors)
        return _apply_attention(args.without_tensors(), where, layout, *map(_unwrap_if_dead, tensors))
    if layout is not None:
        raise ValueError("ops.attention: layout is for differentiable calls")
    if torch.compiler.is_compiling():
        return attention_fwd_no_grad(*args)
    return _fwd_impl(args, needs_backward=False, eager=True)
