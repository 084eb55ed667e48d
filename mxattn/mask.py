"""Attention masks in one canonical form (cuDNN's diagonal band), and the one place that reads TE's mask words.

A mask is a diagonal band. With ``offset = 0`` for ``diagonal_alignment="top_left"`` and
``offset = s_kv - s_q`` for ``"bottom_right"`` (per sequence, with that sequence's own lengths), query row ``i``
may attend key column ``j`` iff::

    (right_bound is None or j <= i + offset + right_bound) and
    (left_bound  is None or j >  i + offset - left_bound)

Causal is not a separate switch: it *is* the band with ``right_bound = 0`` (``MaskSpec(causal=True)`` builds
exactly that), so a backend reads ``left_bound``, ``right_bound`` and ``diagonal_alignment`` and nothing else.
This is the meaning of cuDNN's ``diagonal_band_left_bound`` / ``diagonal_band_right_bound`` /
``diagonal_alignment``. Padding (per-sequence lengths) is not part of the band: it travels as
`mxattn.seqinfo.SeqInfo`.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Tuple

import torch

from .compile_marks import constant_result

ALIGNMENTS = ("top_left", "bottom_right")
#: Transformer Engine's mask words: (causal, bottom-right alignment, needs sequence lengths)
_TE_MASK_TYPES = {
    "no_mask": (False, False, False),
    "causal": (True, False, False),
    "causal_bottom_right": (True, True, False),
    "padding": (False, False, True),
    "padding_causal": (True, False, True),
    "padding_causal_bottom_right": (True, True, True),
}
MASK_TYPES = tuple(_TE_MASK_TYPES)


class MaskSpec:
    """A band mask in canonical form: (diagonal_alignment, left_bound, right_bound); see the module docstring.

    ``causal=True`` is shorthand for ``right_bound=0``; two specs with the same band compare equal and hash
    alike however they were written.
    """

    __slots__ = ("diagonal_alignment", "left_bound", "right_bound")

    def __init__(self, causal: bool = False, diagonal_alignment: str = "top_left",
                 left_bound: Optional[int] = None, right_bound: Optional[int] = None):
        if diagonal_alignment not in ALIGNMENTS:
            raise ValueError(f"diagonal_alignment must be one of {ALIGNMENTS}, got {diagonal_alignment!r}")
        for name, val, low in (("left_bound", left_bound, 1), ("right_bound", right_bound, 0)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)):
                raise TypeError(f"{name} must be None or an int, got {type(val).__name__}")
            if val is not None and val < low:
                raise ValueError(f"{name} must be None or >= {low} (cuDNN meaning), got {val}")
        if causal and right_bound not in (None, 0):
            raise ValueError(f"a causal mask has right_bound 0, got right_bound={right_bound}")
        object.__setattr__(self, "diagonal_alignment", diagonal_alignment)
        object.__setattr__(self, "left_bound", left_bound)
        object.__setattr__(self, "right_bound", 0 if causal else right_bound)

    def __setattr__(self, name, value):
        raise AttributeError("MaskSpec is immutable")

    def _key(self):
        return (self.diagonal_alignment, self.left_bound, self.right_bound)

    def __eq__(self, other):
        return isinstance(other, MaskSpec) and self._key() == other._key()

    def __hash__(self):
        return hash(("MaskSpec",) + self._key())

    def __repr__(self):
        return (f"MaskSpec(diagonal_alignment={self.diagonal_alignment!r}, left_bound={self.left_bound}, "
                f"right_bound={self.right_bound})")

    def __reduce__(self):
        return (MaskSpec, (False, self.diagonal_alignment, self.left_bound, self.right_bound))

    @property
    def causal(self) -> bool:
        """True when no key right of the diagonal is kept (right_bound == 0)."""
        return self.right_bound == 0

    @property
    def bottom_right(self) -> bool:
        return self.diagonal_alignment == "bottom_right"

    @property
    def is_unmasked(self) -> bool:
        """True when every (i, j) is kept for every sequence length."""
        return self.left_bound is None and self.right_bound is None

    def offset(self, s_q: int, s_kv: int) -> int:
        """Column of the diagonal for query row 0."""
        return 0 if self.diagonal_alignment == "top_left" else s_kv - s_q

    def keep(self, s_q: int, s_kv: int, device=None) -> torch.Tensor:
        """Boolean [s_q, s_kv] matrix, True where attention is allowed (for tests and small references)."""
        i = torch.arange(s_q, device=device).unsqueeze(1) + self.offset(s_q, s_kv)
        j = torch.arange(s_kv, device=device).unsqueeze(0)
        keep = torch.ones(s_q, s_kv, dtype=torch.bool, device=device)
        if self.right_bound is not None:
            keep &= j <= i + self.right_bound
        if self.left_bound is not None:
            keep &= j > i - self.left_bound
        return keep


class ResolvedMask(NamedTuple):
    """TE's (attn_mask_type, window_size, bottom_right_diagonal) resolved: the band, and whether the mask type
    needs lengths."""

    band: MaskSpec
    padding: bool


def _check_window(window_size) -> Optional[Tuple[int, int]]:
    """window_size as a (left, right) tuple of ints (None entries read as -1), or None; ValueError otherwise."""
    if window_size is None:
        return None
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all((isinstance(w, int) and not isinstance(w, bool)) or w is None for w in window_size)):
        raise ValueError(f"window_size must be a (left, right) pair of ints (-1 = unbounded), got {window_size!r}")
    window = tuple(-1 if w is None else int(w) for w in window_size)
    if min(window) < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    return window


#: the (attn_mask_type, window_size) pairs already warned about: TE's warning comes once per combination
_WARNED_WINDOWS: set = set()


def _te_windows(causal: bool) -> str:
    """The windows Transformer Engine takes for a causal or a non-causal mask type, as the messages write them."""
    return "(-1, 0) or (>=0, 0)" if causal else "(-1, -1) or (>=0, >=0)"


@constant_result  # (called at trace time under torch.compile: Dynamo cannot trace warnings.warn)
def _warn_window(attn_mask_type: str, window: Tuple[int, int], used: Tuple[int, int]) -> None:
    if (attn_mask_type, window) in _WARNED_WINDOWS:
        return None
    _WARNED_WINDOWS.add((attn_mask_type, window))
    warnings.warn(f"window_size should be {_te_windows('causal' in attn_mask_type)} for attn_mask_type={attn_mask_type!r}; got {window!r}, "
                  f"which runs as {used!r} (Transformer Engine's rule)", UserWarning, stacklevel=6)
    return None


def te_window(attn_mask_type: str, window_size=None) -> Tuple[int, int]:
    """The (left, right) window Transformer Engine runs for this mask type (its ``check_set_window_size``).

    Causal types take (-1, 0) or (>=0, 0): None gives (-1, 0); (-1, -1) and (>=0, right != 0) warn and run
    with right = 0; (-1, right > 0) raises. ``no_mask`` and ``padding`` take (-1, -1) or (>=0, >=0): None
    gives (-1, -1); (-1, 0) warns and runs as (-1, -1); one bound -1 and the other not raises. Each warning
    comes once per (mask type, window). Entries below -1 raise (ValueError naming window_size)."""
    if attn_mask_type not in _TE_MASK_TYPES:
        raise ValueError(f"attn_mask_type must be one of {MASK_TYPES}, got {attn_mask_type!r}")
    window = _check_window(window_size)
    causal = _TE_MASK_TYPES[attn_mask_type][0]
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    left, right = window
    if causal:
        if window == (-1, 0) or (left >= 0 and right == 0):
            return window
        if window == (-1, -1) or left >= 0:
            _warn_window(attn_mask_type, window, (left, 0))
            return (left, 0)
    else:
        if window == (-1, 0):
            _warn_window(attn_mask_type, window, (-1, -1))
            return (-1, -1)
        if window == (-1, -1) or (left >= 0 and right >= 0):
            return window
    raise ValueError(f"window_size={window!r} is not a window for attn_mask_type={attn_mask_type!r}: it takes "
                     f"{_te_windows(causal)} (Transformer Engine's rule; -1 = unbounded)")


def resolve_mask(attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None,
                 bottom_right_diagonal: Optional[bool] = None, *, equal_lengths: bool = False) -> ResolvedMask:
    """Translate Transformer Engine's ``attn_mask_type``, ``window_size=(left, right)`` and
    ``bottom_right_diagonal``.

    The window is TE's (`te_window`: its warnings and errors). Query row ``i`` keeps keys ``j`` in
    ``[i + o - left, i + o + right]`` (-1 = unbounded), which is cuDNN's ``left_bound = left + 1``,
    ``right_bound = right``, where the diagonal offset ``o`` is ``s_kv - s_q`` (each sequence's own lengths)
    when the diagonal is aligned bottom-right, 0 when top-left. The alignment is TE's: top-left for ``causal``
    and ``padding_causal``, bottom-right for the ``*_bottom_right`` types (whatever bottom_right_diagonal says),
    and bottom_right_diagonal for ``no_mask`` and ``padding`` (None: bottom-right). ``padding*`` types say that
    per-sequence lengths (``cu_seqlens_*``) must be given.

    equal_lengths: every sequence has as many queries as keys, so both alignments give the same band; a
    ``no_mask``/``padding`` window is then sent top-left (the band cuDNN accepts in more shapes). A band
    without bounds is always top-left (its alignment means nothing).
    """
    if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
        raise TypeError(f"bottom_right_diagonal must be None, True or False, got {bottom_right_diagonal!r}")
    left, right = te_window(attn_mask_type, window_size)
    causal, bottom_right, padding = _TE_MASK_TYPES[attn_mask_type]
    if not bottom_right and not causal:
        bottom_right = bottom_right_diagonal is not False and not equal_lengths
    band = MaskSpec(diagonal_alignment="top_left", left_bound=None if left == -1 else left + 1,
                    right_bound=None if right == -1 else right)
    if bottom_right and not band.is_unmasked:
        band = MaskSpec(diagonal_alignment="bottom_right", left_bound=band.left_bound, right_bound=band.right_bound)
    return ResolvedMask(band, padding)


def mask_from_te(attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None,
                 bottom_right_diagonal: Optional[bool] = None) -> MaskSpec:
    """The band of `resolve_mask` (the padding flag dropped)."""
    return resolve_mask(attn_mask_type, window_size, bottom_right_diagonal).band
