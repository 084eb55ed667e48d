"""Attention masks in the cuDNN frontend's terms, and the mapping from Transformer Engine's arguments.

A mask is a diagonal band. With ``offset = 0`` for ``diagonal_alignment="top_left"`` and
``offset = s_kv - s_q`` for ``"bottom_right"``, query row ``i`` may attend key column ``j`` iff::

    (right_bound is None or j <= i + offset + right_bound) and
    (left_bound  is None or j >  i + offset - left_bound)

``causal=True`` is the band with ``right_bound = 0``. This is the meaning of cuDNN's
``diagonal_band_left_bound`` / ``diagonal_band_right_bound`` / ``diagonal_alignment``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

ALIGNMENTS = ("top_left", "bottom_right")
MASK_TYPES = ("no_mask", "causal", "causal_bottom_right")


@dataclass(frozen=True)
class MaskSpec:
    """A causal / sliding-window band mask (cuDNN meaning, see module docstring)."""

    causal: bool = False
    diagonal_alignment: str = "top_left"
    left_bound: Optional[int] = None
    right_bound: Optional[int] = None

    def __post_init__(self):
        if self.diagonal_alignment not in ALIGNMENTS:
            raise ValueError(f"diagonal_alignment must be one of {ALIGNMENTS}, got {self.diagonal_alignment!r}")
        if self.left_bound is not None and self.left_bound < 1:
            raise ValueError(f"left_bound must be None or >= 1 (cuDNN meaning), got {self.left_bound}")
        if self.right_bound is not None and self.right_bound < 0:
            raise ValueError(f"right_bound must be None or >= 0, got {self.right_bound}")
        if self.causal and self.right_bound not in (None, 0):
            raise ValueError(f"a causal mask has right_bound 0, got right_bound={self.right_bound}")

    @property
    def effective_right_bound(self) -> Optional[int]:
        """The right bound with ``causal`` folded in (0 for causal, else ``right_bound``)."""
        return 0 if self.causal else self.right_bound

    @property
    def is_unmasked(self) -> bool:
        """True when every (i, j) is kept for every sequence length."""
        return self.left_bound is None and self.effective_right_bound is None

    def offset(self, s_q: int, s_kv: int) -> int:
        """Column of the diagonal for query row 0."""
        return 0 if self.diagonal_alignment == "top_left" else s_kv - s_q

    def keep(self, s_q: int, s_kv: int, device=None) -> torch.Tensor:
        """Boolean [s_q, s_kv] matrix, True where attention is allowed (for tests and small references)."""
        i = torch.arange(s_q, device=device).unsqueeze(1) + self.offset(s_q, s_kv)
        j = torch.arange(s_kv, device=device).unsqueeze(0)
        keep = torch.ones(s_q, s_kv, dtype=torch.bool, device=device)
        right = self.effective_right_bound
        if right is not None:
            keep &= j <= i + right
        if self.left_bound is not None:
            keep &= j > i - self.left_bound
        return keep


def mask_from_te(attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None) -> MaskSpec:
    """Translate Transformer Engine's ``attn_mask_type`` and ``window_size=(left, right)`` to a MaskSpec.

    TE's window keeps keys ``j`` in ``[i + o - left, i + o + right]`` (``-1`` or ``None`` = unbounded), which
    is cuDNN's ``left_bound = left + 1``, ``right_bound = right``. The diagonal offset ``o`` follows the mask
    type: bottom-right alignment for ``"causal_bottom_right"``, top-left otherwise.
    """
    if attn_mask_type not in MASK_TYPES:
        raise ValueError(f"attn_mask_type must be one of {MASK_TYPES}, got {attn_mask_type!r}")
    causal = attn_mask_type != "no_mask"
    alignment = "bottom_right" if attn_mask_type == "causal_bottom_right" else "top_left"
    left = right = None
    if window_size is not None:
        if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
                and all(isinstance(w, int) or w is None for w in window_size)):
            raise ValueError(f"window_size must be a (left, right) pair of ints (-1 = unbounded), got {window_size!r}")
        w_left, w_right = (-1 if w is None else w for w in window_size)
        if w_left < -1 or w_right < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
        left = None if w_left == -1 else w_left + 1
        right = None if w_right == -1 else w_right
        if causal and right not in (None, 0):
            raise ValueError(
                f"window_size={tuple(window_size)!r}: a causal attn_mask_type allows no keys to the right of the "
                "diagonal; use window_size=(left, 0) or (left, -1)")
    return MaskSpec(causal=causal, diagonal_alignment=alignment, left_bound=left,
                    right_bound=None if causal else right)
