"""Record once, replay per call: a host path made only of allocations, views and Triton launches.

The triton backend's forward and backward spend most of their host time in Python that depends only on the
call's signature (shapes, strides, dtypes, options): checks, tile and grid choices, stride lists, output
allocations, Triton's argument handling. `record(body, roots)` runs such a body once, observing every aten
operation (a `TorchDispatchMode`) and every `triton_launch.launch`, and returns a `LaunchPlan` when the body did
nothing but allocate (empty or zero-filled memory), take views and launch compiled kernels.
`LaunchPlan.replay(roots)` then does the same work for new tensors of the same signature: it allocates the
outputs (those from `carve_from` on as views of one allocation: each CUDA allocation costs microseconds of host
time), carves the scratch from one workspace (offsets planned from the recorded lifetimes, so the peak is no
higher than the recorded run's; zero fills at their recorded place in the sequence), and launches each compiled
kernel with the recorded arguments, pointers re-based onto the new tensors' addresses. A host TMA descriptor
argument (the Gluon forward's K and V) is recorded as its tensor's place and its shape, strides and padding, and
replayed as a `ReplayedDescriptor` on the new address (Triton's launcher encodes a descriptor on every launch).
Work other than a Triton launch that the body reports as a host call (`host_calls.issue`: the cudnn backend's
graph executions) is kept in sequence with its tensors' places and geometry and issued again on views rebuilt
over the replay's tensors (which a replay onto bare addresses must then pass as `holders`).

What the recording refuses (the caller then keeps the ordinary path for that signature): any aten operation that
computes (a copy, a fill of existing memory, arithmetic), a launch through Triton's own dispatcher (launch hooks,
another Triton version), a kernel argument in memory that is neither a root nor allocated by the body, an output
that is not allocated by the body. Host values the body read from tensor contents would be baked in, so callers
record only bodies whose host path reads none (the triton backend reads shapes and the longest sequences, never
the sequence lengths themselves).

The caller's key must hold everything the body's Python reads besides tensor contents and addresses, how the
roots share storage (`alias_key`), plus each root's address modulo 16 (Triton specializes pointers on 16-byte alignment; replayed scratch keeps the recorded
alignment because workspace offsets are multiples of 256).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..constants import ceil_div
from . import recording
from .host_calls import HostCall, slot_geometry
from .recording import active_recorder, allow_carving, carving_allowed, recording_active
from .plan_keys import alias_key, plan_key


_LAUNCHER = None


def _launcher():
    """mxattn.runtime.triton_launch, imported on first use (this module imports without triton)."""
    global _LAUNCHER
    if _LAUNCHER is None:
        _LAUNCHER = importlib.import_module(".triton_launch", __package__)
    return _LAUNCHER

_aten = torch.ops.aten
#: the allocation ops a body may use: uninitialised memory (replays allocate the same) ...
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                _aten.new_empty.default, _aten.new_empty_strided.default}
#: ... and zero-filled memory (replays zero the same bytes at the same point of the sequence)
_ZERO_ALLOCATIONS = {_aten.zeros.default, _aten.zeros_like.default, _aten.new_zeros.default}
#: workspace offsets are multiples of this (keeps every recorded pointer's alignment class)
_ALIGN = 256


class RecordingRefused(Exception):
    """The recorded body did something a replay cannot repeat (the message says what)."""


class _Allocation:
    __slots__ = ("start", "nbytes", "event", "last_use", "zero")

    def __init__(self, start: int, nbytes: int, event: int, zero: bool):
        self.start, self.nbytes, self.event, self.last_use, self.zero = start, nbytes, event, event, zero


#: launch arguments a replay repeats as they are (everything else but tensors and host TMA descriptors is
#: refused: `_Recorder.on_launch`)
_PLAIN_ARGS = (int, float, bool, type(None))


class _Address:
    """A device address where Triton's launcher asks a tensor for one (`data_ptr()`)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class ReplayedDescriptor:
    """A host TMA descriptor as a replay passes it: what Triton 3.6's launcher reads of one (`base.data_ptr()`,
    shape, strides, padding; the block shape and layout are the compiled kernel's), on a re-based address."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, padding):
        self.base, self.shape, self.strides, self.padding = _Address(ptr), list(shape), list(strides), padding


class _Recorder(TorchDispatchMode):
    """Observes a body's aten ops (allocations kept by their storage's address) and launches (tensor arguments
    resolved through their storage to (root or allocation, byte offset) at launch time, while the addresses
    mean what they meant)."""

    def __init__(self, roots: Sequence[Optional[torch.Tensor]]):
        super().__init__()
        self.roots = [None if r is None else _root_ranges(r) for r in roots]
        self.root_items = [None if r is None else r.element_size() for r in roots]
        self.roots_by_storage: dict = {}
        for i, r in enumerate(self.roots):
            if r is not None:
                self.roots_by_storage.setdefault(r[2], []).append(i)
        self.allocations: List[_Allocation] = []
        self.allocation_at: dict = {}  # storage address -> the latest allocation there (addresses are reused)
        self.launches: list = []
        self.events = 0
        self.refusal: Optional[str] = None

    def refuse(self, why: str) -> None:
        if self.refusal is None:
            self.refusal = why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS or func in _ZERO_ALLOCATIONS:
            storage = out.untyped_storage()
            self.allocation_at[storage.data_ptr()] = len(self.allocations)
            self.allocations.append(_Allocation(storage.data_ptr(), storage.nbytes(), self.events,
                                                func in _ZERO_ALLOCATIONS))
            self.events += 1
        elif not func.is_view:
            self.refuse(f"the body ran {func}, which is neither an allocation, a view nor a Triton launch")
        return out

    def resolve(self, t: torch.Tensor) -> Tuple[str, int, int]:
        """('root', index, offset from its data_ptr) or ('alloc', index, offset from its start) of tensor t.
        Among roots sharing t's storage (q, k, v unbound from one tensor), the one starting at t wins, then
        one whose elements hold t's first byte."""
        ptr, storage = t.data_ptr(), t.untyped_storage().data_ptr()
        candidates = self.roots_by_storage.get(storage)
        if candidates:
            best = next((i for i in candidates if self.roots[i][0] == ptr), None)
            if best is None:
                best = next((i for i in candidates if self.roots[i][0] <= ptr < self.roots[i][1]), candidates[0])
            return "root", best, ptr - self.roots[best][0]
        j = self.allocation_at.get(storage)
        if j is None:
            raise RecordingRefused(f"a launch argument at 0x{ptr:x} lies in memory the body did not allocate "
                                   "and no root holds")
        return "alloc", j, ptr - self.allocations[j].start

    def on_launch(self, entry, grid, args) -> None:
        if entry is None:
            self.refuse("a launch went through Triton's dispatcher (launch hooks or an unsupported Triton)")
            return
        template, slots = list(args), []
        is_descriptor = _launcher().is_tma_descriptor
        try:
            for pos, a in enumerate(args):
                if a.__class__ in _PLAIN_ARGS:
                    continue
                if isinstance(a, torch.Tensor):
                    described = None
                elif is_descriptor(a):  # its tensor's place, and what the launcher reads besides the address
                    described = (tuple(int(n) for n in a.shape), tuple(int(n) for n in a.strides), a.padding)
                    a = a.base
                else:
                    raise RecordingRefused(f"a launch argument of type {type(a).__name__} is neither a tensor, a "
                                           "host TMA descriptor nor a plain value: a replay could not repeat it")
                kind, index, offset = self.resolve(a)
                if kind == "alloc":
                    self.allocations[index].last_use = self.events
                slots.append((pos, kind, index, offset, described))
                template[pos] = None
        except RecordingRefused as exc:
            self.refuse(str(exc))
            return
        self.launches.append((entry, tuple(grid), template, slots, self.events))
        self.events += 1

    def on_host_call(self, call, tensors) -> None:
        """A host call (`host_calls.issue`) with its tensors, kept as a launch whose slots describe each
        tensor's geometry (`host_calls.HostCall.replay` rebuilds them)."""
        slots = []
        try:
            for pos, t in enumerate(tensors):
                kind, index, offset = self.resolve(t)
                if kind == "alloc":
                    self.allocations[index].last_use = self.events
                elif self.root_items[index] % t.element_size() or offset % t.element_size():
                    raise RecordingRefused("a host call's tensor is not at an element of its root's dtype")
                slots.append((pos, kind, index, offset, slot_geometry(t)))
        except RecordingRefused as exc:
            self.refuse(str(exc))
            return
        self.launches.append((call, (), [None] * len(tensors), slots, self.events))
        self.events += 1


def _root_ranges(t: torch.Tensor) -> tuple:
    """(data_ptr, end of its elements, storage start, storage end) of a root tensor."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    storage = t.untyped_storage()
    start = t.data_ptr()
    return start, start + extent * t.element_size(), storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _covers_allocation(t: torch.Tensor, a: _Allocation) -> bool:
    """True when t (shape, strides) spans exactly allocation a from its first byte, as `torch.empty_strided`
    with t's shape and strides would allocate it."""
    if t.data_ptr() != a.start or t.numel() == 0:
        return False
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return extent * t.element_size() == a.nbytes


def _plan_workspace(allocations: List[_Allocation], scratch: List[int]) -> Tuple[dict, int]:
    """Byte offsets of the scratch allocations inside one workspace (first fit among the blocks whose
    lifetimes overlap), and its size."""
    placed, offsets, size = [], {}, 0
    for j in scratch:
        a = allocations[j]
        need = ceil_div(max(a.nbytes, 1), _ALIGN) * _ALIGN
        busy = sorted((off, off + n) for off, n, first, last in placed
                      if not (last < a.event or a.last_use < first))
        offset = 0
        for lo, hi in busy:
            if offset + need <= lo:
                break
            offset = max(offset, hi)
        placed.append((offset, need, a.event, a.last_use))
        offsets[j] = offset
        size = max(size, offset + need)
    return offsets, size


class LaunchPlan:
    """A recorded body, replayable for new roots of the same signature (module docstring)."""

    def __init__(self, device: torch.device, launches, outputs, out_allocs, workspace_bytes: int,
                 block_bytes: int = 0):
        self.device = device
        self.index = device.index if device.index is not None else 0
        self._launches = launches
        self._outputs = outputs
        self._out_allocs = out_allocs
        self._workspace_bytes = workspace_bytes
        self._block_bytes = block_bytes
        #: the allocations behind outputs, in the order their addresses follow the roots' and the workspace's in
        #: a replay's address list (the launch slots' sources, `_build`)
        self._out_order = _output_allocations(outputs)
        #: where the outputs that are all carved from the block begin when they are its tail, else None
        #: (`replay`'s packed), and their byte offsets in the block
        tail = len(outputs)
        while tail and outputs[tail - 1][0] == "carved":
            tail -= 1
        carved_before = any(kind == "carved" for kind, _ in outputs[:tail])
        self.packs_from = tail if block_bytes and tail < len(outputs) and not carved_before else None
        self.packed_offsets = tuple(spec[1] for _, spec in outputs[tail:]) if self.packs_from is not None else ()
        #: per output, where a zero-filled carved one ends in the block (else None)
        self._zero_ends = [spec[1] + _nbytes(*spec[2:5]) if kind == "carved" and spec[5] else None
                           for kind, spec in outputs]
        #: the host calls among the launches (`host_calls`): a replay needs the roots' tensors for them
        self._host_calls = tuple(entry for entry, *_ in launches if entry.__class__ is HostCall)
        #: the launches as (generated function, its constants) (`_compile_issue`), made on the first replay
        self._issue = None
        #: its family's [recordings, replays] in the `PlanCache` that stored it (counted without hashing the
        #: family at each replay)
        self.family_stats = [0, 0]
        #: what callers learned about this plan, by question (e.g. whether its packed block is in a layout of
        #: theirs: a property of the plan's signature, so asked once)
        self.answers: dict = {}

    def stale(self) -> bool:
        """True when a host call of this plan may no longer be replayed (`host_calls.HostCall.current`)."""
        return not all(call.current() for call in self._host_calls)

    @property
    def launch_count(self) -> int:
        return sum(entry is not None for entry, *_ in self._launches)

    @property
    def workspace_bytes(self) -> int:
        return self._workspace_bytes

    @property
    def allocations_per_replay(self) -> int:
        """The allocations one replay makes (outputs, the carved outputs' block, the workspace)."""
        return (sum(kind == "whole" for kind, _ in self._outputs) + len(self._out_allocs)
                + bool(self._block_bytes) + bool(self._workspace_bytes))

    def replay(self, roots: Optional[Sequence[Optional[torch.Tensor]]], packed: bool = False,
               bases: Optional[list] = None, holders: Optional[Sequence] = None) -> List[Optional[torch.Tensor]]:
        """The body's outputs for new roots (same signature as recorded), its launches issued on the current
        stream. None when launches cannot be issued directly now (launch hooks installed): the caller then
        runs the body itself. packed (a plan whose outputs end in carved ones, `packs_from`): those outputs
        left out and the block they are carved from last instead (`unpack` makes them; a caller that needs
        only their addresses saves their views). bases: instead of roots, the roots' addresses (a fresh list,
        0 for an absent root). holders (with bases, for a plan with host calls): per root a tensor owning its
        memory (None without one: then None is returned, before anything is issued)."""
        launcher = _launcher()
        if not launcher.fast_path_usable():
            return None
        if self._host_calls:  # (tensors to rebuild the calls' views from; plans still current)
            holders = list(roots) if holders is None and roots is not None else holders and list(holders)
            if not holders or self.stale():
                return None
        else:
            holders = None
        dev = self.device
        if bases is None:
            bases = [None if r is None else r.data_ptr() for r in roots]
        alloc_base, raws, alloc_holder = {}, {}, {}
        if self._block_bytes:  # the carved outputs' one allocation, and typed views of it
            block = torch.empty(self._block_bytes, dtype=torch.uint8, device=dev)
            block_ptr, typed = block.data_ptr(), {}
        outputs: List[Optional[torch.Tensor]] = []
        for (kind, spec), zero_end in zip(self._outputs, self._zero_ends):
            if kind == "carved":  # an output carved from the block at a 256-byte boundary
                j, nbytes_offset, shape, stride, dtype, zero = spec
                alloc_base[j] = block_ptr + nbytes_offset
                if holders is not None:
                    alloc_holder[j] = block
                if packed:  # (the tail: `unpack` makes these views)
                    if zero:
                        block[nbytes_offset:zero_end].zero_()
                    continue
                base = typed.get(dtype)
                if base is None:
                    base = typed[dtype] = block.view(dtype)
                t = base.as_strided(shape, stride, nbytes_offset // base.element_size())
                if zero:
                    t.zero_()
            elif kind == "whole":  # the output is its allocation
                j, shape, stride, dtype, zero = spec
                t = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
                if zero:
                    t.zero_()
                alloc_base[j] = t.data_ptr()
                if holders is not None:
                    alloc_holder[j] = t
            elif kind == "view":  # one of several views of an allocation
                j, offset, shape, stride, dtype = spec
                raw = raws.get(j)
                if raw is None:
                    nbytes, zero = self._out_allocs[j]
                    raw = raws[j] = (torch.zeros if zero else torch.empty)(nbytes, dtype=torch.uint8, device=dev)
                    alloc_base[j] = raw.data_ptr()
                    if holders is not None:
                        alloc_holder[j] = raw
                t = torch.empty(0, dtype=dtype, device=dev).set_(raw.untyped_storage(), offset, shape, stride)
            else:
                t = None
            outputs.append(t)
        workspace = None
        if self._workspace_bytes:
            workspace = torch.empty(self._workspace_bytes, dtype=torch.uint8, device=dev)
        bases.append(0 if workspace is None else workspace.data_ptr())   # the sources a slot names (`_build`)
        for j in self._out_order:
            bases.append(alloc_base[j])
        if holders is not None:  # the tensors owning each source's memory, parallel to bases
            holders.append(workspace)
            holders += [alloc_holder[j] for j in self._out_order]
        program = self._issue
        if program is None:
            program = self._issue = _compile_issue(self._launches, launcher)
        program[0](program[1], bases, launcher.current_stream(self.index), workspace, holders)
        del workspace  # the caching allocator keeps it from other streams' reuse until the launches ran
        if packed:
            outputs.append(block)
        return outputs

    def packed_layout(self) -> Tuple[tuple, int]:
        """(per output a packed replay leaves in its block: (byte offset, shape, strides, dtype); the block's
        bytes), for a plan with `packs_from`: what a caller compares with a layout of its own
        (`mxattn.runtime.saved_block.BlockLayout`) before handing the block on as that layout."""
        return (tuple((off, shape, stride, dtype) for _, (_j, off, shape, stride, dtype, _z)
                      in self._outputs[self.packs_from:]), self._block_bytes)

    def unpack(self, block: torch.Tensor) -> List[torch.Tensor]:
        """The outputs a packed replay (`replay`) left in `block`, as views, as an unpacked replay makes them."""
        return block_views(block, self.packed_layout()[0])


def block_views(block: torch.Tensor, entries) -> List[torch.Tensor]:
    """Views of a uint8 block: per entry (byte offset, shape, strides, dtype), a tensor of that dtype there (the
    offset a multiple of its item size)."""
    typed, out = {}, []
    for offset, shape, stride, dtype in entries:
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = block.view(dtype)
        out.append(base.as_strided(shape, stride, offset // base.element_size()))
    return out


def _compile_issue(launches, launcher):
    """The plan's launches, zero fills and host calls as (issue, K): issue(K, bases, stream, workspace, holders)
    is straight-line Python that issues exactly what a loop over the launches would, each kernel's plain arguments
    taken from the tuple K (unpacked once into locals) and each pointer computed as `bases[source] + offset`,
    calling Triton's C launcher directly where it allows (`triton_launch.direct_launcher`), else `run_compiled`:
    without the loop's per-argument interpretation (the bulk of a replay's host time: tens of pointer arguments per
    launch). Every value lives in K, so the code depends only on the plan's structure (which arguments are
    pointers, and where): plans of one structure share one compiled function (`_PROGRAMS`), such as the plans an
    affine plan instantiates at each decode step's new length, which then only gather their constants."""
    K, structure = [], []
    for entry, grid, template, slots in launches:
        if entry is None:  # a zero-filled scratch allocation: (offset, nbytes) in grid
            K += (grid[0], grid[0] + grid[1])
            structure.append(_ZERO_FILL)
            continue
        if entry.__class__ is HostCall:
            K += (entry, slots)
            structure.append(_HOST_CALL)
            continue
        pointers = {pos: (source, offset, described) for pos, source, offset, described in slots}
        spec = []
        for pos, value in enumerate(template):
            pointer = pointers.get(pos)
            if pointer is None:
                K.append(value)
                continue
            source, offset, described = pointer
            K.append(offset)
            if described is not None:
                K.append(described)
            spec.append((pos, int(source), described is not None))
        direct = launcher.direct_launcher(entry)
        if direct is None:
            K += (entry, grid)
        else:
            K += (direct[0], *(tuple(int(n) for n in grid) + (1,) * (3 - len(grid))), direct[1], entry[1])
        structure.append((direct is not None, len(template), tuple(spec)))
    structure = tuple(structure)
    issue = _PROGRAMS.get(structure)
    if issue is None:
        if len(_PROGRAMS) >= 256:
            _PROGRAMS.clear()
        issue = _PROGRAMS[structure] = _generate_issue(structure, launcher)
    return issue, tuple(K)


#: `_compile_issue`'s structure items other than a kernel launch's
_ZERO_FILL, _HOST_CALL = "zero fill", "host call"


def _generate_issue(structure: tuple, launcher):
    """The issue function of a plan structure (`_compile_issue`), its constants named k0, k1, ... in the order
    `_compile_issue` gathers them."""
    count = 0

    def k() -> str:
        nonlocal count
        count += 1
        return f"k{count - 1}"

    lines = []
    for item in structure:
        if item == _ZERO_FILL:
            start, end = k(), k()
            lines.append(f"    workspace[{start}:{end}].zero_()")
            continue
        if item == _HOST_CALL:
            call, slots = k(), k()
            lines.append(f"    {call}.replay({slots}, bases, holders)")
            continue
        direct, n_args, spec = item
        pointers = {pos: (source, described) for pos, source, described in spec}
        args = []
        for pos in range(n_args):
            pointer = pointers.get(pos)
            if pointer is None:
                args.append(k())
                continue
            address = f"bases[{pointer[0]}] + {k()}"
            args.append(f"RD({address}, *{k()})" if pointer[1] else address)
        if direct:
            fn, g0, g1, g2, between, tail = (k() for _ in range(6))
            lines.append(f"    {fn}({g0}, {g1}, {g2}, stream, *{between}, {''.join(a + ', ' for a in args)}*{tail})")
        else:
            entry, grid = k(), k()
            lines.append(f"    run({entry}, {grid}, stream, [{', '.join(args)}])")
    head = ["def issue(K, bases, stream, workspace, holders):"]
    if count:  # the constants as fast locals (one unpacking; each use is then as cheap as a literal)
        head.append(f"    {', '.join(f'k{i}' for i in range(count))}, = K")
    names = {"RD": ReplayedDescriptor, "run": launcher.run_compiled}
    exec(compile("\n".join(head + lines + ["    return None"]), "<mxattn launch plan>", "exec"), names)  # noqa: S102
    return names["issue"]


#: generated issue functions by plan structure (`_compile_issue`)
_PROGRAMS: dict = {}


def record(body, roots: Sequence[Optional[torch.Tensor]], carve_from: Optional[int] = None):
    """Run body() (returning a flat list of tensors or None) once while recording -> (its outputs, LaunchPlan
    or None, reason). The outputs are body()'s own, computed normally; the plan is None (with the reason)
    when the body did something a replay cannot repeat. Inside a recorded body, plan caches run their bodies
    (nested plans are not replayed, so every launch passes the recorder). carve_from: the outputs from this
    index on that are whole allocations share one allocation in replays (they then live as long as the
    longest-lived of them: for outputs freed together, such as what a forward keeps for its backward)."""
    if recording_active():
        raise RecordingRefused("record() called inside a recorded body")
    recorder = _Recorder(roots)
    launcher = _launcher()
    launcher.set_recording(recorder)
    recording.begin(recorder)
    try:
        with recorder:
            outputs = body()
    finally:
        recording.end()
        launcher.set_recording(None)
    if recorder.refusal is not None:
        return outputs, None, recorder.refusal
    try:
        plan = _build(recorder, outputs, roots, carve_from)
    except RecordingRefused as exc:
        return outputs, None, str(exc)
    return outputs, plan, "recorded"


def _build(rec: _Recorder, outputs, roots, carve_from: Optional[int] = None) -> LaunchPlan:
    """The LaunchPlan of a finished recording and the body's outputs (carve_from: `record`'s)."""
    device = next((r.device for r in roots if r is not None), None)
    if device is None:
        raise RecordingRefused("no root tensor")
    if not rec.launches:
        raise RecordingRefused("the body launched no kernel through triton_launch.launch")
    out_specs, out_allocs = [], {}
    whole = {}
    for t in outputs:
        if t is None:
            out_specs.append(("none", None))
            continue
        kind, j, offset = rec.resolve(t)
        if kind != "alloc":
            raise RecordingRefused("an output is (a view of) a root, not memory the body allocated")
        a = rec.allocations[j]
        if t.numel() == 0 and a.nbytes == 0:  # an empty output (an unused gradient): empty at each replay too
            whole[j] = True
            out_specs.append(("whole", (j, tuple(t.shape), tuple(t.stride()), t.dtype, False)))
            continue
        if j not in whole and j not in out_allocs and _covers_allocation(t, a):
            whole[j] = True
            out_specs.append(("whole", (j, tuple(t.shape), tuple(t.stride()), t.dtype, a.zero)))
        else:
            if j in whole:
                raise RecordingRefused("two outputs share one allocation that one of them spans")
            if offset % t.element_size():
                raise RecordingRefused("an output starts inside an element of its dtype")
            out_allocs[j] = (a.nbytes, a.zero)
            out_specs.append(("view", (j, offset // t.element_size(), tuple(t.shape), tuple(t.stride()), t.dtype)))
    block_bytes = 0
    if carve_from is not None:  # whole outputs from carve_from on: views of one block, at 256-byte boundaries
        for i, (kind, spec) in enumerate(out_specs):
            if i >= carve_from and kind == "whole":
                j, shape, stride, dtype, zero = spec
                out_specs[i] = ("carved", (j, block_bytes, shape, stride, dtype, zero))
                block_bytes += ceil_div(max(rec.allocations[j].nbytes, 1), _ALIGN) * _ALIGN
    out_set = set(whole) | set(out_allocs)
    used = sorted({index for *_, slots, _e in rec.launches for _p, kind, index, *_o in slots if kind == "alloc"})
    scratch = [j for j in used if j not in out_set]
    offsets, ws_bytes = _plan_workspace(rec.allocations, scratch)
    steps = [(a.event, None, (offsets[j], a.nbytes), None, ()) for j, a in enumerate(rec.allocations)
             if a.zero and j in offsets]  # zero fills of scratch, at their allocation's place in the sequence
    # a replay's addresses: the roots', the workspace's, then the output allocations' (`_output_allocations`);
    # each pointer argument becomes (position, index of its source there, byte offset from it)
    out_source = {j: len(roots) + 1 + i for i, j in enumerate(_output_allocations(out_specs))}
    launches = []
    for event, entry, grid, template, slots in sorted(steps + [(e, en, g, t, sl) for en, g, t, sl, e in rec.launches],
                                                      key=lambda step: step[0]):
        new_slots = []
        for pos, kind, index, offset, described in slots:
            if kind == "alloc" and index in out_set:
                new_slots.append((pos, out_source[index], offset, described))
            elif kind == "alloc":
                new_slots.append((pos, len(roots), offsets[index] + offset, described))
            else:
                new_slots.append((pos, index, offset, described))
        launches.append((entry, grid, template, tuple(new_slots)))
    return LaunchPlan(device, launches, out_specs, out_allocs, ws_bytes, block_bytes)


def _nbytes(shape, stride, dtype) -> int:
    """The bytes a tensor of this shape and strides spans (at least one element: `_build`'s block sizes)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    return extent * dtype.itemsize


def _output_allocations(out_specs) -> List[int]:
    """The recorded allocations behind a plan's outputs (`LaunchPlan._outputs`), sorted."""
    return sorted({spec[0] for kind, spec in out_specs if kind != "none"})


__all__ = ["LaunchPlan", "record", "recording_active", "active_recorder", "carving_allowed", "allow_carving",
           "plan_key", "alias_key", "block_views", "RecordingRefused"]
