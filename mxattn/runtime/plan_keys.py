"""Keys of launch-plan caches (`mxattn.runtime.launch_plan.PlanCache`): what a recorded body reads of its roots
besides their contents, and how the roots share storage."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def plan_key(options: tuple, roots: Sequence[Optional[torch.Tensor]], extra=None) -> tuple:
    """A `PlanCache` key: (family, sizes). family: `options` (what the body reads besides the roots, hashable)
    and each root's dtype, device and address mod 16; sizes: each root's shape and strides, how the roots share
    storage (`alias_key`), and `extra` (further integers the body reads, such as the longest sequences)."""
    family, sizes, aliases, seen = list(options), [], [], {}
    for i, r in enumerate(roots):  # each root's key and alias_key in one pass (a backward call has 16 roots)
        if r is None:
            family.append(None)
            sizes.append(None)
            aliases.append(None)
            continue
        ptr = r.data_ptr()
        family.append((r.dtype, r.device, ptr & 15))
        sizes.append((r.shape, r.stride()))
        first = seen.setdefault(r.untyped_storage().data_ptr(), (i, ptr))
        aliases.append(None if first[0] == i else (first[0], ptr - first[1]))
    return tuple(family), (tuple(sizes), tuple(aliases), extra)


def alias_key(roots: Sequence[Optional[torch.Tensor]]) -> tuple:
    """How roots share storage: per root, (index of the first earlier root in its storage, byte distance) or
    None. A plan recorded with q, k, v unbound from one tensor (or one tensor passed twice) must not replay
    for separate tensors, nor the reverse."""
    seen, out = {}, []
    for i, r in enumerate(roots):
        if r is None:
            out.append(None)
            continue
        storage = r.untyped_storage().data_ptr()
        first = seen.setdefault(storage, (i, r.data_ptr()))
        out.append(None if first[0] == i else (first[0], r.data_ptr() - first[1]))
    return tuple(out)


__all__ = ["plan_key", "alias_key"]
