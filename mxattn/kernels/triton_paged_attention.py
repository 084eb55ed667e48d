"""Triton attention over the paged MXFP8 KV cache (`mxattn.MXFP8KVCache`): decode steps and short chunks.

Each program takes one query tile of one sequence and query head and walks the sequence's pages in KV blocks of
BLOCK_N = 128 tokens (the recipe's softmax block), as the dense forward does:

* K: E4M3 bytes and row-wise E8M0 scales gathered from the pages (page table lookups per token), dequantized
  on chip (`dequant_rows`);
* V: sealed blocks of 32 tokens as E4M3 bytes and column-wise scales from the pages (`dequant_cols`); the open
  block (the last ``L % 32`` tokens, kept in the cache's dtype) quantized column-wise here from the rows it
  holds (`quantize_cols`), as the cache's definition says;
* Q: the caller's queries, quantized row-wise on load.

The tiles are then the bf16 values the dense path multiplies (the quantizer's exact dequantizations), the
query tile and warps are the dense bf16 path's (`BF16_FWD_CONFIGS`), and the softmax step is the shared
`softmax_block`: so O equals `mxfp8_attention(..., attn_mask_type="causal_bottom_right", backend="triton")` over
the sequence's tokens bit for bit. Masks: causal bottom-right per sequence (each sequence's own lengths),
optionally a left window bound; attention sinks.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_attention_fwd import BF16_FWD_CONFIGS, BLOCK_N
from .triton_common import (LOG2E, dequant_cols, dequant_rows, kv_block_range, quantize_cols, quantize_rows,
                            round_p_to_bf16, softmax_block, softmax_start)
from .triton_launch import cdiv, launch
from .triton_quantize import padded_head_dim


@triton.jit
def _paged_block(acc, m_i, l_i, q, j, rows, slot, hk, len_kv, sealed, offset, LB, qk_scale,
                 PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n,
                 VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE,
                 MASK: tl.constexpr, HAS_LB: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr):
    """The online softmax over KV block j (tokens [j * BN, j * BN + BN)) of one sequence read from the pages."""
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, DP)
    offs_kb = tl.arange(0, DP // 32)
    cols = j * BN + offs_n
    valid = cols < len_kv
    d_ok = offs_d < D
    page = tl.load(PT + slot * spt + cols // PAGE, mask=valid, other=0).to(tl.int64)
    row = cols % PAGE
    kt = tl.load(KD + page[:, None] * skd_p + hk * skd_h + row[:, None] * skd_n + offs_d[None, :],
                 mask=valid[:, None] & d_ok[None, :], other=0.0)
    ks = tl.load(KS + page[:, None] * sks_p + hk * sks_h + row[:, None] * sks_n + offs_kb[None, :],
                 mask=valid[:, None] & (offs_kb * 32 < D)[None, :], other=127)
    kt = dequant_rows(kt, ks, BN, DP)
    p, alpha, m_new, l_i = softmax_block(tl.dot(q, tl.trans(kt)), m_i, l_i, rows, cols, len_kv, qk_scale, offset,
                                         LB, 0, MASK, HAS_LB, True)
    # V: sealed blocks from the pages, the open block (rows sealed .. len_kv) quantized here from its rows
    in_pages = cols < sealed
    vt = tl.load(VD + page[:, None] * svd_p + hk * svd_h + row[:, None] * svd_n + offs_d[None, :],
                 mask=in_pages[:, None] & d_ok[None, :], other=0.0)
    blk = j * BN + tl.arange(0, BN // 32) * 32  # first token of each 32-block of the tile
    blk_page = tl.load(PT + slot * spt + blk // PAGE, mask=blk < sealed, other=0).to(tl.int64)
    vs = tl.load(VS + blk_page[:, None] * svs_p + hk * svs_h + ((blk % PAGE) // 32)[:, None] * svs_n
                 + offs_d[None, :], mask=(blk < sealed)[:, None] & d_ok[None, :], other=127)
    vt = dequant_cols(vt, vs, BN, DP)
    if j * BN + BN > sealed:  # the tile reaches the open block
        open_rows = valid & (cols >= sealed)
        raw = tl.load(VT + slot * svt_s + hk * svt_h + (cols - sealed)[:, None] * svt_n + offs_d[None, :],
                      mask=open_rows[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        vq, ve = quantize_cols(raw, BN, DP)
        vt = tl.where(open_rows[:, None], dequant_cols(vq, ve.to(tl.uint8), BN, DP), vt)
    acc = acc * alpha[:, None] + tl.dot(round_p_to_bf16(p), vt)
    return acc, m_new, l_i


@triton.jit
def _paged_attn_kernel(
        Q, O, CU_Q, SLOTS, SEQ_LENS, SINK, PT, KD, KS, VD, VS, VT,
        sq_t, sq_h, so_t, so_h, spt,
        skd_p, skd_h, skd_n, sks_p, sks_h, sks_n,
        svd_p, svd_h, svd_n, svs_p, svs_h, svs_n, svt_s, svt_h, svt_n,
        HQ, GROUP, D, PAGE, qk_scale, LB,
        HAS_LB: tl.constexpr, HAS_SINK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr):
    """Grid (query tiles of the longest query run, sequences * HQ). Q, O: [T, HQ, D] (thd, unit stride along
    D), sequence b's queries at rows CU_Q[b] .. CU_Q[b+1]; SLOTS[b]: its cache slot; SEQ_LENS[slot]: its
    cached tokens (the new ones included); PT: the page table [slots, pages]; KD/KS, VD/VS: the pages' E4M3
    bytes and E8M0 scales [pages, H, page, *] (V's scales [pages, H, page / 32, D]); VT: the open V blocks
    [slots, H, 32, D]."""
    tile = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HQ).to(tl.int64)
    hq = (pid % HQ).to(tl.int64)
    hk = hq // GROUP
    first = tl.load(CU_Q + b)
    len_q = tl.load(CU_Q + b + 1) - first  # int32, as every bound of the KV block range
    q0 = first.to(tl.int64)
    m0 = tile * BM
    if m0 >= len_q:
        return
    slot = tl.load(SLOTS + b).to(tl.int64)
    len_kv = tl.load(SEQ_LENS + slot)
    sealed = len_kv - len_kv % 32
    offset = len_kv - len_q  # causal, bottom-right: the last query sees every key
    rows = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, DP)
    q_ok = (rows < len_q)[:, None] & (offs_d < D)[None, :]
    q = tl.load(Q + (q0 + rows)[:, None] * sq_t + hq * sq_h + offs_d[None, :], mask=q_ok, other=0.0)
    qq, qe = quantize_rows(q.to(tl.float32), BM, DP)
    q = dequant_rows(qq, qe.to(tl.uint8), BM, DP)

    lo, mask_hi, full_lo, full_hi, hi = kv_block_range(m0, len_kv, offset, LB, 0, HAS_LB, True, BM, BN)
    m_i, l_i, acc = softmax_start(SINK, hq, HAS_SINK, BM, DP)
    pages = (PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, VD, svd_p, svd_h, svd_n,
             VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE)
    for j in range(lo // BN, tl.cdiv(mask_hi, BN)):
        acc, m_i, l_i = _paged_block(acc, m_i, l_i, q, j, rows, slot, hk, len_kv, sealed, offset, LB, qk_scale,
                                     *pages, True, HAS_LB, BN, DP)
    for j in range(full_lo // BN, full_hi // BN):
        acc, m_i, l_i = _paged_block(acc, m_i, l_i, q, j, rows, slot, hk, len_kv, sealed, offset, LB, qk_scale,
                                     *pages, False, HAS_LB, BN, DP)
    for j in range(tl.cdiv(tl.maximum(full_hi, mask_hi), BN), tl.cdiv(hi, BN)):
        acc, m_i, l_i = _paged_block(acc, m_i, l_i, q, j, rows, slot, hk, len_kv, sealed, offset, LB, qk_scale,
                                     *pages, True, HAS_LB, BN, DP)
    has = (l_i != 0.0) & (rows < len_q)
    denom = tl.where(has, l_i, 1.0)
    o = tl.where(has[:, None], acc / denom[:, None], 0.0)
    tl.store(O + (q0 + rows)[:, None] * so_t + hq * so_h + offs_d[None, :], o.to(O.dtype.element_ty), mask=q_ok)


def paged_config(head_dim: int):
    """(BLOCK_M, num_warps, num_stages) of the paged kernel: the dense bf16 path's tile and warps (so both issue
    the same MMA instructions and agree bit for bit), two pipeline stages; None above head dim 128."""
    dp = padded_head_dim(head_dim)
    if dp not in BF16_FWD_CONFIGS:
        return None
    bm, warps, _ = BF16_FWD_CONFIGS[dp]
    return bm, warps, 2


def paged_attention_fwd(q: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, slots: torch.Tensor,
                        cache, *, softmax_scale: float, left_bound: Optional[int], out: torch.Tensor,
                        sink: Optional[torch.Tensor] = None) -> None:
    """Launch the paged attention kernel: q [T, Hq, D] bf16/fp16/fp32 (unit stride along D), cu_seqlens_q int32
    [B+1] (sequence b's queries), max_seqlen_q its longest run (host int), slots int32 [B] (each sequence's
    cache slot, on q's device), cache an `MXFP8KVCache` on q's device holding every sequence's tokens (the new
    ones appended). Writes out [T, Hq, D] (bf16/fp16). Causal bottom-right per sequence; left_bound: TE's left
    window + 1 (None: unbounded); sink: fp32 [Hq] contiguous logits or None. The caller checks the arguments
    (`mxattn.kvcache.mxfp8_attention_with_kvcache`)."""
    T, hq, d = q.shape
    config = paged_config(d)
    if config is None:
        raise ValueError(f"the paged kernel takes head dims up to {max(BF16_FWD_CONFIGS)}, got {d}")
    bm, warps, stages = config
    n_seq = slots.numel()
    if T == 0 or n_seq == 0 or max_seqlen_q == 0:
        return
    kd, ks = cache.k_data, cache.k_scale.view(torch.uint8)
    vd, vs = cache.v_data, cache.v_scale.view(torch.uint8)
    vt, pt = cache.v_tail, cache.page_table
    launch(_paged_attn_kernel, (cdiv(max_seqlen_q, bm), n_seq * hq),
           q, out, cu_seqlens_q, slots, cache.seq_lens, q if sink is None else sink, pt, kd, ks, vd, vs, vt,
           q.stride(0), q.stride(1), out.stride(0), out.stride(1), pt.stride(0),
           kd.stride(0), kd.stride(1), kd.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
           vd.stride(0), vd.stride(1), vd.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
           vt.stride(0), vt.stride(1), vt.stride(2),
           hq, hq // cache.kv_heads, d, cache.page_size, float(softmax_scale) * LOG2E.value,
           0 if left_bound is None else int(left_bound),
           HAS_LB=left_bound is not None, HAS_SINK=sink is not None, BM=bm, BN=BLOCK_N, DP=padded_head_dim(d),
           num_warps=warps, num_stages=stages)


__all__ = ["paged_attention_fwd", "paged_config"]
