"""One uint8 block for what a compiled forward keeps for its backward (stats and the saved FP8 copies).

Under `torch.compile`, every tensor the forward op returns is a separate output of the compiled graph, a separate
saved tensor of its autograd node and a separate input of the backward op: a dozen for the default saved format,
each costing host time per call (an allocation, the dispatcher's boxing, AOTAutograd's bookkeeping). A custom op's
returns may not share storage, so they cannot be views of one allocation either. The packed ops
(`mxattn::attention_fwd_packed` / `attention_bwd_packed`) therefore return O and ONE uint8 block holding stats and
the saved tensors at fixed offsets, and the backward op takes the block back.

The block's layout depends on the call's shapes and qkv_format alone (q's, k's, v's shapes, their dtype, a
packed batch's number of sequences): stats ([B,Hq,Sq,1] fp32) then the saved format's tensors as its
`fake_tensors` lays them out for q, k, v dense in qkv_format order, each at a multiple of 256 bytes (`ALIGN`,
where `mxattn.runtime.launch_plan` carves a replay's outputs). Not the inputs' strides: a compiled graph may hand
the op other strides at run time than the ones traced above it (inductor chooses its buffers' layouts), so strides
recorded at trace time could not tell the backward how the forward laid its tensors out. The forward asks its
backend for saved tensors in that layout (`AttentionParams.saved_layout`: what dense inputs in qkv_format give
anyway, and what the backward's dK, dV then follow, as the op promises them); a replay of a backend that honours
it leaves them in the block as they are.
"""

from __future__ import annotations

import itertools
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from .launch_plan import _ALIGN as ALIGN  # (each tensor's byte alignment: where replays carve)
from .launch_plan import block_views
from ..layouts import empty_bhsd
from ..seqinfo import SeqInfo


class BlockLayout(NamedTuple):
    """Where each kept tensor lies in the block: entries (byte offset, shape, strides, dtype), stats first, then
    the saved format's tensors in `tensors()` order; nbytes: the block's size; offsets: the entries' offsets."""

    entries: Tuple[tuple, ...]
    nbytes: int
    offsets: Tuple[int, ...]


def layout_of(tensors: Sequence[torch.Tensor]) -> BlockLayout:
    """The block layout holding tensors (real, meta or fake; sizes may be symbolic) in order, each at the next
    multiple of `ALIGN` bytes, spanning its elements' extent (what `torch.empty_strided` of its shape and strides
    allocates)."""
    entries, offset = [], 0
    for t in tensors:
        shape, stride = tuple(t.shape), tuple(t.stride())
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        entries.append((offset, shape, stride, t.dtype))
        offset = offset + (extent * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
    return BlockLayout(tuple(entries), offset, tuple(e[0] for e in entries))


def shapes(q_shape, kv_shape, v_head_dim) -> Tuple[tuple, tuple, tuple]:
    """(q's, k's, v's shapes) from what the backward op has: dO's or q's shape [B,Hq,Sq,*], K's [B,Hkv,Skv,Dqk]
    and V's head dim (dO's last)."""
    return (*q_shape[:3], kv_shape[3]), tuple(kv_shape), (*kv_shape[:3], v_head_dim)


def fake_layout(saved_format, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str,
                seq: Optional[SeqInfo]) -> BlockLayout:
    """The block layout for inputs shaped and typed as q, k, v [B,H,S,D] (real, meta or fake tensors; their
    strides do not matter): stats, then what `saved_format.fake_tensors` promises for inputs dense in qkv_format
    order."""
    stats = q.new_empty((*q.shape[:3], 1), dtype=torch.float32)
    dense = [empty_bhsd(tuple(x.shape), qkv_format, x.dtype, x.device) for x in (q, k, v)]
    return layout_of([stats, *saved_format.fake_tensors(*dense, seq)])


#: (saved_format, shapes, dtype, qkv_format, segment counts) -> (small id, BlockLayout): `layout_for`'s cache
_LAYOUTS: dict = {}
_LAYOUT_IDS = itertools.count()


def layout_for(saved_format, q_shape, k_shape, v_shape, dtype: torch.dtype, qkv_format: str,
               seq: Optional[SeqInfo]) -> Tuple[int, BlockLayout]:
    """(an id naming the layout for as long as the process runs, the layout) for inputs of dtype with these
    [B,H,S,D] shapes in qkv_format, computed once per signature on the meta device (it depends on a packed
    batch's number of sequences, not on the lengths)."""
    key = (saved_format, tuple(q_shape), tuple(k_shape), tuple(v_shape), dtype, qkv_format,
           None if seq is None else (seq.packed, seq.cu_seqlens_q.shape[0], seq.cu_seqlens_kv.shape[0]))
    hit = _LAYOUTS.get(key)
    if hit is None:
        q, k, v = (torch.empty(shape, dtype=dtype, device="meta") for shape in key[1:4])
        if len(_LAYOUTS) >= 1024:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = (next(_LAYOUT_IDS), fake_layout(saved_format, q, k, v, qkv_format, seq))
    return hit


def unpack(block: torch.Tensor, layout: BlockLayout) -> List[torch.Tensor]:
    """The kept tensors as views of block (uint8 [layout.nbytes]): [stats, *saved]."""
    return block_views(block, layout.entries)


def pack(tensors: Sequence[torch.Tensor], layout: BlockLayout) -> torch.Tensor:
    """A new block (uint8 [layout.nbytes] on tensors' device) holding copies of tensors ([stats, *saved], shaped
    as layout says) at their places."""
    block = torch.empty(layout.nbytes, dtype=torch.uint8, device=tensors[0].device)
    for view, t in zip(unpack(block, layout), tensors):
        if view.shape != t.shape or view.dtype != t.dtype:
            raise RuntimeError(f"a kept tensor {tuple(t.shape)} {t.dtype} does not match its block entry "
                               f"{tuple(view.shape)} {view.dtype} (the saved format's fake_tensors)")
        view.copy_(t)
    return block


__all__ = ["ALIGN", "BlockLayout", "layout_of", "shapes", "fake_layout", "layout_for", "unpack", "pack"]
