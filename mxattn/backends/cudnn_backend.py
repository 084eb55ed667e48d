"""The `cudnn` backend: cuDNN's fused MXFP8 attention graphs (Blackwell, SM 10.x, cuDNN >= 9.21).

Two layers:
  * `cudnn_forward` / `cudnn_backward` run the graphs on already-quantized `MXFP8Tensor`s (compact scales; the
    F8_128x4 buffers are made here) and return the outputs with cuDNN's amax side outputs;
  * `CudnnBackend` is the `AttentionBackend` that quantizes (mxattn.formats.quantize_mxfp8) and calls them.

Attention sinks (TE's softmax_type, `AttentionParams.sink`): the graphs get cuDNN's sink_token (fp32
[1, Hq, 1, 1], a view of the [Hq] logits) and, when the sink's gradient is wanted ("learnable"), the backward's
dSink_token output, returned as dsink [Hq] fp32 after dq, dk, dv.

Variable lengths (`SeqInfo`): a padded batch runs the dense graph with cuDNN's padding mask and per-sequence
lengths; a packed (thd) batch runs the ragged graph (token-major tensors with ragged offsets, scales in cuDNN's
per-sequence-tile layout, `cudnn_graphs`). Graph keys and configs never hold the lengths' values (a packed graph
is sized by the longest sequences rounded up to 128), so new lengths reuse the graph.

`CudnnBackend.supports(problem)` decides before any work: the known refusals (`known_refusal`), then, on a device
where cuDNN MXFP8 runs, the forward graph and (for training) the backward graph are built and planned for the
problem (cached per problem, and the plans are reused by the calls).

Execution: graphs come from `cudnn_graphs.GRAPH_CACHE` (planned once per config and device; looked up by the
facts of the argument tensors, so a hit re-validates nothing), run on torch's
current stream with one cuDNN handle per device (launches serialised by a per-device lock, since a handle carries
one stream at a time) and one workspace per (device, stream), grown only when a plan needs more.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Dict, Optional, Tuple

import torch

import cudnn

from ..cudnn_graphs import (GRAPH_CACHE, OUT_DTYPES, SOFTMAX_TYPES, GraphConfig, PlannedGraph, axis_order,
                            backward_pack, build_backward_graph, build_forward_graph, col_scale_bytes,
                            col_scale_dims, dense_stride, forward_pack, graph_json, operand, planned_graph,
                            row_major, row_scale_buffer, row_scale_dims, sink_operand, thd_scale_buffer,
                            varlen_tensors)
from ..cudnn_support import cudnn_support
from ..errors import MXFP8NotSupportedError
from ..formats import MXFP8Tensor, quantize_mxfp8
from ..formats import _is_non_overlapping_and_dense as _is_dense
from ..mask import MaskSpec
from ..recipe import Recipe
from ..seqinfo import SeqInfo
from .base import AttentionBackend, AttentionParams, Problem, SavedForBackward

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _DeviceState:
    """Per-device cuDNN handle, its lock, the workspaces and the cached support answer."""

    def __init__(self, index: int):
        self.index = index
        self.support = cudnn_support(torch.device("cuda", index))
        self.handle = None
        self.lock = threading.Lock()
        self.workspaces: Dict[int, torch.Tensor] = {}

    def get_handle(self):
        with self.lock:
            if self.handle is None:
                with torch.cuda.device(self.index):
                    self.handle = cudnn.create_handle()
            return self.handle

    def workspace(self, stream: int, nbytes: int) -> Optional[torch.Tensor]:
        if nbytes <= 0:
            return None
        ws = self.workspaces.get(stream)
        if ws is None or ws.numel() < nbytes:
            ws = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", self.index))
            self.workspaces[stream] = ws
        return ws


_DEVICES: Dict[int, _DeviceState] = {}
_DEVICES_LOCK = threading.Lock()


def _state(device: torch.device) -> _DeviceState:
    if device.type != "cuda":
        raise ValueError(f"the cudnn backend needs CUDA tensors, got tensors on {device}")
    index = torch.cuda.current_device() if device.index is None else device.index
    state = _DEVICES.get(index)
    if state is None:
        with _DEVICES_LOCK:
            state = _DEVICES.setdefault(index, _DeviceState(index))
    return state


def _supported_state(device: torch.device) -> _DeviceState:
    state = _state(device)
    ok, reason = state.support
    if not ok:
        raise MXFP8NotSupportedError(f"cuDNN MXFP8 attention cannot run on {device}: {reason}")
    return state


def _current_stream(index: int) -> int:
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return torch.cuda.current_stream(index).cuda_stream


def planned(key, kind: str, device: torch.device, make_config) -> PlannedGraph:
    """The cached plan for `key`; on a miss `make_config()` validates the arguments (TypeError/ValueError), the
    support on `device` is checked and the `kind` graph for that config is taken from the cache or built and
    planned (MXFP8NotSupportedError if impossible)."""
    plan = GRAPH_CACHE.lookup(key)
    if plan is None:
        cfg = make_config()
        state = _supported_state(device)
        # one plan per (kind, config, device): shared with the plans `CudnnBackend.supports` made up front
        plan = planned_graph(kind, cfg, state.index, state.get_handle())
        plan = GRAPH_CACHE.get(key, lambda: plan)
    return plan


def execute(plan: PlannedGraph, pack: Dict[int, torch.Tensor], device: torch.device) -> None:
    """Launch `plan` with variant pack `pack` on torch's current stream of `device`."""
    state = _state(device)
    stream = _current_stream(state.index)
    with state.lock:
        workspace = state.workspace(stream, plan.workspace_size)
        cudnn.set_stream(state.handle, stream)
        plan.graph.execute(pack, workspace, handle=state.handle)


# ---------------------------------------------------------------------------------------------------------------
# typed interface on quantized tensors
# ---------------------------------------------------------------------------------------------------------------
def _check_mx(name: str, x, axis: int, fp8_dtype=None) -> Tuple[int, int, int, int]:
    if not isinstance(x, MXFP8Tensor):
        raise TypeError(f"{name} must be an mxattn.MXFP8Tensor, got {type(x).__name__}")
    if x.data.dim() != 4:
        raise ValueError(f"{name} must be [B, H, S, D], got shape {tuple(x.data.shape)}")
    if x.axis != axis:
        what = "along D (axis 3, row-wise)" if axis == 3 else "along S (axis 2, column-wise)"
        raise ValueError(f"{name} must be quantized {what}, got axis {x.axis}")
    if fp8_dtype is not None and x.data.dtype != fp8_dtype:
        raise TypeError(f"{name} has fp8 dtype {x.data.dtype}, expected {fp8_dtype} like the other operands")
    if x.data.numel() and not _is_dense(x.data):
        raise ValueError(f"{name}.data must be non-overlapping and dense (any axis order), got strides "
                         f"{x.data.stride()} for shape {tuple(x.data.shape)}")
    if x.scale.device != x.data.device:
        raise ValueError(f"{name}.scale is on {x.scale.device} but its data on {x.data.device}")
    return tuple(x.data.shape)


def _same(name: str, got, expected, what: str) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"{name} {what} {tuple(got)} does not match the expected {tuple(expected)}")


def _same_device(named) -> torch.device:
    device = named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} like {named[0][0]}")
    return device


_NO_MASK = MaskSpec()
#: token capacity granule of a packed graph: the longest sequences are rounded up to it, so nearby maxima share
#: a graph, the scale capacity is whole 128-token tiles and the backward's "multiple of 64" rule always holds
PACKED_CAPACITY = 128


def packed_capacity(max_seqlen: int) -> int:
    """The graph's S of a packed batch whose longest sequence has `max_seqlen` tokens."""
    return max(1, -(-int(max_seqlen) // PACKED_CAPACITY)) * PACKED_CAPACITY


def _check_seq(seq) -> Optional[SeqInfo]:
    if seq is not None and not isinstance(seq, SeqInfo):
        raise TypeError(f"seq must be a mxattn.seqinfo.SeqInfo or None, got {type(seq).__name__}")
    return seq


def _seq_facts(seq: Optional[SeqInfo]) -> tuple:
    """Cache-key part of the lengths: their kind and, packed, the graph capacity; never the values."""
    if seq is None:
        return (None,)
    if not seq.packed:
        return ("padded", seq.batch, seq.cu_seqlens_q.device)
    return ("packed", seq.batch, packed_capacity(seq.max_seqlen_q), packed_capacity(seq.max_seqlen_kv),
            seq.cu_seqlens_q.device)


def _mx_facts(name: str, x, packed: bool = False) -> tuple:
    """What a GraphConfig is derived from, of an MXFP8Tensor argument (cache-key part). Packed: without the
    token count."""
    if not isinstance(x, MXFP8Tensor):
        raise TypeError(f"{name} must be an mxattn.MXFP8Tensor, got {type(x).__name__}")
    d = x.data
    if packed:
        return (x.axis, d.shape[0], d.shape[1], d.shape[3], d.stride()[1:], d.dtype, d.device, x.scale.device,
                x.segments is None)
    return (x.axis, d.shape, d.stride(), d.dtype, d.device, x.scale.device)


def _t_facts(name: str, t, packed: bool = False) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if packed:
        return (t.dim(), t.shape[0], t.shape[1], t.shape[-1], t.stride()[1:], t.dtype, t.device)
    return (t.shape, t.stride(), t.dtype, t.device)


def _stats_facts(stats, packed: bool) -> tuple:
    if packed:  # converted to token-major by backward_buffers whatever its strides
        if not isinstance(stats, torch.Tensor):
            raise TypeError(f"stats must be a torch.Tensor, got {type(stats).__name__}")
        return (stats.dim(), stats.shape[0], stats.shape[1], stats.dtype, stats.device)
    return _t_facts("stats", stats)


def _mask(mask) -> MaskSpec:
    if mask is None:
        return _NO_MASK
    if not isinstance(mask, MaskSpec):
        raise TypeError(f"mask must be a mxattn.MaskSpec or None, got {type(mask).__name__}")
    return mask


def forward_key(q, k, v, attn_scale, mask: MaskSpec, out_dtype, seq: Optional[SeqInfo] = None,
                sink: bool = False) -> tuple:
    """Cache key of a forward call: every fact of its arguments that its GraphConfig is derived from (for
    variable lengths the kind and capacity, never the lengths; for a sink only its presence: the sink operand
    is normalized to fp32 [1, Hq, 1, 1] by `sink_operand` on every call)."""
    packed = seq is not None and seq.packed
    return ("forward", _mx_facts("q", q, packed), _mx_facts("k", k, packed), _mx_facts("v", v, packed), attn_scale,
            mask, out_dtype, _seq_facts(seq), bool(sink))


def backward_key(q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats, attn_scale, mask: MaskSpec,
                 deterministic, seq: Optional[SeqInfo] = None, sink: bool = False, dsink: bool = False) -> tuple:
    """Cache key of a backward call (as forward_key; dsink: the sink's gradient is wanted)."""
    p = seq is not None and seq.packed
    return ("backward", _mx_facts("q_row", q_row, p), _mx_facts("q_col", q_col, p), _mx_facts("k_row", k_row, p),
            _mx_facts("k_col", k_col, p), _mx_facts("v_row", v_row, p), _t_facts("o", o, p), _t_facts("do", do, p),
            _mx_facts("do_row", do_row, p), _mx_facts("do_col", do_col, p), _stats_facts(stats, p),
            attn_scale, mask, bool(deterministic), _seq_facts(seq), bool(sink), bool(dsink))


def _token_major(shape) -> Tuple[int, int, int]:
    """Strides past the batch axis of a [1, H, T, D] view of a token-major [T, H, D] tensor."""
    return (shape[3], shape[1] * shape[3], 1)


def _check_packed(name: str, t: torch.Tensor, seq: SeqInfo) -> None:
    if t.shape[0] != 1:
        raise ValueError(f"{name} of a packed batch must be a [1, H, T, D] view, got shape {tuple(t.shape)}")
    if any(st != want for st, want, n in zip(t.stride()[1:], _token_major(t.shape), t.shape[1:]) if n > 1):
        raise ValueError(f"{name} of a packed batch must be token-major ([T, H, D] memory, strides past the batch "
                         f"axis {_token_major(t.shape)}), got {t.stride()}")


def _check_segments(name: str, x: MXFP8Tensor, cu: torch.Tensor) -> None:
    if x.segments is None or x.segments.shape != cu.shape:
        raise ValueError(f"{name} of a packed batch must be quantized per sequence (segments = cu_seqlens of "
                         f"{cu.numel() - 1} sequences)")


def _varlen_config(seq: Optional[SeqInfo], b: int) -> dict:
    if seq is None:
        return {}
    if seq.batch != b:
        raise ValueError(f"seq describes {seq.batch} sequences but the padded batch has {b}")
    return dict(varlen="padded")


def forward_config(q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, *, attn_scale: float,
                   mask: Optional[MaskSpec] = None, out_dtype: torch.dtype = torch.bfloat16,
                   seq: Optional[SeqInfo] = None, sink: bool = False) -> GraphConfig:
    """GraphConfig of the forward for row-wise q [B,Hq,Sq,Dqk], k [B,Hk,Skv,Dqk] and column-wise v [B,Hv,Skv,Dv]
    (O gets q's axis order); with `seq` a padded batch, or a packed one ([1, H, T, D] token-major views, v's
    column blocks segmented at the sequences); `sink`: the graph takes sink logits. Raises TypeError/ValueError
    naming the bad argument."""
    return dataclasses.replace(_forward_config(q, k, v, attn_scale=attn_scale, mask=mask, out_dtype=out_dtype,
                                               seq=seq), sink=bool(sink))


def _forward_config(q, k, v, *, attn_scale, mask, out_dtype, seq) -> GraphConfig:
    seq = _check_seq(seq)
    b, h_q, s_q, d_qk = _check_mx("q", q, 3)
    _, h_k, s_kv, _ = _check_mx("k", k, 3, q.data.dtype)
    _, h_v, _, d_v = _check_mx("v", v, 2, q.data.dtype)
    _same("k", (k.data.shape[0], k.data.shape[3]), (b, d_qk), "(batch, head dim)")
    _same("v", (v.data.shape[0], v.data.shape[2]), (b, s_kv), "(batch, sequence length)")
    _same_device((("q", q.data), ("k", k.data), ("v", v.data)))
    if seq is not None and seq.packed:
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_packed(name, x.data, seq)
        _check_segments("v", v, seq.cu_seqlens_kv)
        return GraphConfig.from_packed(seq.batch, h_q, h_k, packed_capacity(seq.max_seqlen_q),
                                       packed_capacity(seq.max_seqlen_kv), d_qk, d_v, attn_scale=attn_scale,
                                       mask=_mask(mask), out_dtype=out_dtype, fp8_dtype=q.data.dtype)
    o_shape = (b, h_q, s_q, d_v)
    return GraphConfig(b=b, h_q=h_q, h_k=h_k, h_v=h_v, s_q=s_q, s_kv=s_kv, d_qk=d_qk, d_v=d_v,
                       attn_scale=attn_scale, q_stride=q.data.stride(), k_stride=k.data.stride(),
                       v_stride=v.data.stride(), o_stride=dense_stride(o_shape, axis_order(q.data.stride())),
                       mask=_mask(mask), out_dtype=out_dtype, fp8_dtype=q.data.dtype, **_varlen_config(seq, b))


def _packed_empty(h: int, t: int, d: int, dtype, device) -> torch.Tensor:
    """A [1, H, T, D] view of a fresh token-major [T, H, D] tensor."""
    return torch.empty((t, h, d), dtype=dtype, device=device).permute(1, 0, 2).unsqueeze(0)


def _scales(cfg: GraphConfig, seq: Optional[SeqInfo], named):
    """(data, F8_128x4 scale tensor) of each (MXFP8Tensor, "q"|"kv") in `named`."""
    if not cfg.packed_layout:
        return [operand(x) for x, _ in named]
    out = []
    for x, which in named:
        cu, s = (seq.cu_seqlens_q, cfg.s_q) if which == "q" else (seq.cu_seqlens_kv, cfg.s_kv)
        out.append((x.data, thd_scale_buffer(x, cu, cfg.b, s)))
    return out


def _varlen(cfg: GraphConfig, seq: Optional[SeqInfo], kind: str) -> dict:
    return {} if cfg.varlen is None else varlen_tensors(cfg, seq.cu_seqlens_q, seq.cu_seqlens_kv, kind)


def forward_buffers(cfg: GraphConfig, q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, check: bool = True,
                    seq: Optional[SeqInfo] = None, sink: Optional[torch.Tensor] = None):
    """(variant pack, (o, stats, amax_o)) for `cfg` on q's device: fresh outputs, F8_128x4 scale buffers (and
    the lengths / ragged offsets of `seq`; the [1, Hq, 1, 1] view of the sink logits `sink`, fp32 [Hq]).
    `check`: verify every slot against the graph (cudnn_forward skips it: its cache key pins the geometry)."""
    device = q.data.device
    if cfg.packed_layout:
        t = q.data.shape[2]
        o = _packed_empty(cfg.h_q, t, cfg.d_v, cfg.out_dtype, device)
        stats = _packed_empty(cfg.h_q, t, 1, torch.float32, device)
    else:
        o = torch.empty_strided(cfg.o_shape, cfg.o_stride, dtype=cfg.out_dtype, device=device)
        stats = torch.empty(cfg.stats_shape, dtype=torch.float32, device=device)
    amax_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
    (qd, sf_q), (kd, sf_k), (vd, sf_v) = _scales(cfg, seq, ((q, "q"), (k, "kv"), (v, "kv")))
    pack = forward_pack(cfg, q=qd, sf_q=sf_q, k=kd, sf_k=sf_k, v=vd, sf_v=sf_v, o=o, stats=stats, amax_o=amax_o,
                        sink=sink_operand(sink, cfg.h_q, device), check=check, **_varlen(cfg, seq, "forward"))
    return pack, (o, stats, amax_o)


def valid_rows(seq: SeqInfo, which: str, n_rows: int) -> torch.Tensor:
    """Bool [B, 1, n_rows, 1] (padded) / [1, 1, n_rows, 1] (packed): True on the rows that cuDNN computes and
    the reference defines as attention results: real tokens of sequences whose other side is not empty (a query
    with no key gives O = 0, stats -inf, zero gradients; mxattn's rule, enforced after cuDNN ran)."""
    cu, other = ((seq.cu_seqlens_q, seq.cu_seqlens_kv) if which == "q" else (seq.cu_seqlens_kv, seq.cu_seqlens_q))
    cu, other = cu.to(torch.int64), other.to(torch.int64)
    has_other = (other[1:] - other[:-1]) > 0
    rows = torch.arange(n_rows, device=cu.device)
    if seq.packed:
        b = torch.searchsorted(cu[1:], rows, right=True).clamp_(max=seq.batch - 1)
        return (has_other[b] & (rows < cu[-1])).view(1, 1, n_rows, 1)
    lengths = (cu[1:] - cu[:-1]).unsqueeze(1)
    return ((rows.unsqueeze(0) < lengths) & has_other.unsqueeze(1)).view(-1, 1, n_rows, 1)


def cudnn_forward(q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, *, attn_scale: float,
                  mask: Optional[MaskSpec] = None, out_dtype: torch.dtype = torch.bfloat16,
                  seq: Optional[SeqInfo] = None, sink: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 attention forward with cuDNN.

    q [B,Hq,Sq,Dqk], k [B,Hk,Skv,Dqk]: quantized along D (row-wise); v [B,Hv,Skv,Dv]: quantized along S
    (column-wise); one CUDA device, one fp8 dtype. Returns (o [B,Hq,Sq,Dv] out_dtype in q's axis order,
    stats [B,Hq,Sq,1] fp32 log-sum-exp, amax_o [1,1,1,1] fp32 = max|o|).
    seq: a padded batch (rows past a length: O = 0, stats -inf), or a packed one (q, k, v [1, H, T, D]
    token-major views, v's blocks segmented at cu_seqlens_kv; O [1,Hq,T,Dv] token-major, stats [1,Hq,T,1]).
    sink: attention-sink logits fp32 [Hq] (TE's softmax_offset; zeros for "off-by-one") or None: one more logit
    in every row's softmax (scaled-score space), nothing added to O; stats include it.
    Raises MXFP8NotSupportedError (with cuDNN's reason) where cuDNN cannot run it.
    """
    mask, seq = _mask(mask), _check_seq(seq)
    if sink is not None and isinstance(q, MXFP8Tensor):
        sink = sink_operand(sink, q.data.shape[1], q.data.device)
    key = forward_key(q, k, v, attn_scale, mask, out_dtype, seq, sink is not None)
    device = q.data.device
    plan = planned(key, "forward", device,
                   lambda: forward_config(q, k, v, attn_scale=attn_scale, mask=mask, out_dtype=out_dtype, seq=seq,
                                          sink=sink is not None))
    # plan.cfg: the cached config, with its slot specs computed once; the key pins every argument's geometry
    pack, outputs = forward_buffers(plan.cfg, q, k, v, check=False, seq=seq, sink=sink)
    o, stats, amax = outputs
    if plan.cfg.packed_layout and (q.data.shape[2] == 0 or k.data.shape[2] == 0):  # nothing for cuDNN to do
        o.zero_(), stats.fill_(float("-inf")), amax.zero_()
        return outputs
    execute(plan, pack, device)
    if seq is not None:
        keep = valid_rows(seq, "q", q.data.shape[2])
        o.masked_fill_(~keep, 0)
        stats.masked_fill_(~keep, float("-inf"))
    return outputs


def _stats_view(stats: torch.Tensor, shape, packed: bool = False) -> torch.Tensor:
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32:
        raise TypeError(f"stats must be a float32 tensor, got {getattr(stats, 'dtype', type(stats).__name__)}")
    _same("stats", stats.shape, shape, "shape")
    if packed:  # token-major [T, H] as cuDNN's ragged Stats
        if stats.stride()[1:3] != (1, shape[1]) and shape[2] > 1:
            stats = stats[0, :, :, 0].t().contiguous().t().unsqueeze(0).unsqueeze(-1)
        return stats
    if stats.stride() != row_major(shape):
        stats = stats.contiguous().as_strided(shape, row_major(shape))
    return stats


def backward_config(q_row: MXFP8Tensor, q_col: MXFP8Tensor, k_row: MXFP8Tensor, k_col: MXFP8Tensor,
                    v_row: MXFP8Tensor, o: torch.Tensor, do: torch.Tensor, do_row: MXFP8Tensor,
                    do_col: MXFP8Tensor, stats: torch.Tensor, *, attn_scale: float, mask: Optional[MaskSpec] = None,
                    deterministic: bool = True, seq: Optional[SeqInfo] = None, sink: bool = False,
                    dsink: bool = False) -> GraphConfig:
    """GraphConfig of the backward (arguments as cudnn_backward; sink: the graph takes sink logits, dsink: and
    writes their gradient). Raises TypeError/ValueError naming the bad argument."""
    cfg = _backward_config(q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats, attn_scale=attn_scale,
                           mask=mask, deterministic=deterministic, seq=seq)
    return dataclasses.replace(cfg, sink=bool(sink), dsink=bool(dsink))


def _backward_config(q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats, *, attn_scale, mask,
                     deterministic, seq) -> GraphConfig:
    seq = _check_seq(seq)
    q_shape = _check_mx("q_row", q_row, 3)
    f8 = q_row.data.dtype
    k_shape, v_shape = _check_mx("k_row", k_row, 3, f8), _check_mx("v_row", v_row, 3, f8)
    do_shape = _check_mx("do_row", do_row, 3, f8)
    for name, col, row, shape in (("q_col", q_col, q_row, q_shape), ("k_col", k_col, k_row, k_shape),
                                  ("do_col", do_col, do_row, do_shape)):
        _same(name, _check_mx(name, col, 2, f8), shape, "shape")
        _same(name, col.data.stride(), row.data.stride(), "data strides (must equal the row-wise copy's)")
    b, h_q, s_q, d_qk = q_shape
    _same("k_row", (k_shape[0], k_shape[3]), (b, d_qk), "(batch, head dim)")
    _same("v_row", (v_shape[0], v_shape[2]), (b, k_shape[2]), "(batch, sequence length)")
    o_shape = (b, h_q, s_q, v_shape[3])
    _same("do_row", do_shape, o_shape, "shape")
    for name, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be a bfloat16 or float16 tensor, got {getattr(t, 'dtype', type(t))}")
        _same(name, t.shape, o_shape, "shape")
    if do.dtype != o.dtype:
        raise TypeError(f"o and do must share one dtype, got {o.dtype} and {do.dtype}")
    if do.stride() != do_row.data.stride():
        raise ValueError(f"do strides {do.stride()} must equal do_row.data's {do_row.data.stride()} (quantize a "
                         "dense do)")
    packed = seq is not None and seq.packed
    _stats_view(stats, (b, h_q, s_q, 1), packed)
    _same_device((("q_row", q_row.data), ("q_col", q_col.data), ("k_row", k_row.data), ("k_col", k_col.data),
                  ("v_row", v_row.data), ("o", o), ("do", do), ("do_row", do_row.data), ("do_col", do_col.data),
                  ("stats", stats)))
    if packed:
        for name, t in (("q_row", q_row.data), ("k_row", k_row.data), ("v_row", v_row.data), ("o", o), ("do", do)):
            _check_packed(name, t, seq)
        for name, x, cu in (("q_col", q_col, seq.cu_seqlens_q), ("k_col", k_col, seq.cu_seqlens_kv),
                            ("do_col", do_col, seq.cu_seqlens_q)):
            _check_segments(name, x, cu)
        return GraphConfig.from_packed(seq.batch, h_q, k_shape[1], packed_capacity(seq.max_seqlen_q),
                                       packed_capacity(seq.max_seqlen_kv), d_qk, v_shape[3], attn_scale=attn_scale,
                                       mask=_mask(mask), out_dtype=o.dtype, fp8_dtype=f8,
                                       deterministic=deterministic)
    return GraphConfig(b=b, h_q=h_q, h_k=k_shape[1], h_v=v_shape[1], s_q=s_q, s_kv=k_shape[2], d_qk=d_qk,
                       d_v=v_shape[3], attn_scale=attn_scale, q_stride=q_row.data.stride(),
                       k_stride=k_row.data.stride(), v_stride=v_row.data.stride(), o_stride=o.stride(),
                       do_stride=do.stride(), mask=_mask(mask), out_dtype=o.dtype, fp8_dtype=f8,
                       deterministic=deterministic, **_varlen_config(seq, b))


def backward_buffers(cfg: GraphConfig, q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats,
                     check: bool = True, seq: Optional[SeqInfo] = None, sink: Optional[torch.Tensor] = None):
    """(variant pack, (dq, dk, dv, amax_dq, amax_dk, amax_dv[, dsink])) for `cfg` on q_row's device; `check`,
    `seq`, `sink` as in forward_buffers; dsink: a zeroed fp32 [1, Hq, 1, 1] buffer for a cfg.dsink graph.

    With a sink, the rows whose stats are -inf (mxattn's rows without a result: padding, queries without keys)
    reach cuDNN as +inf: every probability of such a row, the sink's included, is then exp(-inf) = 0, so they add
    nothing to dQ/dK/dV/dSink (with -inf the sink's would be exp(+inf) times a zero delta)."""
    device = q_row.data.device
    if cfg.packed_layout:
        t_q, t_kv = q_row.data.shape[2], k_row.data.shape[2]
        grads = [_packed_empty(cfg.h_q, t_q, cfg.d_qk, cfg.out_dtype, device),
                 _packed_empty(cfg.h_k, t_kv, cfg.d_qk, cfg.out_dtype, device),
                 _packed_empty(cfg.h_v, t_kv, cfg.d_v, cfg.out_dtype, device)]
        stats = _stats_view(stats, tuple(q_row.data.shape[:3]) + (1,), True)
    else:
        grads = [torch.empty_strided(shape, stride, dtype=cfg.out_dtype, device=device)
                 for shape, stride in ((cfg.q_shape, cfg.q_stride), (cfg.k_shape, cfg.k_stride),
                                       (cfg.v_shape, cfg.v_stride))]
        stats = _stats_view(stats, cfg.stats_shape)
    if cfg.sink:
        stats = stats.clone()  # keeps the strides (dense)
        stats.masked_fill_(stats == float("-inf"), float("inf"))
    amaxes = [torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device) for _ in range(3)]
    if cfg.dsink:
        amaxes.append(torch.zeros(cfg.sink_shape, dtype=torch.float32, device=device))
    (qd, sf_q), (qtd, sf_qt), (kd, sf_k), (ktd, sf_kt), (vd, sf_v), (dod, sf_do), (dotd, sf_dot) = _scales(
        cfg, seq, ((q_row, "q"), (q_col, "q"), (k_row, "kv"), (k_col, "kv"), (v_row, "kv"), (do_row, "q"),
                   (do_col, "q")))
    pack = backward_pack(cfg, q=qd, q_t=qtd, k=kd, k_t=ktd, v=vd, o=o, do_f16=do, do=dod, do_t=dotd,
                         stats=stats, sf_q=sf_q, sf_q_t=sf_qt, sf_k=sf_k,
                         sf_k_t=sf_kt, sf_v=sf_v, sf_do=sf_do, sf_do_t=sf_dot, dq=grads[0], dk=grads[1],
                         dv=grads[2], amax_dq=amaxes[0], amax_dk=amaxes[1], amax_dv=amaxes[2],
                         sink=sink_operand(sink, cfg.h_q, device), dsink=amaxes[3] if cfg.dsink else None,
                         check=check, **_varlen(cfg, seq, "backward"))
    return pack, (*grads, *amaxes)


def cudnn_backward(q_row: MXFP8Tensor, q_col: MXFP8Tensor, k_row: MXFP8Tensor, k_col: MXFP8Tensor,
                   v_row: MXFP8Tensor, o: torch.Tensor, do: torch.Tensor, do_row: MXFP8Tensor,
                   do_col: MXFP8Tensor, stats: torch.Tensor, *, attn_scale: float, mask: Optional[MaskSpec] = None,
                   deterministic: bool = True, seq: Optional[SeqInfo] = None, sink: Optional[torch.Tensor] = None,
                   sink_requires_grad: bool = False) -> Tuple[torch.Tensor, ...]:
    """MXFP8 attention backward with cuDNN.

    q_row/q_col [B,Hq,Sq,Dqk], k_row/k_col [B,Hk,Skv,Dqk], v_row [B,Hv,Skv,Dv], do_row/do_col [B,Hq,Sq,Dv]: the
    row-wise (along D) and column-wise (along S) quantized copies (a pair shares one stride set); o, do
    [B,Hq,Sq,Dv] bf16/fp16 of one dtype (dQ/dK/dV get it; do with do_row's strides); stats [B,Hq,Sq,1] fp32
    from the forward. Returns (dq, dk, dv, amax_dq, amax_dk, amax_dv): gradients in o's dtype with the strides of
    q, k, v; amaxes [1,1,1,1] fp32. seq as in cudnn_forward (packed: [1, H, T, D] token-major views, column-wise
    copies segmented; gradients token-major; rows without a result get zero gradients). sink: the forward's sink
    logits fp32 [Hq] (or None); with sink_requires_grad the outputs end with dsink [Hq] fp32 (dL/dsink summed over
    batch and query rows, cuDNN's dSink_token). Raises MXFP8NotSupportedError (with cuDNN's reason) where cuDNN
    cannot run it.
    """
    args = (q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats)
    mask, seq = _mask(mask), _check_seq(seq)
    if sink_requires_grad and sink is None:
        raise ValueError("sink_requires_grad needs the sink logits (sink=None)")
    if sink is not None and isinstance(q_row, MXFP8Tensor):
        sink = sink_operand(sink, q_row.data.shape[1], q_row.data.device)
    has_sink, dsink = sink is not None, bool(sink_requires_grad)
    key = backward_key(*args, attn_scale, mask, deterministic, seq, has_sink, dsink)
    device = q_row.data.device
    plan = planned(key, "backward", device,
                   lambda: backward_config(*args, attn_scale=attn_scale, mask=mask, deterministic=deterministic,
                                           seq=seq, sink=has_sink, dsink=dsink))
    pack, outputs = backward_buffers(plan.cfg, *args, check=False, seq=seq, sink=sink)
    if dsink:
        outputs = (*outputs[:6], outputs[6].view(-1))
    if plan.cfg.packed_layout and (q_row.data.shape[2] == 0 or k_row.data.shape[2] == 0):
        for t in outputs:
            t.zero_()
        return outputs
    execute(plan, pack, device)
    if seq is not None:
        for g, which in zip(outputs[:3], ("q", "kv", "kv")):
            g.masked_fill_(~valid_rows(seq, which, g.shape[2]), 0)
    return outputs


# ---------------------------------------------------------------------------------------------------------------
# deciding up front (CudnnBackend.supports)
# ---------------------------------------------------------------------------------------------------------------
#: first cuDNN that runs the backward of a ragged (packed) graph with a sink_token (cuDNN frontend 1.32's rule)
SINK_PACKED_BACKWARD_VERSION = 92600


def known_refusal(problem: Problem) -> Optional[str]:
    """Why cuDNN will refuse `problem`, decided from the Problem alone (no cuDNN call), or None.

    cuDNN 9.28's rules (its C++ validation): a left-bounded band needs s_q <= s_kv unless the batch has
    per-sequence lengths; the backward with a bottom-right band that has a right bound needs s_q <= s_kv and both
    multiples of 64; the forward's bottom-right band needs s_q <= s_kv unless the batch has per-sequence lengths.
    For a packed batch s_q / s_kv are the graph's capacities (`packed_capacity`: multiples of 128), so only
    s_q <= s_kv can fail there.

    Attention sinks (softmax_type "off-by-one"/"learnable"): cuDNN 9.28's validation accepts sink_token (and
    dSink_token) on every dense, padded and packed MXFP8 graph it accepts without one, so a sink adds no rule there;
    its frontend refuses the packed (ragged) backward with a sink below cuDNN 9.26 (an out-of-bounds read in its
    dO.O pre-pass), which is checked here against the loaded cuDNN."""
    m = problem.mask
    if problem.out_dtype not in OUT_DTYPES:
        return f"cuDNN writes O in bfloat16 or float16, not {problem.out_dtype}"
    softmax_type = getattr(problem, "softmax_type", "vanilla")
    if softmax_type not in SOFTMAX_TYPES:
        return f"cuDNN has no softmax_type {softmax_type!r} (it runs {', '.join(SOFTMAX_TYPES)})"
    if (softmax_type != "vanilla" and problem.varlen == "packed" and problem.needs_backward
            and cudnn.backend_version() < SINK_PACKED_BACKWARD_VERSION):
        return (f"cuDNN {cudnn.backend_version()} cannot run the packed (thd) backward with an attention sink "
                f"(softmax_type {softmax_type!r}): it needs cuDNN >= 9.26.0")
    s_q, s_kv = problem.seqlen_q, problem.seqlen_kv
    if s_q is None or s_kv is None:  # sizes unknown (the choice under torch.compile): the call checks them
        return None
    if problem.varlen == "packed":
        s_q, s_kv = packed_capacity(s_q), packed_capacity(s_kv)
    if m.left_bound is not None and problem.varlen is None and s_q > s_kv:
        return (f"cuDNN does not support a left-bounded band (left_bound={m.left_bound}) with s_q={s_q} > "
                f"s_kv={s_kv} without per-sequence lengths (sliding window needs max_s_q <= max_s_kv)")
    if not (m.bottom_right and m.right_bound is not None):
        return None
    what = f"a bottom-right band (right_bound={m.right_bound}) with s_q={s_q}, s_kv={s_kv}"
    if s_q > s_kv and (problem.varlen is None or problem.needs_backward):
        return f"cuDNN does not support {what}: s_q > s_kv" + (" in the backward" if problem.varlen else "")
    if problem.needs_backward and (s_q % 64 or s_kv % 64):
        return f"cuDNN's backward does not support {what}: both must be multiples of 64"
    return None


def problem_config(problem: Problem, kind: str = "forward") -> GraphConfig:
    """The graph config the backend will build for `problem` (bshd inputs, e4m3; packed: thd), for planning up
    front. The layout of the real call may differ; it does not change what cuDNN supports. The sink facts follow
    problem.softmax_type (the forward never has dsink)."""
    p = problem
    kw = dict(attn_scale=p.head_dim ** -0.5, mask=p.mask, out_dtype=p.out_dtype)
    if p.varlen == "packed":
        cfg = GraphConfig.from_packed(p.batch, p.heads_q, p.heads_kv, packed_capacity(p.seqlen_q),
                                      packed_capacity(p.seqlen_kv), p.head_dim, **kw)
    else:
        cfg = GraphConfig.from_layout(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim,
                                      layout="bshd", **kw)
        if p.varlen == "padded":
            cfg = dataclasses.replace(cfg, varlen="padded")
    return cfg.for_softmax(getattr(p, "softmax_type", "vanilla"), kind)


def check_problem(problem: Problem, handle=None, device_index: int = 0, sm_version: int = 100
                  ) -> Tuple[bool, str]:
    """(ok, reason) for `problem` on cuDNN: the known refusals, then the forward graph and, if
    problem.needs_backward, the backward graph are built for `problem_config`. With `handle` (a cudnn.Handle of
    CUDA device `device_index`) they are planned there (and the plans cached for the calls); without, cuDNN's own
    validation runs deviceless for SM `sm_version` (no GPU needed). Never raises."""
    try:
        refusal = known_refusal(problem)
        if refusal:
            return False, refusal
        if problem.batch < 1 or problem.seqlen_q < 1 or problem.seqlen_kv < 1:
            return True, "empty problem: nothing for cuDNN to run"
        kinds = ("forward", "backward") if problem.needs_backward else ("forward",)
        for kind in kinds:
            cfg = problem_config(problem, kind)
            if handle is not None:
                planned_graph(kind, cfg, device_index, handle)
            else:
                build = build_forward_graph if kind == "forward" else build_backward_graph
                graph_json(build(cfg, sm_version=sm_version))
        return True, "cuDNN " + (" and ".join(kinds)) + (" planned" if handle is not None else " validated")
    except MXFP8NotSupportedError as exc:
        return False, str(exc)
    except (TypeError, ValueError) as exc:
        return False, f"no cuDNN graph for this problem: {exc}"


_SUPPORT: Dict[Problem, Tuple[bool, str]] = {}
_SUPPORT_LOCK = threading.Lock()


def _support_handle(device: torch.device):
    """(cuDNN handle, device index) to plan with on `device` (a device where cuDNN MXFP8 runs)."""
    state = _supported_state(device)
    return state.get_handle(), state.index


def clear_support_cache() -> None:
    with _SUPPORT_LOCK:
        _SUPPORT.clear()


# ---------------------------------------------------------------------------------------------------------------
# the AttentionBackend
# ---------------------------------------------------------------------------------------------------------------
def _graph_layout(x: torch.Tensor) -> torch.Tensor:
    """x itself when its strides can go to cuDNN (dense, D innermost: bshd/bhsd/sbhd views), else a contiguous
    copy (a strided slice, or D not innermost)."""
    return x if x.stride(-1) == 1 and _is_dense(x) else x.contiguous()


def _thd_layout(x: torch.Tensor) -> torch.Tensor:
    """x [1, H, T, D] itself when token-major (a view of [T, H, D]), else a token-major copy."""
    if all(st == want for st, want, n in zip(x.stride()[1:], _token_major(x.shape), x.shape[1:]) if n > 1):
        return x
    return x[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0)


def _zero_padding(x: torch.Tensor, seq: SeqInfo, which: str) -> torch.Tensor:
    """x with the padding rows of a padded batch set to 0 (the reference backend's rule: padding values reach
    no scale), in x's layout."""
    return x.masked_fill(~seq.valid_rows(which, x.shape[2]), 0)


@functools.lru_cache(maxsize=None)
def _fused_quantizer():
    """The Triton fused quantizer (`quantize_rowcol`), or None where Triton cannot be imported."""
    try:
        from ..kernels.triton_quantize import quantize_rowcol
    except Exception:  # noqa: BLE001 -- no (working) Triton: the torch ops quantize
        return None
    return quantize_rowcol


def _quantizer_for(x: torch.Tensor):
    """The fused quantizer for x (CUDA tensors, Triton importable), else None (torch ops)."""
    return _fused_quantizer() if x.is_cuda else None


def quantize_operand(x: torch.Tensor, seq: Optional[SeqInfo], which: str
                     ) -> Tuple[MXFP8Tensor, MXFP8Tensor]:
    """(row-wise, column-wise) MXFP8 copies of x [B, H, S, D] (a dense layout cuDNN takes: `_graph_layout`),
    blocks of 32 along D and along S, each carrying the F8_128x4 scale tensor the cuDNN graph reads
    (`scale_f8_128x4`). seq: a padded batch (rows past each length of side `which`, "q" or "kv", quantize as
    zeros: the reference backend's rule) or None. On CUDA with Triton one fused launch writes the data, the
    compact scales and the graph's scale bytes; otherwise torch ops (mxattn.formats) make the same bytes."""
    quantize = _quantizer_for(x)
    if quantize is None:
        if seq is not None:
            x = _zero_padding(x, seq, which)
        row, col = quantize_mxfp8(x, axis=-1), quantize_mxfp8(x, axis=-2)
        row.scale_f8_128x4, col.scale_f8_128x4 = row_scale_buffer(row.scale), col_scale_bytes(col.scale)
        return row, col
    cu = None if seq is None else (seq.cu_seqlens_q if which == "q" else seq.cu_seqlens_kv)
    from ..kernels import triton_launch  # imported with the quantizer
    if x.device.index not in (None, triton_launch.current_device()):  # Triton launches on the current device
        with torch.cuda.device(x.device):
            out = quantize(x, swizzle=True, cu_seqlens=cu)
    else:
        out = quantize(x, swizzle=True, cu_seqlens=cu)
    return (MXFP8Tensor.unchecked(out.row.data, out.row.scale, 3, None, out.row_swizzled),
            MXFP8Tensor.unchecked(out.col.data, out.col.scale, 2, None, out.col_swizzled))


@dataclasses.dataclass
class SavedWithScaleBuffers(SavedForBackward):
    """The cudnn backend's saved format: `SavedForBackward` and, for dense and padded batches, each copy's
    F8_128x4 scales as the graph reads them (`MXFP8Tensor.scale_f8_128x4`: row-wise [B, H, Sp, D32p], column-wise
    the [Dp, B*H*S32p] bytes), so the backward hands cuDNN the forward's scale bytes instead of re-swizzling
    them. A packed batch's scale layout depends on its lengths: it keeps the compact scales only."""

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        copies = (self.q_row, self.q_col, self.k_row, self.k_col, self.v_row)
        buffers = tuple(getattr(t, "scale_f8_128x4", None) for t in copies)
        return super().tensors() + (() if any(b is None for b in buffers) else buffers)

    @classmethod
    def from_tensors(cls, flat, seq: Optional[SeqInfo] = None) -> "SavedWithScaleBuffers":
        saved = super().from_tensors(flat[:10], seq)
        if len(flat) == 15:
            for t, buf in zip((saved.q_row, saved.q_col, saved.k_row, saved.k_col, saved.v_row), flat[10:]):
                t.scale_f8_128x4 = buf
        return saved

    @classmethod
    def fake_tensors(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: Optional[SeqInfo] = None
                     ) -> Tuple[torch.Tensor, ...]:
        base = super().fake_tensors(q, k, v, seq)
        if seq is not None and seq.packed:
            return base
        e8m0 = torch.float8_e8m0fnu

        def row(x):
            return x.new_empty(row_scale_dims(*x.shape), dtype=e8m0)

        def col(x):
            b, h, s32p, dp = col_scale_dims(*x.shape)
            return x.new_empty((dp, b * h * s32p), dtype=e8m0)

        return base + (row(q), col(q), row(k), col(k), row(v))


class CudnnBackend(AttentionBackend):
    """cuDNN's fused MXFP8 attention (Blackwell). Quantizes with mxattn.formats (round-up E8M0 scales)."""

    name = "cudnn"
    saved_format = SavedWithScaleBuffers
    #: head dims cuDNN's graph validation accepts for d_qk == d_v (cuDNN may still refuse one at planning time,
    #: which `supports` finds out up front on a Blackwell device).
    supported_head_dims = (16, 32, 48, 64, 80, 96, 112, 128, 256)

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        return cudnn_support(device)

    @classmethod
    def supports_recipe(cls, recipe: Recipe) -> Tuple[bool, str]:
        """cuDNN's MXFP8 SDPA graphs have one recipe, the default; every variant is refused with the reason."""
        if recipe.is_default:
            return True, "cuDNN's MXFP8 SDPA recipe"
        return False, (f"cuDNN's MXFP8 SDPA graphs implement only the default recipe (P with the fixed scale 256, "
                       f"MXFP8 V and dS, round-up E8M0 block scales); this call asks for {recipe.differences()}: "
                       "use backend='reference', or 'auto' to route it to a backend that runs it")

    @classmethod
    def supports(cls, problem):
        """Base checks, the known refusals, then (cached per problem) the forward and, for training, the backward
        graph planned on the problem's device."""
        ok, reason = super().supports(problem)
        if not ok:
            return ok, reason
        refusal = known_refusal(problem)
        if refusal:
            return False, refusal
        if None in (problem.batch, problem.seqlen_q, problem.seqlen_kv):
            return True, ("sizes unknown when choosing (torch.compile): cuDNN plans the graphs at the call and "
                          "refuses unsupported shapes there")
        with _SUPPORT_LOCK:
            answer = _SUPPORT.get(problem)
        if answer is None:
            try:
                handle, index = _support_handle(problem.device)
            except MXFP8NotSupportedError as exc:
                return False, str(exc)
            answer = check_problem(problem, handle, index)
            with _SUPPORT_LOCK:
                _SUPPORT[problem] = answer
        return answer

    def forward(self, q, k, v, params: AttentionParams):
        _supported_state(q.device)
        seq = params.seq
        if seq is not None and seq.packed:
            q, k, v = _thd_layout(q), _thd_layout(k), _thd_layout(v)
            cu_q, cu_kv = seq.cu_seqlens_q, seq.cu_seqlens_kv
            q_row, k_row = quantize_mxfp8(q, axis=-1), quantize_mxfp8(k, axis=-1)
            q_col, k_col = quantize_mxfp8(q, axis=-2, segments=cu_q), quantize_mxfp8(k, axis=-2, segments=cu_kv)
            v_col = quantize_mxfp8(v, axis=-2, segments=cu_kv)
            v_row = quantize_mxfp8(v, axis=-1)
        else:
            q, k, v = _graph_layout(q), _graph_layout(k), _graph_layout(v)
            q_row, q_col = quantize_operand(q, seq, "q")
            k_row, k_col = quantize_operand(k, seq, "kv")
            v_row, v_col = quantize_operand(v, seq, "kv")
        o, stats, _ = cudnn_forward(q_row, k_row, v_col, attn_scale=params.softmax_scale, mask=params.mask,
                                    out_dtype=params.out_dtype, seq=seq, sink=params.sink)
        saved = SavedWithScaleBuffers(q_row=q_row, q_col=q_col, k_row=k_row, k_col=k_col, v_row=v_row)
        return o, stats, saved

    def backward(self, saved: SavedForBackward, o, stats, do, params: AttentionParams):
        _supported_state(o.device)
        seq = params.seq
        o, do = o.to(params.out_dtype), do.to(params.out_dtype)
        if seq is not None and seq.packed:
            o, do = _thd_layout(o), _thd_layout(do)
            do_row, do_col = quantize_mxfp8(do, axis=-1), quantize_mxfp8(do, axis=-2, segments=seq.cu_seqlens_q)
        else:
            o, do = _graph_layout(o), _graph_layout(do)
            if seq is not None:  # cuDNN reads the bf16 dO too: its padding rows must be zeros
                do = _graph_layout(_zero_padding(do, seq, "q"))
            do_row, do_col = quantize_operand(do, None, "q")
        out = cudnn_backward(saved.q_row, saved.q_col, saved.k_row, saved.k_col, saved.v_row, o, do, do_row, do_col,
                             stats, attn_scale=params.softmax_scale, mask=params.mask,
                             deterministic=params.deterministic, seq=seq, sink=params.sink,
                             sink_requires_grad=params.sink_requires_grad)
        if params.sink_requires_grad:
            return out[0], out[1], out[2], out[6]
        return out[0], out[1], out[2]
