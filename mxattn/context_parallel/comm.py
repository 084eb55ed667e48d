"""The collectives context parallelism uses, in forms that both gloo (CPU) and NCCL (CUDA) run:
all_to_all_single, all_gather into a list, reduce_scatter from a list, and batch_isend_irecv for the ring.
Tensors of several dtypes travel together as bytes (one collective instead of several)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist


def pack_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' contents (any dtypes, any layouts) concatenated as one flat uint8 tensor."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack_bytes(flat: torch.Tensor, likes: Sequence[tuple]) -> List[torch.Tensor]:
    """The inverse of `pack_bytes`: likes is [(shape, dtype)] in packing order; returns views of flat."""
    out, at = [], 0
    for shape, dtype in likes:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        out.append(flat[at:at + n].view(dtype).view(shape))
        at += n
    return out


def all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """send [cp, n]: row j goes to rank j -> [cp, n]: row i came from rank i."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def all_gather(x: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's x (one shape and dtype everywhere), in group-rank order."""
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out


def reduce_scatter(pieces: Sequence[torch.Tensor], group) -> torch.Tensor:
    """pieces[j] (one shape and dtype for every j) summed over the ranks into rank j's result."""
    pieces = [p.contiguous() for p in pieces]
    out = torch.empty_like(pieces[0])
    dist.reduce_scatter(out, pieces, group=group)
    return out


#: side streams for ring exchanges on CUDA, one per device (when the caller gives no cp_stream)
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device, cp_stream) -> Optional["torch.cuda.Stream"]:
    if device.type != "cuda":
        return None
    if cp_stream is not None:
        return cp_stream
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


class Pending:
    """An exchange in flight: `wait()` returns the received tensor once it has arrived (and, on CUDA, makes the
    current stream wait for it)."""

    def __init__(self, works, recv: torch.Tensor, send: torch.Tensor):
        self._works, self._recv, self._send = works, recv, send

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._send = (), None  # (the send buffer may be reused from here on)
        return self._recv


class Ring:
    """Neighbour exchanges on the ring of a group's ranks: each rank sends to rank + 1 and receives from rank - 1
    (group ranks; the P2P ops address global ranks, `cp_global_ranks`). On CUDA the operations are issued on
    cp_stream (or a side stream) so that they overlap the compute the caller issues next."""

    def __init__(self, group, global_ranks: Sequence[int], rank: int, cp_stream=None, tag: int = 0):
        size = len(global_ranks)
        self.group = group
        self.next = global_ranks[(rank + 1) % size]
        self.prev = global_ranks[(rank - 1) % size]
        self.cp_stream = cp_stream
        self.tag = tag  # tells this ring's messages from another's running beside it (gloo matches by tag)

    def exchange(self, send: torch.Tensor) -> Pending:
        """Send `send` (contiguous) to the next rank and receive a tensor like it from the previous one, without
        waiting; the caller must not write to `send` before `wait()`."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, self.tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, self.tag)]
        stream = _side_stream(send.device, self.cp_stream)
        if stream is None:
            return Pending(dist.batch_isend_irecv(ops), recv, send)
        stream.wait_stream(torch.cuda.current_stream(send.device))  # (send was written on the compute stream)
        with torch.cuda.stream(stream):
            works = dist.batch_isend_irecv(ops)
        return Pending(works, recv, send)
