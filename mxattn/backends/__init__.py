"""Backend registry and the `auto` choice: cudnn (Blackwell) > triton (other CUDA GPUs) > reference."""

from __future__ import annotations

import importlib
import threading
import warnings
from typing import Dict, Tuple, Type

import torch

from ..errors import MXFP8NotSupportedError
from .base import AttentionBackend, AttentionParams, SavedForBackward

BACKEND_NAMES = ("cudnn", "triton", "reference")
_MODULES = {
    "cudnn": ("mxattn.backends.cudnn_backend", "CudnnBackend"),
    "triton": ("mxattn.backends.triton_backend", "TritonBackend"),
    "reference": ("mxattn.backends.reference", "ReferenceBackend"),
}
_INSTANCES: Dict[str, AttentionBackend] = {}
_WARNED = set()
_LOCK = threading.Lock()


def backend_class(name: str) -> Type[AttentionBackend]:
    """The class of backend `name`; raises MXFP8NotSupportedError if its module cannot be imported."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {('auto',) + BACKEND_NAMES}, got {name!r}")
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


def resolve_backend_name(name: str, device: torch.device) -> str:
    """Turn "auto" into a concrete backend name for `device` (warns once per choice); check explicit names.

    Raises MXFP8NotSupportedError with the reason if an explicitly named backend cannot run on `device`.
    """
    device = torch.device(device)
    if name != "auto":
        if name not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {('auto',) + BACKEND_NAMES}, got {name!r}")
        ok, reason = availability(name, device)
        if not ok:
            raise MXFP8NotSupportedError(f"backend {name!r} cannot run on {device}: {reason}")
        return name
    reasons = []
    for candidate in BACKEND_NAMES:
        ok, reason = availability(candidate, device)
        if ok:
            if candidate != "cudnn":
                key = (device.type, candidate)
                if key not in _WARNED:
                    _WARNED.add(key)
                    why = "; ".join(reasons)
                    warnings.warn(f"mxattn: backend='auto' chose {candidate!r} on {device} ({why})",
                                  RuntimeWarning, stacklevel=4)
            return candidate
        reasons.append(f"{candidate}: {reason}")
    raise MXFP8NotSupportedError("no backend can run: " + "; ".join(reasons))


def get_backend(name: str) -> AttentionBackend:
    """The shared instance of a concrete backend (no availability check)."""
    return _instance(name)


__all__ = ["AttentionBackend", "AttentionParams", "SavedForBackward", "BACKEND_NAMES", "availability",
           "backend_class", "get_backend", "resolve_backend_name"]
