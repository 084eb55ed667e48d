"""Compatibility path: this code now lives in `mxattn.backends.cudnn` (config, graphs, buffers); names re-exported."""

from .backends.cudnn.buffers import (backward_pack, col_scale_buffer, col_scale_bytes, col_scale_tensor,
                                     forward_pack, operand, row_scale_buffer, sf_tile_starts, sink_operand,
                                     thd_col_scale_buffer, thd_row_scale_buffer, thd_scale_buffer, varlen_tensors)
from .backends.cudnn.config import (BwdUid, COL_SCALE_BLOCK_AXIS_CONTIGUOUS, FP8_DTYPES, FwdUid, GraphConfig,
                                    LAYOUT_PERMUTATIONS, OUT_DTYPES, SCALE_DTYPE, SOFTMAX_TYPES, VARLEN_KINDS,
                                    VARLEN_UIDS, axis_order, col_scale_dims, col_scale_stride, dense_stride,
                                    layout_name, layout_strides, row_major, row_scale_dims, thd_stats_stride,
                                    thd_stride)
from .backends.cudnn.graphs import (GRAPH_CACHE, GraphCache, HEUR_MODES, PlannedGraph, build_and_plan,
                                    build_backward_graph, build_forward_graph, graph_json, plan_graph, planned_graph)
from .constants import SF_TILE, MX_BLOCK as BLOCK
from .errors import MXFP8NotSupportedError
from .formats import MXFP8Tensor, swizzle_128x4
from .mask import MaskSpec

__all__ = ["MXFP8NotSupportedError", "MXFP8Tensor", "swizzle_128x4", "MaskSpec", "BLOCK", "LAYOUT_PERMUTATIONS",
           "OUT_DTYPES", "FP8_DTYPES", "SCALE_DTYPE", "HEUR_MODES", "FwdUid", "BwdUid", "VARLEN_UIDS", "VARLEN_KINDS",
           "SOFTMAX_TYPES", "row_scale_dims", "col_scale_dims", "row_major", "COL_SCALE_BLOCK_AXIS_CONTIGUOUS",
           "col_scale_stride", "dense_stride", "axis_order", "layout_strides", "layout_name", "thd_stride",
           "thd_stats_stride", "GraphConfig", "build_forward_graph", "build_backward_graph", "graph_json",
           "row_scale_buffer", "col_scale_buffer", "col_scale_bytes", "col_scale_tensor", "SF_TILE", "sf_tile_starts",
           "thd_row_scale_buffer", "thd_col_scale_buffer", "thd_scale_buffer", "varlen_tensors", "forward_pack",
           "backward_pack", "sink_operand", "operand", "PlannedGraph", "plan_graph", "build_and_plan", "GraphCache",
           "GRAPH_CACHE", "planned_graph"]
