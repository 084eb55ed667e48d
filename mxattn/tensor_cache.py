"""A small cache of results computed from the values of tensors (host reads), valid while those tensors are the
same objects with the same contents: what lets a model hand the same mask or the same `cu_seqlens` to every
layer and pay the device-to-host read once."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch


class TensorValueCache:
    """Results keyed on tensors' identities and version counters (an in-place write bumps the version, so a
    changed tensor is a miss) plus a hashable `extra`; the last `size` entries are kept. Tensors without a
    version counter (inference tensors) are never cached. Thread-safe."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(tensors: Sequence[Optional[torch.Tensor]], extra) -> Optional[tuple]:
        try:
            return tuple((id(t), t._version) if t is not None else None for t in tensors) + (extra,)
        except RuntimeError:                       # inference tensors have no version counter
            return None

    def get(self, tensors: Sequence[Optional[torch.Tensor]], extra, build: Callable[[], object]):
        """build() once per (tensors, extra) while the tensors live unchanged; its value afterwards."""
        key = self._key(tensors, extra)
        if key is None:
            return build()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and all((r() if r is not None else None) is t for r, t in zip(hit[0], tensors)):
                self._entries.move_to_end(key)
                return hit[1]
        value = build()
        refs = tuple(weakref.ref(t) if t is not None else None for t in tensors)
        with self._lock:
            self._entries[key] = (refs, value)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value


__all__ = ["TensorValueCache"]
