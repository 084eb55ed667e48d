"""Deciding up front whether cuDNN runs a `Problem` (`CudnnBackend.supports`): the known refusals decided from
the Problem alone, the graph config planned for it, and the check that builds (and plans or validates) its
graphs."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from .frontend import cudnn

from ...errors import MXFP8NotSupportedError
from ..base import Problem
from .config import OUT_DTYPES, SOFTMAX_TYPES, GraphConfig, packed_capacity
from .graphs import build_backward_graph, build_forward_graph, graph_json, planned_graph

#: first cuDNN that runs the backward of a ragged (packed) graph with a sink_token (cuDNN frontend 1.32's rule)
SINK_PACKED_BACKWARD_VERSION = 92600

#: head dims cuDNN's MXFP8 graphs take for d_qk and d_v in any pair: multiples of 16 up to 128
SMALL_HEAD_DIMS = tuple(range(16, 129, 16))
#: the (d_qk, d_v) pairs they take beyond those (cuDNN 9.28's validation of the forward and backward graphs)
WIDE_HEAD_DIM_PAIRS = ((192, 128), (256, 256))
#: every head dim of some pair cuDNN takes (`CudnnBackend.supported_head_dims`)
HEAD_DIMS = SMALL_HEAD_DIMS + (192, 256)


def head_dims_refusal(d_qk: int, d_v: int) -> Optional[str]:
    """Why cuDNN refuses Q and K of head dim d_qk beside V (O, dO) of head dim d_v, or None.

    cuDNN 9.28's validation of the MXFP8 forward and backward graphs: d_qk and d_v multiples of 16 up to 128 (in
    any pair, d_v > d_qk included), or d_qk == 192 with d_v == 128, or d_qk == d_v == 256. (Its forward alone
    also takes both in (256, 512]; the backward does not, and mxattn lists no dim above 256.)"""
    if (d_qk in SMALL_HEAD_DIMS and d_v in SMALL_HEAD_DIMS) or (d_qk, d_v) in WIDE_HEAD_DIM_PAIRS:
        return None
    return (f"cuDNN has no MXFP8 attention graph for head_dim {d_qk} (q, k) with head_dim_v {d_v} (v): its "
            "validation takes d_qk and d_v multiples of 16 up to 128, or d_qk == 192 and d_v == 128, or "
            "d_qk == d_v == 256 (the reference backend runs any pair)")


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
    """The graph config the backend will build for `problem` (bshd inputs, e4m3; packed: thd; Q/K of head_dim,
    V/O/dO of head_dim_v; the default softmax scale 1/sqrt(head_dim)), for planning up front. The layout and scale
    of the real call may differ; they do not change what cuDNN supports. The sink facts follow
    problem.softmax_type (the forward never has dsink)."""
    p = problem
    kw = dict(attn_scale=p.head_dim ** -0.5, mask=p.mask, out_dtype=p.out_dtype)
    if p.varlen == "packed":
        cfg = GraphConfig.from_packed(p.batch, p.heads_q, p.heads_kv, packed_capacity(p.seqlen_q),
                                      packed_capacity(p.seqlen_kv), p.head_dim, p.head_dim_v, **kw)
    else:
        cfg = GraphConfig.from_layout(p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim,
                                      p.head_dim_v, layout="bshd", **kw)
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
