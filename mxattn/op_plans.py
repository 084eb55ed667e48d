"""Per-signature replays of the ops' bodies: a call's host path reduced to its allocations and launches.

An op body (`mxattn.ops`: the forward's and the backward's) decodes the op's arguments into the library's
vocabulary (mask, lengths, recipe, `AttentionParams`), asks the backend, and lays the results out as the op
promises: Python that depends only on the call's signature, not on tensor contents. For a backend whose every
launch goes through `mxattn.kernels.triton_launch` (`AttentionBackend.replays_ops`), the whole body is recorded
once per signature (`mxattn.kernels.launch_plan.record`) and later calls replay its allocations and launches
with the new tensors' addresses: no checks, no decoding, no plan lookups below. A body that computes anything
with torch (a copy for an unusual layout, a sink gradient) is refused by the recorder and keeps running as
Python, per signature.

The key holds every non-tensor argument and each tensor argument's shape, strides, dtype, device, address
alignment and aliasing (`launch_plan.plan_key`): a call with anything new runs (and checks) the body.
Replays run with the tensors' device current (as the backend's own launches do: a compiled kernel launches on the
current device, e.g. for a layer that `device_map="auto"` put on another GPU). Decode-like families whose sizes change at every call stop recording by themselves (`PlanCache`'s rule, with a
higher bar here: the backend's own per-length plans serve those calls better).
"""

from __future__ import annotations

from typing import Callable, Dict, List

from .backends import backend_class
from .devices import device_guard
from .kernels.launch_plan import PlanCache, plan_key
from .op_args import BwdArgs, FwdArgs

#: recordings of op bodies; a family must replay 16 times per recording to keep recording new sizes
PLANS = PlanCache(max_entries=512, min_replays=16)
#: backend name -> whether its op bodies may be recorded
_REPLAYS: Dict[str, bool] = {}


def replays(backend: str) -> bool:
    """Whether the ops' bodies on `backend` (a concrete name) may be recorded and replayed."""
    known = _REPLAYS.get(backend)
    if known is None:
        known = _REPLAYS[backend] = bool(getattr(backend_class(backend), "replays_ops", False))
    return known


def run_forward(args: FwdArgs, tag, body: Callable[[], List]) -> List:
    """body()'s flat list of tensors for the forward op's arguments `args` (tag: what else the body reads,
    hashable), replayed when this signature has a plan."""
    if not replays(args.backend):
        return body()
    roots = (args.q, args.k, args.v, args.sink, args.cu_seqlens_q, args.cu_seqlens_kv)
    key = plan_key(("fwd", tag, args.softmax_scale, args.bottom_right, args.left_bound, args.right_bound,
                    args.out_dtype, args.qkv_format, args.backend, args.packed, args.recipe), roots,
                   (args.max_seqlen_q, args.max_seqlen_kv))
    with device_guard(args.q.device):  # a replay launches on the current device: make it the tensors' one
        return PLANS.run(key, body, roots)


def run_backward(args: BwdArgs, tag, body: Callable[[], List]) -> List:
    """body()'s flat list of tensors for the backward op's arguments `args`, as `run_forward`."""
    if not replays(args.backend):
        return body()
    roots = (args.do, args.o, args.stats, args.sink, args.cu_seqlens_q, args.cu_seqlens_kv, *args.saved)
    key = plan_key(("bwd", tag, len(args.saved), tuple(args.kv_shape), args.softmax_scale, args.bottom_right,
                    args.left_bound, args.right_bound, args.out_dtype, args.qkv_format, args.backend, args.packed,
                    args.sink_requires_grad, args.recipe), roots, (args.max_seqlen_q, args.max_seqlen_kv))
    with device_guard(args.do.device):
        return PLANS.run(key, body, roots)


__all__ = ["PLANS", "replays", "run_forward", "run_backward"]
