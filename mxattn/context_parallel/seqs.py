"""The sequences of a context-parallel call and the rows each partial attention call reads.

Dense batches (bshd/sbhd) have B sequences of S tokens, each cut into 2 * cp chunks of L = S / (2 * cp). With a
padding mask, cu_seqlens gives each whole sequence's valid length, its padding at the end. A packed batch (thd,
Transformer Engine's layout) has sequences of their own padded lengths (cu_seqlens_padded, each a multiple of
2 * cp), each cut into 2 * cp chunks of its own L_b, and their valid lengths (cu_seqlens).

A sequence's valid tokens are a prefix of it, so the chunks a partial call takes, in the order it takes them (a
rank's two chunks r < 2 * cp - 1 - r, or a prefix of the sequence), hold their valid tokens as a prefix too: a
chunk with padding is followed only by padding. Every partial call is then a padded call (bshd/sbhd: its rows are
one slice, the same for every batch entry, each sequence with its own valid length) or a packed call (thd: the
valid rows gathered, one segment per sequence) on lengths read once on the host.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..constants import MX_BLOCK
from ..seqinfo import SeqInfo, _check_cu, _check_values
from ..tensor_cache import TensorValueCache
from .layout import natural_chunks, shard_sequence


class Side(NamedTuple):
    """The rows one side (queries, or keys and values) of a partial call reads along S of a [B, H, S, D] tensor:
    a slice (bshd/sbhd) or an int64 index of the valid rows (thd), and each sequence's valid rows (None: every
    row, a dense batch)."""

    rows: Union[slice, torch.Tensor]
    lengths: Optional[Tuple[int, ...]]

    @property
    def empty(self) -> bool:
        return self.lengths is not None and sum(self.lengths) == 0

    @property
    def count(self) -> int:
        """Rows read along S."""
        return self.rows.stop - self.rows.start if isinstance(self.rows, slice) else self.rows.numel()


@functools.lru_cache(maxsize=256)
def _packed_rows(seqs: "Seqs", chunks: Tuple[int, ...], gathered: bool, device) -> torch.Tensor:
    """`Seqs.side`'s int64 index of the valid rows of `chunks` in a packed shard (or the gathered K/V), made once
    per (sequences, chunks, device), as `_cu_seqlens`. Read-only."""
    valid = [[seqs.valid(b, c) for c in chunks] for b in range(seqs.batch)]
    starts = torch.tensor([[seqs.position(b, c, gathered) for c in chunks] for b in range(seqs.batch)])
    counts = torch.tensor(valid).reshape(-1)
    # each chunk's first valid row, then its next ones: arange shifted per chunk
    shift = starts.reshape(-1) - (torch.cumsum(counts, 0) - counts)
    return (torch.arange(int(counts.sum())) + torch.repeat_interleave(shift, counts)).to(device)


def take(x: torch.Tensor, rows) -> torch.Tensor:
    """x [B, H, S, D] at `rows` along S (a view for a slice, a copy for an index)."""
    return x[:, :, rows] if isinstance(rows, slice) else x.index_select(2, rows)


def put(x: torch.Tensor, rows, value: torch.Tensor) -> None:
    """x[:, :, rows] = value, in place."""
    if isinstance(rows, slice):
        x[:, :, rows] = value
    else:
        x.index_copy_(2, rows, value)


def add_at(x: torch.Tensor, rows, value: torch.Tensor) -> None:
    """x[:, :, rows] += value, in place."""
    if isinstance(rows, slice):
        x[:, :, rows] += value
    else:
        x.index_add_(2, rows, value)


def step_seqinfo(q: Side, kv: Side, packed: bool, device) -> Optional[SeqInfo]:
    """The SeqInfo of a partial call on these sides (None for a dense batch)."""
    if q.lengths is None:
        return None

    return SeqInfo(_cu_seqlens(q.lengths, device), _cu_seqlens(kv.lengths, device), max(q.lengths),
                   max(kv.lengths), packed)


@functools.lru_cache(maxsize=256)
def _cu_seqlens(lengths: Tuple[int, ...], device) -> torch.Tensor:
    """int32 [n + 1] cumulative lengths on device, made once per (lengths, device): every layer of a model passes
    the same lengths, and a host-to-device copy per call would hold the host back. Read-only."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


class Seqs(NamedTuple):
    """How the ranks hold the sequences of a call (the same on every rank)."""

    cp: int
    packed: bool
    #: tokens per chunk of each sequence (bshd/sbhd: B entries, all L)
    chunks: Tuple[int, ...]
    #: valid tokens of each whole sequence; None: every token (no padding mask)
    lengths: Optional[Tuple[int, ...]]
    #: tokens of a rank's shard along S: 2 L, or the sum of 2 L_b (thd)
    local: int
    #: where each sequence starts in a rank's shard (thd; zeros for bshd/sbhd)
    offsets: Tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.chunks)

    def valid(self, b: int, c: int) -> int:
        """Valid tokens of chunk c of sequence b."""
        L = self.chunks[b]
        return L if self.lengths is None else min(max(self.lengths[b] - c * L, 0), L)

    def position(self, b: int, c: int, gathered: bool) -> int:
        """Where chunk c of sequence b starts along S: in its owner's shard (gathered False), or in the gathered
        K/V (gathered True: bshd/sbhd the whole sequence in order, thd the ranks' shards stacked in rank order)."""
        owner, half = (c, 0) if c < self.cp else (2 * self.cp - 1 - c, 1)
        if not self.packed:
            return (c if gathered else half) * self.chunks[b]
        return self.offsets[b] + half * self.chunks[b] + (owner * self.local if gathered else 0)

    def side(self, chunks: Sequence[int], gathered: bool, device) -> Side:
        """The Side of the chunks (global indices, in the order they sit, each sequence's valid tokens a prefix of
        them) in a shard (gathered False: chunks of one rank) or in the gathered K/V."""
        valid = [[self.valid(b, c) for c in chunks] for b in range(self.batch)]
        lengths = None if self.lengths is None else tuple(sum(v) for v in valid)
        if not self.packed:
            start, L = self.position(0, chunks[0], gathered), self.chunks[0]
            return Side(slice(start, start + len(chunks) * L), lengths)
        return Side(_packed_rows(self, tuple(chunks), gathered, device), tuple(sum(v) for v in valid))

    def whole(self, device) -> Side:
        """The Side of every valid token of the gathered tensors, sequence by sequence in order."""
        return self.side(range(2 * self.cp), True, device)

    def gathered(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every rank's shard [B, H, local, D] (rank order) as the gathered tensor `position` reads."""
        return torch.cat(list(parts) if self.packed else natural_chunks(parts, 2), dim=2)

    def pieces(self, x: torch.Tensor) -> List[torch.Tensor]:
        """The inverse of `gathered`: each rank's shard of x [B, H, cp * local, D], rank order."""
        if self.packed:
            return [x[:, :, j * self.local:(j + 1) * self.local] for j in range(self.cp)]
        return [shard_sequence(x, self.cp, j, 2) for j in range(self.cp)]

    def cu_text(self) -> str:
        """The lengths as the caller gave them (cumulative), for messages."""
        if self.lengths is None:
            return "no cu_seqlens"
        actual = f"cu_seqlens_q {[0, *itertools.accumulate(self.lengths)]}"
        if not self.packed:
            return actual
        return f"{actual}, cu_seqlens_q_padded {[0, *itertools.accumulate(2 * self.cp * L for L in self.chunks)]}"

    def digest(self) -> int:
        """A 63-bit digest of the lengths (0 without cu_seqlens): what the ranks compare."""
        if self.lengths is None:
            return 0
        text = repr((self.packed, self.chunks, self.lengths)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# --------------------------------------------------------------------------- checks


def _values(name: str, cu, device) -> List[int]:
    _check_cu(name, cu, device)
    values = cu.tolist()
    _check_values(name, values, None, None, "q")
    return values


def _self_attention(name_q: str, cu_q, name_kv: str, cu_kv, device) -> Optional[List[int]]:
    """The values of cu_q; cu_kv, when given, must hold the same (self-attention)."""
    if cu_q is None:
        if cu_kv is not None:
            raise ValueError(f"{name_kv} was given without {name_q}")
        return None
    values = _values(name_q, cu_q, device)
    if cu_kv is not None and cu_kv is not cu_q and _values(name_kv, cu_kv, device) != values:
        raise ValueError(f"context parallelism runs self-attention: {name_kv} must be None or equal {name_q} "
                         f"({values}), got {cu_kv.tolist()}")
    return values


#: checked Seqs by the lengths' tensors (every layer of a model passes the same ones: their values are read once)
_SEQS = TensorValueCache()


def sequences(q: torch.Tensor, qkv_format: str, cp: int, padding: bool, cu_seqlens_q, cu_seqlens_kv,
              cu_seqlens_q_padded, cu_seqlens_kv_padded) -> Seqs:
    """The Seqs of a call on this rank's q (its shard, in qkv_format), checked: ValueError/TypeError naming the
    argument. padding: the mask type is a padding one (bshd/sbhd then need cu_seqlens_q)."""
    lengths = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    return _SEQS.get(lengths, (qkv_format, cp, padding, tuple(q.shape), q.device),
                     lambda: _sequences(q, qkv_format, cp, padding, *lengths))


def _sequences(q: torch.Tensor, qkv_format: str, cp: int, padding: bool, cu_seqlens_q, cu_seqlens_kv,
               cu_seqlens_q_padded, cu_seqlens_kv_padded) -> Seqs:
    device = q.device
    actual = _self_attention("cu_seqlens_q", cu_seqlens_q, "cu_seqlens_kv", cu_seqlens_kv, device)
    padded = _self_attention("cu_seqlens_q_padded", cu_seqlens_q_padded, "cu_seqlens_kv_padded",
                             cu_seqlens_kv_padded, device)
    if qkv_format == "thd":
        return _packed(q.shape[0], cp, actual, padded)
    if padded is not None:
        raise ValueError(f"cu_seqlens_q_padded/cu_seqlens_kv_padded place the sequences of a packed batch: they "
                         f"apply to qkv_format='thd', got qkv_format={qkv_format!r}")
    s, batch = q.shape[qkv_format.index("s")], q.shape[qkv_format.index("b")]
    if cp > 1 and (s % 2 or (s // 2) % MX_BLOCK or s == 0):
        raise ValueError(
            f"q, k, v have {s} tokens along the sequence dim on this rank, so the sequence has {cp * s} "
            f"tokens: it must split into 2 * cp_size = {2 * cp} chunks of a multiple of {MX_BLOCK} tokens "
            f"(whole MXFP8 blocks per chunk, so every rank quantizes the blocks the single-device call does); "
            f"pad the sequence to a multiple of {2 * cp * MX_BLOCK} tokens")
    if padding and actual is None:
        raise ValueError("a padding attn_mask_type needs cu_seqlens_q (int32 [batch + 1], the whole sequences' "
                         "valid lengths, the same on every rank)")
    if not padding and actual is not None:
        raise ValueError("cu_seqlens_q/cu_seqlens_kv are valid lengths of a padded batch: use a padding "
                         "attn_mask_type ('padding', 'padding_causal', 'padding_causal_bottom_right') with them")
    lengths = None
    if actual is not None:
        if len(actual) != batch + 1:
            raise ValueError(f"cu_seqlens_q has {len(actual)} entries but q has batch size {batch} "
                             f"(expected {batch + 1})")
        lengths = tuple(b - a for a, b in zip(actual, actual[1:]))
        if lengths and max(lengths) > cp * s:
            raise ValueError(f"cu_seqlens_q: sequence length {max(lengths)} exceeds the whole sequence's "
                             f"{cp * s} tokens (cp_size * {s} on this rank)")
    return Seqs(cp, False, (s // 2,) * batch, lengths, s, (0,) * batch)


def _packed(tokens: int, cp: int, actual: Optional[List[int]], padded: Optional[List[int]]) -> Seqs:
    """The Seqs of a thd shard of `tokens` tokens."""
    if actual is None:
        raise ValueError("qkv_format='thd' needs cu_seqlens_q (int32 [batch + 1], the sequences' valid lengths; "
                         "cu_seqlens_q_padded their padded lengths)")
    padded = actual if padded is None else padded
    if len(padded) != len(actual):
        raise ValueError(f"cu_seqlens_q_padded has {len(padded)} entries and cu_seqlens_q {len(actual)}: they "
                         f"describe the same sequences")
    if padded[-1] != cp * tokens:
        raise ValueError(f"cu_seqlens_q_padded ends at {padded[-1]}, but the whole packed batch has cp_size * "
                         f"{tokens} = {cp * tokens} tokens (q, k, v have {tokens} on this rank)")
    quantum = 2 * cp * MX_BLOCK if cp > 1 else 2
    chunks, lengths = [], []
    for b in range(len(actual) - 1):
        size, n = padded[b + 1] - padded[b], actual[b + 1] - actual[b]
        if size % quantum:
            raise ValueError(
                f"sequence {b} has {size} tokens in cu_seqlens_q_padded: each padded sequence must split into "
                f"2 * cp_size = {2 * cp} chunks of a multiple of {MX_BLOCK} tokens (whole MXFP8 blocks per "
                f"chunk); pad it to a multiple of {quantum} tokens ({-(-size // quantum) * quantum})")
        if n > size:
            raise ValueError(f"sequence {b} has {n} tokens in cu_seqlens_q but only {size} in cu_seqlens_q_padded")
        chunks.append(size // (2 * cp))
        lengths.append(n)
    return Seqs(cp, True, tuple(chunks), tuple(lengths), tokens, tuple(p // cp for p in padded[:-1]))


__all__ = ["Seqs", "Side", "add_at", "put", "sequences", "step_seqinfo", "take"]
