"""A paged KV cache in MXFP8 (serving); the decode/append attention call that reads it: `mxattn.kvcache_call`.

Storage (per page of `page_size` tokens, a multiple of 32, for all KV heads):

* K row-wise: E4M3 bytes [H, page_size, D] and one E8M0 scale per 32 values along D [H, page_size, ceil(D/32)].
  A token's bytes never change once written.
* V column-wise, as the recipe quantizes V: E4M3 bytes [H, page_size, Dv] and one E8M0 scale per 32 tokens
  [H, page_size / 32, Dv]. Blocks run along the sequence from its first token, so a block is quantized once it
  holds 32 tokens ("sealed"); until then the sequence's open block stays in the cache's high-precision dtype
  (one [H, 32, Dv] tail per sequence) and is quantized at each call from what it holds.
* Dv, V's head dim, is D unless the cache is made with another (`head_dim_v`: MLA's d_v != d_qk).

Semantics: after a sequence holds L tokens, attention of its n newest queries equals
``mxfp8_attention(q, K[:L], V[:L], attn_mask_type="causal_bottom_right", ...)`` over the same tokens, bit for bit on
the reference backend (K's bytes are the row-wise quantization of each token, V's full blocks are the same 32
tokens quantized the same way, and V's open block is quantized from the same rows). Bytes: about 0.53x of a
bf16 cache at D=128 (1 + 1/32 bytes per value for K and V) plus the open blocks.

"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from .constants import ceil_div
from .formats import BLOCK_SIZE, MXFP8Tensor, cat_bytes, quantize_mxfp8
from .devices import host_to_device

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def seal_value_blocks(open_rows: torch.Tensor, new_rows: torch.Tensor
                      ) -> Tuple[Optional[MXFP8Tensor], torch.Tensor]:
    """V's blocks along the sequence as tokens arrive: open_rows (the rows of the block not yet full) and
    new_rows, [..., n, D] along dim -2, -> (the full blocks they complete, quantized column-wise, or None;
    the rows left open)."""
    rows = torch.cat([open_rows, new_rows], dim=-2)
    full = rows.shape[-2] // BLOCK_SIZE * BLOCK_SIZE
    sealed = quantize_mxfp8(rows[..., :full, :], axis=-2) if full else None
    return sealed, rows[..., full:, :]


#: int32 device copies of host int tuples by (values, device): `_device_ints`
_DEVICE_INTS: dict = {}


def _device_ints(values: tuple, device: torch.device) -> torch.Tensor:
    """int32 [len(values)] on `device`, shared by every call with the same values (read only: kernels never
    write it). A decode step hands each layer's cache the same offsets and lengths, so one copy serves them all."""
    key = (values, device)
    t = _DEVICE_INTS.get(key)
    if t is None:
        if len(_DEVICE_INTS) >= 32:
            _DEVICE_INTS.clear()
        t = _DEVICE_INTS[key] = host_to_device(list(values), torch.int32, device)
    return t


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] itself when its head dim has unit stride (what the paged kernels read), else a contiguous copy."""
    return x if x.stride(2) == 1 else x.contiguous()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte tensor (FP8 data, E8M0 scales) viewed as uint8: index_put has no float8 kernels."""
    return t.view(torch.uint8)


class MXFP8KVCache:
    """Paged MXFP8 storage of the keys and values of up to `max_sequences` sequences.

    num_pages pages of page_size tokens (a multiple of 32) for kv_heads heads of head_dim (K's, and Q's) and
    head_dim_v (V's, and O's; None: head_dim); dtype: the dtype of the K/V the model writes (the open V block is
    kept in it). A cache of two head dims is read by the reference backend (the paged kernels take one).
    Sequences live in slots (`new_sequence`, `release`); `append` writes tokens; `page_table` (int32
    [max_sequences, max_pages_per_sequence], -1 unused) and `seq_lens` (int32 [max_sequences]) describe the layout
    on the device."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, *, max_sequences: int,
                 dtype: torch.dtype = torch.bfloat16, device="cpu", head_dim_v: Optional[int] = None):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("head_dim_v", head_dim_v), ("max_sequences", max_sequences)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if page_size % BLOCK_SIZE:
            raise ValueError(f"page_size must be a multiple of {BLOCK_SIZE} (V's MXFP8 blocks run along the "
                             f"sequence and must not straddle pages), got {page_size}")
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES}, got {dtype}")
        self.page_size, self.kv_heads, self.head_dim, self.dtype = page_size, kv_heads, head_dim, dtype
        self.head_dim_v = head_dim_v
        self.device = torch.device(device)
        h, p, d, dv, nb = kv_heads, page_size, head_dim, head_dim_v, ceil_div(head_dim, BLOCK_SIZE)
        fp8, e8 = torch.float8_e4m3fn, torch.float8_e8m0fnu
        self.k_data = torch.zeros((num_pages, h, p, d), dtype=fp8, device=self.device)
        self.k_scale = torch.zeros((num_pages, h, p, nb), dtype=e8, device=self.device)
        self.v_data = torch.zeros((num_pages, h, p, dv), dtype=fp8, device=self.device)
        self.v_scale = torch.zeros((num_pages, h, p // BLOCK_SIZE, dv), dtype=e8, device=self.device)
        self.v_tail = torch.zeros((max_sequences, h, BLOCK_SIZE, dv), dtype=dtype, device=self.device)
        self.page_table = torch.full((max_sequences, num_pages), -1, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(max_sequences, dtype=torch.int32, device=self.device)
        self.device = self.k_data.device  # with its index ("cuda" -> "cuda:0"), as tensors report theirs
        self._pages: List[Optional[List[int]]] = [None] * max_sequences     # host copy of the table
        self._lens = [0] * max_sequences
        self._free = list(range(num_pages - 1, -1, -1))
        #: the storage tensors and what a replayed step's key needs of them (fixed for the cache's life)
        self.storage = (self.k_data, self.k_scale, self.v_data, self.v_scale, self.v_tail, self.page_table,
                        self.seq_lens)
        self.storage_key = tuple((t.shape, t.stride(), t.dtype, t.data_ptr() & 15) for t in self.storage) + (
            self.page_size, self.device)
        #: the cache's state: a hash of its geometry and of every change of its slots, pages and lengths since it
        #: was made (`_advance`), so caches made alike and changed alike (the layers of a model) have equal states
        self._state = hash(("MXFP8KVCache", num_pages, max_sequences, dtype, self.storage_key))
        #: appends run the Triton kernel (CUDA with Triton, one head dim); the torch path otherwise (the same bytes)
        self._append_kernel = self.device.type == "cuda" and head_dim_v == head_dim and _triton_importable()

    # ------------------------------------------------------------------ slots and pages

    @property
    def state(self) -> int:
        """A hash of the cache's geometry and of the history of its slots, pages and lengths: two caches with equal
        states hold the same sequences at the same lengths in the same pages (`PagedStep.run`)."""
        return self._state

    def _advance(self, *event) -> None:
        self._state = hash((self._state,) + event)

    def new_sequence(self) -> int:
        """A free slot for a new, empty sequence."""
        for slot, pages in enumerate(self._pages):
            if pages is None:
                self._pages[slot], self._lens[slot] = [], 0
                self.seq_lens[slot] = 0
                self._advance("new", slot)
                return slot
        raise RuntimeError(f"all {len(self._pages)} sequence slots are in use; release one first")

    def release(self, slot: int) -> None:
        """Free a sequence's pages and slot for reuse."""
        pages = self._checked_slot(slot)
        self._free.extend(reversed(pages))
        self._pages[slot], self._lens[slot] = None, 0
        self.page_table[slot] = -1
        self.seq_lens[slot] = 0
        self._advance("release", slot)

    def slot_tensor(self, slots: Sequence[int]) -> torch.Tensor:
        """int32 [len(slots)] of the slots on the cache's device (one copy per slots list: a decode loop asks for
        the same one every step, `_device_ints`)."""
        return _device_ints(tuple(slots), self.device)

    def length(self, slot: int) -> int:
        """Tokens held by the sequence in `slot`."""
        self._checked_slot(slot)
        return self._lens[slot]

    def _checked_slot(self, slot) -> List[int]:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(self._pages):
            raise ValueError(f"slot must be an int in [0, {len(self._pages)}), got {slot!r}")
        if self._pages[slot] is None:
            raise ValueError(f"slot {slot} holds no sequence (new_sequence() first)")
        return self._pages[slot]

    def _check_slots(self, slots: List[int]) -> None:
        """Raise unless slots are distinct slots holding sequences."""
        pages = self._pages
        for slot in slots:
            if slot.__class__ is not int or not 0 <= slot < len(pages) or pages[slot] is None:
                self._checked_slot(slot)   # (raises, naming what is wrong)
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {slots}")

    def _spans(self, slot: int, start: int, n: int):
        """(page, offset in page, offset in the written rows, count) pieces of tokens start .. start + n."""
        pages, done = self._pages[slot], 0
        while done < n:
            pos = start + done
            off = pos % self.page_size
            count = min(n - done, self.page_size - off)
            yield pages[pos // self.page_size], off, done, count
            done += count

    # ------------------------------------------------------------------ writing

    def append(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write n new tokens of one sequence: k [n, kv_heads, head_dim], v [n, kv_heads, head_dim_v] in the
        cache's dtype and device."""
        self._checked_slot(slot)
        n = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else 0
        self.append_batch([slot], k, v, [0, n])

    def append_batch(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor, cu: Sequence[int]) -> None:
        """Write new tokens of several sequences at once: k [T, kv_heads, head_dim], v [T, kv_heads, head_dim_v] in
        the cache's dtype and device; tokens cu[i] .. cu[i + 1] (host ints, cu[0] = 0, cu[-1] = T) go to the
        sequence in slots[i]. Everything is checked before anything is written (on an error the cache is
        unchanged). On CUDA the writes are one Triton kernel (`mxattn.kernels.triton_paged_append`; two when a call
        seals a block and opens another behind rows already open; a cache of two head dims takes the torch path),
        elsewhere a few batched torch kernels; the bytes are the same."""
        self._append(slots, k, v, cu)

    def _reserve(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor, cu: Sequence[int]):
        """Check an `append_batch` (raising before anything changes) and map the pages its tokens need ->
        (slots, cu, lengths before the call, new tokens per sequence) as lists of host ints."""
        slots, cu, starts, counts, table = self._plan_pages(slots, k, v, cu)
        self._map_pages(table)
        return slots, cu, starts, counts

    def _plan_pages(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor, cu: Sequence[int]):
        """`_reserve`'s checks and page choice, changing nothing -> (slots, cu, lengths before the call, new
        tokens per sequence, the pages to map: [(slot, index in its table, page)])."""
        slots = list(slots)
        self._check_slots(slots)
        for name, x, d in (("k", k, self.head_dim), ("v", v, self.head_dim_v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[1:]) != (self.kv_heads, d):
                raise ValueError(f"{name} must be [n, {self.kv_heads}, {d}], got {tuple(getattr(x, 'shape', ()))}")
            if x.dtype != self.dtype or x.device != self.device:
                raise TypeError(f"{name} must be {self.dtype} on {self.device}, got {x.dtype} on {x.device}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must hold the same number of tokens, got {k.shape[0]} and {v.shape[0]}")
        cu = [int(c) for c in cu]
        if len(cu) != len(slots) + 1 or cu[0] != 0 or cu[-1] != k.shape[0]:
            raise ValueError(f"cu must rise from 0 to T={k.shape[0]} in len(slots) + 1 = {len(slots) + 1} offsets, "
                             f"got {cu}")
        counts, starts, need, page = [], [], 0, self.page_size
        for s, a, b in zip(slots, cu, cu[1:]):      # (one pass: a decode step runs this for every layer)
            if b < a:
                raise ValueError(f"cu must rise from 0 to T={k.shape[0]}, got {cu}")
            st, held = self._lens[s], len(self._pages[s]) * page
            counts.append(b - a)
            starts.append(st)
            if st + b - a > held:
                need += ceil_div(st + b - a - held, page)
        if need > len(self._free):
            raise RuntimeError(f"the cache is out of pages: these sequences need {need} more, {len(self._free)} are "
                               f"free (num_pages={self.k_data.shape[0]})")
        table, taken = [], len(self._free)           # (slot, index, page) of the pages to take, last free first
        for s, st, n in zip(slots, starts, counts):
            held = len(self._pages[s])
            while held * page < st + n:
                taken -= 1
                table.append((s, held, self._free[taken]))
                held += 1
        return slots, cu, starts, counts, table

    def _map_pages(self, table: List[Tuple[int, int, int]], entries: Optional[torch.Tensor] = None
                   ) -> Optional[torch.Tensor]:
        """Take the pages `_plan_pages` chose (table; entries: the same as an int64 [n, 3] device tensor, made
        here when None) -> entries (None for an empty table)."""
        if not table:
            return None
        for s, index, page in table:
            if self._free[-1] != page or len(self._pages[s]) != index:
                raise RuntimeError("the cache changed since these pages were chosen")
            self._pages[s].append(self._free.pop())
        if entries is None:
            entries = host_to_device(table, torch.int64, self.device)
        self.page_table[entries[:, 0], entries[:, 1]] = entries[:, 2].to(torch.int32)
        self._advance("map", tuple(table))
        return entries

    def _step_meta(self, cu: List[int], slots: List[int], starts: List[int]) -> torch.Tensor:
        """int32 [3 * B + 1] on the device: cu, slots, lengths before the call (what the append kernel reads;
        the attention kernels read its first two parts). The copy is shared by calls with the same values (every
        layer of a model's decode step), so most calls make no host-to-device copy."""
        return _device_ints(tuple(cu + slots + starts), self.device)

    def _commit(self, slots: List[int], starts: List[int], counts: List[int]) -> None:
        """Record on the host the lengths the append's kernel (or torch path) wrote to `seq_lens`."""
        for s, st, n in zip(slots, starts, counts):
            self._lens[s] = st + n
        self._advance("commit", tuple(slots), tuple(counts))

    @staticmethod
    def _append_shape(starts: List[int], counts: List[int]) -> Optional[Tuple[int, bool]]:
        """`paged_append`'s (blocks, deferred tails) for these lengths and new tokens; None if nothing is new."""
        blocks, deferred = 0, False
        for st, n in zip(starts, counts):
            if n:
                first, last = st // BLOCK_SIZE, (st + n - 1) // BLOCK_SIZE
                blocks = max(blocks, last - first + 1)
                deferred = deferred or (last != first and st % BLOCK_SIZE != 0 and (st + n) % BLOCK_SIZE != 0)
        return (blocks, deferred) if blocks else None

    def _append(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor, cu: Sequence[int]) -> None:
        """`append_batch`."""
        slots, cu, starts, counts = self._reserve(slots, k, v, cu)
        if k.shape[0] == 0:
            return
        if self._append_kernel:
            from .kernels.triton_paged_append import paged_append
            paged_append(self, _unit_stride(k), _unit_stride(v),
                         self._step_meta(cu, slots, starts), len(slots), *self._append_shape(starts, counts))
            self._commit(slots, starts, counts)
            return
        # K, row-wise: each token's bytes land in its page once
        pos_page, pos_off = [], []
        for s, st, n in zip(slots, starts, counts):
            pages = self._pages[s]
            for pos in range(st, st + n):
                pos_page.append(pages[pos // self.page_size])
                pos_off.append(pos % self.page_size)
        # V, column-wise along the sequence: each sequence's open rows (v_tail) then its new rows; the blocks of 32
        # they fill are sealed into their pages, the rest is the new open block. Rows are named in `src`: the
        # used slots' open blocks flattened, then the new tokens.
        seal_rows, seal_page, seal_off, block_page, block_off, rest_rows, rest_slot, rest_pos = ([] for _ in range(8))
        for i, (s, st, n) in enumerate(zip(slots, starts, counts)):
            opened = st % BLOCK_SIZE
            rows = [i * BLOCK_SIZE + r for r in range(opened)] + [len(slots) * BLOCK_SIZE + cu[i] + j for j in range(n)]
            full = len(rows) // BLOCK_SIZE * BLOCK_SIZE
            pages = self._pages[s]
            for j in range(0, full, BLOCK_SIZE):
                first = st - opened + j
                block_page.append(pages[first // self.page_size])
                block_off.append(first % self.page_size // BLOCK_SIZE)
                for r in range(BLOCK_SIZE):
                    seal_page.append(pages[(first + r) // self.page_size])
                    seal_off.append((first + r) % self.page_size)
            seal_rows += rows[:full]
            rest_rows += rows[full:]
            rest_slot += [s] * (len(rows) - full)
            rest_pos += list(range(len(rows) - full))
        index = host_to_device([pos_page, pos_off], torch.int64, self.device)
        kq = quantize_mxfp8(k, axis=-1)                                         # [T, H, D], blocks along D
        _bytes(self.k_data)[index[0], :, index[1]] = _bytes(kq.data)
        _bytes(self.k_scale)[index[0], :, index[1]] = _bytes(kq.scale)
        h, d = self.kv_heads, self.head_dim_v
        slot_index = self.slot_tensor(slots).long()          # (device indices: a host list would be copied)
        src = torch.cat([self.v_tail[slot_index].transpose(1, 2).reshape(-1, h, d), v])   # [S * 32 + T, H, D]
        if seal_rows:
            sealed = host_to_device([seal_rows, seal_page, seal_off], torch.int64, self.device)
            blocks = host_to_device([block_page, block_off], torch.int64, self.device)
            vq = quantize_mxfp8(src[sealed[0]].view(-1, BLOCK_SIZE, h, d), axis=1)    # [blocks, 32, H, D]
            _bytes(self.v_data)[sealed[1], :, sealed[2]] = _bytes(vq.data).view(-1, h, d)
            _bytes(self.v_scale)[blocks[0], :, blocks[1]] = _bytes(vq.scale).view(-1, h, d)
        if rest_rows:
            rest = host_to_device([rest_rows, rest_slot, rest_pos], torch.int64, self.device)
            self.v_tail[rest[1], :, rest[2]] = src[rest[0]]
        self._commit(slots, starts, counts)
        self.seq_lens[slot_index] = host_to_device([st + n for st, n in zip(starts, counts)], torch.int32,
                                                   self.device)

    # ------------------------------------------------------------------ reading

    def keys(self, slot: int) -> MXFP8Tensor:
        """The sequence's K, row-wise MXFP8 [1, kv_heads, L, head_dim]."""
        self._checked_slot(slot)
        length = self._lens[slot]
        data, scale = self._gather(slot, length, self.k_data, self.k_scale, 1)
        return MXFP8Tensor.unchecked(data.unsqueeze(0), scale.unsqueeze(0), 3)

    def values(self, slot: int) -> MXFP8Tensor:
        """The sequence's V, column-wise MXFP8 [1, kv_heads, L, head_dim_v]: its sealed blocks, and the open block
        quantized from the rows it holds."""
        self._checked_slot(slot)
        length = self._lens[slot]
        sealed = length - length % BLOCK_SIZE
        data, scale = self._gather(slot, sealed, self.v_data, self.v_scale, BLOCK_SIZE)
        if length > sealed:
            tail = quantize_mxfp8(self.v_tail[slot, :, :length - sealed], axis=-2)
            data, scale = cat_bytes([data, tail.data], dim=1), cat_bytes([scale, tail.scale], dim=1)
        return MXFP8Tensor.unchecked(data.unsqueeze(0), scale.unsqueeze(0), 2)

    def _gather(self, slot: int, n: int, data: torch.Tensor, scale: torch.Tensor, per_scale: int):
        """Tokens 0 .. n of a sequence from paged storage: (data [H, n, D], scale [H, n / per_scale, *])."""
        parts_d, parts_s = [], []
        for page, off, _, count in self._spans(slot, 0, n):
            parts_d.append(data[page, :, off:off + count])
            parts_s.append(scale[page, :, off // per_scale:(off + count) // per_scale])
        if not parts_d:
            return data[0, :, :0], scale[0, :, :0]
        return cat_bytes(parts_d, dim=1), cat_bytes(parts_s, dim=1)

    def nbytes(self) -> int:
        """Bytes of the cache's storage (pages, open blocks, tables)."""
        return sum(t.numel() * t.element_size() for t in (self.k_data, self.k_scale, self.v_data, self.v_scale,
                                                          self.v_tail, self.page_table, self.seq_lens))

    def bf16_nbytes(self) -> int:
        """Bytes a bf16 cache of the same pages would take (K and V)."""
        return (self.k_data.numel() + self.v_data.numel()) * 2


__all__ = ["MXFP8KVCache", "seal_value_blocks"]
