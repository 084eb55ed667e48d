"""The cuDNN mask rule: option normalisation and keep-matrices.

The recipe (quantization, masks, forward, backward, variants) is documented in the docstring of
``ref/mxfp8_ref.py``, the public module; "module docstring" below means that one. Never imports ``mxattn``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch


# --------------------------------------------------------------------------- masks


class _Mask(NamedTuple):
    offset: int
    left: Optional[int]
    right: Optional[int]


def _resolve_mask(causal, diagonal_alignment, window, s_q: int, s_kv: int) -> Optional[_Mask]:
    """Normalise the mask options (see module docstring); None when nothing is masked."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(diagonal_alignment, str) or diagonal_alignment.lower() not in ("top_left", "bottom_right"):
        raise ValueError(f"diagonal_alignment: expected 'top_left' or 'bottom_right', got {diagonal_alignment!r}")
    if not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2:
        raise ValueError(f"window: expected a pair (left_bound, right_bound), got {window!r}")
    left, right = window
    for val, name, low in ((left, "left_bound", 1), (right, "right_bound", 0)):
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"window {name}: expected an int or None, got {type(val).__name__}")
        if val < low:
            raise ValueError(f"window {name}: expected >= {low}, got {val}")
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True means right_bound 0; got window right_bound {right}")
        right = 0
    if left is None and right is None:
        return None
    offset = s_kv - s_q if diagonal_alignment.lower() == "bottom_right" else 0
    return _Mask(offset, left, right)


def _keep(mask: Optional[_Mask], r0: int, r1: int, c0: int, c1: int,
          device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """Bool [r1-r0, c1-c0] on ``device``: True where query row i keeps key column j; None when no mask."""
    if mask is None:
        return None
    rel = torch.arange(c0, c1, device=device).view(1, -1) - torch.arange(r0, r1, device=device).view(-1, 1)
    keep = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
    if mask.right is not None:
        keep &= rel <= mask.offset + mask.right
    if mask.left is not None:
        keep &= rel > mask.offset - mask.left
    return keep


def keep_mask(s_q: int, s_kv: int, *, causal: bool = False, diagonal_alignment: str = "top_left",
              window=(None, None)) -> torch.Tensor:
    """Dense bool [s_q, s_kv] keep-matrix of the cuDNN mask rule (True = attended)."""
    m = _resolve_mask(causal, diagonal_alignment, window, s_q, s_kv)
    keep = _keep(m, 0, s_q, 0, s_kv)
    return torch.ones(s_q, s_kv, dtype=torch.bool) if keep is None else keep
