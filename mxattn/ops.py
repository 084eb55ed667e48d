"""The `torch.library` custom ops (forward, backward) and their autograd wiring.

`mxattn::attention_fwd` returns O, stats and, flat, what the backend keeps for backward (its `saved_format`: the
FP8 copies by default); `mxattn::attention_bwd` turns them and dO into dQ, dK, dV. Both have fake (meta)
implementations, so `torch.compile(fullgraph=True)` traces models that use them without graph breaks. Tensors are
[B, H, S, D] views (a packed batch as [1, H, T, D]); their arguments are `mxattn.op_args.FwdArgs` / `BwdArgs`
(the mask as its band, the lengths as a `SeqInfo`'s fields, the numerics as the `Recipe.encode` string, the
default recipe when left out), which also decode them; nothing here reads an argument by position. The concrete backend is chosen by the
caller (`mxattn.attention`) and passed by name.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .backends import get_backend
from .layouts import dense_strides_bhsd, empty_bhsd
from .op_args import SINK_INDEX, BwdArgs, FwdArgs
from .recipe import DEFAULT_RECIPE_KEY, Recipe
from .seqinfo import SeqInfo


def _saved_format(backend: str, recipe: str) -> type:
    """The saved format of backend `backend` for the encoded recipe."""
    return get_backend(backend).saved_format_for(Recipe.decode(recipe))


@torch.library.custom_op("mxattn::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, bottom_right: bool,
                  left_bound: Optional[int], right_bound: Optional[int], out_dtype: torch.dtype,
                  qkv_format: str, backend: str, cu_seqlens_q: Optional[Tensor], cu_seqlens_kv: Optional[Tensor],
                  max_seqlen_q: int, max_seqlen_kv: int, packed: bool, sink: Optional[Tensor],
                  recipe: str = DEFAULT_RECIPE_KEY) -> List[Tensor]:
    """q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D], sink None or fp32 [Hq] -> [o [B,Hq,Sq,D] dense in qkv_format order,
    stats [B,Hq,Sq,1] fp32, then the backend's saved tensors (`saved_format_for(recipe).tensors()`)]."""
    args = FwdArgs(q, k, v, softmax_scale, bottom_right, left_bound, right_bound, out_dtype, qkv_format, backend,
                   cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed, sink, recipe)
    o, stats, *saved = _fwd_impl(args)
    return [o, stats, *_as_faked(saved, _saved_format(backend, recipe), q, k, v, args.seq())]


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
        if t.stride() != stride:
            t = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).copy_(t)
        out.append(t)
    return out


#: the saved tensors' promised (shape, stride, dtype) by call signature (`_as_faked`)
_FAKED_LAYOUTS: dict = {}


def _fwd_impl(args: FwdArgs, needs_backward: bool = True):
    """The forward op's body. needs_backward=False returns O alone and lets the backend skip what only a
    backward pass needs."""
    o, stats, saved = get_backend(args.backend).forward(args.q, args.k, args.v, args.params(needs_backward))
    if o.stride() != dense_strides_bhsd(tuple(o.shape), args.qkv_format):  # backends that ignore q's layout
        o = empty_bhsd(tuple(o.shape), args.qkv_format, args.out_dtype, o.device).copy_(o)
    if not needs_backward:
        return o
    return [o, stats.contiguous(), *saved.tensors()]


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, softmax_scale, bottom_right, left_bound, right_bound, out_dtype, qkv_format,
                        backend, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed, sink,
                        recipe=DEFAULT_RECIPE_KEY):
    b, h, s, _ = q.shape
    args = FwdArgs(q, k, v, softmax_scale, bottom_right, left_bound, right_bound, out_dtype, qkv_format, backend,
                   cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed, sink, recipe)
    o = empty_bhsd(tuple(q.shape), qkv_format, out_dtype, q.device)
    stats = q.new_empty((b, h, s, 1), dtype=torch.float32)
    return [o, stats, *_saved_format(backend, recipe).fake_tensors(q, k, v, args.seq())]


@torch.library.custom_op("mxattn::attention_bwd", mutates_args=())
def attention_bwd(do: Tensor, o: Tensor, stats: Tensor, saved: List[Tensor], kv_shape: List[int],
                  softmax_scale: float, bottom_right: bool, left_bound: Optional[int], right_bound: Optional[int],
                  out_dtype: torch.dtype, backend: str, cu_seqlens_q: Optional[Tensor],
                  cu_seqlens_kv: Optional[Tensor], max_seqlen_q: int, max_seqlen_kv: int, packed: bool,
                  sink: Optional[Tensor], sink_requires_grad: bool,
                  recipe: str = DEFAULT_RECIPE_KEY) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dO, O [B,Hq,Sq,D], stats [B,Hq,Sq,1], the backend's saved tensors (as the forward op returned them) and
    K's shape [B,Hkv,Skv,D] -> contiguous (dq, dk, dv) in out_dtype and dsink (fp32 [Hq] when
    sink_requires_grad, else an empty tensor)."""
    return _bwd_impl(BwdArgs(do, o, stats, saved, kv_shape, softmax_scale, bottom_right, left_bound, right_bound,
                             out_dtype, backend, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed,
                             sink, sink_requires_grad, recipe))


def _bwd_impl(args: BwdArgs, contiguous: bool = True):
    """The backward op's body (contiguous: False leaves dq, dk, dv in the layout the backend wrote them, which
    the eager path hands to autograd without copies)."""
    params = args.params(sink_requires_grad=args.sink_requires_grad)
    be = get_backend(args.backend)
    saved_format = be.saved_format_for(params.recipe)
    dq, dk, dv, *dsink = be.backward(saved_format.from_tensors(args.saved, params.seq), args.o, args.stats,
                                     args.do, params)
    dsink = dsink[0] if args.sink_requires_grad else args.stats.new_empty((0,), dtype=torch.float32)
    if contiguous:
        dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    return dq, dk, dv, dsink


@attention_bwd.register_fake
def _attention_bwd_fake(do, o, stats, saved, kv_shape, softmax_scale, bottom_right, left_bound, right_bound,
                        out_dtype, backend, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed, sink,
                        sink_requires_grad, recipe=DEFAULT_RECIPE_KEY):
    dq = do.new_empty(do.shape, dtype=out_dtype)
    dsink = stats.new_empty((do.shape[1] if sink_requires_grad else 0,), dtype=torch.float32)
    return dq, do.new_empty(kv_shape, dtype=out_dtype), do.new_empty(kv_shape, dtype=out_dtype), dsink


def _save_context(ctx, args: FwdArgs, o, stats, saved) -> None:
    """Keep on ctx what `_backward` needs: O, stats, the backend's saved tensors, the lengths and the sink."""
    ctx.args = args.without_tensors()
    ctx.input_dtypes = (args.q.dtype, args.k.dtype, args.v.dtype)
    ctx.kv_shape = list(args.k.shape)
    ctx.has_seq, ctx.has_sink = args.cu_seqlens_q is not None, args.sink is not None
    ctx.save_for_backward(o, stats, *saved, *((args.cu_seqlens_q, args.cu_seqlens_kv) if ctx.has_seq else ()),
                          *((args.sink,) if ctx.has_sink else ()))
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the FP8 side outputs


def _setup_context(ctx, inputs, output):
    o, stats, *saved = output
    _save_context(ctx, FwdArgs(*inputs), o, stats, saved)
    ctx.mark_non_differentiable(stats, *saved)


def _backward(ctx, grad_o, eager: bool = False):
    """Gradients of the forward op's inputs from O's gradient (None: nothing to do). The custom op's autograd
    (eager False: the path torch.compile traces) calls the backward custom op, whose fake implementation
    tracing needs; the eager autograd.Function (eager True) calls its body directly (no custom-op dispatch, and
    gradients in the layout of q, k, v: no contiguous copies)."""
    # one gradient (or None) per argument received: the dispatcher drops trailing arguments equal to their
    # defaults (the default recipe) before the custom op's autograd sees them
    n_args = len(ctx.needs_input_grad)
    if grad_o is None:
        return (None,) * n_args
    o, stats, *rest = ctx.saved_tensors
    sink = rest.pop() if ctx.has_sink else None
    saved, cu = (rest[:-2], rest[-2:]) if ctx.has_seq else (rest, (None, None))
    fwd = ctx.args._replace(cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1], sink=sink)
    sink_requires_grad = ctx.has_sink and ctx.needs_input_grad[SINK_INDEX]
    args = fwd.backward_args(grad_o, o, stats, list(saved), ctx.kv_shape, sink_requires_grad)
    dq, dk, dv, dsink = _bwd_impl(args, contiguous=False) if eager else attention_bwd(*args)
    grads = [g if g.dtype == dt else g.to(dt) for g, dt in zip((dq, dk, dv), ctx.input_dtypes)]
    grads += [None] * (n_args - 3)
    grads[SINK_INDEX] = dsink if sink_requires_grad else None
    return tuple(grads)


def _op_backward(ctx, grads):
    """The custom op's autograd formula: its output is a list, of which only O's gradient is used."""
    return _backward(ctx, grads[0])


attention_fwd.register_autograd(_op_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The forward op's eager twin: the same body and backward without torch.library's dispatch (hundreds of
    microseconds of host time per call), returning O alone (stats and the saved copies stay on ctx, so
    autograd wires one output instead of a dozen); torch.compile traces the custom op."""

    @staticmethod
    def forward(ctx, *inputs):
        args = FwdArgs(*inputs)
        o, stats, *saved = _fwd_impl(args)
        _save_context(ctx, args, o, stats, saved)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        return _backward(ctx, grad_o, eager=True)


def needs_backward(*tensors: Optional[Tensor]) -> bool:
    """True when autograd will want gradients of a call on these tensors (grad mode on and one of them, None
    allowed, requires grad): the one rule the backend choice and the eager path both use."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def attention(args: FwdArgs) -> Tensor:
    """O [B,Hq,Sq,D] of the forward op on args, differentiable: under torch.compile the custom op; in eager
    mode its autograd.Function twin when a gradient is needed, else a forward that keeps nothing for backward
    (the backend may then skip the column-wise copies)."""
    if torch.compiler.is_compiling():
        return attention_fwd(*args)[0]
    if needs_backward(args.q, args.k, args.v, args.sink):
        return _EagerAttention.apply(*args)
    return _fwd_impl(args, needs_backward=False)
