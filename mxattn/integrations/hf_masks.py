"""Hugging Face attention masks as mxattn arguments: `plan_attention_mask` (eager) and
`plan_attention_mask_traced` (torch.compile) translate a mask into a `MaskPlan` (TE mask words, `cu_seqlens`,
and the row gathers `RowGather` / `RowCompaction`), or raise `UnsupportedMaskError`. Used by
`mxattn.integrations.transformers`.

Masks. mxattn masks are a diagonal band (causal, sliding window, bottom-right alignment) plus per-sequence key
lengths (right padding), so each HF mask is translated into TE mask words + ``cu_seqlens`` and the translation is
*verified* against HF's mask before anything runs (`plan_attention_mask`):

* ``None``: what torch SDPA would do with it: causal (top-left) for a causal module with more than one query,
  otherwise no mask (one query token of a decode step sees every key);
* a 4-D boolean or additive (0 / large negative) mask: each query row must keep one contiguous range of keys; the
  key lengths are where the kept keys end, the band (causal, left/right window) is read off the rows, top-left
  alignment when q and k have the same length (prefill, encoders), bottom-right when the queries are the last
  tokens of a longer KV cache (decode); a causal module's left cut counts as a window only when it is the
  module's own sliding window (otherwise it is padding, below). The band and lengths are rebuilt per row and
  compared with HF's mask.
  Otherwise the rows are split into sequences (runs of query rows that share keys with the previous row) whose
  keys are what their rows keep, in order: left padding, the decode steps after right-padded prompts (prompt
  plus the tokens after the padding gap), and packed documents (block-diagonal masks of padding-free batches).
  Each sequence's rows are gathered into a packed (thd) call and O scattered back, so a sequence is computed
  exactly as if it were alone. Anything these do not reproduce exactly (image-token overlays, per-head masks,
  ALiBi-like additive biases) raises `UnsupportedMaskError` saying what it found.

Under torch.compile the translation runs on the device (`plan_attention_mask_traced`): one sequence per batch
row, gathered to the front of its row with static shapes (`RowCompaction`) for one padded call, the same bytes
as the eager translation; left padding, decode steps after either padding and static caches trace without
graph breaks, and what needs several sequences in a row (packed documents without the ``cu_seq_lens`` kwargs)
stops at a device-side assert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..mask import resolve_mask

#: additive mask entries at or below this value are read as "masked" (HF uses finfo(dtype).min; old code -10000)
MASKED_AT_OR_BELOW = -1e4

_PADDING_HINT = ("mxattn expresses a mask as sequences (runs of query rows over the keys they keep: left or right "
                 "padding, decode steps, packed documents) with a causal or sliding-window band inside each; run "
                 "this batch with attn_implementation='sdpa' if it needs more")


class UnsupportedMaskError(ValueError):
    """An attention mask that mxattn's band + right-padding masks cannot express exactly."""


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """An HF attention mask as `mxattn.mxfp8_attention` arguments.

    kv_len: use only the first kv_len key/value positions (torch SDPA's cropping of a causal prefill into a larger
    static cache), None = all. cu_seqlens_*: int32 [B+1] (None when no sequence is padded).
    """

    attn_mask_type: str
    window_size: Optional[Tuple[int, int]] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    kv_len: Optional[int] = None
    #: bounds of the lengths (given under torch.compile, where they cannot be read off cu_seqlens)
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    #: a packed call (`RowGather`) when each sequence's keys start at an offset of their own (left padding)
    gather: Optional["RowGather"] = None
    #: the batch is one row of packed sequences already (padding-free training): a thd call on that row
    packed: bool = False
    #: a padded call on each row's sequence gathered to the front of its row (`RowCompaction`; torch.compile)
    rows: Optional["RowCompaction"] = None
    #: the diagonal of a no_mask/padding window as read off the mask (TE's argument; None: TE's default,
    #: bottom-right): HF's masks fix the alignment, so a top-left window says so
    bottom_right_diagonal: Optional[bool] = None

    def kwargs(self) -> dict:
        return dict(attn_mask_type=self.attn_mask_type, window_size=self.window_size,
                    bottom_right_diagonal=self.bottom_right_diagonal, cu_seqlens_q=self.cu_seqlens_q,
                    cu_seqlens_kv=self.cu_seqlens_kv, max_seqlen_q=self.max_seqlen_q,
                    max_seqlen_kv=self.max_seqlen_kv)


@dataclass(frozen=True, eq=False)
class RowGather:
    """Where each sequence's rows sit in the padded batch: q_rows (int64 [T_q]) index the flattened
    [B * q_len] query rows that have a key, kv_rows (int64 [T_kv]) the flattened [B * kv_len] key rows of
    each sequence's range, in sequence order. The call runs packed (thd) on those rows, so every sequence is
    computed as if it were alone (its MXFP8 blocks along S start at its first kept key); the other query rows
    get O = 0 (they keep no key)."""

    q_rows: torch.Tensor
    kv_rows: torch.Tensor


@dataclass(frozen=True, eq=False)
class RowCompaction:
    """One sequence per batch row at the front of its row, in static shapes (the torch.compile form of
    `RowGather`): q_index int64 [B, Sq] is the padded query row read by each compact row (the sequence's rows
    first, in order), q_back int64 [B, Sq] each padded query row's compact row (rows of no sequence land past
    the sequence's end, where the padded call leaves O = 0), kv_index int64 [B, Skv] the padded key row of
    each compact key. The call is one padded (bshd + cu_seqlens) call on the gathered rows, so every sequence
    is computed as if it were alone, its MXFP8 blocks along S starting at its first key."""

    q_index: torch.Tensor
    q_back: torch.Tensor
    kv_index: torch.Tensor


# --------------------------------------------------------------------------- mask translation


def _plan_without_mask(q_len: int, kv_len: int, is_causal: bool, sliding_window: Optional[int]) -> MaskPlan:
    """attention_mask=None, read as torch SDPA reads it in transformers' `sdpa_attention_forward`."""
    if not is_causal:
        return MaskPlan("no_mask")
    # HF's mask builders only skip a sliding-window mask when the window cannot bite; apply it anyway if it would
    window = None
    if sliding_window is not None and 0 < sliding_window < kv_len:
        window = (int(sliding_window) - 1, 0)
    if q_len == 1:                       # decode step: SDPA uses no mask, i.e. the last query sees every key
        return MaskPlan("no_mask" if window is None else "causal_bottom_right", window)
    # q_len > 1: SDPA's is_causal (top-left); with more keys than queries (prefill into an empty static cache) it
    # drops the keys past q_len, which top-left causal never reads anyway; crop them so they are not quantized
    return MaskPlan("causal", window, kv_len=q_len if kv_len > q_len else None)


def _checked_mask(attention_mask, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The checks of an HF mask that read no values: type, 4-D shape against the call, dtype."""
    if not isinstance(attention_mask, torch.Tensor) or type(attention_mask).__name__ == "BlockMask":
        raise UnsupportedMaskError(f"attention_mask of type {type(attention_mask).__name__} is not supported; mxattn "
                                   "reads 4-D boolean or additive tensor masks (register() sets that up)")
    if attention_mask.dim() != 4:
        raise UnsupportedMaskError(
            f"expected a 4-D attention mask [batch, heads, q_len, kv_len], got shape {tuple(attention_mask.shape)}; "
            "call mxattn.integrations.transformers.register() so that transformers builds one for this "
            "attn_implementation")
    bm, hm, sq, skv = attention_mask.shape
    if bm not in (1, batch) or sq != q_len or skv != kv_len:
        raise UnsupportedMaskError(f"attention mask shape {tuple(attention_mask.shape)} does not match "
                                   f"[batch={batch} (or 1), heads, q_len={q_len}, kv_len={kv_len}]")
    if attention_mask.dtype != torch.bool and not attention_mask.is_floating_point():
        raise UnsupportedMaskError(f"attention mask dtype {attention_mask.dtype} is neither bool nor floating point")
    return attention_mask


def _keep_mask(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """HF 4-D mask -> bool keep [Bm, Sq, Skv] (Bm = 1 or batch), after shape, head and value checks."""
    attention_mask = _checked_mask(attention_mask, batch, q_len, kv_len)
    hm = attention_mask.shape[1]
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    else:
        keep = attention_mask == 0
        other = ~(keep | (attention_mask <= MASKED_AT_OR_BELOW))
        if bool(other.any()):
            value = attention_mask[other][0].item()
            raise UnsupportedMaskError(
                f"the additive attention mask holds values other than 0 and masked (<= {MASKED_AT_OR_BELOW:g}), "
                f"e.g. {value!r}: an additive bias (ALiBi, relative positions, ...) cannot be expressed by "
                "mxattn's masks")
    if hm > 1:
        if not torch.equal(keep, keep[:, :1].expand_as(keep)):
            raise UnsupportedMaskError("the attention mask differs between heads; mxattn applies one mask to all heads")
    return keep[:, 0]


def _row_intervals(keep: torch.Tensor):
    """keep [Bm, Sq, Skv] -> (lo, hi, nonempty, holes) [Bm, Sq]: the first and last kept key of each query row,
    whether it keeps any, and whether its kept keys are not one contiguous range."""
    skv = keep.shape[-1]
    as_int = keep.to(torch.uint8)
    count = keep.sum(dim=-1)
    lo = as_int.argmax(dim=-1)                             # first kept key (argmax returns the first maximum)
    hi = (skv - 1) - as_int.flip(-1).argmax(dim=-1)        # last kept key
    nonempty = count > 0
    return lo, hi, nonempty, nonempty & (hi - lo + 1 != count)


def _holes_error(keep: torch.Tensor, holes: torch.Tensor) -> UnsupportedMaskError:
    b, i = (int(x) for x in holes.nonzero()[0])
    kept = keep[min(b, keep.shape[0] - 1), i].nonzero().flatten().tolist()
    shown = kept if len(kept) <= 12 else kept[:6] + ["..."] + kept[-6:]
    return UnsupportedMaskError(
        f"attention mask row (batch {b}, query {i}) keeps keys {shown}, which is not one contiguous range, and "
        "its sequence's rows do not make one causal or sliding-window band over the keys they keep (an "
        f"image-token or block overlay?). {_PADDING_HINT}")


def _te_band_window(left: Optional[int], right: Optional[int], unbounded: int) -> Optional[Tuple[int, int]]:
    """TE's window_size for a band read off a mask (None = that side does not bite). TE's no_mask/padding take
    no window with one side unbounded (-1), so that side gets `unbounded`, a bound no row reaches (at least
    the longest query and key counts); a causal band (right 0) and no band are TE's own windows."""
    if left is None and right in (None, 0):
        return None
    if right == 0:
        return (left, 0)
    return (unbounded if left is None else left, unbounded if right is None else right)


def _try_alignment(lo, hi, nonempty, kv_lengths, q_len: int, kv_len: int, bottom_right: bool):
    """A (attn_mask_type-without-padding, window, bottom_right_diagonal) that reproduces the row ranges with
    this alignment, or None."""
    device = lo.device
    i = torch.arange(q_len, device=device).unsqueeze(0)                       # [1, Sq]
    off = (kv_lengths - q_len).unsqueeze(1) if bottom_right else torch.zeros_like(kv_lengths).unsqueeze(1)
    last = (kv_lengths - 1).unsqueeze(1)                                       # [B, 1]
    right_ext = torch.where(nonempty, hi - i - off, torch.full_like(hi, -(1 << 40)))
    left_ext = torch.where(nonempty, i + off - lo, torch.full_like(lo, -(1 << 40)))
    right_bites = nonempty & (hi < last)          # some row stops before its sequence's last key
    left_bites = nonempty & (lo > 0)
    stats = torch.stack([right_ext.max(), left_ext.max(), right_bites.any().long(), left_bites.any().long(),
                         nonempty.any().long()]).tolist()
    r_max, l_max, r_bites, l_bites, any_kept = stats
    if not any_kept:
        return "no_mask", None, None
    # a right edge that never cuts a row but sits exactly on the diagonal is causal too (decode steps)
    right = int(r_max) if r_bites or r_max == 0 else None
    left = int(l_max) if l_bites else None
    if (right is not None and right < 0) or (left is not None and left < 0):
        return None
    causal = right == 0
    # rebuild each row's range from (lengths, band) and compare with HF's rows
    lo_e = torch.zeros_like(lo) if left is None else (i + off - left).clamp(min=0).expand_as(lo)
    hi_e = last.expand_as(hi) if right is None else torch.minimum(i + off + right, last)
    nonempty_e = lo_e <= hi_e
    same = torch.equal(nonempty_e, nonempty) and torch.equal(torch.where(nonempty, lo - lo_e, 0),
                                                              torch.zeros_like(lo)) \
        and torch.equal(torch.where(nonempty, hi - hi_e, 0), torch.zeros_like(hi))
    if not same:
        return None
    if causal:
        word = "causal_bottom_right" if bottom_right else "causal"
    else:
        word = "no_mask"
    window = _te_band_window(left, right, max(q_len, kv_len))
    return word, window, (bottom_right if window is not None and not causal else None)


def _window_is_modules(window: Optional[Tuple[int, int]], is_causal: bool, sliding_window: Optional[int]) -> bool:
    """Whether a band's left window (TE's window_size, read off a mask) is the module's own: always for a
    non-causal module; for a causal one only none, or exactly sliding_window keys (left = sliding_window - 1).
    A wider cut is left padding; read as a window, the sequence would keep the padding in its MXFP8 blocks."""
    left = None if window is None or window[0] == -1 else window[0]
    if left is None or not is_causal:
        return True
    return sliding_window is not None and left == int(sliding_window) - 1


def _explain_failure(q_len: int, kv_len: int) -> str:
    return ("the mask is not a causal or sliding-window band over one range of keys and queries per sequence "
            f"(q_len={q_len}, kv_len={kv_len}). {_PADDING_HINT}")


def plan_attention_mask(attention_mask: Optional[torch.Tensor], *, batch: int, q_len: int, kv_len: int,
                        is_causal: bool = True, sliding_window: Optional[int] = None) -> MaskPlan:
    """Translate the mask a transformers model hands its attention function into `mxfp8_attention` arguments.

    attention_mask: None, or 4-D [B or 1, 1 or H, q_len, kv_len] boolean (True = attend) or additive (0 / <=
    -1e4). is_causal, sliding_window: the module's flags. When the mask is None the result is what torch SDPA
    does with ``attn_mask=None``. With a mask, a causal module's rows cut on the left by anything but its own
    window (sliding_window keys) are read as padding, not as a wider window: each sequence then starts at its
    first kept key (its MXFP8 blocks too), as if it were alone (a left-padded decode step). The derived band
    and key lengths are rebuilt row by row and compared with the mask; `UnsupportedMaskError` says what could
    not be expressed.
    """
    if attention_mask is None:
        return _plan_without_mask(q_len, kv_len, is_causal, sliding_window)
    keep = _keep_mask(attention_mask, batch, q_len, kv_len)
    lo, hi, nonempty, holes = _row_intervals(keep)
    if lo.shape[0] != batch:
        lo, hi, nonempty, holes = (x.expand(batch, -1) for x in (lo, hi, nonempty, holes))
    kv_lengths = torch.where(nonempty, hi + 1, torch.zeros_like(hi)).amax(dim=1)         # [B] int64
    order = (False, True) if q_len == kv_len else (True, False)                           # top-left first?
    found = None
    any_holes = bool(holes.any())
    for bottom_right in () if any_holes else order:
        found = _try_alignment(lo, hi, nonempty, kv_lengths, q_len, kv_len, bottom_right)
        if found is not None and _window_is_modules(found[1], is_causal, sliding_window):
            break
        found = None
    if found is None:
        plan = _plan_sequences(keep, nonempty, batch, q_len, kv_len)
        if plan is not None:
            return plan
        if any_holes:
            raise _holes_error(keep, holes)
        raise UnsupportedMaskError("cannot express this attention mask with mxattn: "
                                   + _explain_failure(q_len, kv_len))
    word, window, bottom_right_diagonal = found
    if bool((kv_lengths < kv_len).any()):
        device = attention_mask.device
        cu_kv = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        torch.cumsum(kv_lengths.to(torch.int32), dim=0, out=cu_kv[1:])
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len       # every query row is computed
        word = "padding" if word == "no_mask" else "padding_" + word
        return MaskPlan(word, window, cu_q, cu_kv, bottom_right_diagonal=bottom_right_diagonal)
    return MaskPlan(word, window, bottom_right_diagonal=bottom_right_diagonal)


def _plan_sequences(keep, nonempty, batch: int, q_len: int, kv_len: int) -> Optional[MaskPlan]:
    """Sequences of their own inside the batch rows, as a packed call over each sequence's keys.

    A sequence is a run of consecutive query rows (those with keys) each sharing a key with the previous one;
    its keys are the union of what its rows keep, taken in order (so a decode step after a right-padded
    prompt, which keeps the prompt and the tokens generated after the padding gap, sees them as one
    sequence, as it would alone). Inside a sequence the rows must make a band aligned bottom-right over those
    keys (the same band as top-left when the query and key counts agree, as in a prefill): causal, a sliding
    window, a bidirectional window, or none. That covers left padding, right padding with its decode steps, and
    packed documents with a block-diagonal mask (padding-free batches with restarting position ids). None when
    it does not reproduce the mask exactly. A sliding window hides a sequence's older keys exactly as padding
    would, so in a padded decode step its keys (and V's MXFP8 blocks) start at the window's first key, as they do
    in transformers' sliding-window caches, which keep only the window."""
    device = keep.device
    keep = keep.expand(batch, q_len, kv_len)
    rows = torch.arange(q_len, device=device).expand(batch, q_len)
    last_with_keys = torch.cummax(torch.where(nonempty, rows, torch.full_like(rows, -1)), dim=1).values
    prev_row = torch.cat([torch.full_like(rows[:, :1], -1), last_with_keys[:, :-1]], dim=1)
    prev_keep = torch.gather(keep, 1, prev_row.clamp(min=0).unsqueeze(2).expand(-1, -1, kv_len))
    starts = nonempty & ((prev_row < 0) | ~(keep & prev_keep).any(dim=2))
    n_seg = int(starts.sum())
    if n_seg == 0:
        return None
    seg = torch.where(nonempty, torch.cumsum(starts.flatten().long(), 0).view(batch, q_len) - 1,
                      torch.full_like(rows, n_seg))                                        # n_seg: no sequence
    flat_seg = seg.flatten()
    # each sequence's keys (union of its rows) and their positions in the sequence (compact coordinates)
    cols = torch.zeros(n_seg + 1, kv_len, dtype=torch.int64, device=device).scatter_reduce_(
        0, flat_seg.unsqueeze(1).expand(-1, kv_len), keep.reshape(-1, kv_len).long(), "amax")[:n_seg].bool()
    compact = (torch.cumsum(cols, dim=1, dtype=torch.int32) - 1)                          # [n_seg, Skv]
    len_kv = cols.sum(dim=1)
    qs = torch.full((n_seg + 1,), q_len, dtype=torch.int64, device=device).scatter_reduce(
        0, flat_seg, rows.flatten(), "amin")[:n_seg]
    len_q = torch.bincount(flat_seg, minlength=n_seg + 1)[:n_seg]
    seg_b = torch.arange(batch, device=device).repeat_interleave(q_len)[torch.nonzero(starts.flatten()).flatten()]
    rows_end = torch.zeros(n_seg + 1, dtype=torch.int64, device=device).scatter_reduce(
        0, flat_seg, rows.flatten() + 1, "amax")[:n_seg]
    if not torch.equal(rows_end - qs, len_q):                # a sequence's query rows are not one range
        return None
    # per row, in its sequence's coordinates: kept keys [lo_c, hi_c], query index i, bottom-right offset
    segc = seg.clamp(max=n_seg - 1)
    comp_r = compact[segc]                                                                 # [B, Sq, Skv]
    count = keep.sum(dim=2)
    big = torch.full_like(comp_r, kv_len)
    lo_c = torch.where(keep, comp_r, big).amin(dim=2).long()
    hi_c = torch.where(keep, comp_r, -1).amax(dim=2).long()
    if bool((nonempty & (hi_c - lo_c + 1 != count)).any()):
        return None                                          # a row skips keys its sequence keeps
    i = rows - qs[segc]
    off = len_kv[segc] - len_q[segc]
    never = torch.full_like(lo_c, -(1 << 40))
    r_max, l_max, r_bites, l_bites = (int(x) for x in torch.stack([
        torch.where(nonempty, hi_c - i - off, never).max(), torch.where(nonempty, i + off - lo_c, never).max(),
        (nonempty & (hi_c < len_kv[segc] - 1)).any().long(), (nonempty & (lo_c > 0)).any().long()]).tolist())
    right = r_max if r_bites or r_max == 0 else None
    left = l_max if l_bites else None
    if (right is not None and right < 0) or (left is not None and left < 0):
        return None
    # rebuild every (row, key) from the sequences and the band, and compare with HF's mask
    ii, o3 = i.unsqueeze(2), off.unsqueeze(2)
    expected = nonempty.unsqueeze(2) & cols[segc]
    if right is not None:
        expected &= comp_r <= ii + o3 + right
    if left is not None:
        expected &= comp_r >= ii + o3 - left                 # TE's window: `left` keys before the diagonal
    if not torch.equal(expected, keep):
        return None
    cu_q, cu_kv = (torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(n, 0)])
                   for n in (len_q, len_kv))
    owner_q = torch.repeat_interleave(torch.arange(n_seg, device=device), len_q)
    q_rows = seg_b[owner_q] * q_len + qs[owner_q] + (torch.arange(int(cu_q[-1]), device=device) - cu_q[owner_q])
    key_seg, key_col = torch.nonzero(cols, as_tuple=True)                                  # in sequence order
    kv_rows = seg_b[key_seg] * kv_len + key_col
    word = "padding_causal_bottom_right" if right == 0 else "padding"
    max_q, max_kv = (int(x) for x in torch.stack([len_q.max(), len_kv.max()]).tolist())
    window = _te_band_window(left, right, max(max_q, max_kv))
    return MaskPlan(word, window, cu_q.to(torch.int32), cu_kv.to(torch.int32), max_seqlen_q=max_q,
                    max_seqlen_kv=max_kv, gather=RowGather(q_rows, kv_rows),
                    bottom_right_diagonal=True if window is not None and right != 0 else None)


def _traced_keep(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int):
    """`_keep_mask` without host reads: (keep bool [B, Sq, Skv], bad 0-d bool). bad: the additive mask holds
    values other than 0 and masked, or the heads' masks differ."""
    mask = _checked_mask(attention_mask, batch, q_len, kv_len)
    if mask.dtype == torch.bool:
        keep_h = mask
        bad = torch.zeros((), dtype=torch.bool, device=mask.device)
    else:
        keep_h = mask == 0
        bad = (~(keep_h | (mask <= MASKED_AT_OR_BELOW))).any()
    keep = keep_h[:, :1].expand(-1, keep_h.shape[1], -1, -1)
    bad = bad | _differs(keep_h, keep)
    return keep[:, 0].expand(batch, q_len, kv_len), bad


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """0-d bool: some element of the boolean tensors a and b differs (compared as int8: inductor's value-range
    analysis (torch 2.11) fails on != of two bool tensors)."""
    return (a.to(torch.int8) != b.to(torch.int8)).any()


def _module_band(q_len: int, kv_len: int, is_causal: bool, sliding_window: Optional[int]):
    """(TE word without padding, window_size) of the module's band, as transformers' mask builders make it:
    causal when is_causal, a left window of sliding_window keys, top-left when q_len == kv_len (training,
    prefill) and bottom-right otherwise (decode and chunked-prefill steps of a KV cache)."""
    window = None
    if is_causal and sliding_window is not None and 0 < sliding_window < kv_len:
        window = (int(sliding_window) - 1, 0)
    word = "no_mask" if not is_causal else "causal" if q_len == kv_len else "causal_bottom_right"
    return word, window


def _compaction(selected: torch.Tensor):
    """selected bool [B, S] -> (index, back, count), static shapes, no host read.

    back int64 [B, S]: a permutation of each row that puts the selected positions first, in order, then the
    others, in order (back[b, j] is where position j goes); index int64 [B, S]: its inverse (index[b, c] is the
    position that goes to c); count int64 [B]: the selected positions of each row."""
    n = selected.shape[1]
    j = torch.arange(n, device=selected.device).expand_as(selected)
    before = torch.cumsum(selected, dim=1)                                  # selected positions <= j
    count = selected.sum(dim=1)
    back = torch.where(selected, before - 1, count.unsqueeze(1) + j - before)
    index = torch.zeros_like(back).scatter(1, back, j)
    return index, back, count


def _band_rebuild(band, q_sel, q_pos, n_q, kv_sel, kv_pos, n_kv) -> torch.Tensor:
    """The mask [B, Sq, Skv] (bool) of a padded call: query row i of batch b is compact row q_pos[b, i] of a
    sequence of n_q[b] rows when q_sel[b, i], key j is compact key kv_pos[b, j] of n_kv[b] when kv_sel[b, j];
    `band` (a `MaskSpec`) applies in those compact coordinates, bottom-right with each sequence's lengths."""
    i, j = q_pos.unsqueeze(2), kv_pos.unsqueeze(1)
    off = (n_kv - n_q).view(-1, 1, 1) if band.bottom_right else 0
    keep = q_sel.unsqueeze(2) & kv_sel.unsqueeze(1)
    if band.right_bound is not None:
        keep = keep & (j <= i + off + band.right_bound)
    if band.left_bound is not None:
        keep = keep & (j > i + off - band.left_bound)
    return keep


#: the device-side assert messages of `plan_attention_mask_traced` (CUDA takes fewer than 255 characters; the
#: cases behind them are in its docstring and the README's mask table)
_TRACED_REFUSAL = ("mxattn (torch.compile): this attention mask is not the module's band over one sequence per "
                   "batch row (packed rows need cu_seq_lens_q/k; no static-cache right-padded prefill, no "
                   "overlays); run eagerly for the reason")
_TRACED_BIAS = ("mxattn (torch.compile): the attention mask holds values other than 0 and masked (a bias?) or "
                "differs between heads; mxattn cannot express it")


def plan_attention_mask_traced(attention_mask: Optional[torch.Tensor], *, batch: int, q_len: int, kv_len: int,
                               is_causal: bool = True, sliding_window: Optional[int] = None) -> MaskPlan:
    """`plan_attention_mask` in a form torch.compile traces without graph breaks (no value read on the host).

    The band comes from the module's flags (`_module_band`). Every call is one padded call with one sequence
    per batch row, gathered to the front of its row (`RowCompaction`, static shapes), exactly as the eager
    translation reads the mask:

    * when HF's mask is that band over each row's first L_b keys (right padding, unpadded batches, decode
      steps, static caches), the sequence is all query rows and those keys (what `plan_attention_mask` plans
      without gathering);
    * otherwise it is the query rows that keep a key and the keys they keep, in order (left padding, decode
      steps after right-padded prompts): MXFP8 blocks start at each sequence's first kept key, as in the eager
      translation's packed sequences, so both give the same bytes.

    The mask rebuilt from that plan must equal HF's, else `torch._assert_async` stops the run with the reason
    (a RuntimeError on the CPU, a device-side assert on CUDA): what the eager path refuses is refused here
    too, and so are several sequences in one batch row (packed documents, which the eager path runs: pass
    cu_seq_lens_q/k instead, e.g. DataCollatorWithFlattening(return_flash_attn_kwargs=True)), right-padded
    prompts prefilled into a static cache (pad on the left) and mask overlays. The messages stay under CUDA's
    255-character limit on device-side assert messages."""
    if attention_mask is None:
        return _plan_without_mask(q_len, kv_len, is_causal, sliding_window)
    keep, bad = _traced_keep(attention_mask, batch, q_len, kv_len)
    torch._assert_async(~bad, _TRACED_BIAS)
    word, window = _module_band(q_len, kv_len, is_causal, sliding_window)
    band = resolve_mask(word, window).band
    device = keep.device
    rows_keep = keep.any(dim=2)                                                          # [B, Sq]
    keys_kept = keep.any(dim=1)                                                          # [B, Skv]
    i = torch.arange(q_len, device=device).expand(batch, q_len)
    j = torch.arange(kv_len, device=device).expand(batch, kv_len)
    lengths = torch.where(keys_kept, j + 1, 0).amax(dim=1)                              # [B]
    prefix = j < lengths.unsqueeze(1)
    all_rows = torch.ones_like(rows_keep)
    as_band = ~_differs(_band_rebuild(band, all_rows, i, torch.full_like(lengths, q_len), prefix, j, lengths),
                        keep)
    q_sel = torch.where(as_band, all_rows, rows_keep)
    kv_sel = torch.where(as_band, prefix, keys_kept)
    q_index, q_back, n_q = _compaction(q_sel)
    kv_index, kv_back, n_kv = _compaction(kv_sel)
    torch._assert_async(~_differs(_band_rebuild(band, q_sel, q_back, n_q, kv_sel, kv_back, n_kv), keep),
                        _TRACED_REFUSAL)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    cu_q, cu_kv = (torch.cat([zero, torch.cumsum(n, dim=0).to(torch.int32)]) for n in (n_q, n_kv))
    return MaskPlan("padding_" + word if word != "no_mask" else "padding", window, cu_q, cu_kv,
                    max_seqlen_q=q_len, max_seqlen_kv=kv_len, rows=RowCompaction(q_index, q_back, kv_index))
