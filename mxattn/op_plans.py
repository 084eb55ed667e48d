"""Per-signature replays of the ops' bodies: a call's host path reduced to its allocations and launches.

An op body (`mxattn.ops`: the forward's and the backward's) decodes the op's arguments into the library's
vocabulary (mask, lengths, recipe, `AttentionParams`), asks the backend, and lays the results out as the op
promises: Python that depends only on the call's signature, not on tensor contents. For a backend whose every
launch goes through `mxattn.runtime.triton_launch` (`AttentionBackend.replays_ops`), the whole body is recorded
once per signature (`mxattn.runtime.launch_plan.record`) and later calls replay its allocations and launches
with the new tensors' addresses: no checks, no decoding, no plan lookups below. A body that computes anything
with torch (a copy for an unusual layout, a sink gradient) is refused by the recorder and keeps running as
Python, per signature.

The key holds every non-tensor argument and each tensor argument's shape, strides, dtype, device, address
alignment and aliasing (`launch_plan.plan_key`): a call with anything new runs (and checks) the body.
Replays run with the tensors' device current (as the backend's own launches do: a compiled kernel launches on the
current device, e.g. for a layer that `device_map="auto"` put on another GPU). Decode-like families whose sizes
change at every call stop recording by themselves (`PlanCache`'s rule, with a higher bar here: the backend's own
per-length plans serve those calls better).

One level up, an eager dense call without a backward (inference: prefill, decode steps) replays the public call's
whole body (`run_call`: the layout views, the op, O back in the caller's layout) with the caller's own tensors as
roots. Where the backend says its forward is affine in the KV length (`forward_affine_in_kv_length`: the
one-launch decode forward), one `affine_plan` serves every length, so generation, whose every step attends one more
key, replays too.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .backends import backend_class, get_backend
from .backends.base import AttentionBackend
from .devices import device_guard
from .runtime.affine_plan import AffinePlanCache
from .runtime.launch_plan import allow_carving, plan_key
from .runtime.plan_cache import PlanCache
from .runtime import saved_block
from .op_args import PLAN_OPTION_FIELDS, BwdArgs, FwdArgs, PackedBwdArgs
from .runtime.saved_block import BlockLayout

#: recordings of op bodies; a family must replay 16 times per recording to keep recording new sizes. For eager
#: callers (`carve`), outputs after the first (the forward's stats and saved copies, freed together after its
#: backward; the backward's dK, dV) are carved from one allocation per replay; never for what an op returns (a
#: custom op's returns must not share storage: torch warns, and will refuse)
PLANS = PlanCache(max_entries=512, min_replays=16)
#: `record`'s carve_from for eager callers
_CARVE_FROM = 1
#: backend name -> whether its op bodies may be recorded
_REPLAYS: Dict[str, bool] = {}


def replays(backend: str) -> bool:
    """Whether the ops' bodies on `backend` (a concrete name) may be recorded and replayed."""
    known = _REPLAYS.get(backend)
    if known is None:
        known = _REPLAYS[backend] = bool(getattr(backend_class(backend), "replays_ops", False))
    return known


#: backend name -> its `replay_variant`, or None where the base class's (nothing to key)
_VARIANTS: Dict[str, Optional[Callable]] = {}


def _variant(backend: str, x: torch.Tensor):
    """What `backend`'s bodies read besides the ops' arguments for tensors like x (`replay_variant`)."""
    fn = _VARIANTS.get(backend, _variant)
    if fn is _variant:
        cls = backend_class(backend)
        fn = _VARIANTS[backend] = (None if cls.replay_variant.__func__ is AttentionBackend.replay_variant.__func__
                                   else cls.replay_variant)
    return None if fn is None else fn(x)


def run_forward(args: FwdArgs, tag, body: Callable[[], List]) -> List:
    """body()'s flat list of tensors for the forward op's arguments `args` (tag: what else the body reads,
    hashable), replayed when this signature has a plan."""
    return run_forward_traced(args, tag, body)[0]


def run_forward_traced(args: FwdArgs, tag, body: Callable[[], List], carve: bool = False, packed: bool = False):
    """(`run_forward`'s list [o, stats, *saved], its trace: None, or what lets the backward of these very
    tensors find its plan without keying its 16 roots (`run_backward`'s after)). carve: the caller keeps the
    outputs itself (the eager autograd path), so those after O may share one allocation (a backend whose bodies
    are not replayed may carve what it replays itself: `launch_plan.allow_carving`). packed (with carve): a
    replay may leave stats and the saved tensors in their one allocation: the answer is then ([o, block],
    `Packed`), and `run_backward_packed` runs the backward from them."""
    if not replays(args.backend):
        if carve:
            with allow_carving():
                return body(), None
        return body(), None
    roots = _fwd_roots(args)
    key = _fwd_key(args, tag, carve, roots)
    with device_guard(args.q.device):  # a replay launches on the current device: make it the tensors' one
        outputs, plan, block = PLANS.run_with_plan(key, body, roots, _CARVE_FROM if carve else None,
                                                   packed and carve)
    if block is not None:
        if plan.packs_from == 1:
            return [outputs[0], block], Packed(plan, outputs[0].data_ptr(), block.data_ptr())
        outputs += plan.unpack(block)  # (a plan whose tail holds other outputs than stats and the saved)
    if plan is None or len(outputs) < 2:
        return outputs, None
    o, stats, *saved = outputs
    return outputs, (plan, _addresses((o, stats, args.sink, args.cu_seqlens_q, args.cu_seqlens_kv, *saved)))


def _fwd_roots(args: FwdArgs) -> tuple:
    return args.q, args.k, args.v, args.sink, args.cu_seqlens_q, args.cu_seqlens_kv


def _options(args) -> tuple:
    """The options every op body reads (`FwdArgs`, `BwdArgs` or `PackedBwdArgs`), for plan keys."""
    return tuple(getattr(args, name) for name in PLAN_OPTION_FIELDS)


def _fwd_key(args: FwdArgs, tag, carve: bool, roots: tuple) -> tuple:
    """The plan key of a forward body on args (tag: what else the body reads; carve: `run_forward_traced`'s)."""
    return plan_key(("fwd", tag, carve, _variant(args.backend, args.q), *_options(args)), roots,
                    (args.max_seqlen_q, args.max_seqlen_kv))


#: `LaunchPlan.answers`' key: whether a packed forward's plan leaves its block in the op's layout
_BLOCK_MATCHES = "packed op block layout"


def run_forward_packed(args: FwdArgs, body: Callable[[], List], layout: Callable[[], BlockLayout]) -> List:
    """[O, block] of the packed forward op (`mxattn.runtime.saved_block`): body() gives [o, stats, *saved]; layout() the
    block layout the op promises. A replay whose carved outputs already lie in that layout hands its block over
    as it is (no copy); otherwise (the first calls of a signature, a backend that does not replay, a plan laid
    out otherwise) stats and the saved tensors are copied into a new block."""
    if not replays(args.backend):
        outputs = body()
    else:
        roots = _fwd_roots(args)
        key = _fwd_key(args, "packed op", True, roots)
        with device_guard(args.q.device):
            outputs, plan, block = PLANS.run_with_plan(key, body, roots, _CARVE_FROM, True)
        if block is not None:
            matches = plan.answers.get(_BLOCK_MATCHES)  # (a property of the signature: asked once per plan)
            if matches is None:
                want = layout()
                matches = plan.answers[_BLOCK_MATCHES] = (plan.packs_from == 1
                                                          and plan.packed_layout() == (want.entries, want.nbytes))
            if matches:
                return [outputs[0], block]
            outputs += plan.unpack(block)
    return [outputs[0], saved_block.pack(outputs[1:], layout())]


def run_backward_from_block(args: PackedBwdArgs, layout_id: int, layout: BlockLayout,
                            body: Callable[[BwdArgs], tuple]) -> tuple:
    """body(args.unpacked(stats, saved))'s (dq, dk, dv, dsink) for the packed backward op's arguments, the block's
    layout and its id (`saved_block.layout_for`). Replayed per signature, keyed on dO, O, the block, the lengths
    and the sink (6 roots, not the 16 of `run_backward`); a replay needs only the block's address (the kept
    tensors' views are made only when the body runs)."""
    do, o, block = args.do, args.o, args.block
    others = (args.sink, args.cu_seqlens_q, args.cu_seqlens_kv)
    key = None
    if replays(args.backend):
        key = plan_key(("bwd block", layout_id, _variant(args.backend, do), args.sink_requires_grad,
                        *_options(args)), (do, o, block, *others), (args.max_seqlen_q, args.max_seqlen_kv))
        with device_guard(do.device):
            outputs = PLANS.replay_only(key, *_block_roots(do, o, block, layout.offsets, others))
        if outputs is not None:
            return tuple(outputs)
    stats, *saved = saved_block.unpack(block, layout)
    unpacked = args.unpacked(stats, saved)
    with device_guard(do.device):  # (roots in `run_backward`'s order: the replay's bases above follow it)
        return tuple(PLANS.run_with_plan(key, lambda: body(unpacked), (do, o, stats, *others, *saved))[0])


def _block_roots(do: torch.Tensor, o: torch.Tensor, block: torch.Tensor, offsets: Sequence[int],
                 others: Sequence[Optional[torch.Tensor]]) -> Tuple[None, list, list]:
    """`PlanCache.replay_only`'s (roots, bases, holders) for a backward plan recorded on the roots (dO, O, stats,
    sink, cu_seqlens_q, cu_seqlens_kv, *saved) whose stats and saved tensors lie in `block` at `offsets`: their
    addresses without views (others: sink and the lengths, None where absent), and each address's owner (the
    block for the kept tensors: what a host call rebuilds its views from)."""
    base = block.data_ptr()
    bases = [do.data_ptr(), o.data_ptr(), base + offsets[0], *[0 if t is None else t.data_ptr() for t in others],
             *[base + off for off in offsets[1:]]]
    return None, bases, [do, o, block, *others, *[block] * (len(offsets) - 1)]


class Packed(NamedTuple):
    """The trace of a forward replayed packed (`run_forward_traced`): its plan, O's and the block's addresses."""

    plan: object
    o: int
    block: int


def _addresses(tensors) -> tuple:
    return tuple([0 if t is None else t.data_ptr() for t in tensors])


def run_backward(args: BwdArgs, tag, body: Callable[[], List], after=None, carve: bool = False) -> List:
    """body()'s flat list of tensors for the backward op's arguments `args`, as `run_forward`. after: the
    forward's trace (`run_forward_traced`) when args hold that forward's own outputs: if every kept tensor is
    still at its address (no saved-tensor hook moved it), the key is the forward's plan and dO's layout alone
    (the forward's signature fixes every other root's); else all roots are keyed. carve: as
    `run_forward_traced`'s (dK, dV and dSink then share one allocation)."""
    if not replays(args.backend):
        return body()
    roots = (args.do, args.o, args.stats, args.sink, args.cu_seqlens_q, args.cu_seqlens_kv, *args.saved)
    do, o = args.do, args.o
    if after is not None and _addresses(roots[1:]) == after[1]:
        key = _after_key(after[0], tag, carve, args.sink_requires_grad, do, o)
    else:
        key = plan_key(("bwd", tag, carve, _variant(args.backend, do), len(args.saved), tuple(args.kv_shape),
                        args.sink_requires_grad, *_options(args)), roots, (args.max_seqlen_q, args.max_seqlen_kv))
    with device_guard(do.device):
        return PLANS.run_with_plan(key, body, roots, _CARVE_FROM if carve else None)[0]


def _after_key(fwd_plan, tag, carve: bool, sink_requires_grad: bool, do: torch.Tensor, o: torch.Tensor) -> tuple:
    """The key of a backward on its forward's own outputs (`run_backward`'s after): the forward's plan (whose key
    holds the backend's `replay_variant`) and dO."""
    shared = do.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
    return (("bwd after", fwd_plan, tag, carve, sink_requires_grad, do.dtype, do.device, do.data_ptr() & 15),
            (do.shape, do.stride(), do.data_ptr() - o.data_ptr() if shared else None))


def run_backward_packed(packed: Packed, block: torch.Tensor, do: torch.Tensor, o: torch.Tensor,
                        others: Sequence[Optional[torch.Tensor]], sink_requires_grad: bool, tag,
                        make_args: Callable[[torch.Tensor, list], BwdArgs], body: Callable[[BwdArgs], List]):
    """`run_backward(make_args(stats, saved), tag, lambda: body(args), after, carve=True)` for a forward
    replayed packed (`run_forward_traced`): its trace, the block, dO, O, and its (sink, cu_seqlens_q,
    cu_seqlens_kv). While O and the block are where the forward left them, a replayed backward needs only
    their addresses: stats and the saved tensors are made as views (`LaunchPlan.unpack`) only when the body
    runs."""
    plan = packed.plan
    if o.data_ptr() == packed.o and block.data_ptr() == packed.block:
        key = _after_key(plan, tag, True, sink_requires_grad, do, o)
        with device_guard(do.device):
            outputs = PLANS.replay_only(key, *_block_roots(do, o, block, plan.packed_offsets, others))
        if outputs is not None:
            return outputs
    stats, *saved = plan.unpack(block)
    args = make_args(stats, saved)
    after = (plan, _addresses((o, stats, *others, *saved)))
    return run_backward(args, tag, lambda: body(args), after, carve=True)


# --------------------------------------------------------------------------- whole calls without a backward

#: recordings of public calls' bodies (eager, dense, no backward) by call plan and the roots' layouts
CALLS = PlanCache(max_entries=512, min_replays=16)
#: the same for calls whose forward is affine in the KV length: one plan per layer over every length
CALLS_AFFINE = AffinePlanCache(max_entries=256)
#: identities of call plans (keys hold this small integer, not the plan)
_CALL_IDS = itertools.count(1)

#: `call_replay`'s answers
FIXED, AFFINE = "fixed", "affine"


def call_replay(args: FwdArgs, needs_backward: bool) -> Optional[str]:
    """How an eager dense call on args (bhsd views, backend chosen) may replay its whole body: None (not: a
    backward is needed or the backend's work is not all Triton launches), FIXED (per signature) or AFFINE
    (one plan for every KV length: the backend's forward is affine in it)."""
    if needs_backward or not replays(args.backend):
        return None
    affine = get_backend(args.backend).forward_affine_in_kv_length(args.q, args.k, args.v, args.params(False))
    return AFFINE if affine else FIXED


def new_call_id() -> int:
    """A fresh identity for a call plan (`run_call`'s plan_id)."""
    return next(_CALL_IDS)


def run_call(plan_id: int, kind: str, kv_axis: int, roots: Sequence[Optional[torch.Tensor]],
             body: Callable[[], torch.Tensor]) -> torch.Tensor:
    """body()'s tensor (O of an eager dense call without a backward) for roots (q, k, v, sink in the caller's
    layout; k's and v's length along kv_axis), replayed per signature (kind FIXED), or over every KV length
    (AFFINE), once recorded; plan_id identifies everything else body() reads (`new_call_id`)."""
    flat = lambda: [body()]  # noqa: E731
    with device_guard(roots[0].device):
        if kind == AFFINE:
            if plan_id in _REPEATING:  # its last call replayed at a length seen before: try that first
                outputs = CALLS.replay_only(plan_key((plan_id,), roots), roots)
                if outputs is not None:
                    return outputs[0]
                _REPEATING.discard(plan_id)  # (a new length: decode steps, which the affine plan serves)
            return CALLS_AFFINE.run_keyed((plan_id,), kv_axis, roots[1].shape[kv_axis], flat, roots,
                                          lambda: _run_fixed(plan_id, roots, flat))[0]
        return CALLS.run(plan_key((plan_id,), roots), flat, roots)[0]


#: ids of AFFINE call plans whose last call ran the per-signature plan (`CALLS`) because the affine plan could not
#: serve it (not yet trusted: calls repeated at one length, as in a benchmark or a fixed-length eval loop): their
#: next call tries that plan before keying the roots for the affine one. Only an order of lookups (a set's add
#: and discard are atomic in CPython); bounded, cleared when full
_REPEATING: set = set()


def _run_fixed(plan_id: int, roots, flat) -> list:
    """`run_call`'s per-signature path for an AFFINE call plan that its affine plan did not serve."""
    outputs, plan, _ = CALLS.run_with_plan(plan_key((plan_id,), roots), flat, roots)
    if plan is not None:
        if len(_REPEATING) >= 1024:
            _REPEATING.clear()
        _REPEATING.add(plan_id)
    return outputs


__all__ = ["PLANS", "CALLS", "CALLS_AFFINE", "FIXED", "AFFINE", "replays", "run_forward", "run_forward_traced",
           "run_backward",
           "run_backward_packed", "Packed", "run_forward_packed", "run_backward_from_block", "call_replay", "new_call_id", "run_call"]
