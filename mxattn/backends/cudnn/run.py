"""Running cuDNN's MXFP8 attention graphs: per-device state (handle, lock, workspaces), plan lookup and launch, and
the typed interface on already-quantized `MXFP8Tensor`s: `cudnn_forward` / `cudnn_backward` (compact scales in;
the F8_128x4 buffers are made here) return the outputs with cuDNN's amax side outputs.

Attention sinks (TE's softmax_type, `AttentionParams.sink`): the graphs get cuDNN's sink_token (fp32
[1, Hq, 1, 1], a view of the [Hq] logits) and, when the sink's gradient is wanted ("learnable"), the backward's
dSink_token output, returned as dsink [Hq] fp32 after dq, dk, dv.

Variable lengths (`SeqInfo`): a padded batch runs the dense graph with cuDNN's padding mask and per-sequence
lengths; a packed (thd) batch runs the ragged graph (token-major tensors with ragged offsets, scales in cuDNN's
per-sequence-tile layout, `buffers`). Graph keys and configs never hold the lengths' values (a packed graph
is sized by the longest sequences rounded up to 128), so new lengths reuse the graph.

Execution: graphs come from `graphs.GRAPH_CACHE` (planned once per config and device; looked up by the
facts of the argument tensors, so a hit re-validates nothing), run on torch's
current stream with one cuDNN handle per device (launches serialised by a per-device lock, since a handle carries
one stream at a time) and one workspace per (device, stream), grown only when a plan needs more.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, Optional, Tuple

import torch

from .frontend import cudnn

from ...errors import MXFP8NotSupportedError
from ...formats import MXFP8Tensor
from ...runtime.host_calls import issue
from ...formats import _is_non_overlapping_and_dense as _is_dense
from ...mask import MaskSpec
from ...seqinfo import SeqInfo
from .buffers import backward_pack, forward_pack, operand, sink_operand, thd_scale_buffer, varlen_tensors
from .config import GraphConfig, axis_order, dense_stride, packed_capacity, row_major
from .graphs import GRAPH_CACHE, PlannedGraph, planned_graph
from .support import cudnn_support

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


def issue_execute(plan: PlannedGraph, pack: Dict[int, torch.Tensor], device: torch.device) -> None:
    """`execute(plan, pack, device)`, also reported to a launch-plan recording on this thread (`host_calls`): a
    replay of the recorded body then executes `plan` with the pack rebuilt on its own tensors, while `plan` is
    still in `GRAPH_CACHE` (a cleared cache refuses the replay)."""
    issue(_execute_pack, (plan, device), pack, GRAPH_CACHE.holds_generation())


def _execute_pack(static, pack: Dict[int, torch.Tensor]) -> None:
    """`execute` for a host call: static (plan, device) (looked up here, so the module's `execute` runs)."""
    execute(static[0], pack, static[1])


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


def _check_seq(seq) -> Optional[SeqInfo]:
    if seq is not None and not isinstance(seq, SeqInfo):
        raise TypeError(f"seq must be a mxattn.seqinfo.SeqInfo or None, got {type(seq).__name__}")
    return seq


def _seq_facts(seq: Optional[SeqInfo]) -> tuple:
    """Cache-key part of the lengths: their kind (`SeqInfo.kind`, spelled out: this runs per call), batch and
    device and, packed, the graph capacity of max_seqlen_q/kv; never the lengths' values."""
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
    return dict(varlen=seq.kind)


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
        s = cfg.s_q if which == "q" else cfg.s_kv
        out.append((x.data, thd_scale_buffer(x, seq.cu_seqlens(which), cfg.b, s)))
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
    issue_execute(plan, pack, device)
    if seq is not None:
        keep = seq.result_rows("q", q.data.shape[2])
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
    issue_execute(plan, pack, device)
    if seq is not None:
        for g, which in zip(outputs[:3], ("q", "kv", "kv")):
            g.masked_fill_(~seq.result_rows(which, g.shape[2]), 0)
    return outputs
