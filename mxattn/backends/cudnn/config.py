"""The cuDNN MXFP8 attention graph config: `GraphConfig` (everything that changes a graph), the variant-pack uids
(`FwdUid`, `BwdUid`) and the dims/strides helpers of the graphs' tensors. Runs without a GPU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from .frontend import cudnn

from ...constants import MX_BLOCK, ceil_div
from ...mask import MaskSpec

Stride = Tuple[int, int, int, int]
Shape = Tuple[int, int, int, int]

LAYOUT_PERMUTATIONS = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}  # physical axis order
OUT_DTYPES = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}
FP8_DTYPES = {torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3, torch.float8_e5m2: cudnn.data_type.FP8_E5M2}
SCALE_DTYPE = torch.float8_e8m0fnu


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


def row_scale_dims(b: int, h: int, s: int, d: int) -> Shape:
    """Graph dims of a row-wise (blocks along D) F8_128x4 scale tensor: [B, H, ceil(S/128)*128, D32p]."""
    return (b, h, ceil_div(s, 128) * 128, ceil_div(ceil_div(d, MX_BLOCK), 4) * 4)


def col_scale_dims(b: int, h: int, s: int, d: int) -> Shape:
    """Graph dims of a column-wise (blocks along S) F8_128x4 scale tensor: [B, H, S32p, ceil(D/128)*128]."""
    return (b, h, ceil_div(ceil_div(s, MX_BLOCK), 4) * 4, ceil_div(d, 128) * 128)


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

    @cached_property
    def forward_slots(self) -> SlotNames:
        """The forward graph's slots by name (`forward_specs`' uids; computed once per config)."""
        return SlotNames.of(FwdUid, self.forward_specs)

    @cached_property
    def backward_slots(self) -> SlotNames:
        """The backward graph's slots by name (`backward_specs`' uids; computed once per config)."""
        return SlotNames.of(BwdUid, self.backward_specs)


class SlotNames(NamedTuple):
    """A graph's variant-pack slots by name: (uid, lower-case uid name) in the specs' order, and the names."""

    pairs: Tuple[Tuple[int, str], ...]
    names: frozenset

    @classmethod
    def of(cls, uids, specs: dict) -> "SlotNames":
        pairs = tuple((uid, uids(uid).name.lower()) for uid in specs)
        return cls(pairs, frozenset(name for _, name in pairs))


def _plain_keys(specs: dict) -> dict:
    """Slot specs keyed by plain ints (the variant pack's keys), in uid order of the graph's slots."""
    return {int(uid): spec for uid, spec in specs.items()}


#: token capacity granule of a packed graph: the longest sequences are rounded up to it, so nearby maxima share
#: a graph, the scale capacity is whole 128-token tiles and the backward's "multiple of 64" rule always holds
PACKED_CAPACITY = 128


def packed_capacity(max_seqlen: int) -> int:
    """The graph's S of a packed batch whose longest sequence has `max_seqlen` tokens."""
    return max(1, ceil_div(int(max_seqlen), PACKED_CAPACITY)) * PACKED_CAPACITY
