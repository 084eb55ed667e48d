"""The `cudnn` backend: cuDNN's fused MXFP8 attention graphs (Blackwell, SM 10.x, cuDNN >= 9.21).

Two layers:
  * `cudnn_forward` / `cudnn_backward` run the graphs on already-quantized `MXFP8Tensor`s (compact scales; the
    F8_128x4 buffers are made here) and return the outputs with cuDNN's amax side outputs;
  * `CudnnBackend` is the `AttentionBackend` that quantizes (mxattn.formats.quantize_mxfp8) and calls them.

Execution: graphs come from `cudnn_graphs.GRAPH_CACHE` (planned once per config and device; looked up by the
facts of the argument tensors, so a hit re-validates nothing), run on torch's
current stream with one cuDNN handle per device (launches serialised by a per-device lock, since a handle carries
one stream at a time) and one workspace per (device, stream), grown only when a plan needs more.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

import torch

import cudnn

from ..cudnn_graphs import (GRAPH_CACHE, GraphConfig, PlannedGraph, axis_order, backward_pack, build_and_plan,
                            dense_stride, forward_pack, operand, row_major)
from ..cudnn_support import cudnn_support
from ..errors import MXFP8NotSupportedError
from ..formats import MXFP8Tensor, quantize_mxfp8
from ..formats import _is_non_overlapping_and_dense as _is_dense
from ..mask import MaskSpec
from .base import AttentionBackend, AttentionParams, SavedForBackward

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
    support on `device` is checked and the `kind` graph is built and planned (MXFP8NotSupportedError if
    impossible)."""
    plan = GRAPH_CACHE.lookup(key)
    if plan is None:
        cfg = make_config()
        state = _supported_state(device)
        plan = GRAPH_CACHE.get(key, lambda: build_and_plan(kind, cfg, state.get_handle()))
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
    if not _is_dense(x.data):
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


def _mx_facts(name: str, x) -> tuple:
    """What a GraphConfig is derived from, of an MXFP8Tensor argument (cache-key part)."""
    if not isinstance(x, MXFP8Tensor):
        raise TypeError(f"{name} must be an mxattn.MXFP8Tensor, got {type(x).__name__}")
    d = x.data
    return (x.axis, d.shape, d.stride(), d.dtype, d.device, x.scale.device)


def _t_facts(name: str, t) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return (t.shape, t.stride(), t.dtype, t.device)


def _mask(mask) -> MaskSpec:
    if mask is None:
        return _NO_MASK
    if not isinstance(mask, MaskSpec):
        raise TypeError(f"mask must be a mxattn.MaskSpec or None, got {type(mask).__name__}")
    return mask


def forward_key(q, k, v, attn_scale, mask: MaskSpec, out_dtype) -> tuple:
    """Cache key of a forward call: every fact of its arguments that its GraphConfig is derived from."""
    return ("forward", _mx_facts("q", q), _mx_facts("k", k), _mx_facts("v", v), attn_scale, mask, out_dtype)


def backward_key(q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats, attn_scale, mask: MaskSpec,
                 deterministic) -> tuple:
    """Cache key of a backward call (as forward_key)."""
    return ("backward", _mx_facts("q_row", q_row), _mx_facts("q_col", q_col), _mx_facts("k_row", k_row),
            _mx_facts("k_col", k_col), _mx_facts("v_row", v_row), _t_facts("o", o), _t_facts("do", do),
            _mx_facts("do_row", do_row), _mx_facts("do_col", do_col), _t_facts("stats", stats), attn_scale, mask,
            bool(deterministic))


def forward_config(q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, *, attn_scale: float,
                   mask: Optional[MaskSpec] = None, out_dtype: torch.dtype = torch.bfloat16) -> GraphConfig:
    """GraphConfig of the forward for row-wise q [B,Hq,Sq,Dqk], k [B,Hk,Skv,Dqk] and column-wise v [B,Hv,Skv,Dv]
    (O gets q's axis order). Raises TypeError/ValueError naming the bad argument."""
    b, h_q, s_q, d_qk = _check_mx("q", q, 3)
    _, h_k, s_kv, _ = _check_mx("k", k, 3, q.data.dtype)
    _, h_v, _, d_v = _check_mx("v", v, 2, q.data.dtype)
    _same("k", (k.data.shape[0], k.data.shape[3]), (b, d_qk), "(batch, head dim)")
    _same("v", (v.data.shape[0], v.data.shape[2]), (b, s_kv), "(batch, sequence length)")
    _same_device((("q", q.data), ("k", k.data), ("v", v.data)))
    o_shape = (b, h_q, s_q, d_v)
    return GraphConfig(b=b, h_q=h_q, h_k=h_k, h_v=h_v, s_q=s_q, s_kv=s_kv, d_qk=d_qk, d_v=d_v,
                       attn_scale=attn_scale, q_stride=q.data.stride(), k_stride=k.data.stride(),
                       v_stride=v.data.stride(), o_stride=dense_stride(o_shape, axis_order(q.data.stride())),
                       mask=_mask(mask), out_dtype=out_dtype, fp8_dtype=q.data.dtype)


def forward_buffers(cfg: GraphConfig, q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, check: bool = True):
    """(variant pack, (o, stats, amax_o)) for `cfg` on q's device: fresh outputs, F8_128x4 scale buffers.
    `check`: verify every slot against the graph (cudnn_forward skips it: its cache key pins the geometry)."""
    device = q.data.device
    o = torch.empty_strided(cfg.o_shape, cfg.o_stride, dtype=cfg.out_dtype, device=device)
    stats = torch.empty(cfg.stats_shape, dtype=torch.float32, device=device)
    amax_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
    (qd, sf_q), (kd, sf_k), (vd, sf_v) = operand(q), operand(k), operand(v)
    pack = forward_pack(cfg, q=qd, sf_q=sf_q, k=kd, sf_k=sf_k, v=vd, sf_v=sf_v, o=o, stats=stats, amax_o=amax_o,
                        check=check)
    return pack, (o, stats, amax_o)


def cudnn_forward(q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, *, attn_scale: float,
                  mask: Optional[MaskSpec] = None, out_dtype: torch.dtype = torch.bfloat16
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 attention forward with cuDNN.

    q [B,Hq,Sq,Dqk], k [B,Hk,Skv,Dqk]: quantized along D (row-wise); v [B,Hv,Skv,Dv]: quantized along S
    (column-wise); one CUDA device, one fp8 dtype. Returns (o [B,Hq,Sq,Dv] out_dtype in q's axis order,
    stats [B,Hq,Sq,1] fp32 log-sum-exp, amax_o [1,1,1,1] fp32 = max|o|).
    Raises MXFP8NotSupportedError (with cuDNN's reason) where cuDNN cannot run it.
    """
    mask = _mask(mask)
    key = forward_key(q, k, v, attn_scale, mask, out_dtype)
    plan = planned(key, "forward", q.data.device,
                   lambda: forward_config(q, k, v, attn_scale=attn_scale, mask=mask, out_dtype=out_dtype))
    # plan.cfg: the cached config, with its slot specs computed once; the key pins every argument's geometry
    pack, outputs = forward_buffers(plan.cfg, q, k, v, check=False)
    execute(plan, pack, q.data.device)
    return outputs


def _stats_view(stats: torch.Tensor, shape) -> torch.Tensor:
    if not isinstance(stats, torch.Tensor) or stats.dtype != torch.float32:
        raise TypeError(f"stats must be a float32 tensor, got {getattr(stats, 'dtype', type(stats).__name__)}")
    _same("stats", stats.shape, shape, "shape")
    if stats.stride() != row_major(shape):
        stats = stats.contiguous().as_strided(shape, row_major(shape))
    return stats


def backward_config(q_row: MXFP8Tensor, q_col: MXFP8Tensor, k_row: MXFP8Tensor, k_col: MXFP8Tensor,
                    v_row: MXFP8Tensor, o: torch.Tensor, do: torch.Tensor, do_row: MXFP8Tensor,
                    do_col: MXFP8Tensor, stats: torch.Tensor, *, attn_scale: float, mask: Optional[MaskSpec] = None,
                    deterministic: bool = True) -> GraphConfig:
    """GraphConfig of the backward (arguments as cudnn_backward). Raises TypeError/ValueError naming the bad
    argument."""
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
    _stats_view(stats, (b, h_q, s_q, 1))
    _same_device((("q_row", q_row.data), ("q_col", q_col.data), ("k_row", k_row.data), ("k_col", k_col.data),
                  ("v_row", v_row.data), ("o", o), ("do", do), ("do_row", do_row.data), ("do_col", do_col.data),
                  ("stats", stats)))
    return GraphConfig(b=b, h_q=h_q, h_k=k_shape[1], h_v=v_shape[1], s_q=s_q, s_kv=k_shape[2], d_qk=d_qk,
                       d_v=v_shape[3], attn_scale=attn_scale, q_stride=q_row.data.stride(),
                       k_stride=k_row.data.stride(), v_stride=v_row.data.stride(), o_stride=o.stride(),
                       do_stride=do.stride(), mask=_mask(mask), out_dtype=o.dtype, fp8_dtype=f8,
                       deterministic=deterministic)


def backward_buffers(cfg: GraphConfig, q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats,
                     check: bool = True):
    """(variant pack, (dq, dk, dv, amax_dq, amax_dk, amax_dv)) for `cfg` on q_row's device; `check` as in
    forward_buffers."""
    device = q_row.data.device
    grads = [torch.empty_strided(shape, stride, dtype=cfg.out_dtype, device=device)
             for shape, stride in ((cfg.q_shape, cfg.q_stride), (cfg.k_shape, cfg.k_stride),
                                   (cfg.v_shape, cfg.v_stride))]
    amaxes = [torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device) for _ in range(3)]
    (qd, sf_q), (qtd, sf_qt), (kd, sf_k), (ktd, sf_kt) = map(operand, (q_row, q_col, k_row, k_col))
    (vd, sf_v), (dod, sf_do), (dotd, sf_dot) = map(operand, (v_row, do_row, do_col))
    pack = backward_pack(cfg, q=qd, q_t=qtd, k=kd, k_t=ktd, v=vd, o=o, do_f16=do, do=dod, do_t=dotd,
                         stats=_stats_view(stats, cfg.stats_shape), sf_q=sf_q, sf_q_t=sf_qt, sf_k=sf_k,
                         sf_k_t=sf_kt, sf_v=sf_v, sf_do=sf_do, sf_do_t=sf_dot, dq=grads[0], dk=grads[1],
                         dv=grads[2], amax_dq=amaxes[0], amax_dk=amaxes[1], amax_dv=amaxes[2], check=check)
    return pack, (*grads, *amaxes)


def cudnn_backward(q_row: MXFP8Tensor, q_col: MXFP8Tensor, k_row: MXFP8Tensor, k_col: MXFP8Tensor,
                   v_row: MXFP8Tensor, o: torch.Tensor, do: torch.Tensor, do_row: MXFP8Tensor,
                   do_col: MXFP8Tensor, stats: torch.Tensor, *, attn_scale: float, mask: Optional[MaskSpec] = None,
                   deterministic: bool = True) -> Tuple[torch.Tensor, ...]:
    """MXFP8 attention backward with cuDNN.

    q_row/q_col [B,Hq,Sq,Dqk], k_row/k_col [B,Hk,Skv,Dqk], v_row [B,Hv,Skv,Dv], do_row/do_col [B,Hq,Sq,Dv]: the
    row-wise (along D) and column-wise (along S) quantized copies (a pair shares one stride set); o, do
    [B,Hq,Sq,Dv] bf16/fp16 of one dtype (dQ/dK/dV get it; do with do_row's strides); stats [B,Hq,Sq,1] fp32
    from the forward. Returns (dq, dk, dv, amax_dq, amax_dk, amax_dv): gradients in o's dtype with the strides of
    q, k, v; amaxes [1,1,1,1] fp32. Raises MXFP8NotSupportedError (with cuDNN's reason) where cuDNN cannot run it.
    """
    args = (q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats)
    mask = _mask(mask)
    key = backward_key(*args, attn_scale, mask, deterministic)
    plan = planned(key, "backward", q_row.data.device,
                   lambda: backward_config(*args, attn_scale=attn_scale, mask=mask, deterministic=deterministic))
    pack, outputs = backward_buffers(plan.cfg, *args, check=False)
    execute(plan, pack, q_row.data.device)
    return outputs


# ---------------------------------------------------------------------------------------------------------------
# the AttentionBackend
# ---------------------------------------------------------------------------------------------------------------
def _graph_layout(x: torch.Tensor) -> torch.Tensor:
    """x itself when its strides can go to cuDNN (dense, D innermost: bshd/bhsd/sbhd views), else a contiguous
    copy (a strided slice, or D not innermost)."""
    return x if x.stride(-1) == 1 and _is_dense(x) else x.contiguous()


class CudnnBackend(AttentionBackend):
    """cuDNN's fused MXFP8 attention (Blackwell). Quantizes with mxattn.formats (round-up E8M0 scales)."""

    name = "cudnn"
    #: head dims cuDNN's graph validation accepts for d_qk == d_v (cuDNN may still refuse one at planning time,
    #: which raises MXFP8NotSupportedError with its reason).
    supported_head_dims = (16, 32, 48, 64, 80, 96, 112, 128, 256)

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        return cudnn_support(device)

    @classmethod
    def supports(cls, problem):
        ok, reason = super().supports(problem)
        if ok and problem.varlen is not None:
            return False, "variable-length graphs are not wired into the cudnn backend yet"
        return ok, reason

    def forward(self, q, k, v, params: AttentionParams):
        _supported_state(q.device)
        q, k, v = _graph_layout(q), _graph_layout(k), _graph_layout(v)
        q_row, k_row, v_col = quantize_mxfp8(q, axis=-1), quantize_mxfp8(k, axis=-1), quantize_mxfp8(v, axis=-2)
        o, stats, _ = cudnn_forward(q_row, k_row, v_col, attn_scale=params.softmax_scale, mask=params.mask,
                                    out_dtype=params.out_dtype)
        saved = SavedForBackward(q_row=q_row, q_col=quantize_mxfp8(q, axis=-2), k_row=k_row,
                                 k_col=quantize_mxfp8(k, axis=-2), v_row=quantize_mxfp8(v, axis=-1))
        return o, stats, saved

    def backward(self, saved: SavedForBackward, o, stats, do, params: AttentionParams):
        _supported_state(o.device)
        o, do = _graph_layout(o.to(params.out_dtype)), _graph_layout(do.to(params.out_dtype))
        do_row, do_col = quantize_mxfp8(do, axis=-1), quantize_mxfp8(do, axis=-2)
        dq, dk, dv, *_ = cudnn_backward(saved.q_row, saved.q_col, saved.k_row, saved.k_col, saved.v_row, o, do,
                                        do_row, do_col, stats, attn_scale=params.softmax_scale, mask=params.mask,
                                        deterministic=params.deterministic)
        return dq, dk, dv
