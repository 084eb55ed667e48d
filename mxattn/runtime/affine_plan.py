"""Launch plans for calls that differ in one length: decode steps, each at a KV length no call had before.

A `LaunchPlan` (`launch_plan`) replays one signature, so generation, whose every step attends one more key,
never replays: each step's calls pay the whole host path. Where a body's host path depends on a free length
n only through integers that are affine in n (sizes, strides, diagonal offsets, grids and output sizes; no
tile choice or branch that changes with n), one plan serves every n: `AffinePlan` records the body at three
different lengths, fits every integer of the recording (launch arguments, grids, pointer offsets, output
shapes and strides, allocation sizes) and every integer of the roots' description (shapes, strides, how they
share storage) as ``a + b * n``, and trusts the fit once the third recording equals the prediction from the
first two. A replay at a new n then computes the integers, checks that the roots are exactly the predicted
ones (shapes, strides, aliasing: otherwise the call runs its body) and launches the compiled kernels that
Triton would pick for those integers (its specialization classes: == 1, multiple of 16, 32/64 bits). A length
whose classes no recording has seen is recorded once more, and the recording must again equal the prediction.
Anything that disagrees (another structure, a non-integer slope, a wrong prediction, a refused recording)
retires the plan: its calls run their bodies from then on.

Callers use it only for bodies whose dependence on n they know to be affine (the triton backend's one-launch
forward without a backward); the verification by three recordings guards the rest.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .launch_plan import LaunchPlan, _launcher, alias_key, record, recording_active

#: marks an integer's place in a structure split by `_split`
_INT = object()
#: recordings at distinct lengths before a fit is trusted (two to fit, one to check)
TRUST_AFTER = 3


def _split(obj, ints: list):
    """obj with every int (not bool) replaced by _INT and appended to ints; tuples and lists become
    (type, items) pairs, anything else stays (floats, bools, dtypes, strings, None)."""
    cls = obj.__class__
    if cls is int:
        ints.append(obj)
        return _INT
    if cls is tuple or cls is list:
        return cls, tuple([_split(x, ints) for x in obj])
    return obj


def _join(skeleton, values):
    """`_split` inverted: skeleton with its _INT places filled from the iterator values."""
    if skeleton is _INT:
        return next(values)
    if skeleton.__class__ is tuple:
        cls, items = skeleton
        out = [next(values) if x is _INT else _join(x, values) if x.__class__ is tuple else x for x in items]
        return out if cls is list else tuple(out)
    return skeleton


def root_facts(roots: Sequence[Optional[torch.Tensor]], aliases: tuple) -> tuple:
    """The integers a body may read off its roots besides their contents: every shape and stride, and the
    byte distance of each root to the earlier root whose storage it shares (`alias_key`)."""
    out: list = []
    for r in roots:
        if r is not None:
            out += r.shape
            out += r.stride()
    for a in aliases:
        if a is not None:
            out.append(a[1])
    return tuple(out)


def layout_free_of(r: torch.Tensor, axis: int, n: int) -> tuple:
    """What an affine plan's key holds of a root whose `axis` has the free length n: dtype, device, address mod
    16, the shape without that axis, and the strides with each multiple of n written as ("n", multiple) (a
    cache re-made at every length has strides that grow with n; views of a preallocated buffer keep theirs):
    roots that differ only in n share it; the plan checks every integer itself."""
    return (r.dtype, r.device, r.data_ptr() & 15, (*r.shape[:axis], *r.shape[axis + 1:]),
            tuple([("n", st // n) if st % n == 0 else st for st in r.stride()]))


def roots_key(roots: Sequence[Optional[torch.Tensor]], axis: int, n: int) -> list:
    """What an affine plan's key holds of roots (q, k, v, then any others; None where absent): K's and V's
    (roots 1 and 2, whose `axis` has the free length n) as `layout_free_of`, every other root as its dtype,
    device, address mod 16, shape and strides."""
    return [None if r is None else layout_free_of(r, axis, n) if i in (1, 2) else
            (r.dtype, r.device, r.data_ptr() & 15, r.shape, r.stride()) for i, r in enumerate(roots)]


def describe_roots(roots: Sequence[Optional[torch.Tensor]], axis: int, n: int) -> Tuple[list, tuple, tuple]:
    """(`roots_key(roots, axis, n)`, each root's entry of `alias_key(roots)` reduced to the earlier root's
    index, `root_facts(roots, alias_key(roots))`) in one pass over the roots (a decode step's host path)."""
    keys, firsts, facts, distances, seen = [], [], [], [], {}
    free = None  # K's (shape, strides, their `layout_free_of` parts): V's are usually the same
    for i, r in enumerate(roots):
        if r is None:
            keys.append(None)
            firsts.append(None)
            continue
        shape, stride, ptr = r.shape, r.stride(), r.data_ptr()
        facts += shape
        facts += stride
        if i == 1 or i == 2:
            if free is None or free[0] != shape or free[1] != stride:
                free = (shape, stride, (*shape[:axis], *shape[axis + 1:]),
                        tuple([("n", st // n) if st % n == 0 else st for st in stride]))
            keys.append((r.dtype, r.device, ptr & 15, free[2], free[3]))
        else:
            keys.append((r.dtype, r.device, ptr & 15, shape, stride))
        first = seen.setdefault(r.untyped_storage().data_ptr(), (i, ptr))
        if first[0] == i:
            firsts.append(None)
        else:
            firsts.append(first[0])
            distances.append(ptr - first[1])
    facts += distances
    return keys, tuple(firsts), tuple(facts)


class _Recording:
    """One recording's integers (the roots' facts first, then each part's), structure and compiled kernels. The
    parts: each launch's grid, template and pointer slots, then the outputs, the output allocations and the
    workspace size (a replay rebuilds only the parts whose integers change with n)."""

    __slots__ = ("n", "ints", "skeleton", "spans", "entries")

    def __init__(self, n: int, facts: tuple, plan: LaunchPlan):
        self.n = n
        ints = list(facts)
        parts = [part for _entry, *launch in plan._launches for part in launch]
        parts += [plan._outputs, sorted(plan._out_allocs.items()), plan._workspace_bytes]
        skeletons, spans = [], []
        for part in parts:
            start = len(ints)
            skeletons.append(_split(part, ints))
            spans.append((start, len(ints)))
        self.skeleton = (len(facts), plan.device, len(plan._launches), tuple(skeletons))
        self.spans = spans
        self.ints = ints
        self.entries = [entry for entry, *_ in plan._launches]


class AffinePlan:
    """Recordings of one body at several lengths and, once trusted, their affine fit (module docstring)."""

    def __init__(self):
        self.recordings: List[_Recording] = []
        self.retired: Optional[str] = None
        self.trusted = False
        self._a: list = []
        self._b: list = []
        self._fixed: list = []     # per part: the part itself when none of its ints changes with n, else None
        self._varying: list = []   # per launch: indices of its template ints that change with n
        self._entries: list = []   # per launch: {classes of the varying ints: compiled kernel}
        self._last = None          # (n, LaunchPlan or None, predicted facts): the layers of one step share it

    @property
    def state(self) -> str:
        if self.retired is not None:
            return "retired: " + self.retired
        return "trusted" if self.trusted else f"observing ({len(self.recordings)} of {TRUST_AFTER} lengths)"

    # ---------------------------------------------------------------- replay

    def replay(self, n: int, facts: tuple, roots) -> Optional[list]:
        """The body's outputs at length n, or None when this plan cannot give them (not trusted, retired, the
        roots are not the predicted ones, or no recording compiled the kernels n's integers need)."""
        if not self.trusted:
            return None
        last = self._last
        if last is None or last[0] != n:
            last = self._last = (n, *self._instantiate(n))
        plan, predicted = last[1], last[2]
        if plan is None or facts != predicted:
            return None
        return plan.replay(roots)

    def _instantiate(self, n: int):
        """(LaunchPlan at n or None when no recording compiled its kernels, the roots' predicted facts)."""
        a, b = self._a, self._b
        n_facts, device, n_launches, skeletons = self.recordings[0].skeleton
        predicted = tuple([a[j] + b[j] * n for j in range(n_facts)])
        classify = _launcher()._int_class
        entries = []
        for varying, known, first in zip(self._varying, self._entries, self.recordings[0].entries):
            if first is None:       # a zero fill of scratch, no kernel
                entries.append(None)
                continue
            entry = known.get(tuple([classify(a[j] + b[j] * n) for j in varying]))
            if entry is None:
                return None, predicted
            entries.append(entry)
        parts = [fixed if fixed is not None else
                 _join(skeleton, iter([a[j] + b[j] * n for j in range(start, end)]))
                 for fixed, skeleton, (start, end) in zip(self._fixed, skeletons, self.recordings[0].spans)]
        launches = [(entries[i], *parts[3 * i:3 * i + 3]) for i in range(n_launches)]
        outputs, out_allocs, workspace = parts[3 * n_launches:]
        return LaunchPlan(device, launches, outputs, dict(out_allocs), workspace), predicted

    # ---------------------------------------------------------------- recording

    def wants(self, n: int, facts: tuple) -> bool:
        """Whether a call at n should be recorded: while observing, at a length not yet recorded; once
        trusted, when its roots are the predicted ones but its kernels were not compiled for n's classes."""
        if self.retired is not None:
            return False
        if not self.trusted:
            return all(r.n != n for r in self.recordings)
        last = self._last
        return last is not None and last[0] == n and last[1] is None and last[2] == facts

    def observe(self, n: int, facts: tuple, plan: Optional[LaunchPlan], reason: str) -> None:
        """Add the recording of a call at n (plan None: the recording was refused, for `reason`)."""
        if plan is None:
            self._retire(f"a recording was refused ({reason})")
            return
        rec = _Recording(n, facts, plan)
        if self.recordings and rec.skeleton != self.recordings[0].skeleton:
            self._retire("the recorded structure changed with the length")
            return
        if self._a and [a + b * n for a, b in zip(self._a, self._b)] != rec.ints:
            self._retire(f"the recording at length {n} differs from the affine prediction")
            return
        self.recordings.append(rec)
        if len(self.recordings) == 2:
            self._fit()
        if self.retired is None and len(self.recordings) >= TRUST_AFTER:
            self.trusted = True
        if self._a:
            self._add_entries(rec)
            if len(self.recordings) == 2:
                self._add_entries(self.recordings[0])
        self._last = None  # the next replay instantiates with what this recording added

    def _fit(self) -> None:
        r1, r2 = self.recordings
        dn = r2.n - r1.n
        a, b = [], []
        for v1, v2 in zip(r1.ints, r2.ints):
            if (v2 - v1) % dn:
                self._retire("an integer of the recordings is not affine in the length with an integer slope")
                return
            slope = (v2 - v1) // dn
            a.append(v1 - slope * r1.n)
            b.append(slope)
        self._a, self._b = a, b
        skeletons = r1.skeleton[3]
        # parts whose integers do not change with n are built once
        self._fixed = [None if any(b[start:end]) else _join(skeleton, iter(r1.ints[start:end]))
                       for skeleton, (start, end) in zip(skeletons, r1.spans)]
        # each launch's template (its second part): the places of its ints that change with n
        self._varying = [[j for j in range(*r1.spans[3 * i + 1]) if b[j]] for i in range(r1.skeleton[2])]
        self._entries = [{} for _ in self._varying]

    def _add_entries(self, rec: _Recording) -> None:
        classify = _launcher()._int_class
        for varying, known, entry in zip(self._varying, self._entries, rec.entries):
            if entry is not None:
                known.setdefault(tuple([classify(rec.ints[j]) for j in varying]), entry)

    def _retire(self, why: str) -> None:
        self.retired = why
        self.trusted = False
        self._last = None


class AffinePlanCache:
    """Affine plans by key (bounded, cleared when full). `run(key, n, body, roots)` replays, records or runs
    body() itself (module docstring); the caller's key holds everything the body reads besides n, the roots'
    addresses and contents, and integers affine in n (which the plan checks itself). Reads and writes of a dict
    are atomic in CPython; a plan's recordings are appended under no lock, so two threads recording one key at
    once may retire it (never replay wrongly)."""

    def __init__(self, max_entries: int = 64):
        self._plans: dict = {}
        self.max_entries = max_entries
        self.last_reason: Optional[str] = None

    def run(self, key, n: int, body, roots: Sequence[Optional[torch.Tensor]], otherwise=None):
        """body()'s outputs (a flat list) for these roots at length n: replayed, or recorded, or else from
        otherwise() (e.g. the signature's own `PlanCache` path, for calls repeated at one length before a
        fit is trusted) or body(). Inside a recorded body (`recording_active`): body() alone."""
        if recording_active():
            return body()
        aliases = alias_key(roots)
        return self._run((key, tuple([None if a is None else a[0] for a in aliases])), root_facts(roots, aliases),
                         n, body, roots, otherwise)

    def run_keyed(self, prefix: tuple, axis: int, n: int, body, roots: Sequence[Optional[torch.Tensor]],
                  otherwise=None):
        """`run((*prefix, *roots_key(roots, axis, n)), n, body, roots, otherwise)`, the roots described in one
        pass (`describe_roots`)."""
        if recording_active():
            return body()
        keys, firsts, facts = describe_roots(roots, axis, n)
        return self._run(((*prefix, *keys), firsts), facts, n, body, roots, otherwise)

    def _run(self, full, facts: tuple, n: int, body, roots, otherwise):
        plan = self._plans.get(full)
        if plan is None:
            if len(self._plans) >= self.max_entries:
                self._plans.clear()
            plan = self._plans[full] = AffinePlan()
        outputs = plan.replay(n, facts, roots)
        if outputs is not None:
            return outputs
        if not plan.wants(n, facts):
            return (otherwise or body)()
        outputs, recorded, reason = record(body, roots)
        plan.observe(n, facts, recorded, reason)
        self.last_reason = plan.state
        return outputs

    def plan(self, key, roots) -> Optional[AffinePlan]:
        """The plan stored for key and these roots' aliasing, if any."""
        aliases = alias_key(roots)
        return self._plans.get((key, tuple([None if a is None else a[0] for a in aliases])))

    def clear(self) -> None:
        self._plans.clear()


__all__ = ["AffinePlan", "AffinePlanCache", "root_facts", "layout_free_of", "roots_key", "describe_roots", "TRUST_AFTER"]
