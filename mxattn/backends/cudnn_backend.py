"""Compatibility path: this code now lives in `mxattn.backends.cudnn` (run, refusals, backend); names re-exported."""

from ..errors import MXFP8NotSupportedError
from ..formats import MXFP8Tensor, quantize_mxfp8
from ..mask import MaskSpec
from ..recipe import Recipe
from ..seqinfo import SeqInfo
from .base import AttentionBackend, AttentionParams, Problem, SavedForBackward
from .cudnn.backend import CudnnBackend, SavedWithScaleBuffers, clear_support_cache, quantize_operand
from .cudnn.buffers import (backward_pack, col_scale_bytes, forward_pack, operand, row_scale_buffer, sink_operand,
                            thd_scale_buffer, varlen_tensors)
from .cudnn.config import (GraphConfig, OUT_DTYPES, PACKED_CAPACITY, SOFTMAX_TYPES, axis_order, col_scale_dims,
                           dense_stride, packed_capacity, row_major, row_scale_dims)
from .cudnn.graphs import (GRAPH_CACHE, PlannedGraph, build_backward_graph, build_forward_graph, graph_json,
                           planned_graph)
from .cudnn.refusals import SINK_PACKED_BACKWARD_VERSION, check_problem, known_refusal, problem_config
from .cudnn.run import (backward_buffers, backward_config, backward_key, cudnn_backward, cudnn_forward, execute,
                        forward_buffers, forward_config, forward_key, planned)
from .cudnn.support import cudnn_support

__all__ = ["GRAPH_CACHE", "OUT_DTYPES", "SOFTMAX_TYPES", "GraphConfig", "PlannedGraph", "axis_order", "backward_pack",
           "build_backward_graph", "build_forward_graph", "col_scale_bytes", "col_scale_dims", "dense_stride",
           "forward_pack", "graph_json", "operand", "planned_graph", "row_major", "row_scale_buffer",
           "row_scale_dims", "sink_operand", "thd_scale_buffer", "varlen_tensors", "cudnn_support",
           "MXFP8NotSupportedError", "MXFP8Tensor", "quantize_mxfp8", "MaskSpec", "Recipe", "SeqInfo",
           "AttentionBackend", "AttentionParams", "Problem", "SavedForBackward", "planned", "execute",
           "PACKED_CAPACITY", "packed_capacity", "forward_key", "backward_key", "forward_config", "forward_buffers",
           "cudnn_forward", "backward_config", "backward_buffers", "cudnn_backward",
           "SINK_PACKED_BACKWARD_VERSION", "known_refusal", "problem_config", "check_problem", "clear_support_cache",
           "quantize_operand", "SavedWithScaleBuffers", "CudnnBackend"]
