"""`CudnnBackend`, the `AttentionBackend` of cuDNN's fused MXFP8 attention graphs: quantizes the inputs
(mxattn.formats.quantize_mxfp8, or the fused Triton quantizer on CUDA) and calls `run.cudnn_forward` /
`run.cudnn_backward`.

`CudnnBackend.supports(problem)` decides before any work: the known refusals (`refusals.known_refusal`), then, on
a device where cuDNN MXFP8 runs, the forward graph and (for training) the backward graph are built and planned for
the problem (cached per problem, and the plans are reused by the calls).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Dict, List, Optional, Tuple

import torch

from ...devices import device_guard
from ...errors import MXFP8NotSupportedError
from ...formats import MXFP8Tensor, quantize_mxfp8
from ...mask import MaskSpec
from ...formats import _is_non_overlapping_and_dense as _is_dense
from ...runtime.launch_plan import carving_allowed, plan_key
from ...runtime.plan_cache import PlanCache
from ...recipe import Recipe
from ...seqinfo import SeqInfo, zero_padding
from ..base import AttentionBackend, AttentionParams, Problem, SavedForBackward, check_forward_quantized
from .buffers import col_scale_bytes, row_scale_buffer
from .config import col_scale_dims, row_scale_dims
from .refusals import HEAD_DIMS, check_problem, head_dims_refusal, known_refusal
from .run import _supported_state, _token_major, cudnn_backward, cudnn_forward
from .support import cudnn_support

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


def _with_data(x: MXFP8Tensor, data: torch.Tensor) -> MXFP8Tensor:
    """x with its data replaced by `data` (the same values in another layout; x itself when it is x's)."""
    return x if data is x.data else MXFP8Tensor.unchecked(data, x.scale, x.axis, x.segments, x.scale_f8_128x4)


@functools.lru_cache(maxsize=None)
def _fused_quantizer():
    """The Triton fused quantizer (`quantize_rowcol`), or None where Triton cannot be imported."""
    try:
        from ...kernels.triton_quantize import quantize_rowcol
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
    compact scales and the graph's scale bytes (`quantize_operands`); otherwise torch ops (mxattn.formats) make
    the same bytes."""
    return quantize_operands((x,), seq, (which,))[0]


def quantize_operands(xs: Tuple[torch.Tensor, ...], seq: Optional[SeqInfo], sides: Tuple[str, ...],
                      carve_from: Optional[int] = None) -> List[Tuple[MXFP8Tensor, MXFP8Tensor]]:
    """`quantize_operand` of each x in xs (on the length side of the same index in `sides`). With the fused
    quantizer the calls' host path (checks, output allocations, launch arguments) is recorded once per
    signature and replayed with the new tensors' addresses (`_QUANT_PLANS`): the same launches writing the same
    bytes into fresh outputs of the same geometry. carve_from: a replay's outputs from this index on, in the
    order (column-wise data, scales, F8_128x4 scales, row-wise data, scales, F8_128x4 scales) per x, share one
    allocation (at 256-byte boundaries): only for outputs that no custom op returns and that are freed together."""
    quantize = _quantizer_for(xs[0])
    if quantize is None:
        return [_quantize_torch(x, seq, which) for x, which in zip(xs, sides)]
    cus = tuple(None if seq is None else seq.cu_seqlens(which) for which in sides)

    def body():
        flat = []
        for x, cu in zip(xs, cus):
            out = quantize(x, swizzle=True, cu_seqlens=cu)
            flat += [out.col.data, out.col.scale, out.col_swizzled, out.row.data, out.row.scale, out.row_swizzled]
        return flat

    roots = xs + cus  # (the key tells a lengths tensor passed twice from two equal ones: `alias_key`)
    key = plan_key(("cudnn quantize", quantize, carve_from), roots)
    with device_guard(xs[0].device):
        flat = _QUANT_PLANS.run_with_plan(key, body, roots, carve_from)[0]
    return [(MXFP8Tensor.unchecked(flat[i + 3], flat[i + 4], 3, None, flat[i + 5]),
             MXFP8Tensor.unchecked(flat[i], flat[i + 1], 2, None, flat[i + 2])) for i in range(0, len(flat), 6)]


#: launch plans of the fused quantizer's calls, by signature (`quantize_operands`); a family whose sizes change
#: at every call stops recording (`PlanCache`'s rule)
_QUANT_PLANS = PlanCache(max_entries=256, min_replays=16)


def _quantize_torch(x: torch.Tensor, seq: Optional[SeqInfo], which: str) -> Tuple[MXFP8Tensor, MXFP8Tensor]:
    """`quantize_operand` with torch ops (mxattn.formats), where the fused quantizer does not run."""
    x = zero_padding(x, seq, which)
    row, col = quantize_mxfp8(x, axis=-1), quantize_mxfp8(x, axis=-2)
    row.scale_f8_128x4, col.scale_f8_128x4 = row_scale_buffer(row.scale), col_scale_bytes(col.scale)
    return row, col


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
    #: head dims of some (d_qk, d_v) pair cuDNN's graph validation accepts (`v_dim_refusal` checks the pair; cuDNN
    #: may still refuse a shape at planning time, which `supports` finds out up front on a Blackwell device)
    supported_head_dims = HEAD_DIMS
    #: V, O and dO may have another head dim than Q and K (the pairs of `refusals.head_dims_refusal`)
    supports_distinct_v_dim = True
    #: the ops' bodies are recorded once per signature and replayed (`mxattn.op_plans`): a body of allocations,
    #: views, fused-quantizer launches and graph executions (`run.issue_execute`) replays; one that computes
    #: with torch (the torch-op quantizer, a padded or packed batch's masking, a sink) is refused and runs as is
    replays_ops = True
    #: compiled calls keep the graphs' outputs as they are (the packed ops' block would be checked on Blackwell
    #: first: cuDNN's scale layouts may not be carved as the block lays them out, and a copy per call would cost
    #: what the kernels save)
    packs_compiled_saved = False

    @classmethod
    def replay_variant(cls, x: torch.Tensor):
        """The quantizer the bodies use for tensors like x (`_quantizer_for`: the fused one, or None)."""
        return _quantizer_for(x)

    @classmethod
    def availability(cls, device: torch.device) -> Tuple[bool, str]:
        return cudnn_support(device)

    @classmethod
    def v_dim_refusal(cls, head_dim: int, head_dim_v: int) -> str:
        """The base class's check, then cuDNN's rule on the pair (`refusals.head_dims_refusal`: 192 runs with
        head_dim_v 128 only, 256 with 256 only) where head_dim is listed (else the base class's list check names
        it)."""
        refusal = super().v_dim_refusal(head_dim, head_dim_v)
        if refusal or head_dim not in cls.supported_head_dims:
            return refusal
        return head_dims_refusal(head_dim, head_dim_v) or ""

    @classmethod
    def supports_cache(cls, call):
        """A Blackwell GPU and one head dim for K and V, then cuDNN's verdict on its paged MXFP8 graph for the
        call (`paged`)."""
        ok, why = cls.availability(call.q.device)
        if not ok:
            return False, why
        d, d_v = call.cache.head_dim, call.cache.head_dim_v
        if d != d_v:  # the paged graph reads K and V pages of one head dim (`paged.PagedGraphConfig.d`)
            return False, (f"q and k have head_dim {d} and v has head_dim_v {d_v}: cuDNN's paged MXFP8 graph "
                           "reads K and V pages of one head dim (a cache with head_dim_v runs on the reference "
                           "backend)")
        refusal = cls.v_dim_refusal(d, d_v)
        if refusal:
            return False, refusal
        from .paged import paged_config_of, require_paged_graph
        try:
            require_paged_graph(paged_config_of(**_paged_args(call, sink=call.sink is not None)), call.q.device)
        except MXFP8NotSupportedError as exc:
            return False, str(exc)
        return True, why

    @classmethod
    def cache_support_reads_sizes(cls, call) -> bool:
        """Where cuDNN is usable its verdict reads the call's lengths and page counts (the graph's dims)."""
        return cls.availability(call.q.device)[0]

    def attend_cache(self, call):
        from ...kvcache_step import check_queries
        from .paged import cudnn_paged_forward
        cache, slots, cu = call.cache, call.slots, call.cu
        if call.k_new is not None:
            cache._append(slots, call.k_new, call.v_new, cu)
        check_queries(cache, slots, cu, [cache._lens[s] for s in slots])
        return cudnn_paged_forward(**_paged_args(call, sink=call.sink)), None

    @classmethod
    def supports_recipe(cls, recipe: Recipe) -> Tuple[bool, str]:
        """cuDNN's MXFP8 SDPA graphs have one recipe, the default; every variant is refused with the reason."""
        if recipe.is_default:
            return True, "cuDNN's MXFP8 SDPA recipe"
        return False, (f"cuDNN's MXFP8 SDPA graphs implement only the default recipe (P with the fixed scale 256, "
                       f"MXFP8 V and dS, round-up E8M0 block scales); this call asks for {recipe.differences()}: "
                       "use backend='reference', or 'auto' to route it to a backend that runs it")

    @classmethod
    def support_reads_sizes(cls, problem) -> bool:
        """Where cuDNN is usable its refusals read the sizes (`known_refusal`, the planned graphs); elsewhere it
        refuses for the device whatever the sizes."""
        return cls.availability(problem.device)[0]

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
            # V first: its column-wise copy serves this forward alone; the others are kept for the backward, in
            # one allocation where the caller keeps them itself (the eager autograd path)
            (v_row, v_col), (q_row, q_col), (k_row, k_col) = quantize_operands(
                (v, q, k), seq, ("kv", "q", "kv"), carve_from=3 if carving_allowed() else None)
        o, stats, _ = cudnn_forward(q_row, k_row, v_col, attn_scale=params.softmax_scale, mask=params.mask,
                                    out_dtype=params.out_dtype, seq=seq, sink=params.sink)
        saved = SavedWithScaleBuffers(q_row=q_row, q_col=q_col, k_row=k_row, k_col=k_col, v_row=v_row)
        return o, stats, saved

    def forward_quantized(self, q: MXFP8Tensor, k: MXFP8Tensor, v: MXFP8Tensor, params: AttentionParams):
        """`AttentionBackend.forward_quantized`: the given bytes go to the forward graph (`cudnn_forward`, which
        takes MXFP8Tensors and makes the F8_128x4 scale buffers from their compact scales) as `forward` hands
        it its own, in a layout the graph takes (dense, D innermost; token-major for a packed batch: copies
        otherwise). A padded batch's V padding rows are zeroed (never read as values, as the other backends).
        The default recipe only (bf16-V and every other variant: MXFP8NotSupportedError)."""
        check_forward_quantized(q, k, v, params)
        ok, reason = self.supports_recipe(params.recipe)
        if not ok:
            raise MXFP8NotSupportedError(f"backend 'cudnn': {reason}")
        _supported_state(q.data.device)
        seq = params.seq
        if seq is not None and not seq.packed:
            v = _with_data(v, zero_padding(v.data.view(torch.uint8), seq, "kv").view(v.data.dtype))
        layout = _thd_layout if seq is not None and seq.packed else _graph_layout
        q, k, v = (_with_data(x, layout(x.data)) for x in (q, k, v))
        o, stats, _ = cudnn_forward(q, k, v, attn_scale=params.softmax_scale, mask=params.mask,
                                    out_dtype=params.out_dtype, seq=seq, sink=params.sink)
        return o, stats

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
                do = _graph_layout(zero_padding(do, seq, "q"))
            [(do_row, do_col)] = quantize_operands((do,), None, ("q",), carve_from=0)  # this backward's alone
        out = cudnn_backward(saved.q_row, saved.q_col, saved.k_row, saved.k_col, saved.v_row, o, do, do_row, do_col,
                             stats, attn_scale=params.softmax_scale, mask=params.mask,
                             deterministic=params.deterministic, seq=seq, sink=params.sink,
                             sink_requires_grad=params.sink_requires_grad)
        if params.sink_requires_grad:
            return out[0], out[1], out[2], out[6]
        return out[0], out[1], out[2]


def _paged_args(call, sink) -> dict:
    """The arguments of `paged.paged_config_of` / `cudnn_paged_forward` for a KV-cache call."""
    return dict(q=call.q, cu=call.cu, cache=call.cache, slots=call.slots, attn_scale=call.softmax_scale,
                mask=MaskSpec(diagonal_alignment="bottom_right", left_bound=call.left_bound, right_bound=0),
                sink=sink, out_dtype=call.kernel_dtype)
