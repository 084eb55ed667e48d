"""cuDNN's MXFP8 SDPA forward over the paged MXFP8 KV cache (`mxattn.MXFP8KVCache`): decode steps and chunks.

The graph is the dense forward's `sdpa_mxfp8` node with K and V read from the cache's page pools through page
tables (`paged_attention_k_table` / `paged_attention_v_table`) and a padding mask from per-sequence lengths:

* Q: the call's new queries in a padded batch [B, Hq, s_q, D] (bshd memory), quantized row-wise, F8_128x4 scales;
* K: the page pool [num_pages, Hkv, page_size, D] as stored (row-wise bytes), its scale pool [num_pages, Hkv,
  page_size, ceil(D/32)] swizzled to F8_128x4 (`row_scale_dims` of the pool);
* V: the page pool as stored (column-wise blocks of 32 tokens), its scale pool [num_pages, Hkv, page_size/32, D]
  swizzled column-wise (`col_scale_dims` of the pool); each sequence's open block (kept in the cache's dtype)
  is quantized into its page first, from the rows it holds, as the cache's definition says (the rows past the
  sequence's length are zeroed there, so no stale byte of a reused page meets a zero probability);
* page tables int32 [B, 1, max_pages, 1] (the cache's rows of its slots), lengths int32 [B, 1, 1, 1];
* the band mask: causal bottom-right per sequence, optionally a left window bound; the sink as the dense graph's.

cuDNN's validation accepts this graph with F8_128x4 scale pools beside the page pools (deviceless, SM 10.0;
`benchmarks/experiments/cudnn_paged_mxfp8_probe.py`); it refuses plain scales beside paged K/V. Everything here
but `cudnn_paged_forward`'s execution runs without a GPU; the execution needs a Blackwell GPU and cuDNN >= 9.21
(`tests/kvcache/test_kvcache_cudnn.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .frontend import cudnn

from ...constants import MX_BLOCK
from ...errors import MXFP8NotSupportedError
from ...formats import quantize_mxfp8
from ...mask import MaskSpec
from .buffers import col_scale_buffer, row_scale_buffer, sink_operand
from .config import OUT_DTYPES, SCALE_DTYPE, col_scale_dims, col_scale_stride, layout_strides, row_major, \
    row_scale_dims
from .graphs import (GRAPH_CACHE, _ALIGNMENT, _declare_inputs, _declare_outputs, _finish, _new_graph,
                     graph_json, plan_graph)


class PagedUid(IntEnum):
    """Variant-pack uids of the paged forward graph."""

    Q = 201
    K = 202
    V = 203
    SF_Q = 204
    SF_K = 205
    SF_V = 206
    O = 207
    STATS = 208
    AMAX_O = 209
    SEQ_LEN_Q = 210
    SEQ_LEN_KV = 211
    TABLE_K = 212
    TABLE_V = 213
    SINK = 214


@dataclass(frozen=True)
class PagedGraphConfig:
    """Everything that changes a paged MXFP8 forward graph: b sequences of at most s_q new queries (h_q heads)
    over a cache of num_pages pages of page_size tokens (h_kv heads, head dim d) with max_pages page-table
    entries per sequence; the band `mask` (bottom-right); out_dtype bf16/fp16; sink: cuDNN's sink_token input."""

    b: int
    h_q: int
    h_kv: int
    s_q: int
    d: int
    num_pages: int
    page_size: int
    max_pages: int
    attn_scale: float
    mask: MaskSpec = field(default_factory=lambda: MaskSpec(diagonal_alignment="bottom_right", right_bound=0))
    out_dtype: torch.dtype = torch.bfloat16
    sink: bool = False
    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self):
        for name in ("b", "h_q", "h_kv", "s_q", "d", "num_pages", "page_size", "max_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.h_q % self.h_kv:
            raise ValueError(f"h_q ({self.h_q}) must be divisible by h_kv ({self.h_kv})")
        if self.page_size % MX_BLOCK:
            raise ValueError(f"page_size must be a multiple of {MX_BLOCK}, got {self.page_size}")
        if not isinstance(self.mask, MaskSpec) or self.mask.diagonal_alignment != "bottom_right" \
                or self.mask.right_bound != 0:
            raise ValueError(f"mask must be a causal bottom-right MaskSpec (right_bound 0), got {self.mask!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {self.out_dtype}")
        object.__setattr__(self, "attn_scale", float(self.attn_scale))

    @property
    def q_shape(self):
        return (self.b, self.h_q, self.s_q, self.d)

    @property
    def pool_shape(self):
        return (self.num_pages, self.h_kv, self.page_size, self.d)

    @property
    def max_seq_len_kv(self) -> int:
        return self.page_size * self.max_pages

    def describe(self) -> str:
        """One line for error messages."""
        return (f"paged b={self.b} h_q={self.h_q} h_kv={self.h_kv} s_q={self.s_q} d={self.d} "
                f"pages={self.num_pages}x{self.page_size} max_pages={self.max_pages} left={self.mask.left_bound} "
                f"out={str(self.out_dtype).replace('torch.', '')}" + (" sink" if self.sink else ""))

    @property
    def specs(self) -> Dict[int, Tuple[tuple, tuple, torch.dtype]]:
        """uid -> (shape, stride, torch dtype) of every slot of the graph."""
        q_stride = layout_strides("bshd", self.q_shape)
        sf_q, sf_k = row_scale_dims(*self.q_shape), row_scale_dims(*self.pool_shape)
        sf_v = col_scale_dims(*self.pool_shape)
        lens = ((self.b, 1, 1, 1), (1, 1, 1, 1), torch.int32)
        table = ((self.b, 1, self.max_pages, 1), row_major((self.b, 1, self.max_pages, 1)), torch.int32)
        stats = (self.b, self.h_q, self.s_q, 1)
        specs = {
            PagedUid.Q: (self.q_shape, q_stride, self.fp8_dtype),
            PagedUid.K: (self.pool_shape, row_major(self.pool_shape), self.fp8_dtype),
            PagedUid.V: (self.pool_shape, row_major(self.pool_shape), self.fp8_dtype),
            PagedUid.SF_Q: (sf_q, row_major(sf_q), SCALE_DTYPE),
            PagedUid.SF_K: (sf_k, row_major(sf_k), SCALE_DTYPE),
            PagedUid.SF_V: (sf_v, col_scale_stride(sf_v), SCALE_DTYPE),
            PagedUid.O: (self.q_shape, q_stride, self.out_dtype),
            PagedUid.STATS: (stats, row_major(stats), torch.float32),
            PagedUid.AMAX_O: ((1, 1, 1, 1), (1, 1, 1, 1), torch.float32),
            PagedUid.SEQ_LEN_Q: lens, PagedUid.SEQ_LEN_KV: lens, PagedUid.TABLE_K: table, PagedUid.TABLE_V: table,
        }
        if self.sink:
            specs[PagedUid.SINK] = ((1, self.h_q, 1, 1), (self.h_q, 1, 1, 1), torch.float32)
        return {int(uid): spec for uid, spec in specs.items()}


def build_paged_forward_graph(cfg: PagedGraphConfig, handle=None, *, sm_version: int = 100):
    """The paged `sdpa_mxfp8` forward graph for `cfg` (module docstring), validated, its operation graph built.
    `handle`: a cudnn.Handle to plan and run with; None builds a deviceless graph lowered for `sm_version`.
    MXFP8NotSupportedError with cuDNN's reason if cuDNN rejects it."""
    specs = cfg.specs
    graph = _new_graph(cfg, handle, sm_version, "mxattn_mxfp8_paged_fwd")
    t = _declare_inputs(graph, specs, (PagedUid.Q, PagedUid.K, PagedUid.V, PagedUid.SF_Q, PagedUid.SF_K,
                                       PagedUid.SF_V, PagedUid.SEQ_LEN_Q, PagedUid.SEQ_LEN_KV, PagedUid.TABLE_K,
                                       PagedUid.TABLE_V) + ((PagedUid.SINK,) if cfg.sink else ()))
    extra = dict(sink_token=t[PagedUid.SINK]) if cfg.sink else {}
    outputs = graph.sdpa_mxfp8(
        q=t[PagedUid.Q], k=t[PagedUid.K], v=t[PagedUid.V], descale_q=t[PagedUid.SF_Q], descale_k=t[PagedUid.SF_K],
        descale_v=t[PagedUid.SF_V], attn_scale=cfg.attn_scale, generate_stats=True,
        diagonal_alignment=_ALIGNMENT["bottom_right"], diagonal_band_left_bound=cfg.mask.left_bound,
        diagonal_band_right_bound=0, use_padding_mask=True, seq_len_q=t[PagedUid.SEQ_LEN_Q],
        seq_len_kv=t[PagedUid.SEQ_LEN_KV], paged_attention_k_table=t[PagedUid.TABLE_K],
        paged_attention_v_table=t[PagedUid.TABLE_V], paged_attention_max_seq_len_kv=cfg.max_seq_len_kv,
        name="sdpa_mxfp8", **extra)
    _declare_outputs(outputs, specs, (PagedUid.O, PagedUid.STATS, PagedUid.AMAX_O))
    return _finish(graph, cfg, "paged forward")


@functools.lru_cache(maxsize=64)
def paged_graph_refusal(cfg: PagedGraphConfig) -> Optional[str]:
    """None when cuDNN's own (C++) validation accepts the paged graph of `cfg`, lowered without a GPU for SM 10.0;
    else cuDNN's reason. (The Python frontend's `validate()` in `build_paged_forward_graph` accepts more than the
    C++ validation: cuDNN 9.28 refuses MXFP8 SDPA over paged K/V there.)"""
    try:
        graph_json(build_paged_forward_graph(cfg))
    except MXFP8NotSupportedError as exc:
        return str(exc)
    return None


def paged_config_of(q: torch.Tensor, cu: List[int], cache, slots: Sequence[int], *, attn_scale: float,
                    mask: MaskSpec, sink: bool, out_dtype: torch.dtype) -> PagedGraphConfig:
    """The graph config of a call: q [T, Hq, D] split by host offsets cu over the cache's sequences `slots`."""
    return PagedGraphConfig(b=len(slots), h_q=q.shape[1], h_kv=cache.kv_heads,
                            s_q=max([hi - lo for lo, hi in zip(cu, cu[1:])] + [1]), d=cache.head_dim,
                            num_pages=cache.k_data.shape[0], page_size=cache.page_size,
                            max_pages=cache.page_table.shape[1], attn_scale=attn_scale, mask=mask,
                            out_dtype=out_dtype, sink=sink)


def require_paged_graph(cfg: PagedGraphConfig, device: torch.device) -> None:
    """MXFP8NotSupportedError unless cuDNN accepts the paged graph of `cfg` and can run it on `device` (a Blackwell
    GPU, cuDNN >= 9.21), naming why; the verdict on the graph comes first (it holds on any GPU)."""
    from .support import cudnn_support
    refusal = paged_graph_refusal(cfg)
    if refusal is not None:
        raise MXFP8NotSupportedError(
            f"backend 'cudnn': cuDNN {cudnn.backend_version()} refuses its MXFP8 SDPA graph over paged K/V "
            f"({cfg.describe()}): {refusal.rstrip('.')}. Use backend='triton' (CUDA) or 'reference'")
    if device.type != "cuda":
        raise MXFP8NotSupportedError(f"backend 'cudnn' runs cuDNN's paged MXFP8 graph on a Blackwell GPU, got "
                                     f"device {device}; use backend='triton' (CUDA) or 'reference'")
    ok, why = cudnn_support(device)
    if not ok:
        raise MXFP8NotSupportedError(f"backend 'cudnn' cannot run cuDNN's paged MXFP8 graph here: {why}")


# ---------------------------------------------------------------------------------------------------------------
# the cache's operands (pure torch: any device) and the call (Blackwell)
# ---------------------------------------------------------------------------------------------------------------
def seal_open_blocks_into_pages(cache, slots: Sequence[int]) -> None:
    """Write each sequence's open V block (the `L % 32` rows kept in the cache's dtype) into its page as the
    column-wise quantization of those rows, the block's other rows zero, with its scale row: what cuDNN reads
    of V is then every token's `cache.values(slot)` bytes. Sealed blocks are untouched; a later append seals or
    rewrites the open block in place."""
    for slot in slots:
        length = cache.length(slot)
        rows = length % MX_BLOCK
        if rows == 0:
            continue
        first = length - rows
        page, off = cache._pages[slot][first // cache.page_size], first % cache.page_size
        block = cache.v_tail[slot].clone()                             # [H, 32, D]
        block[:, rows:] = 0
        vq = quantize_mxfp8(block, axis=-2)                            # scale [H, 1, D]
        cache.v_data.view(torch.uint8)[page, :, off:off + MX_BLOCK] = vq.data.view(torch.uint8)
        cache.v_scale.view(torch.uint8)[page, :, off // MX_BLOCK] = vq.scale.view(torch.uint8)[:, 0]


def paged_operands(cfg: PagedGraphConfig, q: torch.Tensor, cu: List[int], cache, slots: Sequence[int],
                   sink: Optional[torch.Tensor] = None) -> Tuple[Dict[int, torch.Tensor], torch.Tensor]:
    """(variant pack, row index) of a call: q [T, Hq, D] split by host offsets cu (B + 1) into the padded Q of
    `cfg`; the cache's pools, swizzled scale pools, page tables and lengths of `slots` (open V blocks sealed
    into their pages first); output buffers. The row index (int64 [T]) picks the call's rows out of O viewed
    [B * s_q, Hq, D]."""
    b, s_q, hq, d = cfg.b, cfg.s_q, cfg.h_q, cfg.d
    device = q.device
    rows = torch.tensor([i * s_q + j for i, (lo, hi) in enumerate(zip(cu, cu[1:])) for j in range(hi - lo)],
                        dtype=torch.int64).to(device)
    padded = q.new_zeros((b * s_q, hq, d)).index_copy_(0, rows, q).view(b, s_q, hq, d)
    qq = quantize_mxfp8(padded.permute(0, 2, 1, 3), axis=-1)            # bshd bytes, scales [B, Hq, s_q, D/32]
    seal_open_blocks_into_pages(cache, slots)
    slot_index = torch.tensor(list(slots), dtype=torch.int64).to(device)
    table = cache.page_table.index_select(0, slot_index).clamp(min=0).view(b, 1, cache.page_table.shape[1], 1)
    lens_q = torch.tensor([hi - lo for lo, hi in zip(cu, cu[1:])], dtype=torch.int32).view(b, 1, 1, 1)
    lens_kv = torch.tensor([cache.length(s) for s in slots], dtype=torch.int32).view(b, 1, 1, 1)
    o = torch.empty((b, s_q, hq, d), dtype=cfg.out_dtype, device=device).permute(0, 2, 1, 3)
    pack = {
        PagedUid.Q: qq.data, PagedUid.SF_Q: row_scale_buffer(qq.scale),
        PagedUid.K: cache.k_data, PagedUid.SF_K: row_scale_buffer(cache.k_scale),
        PagedUid.V: cache.v_data, PagedUid.SF_V: col_scale_buffer(cache.v_scale),
        PagedUid.SEQ_LEN_Q: lens_q.to(device), PagedUid.SEQ_LEN_KV: lens_kv.to(device),
        PagedUid.TABLE_K: table.contiguous(), PagedUid.TABLE_V: table.contiguous(),
        PagedUid.O: o, PagedUid.STATS: torch.empty((b, hq, s_q, 1), dtype=torch.float32, device=device),
        PagedUid.AMAX_O: torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device),
    }
    if cfg.sink:
        pack[PagedUid.SINK] = sink_operand(sink, hq, device)
    return {int(uid): t for uid, t in pack.items()}, rows


def check_pack(cfg: PagedGraphConfig, pack: Dict[int, torch.Tensor]) -> None:
    """ValueError naming the slot whose shape, strides or dtype differ from the graph's, or a missing/extra slot."""
    specs = cfg.specs
    if set(pack) != set(specs):
        raise ValueError(f"variant pack slots {sorted(pack)} differ from the graph's {sorted(specs)}")
    for uid, (shape, stride, dtype) in specs.items():
        t = pack[uid]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or tuple(t.stride()) != tuple(stride):
            raise ValueError(f"{PagedUid(uid).name}: the graph wants {tuple(shape)} strides {tuple(stride)} {dtype}, "
                             f"got {tuple(t.shape)} strides {tuple(t.stride())} {t.dtype}")


def cudnn_paged_forward(q: torch.Tensor, cu: List[int], cache, slots: Sequence[int], *, attn_scale: float,
                        mask: MaskSpec, sink: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """Attention of the new queries q [T, Hq, D] (host offsets cu) over the cached sequences `slots` with
    cuDNN's paged MXFP8 graph -> O [T, Hq, D] in out_dtype (bf16/fp16). Needs cuDNN to accept the graph, a
    Blackwell GPU and cuDNN >= 9.21 (`require_paged_graph`: MXFP8NotSupportedError with the reason otherwise,
    before anything is written)."""
    from .run import _supported_state, execute
    cfg = paged_config_of(q, cu, cache, slots, attn_scale=attn_scale, mask=mask, sink=sink is not None,
                          out_dtype=out_dtype)
    require_paged_graph(cfg, q.device)
    state = _supported_state(q.device)
    plan = GRAPH_CACHE.get(("paged_forward", cfg, state.index),
                           lambda: plan_graph(build_paged_forward_graph(cfg, state.get_handle()), cfg,
                                              "paged forward"))
    pack, rows = paged_operands(cfg, q, cu, cache, slots, sink)
    execute(plan, pack, q.device)
    o = pack[PagedUid.O].permute(0, 2, 1, 3).reshape(cfg.b * cfg.s_q, cfg.h_q, cfg.d)
    return o.index_select(0, rows)


__all__ = ["PagedUid", "PagedGraphConfig", "build_paged_forward_graph", "paged_graph_refusal", "paged_config_of",
           "require_paged_graph", "paged_operands", "check_pack", "seal_open_blocks_into_pages",
           "cudnn_paged_forward"]
