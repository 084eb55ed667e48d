"""What cuDNN's MXFP8 graphs read and write, made from mxattn's tensors: the F8_128x4 scale buffers (dense and
packed), the variable-length tensors, the variant packs and the operands of an `MXFP8Tensor`.

Scale-factor layout (E8M0, `F8_128x4` reordering), as the cuDNN MXFP8 graph consumes it:
  * row-wise scales (Q, K, dO, backward V; blocks along D): graph dims [B, H, Sp, D32p]; each (b, h) slab is the
    M=S x K=ceil(D/32) matrix in 128x4 tiles, byte of (m, k) inside the slab
    ``((m//128)*(D32p//4) + k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4``, slabs one after another in (b, h)
    order (spec section 4).
  * column-wise scales (forward V, Q_T, K_T, dO_T; blocks along S): graph dims [B, H, S32p, Dp]. The 128x4 rule
    is applied to the transpose of the WHOLE column-wise scale, i.e. the matrix M=D x K=B*H*S32p (each slab's
    ceil(S/32) scale rows zero-padded to S32p first). Byte of (b, h, k, m):
    ``((m//128)*(B*H*S32p//4) + (b*H+h)*(S32p//4) + k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4``.
    For D <= 128 (one 128-row D tile) this equals the per-slab formula of spec section 4; for D > 128 (Q_T/K_T at
    d_qk=192) cuDNN wants the D tile as the OUTER index across all heads ("D-plane-major": see the frontend's
    ``cudnn/sdpa/kernels/_mxfp8_sf.py`` docstring and its test quantizer, which swizzles the transposed
    [D, B*H*S32] matrix), which differs from the spec's per-slab order.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ...constants import MX_BLOCK, SF_TILE
from ...formats import MXFP8Tensor, swizzle_128x4
from .config import (SCALE_DTYPE, GraphConfig, SlotNames, col_scale_dims, col_scale_stride,
                     row_scale_dims)

# ---------------------------------------------------------------------------------------------------------------
# scale buffers (compact E8M0 scales -> the F8_128x4 bytes cuDNN reads)
# ---------------------------------------------------------------------------------------------------------------
def row_scale_buffer(scale: torch.Tensor) -> torch.Tensor:
    """Row-wise compact scale [B, H, S, ceil(D/32)] (e8m0) -> F8_128x4 buffer [B, H, Sp, D32p] (e8m0, row-major),
    each (b, h) slab swizzled on its own."""
    return swizzle_128x4(scale)


def col_scale_buffer(scale: torch.Tensor) -> torch.Tensor:
    """Column-wise compact scale [B, H, ceil(S/32), D] (e8m0) -> F8_128x4 buffer declared [B, H, S32p, Dp] with
    strides `col_scale_stride` (e8m0): `col_scale_tensor` of `col_scale_bytes`."""
    b, h, s32, d = scale.shape
    return col_scale_tensor(col_scale_bytes(scale), b, h, s32 * MX_BLOCK, d)


def col_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Column-wise compact scale [B, H, ceil(S/32), D] (e8m0) -> the bytes cuDNN reads, contiguous [Dp, B*H*S32p]
    (e8m0): each slab's scale rows zero-padded to S32p, the whole [B*H*S32p, D] matrix transposed to
    M=D x K=B*H*S32p and swizzled (D tile outermost; module docstring). The fused Triton quantizer
    (`mxattn.kernels.triton_quantize.quantize_rowcol(swizzle=True)`) writes the same bytes."""
    b, h, s32, d = scale.shape
    s32p = col_scale_dims(b, h, s32 * MX_BLOCK, d)[2]
    raw = scale.view(torch.uint8)
    if s32p != s32:
        raw = torch.nn.functional.pad(raw, (0, 0, 0, s32p - s32))
    return swizzle_128x4(raw.reshape(b * h * s32p, d).t()).view(SCALE_DTYPE)


def col_scale_tensor(buf: torch.Tensor, b: int, h: int, s: int, d: int) -> torch.Tensor:
    """The graph's column-wise scale tensor (dims `col_scale_dims(b, h, s, d)`, strides `col_scale_stride`) over
    `col_scale_bytes`-ordered bytes `buf` (contiguous, e8m0 or uint8)."""
    dims = col_scale_dims(b, h, s, d)
    if buf.dtype != SCALE_DTYPE:  # (the quantizers' buffers are e8m0 already: no second view per call)
        buf = buf.view(SCALE_DTYPE)
    return buf.as_strided(dims, col_scale_stride(dims))


# --- packed (thd) batches: cuDNN's per-sequence-tile layout ------------------------------------------------------
# cuDNN's MXFP8 graphs read the scales of a ragged batch PACKED per sequence tile (frontend 1.32:
# `cudnn/sdpa/kernels/_mxfp8_sf.py`, the `sdpa_fwd_prefill_sm100_mxfp8` engine spec and the module notes of
# `cudnn/sdpa/bwd/api_dsl_sm107.py`): per head, every sequence's ceil(s_b/128) tiles of 128 tokens in cu_seqlens
# order, sequence b's first tile at cu_sf[b] = sum_{i<b} ceil(s_i/128) (NOT cu[b]/128), each tile's bytes
# contiguous: row-wise 128 rows x D32p scale columns in F8_128x4 order, column-wise the ceil(D/128) D planes of
# 512 bytes one after another (plane stride one atom; NOT the dense D-plane-major order). The graph keeps the
# dense dims (a capacity of b * ceil(S_max/128) tiles per head, head-major [H, tiles, tile bytes]); unused
# tiles and padding bytes are zero (SF_TILE: `mxattn.constants`).


def sf_tile_starts(cu: torch.Tensor) -> torch.Tensor:
    """cu_sf: int64 [B+1] first SF tile of each sequence (and the total) of cumulative lengths `cu`."""
    cu = cu.to(torch.int64)
    tiles = (cu[1:] - cu[:-1] + SF_TILE - 1) // SF_TILE
    return torch.nn.functional.pad(torch.cumsum(tiles, 0), (1, 0))


def _packed_rows(cu: torch.Tensor, n_rows: int, rows_per_tile: int, rows_of) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each destination row r < n_rows of the per-tile layout (rows_per_tile rows per 128-token tile):
    (source row, valid). rows_of(cu) gives (count, start): each sequence's number of source rows and its first
    source row."""
    cu64 = cu.to(torch.int64)
    count, start = rows_of(cu64)
    first = sf_tile_starts(cu64) * rows_per_tile  # [B+1]
    r = torch.arange(n_rows, device=cu.device)
    b = torch.searchsorted(first[1:], r, right=True).clamp_(max=count.numel() - 1)
    local = r - first[b]
    valid = (local >= 0) & (local < count[b])
    return torch.where(valid, start[b] + local, 0), valid


def thd_row_scale_buffer(scale: torch.Tensor, cu: torch.Tensor, b: int, s_max: int) -> torch.Tensor:
    """Row-wise compact scale of a packed batch [1, H, T, ceil(D/32)] (e8m0; rows = tokens) and its cu_seqlens
    (int32 [b+1]) -> the graph's SF tensor [b, H, ceil(s_max/128)*128, D32p] (row-major dims, packed
    per-sequence-tile bytes; section comment above). No host synchronisation."""
    _, h, t, k = scale.shape
    dims = row_scale_dims(b, h, s_max, k * MX_BLOCK)
    n_rows = b * dims[2]  # per head: the capacity in rows
    src, valid = _packed_rows(cu, n_rows, SF_TILE,
                              lambda c: (c[1:] - c[:-1], c[:-1]))
    raw = scale.view(torch.uint8)[0]  # [H, T, K]
    rows = torch.where(valid.view(1, -1, 1), raw[:, src], 0) if t else raw.new_zeros(h, n_rows, k)
    buf = swizzle_128x4(rows)  # [H, n_rows, D32p]: tile-major per head, each tile's atoms contiguous
    return buf.reshape(dims).view(SCALE_DTYPE)


def thd_col_scale_buffer(scale: torch.Tensor, cu: torch.Tensor, b: int, s_max: int) -> torch.Tensor:
    """Column-wise segmented scale of a packed batch [1, H, T//32 + B, D] (e8m0; sequence i's blocks from row
    cu[i]//32 + i, `mxattn.formats`) -> the graph's SF tensor declared [b, H, S32p, Dp] with `col_scale_stride`
    (packed per-sequence-tile bytes, both D planes of a (head, tile) contiguous). No host synchronisation."""
    _, h, n_blocks, d = scale.shape
    dims = col_scale_dims(b, h, s_max, d)
    tiles = b * (dims[2] // 4)  # per head: capacity in tiles (4 scale blocks of 32 tokens each)
    idx = torch.arange(cu.numel() - 1, device=cu.device)
    src, valid = _packed_rows(cu, tiles * 4, 4,
                              lambda c: ((c[1:] - c[:-1] + MX_BLOCK - 1) // MX_BLOCK, c[:-1] // MX_BLOCK + idx))
    raw = scale.view(torch.uint8)[0]  # [H, n_blocks, D] (n_blocks >= B >= 1)
    blocks = torch.where(valid.view(1, -1, 1), raw[:, src], 0)
    per_tile = blocks.view(h, tiles, 4, d).transpose(2, 3)  # [H, tiles, M=D, K=4 blocks]
    buf = swizzle_128x4(per_tile)  # [H, tiles, Dp, 4]: per (head, tile) the D planes one after another
    return buf.reshape(-1).view(SCALE_DTYPE).as_strided(dims, col_scale_stride(dims))


def thd_scale_buffer(x: MXFP8Tensor, cu: torch.Tensor, b: int, s_max: int) -> torch.Tensor:
    """F8_128x4 scale tensor of a packed-batch MXFP8Tensor (row-wise, or column-wise segmented at `cu`)."""
    if x.axis == 3:
        return thd_row_scale_buffer(x.scale, cu, b, s_max)
    if x.axis == 2:
        return thd_col_scale_buffer(x.scale, cu, b, s_max)
    raise ValueError(f"MXFP8Tensor must be quantized along D (axis 3) or S (axis 2) of [B, H, S, D], got {x.axis}")


def varlen_tensors(cfg: GraphConfig, cu_q: torch.Tensor, cu_kv: torch.Tensor, kind: str = "forward"
                   ) -> Dict[str, torch.Tensor]:
    """The variable-length slots of `cfg`'s `kind` graph, by lower-case uid name: seq_len_q/kv (int32 [b,1,1,1],
    differences of the cumulative lengths) and, packed, ragged_* (element offsets of each sequence's first row:
    cu * the tensor's token stride, int32 or int64 per cfg.ragged_dtype, [b+1,1,1,1]). Device ops only."""
    if cfg.varlen is None:
        return {}
    b = cfg.b
    out = {"seq_len_q": (cu_q[1:] - cu_q[:-1]).to(torch.int32).view(b, 1, 1, 1),
           "seq_len_kv": (cu_kv[1:] - cu_kv[:-1]).to(torch.int32).view(b, 1, 1, 1)}
    if cfg.packed_layout:
        dt = cfg.ragged_dtype
        for name, cu, stride in (("ragged_q", cu_q, cfg.q_stride[2]), ("ragged_k", cu_kv, cfg.k_stride[2]),
                                 ("ragged_v", cu_kv, cfg.v_stride[2]), ("ragged_o", cu_q, cfg.o_stride[2]),
                                 ("ragged_stats", cu_q, cfg.stats_stride[2])):
            out[name] = (cu.to(dt) * stride).view(b + 1, 1, 1, 1)
    return out


# ---------------------------------------------------------------------------------------------------------------
# variant packs
# ---------------------------------------------------------------------------------------------------------------
#: slots that hold token rows: in a packed graph their tensors are [1, H, T, D] (T tokens), not the graph's dims
_TOKEN_SLOTS = {"q", "k", "v", "o", "stats", "q_t", "k_t", "do_f16", "do", "do_t", "dq", "dk", "dv"}


def _slot_matches(cfg: GraphConfig, name: str, tensor: torch.Tensor, spec) -> bool:
    shape, stride, dtype = spec
    if tensor.dtype != dtype:
        return False
    if cfg.packed_layout and name in _TOKEN_SLOTS:
        return (tensor.dim() == 4 and tensor.shape[0] == 1 and (tensor.shape[1], tensor.shape[3]) ==
                (shape[1], shape[3]) and all(st == want for st, want, n in zip(tensor.stride()[1:], stride[1:],
                                                                                  tensor.shape[1:]) if n > 1))
    return tuple(tensor.shape) == tuple(shape) and tensor.stride() == tuple(stride)


def _pack(cfg: GraphConfig, specs, slots: SlotNames, named: Dict[str, Optional[torch.Tensor]], check: bool
          ) -> Dict[int, torch.Tensor]:
    """uid -> tensor of `named` for the graph of `specs` / `slots`; ValueError for a missing or extra slot, and
    with `check` for a tensor whose geometry differs from its slot's."""
    if {n for n, t in named.items() if t is not None} != slots.names:
        _refuse_slots(cfg, slots, named)
    if check:
        for uid, name in slots.pairs:
            _check_slot(cfg, name, named[name], specs[uid])
    return {uid: named[name] for uid, name in slots.pairs}


def _refuse_slots(cfg: GraphConfig, slots: SlotNames, named: Dict[str, Optional[torch.Tensor]]) -> None:
    """ValueError naming the slots of `slots` that `named` lacks, else those it has beyond them."""
    missing = [n for _, n in slots.pairs if named.get(n) is None]
    if missing:
        raise ValueError(f"this graph ({cfg.describe()}) needs {', '.join(missing)}")
    extra = sorted(set(n for n, t in named.items() if t is not None) - slots.names)
    raise ValueError(f"this graph ({cfg.describe()}) has no slot for {', '.join(extra)}")


def _check_slot(cfg: GraphConfig, name: str, tensor: torch.Tensor, spec) -> None:
    """ValueError unless `tensor` has the geometry and dtype of slot `name` (`spec`) of cfg's graph."""
    if not _slot_matches(cfg, name, tensor, spec):
        shape, stride, dtype = spec
        what = (f"[1, {shape[1]}, T, {shape[3]}] {dtype} with strides (*, {', '.join(map(str, stride[1:]))})"
                if cfg.packed_layout and name in _TOKEN_SLOTS else f"{tuple(shape)} {dtype} with strides {stride}")
        raise ValueError(f"{name} must be {what} for this graph, got {tuple(tensor.shape)} {tensor.dtype} "
                         f"strides {tensor.stride()}")


def forward_pack(cfg: GraphConfig, *, q, sf_q, k, sf_k, v, sf_v, o, stats, amax_o, sink=None, check: bool = True,
                 **varlen) -> Dict[int, torch.Tensor]:
    """uid -> tensor for the forward graph. q/k/v: FP8 data; sf_*: F8_128x4 buffers (row_scale_buffer for Q, K;
    col_scale_buffer for V; thd_*_scale_buffer for a packed batch); o, stats, amax_o: output buffers; varlen:
    the `varlen_tensors` of a variable-length graph (seq_len_q, seq_len_kv, ragged_*); sink: fp32 [1, h_q, 1, 1]
    (`sink_operand`) for a cfg.sink graph. Raises ValueError naming a
    tensor whose shape, strides or dtype differ from the graph's (in a packed graph the token tensors are
    [1, H, T, D] with the graph's strides past the batch axis), or a missing or extra slot. `check=False` skips
    the geometry check: only for callers whose tensors are derived from `cfg` by construction (the cudnn
    backend, where the cache key pins every argument's geometry)."""
    named = dict(q=q, k=k, v=v, sf_q=sf_q, sf_k=sf_k, sf_v=sf_v, o=o, stats=stats, amax_o=amax_o, sink=sink,
                 **varlen)
    return _pack(cfg, cfg.forward_specs, cfg.forward_slots, named, check)


def backward_pack(cfg: GraphConfig, *, q, q_t, k, k_t, v, o, do_f16, do, do_t, stats, sf_q, sf_q_t, sf_k, sf_k_t,
                  sf_v, sf_do, sf_do_t, dq, dk, dv, amax_dq, amax_dk, amax_dv, sink=None, dsink=None,
                  check: bool = True, **varlen) -> Dict[int, torch.Tensor]:
    """uid -> tensor for the backward graph (names as the BwdUid members, lower case); `check`, `varlen`, `sink`
    as in forward_pack; dsink: the fp32 [1, h_q, 1, 1] output buffer of a cfg.dsink graph."""
    named = dict(q=q, q_t=q_t, k=k, k_t=k_t, v=v, o=o, do_f16=do_f16, do=do, do_t=do_t, stats=stats, sf_q=sf_q,
                 sf_q_t=sf_q_t, sf_k=sf_k, sf_k_t=sf_k_t, sf_v=sf_v, sf_do=sf_do, sf_do_t=sf_do_t, dq=dq, dk=dk,
                 dv=dv, amax_dq=amax_dq, amax_dk=amax_dk, amax_dv=amax_dv, sink=sink, dsink=dsink, **varlen)
    return _pack(cfg, cfg.backward_specs, cfg.backward_slots, named, check)


def sink_operand(sink: Optional[torch.Tensor], h_q: int, device: torch.device) -> Optional[torch.Tensor]:
    """The SINK slot for sink logits `sink` (fp32 [h_q] or [1, h_q, 1, 1], TE's softmax_offset; None: no sink):
    a [1, h_q, 1, 1] fp32 contiguous tensor on `device` (a view of `sink` when it already is one, detached).
    TypeError/ValueError naming the problem."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"sink must be a torch.Tensor or None, got {type(sink).__name__}")
    if tuple(sink.shape) not in ((h_q,), (1, h_q, 1, 1)):
        raise ValueError(f"sink must have one logit per query head, [{h_q}] (or [1, {h_q}, 1, 1]), got "
                         f"{tuple(sink.shape)}")
    if not sink.is_floating_point():
        raise TypeError(f"sink must be a floating-point tensor (fp32 logits), got {sink.dtype}")
    if sink.device != device:
        raise ValueError(f"sink is on {sink.device}, expected {device} like q")
    return sink.detach().to(torch.float32).contiguous().view(1, h_q, 1, 1)


def operand(x: MXFP8Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(FP8 data, F8_128x4 scale buffer) of an MXFP8Tensor quantized along D (axis 3) or S (axis 2) (the buffer
    the quantizer made, `x.scale_f8_128x4`, when it made one)."""
    made = getattr(x, "scale_f8_128x4", None)
    if made is not None:
        return x.data, (made if x.axis == 3 else col_scale_tensor(made, *x.data.shape))
    if x.axis == 3:
        return x.data, row_scale_buffer(x.scale)
    if x.axis == 2:
        return x.data, col_scale_buffer(x.scale)
    raise ValueError(f"MXFP8Tensor must be quantized along D (axis 3) or S (axis 2) of [B, H, S, D], got {x.axis}")

