"""Transformer Engine's load-balanced sequence layout for context parallelism, and its chunk maths.

A sequence of S tokens is cut into 2 * cp chunks of L = S / (2 * cp) tokens; rank r holds chunks r and
2 * cp - 1 - r, concatenated in that order along the sequence dim of its q, k, v (so under a causal mask every
rank does the same work). With L a multiple of 32, every MXFP8 block of 32 tokens along the sequence lies inside
one chunk, so each rank quantizes exactly the blocks the single-device call does.

A packed batch (thd) is split the same way sequence by sequence (Transformer Engine's thd layout): each sequence is
padded (cu_seqlens_padded, int32 [B+1]) to a multiple of 2 * cp tokens and cut into 2 * cp chunks of its own, and
rank r's shard holds, for every sequence in turn, its chunks r and 2 * cp - 1 - r back to back.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def local_chunks(cp_size: int, rank: int) -> Tuple[int, int]:
    """The two chunk indices (of 2 * cp_size) rank `rank` holds, in the order they sit in its shard."""
    return rank, 2 * cp_size - 1 - rank


def _check_split(length: int, cp_size: int, what: str) -> int:
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if length % (2 * cp_size):
        raise ValueError(f"{what} has {length} tokens along the sequence dim, which does not split into "
                         f"2 * cp_size = {2 * cp_size} equal chunks")
    return length // (2 * cp_size)


def shard_sequence(x: torch.Tensor, cp_size: int, rank: int, seq_dim: int,
                   cu_seqlens_padded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor in Transformer Engine's load-balanced layout.

    x: any tensor with the sequence (S tokens) along `seq_dim` (1 for bshd, 0 for sbhd and thd). Returns a new
    tensor (same dtype and device) with 2 * S / (2 * cp_size) tokens along seq_dim: chunks `rank` and
    `2 * cp_size - 1 - rank` of the 2 * cp_size equal chunks, concatenated. Differentiable.
    cu_seqlens_padded (thd): int32 [B+1] offsets of the padded sequences packed along seq_dim (the last one S):
    the shard is then every sequence's chunks `rank` and `2 * cp_size - 1 - rank`, sequence after sequence.
    Raises ValueError when S (a padded sequence) does not split into 2 * cp_size chunks or rank is out of
    range."""
    _check_rank(rank, cp_size)
    if cu_seqlens_padded is not None:
        return x.index_select(seq_dim, _thd_positions(cu_seqlens_padded, x.shape[seq_dim], cp_size, rank, x.device))
    chunk = _check_split(x.shape[seq_dim], cp_size, "x")
    first, second = local_chunks(cp_size, rank)
    return torch.cat([x.narrow(seq_dim, first * chunk, chunk), x.narrow(seq_dim, second * chunk, chunk)],
                     dim=seq_dim)


def unshard_sequence(shards: Sequence[torch.Tensor], seq_dim: int,
                     cu_seqlens_padded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse of `shard_sequence`: every rank's shard, in rank order, back to the full sequence.

    shards: cp_size tensors of one shape with 2 * L tokens along seq_dim -> a tensor with 2 * cp_size * L
    tokens, chunks in their natural order; with cu_seqlens_padded (thd, as `shard_sequence` takes it) the
    packed padded sequences in order. Differentiable."""
    cp_size = len(shards)
    if cp_size == 0:
        raise ValueError("unshard_sequence needs at least one shard")
    shape = shards[0].shape
    if any(s.shape != shape for s in shards):
        raise ValueError(f"every shard must have one shape, got {[tuple(s.shape) for s in shards]}")
    if cu_seqlens_padded is not None:
        total = cp_size * shape[seq_dim]
        order = torch.cat([_thd_positions(cu_seqlens_padded, total, cp_size, r, torch.device("cpu"))
                           for r in range(cp_size)])
        return torch.cat(list(shards), dim=seq_dim).index_select(seq_dim, torch.argsort(order).to(shards[0].device))
    if shape[seq_dim] % 2:
        raise ValueError(f"a shard holds two equal chunks along seq_dim, got {shape[seq_dim]} tokens")
    return torch.cat(natural_chunks(shards, seq_dim), dim=seq_dim)


def _check_rank(rank, cp_size) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < max(cp_size, 1):
        raise ValueError(f"rank must be an int in [0, cp_size={cp_size}), got {rank!r}")


def _thd_positions(cu_seqlens_padded, total: int, cp_size: int, rank: int, device) -> torch.Tensor:
    """int64 positions, in the packed padded batch of `total` tokens, of rank's thd shard in shard order."""
    offsets = [int(x) for x in (cu_seqlens_padded.tolist() if isinstance(cu_seqlens_padded, torch.Tensor)
                                else cu_seqlens_padded)]
    if not offsets or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"cu_seqlens_padded must run from 0 to the {total} packed tokens, got {offsets}")
    pieces = []
    for b, (start, end) in enumerate(zip(offsets, offsets[1:])):
        chunk = _check_split(end - start, cp_size, f"sequence {b} of cu_seqlens_padded")
        pieces += [torch.arange(start + c * chunk, start + (c + 1) * chunk) for c in local_chunks(cp_size, rank)]
    return torch.cat(pieces).to(device) if pieces else torch.zeros(0, dtype=torch.int64, device=device)


def natural_chunks(shards: Sequence[torch.Tensor], seq_dim: int) -> List[torch.Tensor]:
    """The 2 * cp chunks of every rank's shard (rank order) as views, in their natural sequence order."""
    cp_size = len(shards)
    chunk = shards[0].shape[seq_dim] // 2
    out = []
    for c in range(2 * cp_size):
        owner, half = (c, 0) if c < cp_size else (2 * cp_size - 1 - c, 1)
        out.append(shards[owner].narrow(seq_dim, half * chunk, chunk))
    return out


__all__ = ["local_chunks", "natural_chunks", "shard_sequence", "unshard_sequence"]
