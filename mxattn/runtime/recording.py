"""Per-thread state of launch-plan recordings: whether `launch_plan.record` runs a body on this thread, its
recorder (which host calls report to), and whether replays may carve outputs from one allocation."""

from __future__ import annotations

import contextlib
import threading

#: per-thread: whether a recording is under way (a plan cache called inside a recorded body runs the body itself:
#: a replay there would launch past the recorder, which would then miss those launches)
_STATE = threading.local()


def recording_active() -> bool:
    """True while `record` runs a body on this thread."""
    return getattr(_STATE, "active", False)


def begin(recorder) -> None:
    """Mark a recording by `recorder` as under way on this thread."""
    _STATE.active, _STATE.recorder = True, recorder


def end() -> None:
    """Mark this thread's recording as finished."""
    _STATE.active, _STATE.recorder = False, None


def active_recorder():
    """The recorder of the `record` running on this thread (its on_host_call takes host calls), or None."""
    return getattr(_STATE, "recorder", None)


def carving_allowed() -> bool:
    """True inside `allow_carving` on this thread: whoever runs the body keeps its outputs itself, so plans
    replayed within it may carve the outputs they make from one allocation (`record`'s carve_from)."""
    return getattr(_STATE, "carve", False)


@contextlib.contextmanager
def allow_carving():
    """Run a body (not itself replayed) whose outputs its caller keeps itself, such as the eager autograd path's
    forward, whose saved copies are freed together: `carving_allowed()` is True within."""
    before = carving_allowed()
    _STATE.carve = True
    try:
        yield
    finally:
        _STATE.carve = before


__all__ = ["active_recorder", "allow_carving", "begin", "carving_allowed", "end", "recording_active"]
