"""Backend registry and the one `auto` choice, for every entry point: the first of cudnn (Blackwell), triton (other
CUDA GPUs), reference that supports the whole call (`AttentionBackend.supports` for attention over q, k, v,
already quantized or not; `AttentionBackend.supports_cache` for attention over the MXFP8 KV cache), warning once
when it is not cudnn."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
import warnings
from typing import Dict, Tuple, Type

import torch

from ..compile_marks import constant_result
from ..errors import MXFP8NotSupportedError
from .base import AttentionBackend, AttentionParams, CacheCall, Problem, SavedForBackward

BACKEND_NAMES = ("cudnn", "triton", "reference")
_MODULES = {
    "cudnn": ("mxattn.backends.cudnn.backend", "CudnnBackend"),
    "triton": ("mxattn.backends.triton_backend", "TritonBackend"),
    "reference": ("mxattn.backends.reference", "ReferenceBackend"),
}
_INSTANCES: Dict[str, AttentionBackend] = {}
_WARNED = set()
_LOCK = threading.Lock()


def check_backend_name(name, concrete: bool = False) -> None:
    """ValueError naming `backend` unless name is one of BACKEND_NAMES, or "auto" where concrete is False."""
    allowed = BACKEND_NAMES if concrete else ("auto",) + BACKEND_NAMES
    if name not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {name!r}")


def backend_class(name: str) -> Type[AttentionBackend]:
    """The class of backend `name`; raises MXFP8NotSupportedError if its module cannot be imported."""
    check_backend_name(name, concrete=True)
    module_name, class_name = _MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # triton or the cudnn frontend missing
        raise MXFP8NotSupportedError(f"backend {name!r} cannot be imported here: {exc}") from exc
    return getattr(module, class_name)


def availability(name: str, device: torch.device) -> Tuple[bool, str]:
    """(usable, reason) for backend `name` on `device`; never raises."""
    try:
        return backend_class(name).availability(torch.device(device))
    except MXFP8NotSupportedError as exc:
        return False, str(exc)


def _instance(name: str) -> AttentionBackend:
    with _LOCK:
        if name not in _INSTANCES:
            _INSTANCES[name] = backend_class(name)()
        return _INSTANCES[name]


def supports(name: str, problem: Problem) -> Tuple[bool, str]:
    """(can run, reason) for backend `name` on the whole call `problem`; never raises."""
    try:
        return backend_class(name).supports(problem)
    except MXFP8NotSupportedError as exc:
        return False, str(exc)


def _warn_once(device: torch.device, chosen: str, reasons, stacklevel: int) -> None:
    key = (device.type, chosen, tuple(r.split(":")[0] for r in reasons))
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"mxattn: backend='auto' chose {chosen!r} on {device} ({'; '.join(reasons)})",
                      RuntimeWarning, stacklevel=stacklevel)


def _first_supporting(name: str, device: torch.device, ask, stacklevel: int = 6) -> str:
    """`name` after ask(name) -> (ok, reason) said yes (MXFP8NotSupportedError with the reason otherwise), or for
    "auto" the first of BACKEND_NAMES that ask accepts, warning once per (device type, choice, reasons) when it
    is not cudnn (stacklevel: the warning's, pointing at the user's call)."""
    if name != "auto":
        check_backend_name(name)
        ok, reason = ask(name)
        if not ok:
            raise MXFP8NotSupportedError(f"backend {name!r} cannot run this call on {device}: {reason}")
        return name
    reasons = []
    for candidate in BACKEND_NAMES:
        ok, reason = ask(candidate)
        if ok:
            if candidate != "cudnn":
                _warn_once(device, candidate, reasons, stacklevel)
            return candidate
        reasons.append(f"{candidate}: {reason}")
    raise MXFP8NotSupportedError("no backend can run this call: " + "; ".join(reasons))


def choose_backend(name: str, problem: Problem) -> str:
    """`pick_backend` for a Problem; a constant under torch.compile (the choice runs once at trace time). Under
    torch.compile the batch size and sequence lengths may be symbolic (dynamic shapes), so the choice is made
    without them there: a size-dependent refusal (cuDNN's, for a few band masks) then raises at the call instead
    of falling back. Head counts and head dim must be static (they are unless one compiled function sees
    several). Every other field of the Problem (softmax type included) reaches the choice."""
    if not torch.compiler.is_compiling():
        return pick_backend(name, problem)
    return _choose_constant(name, problem.encode(without_sizes=True))


@constant_result
def _choose_constant(name: str, problem_key: tuple) -> str:
    return pick_backend(name, Problem.decode(problem_key))


@functools.lru_cache(maxsize=1024)
def pick_backend(name: str, problem: Problem) -> str:
    """The concrete backend that runs `problem`: `name` itself after checking it supports the call
    (MXFP8NotSupportedError with the reason otherwise), or for "auto" the first of BACKEND_NAMES that does,
    warning once per (device type, choice, reasons) when it is not cudnn. A constant under torch.compile: the
    choice runs once at trace time, with no graph break. Answers are cached per (name, problem): the support
    checks read library versions and package metadata (about a millisecond), which must not be paid per call;
    refusals raise every time (exceptions are not cached). A backend that takes V only as wide as Q and K runs a
    narrower V zero-padded (`v_padding`, which every caller of a choice applies), so it is chosen for it too."""
    return _first_supporting(name, problem.device, lambda candidate: (
        (True, "") if v_padding(candidate, problem) else supports(candidate, problem)))


def v_padding(name: str, problem: Problem) -> int:
    """How many zero channels backend `name` needs appended to V (and dO) to run `problem`: head_dim - head_dim_v
    when V is narrower than Q and K (MLA) and the backend refuses that pair of head dims but runs the call with
    V as wide as Q, else 0. Zero channels change none of V's block scales (MXFP8 blocks along D hold V's own
    channels and zeros; blocks along S are per channel), so O's first head_dim_v channels and dV's are those of
    a backend that takes the pair. A constant under torch.compile."""
    if problem.quantized or problem.head_dim_v >= problem.head_dim:
        return 0
    if not torch.compiler.is_compiling():
        return _v_padding(name, problem)
    return _v_padding_constant(name, problem.encode(without_sizes=True))


@constant_result
def _v_padding_constant(name: str, problem_key: tuple) -> int:
    return _v_padding(name, Problem.decode(problem_key))


@functools.lru_cache(maxsize=256)
def _v_padding(name: str, problem: Problem) -> int:
    try:
        refuses_the_pair = bool(backend_class(name).v_dim_refusal(problem.head_dim, problem.head_dim_v))
    except MXFP8NotSupportedError:
        return 0
    if refuses_the_pair and supports(name, dataclasses.replace(problem, head_dim_v=problem.head_dim))[0]:
        return problem.head_dim - problem.head_dim_v
    return 0


def clear_choices() -> None:
    """Forget the cached backend choices and V paddings (after a support check changed, as tests make them)."""
    pick_backend.cache_clear()
    _v_padding.cache_clear()


def supports_cache(name: str, call: CacheCall) -> Tuple[bool, str]:
    """(can serve the KV-cache call, reason) for backend `name`; never raises."""
    try:
        return backend_class(name).supports_cache(call)
    except MXFP8NotSupportedError as exc:
        return False, str(exc)


#: cache calls' choices by (name, `CacheCall.facts`) where no verdict read the sizes (decode steps pay no checks)
_CACHE_CHOICES: dict = {}


def pick_cache_backend(name: str, call: CacheCall) -> str:
    """The concrete backend that serves the KV-cache call `call` (`mxattn.mxfp8_attention_with_kvcache`), chosen
    as `pick_backend` chooses for attention over q, k, v."""
    key = (name, call.facts())
    chosen = _CACHE_CHOICES.get(key)
    if chosen is not None:
        return chosen
    chosen = _first_supporting(name, call.q.device, lambda candidate: supports_cache(candidate, call), 7)
    asked = BACKEND_NAMES[:BACKEND_NAMES.index(chosen) + 1] if name == "auto" else (chosen,)
    if not any(_cache_reads_sizes(n, call) for n in asked):
        if len(_CACHE_CHOICES) >= 256:
            _CACHE_CHOICES.clear()
        _CACHE_CHOICES[key] = chosen
    return chosen


def _cache_reads_sizes(name: str, call: CacheCall) -> bool:
    try:
        return backend_class(name).cache_support_reads_sizes(call)
    except MXFP8NotSupportedError:
        return False


def choice_reads_sizes(name: str, chosen: str, problem: Problem) -> bool:
    """Whether `pick_backend(name, problem)`, which chose `chosen`, could choose otherwise (or refuse) for
    another batch size or other sequence lengths: some backend it asked reads them (`support_reads_sizes`).
    For "auto" those are the backends before the chosen one and the chosen one."""
    asked = BACKEND_NAMES[:BACKEND_NAMES.index(chosen) + 1] if name == "auto" else (chosen,)
    return any(_reads_sizes(n, problem) for n in asked)


def _reads_sizes(name: str, problem: Problem) -> bool:
    try:
        return backend_class(name).support_reads_sizes(problem)
    except MXFP8NotSupportedError:  # not importable here (no frontend, no triton): unusable at every size
        return False


def get_backend(name: str) -> AttentionBackend:
    """The shared instance of a concrete backend (no availability check)."""
    return _instance(name)


__all__ = ["AttentionBackend", "AttentionParams", "CacheCall", "Problem", "SavedForBackward", "BACKEND_NAMES",
           "availability", "backend_class", "check_backend_name", "choice_reads_sizes", "clear_choices",
           "choose_backend", "get_backend", "pick_backend", "pick_cache_backend", "supports", "supports_cache",
           "v_padding"]
