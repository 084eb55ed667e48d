"""The small typed interface every attention backend implements.

Tensors cross this interface as [B, H, S, D] views (any strides); a packed (thd) batch arrives as a
[1, H, T, D] view with its sequences described by `AttentionParams.seq` (`mxattn.seqinfo.SeqInfo`). A backend
quantizes its own inputs, so it can use a fused quantizer (`forward`); inputs that arrive already quantized
(`MXFP8Tensor`s: a KV cache, FP8 from the previous GEMM) take `forward_quantized`, an inference path. A backend
hands back exactly what its backward pass needs, in a format of its own (`AttentionBackend.saved_format`; the
default `SavedForBackward` holds the MXFP8 copies every backend here keeps). `supports(problem)` sees the whole
call before any work is done, so `auto` can pick a backend that will run it, forward and backward.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, fields, replace
from typing import List, NamedTuple, Optional, Tuple

import torch

from ..checks import check_quantized_inputs, check_quantized_segments
from ..constants import ATTENTION_FP8_DTYPE, INPUT_DTYPES, KERNEL_OUT_DTYPES, ceil_div
from ..errors import MXFP8NotSupportedError
from ..formats import BLOCK_SIZE, MXFP8Tensor, segmented_scale_rows
from ..mask import MaskSpec
from ..recipe import DEFAULT_RECIPE, DEFAULT_RECIPE_KEY, Recipe
from ..seqinfo import SeqInfo


@dataclass(frozen=True)
class AttentionParams:
    """Everything besides the tensors that a forward/backward call needs."""

    softmax_scale: float
    mask: MaskSpec
    out_dtype: torch.dtype = torch.bfloat16
    deterministic: bool = True
    #: per-sequence lengths (padded or packed batch); None for a dense batch
    seq: Optional[SeqInfo] = None
    #: attention-sink logits, fp32 [Hq] on the tensors' device (TE's softmax_offset; zeros for "off-by-one"),
    #: or None ("vanilla"). The sink joins every row's softmax denominator and adds nothing to O.
    sink: Optional[torch.Tensor] = None
    #: True when the caller needs the gradient of `sink` (softmax_type "learnable")
    sink_requires_grad: bool = False
    #: False when no backward pass follows: a backend may then skip what only the backward needs (the
    #: column-wise copies) and return None for the saved copies
    needs_backward: bool = True
    #: the numerics (`mxattn.Recipe`); a backend runs only those its `supports_recipe` accepts
    recipe: Recipe = DEFAULT_RECIPE
    #: a qkv_format when the caller wants the saved tensors dense in its order whatever the inputs' strides
    #: (the compiled path's block is laid out from shapes and format alone, `mxattn.runtime.saved_block`); a backend
    #: that lays them out otherwise has them copied into place. None: the backend's own layout
    saved_layout: Optional[str] = None


@dataclass(frozen=True)
class Problem:
    """What a backend must know to say whether it can run a call (no tensors, hashable).

    seqlen_q/kv are the padded lengths (dense/padded) or the longest sequence (packed); varlen is None,
    "padded" or "packed". batch, seqlen_q and seqlen_kv are None when unknown (the choice under torch.compile,
    whose sizes may be symbolic): a backend then checks what it can and leaves the rest to the call."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    mask: MaskSpec
    varlen: Optional[str] = None
    needs_backward: bool = False
    out_dtype: torch.dtype = torch.bfloat16
    #: "vanilla", "off-by-one" or "learnable" (TE's softmax_type)
    softmax_type: str = "vanilla"
    #: the numerics asked for, as `Recipe.encode` gives it (a string: Problem is built in traced code)
    recipe: str = DEFAULT_RECIPE_KEY
    #: True when q, k, v arrive already quantized (`AttentionBackend.forward_quantized`; dtype is then their
    #: elements' FP8 dtype, and there is no backward)
    quantized: bool = False
    #: True when the backward must take the gradient of the forward's log-sum-exp (`AttentionBackend.backward`'s
    #: dstats: the stats returned to the caller and differentiated)
    stats_grad: bool = False
    #: V's head dim (O's and dO's), d_v; None (the default) means head_dim. head_dim is then d_qk, Q's and K's
    head_dim_v: Optional[int] = None

    def __post_init__(self):
        if self.head_dim_v is None:  # (one spelling per call: equal problems hash alike)
            object.__setattr__(self, "head_dim_v", self.head_dim)

    def encode(self, without_sizes: bool = False) -> tuple:
        """Every field, in declaration order, as a flat tuple of Python constants (the device as its string,
        the mask as its three band fields): what
        `torch.compiler.assume_constant_result` can take. A field added to Problem is carried without touching
        the encoder. without_sizes: batch and sequence lengths as None (they may be symbolic under
        torch.compile)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "device":
                out.append(str(value))
            elif f.name == "mask":
                out += [value.diagonal_alignment, value.left_bound, value.right_bound]
            else:
                out.append(None if without_sizes and f.name in _SIZE_FIELDS else value)
        return tuple(out)

    @classmethod
    def decode(cls, key: tuple) -> "Problem":
        """The inverse of `encode`."""
        values, i = {}, 0
        for f in fields(cls):
            if f.name == "mask":
                values["mask"] = MaskSpec(diagonal_alignment=key[i], left_bound=key[i + 1], right_bound=key[i + 2])
                i += 3
            else:
                values[f.name] = torch.device(key[i]) if f.name == "device" else key[i]
                i += 1
        return cls(**values)


#: the Problem fields that may be symbolic under torch.compile
_SIZE_FIELDS = ("batch", "seqlen_q", "seqlen_kv")


class CacheCall(NamedTuple):
    """A checked call of `mxfp8_attention_with_kvcache`: what a backend's `supports_cache` / `attend_cache` read."""

    #: the new tokens' queries [T, Hq, D] (bf16, fp16 or fp32)
    q: torch.Tensor
    #: the `mxattn.MXFP8KVCache` (its device is q's)
    cache: object
    #: the cache slots of the batch's sequences, in q's order
    slots: List[int]
    #: host offsets [B+1] splitting T by sequence, and the caller's tensor of them (int32, q's device or the CPU)
    cu: List[int]
    cu_seqlens_q: torch.Tensor
    #: None, or the new tokens' K [T, Hkv, D] and V [T, Hkv, Dv], appended before attending
    k_new: Optional[torch.Tensor]
    v_new: Optional[torch.Tensor]
    softmax_scale: float
    #: the sliding window's left bound (None: unbounded); the mask is causal, aligned bottom-right
    left_bound: Optional[int]
    softmax_type: str
    #: fp32 [Hq] sink logits or None (`mxattn.sinks.sink_logits`)
    sink: Optional[torch.Tensor]
    #: flash-decoding splits (0: the backend chooses)
    num_splits: int
    #: the dtype the kernels write O in (bf16 or fp16), and the one the caller gets
    kernel_dtype: torch.dtype
    out_dtype: torch.dtype

    def facts(self) -> tuple:
        """What a support verdict reads besides sizes (the backend choice's cache key)."""
        q, cache = self.q, self.cache
        return (q.device, q.dtype, q.shape[1], cache.kv_heads, cache.head_dim, cache.head_dim_v, self.left_bound,
                self.softmax_type, self.kernel_dtype, self.k_new is None)


def sink_grad(o: torch.Tensor, do: torch.Tensor, stats: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """dSink [Hq] fp32 from o, do [B,Hq,S,D] and stats [B,Hq,S,1] (log-sum-exp including the sink).

    The sink's probability in row i is P_sink = exp(sink - stats_i) and dL/dsink = -sum_i P_sink * delta_i with
    delta_i = rowsum(O_i * dO_i) (fp32), summed over batch and rows. Rows without a softmax (padding: stats
    -inf) contribute nothing."""
    return sink_grad_from_delta((o.float() * do.float()).sum(dim=-1), stats, sink)


def sink_grad_from_delta(delta: torch.Tensor, stats: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """`sink_grad` from a backward's own delta = rowsum(O * dO), fp32 [B,Hq,S] (no second pass over O, dO)."""
    lse = stats.squeeze(-1)
    p_sink = torch.exp(sink.view(1, -1, 1) - lse)
    contrib = torch.where(torch.isfinite(lse), p_sink * delta, torch.zeros((), device=lse.device))
    return -contrib.sum(dim=(0, 2))


@dataclass
class SavedForBackward:
    """FP8 copies kept from the forward pass (compact E8M0 scales), never the high-precision inputs: the default
    saved format (`AttentionBackend.saved_format`).

    q_row, k_row, v_row: blocks along D; q_col, k_col: blocks along S. Each data tensor is [B, H, S, D].

    A saved format is any class with these three methods, which carry it through autograd and torch.compile
    as a flat tuple of tensors: `tensors()`, `from_tensors(flat, seq)` (its inverse) and
    `fake_tensors(q, k, v, seq)` (empty tensors shaped, typed and placed as `tensors()` would be for inputs
    q, k, v, what the traced forward returns). A backend that keeps something else (pre-swizzled scales,
    transposed copies) defines its own and names it in `saved_format`.
    """

    q_row: MXFP8Tensor
    q_col: MXFP8Tensor
    k_row: MXFP8Tensor
    k_col: MXFP8Tensor
    v_row: MXFP8Tensor

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        """Flat (data, scale) tuple in field order, for autograd's save_for_backward."""
        out = []
        for t in (self.q_row, self.q_col, self.k_row, self.k_col, self.v_row):
            out += [t.data, t.scale]
        return tuple(out)

    @classmethod
    def from_tensors(cls, flat, seq: Optional[SeqInfo] = None) -> "SavedForBackward":
        """Inverse of `tensors()`; seq restores the segments of the column-wise copies of a packed batch."""
        axes = (3, 2, 3, 2, 3)
        segs = (None, None, None, None, None) if seq is None else \
            (None, seq.segments("q"), None, seq.segments("kv"), None)
        parts = [MXFP8Tensor.unchecked(flat[2 * i], flat[2 * i + 1], axis, segs[i]) for i, axis in enumerate(axes)]
        return cls(*parts)

    @classmethod
    def fake_tensors(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: Optional[SeqInfo] = None
                     ) -> Tuple[torch.Tensor, ...]:
        """Empty tensors as `tensors()` returns them for q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] (seq: a packed batch's
        column-wise scales are segmented)."""
        packed = seq is not None and seq.packed
        q_row, q_row_s, q_col, q_col_s = _empty_row_col(q, seq.cu_seqlens_q if packed else None)
        k_row, k_row_s, k_col, k_col_s = _empty_row_col(k, seq.cu_seqlens_kv if packed else None)
        v_row, v_row_s, _, _ = _empty_row_col(v, None)
        return q_row, q_row_s, q_col, q_col_s, k_row, k_row_s, k_col, k_col_s, v_row, v_row_s


def _empty_row_col(x: torch.Tensor, segments: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Row-wise data/scale then column-wise data/scale of x [B, H, S, D], shaped as the quantizers make them."""
    b, h, s, d = x.shape
    col_rows = segmented_scale_rows(s, segments.shape[0] - 1) if segments is not None else ceil_div(s, BLOCK_SIZE)
    fp8, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    return (torch.empty_like(x, dtype=fp8), x.new_empty((b, h, s, ceil_div(d, BLOCK_SIZE)), dtype=e8m0),
            torch.empty_like(x, dtype=fp8), x.new_empty((b, h, col_rows, d), dtype=e8m0))


class AttentionBackend(abc.ABC):
    """One way of running MXFP8 attention. Subclasses set `name` and `supported_head_dims`."""

    name: str = ""
    #: head dims this backend runs; None means any.
    supported_head_dims: Optional[Tuple[int, ...]] = None
    #: dtypes of q, k, v this backend takes
    input_dtypes: Tuple[torch.dtype, ...] = INPUT_DTYPES
    #: the class of what forward() keeps for backward() (see SavedForBackward, the default, for the three methods
    #: that carry it through autograd and torch.compile)
    saved_format: type = SavedForBackward
    #: dtypes forward() writes O in and backward() the gradients in (`AttentionParams.out_dtype`); float32 means
    #: unrounded results, which partial attention over disjoint key sets needs before it is merged
    output_dtypes: Tuple[torch.dtype, ...] = KERNEL_OUT_DTYPES
    #: True when backward() takes `dstats`, the gradient of the forward's log-sum-exp
    takes_stats_grad: bool = False
    #: True when V (and O, dO) may have another head dim than Q and K (`Problem.head_dim_v`, MLA's d_v != d_qk)
    supports_distinct_v_dim: bool = False
    #: True when every kernel of forward() and backward() launches through `mxattn.runtime.triton_launch` and
    #: their host paths read no tensor contents: the ops' bodies may then be recorded once per signature and
    #: replayed (`mxattn.op_plans`). Work issued any other way would be missing from a replay, unless reported
    #: to the recording as a host call (`mxattn.runtime.host_calls.issue`: the cudnn backend's graph executions).
    replays_ops: bool = False
    #: True when compiled calls keep stats and the saved tensors in one block (`mxattn.runtime.saved_block`: the packed
    #: ops); a replayed forward that writes them as `AttentionParams.saved_layout` asks hands its block over,
    #: other calls copy them in
    packs_compiled_saved: bool = True

    @classmethod
    def replay_variant(cls, x: torch.Tensor):
        """What the bodies' host path reads besides the ops' arguments on tensors like x (hashable; the ops'
        replays key it, `mxattn.op_plans`): the base class reads nothing else (None)."""
        return None

    @classmethod
    @abc.abstractmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        """(usable on `device`, human-readable reason). Never raises."""

    @classmethod
    def supports_recipe(cls, recipe: Recipe) -> Tuple[bool, str]:
        """(runs `recipe`, reason). The base class runs the default recipe only; backends that run variants
        (or that refuse with a reason of their own) override it."""
        if recipe.is_default:
            return True, "the default recipe"
        return False, (f"runs only the default recipe, and this call asks for {recipe.differences()} (the "
                       "reference backend runs every recipe)")

    @classmethod
    def saved_format_for(cls, recipe: Recipe) -> type:
        """The saved format of a call with `recipe` (`saved_format` unless a backend keeps something else for
        some recipes)."""
        return cls.saved_format

    @classmethod
    def support_reads_sizes(cls, problem: Problem) -> bool:
        """Whether `supports(problem)` could answer otherwise for another batch size or other sequence lengths
        (the base class's checks read none; a backend whose refusals read them says so)."""
        return False

    @classmethod
    def supports(cls, problem: Problem) -> Tuple[bool, str]:
        """(can run this whole call, forward and, if problem.needs_backward, backward; reason). Never raises.

        The base class checks the recipe (`supports_recipe`), the device, the input dtype (for already-quantized
        inputs: that the backend has `forward_quantized`, and E4M3 elements) and the head dims (`v_dim_refusal`,
        `supported_head_dims`); backends add their own limits."""
        ok, reason = cls.supports_recipe(Recipe.decode(problem.recipe))
        if not ok:
            return False, reason
        ok, reason = cls.availability(problem.device)
        if not ok:
            return False, reason
        if problem.quantized:
            if cls.forward_quantized is AttentionBackend.forward_quantized:
                return False, cls._no_quantized_inputs()
            if problem.dtype != ATTENTION_FP8_DTYPE:
                return False, (f"takes already-quantized q, k, v with {ATTENTION_FP8_DTYPE} elements, got "
                               f"{problem.dtype}")
        elif problem.dtype not in cls.input_dtypes:
            return False, (f"takes q, k, v in {', '.join(map(str, cls.input_dtypes))}, got {problem.dtype}")
        # (before the list of head dims: a pair of dims a backend lists alone, as cuDNN's 192, is refused as a pair)
        refusal = cls.v_dim_refusal(problem.head_dim, problem.head_dim_v)
        if refusal:
            return False, refusal
        if cls.supported_head_dims is not None and problem.head_dim not in cls.supported_head_dims:
            return False, (f"head_dim {problem.head_dim} is not supported (supported: "
                           f"{', '.join(map(str, cls.supported_head_dims))})")
        if problem.out_dtype not in cls.output_dtypes:
            return False, (f"writes its outputs in {', '.join(map(str, cls.output_dtypes))}, and this call needs "
                           f"{problem.out_dtype}")
        if problem.stats_grad and problem.needs_backward and not cls.takes_stats_grad:
            return False, "its backward takes no gradient of the softmax statistics (log-sum-exp)"
        return True, reason

    @classmethod
    def v_dim_refusal(cls, head_dim: int, head_dim_v: int) -> str:
        """Why this backend cannot run V of head dim head_dim_v beside Q and K of head_dim (d_v != d_qk), or ""
        when it can (equal dims; or `supports_distinct_v_dim` and head_dim_v among `supported_head_dims`). The
        check of `supports`, and of `supports_cache` for a cache of two head dims."""
        if head_dim_v == head_dim:
            return ""
        if not cls.supports_distinct_v_dim:
            return (f"q and k have head_dim {head_dim} and v has head_dim_v {head_dim_v}: this backend runs one "
                    "head dim for q, k and v (d_qk != d_v runs on the reference backend)")
        if cls.supported_head_dims is not None and head_dim_v not in cls.supported_head_dims:
            return (f"head_dim_v {head_dim_v} is not supported (supported: "
                    f"{', '.join(map(str, cls.supported_head_dims))})")
        return ""

    @classmethod
    def supports_cache(cls, call: CacheCall) -> Tuple[bool, str]:
        """(can serve this KV-cache call, reason), before anything is written. Never raises. The base class has
        no path over the cache."""
        return False, "has no path over the MXFP8 KV cache"

    @classmethod
    def cache_support_reads_sizes(cls, call: CacheCall) -> bool:
        """Whether `supports_cache(call)` could answer otherwise for other lengths or page counts (the base
        class's answer reads none)."""
        return False

    def attend_cache(self, call: CacheCall) -> Tuple[torch.Tensor, object]:
        """Append call.k_new / v_new (when given), then attend: (O [T, Hq, Dv] in call.kernel_dtype, the
        `mxattn.PagedStep` that ran, or None). Called only after `supports_cache(call)` said yes."""
        raise MXFP8NotSupportedError(f"backend {self.name!r}: {self.supports_cache(call)[1]}")

    def forward_affine_in_kv_length(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    params: AttentionParams) -> bool:
        """Whether forward(q, k, v, params)'s host path depends on the KV length n (k's dim 2) only through
        integers affine in n (sizes, strides, offsets, grids; no choice that changes with n), so that three
        recorded calls predict every other length's launches (`mxattn.runtime.affine_plan`; decode steps).
        Reads shapes only, never n beyond its being non-zero. The base class: False."""
        return False

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams
                ) -> Tuple[torch.Tensor, torch.Tensor, object]:
        """q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] high precision -> (o [B,Hq,Sq,D] out_dtype, stats [B,Hq,Sq,1] fp32,
        saved: a `saved_format` instance, or None when not params.needs_backward)."""

    @abc.abstractmethod
    def backward(self, saved, o: torch.Tensor, stats: torch.Tensor, do: torch.Tensor,
                 params: AttentionParams, dstats: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
        """saved (what forward returned, a `saved_format` instance), o, do [B,Hq,Sq,D] (bf16/fp16), stats
        [B,Hq,Sq,1] fp32 -> (dq [B,Hq,Sq,D], dk, dv [B,Hkv,Skv,D]) in params.out_dtype, followed by dsink [Hq]
        fp32 when params.sink_requires_grad (a backend without its own may use `sink_grad`).
        dstats: None, or the gradient of the returned stats (fp32 [B,Hq,Sq,1]); d stats / d S = P, so it enters
        as delta = rowsum(O * dO) - dstats. Passed only to backends with `takes_stats_grad` (others may omit
        the argument)."""

    def saved_for_backward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: AttentionParams):
        """What `forward(q, k, v, params)` keeps for `backward` (a `saved_format_for(params.recipe)` instance, the
        same bytes), without the attention: for callers that drop the forward's copies and remake them when the
        backward comes (context parallelism's ring holds one K/V block at a time). The base class runs the
        forward and keeps its copies; a backend overrides it with its quantizations alone."""
        return self.forward(q, k, v, replace(params, needs_backward=True))[2]

    def forward_quantized(self, q: MXFP8Tensor, k: MXFP8Tensor, v, params: AttentionParams
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The forward on already-quantized inputs, without autograd (an inference path: nothing is kept for a
        backward; params.needs_backward is ignored).

        q [B,Hq,Sq,D], k [B,Hkv,Skv,D]: `MXFP8Tensor`s with E4M3 elements blocked along D (axis 3, row-wise: the
        Q K^T product's operands); v [B,Hkv,Skv,D]: blocked along S (axis 2, column-wise: P V's operand), or
        under the bf16-V recipe (`Recipe(v_operand="bf16")`) a bfloat16 tensor. Views as `forward` gets them
        (any strides); a packed batch's v has its blocks restart at every sequence (`MXFP8Tensor.segments` equal
        to params.seq.cu_seqlens_kv), a padded batch's rows past each length are read as they are given (the
        last block's scale included: quantize them as zeros, as `forward` does, for the same numbers).
        `check_quantized_inputs` / `check_quantized_segments` are the argument checks.
        Returns (o [B,Hq,Sq,D] params.out_dtype, stats [B,Hq,Sq,1] fp32), equal bit for bit to `forward`'s on
        the inputs these bytes are the quantization of (`mxattn.quantize_attention_inputs`). The recipe's
        scale_rounding and ds_quant play no part (the inputs are quantized; no backward).

        The base class refuses (MXFP8NotSupportedError naming the backend); `supports` refuses problems with
        `quantized` set for a backend that does not override it."""
        raise MXFP8NotSupportedError(f"backend {self.name!r}: {self._no_quantized_inputs()}")

    @classmethod
    def _no_quantized_inputs(cls) -> str:
        return ("has no entry point for already-quantized inputs (AttentionBackend.forward_quantized is not "
                "implemented there): pass the high-precision tensors to mxfp8_attention, or use a backend that "
                "takes MXFP8Tensor inputs")


def check_forward_quantized(q, k, v, params: AttentionParams) -> None:
    """`AttentionBackend.forward_quantized`'s argument checks on [B, H, S, D] views (`mxattn.checks`), before any
    kernel: raises TypeError/ValueError naming the argument."""
    if not isinstance(params, AttentionParams):
        raise TypeError(f"params must be an AttentionParams, got {type(params).__name__}")
    check_quantized_inputs(q, k, v, "bhsd", params.recipe)
    seq = params.seq
    check_quantized_segments(v, seq.cu_seqlens_kv if seq is not None and seq.packed else None)
