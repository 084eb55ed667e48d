"""Host calls in launch plans: work a recorded body issues other than a Triton launch (a cuDNN graph execution),
kept as the callable, what it reads besides tensors, and each named tensor's place and geometry.

A body reports such a call through `issue(call, names -> tensors)`: the call runs at once, and a recording active on
this thread (`mxattn.runtime.launch_plan.record`) resolves every tensor to (root or allocation, byte offset) with
its shape, strides and dtype, as it resolves a launch's pointer arguments. A replay (`LaunchPlan.replay`) then
calls `call.fn(call.static, names -> tensors)` with tensors of the recorded geometry at the re-based addresses,
made as views of the tensors that own that memory in the replay (the roots, the workspace, the outputs'
allocations): the same names, in the recorded order, at the same addresses relative to the new roots.

`HostCall.current` says whether a recorded call may still be replayed (e.g. its cuDNN plan was not dropped from
the graph cache since the recording): a replay checks it before issuing anything, and refuses otherwise.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from .recording import active_recorder


class HostCall:
    """A recorded host call: fn(static, {name: tensor}) with the names in recorded order; current() -> bool."""

    __slots__ = ("fn", "static", "names", "current")

    def __init__(self, fn: Callable, static, names: Tuple, current: Callable[[], bool]):
        self.fn, self.static, self.names, self.current = fn, static, names, current

    def replay(self, slots, bases: Sequence[int], holders: Sequence[Optional[torch.Tensor]]) -> None:
        """Issue the call with its tensors rebuilt: slots (position, source, byte offset, (shape, strides,
        dtype)) as `LaunchPlan` keeps them, bases the sources' addresses, holders tensors owning their memory."""
        names, tensors, typed = self.names, {}, {}
        for pos, source, offset, (shape, stride, dtype) in slots:
            holder, addr = holders[source], bases[source] + offset
            if holder.dtype is dtype and holder.data_ptr() == addr and holder.shape == shape \
                    and holder.stride() == stride:  # (the root or output itself)
                tensors[names[pos]] = holder
                continue
            base = typed.get((id(holder), dtype))
            if base is None:
                base = typed[(id(holder), dtype)] = _typed(holder, dtype)
            view, start = base
            tensors[names[pos]] = (view.as_strided(shape, stride, (addr - start) // dtype.itemsize) if view is not None
                                   else _on_storage(holder, addr - start, shape, stride, dtype))
        self.fn(self.static, tensors)


def _always() -> bool:
    return True


def issue(fn: Callable, static, tensors: Dict, current: Callable[[], bool] = _always) -> None:
    """fn(static, tensors) ({name: tensor}); reported to the launch-plan recording active on this thread, if any,
    which then replays it (module docstring). current: `HostCall.current`."""
    fn(static, tensors)
    recorder = active_recorder()
    if recorder is not None:
        recorder.on_host_call(HostCall(fn, static, tuple(tensors), current), list(tensors.values()))


def slot_geometry(t: torch.Tensor) -> Tuple[tuple, tuple, torch.dtype]:
    """(shape, strides, dtype) of a host call's tensor, as a replay rebuilds it."""
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _typed(holder: torch.Tensor, dtype: torch.dtype) -> Tuple[Optional[torch.Tensor], int]:
    """(holder's memory as a dtype tensor whose as_strided views reach all of it, or None where no such view
    is free; the address of its storage's first byte)."""
    start = holder.untyped_storage().data_ptr()
    if holder.dtype == dtype:
        return holder, start
    if holder.dim() == 1 and holder.dtype == torch.uint8 and holder.storage_offset() == 0 \
            and holder.numel() % dtype.itemsize == 0:  # (an allocation's raw bytes)
        return holder.view(dtype), start
    return None, start


def _on_storage(holder: torch.Tensor, byte_offset: int, shape, stride, dtype) -> torch.Tensor:
    """A dtype tensor (shape, stride) at byte_offset of holder's storage."""
    return torch.empty(0, dtype=dtype, device=holder.device).set_(holder.untyped_storage(),
                                                                 byte_offset // dtype.itemsize, shape, stride)


__all__ = ["HostCall", "issue", "slot_geometry"]
