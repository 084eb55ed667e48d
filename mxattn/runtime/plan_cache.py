"""`PlanCache`: launch plans by key, recorded on a key's second call and replayed from its third."""

from __future__ import annotations

from typing import List, Optional

import torch

from .launch_plan import LaunchPlan, record
from .recording import recording_active


class PlanCache:
    """Plans by key, recorded on a key's second call and replayed from its third (a signature seen once, such
    as one decode step's KV length in a single layer, costs no recording). Keys are (family, sizes): a family
    (e.g. one layer's dtypes and options at ever new sequence lengths) whose recordings are rarely replayed
    (fewer than `min_replays` replays per recording after `min_replays` recordings) stops recording, since a
    recording costs a few ordinary calls. Refusals are remembered. Bounded (cleared when full). Reads and
    writes of a dict are atomic in CPython and plans are immutable, so threads share it (the statistics
    may lose a count under contention, nothing else)."""

    _REFUSED = object()
    _SEEN = object()

    def __init__(self, max_entries: int = 256, min_replays: int = 4):
        self._plans: dict = {}
        self._families: dict = {}  # family -> [recordings, replays]
        self.max_entries = max_entries
        self.min_replays = min_replays
        self.last_reason: Optional[str] = None

    def run(self, key, body, roots):
        """body()'s outputs for these roots: replayed when the key has a plan, else body() run (and recorded
        on the key's second call). A key of None runs body() alone."""
        return self.run_with_plan(key, body, roots)[0]

    def run_with_plan(self, key, body, roots, carve_from: Optional[int] = None, packed: bool = False):
        """(`run`'s outputs, the LaunchPlan that made them or whose recording they are, else None, None or the
        block of a packed replay). carve_from: `record`'s for this call; the key must tell carving callers
        apart. packed: a replay of a plan that can (`LaunchPlan.packs_from`) leaves its carved tail in the block
        it returns third (`LaunchPlan.replay`'s packed), the outputs before it first."""
        if key is None or recording_active():
            return body(), None, None
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.max_entries:  # the families' statistics outlive the plans
                self._plans.clear()
                if len(self._families) >= self.max_entries:
                    self._families.clear()
            self._plans[key] = self._SEEN
            return body(), None, None
        if plan is self._REFUSED:
            return body(), None, None
        if plan is self._SEEN:
            stats = self._families.setdefault(key[0], [0, 0])
            if stats[0] >= self.min_replays and stats[1] < self.min_replays * stats[0]:
                return body(), None, None  # a volatile family: recordings would cost more than their replays save
            outputs, plan, self.last_reason = record(body, roots, carve_from)
            self._plans[key] = self._REFUSED if plan is None else plan
            stats[0] += 1
            if plan is not None:
                plan.family_stats = stats
            return outputs, plan, None
        packed = packed and plan.packs_from is not None
        outputs = plan.replay(roots, packed)
        if outputs is None:  # launch hooks installed (Triton's own path), or a host call no longer current
            if plan.stale():
                self._plans[key] = self._SEEN  # (recorded again on the next call)
            return body(), None, None
        plan.family_stats[1] += 1
        return outputs, plan, outputs.pop() if packed else None

    def replay_only(self, key, roots=None, bases: Optional[list] = None, holders=None
                    ) -> Optional[List[Optional[torch.Tensor]]]:
        """The outputs of key's plan replayed for roots, or onto the root addresses `bases` (with `holders`:
        `LaunchPlan.replay`'s), or None when key has no plan or it cannot replay now: the caller then calls
        `run_with_plan`."""
        plan = self._plans.get(key)
        if plan.__class__ is not LaunchPlan or recording_active():
            return None
        outputs = plan.replay(roots, False, bases, holders)
        if outputs is not None:
            plan.family_stats[1] += 1
        return outputs

    def plan(self, key) -> Optional[LaunchPlan]:
        """The plan stored for key (None if none, refused or seen once)."""
        p = self._plans.get(key)
        return p if isinstance(p, LaunchPlan) else None

    def clear(self) -> None:
        self._plans.clear()
        self._families.clear()


__all__ = ["PlanCache"]
