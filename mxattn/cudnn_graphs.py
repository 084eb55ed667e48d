"""cuDNN frontend graphs for MXFP8 attention: the graph config, tensor uids, builders, scale buffers, the variant
pack and a cache of planned graphs.

Everything here except `planned_graph` runs without a GPU: graphs are built with the pure-Python `cudnn.pygraph`
(validated by `validate()` and `build_operation_graph()`), and `graph_json` lowers a graph built without a device
handle to the cuDNN C++ frontend, runs cuDNN's own (arch-aware) validation and returns its JSON.

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

import dataclasses
import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Callable, Dict, Optional, Tuple

import torch

import cudnn

from .errors import MXFP8NotSupportedError
from .formats import MXFP8Tensor, swizzle_128x4
from .mask import MaskSpec

Stride = Tuple[int, int, int, int]
Shape = Tuple[int, int, int, int]

BLOCK = 32
LAYOUT_PERMUTATIONS = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}  # physical axis order
OUT_DTYPES = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}
FP8_DTYPES = {torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3, torch.float8_e5m2: cudnn.data_type.FP8_E5M2}
SCALE_DTYPE = torch.float8_e8m0fnu
_ALIGNMENT = {"top_left": cudnn.diagonal_alignment.TOP_LEFT, "bottom_right": cudnn.diagonal_alignment.BOTTOM_RIGHT}
#: heuristics asked for when planning; FALLBACK keeps a plan available where mode A has none.
HEUR_MODES = (cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK)


class FwdUid(IntEnum):
    """Variant-pack uids of the forward graph."""

    Q = 1
    K = 2
    V = 3
    SF_Q = 4
    SF_K = 5
    SF_V = 6
    O = 7
    STATS = 8
    AMAX_O = 9
    # variable lengths (GraphConfig.varlen): per-sequence lengths, and for "packed" the ragged offsets
    SEQ_LEN_Q = 10
    SEQ_LEN_KV = 11
    RAGGED_Q = 12
    RAGGED_K = 13
    RAGGED_V = 14
    RAGGED_O = 15
    RAGGED_STATS = 16
    # attention sink (GraphConfig.sink): fp32 [1, h_q, 1, 1] logits
    SINK = 17


class BwdUid(IntEnum):
    """Variant-pack uids of the backward graph."""

    Q = 101
    Q_T = 102
    K = 103
    K_T = 104
    V = 105
    O = 106
    DO_F16 = 107
    DO = 108
    DO_T = 109
    STATS = 110
    SF_Q = 111
    SF_Q_T = 112
    SF_K = 113
    SF_K_T = 114
    SF_V = 115
    SF_DO = 116
    SF_DO_T = 117
    DQ = 118
    DK = 119
    DV = 120
    AMAX_DQ = 121
    AMAX_DK = 122
    AMAX_DV = 123
    # variable lengths: RAGGED_Q serves Q, Q_T, dQ; RAGGED_K K, K_T, dK; RAGGED_V V, dV; RAGGED_O O, dO (all three)
    SEQ_LEN_Q = 124
    SEQ_LEN_KV = 125
    RAGGED_Q = 126
    RAGGED_K = 127
    RAGGED_V = 128
    RAGGED_O = 129
    RAGGED_STATS = 130
    # attention sink: SINK (GraphConfig.sink) input, DSINK (GraphConfig.dsink) output, both fp32 [1, h_q, 1, 1]
    SINK = 131
    DSINK = 132


#: the uids that exist only in variable-length graphs
VARLEN_UIDS = {"padded": ("SEQ_LEN_Q", "SEQ_LEN_KV"),
               "packed": ("SEQ_LEN_Q", "SEQ_LEN_KV", "RAGGED_Q", "RAGGED_K", "RAGGED_V", "RAGGED_O", "RAGGED_STATS")}
VARLEN_KINDS = tuple(VARLEN_UIDS)
#: TE's softmax_type values and the sink facts of their graphs: (sink_token input, dSink_token output)
SOFTMAX_TYPES = {"vanilla": (False, False), "off-by-one": (True, False), "learnable": (True, True)}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def row_scale_dims(b: int, h: int, s: int, d: int) -> Shape:
    """Graph dims of a row-wise (blocks along D) F8_128x4 scale tensor: [B, H, ceil(S/128)*128, D32p]."""
    return (b, h, _ceil(s, 128) * 128, _ceil(_ceil(d, BLOCK), 4) * 4)


def col_scale_dims(b: int, h: int, s: int, d: int) -> Shape:
    """Graph dims of a column-wise (blocks along S) F8_128x4 scale tensor: [B, H, S32p, ceil(D/128)*128]."""
    return (b, h, _ceil(_ceil(s, BLOCK), 4) * 4, _ceil(d, 128) * 128)


def row_major(shape) -> Tuple[int, ...]:
    """Row-major (contiguous) strides of `shape`."""
    out, step = [], 1
    for n in reversed(tuple(shape)):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


#: Declared strides of the column-wise scale tensors (forward SF_V, SF_Q_T, SF_K_T, SF_dO_T). True: the
#: scale-block axis (dim 2) contiguous, (H*S32p*Dp, S32p*Dp, 1, S32p), as the `sdpa_mxfp8` binding documents
#: ("descale_v: ... stride[2]=1") and the frontend's C++ sample declares. False: row-major, as the frontend's
#: newest Python test declares. The bytes are F8_128x4-ordered either way; only the declaration differs.
COL_SCALE_BLOCK_AXIS_CONTIGUOUS = True


def col_scale_stride(dims: Shape) -> Stride:
    """Declared strides of a column-wise scale tensor of graph dims [B, H, S32p, Dp] (see
    COL_SCALE_BLOCK_AXIS_CONTIGUOUS)."""
    b, h, s32p, dp = dims
    return (h * s32p * dp, s32p * dp, 1, s32p) if COL_SCALE_BLOCK_AXIS_CONTIGUOUS else (h * s32p * dp, s32p * dp, dp, 1)


def dense_stride(shape: Shape, order: Tuple[int, ...]) -> Stride:
    """Strides of a dense [B, H, S, D] tensor whose memory holds the axes in `order` (outermost first)."""
    stride, step = [0] * 4, 1
    for axis in reversed(order):
        stride[axis] = step
        step *= max(int(shape[axis]), 1)
    return tuple(stride)


def axis_order(stride: Stride) -> Tuple[int, ...]:
    """Axes of a [B, H, S, D] tensor from outermost to innermost memory stride (ties keep [B, H, S, D] order)."""
    return tuple(sorted(range(4), key=lambda a: (-stride[a], a)))


def layout_strides(layout: str, shape: Shape) -> Stride:
    """Strides of the [B, H, S, D] view of a dense `layout` ("bhsd", "bshd", "sbhd") tensor of `shape`."""
    if layout not in LAYOUT_PERMUTATIONS:
        raise ValueError(f"layout must be one of {tuple(LAYOUT_PERMUTATIONS)}, got {layout!r}")
    return dense_stride(shape, LAYOUT_PERMUTATIONS[layout])


def layout_name(stride: Stride) -> str:
    """"bhsd", "bshd" or "sbhd" for the axis order of `stride`, else "strided"."""
    order = axis_order(stride)
    for name, perm in LAYOUT_PERMUTATIONS.items():
        if order == perm:
            return name
    return "strided"


def thd_stride(shape: Shape) -> Stride:
    """Declared strides of a packed (thd) tensor of graph dims [B, H, S_max, D]: token-major rows of H*D
    elements, as a [T, H, D] tensor holds them (the batch stride is the dense capacity's; cuDNN never steps it,
    every sequence's base comes from the ragged offsets)."""
    b, h, s, d = shape
    return (s * h * d, d, h * d, 1)


def thd_stats_stride(shape: Shape) -> Stride:
    """Declared strides of packed Stats [B, H, S_max, 1]: token-major [T, H] fp32 (cuDNN's ragged Stats)."""
    b, h, s, _ = shape
    return (s * h, 1, h, 1)


def _check_stride(name: str, stride) -> Stride:
    stride = tuple(int(s) for s in stride)
    if len(stride) != 4 or any(s < 0 for s in stride):
        raise ValueError(f"{name} must be 4 non-negative strides of a [B, H, S, D] view, got {stride}")
    if stride[3] != 1:
        raise ValueError(f"{name} must have unit stride on D (cuDNN reads rows of D contiguously), got {stride}")
    return stride


@dataclass(frozen=True)
class GraphConfig:
    """Everything that changes a cuDNN MXFP8 attention graph.

    Shapes are of the [B, H, S, D] views: Q [b, h_q, s_q, d_qk], K [b, h_k, s_kv, d_qk], V [b, h_v, s_kv, d_v],
    O/dO [b, h_q, s_q, d_v]. Layout is carried as strides of those views (q_stride also serves Q_T and dQ,
    k_stride K_T and dK, v_stride dV; do_stride the BF16/FP16 dO and its FP8 copies, backward only).

    Attention sink (TE's softmax_type, spec section 11): `sink` adds cuDNN's `sink_token` input (fp32
    [1, h_q, 1, 1] logits in the scaled-score space, one per query head) to the forward and backward graphs;
    `dsink` (backward only, needs `sink`) adds the `dSink_token` output (fp32 [1, h_q, 1, 1], summed over batch
    and query rows). "off-by-one" is sink=True, dsink=False; "learnable" sink=True, dsink=True (`for_softmax`).
    A forward graph ignores `dsink`: callers keep it False there so forward configs do not split on it.
    """

    b: int
    h_q: int
    h_k: int
    h_v: int
    s_q: int
    s_kv: int
    d_qk: int
    d_v: int
    attn_scale: float
    q_stride: Stride
    k_stride: Stride
    v_stride: Stride
    o_stride: Stride
    do_stride: Optional[Stride] = None
    mask: MaskSpec = field(default_factory=MaskSpec)
    out_dtype: torch.dtype = torch.bfloat16
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    deterministic: bool = True
    varlen: Optional[str] = None
    sink: bool = False
    dsink: bool = False

    def __post_init__(self):
        for name in ("b", "h_q", "h_k", "h_v", "s_q", "s_kv", "d_qk", "d_v"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.h_q % self.h_k or self.h_q % self.h_v:
            raise ValueError(f"h_q ({self.h_q}) must be divisible by h_k ({self.h_k}) and h_v ({self.h_v})")
        if not isinstance(self.attn_scale, (int, float)) or not (float(self.attn_scale) == float(self.attn_scale)) \
                or abs(float(self.attn_scale)) == float("inf"):
            raise ValueError(f"attn_scale must be a finite float, got {self.attn_scale!r}")
        for name in ("q_stride", "k_stride", "v_stride", "o_stride", "do_stride"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check_stride(name, value))
        object.__setattr__(self, "attn_scale", float(self.attn_scale))
        if not isinstance(self.mask, MaskSpec):
            raise TypeError(f"mask must be a mxattn.MaskSpec, got {type(self.mask).__name__}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {self.out_dtype}")
        if self.fp8_dtype not in FP8_DTYPES:
            raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.fp8_dtype}")
        if self.varlen not in (None,) + VARLEN_KINDS:
            raise ValueError(f"varlen must be None, 'padded' or 'packed', got {self.varlen!r}")
        for name in ("sink", "dsink"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.dsink and not self.sink:
            raise ValueError("dsink (the dSink_token output) needs sink (the sink_token input)")
        if self.packed_layout:
            for name, shape in (("q_stride", self.q_shape), ("k_stride", self.k_shape), ("v_stride", self.v_shape),
                                ("o_stride", self.o_shape), ("do_stride", self.o_shape)):
                value = getattr(self, name)
                if value is not None and value != thd_stride(shape):
                    raise ValueError(f"a packed (thd) graph needs token-major {name} {thd_stride(shape)} for "
                                     f"[B, H, S, D] = {shape}, got {value}")

    @classmethod
    def from_layout(cls, b: int, h_q: int, h_kv: int, s_q: int, s_kv: int, d_qk: int, d_v: Optional[int] = None, *,
                    layout: str = "bshd", attn_scale: Optional[float] = None, mask: Optional[MaskSpec] = None,
                    out_dtype: torch.dtype = torch.bfloat16, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                    deterministic: bool = True) -> "GraphConfig":
        """Config for dense tensors in a named layout (all of Q, K, V, O, dO in that layout)."""
        d_v = d_qk if d_v is None else d_v
        o_stride = layout_strides(layout, (b, h_q, s_q, d_v))
        return cls(b=b, h_q=h_q, h_k=h_kv, h_v=h_kv, s_q=s_q, s_kv=s_kv, d_qk=d_qk, d_v=d_v,
                   attn_scale=d_qk ** -0.5 if attn_scale is None else attn_scale,
                   q_stride=layout_strides(layout, (b, h_q, s_q, d_qk)),
                   k_stride=layout_strides(layout, (b, h_kv, s_kv, d_qk)),
                   v_stride=layout_strides(layout, (b, h_kv, s_kv, d_v)),
                   o_stride=o_stride, do_stride=o_stride, mask=mask or MaskSpec(), out_dtype=out_dtype,
                   fp8_dtype=fp8_dtype, deterministic=deterministic)

    @classmethod
    def from_packed(cls, b: int, h_q: int, h_kv: int, max_s_q: int, max_s_kv: int, d_qk: int, d_v: Optional[int] = None,
               *, attn_scale: Optional[float] = None, mask: Optional[MaskSpec] = None,
               out_dtype: torch.dtype = torch.bfloat16, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
               deterministic: bool = True) -> "GraphConfig":
        """Config of a packed (thd) batch of b sequences of at most max_s_q / max_s_kv tokens."""
        d_v = d_qk if d_v is None else d_v
        o_stride = thd_stride((b, h_q, max_s_q, d_v))
        return cls(b=b, h_q=h_q, h_k=h_kv, h_v=h_kv, s_q=max_s_q, s_kv=max_s_kv, d_qk=d_qk, d_v=d_v,
                   attn_scale=d_qk ** -0.5 if attn_scale is None else attn_scale,
                   q_stride=thd_stride((b, h_q, max_s_q, d_qk)), k_stride=thd_stride((b, h_kv, max_s_kv, d_qk)),
                   v_stride=thd_stride((b, h_kv, max_s_kv, d_v)), o_stride=o_stride, do_stride=o_stride,
                   mask=mask or MaskSpec(), out_dtype=out_dtype, fp8_dtype=fp8_dtype, deterministic=deterministic,
                   varlen="packed")

    def for_softmax(self, softmax_type: str, kind: str = "backward") -> "GraphConfig":
        """This config with the sink facts of TE's `softmax_type` ("vanilla", "off-by-one", "learnable") for a
        `kind` ("forward"/"backward") graph (a forward graph never has dsink)."""
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {tuple(SOFTMAX_TYPES)}, got {softmax_type!r}")
        sink, dsink = SOFTMAX_TYPES[softmax_type]
        return dataclasses.replace(self, sink=sink, dsink=dsink and kind == "backward")

    # --- variable lengths -----------------------------------------------------------------------------------------
    @property
    def packed_layout(self) -> bool:
        return self.varlen == "packed"

    @property
    def ragged_dtype(self) -> torch.dtype:
        """dtype of the ragged offsets: int32 unless an element offset of the capacity can exceed it."""
        largest = max(self.b * self.s_q * self.h_q * max(self.d_qk, self.d_v),
                      self.b * self.s_kv * max(self.h_k, self.h_v) * max(self.d_qk, self.d_v))
        return torch.int32 if largest < 2 ** 31 else torch.int64

    @property
    def max_total_seq_len_q(self) -> Optional[int]:
        """Token capacity of a packed Q (b * s_q), told to cuDNN as max_total_seq_len_q; None otherwise."""
        return self.b * self.s_q if self.packed_layout else None

    @property
    def max_total_seq_len_kv(self) -> Optional[int]:
        return self.b * self.s_kv if self.packed_layout else None

    # --- shapes -------------------------------------------------------------------------------------------------
    @property
    def q_shape(self) -> Shape:
        return (self.b, self.h_q, self.s_q, self.d_qk)

    @property
    def k_shape(self) -> Shape:
        return (self.b, self.h_k, self.s_kv, self.d_qk)

    @property
    def v_shape(self) -> Shape:
        return (self.b, self.h_v, self.s_kv, self.d_v)

    @property
    def o_shape(self) -> Shape:
        return (self.b, self.h_q, self.s_q, self.d_v)

    @property
    def stats_shape(self) -> Shape:
        return (self.b, self.h_q, self.s_q, 1)

    def describe(self) -> str:
        """One line for error messages and tables."""
        m = self.mask
        mask = "none" if m.is_unmasked else (f"{'causal ' if m.causal else ''}{m.diagonal_alignment}"
                                             f" left={m.left_bound} right={m.right_bound}")
        return (f"b={self.b} h_q={self.h_q} h_k={self.h_k} h_v={self.h_v} s_q={self.s_q} s_kv={self.s_kv} "
                f"d_qk={self.d_qk} d_v={self.d_v} layout={layout_name(self.q_stride)} mask=[{mask}] "
                f"out={str(self.out_dtype).replace('torch.', '')} fp8={str(self.fp8_dtype).replace('torch.', '')}"
                f" deterministic={self.deterministic}" + (f" varlen={self.varlen}" if self.varlen else "")
                + (" sink" + ("+dsink" if self.dsink else "") if self.sink else ""))

    @property
    def sink_shape(self) -> Shape:
        return (1, self.h_q, 1, 1)

    @property
    def stats_stride(self) -> Stride:
        return thd_stats_stride(self.stats_shape) if self.packed_layout else row_major(self.stats_shape)

    def _sink_specs(self, uids, kind: str) -> dict:
        spec = (self.sink_shape, row_major(self.sink_shape), torch.float32)
        out = {uids.SINK: spec} if self.sink else {}
        if kind == "backward" and self.dsink:
            out[uids.DSINK] = spec
        return out

    def _varlen_specs(self, uids) -> dict:
        if self.varlen is None:
            return {}
        lens = ((self.b, 1, 1, 1), (1, 1, 1, 1), torch.int32)
        out = {uids.SEQ_LEN_Q: lens, uids.SEQ_LEN_KV: lens}
        if self.packed_layout:
            offsets = ((self.b + 1, 1, 1, 1), (1, 1, 1, 1), self.ragged_dtype)
            out.update({getattr(uids, name): offsets for name in VARLEN_UIDS["packed"][2:]})
        return out

    # --- what every variant-pack slot must look like: uid -> (shape, stride, torch dtype) --------------------------
    @cached_property
    def forward_specs(self) -> Dict[int, Tuple[Shape, Stride, torch.dtype]]:
        sq, sk, sv = (row_scale_dims(*self.q_shape), row_scale_dims(*self.k_shape), col_scale_dims(*self.v_shape))
        f8 = self.fp8_dtype
        return _plain_keys({
            FwdUid.Q: (self.q_shape, self.q_stride, f8),
            FwdUid.K: (self.k_shape, self.k_stride, f8),
            FwdUid.V: (self.v_shape, self.v_stride, f8),
            FwdUid.SF_Q: (sq, row_major(sq), SCALE_DTYPE),
            FwdUid.SF_K: (sk, row_major(sk), SCALE_DTYPE),
            FwdUid.SF_V: (sv, col_scale_stride(sv), SCALE_DTYPE),
            FwdUid.O: (self.o_shape, self.o_stride, self.out_dtype),
            FwdUid.STATS: (self.stats_shape, self.stats_stride, torch.float32),
            FwdUid.AMAX_O: ((1, 1, 1, 1), (1, 1, 1, 1), torch.float32),
            **self._varlen_specs(FwdUid),
            **self._sink_specs(FwdUid, "forward"),
        })

    @cached_property
    def backward_specs(self) -> Dict[int, Tuple[Shape, Stride, torch.dtype]]:
        do_stride = self.o_stride if self.do_stride is None else self.do_stride
        f8, f16 = self.fp8_dtype, self.out_dtype
        scales = {
            BwdUid.SF_Q: row_scale_dims(*self.q_shape), BwdUid.SF_K: row_scale_dims(*self.k_shape),
            BwdUid.SF_V: row_scale_dims(*self.v_shape), BwdUid.SF_DO: row_scale_dims(*self.o_shape),
        }
        col_scales = {
            BwdUid.SF_Q_T: col_scale_dims(*self.q_shape), BwdUid.SF_K_T: col_scale_dims(*self.k_shape),
            BwdUid.SF_DO_T: col_scale_dims(*self.o_shape),
        }
        specs = {
            BwdUid.Q: (self.q_shape, self.q_stride, f8), BwdUid.Q_T: (self.q_shape, self.q_stride, f8),
            BwdUid.K: (self.k_shape, self.k_stride, f8), BwdUid.K_T: (self.k_shape, self.k_stride, f8),
            BwdUid.V: (self.v_shape, self.v_stride, f8),
            BwdUid.O: (self.o_shape, self.o_stride, f16), BwdUid.DO_F16: (self.o_shape, do_stride, f16),
            BwdUid.DO: (self.o_shape, do_stride, f8), BwdUid.DO_T: (self.o_shape, do_stride, f8),
            BwdUid.STATS: (self.stats_shape, self.stats_stride, torch.float32),
            BwdUid.DQ: (self.q_shape, self.q_stride, f16), BwdUid.DK: (self.k_shape, self.k_stride, f16),
            BwdUid.DV: (self.v_shape, self.v_stride, f16),
        }
        specs.update({uid: (dims, row_major(dims), SCALE_DTYPE) for uid, dims in scales.items()})
        specs.update({uid: (dims, col_scale_stride(dims), SCALE_DTYPE) for uid, dims in col_scales.items()})
        for uid in (BwdUid.AMAX_DQ, BwdUid.AMAX_DK, BwdUid.AMAX_DV):
            specs[uid] = ((1, 1, 1, 1), (1, 1, 1, 1), torch.float32)
        specs.update(self._varlen_specs(BwdUid))
        specs.update(self._sink_specs(BwdUid, "backward"))
        return _plain_keys(dict(sorted(specs.items())))


def _plain_keys(specs: dict) -> dict:
    """Slot specs keyed by plain ints (the variant pack's keys), in uid order of the graph's slots."""
    return {int(uid): spec for uid, spec in specs.items()}


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


def graph_json(graph) -> dict:
    """cuDNN's own JSON description of `graph` (a dict: "nodes", "tensors" with dim/stride/data_type/
    reordering_type/uid, "context", versions).

    A graph already lowered to the cuDNN C++ frontend (planned on a device) is described as it is. Otherwise it is
    lowered here (with the graph's handle; a graph built with handle=None lowers without any device) and cuDNN's
    C++ `validate()` runs first (MXFP8NotSupportedError with cuDNN's reason). Uses the pure-Python pygraph's
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
            lowered.validate()
        except Exception as exc:  # noqa: BLE001 -- cuDNN's verdict on the graph
            raise MXFP8NotSupportedError(f"cuDNN's validation rejected the graph: {type(exc).__name__}: {exc}") \
                from None
    return json.loads(repr(lowered))


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
    return col_scale_tensor(col_scale_bytes(scale), b, h, s32 * BLOCK, d)


def col_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Column-wise compact scale [B, H, ceil(S/32), D] (e8m0) -> the bytes cuDNN reads, contiguous [Dp, B*H*S32p]
    (e8m0): each slab's scale rows zero-padded to S32p, the whole [B*H*S32p, D] matrix transposed to
    M=D x K=B*H*S32p and swizzled (D tile outermost; module docstring). The fused Triton quantizer
    (`mxattn.kernels.triton_quantize.quantize_rowcol(swizzle=True)`) writes the same bytes."""
    b, h, s32, d = scale.shape
    s32p = col_scale_dims(b, h, s32 * BLOCK, d)[2]
    raw = scale.view(torch.uint8)
    if s32p != s32:
        raw = torch.nn.functional.pad(raw, (0, 0, 0, s32p - s32))
    return swizzle_128x4(raw.reshape(b * h * s32p, d).t()).view(SCALE_DTYPE)


def col_scale_tensor(buf: torch.Tensor, b: int, h: int, s: int, d: int) -> torch.Tensor:
    """The graph's column-wise scale tensor (dims `col_scale_dims(b, h, s, d)`, strides `col_scale_stride`) over
    `col_scale_bytes`-ordered bytes `buf` (contiguous, e8m0 or uint8)."""
    dims = col_scale_dims(b, h, s, d)
    return buf.view(SCALE_DTYPE).as_strided(dims, col_scale_stride(dims))


# --- packed (thd) batches: cuDNN's per-sequence-tile layout ------------------------------------------------------
# cuDNN's MXFP8 graphs read the scales of a ragged batch PACKED per sequence tile (frontend 1.32:
# `cudnn/sdpa/kernels/_mxfp8_sf.py`, the `sdpa_fwd_prefill_sm100_mxfp8` engine spec and the module notes of
# `cudnn/sdpa/bwd/api_dsl_sm107.py`): per head, every sequence's ceil(s_b/128) tiles of 128 tokens in cu_seqlens
# order, sequence b's first tile at cu_sf[b] = sum_{i<b} ceil(s_i/128) (NOT cu[b]/128), each tile's bytes
# contiguous: row-wise 128 rows x D32p scale columns in F8_128x4 order, column-wise the ceil(D/128) D planes of
# 512 bytes one after another (plane stride one atom; NOT the dense D-plane-major order). The graph keeps the
# dense dims (a capacity of b * ceil(S_max/128) tiles per head, head-major [H, tiles, tile bytes]); unused
# tiles and padding bytes are zero.
SF_TILE = 128


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
    dims = row_scale_dims(b, h, s_max, k * BLOCK)
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
                              lambda c: ((c[1:] - c[:-1] + BLOCK - 1) // BLOCK, c[:-1] // BLOCK + idx))
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


@functools.lru_cache(maxsize=256)
def _slot_names(uids, slots: Tuple[int, ...]) -> Dict[int, str]:
    """uid -> lower-case slot name of the graph slots `slots` (uids of enum `uids`); cached: it runs per call."""
    return {uid: uids(uid).name.lower() for uid in slots}


def _pack(cfg: GraphConfig, specs, named: Dict[str, torch.Tensor], uids, check: bool) -> Dict[int, torch.Tensor]:
    names = _slot_names(uids, tuple(specs))
    missing = [n for n in names.values() if named.get(n) is None]
    if missing:
        raise ValueError(f"this graph ({cfg.describe()}) needs {', '.join(missing)}")
    extra = sorted(set(n for n, t in named.items() if t is not None) - set(names.values()))
    if extra:
        raise ValueError(f"this graph ({cfg.describe()}) has no slot for {', '.join(extra)}")
    pack = {}
    for uid, spec in specs.items():
        name, tensor = names[uid], named[names[uid]]
        if check and not _slot_matches(cfg, name, tensor, spec):
            shape, stride, dtype = spec
            what = (f"[1, {shape[1]}, T, {shape[3]}] {dtype} with strides (*, {', '.join(map(str, stride[1:]))})"
                    if cfg.packed_layout and name in _TOKEN_SLOTS else f"{tuple(shape)} {dtype} with strides {stride}")
            raise ValueError(f"{name} must be {what} for this graph, got {tuple(tensor.shape)} {tensor.dtype} "
                             f"strides {tensor.stride()}")
        pack[uid] = tensor
    return pack


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
    return _pack(cfg, cfg.forward_specs, named, FwdUid, check)


def backward_pack(cfg: GraphConfig, *, q, q_t, k, k_t, v, o, do_f16, do, do_t, stats, sf_q, sf_q_t, sf_k, sf_k_t,
                  sf_v, sf_do, sf_do_t, dq, dk, dv, amax_dq, amax_dk, amax_dv, sink=None, dsink=None,
                  check: bool = True, **varlen) -> Dict[int, torch.Tensor]:
    """uid -> tensor for the backward graph (names as the BwdUid members, lower case); `check`, `varlen`, `sink`
    as in forward_pack; dsink: the fp32 [1, h_q, 1, 1] output buffer of a cfg.dsink graph."""
    named = dict(q=q, q_t=q_t, k=k, k_t=k_t, v=v, o=o, do_f16=do_f16, do=do, do_t=do_t, stats=stats, sf_q=sf_q,
                 sf_q_t=sf_q_t, sf_k=sf_k, sf_k_t=sf_k_t, sf_v=sf_v, sf_do=sf_do, sf_do_t=sf_do_t, dq=dq, dk=dk,
                 dv=dv, amax_dq=amax_dq, amax_dk=amax_dk, amax_dv=amax_dv, sink=sink, dsink=dsink, **varlen)
    return _pack(cfg, cfg.backward_specs, named, BwdUid, check)


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


GRAPH_CACHE = GraphCache()


def planned_graph(kind: str, cfg: GraphConfig, device_index: int, handle, cache: GraphCache = GRAPH_CACHE
                  ) -> PlannedGraph:
    """The planned `kind` graph for `cfg` on CUDA device `device_index` from `cache` (built with `handle`, a
    cudnn.Handle of that device, on a miss). MXFP8NotSupportedError if cuDNN cannot run it."""
    return cache.get((kind, cfg, device_index), lambda: build_and_plan(kind, cfg, handle))
