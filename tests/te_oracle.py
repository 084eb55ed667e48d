"""Transformer Engine's mask and window rules, written from TE's own definitions (never from mxattn's code), for the
tests that check mxattn's masks against them:

* ``te_window``: ``check_set_window_size`` (transformer_engine/pytorch/attention/dot_product_attention/utils.py);
* ``te_bottom_right``: ``DotProductAttention.forward``'s ``bottom_right_diagonal`` resolution;
* ``te_keep``: the ``window_size`` docstring, query i attends keys in ``[i + sk - sq - left, i + sk - sq + right]``
  bottom-right, ``[i - left, i + right]`` top-left (``get_full_mask``), -1 = unbounded.
"""

import torch

TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right")
SIDES = (-1, 0, 1, 16)
#: None and every (left, right) with left, right in SIDES
WINDOWS = [None] + [(left, right) for left in SIDES for right in SIDES]


def te_window(mask_type, window):
    """TE's check_set_window_size -> (the window TE runs, whether it warns), or None where it asserts."""
    causal = "causal" in mask_type
    if window is None:
        return ((-1, 0) if causal else (-1, -1)), False
    left, right = window
    if causal:
        if window == (-1, 0) or (left >= 0 and right == 0):
            return window, False
        if window == (-1, -1) or (left >= 0 and right != 0):
            return (left, 0), True
        return None
    if window == (-1, 0):
        return (-1, -1), True
    if window == (-1, -1) or (left >= 0 and right >= 0):
        return window, False
    return None


def te_bottom_right(mask_type, bottom_right_diagonal):
    """TE's DotProductAttention.forward: whether the diagonal is aligned bottom-right."""
    if mask_type in ("causal", "padding_causal"):
        return False
    if mask_type in ("causal_bottom_right", "padding_causal_bottom_right"):
        return True
    return True if bottom_right_diagonal is None else bottom_right_diagonal


def te_keep(len_q, len_kv, window, bottom_right):
    """bool [len_q, len_kv]: query i attends key j (the window_size docstring's formula)."""
    left, right = window
    i = torch.arange(len_q).unsqueeze(1)
    j = torch.arange(len_kv).unsqueeze(0)
    diag = i + (len_kv - len_q if bottom_right else 0)
    keep = torch.ones(len_q, len_kv, dtype=torch.bool)
    if left != -1:
        keep &= j >= diag - left
    if right != -1:
        keep &= j <= diag + right
    return keep
