"""Triton attention over the paged MXFP8 KV cache (`mxattn.MXFP8KVCache`): decode steps and chunks.

One kernel, `_paged_attn_kernel`, with two data paths behind one prologue and epilogue (program ids to sequence,
KV head and tile, lengths, query rows, split ranges, the stores): the exact path below, and the decode path
(DECODE: `triton_paged_decode`) for decode steps on the 16-row tile.

One program takes one KV head of one sequence and packs the query heads that share it (GQA) with the query
tokens of a tile into the rows of the dense forward's query tile: row r holds token ``r // GP`` and group head
``r % GP`` (GP: the group, rounded up to a power of two). The pages are read once per KV head, not once per
query head, and a decode step (one token, four query heads per KV head) fills four rows instead of one. The
program walks the sequence's pages in KV blocks of BLOCK_N = 128 tokens (the recipe's softmax block); on the exact
path:

* K: E4M3 bytes and row-wise E8M0 scales gathered from the pages (page table lookups per token), dequantized
  on chip (`dequant_rows`);
* V: sealed blocks of 32 tokens as E4M3 bytes and column-wise scales from the pages (`dequant_cols`); the open
  block (the last ``L % 32`` tokens, kept in the cache's dtype) quantized column-wise here from the rows it
  holds (`quantize_cols`), as the cache's definition says;
* Q: the caller's queries, quantized row-wise on load.

The tiles are the bf16 values the dense path multiplies (the quantizer's exact dequantizations), the tile and
warps are the dense bf16 path's (`BF16_FWD_CONFIGS`: the same MMA instructions, and each row's result does not
depend on which row of the tile it sits in), and the softmax step is the shared `softmax_block`: so with one
split, O equals ``mxfp8_attention(..., attn_mask_type="causal_bottom_right", backend="triton")`` over the
sequence's tokens bit for bit.

Split KV (flash-decoding): when the programs would leave multiprocessors idle (few sequences, long contexts),
each sequence's KV blocks are cut into `n_splits` contiguous ranges run by separate programs, in two passes and
a combine, so that every P is still rounded to E4M3 against the running max of the sequential pass:

1. each split's row maximum of the logits (K only: PASS = 1); on the decode path (STORE_S) it also writes the
   logits themselves, unmasked, to a workspace (one fp32 row per query token and head, a column per key position;
   `score_columns` sizes it, `SCORES_MAX_BYTES` caps it);
2. each split starts its online softmax from the maximum over the sink and the earlier splits (what the
   sequential pass's running max is when it reaches the split's first block), so each block's P is the
   sequential pass's P; it writes its unnormalised O, final max and sum (PASS = 2). Under STORE_S it reads the
   logits pass 1 wrote (the same bits: the same P and O) instead of reading K again and recomputing Q K^T;
3. `_combine_splits_kernel` rescales the splits to the overall max and normalises.

Only the fp32 additions across splits are ordered differently from the sequential pass: split results agree with
one split to fp32 rounding (not bit for bit). A decode call that does not ask for one split (num_splits != 1) and
packs at most 16 rows per tile runs the decode path instead (DECODE, `triton_paged_decode`: the same passes on
the 16-row FAST_TILE, the FP8 bytes multiplied on the f16 tensor cores per 32-block and the power-of-two scales
applied to the products): the same fp32-rounding agreement, without dequantizing K and V tiles.
Masks: causal bottom-right per sequence (each sequence's own lengths), optionally a left window bound; attention sinks.
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..constants import MAX_KV_SPLITS
from .triton_attention_fwd import BF16_FWD_CONFIGS, BLOCK_N
from .triton_common import (LOG2E, band_block_range, block_max, dequant_cols, dequant_rows, load_tile,
                            mask_logits, quantize_cols, quantize_rows, round_p_to_bf16, softmax_block, softmax_start)
from ..runtime.triton_launch import cdiv, launch, sm_count
from .triton_paged_decode import _block_pages, _decode_scores, _decode_values, _load_scores, _q_block, _store_scores
from .triton_quantize import padded_head_dim

# passes of _paged_attn_kernel
SINGLE, MAX_PASS, SPLIT_PASS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
#: programs per multiprocessor the split count aims at (four fit under DECODE_MAXNREG's cap): the fastest split
#: count for decode batches of 1 to 8 over 1k-32k contexts (one 128-token block per split is not too short there)
PROGRAMS_PER_SM = 4


@triton.jit
def _paged_keys(j, slot, hk, len_kv, PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, D, PAGE,
                BN: tl.constexpr, DP: tl.constexpr, EVEN_D: tl.constexpr, WHOLE_PAGES: tl.constexpr):
    """KV block j's keys (tokens [j * BN, j * BN + BN) of the sequence in `slot`, KV head hk) dequantized to bf16
    [BN, DP], zero past len_kv; with the block's page per token [BN] and the in-page rows [BN]. EVEN_D (D ==
    DP): no mask along D, so the FP8 rows load 16 bytes at a time. WHOLE_PAGES: PAGE is a multiple of BN."""
    offs_d = tl.arange(0, DP)
    offs_kb = tl.arange(0, DP // 32)
    cols = j * BN + tl.arange(0, BN)
    valid = cols < len_kv
    if WHOLE_PAGES:  # the block lies in one page: one page-table read
        page = tl.zeros([BN], tl.int64) + tl.load(PT + slot * spt + (j * BN) // PAGE).to(tl.int64)
    else:
        page = tl.load(PT + slot * spt + cols // PAGE, mask=valid, other=0).to(tl.int64)
    row = cols % PAGE
    kt = load_tile(KD + page[:, None] * skd_p + hk * skd_h + row[:, None] * skd_n + offs_d[None, :],
                   valid, offs_d < D, 0.0, True, EVEN_D)
    ks = load_tile(KS + page[:, None] * sks_p + hk * sks_h + row[:, None] * sks_n + offs_kb[None, :],
                   valid, offs_kb * 32 < D, 127, True, EVEN_D)
    return dequant_rows(kt, ks, BN, DP), page, row


@triton.jit
def _paged_values(j, page, row, slot, hk, len_kv, sealed, PT, spt, VD, svd_p, svd_h, svd_n,
                  VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE,
                  BN: tl.constexpr, DP: tl.constexpr, EVEN_D: tl.constexpr, WHOLE_PAGES: tl.constexpr):
    """KV block j's values as bf16 [BN, DP]: sealed 32-token blocks from the pages (page, row: per token, from
    `_paged_keys`), the open block (tokens sealed .. len_kv) quantized here from its rows, zero past len_kv."""
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    cols = j * BN + tl.arange(0, BN)
    vt = load_tile(VD + page[:, None] * svd_p + hk * svd_h + row[:, None] * svd_n + offs_d[None, :],
                   cols < sealed, d_ok, 0.0, True, EVEN_D)
    blk = j * BN + tl.arange(0, BN // 32) * 32  # first token of each 32-block of the tile
    if WHOLE_PAGES:
        blk_page = tl.zeros([BN // 32], tl.int64) + tl.load(PT + slot * spt + (j * BN) // PAGE).to(tl.int64)
    else:
        blk_page = tl.load(PT + slot * spt + blk // PAGE, mask=blk < sealed, other=0).to(tl.int64)
    vs = load_tile(VS + blk_page[:, None] * svs_p + hk * svs_h + ((blk % PAGE) // 32)[:, None] * svs_n
                   + offs_d[None, :], blk < sealed, d_ok, 127, True, EVEN_D)
    vt = dequant_cols(vt, vs, BN, DP)
    if j * BN + BN > sealed:  # the tile reaches the open block
        open_rows = (cols < len_kv) & (cols >= sealed)
        raw = load_tile(VT + slot * svt_s + hk * svt_h + (cols - sealed)[:, None] * svt_n + offs_d[None, :],
                        open_rows, d_ok, 0.0, True, EVEN_D).to(tl.float32)
        vq, ve = quantize_cols(raw, BN, DP)
        vt = tl.where(open_rows[:, None], dequant_cols(vq, ve.to(tl.uint8), BN, DP), vt)
    return vt


@triton.jit
def _paged_blocks(acc, m_i, l_i, q, j0, j1, pos, slot, hk, len_kv, sealed, offset, LB, qk_scale,
                  PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n,
                  VD, svd_p, svd_h, svd_n, VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE, SW, s_row, s_ok,
                  MASK: tl.constexpr, HAS_LB: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
                  EVEN_D: tl.constexpr, WHOLE_PAGES: tl.constexpr, MAX_ONLY: tl.constexpr, DECODE: tl.constexpr,
                  BM: tl.constexpr, NB: tl.constexpr, TAIL: tl.constexpr, STORE_S: tl.constexpr):
    """The online softmax over KV blocks j0 .. j1 (in order) for query positions pos [BM]; MAX_ONLY: only the
    running max of the logits (acc and l_i unchanged). q: Q dequantized to bf16, or under DECODE its D blocks and
    scales (`_q_block`; TAIL: the blocks may reach past the sealed V blocks and past len_kv). STORE_S (DECODE, split
    passes): the maximum pass also writes each block's logits to the workspace SW (rows s_ok at offsets s_row,
    `_store_scores`), the split pass reads them there instead of computing them (`_load_scores`)."""
    for j in range(j0, j1):
        if DECODE:
            pg, page, row = _block_pages(j, slot, len_kv, PT, spt, PAGE, BN, WHOLE_PAGES)
            if STORE_S and not MAX_ONLY:  # the split pass: S as the maximum pass computed it
                qk = _load_scores(SW, s_row, s_ok, j, BN)
            else:
                qk = _decode_scores(*q, j, page, row, hk, len_kv, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n,
                                    D, BN, NB, TAIL, EVEN_D)
                if STORE_S:
                    _store_scores(SW, s_row, s_ok, j, qk, BN)
        else:
            kt, page, row = _paged_keys(j, slot, hk, len_kv, PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h,
                                        sks_n, D, PAGE, BN, DP, EVEN_D, WHOLE_PAGES)
            qk = tl.dot(q, tl.trans(kt))
        cols = j * BN + tl.arange(0, BN)
        if MAX_ONLY:
            m_i = block_max(mask_logits(qk, pos, cols, len_kv, offset, LB, 0, MASK, HAS_LB, True), m_i, qk_scale)
        else:
            p, alpha, m_i, l_i = softmax_block(qk, m_i, l_i, pos, cols, len_kv, qk_scale, offset, LB, 0, MASK,
                                               HAS_LB, True)
            if DECODE:
                pv = _decode_values(p, j, pg, slot, hk, len_kv, sealed, PT, spt, PAGE, VD, svd_p, svd_h, svd_n,
                                    VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, BM, BN, DP, WHOLE_PAGES,
                                    TAIL, EVEN_D)
                acc = acc * alpha[:, None] + pv
            else:
                vt = _paged_values(j, page, row, slot, hk, len_kv, sealed, PT, spt, VD, svd_p, svd_h, svd_n,
                                   VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE, BN, DP, EVEN_D,
                                   WHOLE_PAGES)
                acc = acc * alpha[:, None] + tl.dot(round_p_to_bf16(p), vt)
    return acc, m_i, l_i


@triton.jit
def _paged_attn_kernel(
        Q, O, MP, MF, LP, OP, CU_Q, SLOTS, SEQ_LENS, SINK, PT, KD, KS, VD, VS, VT,
        sq_t, sq_h, so_t, so_h, spt,
        skd_p, skd_h, skd_n, sks_p, sks_h, sks_n,
        svd_p, svd_h, svd_n, svs_p, svs_h, svs_n, svt_s, svt_h, svt_n,
        T, HQ, HKV, GROUP, D, PAGE, qk_scale, LB, N_SPLITS, SW, SW_N,
        HAS_LB: tl.constexpr, HAS_SINK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
        GP: tl.constexpr, EVEN_D: tl.constexpr, WHOLE_PAGES: tl.constexpr, PASS: tl.constexpr,
        DECODE: tl.constexpr, STORE_S: tl.constexpr = False):
    """Grid (query tiles of the longest query run * N_SPLITS, sequences * HKV * head chunks). Q, O: [T, HQ, D]
    (thd, unit stride along D), sequence b's queries at rows CU_Q[b] .. CU_Q[b+1]; SLOTS[b]: its cache slot;
    SEQ_LENS[slot]: its cached tokens (the new ones included); PT: the page table [slots, pages]; KD/KS, VD/VS:
    the pages' E4M3 bytes and E8M0 scales [pages, H, page, *] (V's scales [pages, H, page / 32, D]); VT: the
    open V blocks [slots, H, 32, D]. A tile holds BM // GP query tokens x GP query heads of one KV head (head
    chunk c: the group's heads c * GP .. c * GP + GP). PASS: SINGLE (the whole sequence, writes O), MAX_PASS
    (split s's row maxima of the logits to MP [N_SPLITS, T, HQ]), SPLIT_PASS (split s from the maximum of the
    sink and MP's earlier splits; its unnormalised O to OP [N_SPLITS, T, HQ, DP], final max to MF and sum to
    LP [N_SPLITS, T, HQ]). DECODE: the decode data path (`triton_paged_decode`: FP8 operands on the f16 tensor
    cores), else the exact one (tiles dequantized to bf16, the dense path's products). STORE_S (DECODE, split
    passes): the logits workspace SW fp32 [T * HQ, SW_N] (row tok * HQ + head, column: the key's position; SW_N at
    least every sequence's length: a longer sequence's rows are neither written nor read), written by MAX_PASS and
    read by SPLIT_PASS in place of Q K^T."""
    NB: tl.constexpr = DP // 32
    TQ: tl.constexpr = BM // GP
    tile = tl.program_id(0) // N_SPLITS
    split = tl.program_id(0) % N_SPLITS
    pid = tl.program_id(1)
    chunks = tl.cdiv(GROUP, GP)
    b = (pid // (HKV * chunks)).to(tl.int64)
    hk = ((pid // chunks) % HKV).to(tl.int64)
    chunk = pid % chunks
    first = tl.load(CU_Q + b)
    len_q = tl.load(CU_Q + b + 1) - first  # int32, as every bound of the KV block range
    t0 = tile * TQ
    if t0 >= len_q:
        return
    slot = tl.load(SLOTS + b).to(tl.int64)
    len_kv = tl.load(SEQ_LENS + slot)
    sealed = len_kv - len_kv % 32
    offset = len_kv - len_q  # causal, bottom-right: the last query sees every key
    r = tl.arange(0, BM)
    pos = t0 + r // GP                       # the row's query token (position among the sequence's queries)
    g = chunk * GP + r % GP                  # the row's head within the group
    row_ok = (pos < len_q) & (g < GROUP)
    head = hk * GROUP + tl.where(g < GROUP, g, 0)
    tok = first.to(tl.int64) + pos
    offs_d = tl.arange(0, DP)
    q_ok = row_ok[:, None] & (offs_d < D)[None, :]
    if DECODE:  # Q's 32-wide D blocks quantized row-wise: E4M3 values as f16 and their scales
        q0, s0 = _q_block(Q, tok, head, sq_t, sq_h, row_ok, 0, D, BM)
        q1, s1 = _q_block(Q, tok, head, sq_t, sq_h, row_ok & (NB > 1), 1, D, BM)
        q2, s2 = _q_block(Q, tok, head, sq_t, sq_h, row_ok & (NB > 2), 2, D, BM)
        q3, s3 = _q_block(Q, tok, head, sq_t, sq_h, row_ok & (NB > 2), 3, D, BM)
        qs = (q0, q1, q2, q3, s0, s1, s2, s3)
    else:  # Q quantized row-wise and dequantized to bf16
        q = tl.load(Q + tok[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :], mask=q_ok, other=0.0)
        qq, qe = quantize_rows(q.to(tl.float32), BM, DP)
        q = dequant_rows(qq, qe.to(tl.uint8), BM, DP)

    lo, mask_hi, full_lo, full_hi, hi = band_block_range(t0, len_kv, offset, LB, 0, HAS_LB, True, TQ, BN)
    js = lo // BN
    je = tl.cdiv(hi, BN)
    if PASS != SINGLE:  # this split's blocks
        per = tl.cdiv(je - js, N_SPLITS)
        js = js + split * per
        je = tl.minimum(js + per, je)
    m_i, l_i, acc = softmax_start(SINK, head, HAS_SINK, BM, DP)
    part = (split * T + tok) * HQ + head     # [BM] index into MP / MF / LP
    s_row = (tok * HQ + head) * SW_N         # [BM] the rows' offsets in SW (STORE_S)
    s_ok = row_ok & (len_kv <= SW_N)
    if PASS == MAX_PASS:
        m_i = tl.full([BM], float("-inf"), tl.float32)
    if PASS == SPLIT_PASS:
        for s in range(0, split):
            m_i = tl.maximum(m_i, tl.load(MP + part - (split - s) * T * HQ, mask=row_ok, other=float("-inf")))
        if split > 0:
            l_i = tl.zeros([BM], tl.float32)
    pages = (PT, spt, KD, skd_p, skd_h, skd_n, KS, sks_p, sks_h, sks_n, VD, svd_p, svd_h, svd_n,
             VS, svs_p, svs_h, svs_n, VT, svt_s, svt_h, svt_n, D, PAGE, SW, s_row, s_ok)
    max_only: tl.constexpr = PASS == MAX_PASS
    store_s: tl.constexpr = STORE_S and DECODE and PASS != SINGLE
    if DECODE:
        # the split's blocks [js, je) in three runs: the band's left edge (masked), blocks every query row keeps
        # whole and whose V blocks are all sealed (no mask), the rest (masked; the open V block, keys past len_kv)
        s_blk = sealed // BN
        x1 = tl.maximum(js, tl.minimum(tl.minimum(full_lo // BN, s_blk), je))
        x2 = tl.maximum(x1, tl.minimum(tl.minimum(full_hi // BN, s_blk), je))
        run = (pos, slot, hk, len_kv, sealed, offset, LB, qk_scale)
        acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, qs, js, x1, *run, *pages, True, HAS_LB, BN, DP, EVEN_D,
                                      WHOLE_PAGES, max_only, True, BM, NB, False, store_s)
        acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, qs, x1, x2, *run, *pages, False, HAS_LB, BN, DP, EVEN_D,
                                      WHOLE_PAGES, max_only, True, BM, NB, False, store_s)
        acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, qs, x2, je, *run, *pages, True, HAS_LB, BN, DP, EVEN_D,
                                      WHOLE_PAGES, max_only, True, BM, NB, True, store_s)
    else:  # the band's masked left edge, the unmasked blocks, the masked rest
        acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, q, tl.maximum(lo // BN, js),
                                      tl.minimum(tl.cdiv(mask_hi, BN), je), pos, slot, hk, len_kv, sealed, offset,
                                      LB, qk_scale, *pages, True, HAS_LB, BN, DP, EVEN_D, WHOLE_PAGES, max_only,
                                      False, BM, NB, False, False)
        acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, q, tl.maximum(full_lo // BN, js),
                                      tl.minimum(full_hi // BN, je), pos, slot, hk, len_kv, sealed, offset,
                                      LB, qk_scale, *pages, False, HAS_LB, BN, DP, EVEN_D, WHOLE_PAGES, max_only,
                                      False, BM, NB, False, False)
        acc, m_i, l_i = _paged_blocks(acc, m_i, l_i, q, tl.maximum(tl.cdiv(tl.maximum(full_hi, mask_hi), BN), js),
                                      tl.minimum(tl.cdiv(hi, BN), je), pos, slot, hk, len_kv, sealed, offset,
                                      LB, qk_scale, *pages, True, HAS_LB, BN, DP, EVEN_D, WHOLE_PAGES, max_only,
                                      False, BM, NB, False, False)
    if PASS == MAX_PASS:
        tl.store(MP + part, m_i, mask=row_ok)
    elif PASS == SPLIT_PASS:
        tl.store(MF + part, m_i, mask=row_ok)
        tl.store(LP + part, l_i, mask=row_ok)
        tl.store(OP + part[:, None] * DP + offs_d[None, :], acc, mask=row_ok[:, None])
    else:
        has = (l_i != 0.0) & row_ok
        denom = tl.where(has, l_i, 1.0)
        o = tl.where(has[:, None], acc / denom[:, None], 0.0)
        tl.store(O + tok[:, None] * so_t + head[:, None] * so_h + offs_d[None, :], o.to(O.dtype.element_ty),
                 mask=q_ok)


@triton.jit
def _combine_splits_kernel(O, MF, LP, OP, so_t, so_h, T, HQ, D, N_SPLITS, SP: tl.constexpr, DP: tl.constexpr):
    """Grid (T, HQ): O[t, h] = sum_s 2^(MF_s - M) OP_s / sum_s 2^(MF_s - M) LP_s over the splits (M: the largest
    MF_s; a split without keys has MF = -inf, LP = 0 and adds nothing); 0 where no key was seen."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    s_ok = s < N_SPLITS
    idx = (s * T + t) * HQ + h
    m_s = tl.load(MF + idx, mask=s_ok, other=float("-inf"))
    m = tl.max(m_s, axis=0)
    w = tl.where(m_s == float("-inf"), 0.0, tl.math.exp2(m_s - tl.where(m == float("-inf"), 0.0, m)))
    l_sum = tl.sum(w * tl.load(LP + idx, mask=s_ok, other=0.0), axis=0)
    offs_d = tl.arange(0, DP)
    acc = tl.sum(w[:, None] * tl.load(OP + idx[:, None] * DP + offs_d[None, :], mask=s_ok[:, None], other=0.0),
                 axis=0)
    o = tl.where(l_sum != 0.0, acc / tl.where(l_sum != 0.0, l_sum, 1.0), 0.0)
    tl.store(O + t * so_t + h * so_h + offs_d, o.to(O.dtype.element_ty), mask=offs_d < D)


#: exact tiles other than the dense path's: at D128 one warpgroup of a 64-row tile issues the same wgmma
#: (m64n128k16) with the same row layout as each warpgroup of the dense 128-row / 8-warp tile, so the results are
#: the same bits (tests/kvcache/test_kvcache_gpu.py checks it), at half the rows
EXACT_TILES = {128: (64, 4)}
#: the tile of the decode path (`triton_paged_decode`): the fewest rows an MMA takes (mma.sync m16n8k16), one
#: warp group, two stages (a third is no faster)
FAST_TILE = (16, 4, 2)
#: register cap of the decode path's builds (None: the compiler's choice, 255 per thread and one or two programs per
#: multiprocessor): 128 fits four, which with PROGRAMS_PER_SM's splits run decode steps faster than the compiler's
#: choice
DECODE_MAXNREG = 128
#: the largest logits workspace (bytes) the decode path's split passes store S in (STORE_S), else the split pass
#: recomputes it: 4 bytes per query row (tokens x query heads) and key column (`score_columns`), e.g. 4 MiB at
#: batch 8, 32 query heads, 4k context; 64 MiB (batch 64 x 32 heads at 8k) keeps long prefix-free batches from
#: holding a large scratch for a small gain (few heads' rows per KV head: S is 1/8 of K's bytes at GP 4)
SCORES_MAX_BYTES = 64 << 20


def paged_config(head_dim: int, exact: bool = True, rows: int = 0):
    """(BLOCK_M, num_warps, num_stages) of the paged kernel; None above head dim 128. exact: the dense bf16 path's
    MMA instructions and row layout (its tile and warps, or EXACT_TILES), so both agree bit for bit; two stages. Not
    exact and at most 16 packed rows (a decode step: query heads per KV head x query tokens): FAST_TILE, the
    decode path's (`triton_paged_decode`), whose sums of the products of QK^T and PV run in another order: O
    agrees to fp32 rounding."""
    dp = padded_head_dim(head_dim)
    if dp not in BF16_FWD_CONFIGS:
        return None
    if not exact and rows <= FAST_TILE[0]:
        return FAST_TILE
    bm, warps = EXACT_TILES.get(dp, BF16_FWD_CONFIGS[dp][:2])
    return bm, warps, 2


def tile_heads(group: int, block_m: int) -> int:
    """Query heads of one KV head packed in a tile: the group size rounded up to a power of two, at most the
    tile's rows."""
    return min(triton.next_power_of_2(group), block_m)


def choose_splits(programs: int, kv_blocks: int, sms: int) -> int:
    """Splits of each sequence's KV blocks for `programs` programs (sequences x KV heads x tiles) over at most
    kv_blocks blocks on a GPU of `sms` multiprocessors: 1 when the programs already fill the GPU, else the largest
    power of two that reaches at most about PROGRAMS_PER_SM programs per multiprocessor, with a block per split
    at least (and at most MAX_KV_SPLITS)."""
    if programs >= sms or kv_blocks < 2:
        return 1
    want = min(cdiv(PROGRAMS_PER_SM * sms, programs), kv_blocks, MAX_KV_SPLITS)
    return 1 << (want.bit_length() - 1)


def _config(d: int, group: int, max_seqlen_q: int, num_splits: int):
    """`paged_config` of a call (raises above head dim 128)."""
    config = paged_config(d, num_splits == 1, triton.next_power_of_2(group) * max_seqlen_q)
    if config is None:
        raise ValueError(f"the paged kernel takes head dims up to {max(BF16_FWD_CONFIGS)}, got {d}")
    return config


def split_count(q: torch.Tensor, hkv: int, n_seq: int, max_seqlen_q: int, num_splits: int,
                max_seqlen_kv: int) -> int:
    """The split count `paged_attention_fwd` runs for q [T, Hq, D] over n_seq sequences of at most
    max_seqlen_q queries and max_seqlen_kv cached tokens: num_splits itself unless 0 (choose: `choose_splits`)."""
    if num_splits:
        return num_splits
    return _chosen_splits(q.shape[1], q.shape[2], hkv, n_seq, max_seqlen_q, cdiv(max_seqlen_kv, BLOCK_N),
                          sm_count(q.device))


@functools.lru_cache(maxsize=1024)
def _chosen_splits(hq: int, d: int, hkv: int, n_seq: int, max_seqlen_q: int, kv_blocks: int, sms: int) -> int:
    group = hq // hkv
    bm, _, _ = _config(d, group, max_seqlen_q, 0)
    tiles, rows = _grid(bm, group, hkv, n_seq, max_seqlen_q)
    return choose_splits(tiles * rows, kv_blocks, sms)


def _grid(bm: int, group: int, hkv: int, n_seq: int, max_seqlen_q: int):
    """The kernel's grid before splitting: (query tiles of the longest query run, sequences x KV heads x head
    chunks), for BLOCK_M = bm rows of tile_heads(group, bm) heads each."""
    gp = tile_heads(group, bm)
    return cdiv(max_seqlen_q, bm // gp), n_seq * hkv * cdiv(group, gp)


def score_columns(max_seqlen_kv: int) -> int:
    """Columns of the split passes' logits workspace (STORE_S) for sequences of at most max_seqlen_kv tokens: their
    KV blocks rounded up to a power of two, times BLOCK_N (a bucket: a decode loop keeps one workspace size, and
    one recorded launch plan (`paged_step`), for many steps); 0 without tokens."""
    blocks = cdiv(max_seqlen_kv, BLOCK_N)
    return BLOCK_N << (blocks - 1).bit_length() if blocks > 0 else 0


def _score_workspace(q: torch.Tensor, num_splits: int, decode: bool, max_seqlen_kv: int):
    """(SW, SW_N) of a call: the logits workspace fp32 [T * Hq, SW_N] when the decode path runs split passes
    (STORE_S) and it fits SCORES_MAX_BYTES, else None (the split pass recomputes S)."""
    cols = score_columns(max_seqlen_kv)
    rows = q.shape[0] * q.shape[1]
    if not decode or num_splits == 1 or cols == 0 or rows * cols * 4 > SCORES_MAX_BYTES:
        return None
    return torch.empty((rows, cols), device=q.device, dtype=torch.float32), cols


def paged_attention_fwd(q: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int, slots: torch.Tensor,
                        cache, *, softmax_scale: float, left_bound: Optional[int], out: torch.Tensor,
                        sink: Optional[torch.Tensor] = None, num_splits: int = 1, max_seqlen_kv: int = 0) -> None:
    """Launch the paged attention kernels: q [T, Hq, D] bf16/fp16/fp32 (unit stride along D), cu_seqlens_q int32
    [B+1] (sequence b's queries), max_seqlen_q its longest run (host int), slots int32 [B] (each sequence's
    cache slot, on q's device), cache an `MXFP8KVCache` on q's device holding every sequence's tokens (the new
    ones appended). Writes out [T, Hq, D] (bf16/fp16). Causal bottom-right per sequence; left_bound: TE's left
    window + 1 (None: unbounded); sink: fp32 [Hq] contiguous logits or None. num_splits: 1 (one program per
    sequence and KV head, the dense path's tile: bit-equal to the dense call), n > 1 (split KV), 0 (choose:
    `choose_splits`, from max_seqlen_kv, the longest cached sequence); other than 1, a decode step takes the
    16-row FAST_TILE (`paged_config`), whose split passes store the logits when max_seqlen_kv (then at least
    every sequence's length) is given (`_score_workspace`). The caller checks the arguments
    (`mxattn.mxfp8_attention_with_kvcache`)."""
    T, hq, d = q.shape
    hkv = cache.kv_heads
    group = hq // hkv
    n_seq = slots.numel()
    bm, warps, stages = _config(d, group, max_seqlen_q, num_splits)
    if T == 0 or n_seq == 0 or max_seqlen_q == 0:
        return
    gp = tile_heads(group, bm)
    dp = padded_head_dim(d)
    tiles, rows = _grid(bm, group, hkv, n_seq, max_seqlen_q)
    if num_splits == 0:
        num_splits = split_count(q, hkv, n_seq, max_seqlen_q, 0, max_seqlen_kv)
    kd, ks = cache.k_data, cache.k_scale.view(torch.uint8)
    vd, vs = cache.v_data, cache.v_scale.view(torch.uint8)
    vt, pt = cache.v_tail, cache.page_table
    # the exact tile dequantizes as the dense path does; the decode tile feeds the FP8 bytes to the tensor cores
    decode = (bm, warps, stages) == FAST_TILE
    scores = None
    if num_splits > 1:
        mp = torch.empty((3, num_splits, T, hq), device=q.device, dtype=torch.float32)
        op = torch.empty((num_splits, T, hq, dp), device=q.device, dtype=torch.float32)
        parts = (mp[0], mp[1], mp[2], op)
        scores = _score_workspace(q, num_splits, decode, max_seqlen_kv)
    else:
        parts = (q, q, q, q)
    args = (cu_seqlens_q, slots, cache.seq_lens, q if sink is None else sink, pt, kd, ks, vd, vs, vt,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), pt.stride(0),
            kd.stride(0), kd.stride(1), kd.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            vd.stride(0), vd.stride(1), vd.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
            vt.stride(0), vt.stride(1), vt.stride(2),
            T, hq, hkv, group, d, cache.page_size, float(softmax_scale) * LOG2E.value,
            0 if left_bound is None else int(left_bound), num_splits, *(scores or (q, 0)))
    options = dict(HAS_LB=left_bound is not None, HAS_SINK=sink is not None, BM=bm, BN=BLOCK_N, DP=dp, GP=gp,
                   EVEN_D=dp == d, WHOLE_PAGES=cache.page_size % BLOCK_N == 0, DECODE=decode,
                   STORE_S=scores is not None, num_warps=warps, num_stages=stages)
    if decode and DECODE_MAXNREG is not None:
        options["maxnreg"] = DECODE_MAXNREG
    grid = (tiles * num_splits, rows)
    kernel = _paged_attn_kernel
    if num_splits == 1:
        launch(kernel, grid, q, out, *parts, *args, PASS=SINGLE.value, **options)
        return
    launch(kernel, grid, q, out, *parts, *args, PASS=MAX_PASS.value, **options)
    launch(kernel, grid, q, out, *parts, *args, PASS=SPLIT_PASS.value, **options)
    launch(_combine_splits_kernel, (T, hq), out, parts[1], parts[2], parts[3], out.stride(0), out.stride(1),
           T, hq, d, num_splits, SP=triton.next_power_of_2(num_splits), DP=dp, num_warps=4)


__all__ = ["paged_attention_fwd", "paged_config", "choose_splits", "score_columns", "split_count", "tile_heads"]
