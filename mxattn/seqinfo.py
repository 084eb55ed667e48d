"""Per-sequence lengths of a padded or packed batch: the one value that carries variable lengths through mxattn.

`SeqInfo` travels from `mxattn.attention` through the custom ops (`mxattn.ops`) to every backend and to the
quantizer, the way FlashAttention threads ``cu_seqlens`` to its kernels. Tensors cross the backend interface
as [B, H, S, D] views in both cases:

* **padded** (``packed=False``): q [B, Hq, Sq_max, D]; sequence b is batch b, rows ``0 .. len_q[b]``
  (``len_q[b] = cu_seqlens_q[b+1] - cu_seqlens_q[b]``). Rows past a sequence's length are padding: the
  quantizer reads them as zeros, outputs and gradients there are zero.
* **packed** (``packed=True``, TE's ``thd``): q [T_q, Hq, D] is viewed as [1, Hq, T_q, D]; sequence b is rows
  ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]``. MXFP8 blocks along S restart at every sequence start, so a
  column-wise scale tensor has ``T // 32 + B`` block rows with sequence b's blocks from row
  ``cu_seqlens[b] // 32 + b`` (`mxattn.formats.segment_block_start`).

Either way a sequence's numbers do not depend on the other sequences nor on padding values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .tensor_cache import TensorValueCache


@dataclass(frozen=True, eq=False)
class SeqInfo:
    """cu_seqlens_q/kv: int32 [B+1] on the attention tensors' device (cumulative lengths, starting at 0);
    max_seqlen_q/kv: upper bounds of the lengths (ints); packed: thd (True) or padded (False)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    packed: bool

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    @property
    def kind(self) -> str:
        """The lengths' kind, "packed" or "padded" (as `Problem.varlen`, cuDNN's configs and the recipes name it)."""
        return "packed" if self.packed else "padded"

    def cu_seqlens(self, which: str) -> torch.Tensor:
        """cu_seqlens_q (which "q") or cu_seqlens_kv (which "kv"): int32 [B+1]."""
        return self.cu_seqlens_q if which == "q" else self.cu_seqlens_kv

    def max_seqlen(self, which: str) -> int:
        """max_seqlen_q (which "q") or max_seqlen_kv (which "kv")."""
        return self.max_seqlen_q if which == "q" else self.max_seqlen_kv

    def host_offsets(self) -> Tuple[List[int], List[int]]:
        """(cu_seqlens_q, cu_seqlens_kv) as Python lists (one device-to-host copy; for the reference path)."""
        both = torch.stack([self.cu_seqlens_q, self.cu_seqlens_kv]).cpu().tolist()
        return both[0], both[1]

    def rows_of(self, t: torch.Tensor, b: int, cu: List[int]) -> torch.Tensor:
        """The [1, H, len, *] view of sequence b's rows of t ([B, H, S, *] padded, [1, H, T, *] packed); cu: the
        cu_seqlens of t's side as a Python list (`host_offsets`), len = cu[b + 1] - cu[b]."""
        if self.packed:
            return t[:, :, cu[b]:cu[b + 1]]
        return t[b:b + 1, :, :cu[b + 1] - cu[b]]

    def segments(self, which: str) -> Optional[torch.Tensor]:
        """The cu_seqlens that split the S axis of `which` ("q" or "kv") into MXFP8 segments (packed), else None."""
        if not self.packed:
            return None
        return self.cu_seqlens(which)

    def valid_rows(self, which: str, n_rows: int) -> torch.Tensor:
        """Bool [B, 1, n_rows, 1] (padded) / [1, 1, n_rows, 1] (packed): True on the rows of real tokens."""
        cu = self.cu_seqlens(which).to(torch.int64)
        rows = torch.arange(n_rows, device=cu.device)
        if self.packed:
            valid = (rows >= cu[0]) & (rows < cu[-1])
            return valid.view(1, 1, n_rows, 1)
        lengths = (cu[1:] - cu[:-1]).unsqueeze(1)
        return (rows.unsqueeze(0) < lengths).view(-1, 1, n_rows, 1)

    def result_rows(self, which: str, n_rows: int) -> torch.Tensor:
        """Bool [B, 1, n_rows, 1] (padded) / [1, 1, n_rows, 1] (packed): True on the rows that have an attention
        result: real tokens of sequences whose other side is not empty (a query with no key gives O = 0, stats
        -inf, zero gradients; a key with no query zero gradients). No host copy."""
        cu = self.cu_seqlens(which).to(torch.int64)
        other = self.cu_seqlens("kv" if which == "q" else "q").to(torch.int64)
        has_other = (other[1:] - other[:-1]) > 0
        rows = torch.arange(n_rows, device=cu.device)
        if self.packed:
            b = torch.searchsorted(cu[1:], rows, right=True).clamp_(max=self.batch - 1)
            return (has_other[b] & (rows < cu[-1])).view(1, 1, n_rows, 1)
        lengths = (cu[1:] - cu[:-1]).unsqueeze(1)
        return ((rows.unsqueeze(0) < lengths) & has_other.unsqueeze(1)).view(-1, 1, n_rows, 1)


def zero_padding(x: torch.Tensor, seq: Optional[SeqInfo], which: str) -> torch.Tensor:
    """x [B, H, S, D] with the padding rows of a padded batch set to 0: rows past each length of side `which`
    ("q" or "kv"), in a new tensor of x's layout (NaN or inf there must reach no scale, and cuDNN reads them).
    x itself for a dense batch (seq None) and for a packed one: a pack has no padding rows between its
    sequences, and its rows outside [cu[0], cu[-1]), if any, are left as they are (no sequence owns them: a
    packed quantization's blocks restart at each sequence, and no kernel reads them as values). Every backend
    zeroes padding with this rule (the reference's quantization, the cudnn backend's inputs and dO, the triton
    backend's seq-major V)."""
    if seq is None or seq.packed:
        return x
    return torch.where(seq.valid_rows(which, x.shape[2]), x, torch.zeros((), dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------- kernel launches (seq None: dense)


def grid_rows(seq: Optional[SeqInfo], which: str, n_rows: int) -> int:
    """Rows along S a kernel grid covers on side `which` of [B, H, n_rows, D] tensors (`covered_rows`)."""
    if seq is None or not seq.packed:
        return n_rows
    return covered_rows(n_rows, seq.max_seqlen_q if which == "q" else seq.max_seqlen_kv, True)


def covered_rows(n_rows: int, max_seqlen: Optional[int], packed: bool) -> int:
    """Rows along S a kernel grid covers in [B, H, n_rows, D] tensors: the longest sequence (max_seqlen, when
    known) of a packed batch, at most n_rows (programs past their own sequence's end exit at once), else n_rows
    (dense, or padded: padding rows get their zeros from the kernels)."""
    return min(n_rows, max_seqlen) if packed and max_seqlen is not None else n_rows


def grid_sequences(seq: Optional[SeqInfo], batch: int) -> int:
    """Sequences along a kernel grid's (sequence, head) axis: B of cu_seqlens for a packed batch, else the
    tensors' batch size `batch` (dense or padded)."""
    return seq.cu_seqlens_q.numel() - 1 if seq is not None and seq.packed else batch


def quantizer_args(seq: Optional[SeqInfo], which: str) -> dict:
    """Length keywords of the fused quantizer (`triton_quantize.quantize_rowcol`) for side `which` ("q" or
    "kv"): cu_seqlens (int32 [B+1]), max_seqlen (int), packed (bool); empty for a dense call (seq None)."""
    if seq is None:
        return {}
    if which == "q":  # (the fields themselves: this runs per call)
        return dict(cu_seqlens=seq.cu_seqlens_q, max_seqlen=seq.max_seqlen_q, packed=seq.packed)
    return dict(cu_seqlens=seq.cu_seqlens_kv, max_seqlen=seq.max_seqlen_kv, packed=seq.packed)


def kernel_cu_seqlens(seq: Optional[SeqInfo], stand_in: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens_q, cu_seqlens_kv) as the kernels' pointer arguments: seq's int32 [B+1] tensors, or for a
    dense call (seq None) `stand_in` (any tensor) twice, a pointer the kernels never read."""
    if seq is None:
        return stand_in, stand_in
    return seq.cu_seqlens_q, seq.cu_seqlens_kv


def kernel_flags(seq: Optional[SeqInfo], bottom_right: Optional[bool] = None) -> dict:
    """The kernels' length constexprs (Python bools): VARLEN (seq given), PACKED, and unless bottom_right is
    None BOTTOM_RIGHT (each sequence's own diagonal offset; variable-length calls only)."""
    varlen = seq is not None
    if bottom_right is None:
        return dict(VARLEN=varlen, PACKED=varlen and bool(seq.packed))
    return dict(VARLEN=varlen, PACKED=varlen and bool(seq.packed), BOTTOM_RIGHT=varlen and bool(bottom_right))


# --------------------------------------------------------------------------- argument checks


def _check_cu(name: str, cu, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 [batch + 1]), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the device of q, k, v ({device}), got {cu.device}")


def _check_values(name: str, values: List[int], total: Optional[int], limit: Optional[int], what: str) -> int:
    """Check starts-at-0, non-decreasing, last entry (packed) / per-sequence bound (padded); return max len."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if min(lengths) < 0:
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{name} must be non-decreasing, got {values[i]} then {values[i + 1]} at index {i}")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of {what} tokens ({total}), got {values[-1]}")
    if limit is not None and max(lengths) > limit:
        raise ValueError(f"{name}: sequence length {max(lengths)} exceeds the padded length {limit} of {what}")
    return max(lengths)


def _check_max(name: str, given, actual: Optional[int]) -> int:
    if given is None:
        return actual
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        raise ValueError(f"{name} must be a non-negative int or None, got {given!r}")
    if actual is not None and given < actual:
        raise ValueError(f"{name}={given} is smaller than the longest sequence ({actual})")
    return given


#: longest sequences of the last few checked (cu_seqlens_q, cu_seqlens_kv) pairs
_CHECKED = TensorValueCache()


def make_seqinfo(*, packed: bool, batch: Optional[int], rows_q: int, rows_kv: int, device: torch.device,
                 cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) -> SeqInfo:
    """Validate TE-style length arguments and build a SeqInfo (raises TypeError/ValueError naming the argument).

    packed: q/k/v are thd with rows_q / rows_kv tokens; else padded with batch `batch` and rows_q / rows_kv
    positions per sequence. cu_seqlens_kv None means cu_seqlens_q (self-attention). Values are checked on the
    host (one small copy) except while torch.compile traces, where max_seqlen_* must then be given.
    """
    if cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q is required with qkv_format='thd' or a padding attn_mask_type")
    _check_cu("cu_seqlens_q", cu_seqlens_q, device)
    if cu_seqlens_kv is None:
        cu_seqlens_kv = cu_seqlens_q
    _check_cu("cu_seqlens_kv", cu_seqlens_kv, device)
    b = cu_seqlens_q.numel() - 1
    if cu_seqlens_kv.numel() - 1 != b:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_kv describe different batch sizes: "
                         f"{b} and {cu_seqlens_kv.numel() - 1}")
    if not packed and batch != b:
        raise ValueError(f"cu_seqlens_q has {b + 1} entries but q has batch size {batch} (expected {batch + 1})")
    actual_q = actual_kv = None
    if not torch.compiler.is_compiling():
        def check():
            cu_q, cu_kv = torch.stack([cu_seqlens_q, cu_seqlens_kv]).cpu().tolist()
            return (_check_values("cu_seqlens_q", cu_q, rows_q if packed else None, None if packed else rows_q,
                                  "q"),
                    _check_values("cu_seqlens_kv", cu_kv, rows_kv if packed else None, None if packed else rows_kv,
                                  "k/v"))

        # one host read per lengths tensor: every layer of a model gets the same cu_seqlens (a failed check
        # raises and caches nothing)
        actual_q, actual_kv = _CHECKED.get((cu_seqlens_q, cu_seqlens_kv), (packed, rows_q, rows_kv), check)
    elif max_seqlen_q is None or max_seqlen_kv is None:
        raise ValueError("under torch.compile pass max_seqlen_q and max_seqlen_kv (they size the kernel grids)")
    max_q = _check_max("max_seqlen_q", max_seqlen_q, actual_q)
    max_kv = _check_max("max_seqlen_kv", max_seqlen_kv if max_seqlen_kv is not None or cu_seqlens_kv is not
                        cu_seqlens_q else max_seqlen_q, actual_kv)
    return SeqInfo(cu_seqlens_q, cu_seqlens_kv, int(max_q), int(max_kv), bool(packed))


def cu_seqlens_from_padding_mask(keep: torch.Tensor, name: str = "attention_mask") -> torch.Tensor:
    """keep: bool [B, S], True on real tokens, each row a prefix of True (right padding) -> int32 cu_seqlens
    [B+1] on keep's device. Raises ValueError naming `name` when a row is not a right-padded prefix (left
    padding or holes are not lengths). One small device-to-host check."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
        raise ValueError(f"{name} must be a bool [batch, seq] tensor (True = real token), got "
                         f"{getattr(keep, 'dtype', type(keep).__name__)} {tuple(getattr(keep, 'shape', ()))}")
    lengths = keep.sum(dim=1, dtype=torch.int32)
    prefix = torch.arange(keep.shape[1], device=keep.device).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(prefix, keep):
        row = int((prefix != keep).any(dim=1).nonzero()[0])
        raise ValueError(f"{name} row {row} is not right padding (real tokens first, then padding): mxattn "
                         "turns padding masks into sequence lengths and cannot express left padding or holes")
    cu = torch.zeros(keep.shape[0] + 1, dtype=torch.int32, device=keep.device)
    torch.cumsum(lengths, dim=0, out=cu[1:])
    return cu


__all__ = ["SeqInfo", "make_seqinfo", "cu_seqlens_from_padding_mask", "zero_padding"]
