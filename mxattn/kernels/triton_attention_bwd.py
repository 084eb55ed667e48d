"""Triton MXFP8 attention backward (spec section 7), deterministic, no atomics.

Three launches, four per chunk of heads in the bf16-scratch data path (mode "pre"):
  1. prep pass (`bwd_prep`, module `triton_bwd_prep`): delta = rowsum(O * dO) in FP32 from the bf16/fp16
     tensors; in mode "pre" also dO quantized to MXFP8 both ways and dO's and Q's copies dequantized exactly to
     bf16 scratch, in the same pass (and, before the dQ kernel, K's and V's copies in a second pass, `kv_prep`).
  2. dK/dV kernel: one program per 128-row KV block and KV head; it walks the query heads of its GQA group
     in fixed order and, for each, the query blocks in ascending order, accumulating dK and dV in FP32
     registers. dS is quantized on the fly along s_q (blocks of 32) for dK = dS_c^T Q_col; P is quantized to
     E4M3 with the fixed scale 256 for dV = Pq^T dO_col.
  3. dQ kernel: one program per query block; it recomputes S, P, dP and quantizes dS along s_kv (blocks of 32)
     for dQ = dS_r K_col.
Every FP8 operand is dequantized exactly to BF16 (in registers, or in mode "pre" by the prep passes) and
multiplied with FP32 accumulation. The tile loads and stores all three share are in `triton_bwd_tiles`.

Variable lengths (`seq`): as in the forward kernel, every kernel starts with `program_prologue` (`seq_span` for
the prep pass), works in rows relative to its sequence's start, and programs past their sequence's end
exit at once (padded batch: after writing zero gradients on the padding rows of their tile).
"""

import os
from types import SimpleNamespace
from typing import List, Tuple

import torch
import triton
import triton.language as tl

from ..runtime.triton_launch import cdiv, launch, sm_count
from .triton_attention_fwd import SCRATCH_BUDGET_BYTES, check_seq
from .triton_bwd_prep import PACKED_GAP, bwd_prep, kv_prep
from .triton_bwd_tiles import _col_tile, _row_tile, _store_rows
from .triton_common import (LOG2E, P_DESCALE, P_SCALE, band_block_range, program_prologue, qdq_rows,
                            tile_offsets)
from .triton_quantize import padded_head_dim, row_tiles, seq_programs
from ..seqinfo import grid_rows, grid_sequences, kernel_cu_seqlens, kernel_flags
from ..runtime.recipe_flags import DEFAULT_FLAGS, KernelRecipe


@triton.jit
def _dkdv_block(dk, dv, k_dq, v_dq, m0, cols, offs_mb, offs_d, d_ok, offs_kb, kb_ok,
                Qh, QSh, QCh, QCSh, DOh, DOSh, DOCh, DOCSh, LSEh, DELTAh,
                sqs, sqss, sqcs, sqcss, sdos, sdoss, sdocs, sdocss, sls,
                len_q, len_kv, qk_scale, sm_scale, offset, LB, RB,
                MASK: tl.constexpr, HAS_LB: tl.constexpr, HAS_RB: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, DP: tl.constexpr, EVEN_D: tl.constexpr, PRE: tl.constexpr,
                P_BF16: tl.constexpr, DS_BF16: tl.constexpr, FLOOR: tl.constexpr):
    """The query block of rows [m0, m0 + BM) of the dK/dV accumulation (recipe switches: `recipe_flags`); each operand at its head's base pointer
    (..h). MASK: the block needs the band/length mask. Unlike the dQ kernel's, the loads stay row-masked in
    every block and the loops run over m0 itself (not a block index): both alternatives made the compiler keep
    address tiles across the loop, which spills at this kernel's register pressure (the dK and dV accumulators
    take half of the registers; offline sm_90 compile, see profile.md)."""
    rows = m0 + offs_mb
    rmask = rows < len_q
    blks = m0 // 32 + tl.arange(0, BM // 32)
    bmask = blks * 32 < len_q
    q_dq = _row_tile(Qh + rows[:, None] * sqs + offs_d[None, :], QSh + rows[:, None] * sqss + offs_kb[None, :],
                     rmask, d_ok, kb_ok, True, EVEN_D, BM, DP, PRE)
    lse = tl.load(LSEh + rows * sls, mask=rmask, other=float("inf")) * LOG2E
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    p_t = tl.math.exp2(tl.dot(k_dq, tl.trans(q_dq)) * qk_scale - lse[None, :])  # [BN, BM]
    if MASK:
        keep = (cols < len_kv)[:, None] & rmask[None, :]
        if HAS_RB:
            keep = keep & (cols[:, None] <= rows[None, :] + offset + RB)
        if HAS_LB:
            keep = keep & (cols[:, None] > rows[None, :] + offset - LB)
        p_t = tl.where(keep, p_t, 0.0)
    do_c = _col_tile(DOCh + rows[:, None] * sdocs + offs_d[None, :],
                     DOCSh + blks[:, None] * sdocss + offs_d[None, :], rmask, bmask, d_ok, True, EVEN_D, BM, DP, PRE)
    if P_BF16:
        pq_t = (p_t * P_SCALE).to(tl.bfloat16)
    else:
        pq_t = (p_t * P_SCALE).to(tl.float8e4nv).to(tl.bfloat16)
    dv += tl.dot(pq_t, do_c)
    do_r = _row_tile(DOh + rows[:, None] * sdos + offs_d[None, :],
                     DOSh + rows[:, None] * sdoss + offs_kb[None, :], rmask, d_ok, kb_ok, True, EVEN_D, BM, DP, PRE)
    dp_t = tl.dot(v_dq, tl.trans(do_r))
    delta = tl.load(DELTAh + rows, mask=rmask, other=0.0)
    ds_t = p_t * (dp_t - delta[None, :]) * sm_scale
    if DS_BF16:
        ds_c = ds_t.to(tl.bfloat16)
    else:
        ds_c = qdq_rows(ds_t, BN, BM, FLOOR)  # blocks of 32 along s_q
    q_c = _col_tile(QCh + rows[:, None] * sqcs + offs_d[None, :],
                    QCSh + blks[:, None] * sqcss + offs_d[None, :], rmask, bmask, d_ok, True, EVEN_D, BM, DP, PRE)
    dk += tl.dot(ds_c, q_c)
    return dk, dv


@triton.jit
def _dkdv_kernel(
        Q, QS, QC, QCS, K, KS, V, VS, DO, DOS, DOC, DOCS, LSE, DELTA, DK, DV, CU_Q, CU_KV,
        sqb, sqh, sqs, sqsb, sqsh, sqss,
        sqcb, sqch, sqcs, sqcsb, sqcsh, sqcss,
        skb, skh, sks, sksb, sksh, skss,
        svb, svh, svs, svsb, svsh, svss,
        sdob, sdoh, sdos, sdosb, sdosh, sdoss,
        sdocb, sdoch, sdocs, sdocsb, sdocsh, sdocss,
        slb, slh, sls, sdelb,
        sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
        HKV, GROUP, SQ, SKV, D, qk_scale, sm_scale, offset, LB, RB,
        HAS_LB: tl.constexpr, HAS_RB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, EVEN_D: tl.constexpr, PRE: tl.constexpr,
        VARLEN: tl.constexpr, PACKED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        P_BF16: tl.constexpr = False, DS_BF16: tl.constexpr = False, V_RAW: tl.constexpr = False,
        FLOOR: tl.constexpr = False):
    """Grid (KV tiles, sequences * HKV). All FP8 tensors have a unit stride along D. SQ, SKV: the tensors' row
    counts; len_q, len_kv: the sequence's. K and V are FP8 (row-wise); the query-side operands are FP8 or
    (PRE) their bf16 dequantizations. Recipe switches (`recipe_flags`): P_BF16 P rounded to bf16 for dV,
    DS_BF16 dS rounded to bf16 for dK, V_RAW V a bf16 tensor (VS unread), FLOOR the OCP rule for dS's scales."""
    tile, hk, _, bt, q0, kv0, len_q, len_kv, qb0, _, offset, n_out = program_prologue(
        CU_Q, CU_KV, HKV, 1, SQ, SKV, offset, VARLEN, PACKED, BOTTOM_RIGHT, False, HAS_RB)
    n0, cols, offs_mb, offs_d, offs_kb, d_ok, kb_ok = tile_offsets(tile, D, BN, BM, DP)
    if VARLEN:
        if n0 >= len_kv:  # no key row of this sequence in the tile
            if not PACKED:  # padding rows of a padded batch: zero gradients
                zero = tl.zeros([BN, DP], tl.float32)
                _store_rows(DK, bt, hk, kv0, sdkb, sdkh, sdks, cols, offs_d, n_out, D, zero)
                _store_rows(DV, bt, hk, kv0, sdvb, sdvh, sdvs, cols, offs_d, n_out, D, zero)
            return
    c_ok = cols < len_kv
    k_dq = _row_tile(K + bt * skb + hk * skh + kv0 * sks + cols[:, None] * sks + offs_d[None, :],
                     KS + bt * sksb + hk * sksh + kv0 * skss + cols[:, None] * skss + offs_kb[None, :],
                     c_ok, d_ok, kb_ok, True, EVEN_D, BN, DP, False)
    v_dq = _row_tile(V + bt * svb + hk * svh + kv0 * svs + cols[:, None] * svs + offs_d[None, :],
                     VS + bt * svsb + hk * svsh + kv0 * svss + cols[:, None] * svss + offs_kb[None, :],
                     c_ok, d_ok, kb_ok, True, EVEN_D, BN, DP, V_RAW)

    # query rows that see this KV block, and the query blocks that see all of it
    lo, mask_hi, full_lo, full_hi, hi = band_block_range(n0, len_q, offset, LB, RB, HAS_LB, HAS_RB, BM, BN,
                                                          True, len_kv)

    tile = (cols, offs_mb, offs_d, d_ok, offs_kb, kb_ok)
    strides = (sqs, sqss, sqcs, sqcss, sdos, sdoss, sdocs, sdocss, sls, len_q, len_kv, qk_scale, sm_scale,
               offset, LB, RB)
    dk = tl.zeros([BN, DP], tl.float32)
    dv = tl.zeros([BN, DP], tl.float32)
    for g in range(0, GROUP):
        hq = hk * GROUP + g
        heads = (Q + bt * sqb + hq * sqh + q0 * sqs, QS + bt * sqsb + hq * sqsh + q0 * sqss,
                 QC + bt * sqcb + hq * sqch + q0 * sqcs, QCS + bt * sqcsb + hq * sqcsh + qb0 * sqcss,
                 DO + bt * sdob + hq * sdoh + q0 * sdos, DOS + bt * sdosb + hq * sdosh + q0 * sdoss,
                 DOC + bt * sdocb + hq * sdoch + q0 * sdocs, DOCS + bt * sdocsb + hq * sdocsh + qb0 * sdocss,
                 LSE + bt * slb + hq * slh + q0 * sls, DELTA + bt * sdelb + hq * SQ + q0)
        for m0 in range(lo, mask_hi, BM):
            dk, dv = _dkdv_block(dk, dv, k_dq, v_dq, m0, *tile, *heads, *strides,
                                 True, HAS_LB, HAS_RB, BM, BN, DP, EVEN_D, PRE,
                                 P_BF16, DS_BF16, FLOOR)
        for m0 in range(full_lo, full_hi, BM):
            dk, dv = _dkdv_block(dk, dv, k_dq, v_dq, m0, *tile, *heads, *strides,
                                 False, HAS_LB, HAS_RB, BM, BN, DP, EVEN_D, PRE,
                                 P_BF16, DS_BF16, FLOOR)
        for m0 in range(tl.maximum(full_hi, mask_hi), hi, BM):
            dk, dv = _dkdv_block(dk, dv, k_dq, v_dq, m0, *tile, *heads, *strides,
                                 True, HAS_LB, HAS_RB, BM, BN, DP, EVEN_D, PRE,
                                 P_BF16, DS_BF16, FLOOR)
    if VARLEN:  # rows past the sequence (padding) get exact zeros even where a NaN of its own rows reached them
        dk = tl.where(c_ok[:, None], dk, 0.0)
        dv = tl.where(c_ok[:, None], dv, 0.0)
    _store_rows(DK, bt, hk, kv0, sdkb, sdkh, sdks, cols, offs_d, n_out, D, dk)
    _store_rows(DV, bt, hk, kv0, sdvb, sdvh, sdvs, cols, offs_d, n_out, D, dv * P_DESCALE)


@triton.jit
def _dq_block(dq, q_dq, do_r, lse, delta, j, offs_m, offs_n, d_ok, kb_ok,
              k_ptrs, ks_ptrs, kc_ptrs, kcs_ptrs, v_ptrs, vs_ptrs, sks, skss, skcs, skcss, svs, svss,
              len_kv, qk_scale, sm_scale, offset, LB, RB,
              MASK: tl.constexpr, HAS_LB: tl.constexpr, HAS_RB: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, DP: tl.constexpr, EVEN_D: tl.constexpr, PRE: tl.constexpr,
              DS_BF16: tl.constexpr, V_RAW: tl.constexpr, FLOOR: tl.constexpr):
    """One KV block j (rows [n0, n0 + BN), n0 = j * BN) of the dQ accumulation from the pointer tiles of KV block
    0 (moved by a scalar per block). MASK: the block needs the band/length mask and masked loads; without it
    every key row exists and the loads are unmasked (16-byte loads, no predicates)."""
    n0 = j * BN
    cols = n0 + offs_n
    c_ok = cols < len_kv
    k_dq = _row_tile(k_ptrs + n0 * sks, ks_ptrs + n0 * skss, c_ok, d_ok, kb_ok, MASK, EVEN_D, BN, DP, PRE)
    p = tl.math.exp2(tl.dot(q_dq, tl.trans(k_dq)) * qk_scale - lse[:, None])
    if MASK:
        keep = c_ok[None, :]
        if HAS_RB:
            keep = keep & (cols[None, :] <= offs_m[:, None] + offset + RB)
        if HAS_LB:
            keep = keep & (cols[None, :] > offs_m[:, None] + offset - LB)
        p = tl.where(keep, p, 0.0)
    if V_RAW:
        v_dq = _row_tile(v_ptrs + n0 * svs, vs_ptrs, c_ok, d_ok, kb_ok, MASK, EVEN_D, BN, DP, True)
    else:
        v_dq = _row_tile(v_ptrs + n0 * svs, vs_ptrs + n0 * svss, c_ok, d_ok, kb_ok, MASK, EVEN_D, BN, DP, PRE)
    dp = tl.dot(do_r, tl.trans(v_dq))
    ds = p * (dp - delta[:, None]) * sm_scale
    if DS_BF16:
        ds_r = ds.to(tl.bfloat16)
    else:
        ds_r = qdq_rows(ds, BM, BN, FLOOR)  # blocks of 32 along s_kv
    bmask = (n0 // 32 + tl.arange(0, BN // 32)) * 32 < len_kv
    k_c = _col_tile(kc_ptrs + n0 * skcs, kcs_ptrs + (n0 // 32) * skcss, c_ok, bmask, d_ok, MASK, EVEN_D, BN, DP,
                    PRE)
    dq += tl.dot(ds_r, k_c)
    return dq


@triton.jit
def _dq_kernel(
        Q, QS, K, KS, KC, KCS, V, VS, DO, DOS, LSE, DELTA, DQ, CU_Q, CU_KV,
        sqb, sqh, sqs, sqsb, sqsh, sqss,
        skb, skh, sks, sksb, sksh, skss,
        skcb, skch, skcs, skcsb, skcsh, skcss,
        svb, svh, svs, svsb, svsh, svss,
        sdob, sdoh, sdos, sdosb, sdosh, sdoss,
        slb, slh, sls, sdelb, sdqb, sdqh, sdqs,
        HQ, GROUP, SQ, SKV, D, qk_scale, sm_scale, offset, LB, RB,
        HAS_LB: tl.constexpr, HAS_RB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, EVEN_D: tl.constexpr, PRE: tl.constexpr,
        VARLEN: tl.constexpr, PACKED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        DS_BF16: tl.constexpr = False, V_RAW: tl.constexpr = False, FLOOR: tl.constexpr = False):
    """Grid (query tiles, sequences * HQ). Recipe switches as the dK/dV kernel's."""
    tile, hq, hk, bt, q0, kv0, len_q, len_kv, _, kvb0, offset, n_out = program_prologue(
        CU_Q, CU_KV, HQ, GROUP, SQ, SKV, offset, VARLEN, PACKED, BOTTOM_RIGHT, True, HAS_RB)
    m0, offs_m, offs_n, offs_d, offs_kb, d_ok, kb_ok = tile_offsets(tile, D, BM, BN, DP)
    if VARLEN:
        if m0 >= len_q:  # no query row of this sequence in the tile
            if not PACKED:  # padding rows of a padded batch: zero gradients
                _store_rows(DQ, bt, hq, q0, sdqb, sdqh, sdqs, offs_m, offs_d, n_out, D,
                            tl.zeros([BM, DP], tl.float32))
            return
    rmask = offs_m < len_q
    q_dq = _row_tile(Q + bt * sqb + hq * sqh + q0 * sqs + offs_m[:, None] * sqs + offs_d[None, :],
                     QS + bt * sqsb + hq * sqsh + q0 * sqss + offs_m[:, None] * sqss + offs_kb[None, :],
                     rmask, d_ok, kb_ok, True, EVEN_D, BM, DP, PRE)
    do_r = _row_tile(DO + bt * sdob + hq * sdoh + q0 * sdos + offs_m[:, None] * sdos + offs_d[None, :],
                     DOS + bt * sdosb + hq * sdosh + q0 * sdoss + offs_m[:, None] * sdoss + offs_kb[None, :],
                     rmask, d_ok, kb_ok, True, EVEN_D, BM, DP, PRE)
    lse = tl.load(LSE + bt * slb + hq * slh + q0 * sls + offs_m * sls, mask=rmask, other=float("inf")) * LOG2E
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + bt * sdelb + hq * SQ + q0 + offs_m, mask=rmask, other=0.0)
    k_ptrs = K + bt * skb + hk * skh + kv0 * sks + offs_n[:, None] * sks + offs_d[None, :]
    ks_ptrs = KS + bt * sksb + hk * sksh + kv0 * skss + offs_n[:, None] * skss + offs_kb[None, :]
    kc_ptrs = KC + bt * skcb + hk * skch + kv0 * skcs + offs_n[:, None] * skcs + offs_d[None, :]
    kcs_ptrs = (KCS + bt * skcsb + hk * skcsh + kvb0 * skcss + tl.arange(0, BN // 32)[:, None] * skcss
                + offs_d[None, :])
    v_ptrs = V + bt * svb + hk * svh + kv0 * svs + offs_n[:, None] * svs + offs_d[None, :]
    vs_ptrs = VS + bt * svsb + hk * svsh + kv0 * svss + offs_n[:, None] * svss + offs_kb[None, :]

    lo, mask_hi, full_lo, full_hi, hi = band_block_range(m0, len_kv, offset, LB, RB, HAS_LB, HAS_RB, BM, BN)

    dq = tl.zeros([BM, DP], tl.float32)
    args = (k_ptrs, ks_ptrs, kc_ptrs, kcs_ptrs, v_ptrs, vs_ptrs, sks, skss, skcs, skcss, svs, svss,
            len_kv, qk_scale, sm_scale, offset, LB, RB)
    for j in range(lo // BN, tl.cdiv(mask_hi, BN)):
        dq = _dq_block(dq, q_dq, do_r, lse, delta, j, offs_m, offs_n, d_ok, kb_ok, *args,
                       True, HAS_LB, HAS_RB, BM, BN, DP, EVEN_D, PRE,
                                 DS_BF16, V_RAW, FLOOR)
    for j in range(full_lo // BN, full_hi // BN):
        dq = _dq_block(dq, q_dq, do_r, lse, delta, j, offs_m, offs_n, d_ok, kb_ok, *args,
                       False, HAS_LB, HAS_RB, BM, BN, DP, EVEN_D, PRE,
                                 DS_BF16, V_RAW, FLOOR)
    for j in range(tl.cdiv(tl.maximum(full_hi, mask_hi), BN), tl.cdiv(hi, BN)):
        dq = _dq_block(dq, q_dq, do_r, lse, delta, j, offs_m, offs_n, d_ok, kb_ok, *args,
                       True, HAS_LB, HAS_RB, BM, BN, DP, EVEN_D, PRE,
                                 DS_BF16, V_RAW, FLOOR)
    if VARLEN:  # as in the dK/dV kernel
        dq = tl.where(rmask[:, None], dq, 0.0)
    _store_rows(DQ, bt, hq, q0, sdqb, sdqh, sdqs, offs_m, offs_d, n_out, D, dq)


#: ((dK/dV BM, BN, warps, stages), (dQ BM, BN, warps, stages)) by padded head dim, for the bf16-scratch ("pre")
#: data path: the fastest of `python -m mxattn bench --sweep bwd_pre`; at D64 and D32 one 4-warp group per dK/dV
#: program (two per SM) is faster still
BWD_CONFIGS = {32: ((32, 128, 4, 3), (64, 64, 4, 3)), 64: ((32, 128, 4, 3), (128, 32, 8, 3)),
               128: ((32, 128, 8, 3), (128, 64, 8, 3)), 256: ((32, 64, 8, 1), (64, 32, 8, 1))}
#: the same for the FP8-streaming ("fp8") data path (dequantization on chip: more registers, fewer stages)
BWD_FP8_CONFIGS = {32: ((64, 128, 8, 2), (128, 64, 8, 2)), 64: ((64, 128, 8, 2), (128, 64, 8, 2)),
                   128: ((64, 128, 8, 1), (128, 64, 8, 3)), 256: ((32, 64, 8, 1), (64, 32, 8, 1))}


def _bwd_config(dp: int, mode: str):
    """((dkdv BM, BN, warps, stages), (dq BM, BN, warps, stages)) for padded head dim dp and data path mode."""
    return (BWD_CONFIGS if mode == "pre" else BWD_FP8_CONFIGS)[dp]


def _st3(t):
    return tuple(t.stride()[:3])


def _op(t):
    """(data, scale-bytes) of an MXFP8Tensor, or (t, t) for a bf16 tensor that already holds the
    dequantization (the scale argument is then unused)."""
    if isinstance(t, torch.Tensor):
        return t, t
    return t.data, t.scale.view(torch.uint8)


def _launch_dkdv(qr, qc, kr, vr, dor, doc, stats, delta, dk, dv, cfg, pre, args, common, seq, cu, flags):
    (bm1, bn1, w1, st1) = cfg
    B, HKV, SKV = kr.data.shape[0], kr.data.shape[1], kr.data.shape[2]
    ops = [_op(t) for t in (qr, qc, kr, vr, dor, doc)]
    flat = [x for pair in ops for x in pair]
    strides = [st for pair in ops for x in pair for st in _st3(x)]
    launch(
        _dkdv_kernel, (row_tiles(grid_rows(seq, "kv", SKV), bn1), seq_programs(grid_sequences(seq, B), HKV)),
        *flat, stats, delta, dk, dv, *cu, *strides, *_st3(stats), delta.stride(0), *_st3(dk),
        *_st3(dv), HKV, *args, BM=bm1, BN=bn1, PRE=pre, **flags.bwd(), num_warps=w1, num_stages=st1, **common)


def _launch_dq(qr, kr, kc, vr, dor, stats, delta, dq, cfg, pre, args, common, seq, cu, flags):
    (bm2, bn2, w2, st2) = cfg
    qd = qr if isinstance(qr, torch.Tensor) else qr.data
    B, HQ, SQ = qd.shape[0], qd.shape[1], qd.shape[2]
    ops = [_op(t) for t in (qr, kr, kc, vr, dor)]
    flat = [x for pair in ops for x in pair]
    strides = [st for pair in ops for x in pair for st in _st3(x)]
    launch(
        _dq_kernel, (row_tiles(grid_rows(seq, "q", SQ), bm2), seq_programs(grid_sequences(seq, B), HQ)),
        *flat, stats, delta, dq, *cu, *strides, *_st3(stats), delta.stride(0), *_st3(dq),
        HQ, *args, BM=bm2, BN=bn2, PRE=pre, DS_BF16=flags.ds_bf16, V_RAW=flags.v_raw, FLOOR=flags.floor,
        num_warps=w2, num_stages=st2, **common)


def _heads(t, h0: int, h1: int):
    """Head slice [h0, h1) of an MXFP8Tensor (data and scale views, no copy; segments kept), or of a plain
    tensor (the bf16-V recipe's V)."""
    if isinstance(t, torch.Tensor):
        return t[:, h0:h1]
    return SimpleNamespace(data=t.data[:, h0:h1], scale=t.scale[:, h0:h1], axis=t.axis,
                           segments=getattr(t, "segments", None))


def _pre_budget_from_environment(default: int) -> int:
    """PRE_BUDGET_BYTES from MXATTN_BWD_SCRATCH_MIB (a whole number of MiB, 0 or more), else `default`."""
    text = os.environ.get("MXATTN_BWD_SCRATCH_MIB")
    if text is None or not text.strip():
        return default
    try:
        mib = int(text.strip())
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"MXATTN_BWD_SCRATCH_MIB must be a whole number of MiB, 0 or more (the bf16 scratch one "
                         f"head chunk of the backward aims at), got {text!r}")
    return mib << 20


#: the bf16 scratch one head chunk of the "pre" backward aims at (chunks of more heads keep more programs in
#: flight); one KV head's alone may reach SCRATCH_BUDGET_BYTES. A chunk always holds the KV heads for about two
#: waves of dK/dV programs, so MXATTN_BWD_SCRATCH_MIB=0 in the environment keeps only those, trading a few percent
#: of backward time for a lower peak (benchmarks/bwd_scratch_budget.py measures both). Default 128 MiB
PRE_BUDGET_BYTES = _pre_budget_from_environment(SCRATCH_BUDGET_BYTES // 4)


def head_chunks(hkv: int, per_head: int, want: int) -> List[Tuple[int, int]]:
    """The "pre" backward's chunks of KV heads [(h0, h1)]: hkv heads of per_head bytes of bf16 scratch each, at
    least `want` heads per chunk (about two waves of dK/dV programs) or PRE_BUDGET_BYTES of scratch, at most
    SCRATCH_BUDGET_BYTES (one head at least); as many chunks as chunks of that size need, balanced (sizes differ
    by at most one head: no small last chunk whose launches run a fraction of a wave, and the largest chunk's
    scratch, the peak, is smaller)."""
    hc = max(1, min(hkv, max(want, PRE_BUDGET_BYTES // max(1, per_head))))
    if hc * per_head > SCRATCH_BUDGET_BYTES:
        hc = max(1, SCRATCH_BUDGET_BYTES // per_head)
    n_chunks = cdiv(hkv, hc)
    bounds = [hkv * i // n_chunks for i in range(n_chunks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _pre_scratch_per_kv_head(B: int, group: int, SQ: int, SKV: int, D: int) -> int:
    """Bytes of bf16 scratch one KV head needs in the "pre" backward: the dK/dV phase holds 4 q-side operands
    (Q and dO, each row- and column-wise), the dQ phase Q and dO row-wise and K (both ways) and V row-wise."""
    return max(B * group * SQ * D * 8, B * (group * SQ * 4 + SKV * 6) * D)


def bwd_streams_bf16(B: int, HQ: int, HKV: int, SQ: int, SKV: int, D: int) -> bool:
    """The problem's choice of backward data path: True ("pre": per chunk of KV heads the streamed operands
    are dequantized to bf16 scratch first, faster) unless one KV head's scratch alone exceeds
    SCRATCH_BUDGET_BYTES, where the kernels stream FP8 and dequantize on chip (no scratch; same numbers)."""
    return _pre_scratch_per_kv_head(B, max(1, HQ // max(1, HKV)), SQ, SKV, D) <= SCRATCH_BUDGET_BYTES


def _packed_gap(gluon_dkdv, gluon_dq, k_row, v_row, seq, group: int, heads: int, D: int, **call) -> int:
    """A packed batch's scratch gap for a "pre" backward: PACKED_GAP where both Gluon kernels take the call (asked
    with shape-only stand-ins of the gapped scratch of a chunk of `heads` KV heads, their length heuristics
    seeing the longest sequence), else 0 (both Triton kernels, packed scratch). Both or neither: the Triton
    kernels read the packed scratch layout, the Gluon ones the gapped one."""
    if gluon_dkdv is None or gluon_dq is None:
        return 0
    n_seq = grid_sequences(seq, 1)

    def stand_in(h: int, rows: int):
        return torch.empty((1, h, rows + PACKED_GAP * n_seq, D), dtype=torch.bfloat16, device="meta")
    q_s, kv_s = stand_in(heads * group, seq.max_seqlen_q), stand_in(heads, seq.max_seqlen_kv)
    k_h, v_h = _heads(k_row, 0, heads), _heads(v_row, 0, heads)
    takes = gluon_dkdv.takes(q_s, k_h, v_h, seq=seq, q_c=q_s, do_r=q_s, do_c=q_s, **call) and \
        gluon_dq.takes(q_s, kv_s, kv_s, kv_s, q_s, seq=seq, **call)
    return PACKED_GAP if takes else 0


def attention_bwd(q_row, q_col, k_row, k_col, v_row, do_row, do_col, o, do, stats, *, softmax_scale: float,
                  offset: int, left_bound, right_bound, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                  config=None, mode: str = "fp8", seq=None, bottom_right: bool = False,
                  flags: KernelRecipe = DEFAULT_FLAGS, gluon_dkdv=None, gluon_dq=None, dstats=None) -> torch.Tensor:
    """Launch the prep pass, dK/dV kernel and dQ kernel (per chunk of heads in mode "pre").

    q_row, q_col: MXFP8Tensor [B,Hq,Sq,D] (row: scales [B,H,S,ceil(D/32)], col: scales [B,H,ceil(S/32),D]);
    k_row, k_col, v_row: MXFP8Tensor [B,Hkv,Skv,D]; do_row, do_col: MXFP8Tensor of dO (mode "fp8"; None
    allowed in mode "pre"); o, do [B,Hq,Sq,D] bf16/fp16; stats [B,Hq,Sq,1] fp32.
    Writes dq [B,Hq,Sq,D], dk, dv [B,Hkv,Skv,D] (unit stride along D; bf16, fp16 or fp32); returns the prep
    pass's delta = rowsum(O * dO) fp32 [B,Hq,Sq] (what a sink's gradient needs), less dstats where given.
    dstats: None, or the gradient of the stats fp32 [B,Hq,Sq] (the log-sum-exp returned as an output): it
    enters as delta - dstats, subtracted after the prep pass (d lse / d S = P).
    mode "fp8": the kernels read the FP8 operands and dequantize tiles in registers (least memory).
    mode "pre": per chunk of KV heads the streamed operands are first dequantized exactly to bf16 scratch
    (dO quantized chunk-wise, `bwd_prep`), then the kernels stream bf16 (same numbers, fewer ALU
    operations in the inner loops; at most about PRE_BUDGET_BYTES of scratch per chunk).
    config: optional ((BM, BN, warps, stages) of dK/dV, (BM, BN, warps, stages) of dQ) override (sweeps);
    every block size a multiple of 32 (dS is quantized in blocks of 32 inside a tile).
    seq, bottom_right: variable lengths as in `attention_fwd` (a packed batch's column-wise copies q_col,
    k_col, do_col are segmented; a padded batch's copies were quantized with the padding rows read as zeros).
    flags: the recipe's switches (`recipe_flags`); with flags.v_raw, v_row is V rounded to bf16 [B,Hkv,Skv,D]
    (unit stride along D), and do_row/do_col (mode "fp8") must have been quantized with flags.floor's rule.
    gluon_dkdv: optional module `gluon_attention_bwd` (Hopper): in mode "pre" its warp-specialised dK/dV kernel
    runs each chunk it takes (`takes`; same numbers), the Triton kernel the others. A packed batch runs both
    Gluon kernels on gapped scratch (`bwd_prep`'s gap) where both take it, else both Triton kernels.
    gluon_dq: likewise, optional module `gluon_attention_dq` (Hopper): in mode "pre" its warp-specialised dQ
    kernel runs each chunk it takes (`takes`; same numbers), the Triton dQ kernel the others. Neither runs with
    a config override (the Triton kernels' block sizes).
    """
    if mode not in ("fp8", "pre"):
        raise ValueError(f"mode must be 'fp8' or 'pre', got {mode!r}")
    B, HQ, SQ, D = q_row.data.shape
    HKV, SKV = k_row.data.shape[1], k_row.data.shape[2]
    group = HQ // HKV
    dp = padded_head_dim(D)
    for name, t in (("q_row", q_row), ("q_col", q_col), ("k_row", k_row), ("k_col", k_col), ("v_row", v_row),
                    ("do_row", do_row), ("do_col", do_col)):
        if t is None:
            if mode == "fp8":
                raise ValueError(f"{name} is required in mode 'fp8'")
            continue
        if name == "v_row" and flags.v_raw:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or t.shape != k_row.data.shape or \
                    t.stride(3) != 1:
                raise ValueError(f"with flags.v_raw, v_row must be a bf16 tensor of k_row's shape "
                                 f"{tuple(k_row.data.shape)} with unit stride along D")
            continue
        if t.data.stride(3) != 1 or t.scale.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along its last axis (data and scale)")
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along D")
    seq = check_seq(seq, q_row.data, k_row.data, bottom_right, offset)
    cu = kernel_cu_seqlens(seq, stats)  # (the full stats stand in for a dense call's lengths, in every launch)
    if seq is not None and seq.packed:
        for name, t in (("q_col", q_col), ("k_col", k_col), ("do_col", do_col)):
            if t is not None and getattr(t, "segments", None) is None:
                raise ValueError(f"{name} of a packed batch must be segmented (MXFP8Tensor segments=cu_seqlens)")
    (bm1, bn1, w1, st1), (bm2, bn2, w2, st2) = config if config is not None else _bwd_config(dp, mode)
    if min(bm1, bn1, bm2, bn2) < 32 or any(x % 32 for x in (bm1, bn1, bm2, bn2)):
        raise ValueError(f"backward block sizes must be multiples of 32, got {config}")
    if dstats is not None and (not isinstance(dstats, torch.Tensor) or dstats.dtype != torch.float32
                               or tuple(dstats.shape) != (B, HQ, SQ) or dstats.device != o.device):
        raise ValueError(f"dstats must be a float32 tensor of shape {(B, HQ, SQ)} on {o.device}")
    delta = torch.empty((B, HQ, SQ), dtype=torch.float32, device=o.device)
    lb = 0 if left_bound is None else int(left_bound)
    rb = 0 if right_bound is None else int(right_bound)
    common = dict(HAS_LB=left_bound is not None, HAS_RB=right_bound is not None, DP=dp, EVEN_D=dp == D,
                  **kernel_flags(seq, bottom_right))
    args = (group, SQ, SKV, D, float(softmax_scale) * LOG2E.value, float(softmax_scale), int(offset), lb, rb)
    cfg1, cfg2 = (bm1, bn1, w1, st1), (bm2, bn2, w2, st2)
    if mode == "fp8":  # delta alone first (the "pre" path gets it with its scratch)
        bwd_prep(o, do, None, None, delta, 0, HQ, seq, cu, scratch=False)
        if dstats is not None:
            delta.sub_(dstats)
        _launch_dkdv(q_row, q_col, k_row, v_row, do_row, do_col, stats, delta, dk, dv, cfg1, False, args, common,
                     seq, cu, flags)
        _launch_dq(q_row, k_row, k_col, v_row, do_row, stats, delta, dq, cfg2, False, args, common, seq, cu, flags)
        return delta
    packed = seq is not None and seq.packed
    # a packed batch's gapped scratch (the Gluon kernels) only where its gaps add at most the batch's own rows (many
    # short documents keep the packed scratch and the Triton kernels), its rows counted in the chunks' budget
    gap_rows = PACKED_GAP * grid_sequences(seq, B) if packed and config is None else 0
    if gap_rows > min(SQ, SKV):
        gap_rows = 0
    per_head = _pre_scratch_per_kv_head(B, group, SQ + gap_rows, SKV + gap_rows, D)
    sms = sm_count(o.device) if o.is_cuda else 132
    # heads for about two waves of programs
    want = cdiv(2 * sms, max(1, row_tiles(grid_rows(seq, "kv", SKV), bn1) * seq_programs(grid_sequences(seq, B), 1)))
    chunks = head_chunks(HKV, per_head, want)
    masks = dict(right_bound=right_bound, left_bound=left_bound, bottom_right=bottom_right, flags=flags)
    gap = _packed_gap(gluon_dkdv, gluon_dq, k_row, v_row, seq, group, max(h1 - h0 for h0, h1 in chunks), D,
                      **masks) if gap_rows else 0
    for h0, h1 in chunks:  # a loop over head chunks, not elements
        q0, q1 = h0 * group, h1 * group
        do_r, do_c, q_r, q_c = bwd_prep(o, do, q_row, q_col, delta, q0, q1, seq, cu, floor=flags.floor, gap=gap)
        st, de = stats[:, q0:q1], delta[:, q0:q1]
        if dstats is not None:
            de.sub_(dstats[:, q0:q1])
        k_h, v_h = _heads(k_row, h0, h1), _heads(v_row, h0, h1)
        if gap or (not packed and gluon_dkdv is not None and config is None and gluon_dkdv.takes(
                q_r, k_h, v_h, seq=seq, q_c=q_c, do_r=do_r, do_c=do_c, **masks)):
            gluon_dkdv.dkdv_gluon(q_r, q_c, k_h, v_h, do_r, do_c, st, de, dk[:, h0:h1], dv[:, h0:h1],
                                  softmax_scale=softmax_scale, offset=offset, left_bound=left_bound,
                                  right_bound=right_bound, seq=seq, bottom_right=bottom_right, flags=flags,
                                  checked=True)
        else:
            _launch_dkdv(q_r, q_c, k_h, v_h, do_r, do_c, st, de, dk[:, h0:h1], dv[:, h0:h1], cfg1, True, args,
                         common, seq, cu, flags)
        del q_c, do_c
        k_r, k_c, v_r = kv_prep(k_row, k_col, v_row, h0, h1, seq, cu, gap=gap)
        if gap or (not packed and gluon_dq is not None and config is None and gluon_dq.takes(
                q_r, k_r, k_c, v_r, do_r, seq=seq, **masks)):
            gluon_dq.dq_gluon(q_r, k_r, k_c, v_r, do_r, st, de, dq[:, q0:q1], softmax_scale=softmax_scale,
                              offset=offset, left_bound=left_bound, right_bound=right_bound, seq=seq,
                              bottom_right=bottom_right, flags=flags, checked=True)
        else:
            _launch_dq(q_r, k_r, k_c, v_r, do_r, st, de, dq[:, q0:q1], cfg2, True, args, common, seq, cu, flags)
        del q_r, do_r, k_r, k_c, v_r
    return delta


__all__ = ["attention_bwd", "head_chunks", "PRE_BUDGET_BYTES"]
