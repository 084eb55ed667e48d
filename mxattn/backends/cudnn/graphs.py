"""cuDNN frontend graphs for MXFP8 attention: the graph builders, `graph_json`, planning and a cache of planned
graphs.

Everything here except `planned_graph` runs without a GPU: graphs are built with the pure-Python `cudnn.pygraph`
(validated by `validate()` and `build_operation_graph()`), and `graph_json` lowers a graph built without a device
handle to the cuDNN C++ frontend, runs cuDNN's own (arch-aware) validation and returns its JSON.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from .frontend import cudnn

from ...errors import MXFP8NotSupportedError
from .config import FP8_DTYPES, OUT_DTYPES, SCALE_DTYPE, VARLEN_UIDS, BwdUid, FwdUid, GraphConfig

_ALIGNMENT = {"top_left": cudnn.diagonal_alignment.TOP_LEFT, "bottom_right": cudnn.diagonal_alignment.BOTTOM_RIGHT}
#: heuristics asked for when planning; FALLBACK keeps a plan available where mode A has none.
HEUR_MODES = (cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK)


# ---------------------------------------------------------------------------------------------------------------
# graph builders
# ---------------------------------------------------------------------------------------------------------------
_CUDNN_TYPES = {torch.float32: cudnn.data_type.FLOAT, SCALE_DTYPE: cudnn.data_type.FP8_E8M0,
                torch.int32: cudnn.data_type.INT32, torch.int64: cudnn.data_type.INT64, **OUT_DTYPES, **FP8_DTYPES}


def _new_graph(cfg: GraphConfig, handle, sm_version: int, name: str):
    if handle is None:  # deviceless: lowering and cuDNN's validation target `sm_version`, no GPU needed
        handle_kwargs = dict(handle=cudnn.Handle(None), sm_version=sm_version)
    else:
        handle_kwargs = dict(handle=handle)
    return cudnn.pygraph(name=name, io_data_type=FP8_DTYPES[cfg.fp8_dtype],
                         intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
                         **handle_kwargs)


def _declare_inputs(graph, specs, uids):
    out = {}
    for uid in uids:
        shape, stride, dtype = specs[int(uid)]
        is_scale = dtype == SCALE_DTYPE
        out[uid] = graph.tensor(dim=list(shape), stride=list(stride), data_type=_CUDNN_TYPES[dtype], uid=int(uid),
                                name=uid.name, reordering_type=cudnn.tensor_reordering.F8_128x4 if is_scale else None)
    return out


def _declare_varlen(graph, cfg: GraphConfig, specs, uids) -> dict:
    """The SEQ_LEN_Q/KV (and, packed, RAGGED_*) input tensors of a variable-length graph, keyed by uid."""
    if cfg.varlen is None:
        return {}
    return _declare_inputs(graph, specs, [getattr(uids, name) for name in VARLEN_UIDS[cfg.varlen]])


def _set_ragged(tensors: dict, varlen: dict, uids, which) -> None:
    """Attach ragged offsets: `which` maps a RAGGED_* uid name to the tensor uids it serves."""
    for ragged, served in which.items():
        offset = varlen.get(getattr(uids, ragged))
        if offset is not None:
            for uid in served:
                tensors[uid].set_ragged_offset(offset)


def _varlen_kwargs(cfg: GraphConfig, varlen: dict, uids) -> dict:
    if cfg.varlen is None:
        return {}
    out = dict(use_padding_mask=True, seq_len_q=varlen[uids.SEQ_LEN_Q], seq_len_kv=varlen[uids.SEQ_LEN_KV])
    if cfg.packed_layout:
        out.update(max_total_seq_len_q=cfg.max_total_seq_len_q, max_total_seq_len_kv=cfg.max_total_seq_len_kv)
    return out


def _declare_outputs(graph_outputs, specs, uids):
    for tensor, uid in zip(graph_outputs, uids):
        shape, stride, dtype = specs[int(uid)]
        tensor.set_uid(int(uid)).set_name(uid.name).set_output(True).set_dim(list(shape)).set_stride(list(stride))
        tensor.set_data_type(_CUDNN_TYPES[dtype])


def _declare_sink(graph, cfg: GraphConfig, specs, uids, kind: str) -> dict:
    """The sink_token (and, backward with cfg.dsink, dSink_token) keyword arguments of the sdpa node: fp32
    [1, h_q, 1, 1] tensors with uids SINK / DSINK (dSink_token is an output port cuDNN writes)."""
    out = {}
    if cfg.sink:
        out["sink_token"] = _declare_inputs(graph, specs, (uids.SINK,))[uids.SINK]
    if kind == "backward" and cfg.dsink:
        shape, stride, dtype = specs[int(uids.DSINK)]
        out["dSink_token"] = graph.tensor(dim=list(shape), stride=list(stride), data_type=_CUDNN_TYPES[dtype],
                                          uid=int(uids.DSINK), name=uids.DSINK.name)
    return out


def _finish(graph, cfg: GraphConfig, what: str):
    try:
        graph.validate()
        graph.build_operation_graph()
    except Exception as exc:  # noqa: BLE001 -- cuDNN's verdict (typically cudnnGraphNotSupportedError/ValueError)
        raise MXFP8NotSupportedError(f"cuDNN rejected the MXFP8 {what} graph for {cfg.describe()}: "
                                     f"{type(exc).__name__}: {exc}") from None
    return graph


def build_forward_graph(cfg: GraphConfig, handle=None, *, sm_version: int = 100):
    """The `sdpa_mxfp8` forward graph for `cfg`, validated and with its operation graph built.

    Inputs Q, K, V (FP8, uids FwdUid.Q/K/V) and SF_Q, SF_K (row-wise) / SF_V (column-wise) E8M0 F8_128x4 scales;
    outputs O [b,h_q,s_q,d_v] (out_dtype), Stats [b,h_q,s_q,1] FP32 (log-sum-exp) and Amax_O [1,1,1,1] FP32.
    With cfg.sink, input SINK fp32 [1,h_q,1,1] (cuDNN's sink_token: one logit per query head in every row's
    softmax; it enters Stats, not O).
    `handle`: the cudnn.Handle to plan and run with; None builds a deviceless graph whose lowering targets
    `sm_version` (for inspection and validation without a GPU; it cannot be planned).
    Raises MXFP8NotSupportedError with cuDNN's reason if cuDNN rejects the graph.
    """
    specs = cfg.forward_specs
    graph = _new_graph(cfg, handle, sm_version, "mxattn_mxfp8_fwd")
    t = _declare_inputs(graph, specs, (FwdUid.Q, FwdUid.K, FwdUid.V, FwdUid.SF_Q, FwdUid.SF_K, FwdUid.SF_V))
    varlen = _declare_varlen(graph, cfg, specs, FwdUid)
    _set_ragged(t, varlen, FwdUid, {"RAGGED_Q": (FwdUid.Q,), "RAGGED_K": (FwdUid.K,), "RAGGED_V": (FwdUid.V,)})
    mask = cfg.mask
    outputs = graph.sdpa_mxfp8(
        q=t[FwdUid.Q], k=t[FwdUid.K], v=t[FwdUid.V],
        descale_q=t[FwdUid.SF_Q], descale_k=t[FwdUid.SF_K], descale_v=t[FwdUid.SF_V],
        attn_scale=cfg.attn_scale, generate_stats=True,
        diagonal_alignment=_ALIGNMENT[mask.diagonal_alignment],
        diagonal_band_left_bound=mask.left_bound, diagonal_band_right_bound=mask.right_bound,
        name="sdpa_mxfp8", **_varlen_kwargs(cfg, varlen, FwdUid), **_declare_sink(graph, cfg, specs, FwdUid,
                                                                                    "forward"))
    _declare_outputs(outputs, specs, (FwdUid.O, FwdUid.STATS, FwdUid.AMAX_O))
    _set_ragged(dict(zip((FwdUid.O, FwdUid.STATS), outputs)), varlen, FwdUid,
                {"RAGGED_O": (FwdUid.O,), "RAGGED_STATS": (FwdUid.STATS,)})
    return _finish(graph, cfg, "forward")


def build_backward_graph(cfg: GraphConfig, handle=None, *, sm_version: int = 100):
    """The `sdpa_mxfp8_backward` graph for `cfg`, validated and with its operation graph built.

    Inputs: Q, Q_T, K, K_T, V, dO, dO_T (FP8; *_T are the column-wise quantized copies), O and dO in out_dtype,
    Stats [b,h_q,s_q,1] FP32 from the forward, and the seven E8M0 F8_128x4 scales (SF_Q/SF_K/SF_V/SF_DO row-wise,
    SF_Q_T/SF_K_T/SF_DO_T column-wise). Outputs dQ, dK, dV (out_dtype, strides of Q, K, V) and their FP32 amaxes.
    With cfg.sink the SINK input fp32 [1,h_q,1,1] (sink_token), and with cfg.dsink the DSINK output (dSink_token,
    fp32 [1,h_q,1,1]: dL/dsink summed over batch and query rows).
    `handle`/`sm_version` as in build_forward_graph.
    """
    specs = cfg.backward_specs
    graph = _new_graph(cfg, handle, sm_version, "mxattn_mxfp8_bwd")
    inputs = [u for u in BwdUid if u <= BwdUid.SF_DO_T]
    t = _declare_inputs(graph, specs, inputs)
    varlen = _declare_varlen(graph, cfg, specs, BwdUid)
    _set_ragged(t, varlen, BwdUid, {"RAGGED_Q": (BwdUid.Q, BwdUid.Q_T), "RAGGED_K": (BwdUid.K, BwdUid.K_T),
                                    "RAGGED_V": (BwdUid.V,),
                                    "RAGGED_O": (BwdUid.O, BwdUid.DO_F16, BwdUid.DO, BwdUid.DO_T),
                                    "RAGGED_STATS": (BwdUid.STATS,)})
    mask = cfg.mask
    outputs = graph.sdpa_mxfp8_backward(
        q=t[BwdUid.Q], q_T=t[BwdUid.Q_T], k=t[BwdUid.K], k_T=t[BwdUid.K_T], v=t[BwdUid.V],
        o_f16=t[BwdUid.O], dO_f16=t[BwdUid.DO_F16], dO=t[BwdUid.DO], dO_T=t[BwdUid.DO_T], stats=t[BwdUid.STATS],
        descale_q=t[BwdUid.SF_Q], descale_q_T=t[BwdUid.SF_Q_T], descale_k=t[BwdUid.SF_K],
        descale_k_T=t[BwdUid.SF_K_T], descale_v=t[BwdUid.SF_V], descale_dO=t[BwdUid.SF_DO],
        descale_dO_T=t[BwdUid.SF_DO_T],
        attn_scale=cfg.attn_scale, use_deterministic_algorithm=cfg.deterministic,
        diagonal_alignment=_ALIGNMENT[mask.diagonal_alignment],
        left_bound=mask.left_bound, right_bound=mask.right_bound,
        name="sdpa_mxfp8_backward", **_varlen_kwargs(cfg, varlen, BwdUid), **_declare_sink(graph, cfg, specs, BwdUid,
                                                                                              "backward"))
    _declare_outputs(outputs, specs, (BwdUid.DQ, BwdUid.DK, BwdUid.DV, BwdUid.AMAX_DQ, BwdUid.AMAX_DK,
                                      BwdUid.AMAX_DV))
    _set_ragged(dict(zip((BwdUid.DQ, BwdUid.DK, BwdUid.DV), outputs)), varlen, BwdUid,
                {"RAGGED_Q": (BwdUid.DQ,), "RAGGED_K": (BwdUid.DK,), "RAGGED_V": (BwdUid.DV,)})
    return _finish(graph, cfg, "backward")


def graph_json(graph, validate: bool = True) -> dict:
    """cuDNN's own JSON description of `graph` (a dict: "nodes", "tensors" with dim/stride/data_type/
    reordering_type/uid, "context", versions).

    A graph already lowered to the cuDNN C++ frontend (planned on a device) is described as it is. Otherwise it is
    lowered here (with the graph's handle; a graph built with handle=None lowers without any device) and cuDNN's
    C++ `validate()` runs first (MXFP8NotSupportedError with cuDNN's reason; validate=False skips it: the JSON
    of a graph cuDNN may refuse). Uses the pure-Python pygraph's
    lowering hook (`_lower_to_cpp`, cudnn-frontend 1.32): the public routes to the C++ JSON (`key()`,
    `serialize()`) need a GPU or a built plan.
    """
    lowered = getattr(graph, "_lowered_graph", None)
    if lowered is None:
        lower = getattr(graph, "_lower_to_cpp", None)
        if lower is None:
            raise RuntimeError("this cudnn-frontend's pygraph has no _lower_to_cpp(); graph_json needs 1.32's layout")
        lowered = lower()
        try:
            if validate:
                lowered.validate()
        except Exception as exc:  # noqa: BLE001 -- cuDNN's verdict on the graph
            raise MXFP8NotSupportedError(f"cuDNN's validation rejected the graph: {type(exc).__name__}: {exc}") \
                from None
    return json.loads(repr(lowered))



# ---------------------------------------------------------------------------------------------------------------
# planning and the cache
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class PlannedGraph:
    """A graph with a built execution plan, ready for `execute` on the device it was planned for."""

    kind: str
    cfg: GraphConfig
    graph: object
    workspace_size: int


def plan_graph(graph, cfg: GraphConfig, kind: str) -> PlannedGraph:
    """create_execution_plans (heuristics A, then FALLBACK) + check_support + build_plans on `graph` (built with a
    device handle). Any failure, typically cudnnGraphNotSupportedError, becomes MXFP8NotSupportedError carrying
    cuDNN's message."""
    try:
        graph.create_execution_plans(list(HEUR_MODES))
        graph.check_support()
        graph.build_plans()
        workspace = int(graph.get_workspace_size())
    except Exception as exc:  # noqa: BLE001 -- every failure here is cuDNN's verdict on this graph and device
        raise MXFP8NotSupportedError(f"cuDNN has no plan for the MXFP8 {kind} graph ({cfg.describe()}): "
                                     f"{type(exc).__name__}: {exc}") from None
    return PlannedGraph(kind, cfg, graph, workspace)


_BUILDERS: Dict[str, Callable] = {"forward": build_forward_graph, "backward": build_backward_graph}


def build_and_plan(kind: str, cfg: GraphConfig, handle) -> PlannedGraph:
    """Build the `kind` ("forward"/"backward") graph for `cfg` with cuDNN handle `handle` and plan it."""
    return plan_graph(_BUILDERS[kind](cfg, handle), cfg, kind)


class GraphCache:
    """Bounded, thread-safe LRU of planned graphs.

    Keys are hashable descriptions of (graph config, device): `planned_graph` uses (kind, GraphConfig, device
    index); the cudnn backend uses the tuple of every fact of its argument tensors that a config is derived
    from, which skips re-deriving and re-validating a GraphConfig on a hit. A miss calls `build()` outside the
    lock (two threads missing one key may both build; the first stored wins and every caller gets that object).
    Failures are not cached: a retry asks cuDNN again.
    """

    def __init__(self, maxsize: int = 64):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._entries: "OrderedDict[object, PlannedGraph]" = OrderedDict()
        self._lock = threading.Lock()
        self._generation = 0  # clears so far (`holds_generation`)

    def lookup(self, key) -> Optional[PlannedGraph]:
        """The entry for `key` (now the most recently used), or None."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def get(self, key, build: Callable[[], PlannedGraph]) -> PlannedGraph:
        """The entry for `key`, made by `build()` on a miss."""
        hit = self.lookup(key)
        if hit is not None:
            return hit
        built = build()
        with self._lock:
            planned = self._entries.setdefault(key, built)
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return planned

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._generation += 1

    def holds_generation(self) -> Callable[[], bool]:
        """A check that no `clear` has run since this call (what a replay recorded with a plan of this cache
        asks before it executes that plan again)."""
        generation = self._generation
        return lambda: self._generation == generation


GRAPH_CACHE = GraphCache()


def planned_graph(kind: str, cfg: GraphConfig, device_index: int, handle, cache: GraphCache = GRAPH_CACHE
                  ) -> PlannedGraph:
    """The planned `kind` graph for `cfg` on CUDA device `device_index` from `cache` (built with `handle`, a
    cudnn.Handle of that device, on a miss). MXFP8NotSupportedError if cuDNN cannot run it."""
    return cache.get((kind, cfg, device_index), lambda: build_and_plan(kind, cfg, handle))
