"""Triton MXFP8 attention backward (spec section 7), deterministic, no atomics.

Three launches:
  1. delta pre-pass: delta = rowsum(O * dO) in FP32 from the bf16/fp16 tensors.
  2. dK/dV kernel: one program per 128-row KV block and KV head; it walks the query heads of its GQA group
     in fixed order and, for each, the query blocks in ascending order, accumulating dK and dV in FP32
     registers. dS is quantized on the fly along s_q (blocks of 32) for dK = dS_c^T Q_col; P is quantized to
     E4M3 with the fixed scale 256 for dV = Pq^T dO_col.
  3. dQ kernel: one program per query block; it recomputes S, P, dP and quantizes dS along s_kv (blocks of 32)
     for dQ = dS_r K_col.
Every FP8 operand is dequantized exactly to BF16 in registers and multiplied with FP32 accumulation.
"""

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from .triton_launch import launch
from .triton_attention_fwd import kv_block_range
from .triton_quantize import dequant_cols, dequant_rows, qdq_rows

LOG2E = 1.4426950408889634


@triton.jit
def _delta_kernel(O, DO, DELTA, sob, soh, sos, sod, sdb, sdh, sds, sdd, HQ, SQ, D,
                  BM: tl.constexpr, DP: tl.constexpr):
    """delta[b*HQ + h, i] = sum_d O[b,h,i,d] * dO[b,h,i,d] in FP32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = (pid_bh % HQ).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, DP)
    mask = (offs_m < SQ)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sds + offs_d[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + pid_bh.to(tl.int64) * SQ + offs_m, delta, mask=offs_m < SQ)


@triton.jit
def _load_row_tile(ptr, sptr, rows, offs_d, offs_kb, s_r, s_sr, NR, D, R: tl.constexpr, DP: tl.constexpr,
                   RAW: tl.constexpr = False):
    """Row-wise MXFP8 tile: rows [R] of a [.., N, D] tensor with scales [.., N, D/32] -> bf16 [R, DP].
    RAW: ptr already holds the bf16 dequantization; load it as is."""
    rmask = rows < NR
    x = tl.load(ptr + rows[:, None] * s_r + offs_d[None, :], mask=rmask[:, None] & (offs_d < D)[None, :],
                other=0.0)
    if RAW:
        return x
    s = tl.load(sptr + rows[:, None] * s_sr + offs_kb[None, :], mask=rmask[:, None] & (offs_kb * 32 < D)[None, :],
                other=127)
    return dequant_rows(x, s, R, DP)


@triton.jit
def _load_col_tile(ptr, sptr, r0, offs_r, offs_d, s_r, s_sr, NR, D, R: tl.constexpr, DP: tl.constexpr,
                   RAW: tl.constexpr = False):
    """Column-wise MXFP8 tile: rows [r0, r0 + R) (r0 % 32 == 0) with scales [.., ceil(N/32), D] -> bf16.
    RAW: ptr already holds the bf16 dequantization; load it as is."""
    rows = r0 + offs_r
    x = tl.load(ptr + rows[:, None] * s_r + offs_d[None, :], mask=(rows < NR)[:, None] & (offs_d < D)[None, :],
                other=0.0)
    if RAW:
        return x
    blk = r0 // 32 + tl.arange(0, R // 32)
    s = tl.load(sptr + blk[:, None] * s_sr + offs_d[None, :], mask=(blk * 32 < NR)[:, None] & (offs_d < D)[None, :],
                other=127)
    return dequant_cols(x, s, R, DP)


@triton.jit
def _dkdv_block(dk, dv, k_dq, v_dq, m0, cols, offs_mb, offs_d, offs_kb,
                Qh, QSh, QCh, QCSh, DOh, DOSh, DOCh, DOCSh, LSEh, DELTAh,
                sqs, sqss, sqcs, sqcss, sdos, sdoss, sdocs, sdocss, sls,
                SQ, SKV, D, qk_scale, sm_scale, offset, LB, RB,
                MASK: tl.constexpr, HAS_LB: tl.constexpr, HAS_RB: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, PRE: tl.constexpr):
    rows = m0 + offs_mb
    rmask = rows < SQ
    q_dq = _load_row_tile(Qh, QSh, rows, offs_d, offs_kb, sqs, sqss, SQ, D, BM, DP, PRE)
    lse = tl.load(LSEh + rows * sls, mask=rmask, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    p_t = tl.math.exp2(tl.dot(k_dq, tl.trans(q_dq)) * qk_scale - lse[None, :])  # [BN, BM]
    if MASK:
        keep = (cols < SKV)[:, None] & rmask[None, :]
        if HAS_RB:
            keep = keep & (cols[:, None] <= rows[None, :] + offset + RB)
        if HAS_LB:
            keep = keep & (cols[:, None] > rows[None, :] + offset - LB)
        p_t = tl.where(keep, p_t, 0.0)
    do_c = _load_col_tile(DOCh, DOCSh, m0, offs_mb, offs_d, sdocs, sdocss, SQ, D, BM, DP, PRE)
    pq_t = (p_t * 256.0).to(tl.float8e4nv).to(tl.bfloat16)
    dv += tl.dot(pq_t, do_c)
    do_r = _load_row_tile(DOh, DOSh, rows, offs_d, offs_kb, sdos, sdoss, SQ, D, BM, DP, PRE)
    dp_t = tl.dot(v_dq, tl.trans(do_r))
    delta = tl.load(DELTAh + rows, mask=rmask, other=0.0)
    ds_t = p_t * (dp_t - delta[None, :]) * sm_scale
    ds_c = qdq_rows(ds_t, BN, BM)  # blocks of 32 along s_q
    q_c = _load_col_tile(QCh, QCSh, m0, offs_mb, offs_d, sqcs, sqcss, SQ, D, BM, DP, PRE)
    dk += tl.dot(ds_c, q_c)
    return dk, dv


@triton.jit
def _dkdv_kernel(
        Q, QS, QC, QCS, K, KS, V, VS, DO, DOS, DOC, DOCS, LSE, DELTA, DK, DV,
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
        BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, PRE: tl.constexpr):
    """Grid (cdiv(SKV, BN), B * HKV). All FP8 tensors have a unit stride along D."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    n0 = pid_n * BN
    cols = n0 + tl.arange(0, BN)
    offs_mb = tl.arange(0, BM)
    offs_d = tl.arange(0, DP)
    offs_kb = tl.arange(0, DP // 32)
    k_dq = _load_row_tile(K + b * skb + hk * skh, KS + b * sksb + hk * sksh, cols, offs_d, offs_kb, sks, skss,
                          SKV, D, BN, DP)
    v_dq = _load_row_tile(V + b * svb + hk * svh, VS + b * svsb + hk * svsh, cols, offs_d, offs_kb, svs, svss,
                          SKV, D, BN, DP)

    # query rows that see this KV block, and the query blocks that see all of it
    zero = pid_n * 0  # keeps every bound a run-time i32 (both branches of the `if`s below agree in type)
    lo = zero
    hi = zero + SQ
    full_lo = zero
    full_hi = zero + ((SQ + BM - 1) // BM) * BM
    if HAS_RB:
        lo = (tl.maximum(n0 - offset - RB, 0) // BM) * BM
        full_lo = ((tl.maximum(n0 + BN - 1 - offset - RB, 0) + BM - 1) // BM) * BM
    if HAS_LB:
        hi = tl.minimum(SQ, tl.maximum(n0 + BN - 1 - offset + LB, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(n0 - offset + LB - 1, 0) // BM) * BM)
    if n0 + BN > SKV:
        full_hi = zero
    full_lo = tl.maximum(full_lo, lo)
    if full_hi <= full_lo:
        full_lo = hi
        full_hi = hi
    mask_hi = tl.minimum(full_lo, hi)

    dk = tl.zeros([BN, DP], tl.float32)
    dv = tl.zeros([BN, DP], tl.float32)
    for g in range(0, GROUP):
        hq = hk * GROUP + g
        Qh = Q + b * sqb + hq * sqh
        QSh = QS + b * sqsb + hq * sqsh
        QCh = QC + b * sqcb + hq * sqch
        QCSh = QCS + b * sqcsb + hq * sqcsh
        DOh = DO + b * sdob + hq * sdoh
        DOSh = DOS + b * sdosb + hq * sdosh
        DOCh = DOC + b * sdocb + hq * sdoch
        DOCSh = DOCS + b * sdocsb + hq * sdocsh
        LSEh = LSE + b * slb + hq * slh
        DELTAh = DELTA + b * sdelb + hq * SQ
        for m0 in range(lo, mask_hi, BM):
            dk, dv = _dkdv_block(dk, dv, k_dq, v_dq, m0, cols, offs_mb, offs_d, offs_kb,
                                 Qh, QSh, QCh, QCSh, DOh, DOSh, DOCh, DOCSh, LSEh, DELTAh,
                                 sqs, sqss, sqcs, sqcss, sdos, sdoss, sdocs, sdocss, sls,
                                 SQ, SKV, D, qk_scale, sm_scale, offset, LB, RB,
                                 True, HAS_LB, HAS_RB, BM, BN, DP, PRE)
        for m0 in range(full_lo, full_hi, BM):
            dk, dv = _dkdv_block(dk, dv, k_dq, v_dq, m0, cols, offs_mb, offs_d, offs_kb,
                                 Qh, QSh, QCh, QCSh, DOh, DOSh, DOCh, DOCSh, LSEh, DELTAh,
                                 sqs, sqss, sqcs, sqcss, sdos, sdoss, sdocs, sdocss, sls,
                                 SQ, SKV, D, qk_scale, sm_scale, offset, LB, RB,
                                 False, HAS_LB, HAS_RB, BM, BN, DP, PRE)
        for m0 in range(tl.maximum(full_hi, mask_hi), hi, BM):
            dk, dv = _dkdv_block(dk, dv, k_dq, v_dq, m0, cols, offs_mb, offs_d, offs_kb,
                                 Qh, QSh, QCh, QCSh, DOh, DOSh, DOCh, DOCSh, LSEh, DELTAh,
                                 sqs, sqss, sqcs, sqcss, sdos, sdoss, sdocs, sdocss, sls,
                                 SQ, SKV, D, qk_scale, sm_scale, offset, LB, RB,
                                 True, HAS_LB, HAS_RB, BM, BN, DP, PRE)
    omask = (cols < SKV)[:, None] & (offs_d < D)[None, :]
    tl.store(DK + b * sdkb + hk * sdkh + cols[:, None] * sdks + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=omask)
    tl.store(DV + b * sdvb + hk * sdvh + cols[:, None] * sdvs + offs_d[None, :],
             (dv * (1.0 / 256.0)).to(DV.dtype.element_ty), mask=omask)


@triton.jit
def _dq_block(dq, q_dq, do_r, lse, delta, n0, offs_m, offs_n, offs_d, offs_kb,
              Kh, KSh, KCh, KCSh, Vh, VSh, sks, skss, skcs, skcss, svs, svss,
              SKV, D, qk_scale, sm_scale, offset, LB, RB,
              MASK: tl.constexpr, HAS_LB: tl.constexpr, HAS_RB: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, PRE: tl.constexpr):
    cols = n0 + offs_n
    k_dq = _load_row_tile(Kh, KSh, cols, offs_d, offs_kb, sks, skss, SKV, D, BN, DP, PRE)
    p = tl.math.exp2(tl.dot(q_dq, tl.trans(k_dq)) * qk_scale - lse[:, None])
    if MASK:
        keep = (cols < SKV)[None, :]
        if HAS_RB:
            keep = keep & (cols[None, :] <= offs_m[:, None] + offset + RB)
        if HAS_LB:
            keep = keep & (cols[None, :] > offs_m[:, None] + offset - LB)
        p = tl.where(keep, p, 0.0)
    v_dq = _load_row_tile(Vh, VSh, cols, offs_d, offs_kb, svs, svss, SKV, D, BN, DP, PRE)
    dp = tl.dot(do_r, tl.trans(v_dq))
    ds = p * (dp - delta[:, None]) * sm_scale
    ds_r = qdq_rows(ds, BM, BN)  # blocks of 32 along s_kv
    k_c = _load_col_tile(KCh, KCSh, n0, offs_n, offs_d, skcs, skcss, SKV, D, BN, DP, PRE)
    dq += tl.dot(ds_r, k_c)
    return dq


@triton.jit
def _dq_kernel(
        Q, QS, K, KS, KC, KCS, V, VS, DO, DOS, LSE, DELTA, DQ,
        sqb, sqh, sqs, sqsb, sqsh, sqss,
        skb, skh, sks, sksb, sksh, skss,
        skcb, skch, skcs, skcsb, skcsh, skcss,
        svb, svh, svs, svsb, svsh, svss,
        sdob, sdoh, sdos, sdosb, sdosh, sdoss,
        slb, slh, sls, sdelb, sdqb, sdqh, sdqs,
        HQ, GROUP, SQ, SKV, D, qk_scale, sm_scale, offset, LB, RB,
        HAS_LB: tl.constexpr, HAS_RB: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, PRE: tl.constexpr):
    """Grid (cdiv(SQ, BM), B * HQ)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    hq = (pid_bh % HQ).to(tl.int64)
    hk = hq // GROUP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, DP)
    offs_kb = tl.arange(0, DP // 32)
    rmask = offs_m < SQ
    q_dq = _load_row_tile(Q + b * sqb + hq * sqh, QS + b * sqsb + hq * sqsh, offs_m, offs_d, offs_kb, sqs, sqss,
                          SQ, D, BM, DP, PRE)
    do_r = _load_row_tile(DO + b * sdob + hq * sdoh, DOS + b * sdosb + hq * sdosh, offs_m, offs_d, offs_kb,
                          sdos, sdoss, SQ, D, BM, DP, PRE)
    lse = tl.load(LSE + b * slb + hq * slh + offs_m * sls, mask=rmask, other=float("inf")) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + b * sdelb + hq * SQ + offs_m, mask=rmask, other=0.0)
    Kh = K + b * skb + hk * skh
    KSh = KS + b * sksb + hk * sksh
    KCh = KC + b * skcb + hk * skch
    KCSh = KCS + b * skcsb + hk * skcsh
    Vh = V + b * svb + hk * svh
    VSh = VS + b * svsb + hk * svsh

    lo, mask_hi, full_lo, full_hi, hi = kv_block_range(m0, SKV, offset, LB, RB, HAS_LB, HAS_RB, BM, BN)

    dq = tl.zeros([BM, DP], tl.float32)
    for n0 in range(lo, mask_hi, BN):
        dq = _dq_block(dq, q_dq, do_r, lse, delta, n0, offs_m, offs_n, offs_d, offs_kb,
                       Kh, KSh, KCh, KCSh, Vh, VSh, sks, skss, skcs, skcss, svs, svss,
                       SKV, D, qk_scale, sm_scale, offset, LB, RB, True, HAS_LB, HAS_RB, BM, BN, DP, PRE)
    for n0 in range(full_lo, full_hi, BN):
        dq = _dq_block(dq, q_dq, do_r, lse, delta, n0, offs_m, offs_n, offs_d, offs_kb,
                       Kh, KSh, KCh, KCSh, Vh, VSh, sks, skss, skcs, skcss, svs, svss,
                       SKV, D, qk_scale, sm_scale, offset, LB, RB, False, HAS_LB, HAS_RB, BM, BN, DP, PRE)
    for n0 in range(tl.maximum(full_hi, mask_hi), hi, BN):
        dq = _dq_block(dq, q_dq, do_r, lse, delta, n0, offs_m, offs_n, offs_d, offs_kb,
                       Kh, KSh, KCh, KCSh, Vh, VSh, sks, skss, skcs, skcss, svs, svss,
                       SKV, D, qk_scale, sm_scale, offset, LB, RB, True, HAS_LB, HAS_RB, BM, BN, DP, PRE)
    tl.store(DQ + b * sdqb + hq * sdqh + offs_m[:, None] * sdqs + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=rmask[:, None] & (offs_d < D)[None, :])


def _bwd_config(dp: int):
    """((dkdv BM, BN, warps, stages), (dq BM, BN, warps, stages)) for padded head dim dp."""
    if dp <= 128:
        return (64, 128, 8, 2), (128, 64, 8, 2)
    return (32, 64, 8, 1), (64, 32, 8, 1)


def _st3(t):
    return tuple(t.stride()[:3])


def _op(t):
    """(data, scale-bytes) of an MXFP8Tensor, or (t, t) for a bf16 tensor that already holds the
    dequantization (the scale argument is then unused)."""
    if isinstance(t, torch.Tensor):
        return t, t
    return t.data, t.scale.view(torch.uint8)


def _launch_dkdv(qr, qc, kr, vr, dor, doc, stats, delta, dk, dv, cfg, pre, args, common):
    (bm1, bn1, w1, st1) = cfg
    B, HKV, SKV = kr.data.shape[0], kr.data.shape[1], kr.data.shape[2]
    ops = [_op(t) for t in (qr, qc, kr, vr, dor, doc)]
    flat = [x for pair in ops for x in pair]
    strides = [st for pair in ops for x in pair for st in _st3(x)]
    launch(
        _dkdv_kernel, (triton.cdiv(SKV, bn1), B * HKV),
        *flat, stats, delta, dk, dv, *strides, *_st3(stats), delta.stride(0), *_st3(dk), *_st3(dv),
        HKV, *args, BM=bm1, BN=bn1, PRE=pre, num_warps=w1, num_stages=st1, **common)


def _launch_dq(qr, kr, kc, vr, dor, stats, delta, dq, cfg, pre, args, common):
    (bm2, bn2, w2, st2) = cfg
    qd = qr if isinstance(qr, torch.Tensor) else qr.data
    B, HQ, SQ = qd.shape[0], qd.shape[1], qd.shape[2]
    ops = [_op(t) for t in (qr, kr, kc, vr, dor)]
    flat = [x for pair in ops for x in pair]
    strides = [st for pair in ops for x in pair for st in _st3(x)]
    launch(
        _dq_kernel, (triton.cdiv(SQ, bm2), B * HQ),
        *flat, stats, delta, dq, *strides, *_st3(stats), delta.stride(0), *_st3(dq),
        HQ, *args, BM=bm2, BN=bn2, PRE=pre, num_warps=w2, num_stages=st2, **common)


def _heads(t, h0: int, h1: int):
    """Head slice [h0, h1) of an MXFP8Tensor (data and scale views, no copy)."""
    return SimpleNamespace(data=t.data[:, h0:h1], scale=t.scale[:, h0:h1], axis=t.axis)


#: upper bound on the bf16 scratch (dequantized operands) one head chunk of the "pre" backward may hold
PRE_BUDGET_BYTES = 128 << 20


def attention_bwd(q_row, q_col, k_row, k_col, v_row, do_row, do_col, o, do, stats, *, softmax_scale: float,
                  offset: int, left_bound, right_bound, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                  config=None, mode: str = "fp8") -> None:
    """Launch delta pre-pass, dK/dV kernel and dQ kernel.

    q_row, q_col: MXFP8Tensor [B,Hq,Sq,D] (row: scales [B,H,S,ceil(D/32)], col: scales [B,H,ceil(S/32),D]);
    k_row, k_col, v_row: MXFP8Tensor [B,Hkv,Skv,D]; do_row, do_col: MXFP8Tensor of dO (mode "fp8"; None
    allowed in mode "pre"); o, do [B,Hq,Sq,D] bf16/fp16; stats [B,Hq,Sq,1] fp32.
    Writes dq [B,Hq,Sq,D], dk, dv [B,Hkv,Skv,D] (unit stride along D).
    mode "fp8": the kernels read the FP8 operands and dequantize tiles in registers (least memory).
    mode "pre": per chunk of KV heads the streamed operands are first dequantized exactly to bf16 scratch
    (dO quantized chunk-wise by the fused quantizer), then the kernels stream bf16 (same numbers, fewer ALU
    operations in the inner loops; at most about PRE_BUDGET_BYTES of scratch per chunk).
    config: optional ((BM, BN, warps, stages) of dK/dV, (BM, BN, warps, stages) of dQ) override (sweeps);
    every block size a multiple of 32 (dS is quantized in blocks of 32 inside a tile).
    """
    if mode not in ("fp8", "pre"):
        raise ValueError(f"mode must be 'fp8' or 'pre', got {mode!r}")
    B, HQ, SQ, D = q_row.data.shape
    HKV, SKV = k_row.data.shape[1], k_row.data.shape[2]
    group = HQ // HKV
    dp = max(32, triton.next_power_of_2(D))
    for name, t in (("q_row", q_row), ("q_col", q_col), ("k_row", k_row), ("k_col", k_col), ("v_row", v_row),
                    ("do_row", do_row), ("do_col", do_col)):
        if t is None:
            if mode == "fp8":
                raise ValueError(f"{name} is required in mode 'fp8'")
            continue
        if t.data.stride(3) != 1 or t.scale.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along its last axis (data and scale)")
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along D")
    (bm1, bn1, w1, st1), (bm2, bn2, w2, st2) = config if config is not None else _bwd_config(dp)
    if min(bm1, bn1, bm2, bn2) < 32 or any(x % 32 for x in (bm1, bn1, bm2, bn2)):
        raise ValueError(f"backward block sizes must be multiples of 32, got {config}")
    delta = torch.empty((B, HQ, SQ), dtype=torch.float32, device=o.device)
    launch(_delta_kernel, (triton.cdiv(SQ, 64), B * HQ), o, do, delta, *o.stride(), *do.stride(), HQ, SQ, D,
           BM=64, DP=dp, num_warps=4)
    lb = 0 if left_bound is None else int(left_bound)
    rb = 0 if right_bound is None else int(right_bound)
    common = dict(HAS_LB=left_bound is not None, HAS_RB=right_bound is not None, DP=dp)
    args = (group, SQ, SKV, D, float(softmax_scale) * LOG2E, float(softmax_scale), int(offset), lb, rb)
    cfg1, cfg2 = (bm1, bn1, w1, st1), (bm2, bn2, w2, st2)
    if mode == "fp8":
        _launch_dkdv(q_row, q_col, k_row, v_row, do_row, do_col, stats, delta, dk, dv, cfg1, False, args, common)
        _launch_dq(q_row, k_row, k_col, v_row, do_row, stats, delta, dq, cfg2, False, args, common)
        return
    from .triton_quantize import dequantize_bf16, quantize_rowcol
    # scratch bytes per KV head: dK/dV phase holds 4 q-side bf16 operands (+ FP8 dO temporaries)
    per_head = max(B * group * SQ * D * 10, B * (group * SQ * 4 + SKV * 6) * D)
    sms = torch.cuda.get_device_properties(o.device).multi_processor_count if o.is_cuda else 132
    want = triton.cdiv(2 * sms, max(1, triton.cdiv(SKV, bn1) * B))  # heads for about two waves of programs
    hc = max(1, min(HKV, max(want, PRE_BUDGET_BYTES // max(1, per_head))))
    if hc * per_head > 4 * PRE_BUDGET_BYTES:
        hc = max(1, (4 * PRE_BUDGET_BYTES) // per_head)
    for h0 in range(0, HKV, hc):  # a loop over head chunks, not elements
        h1 = min(HKV, h0 + hc)
        q0, q1 = h0 * group, h1 * group
        dq_ = quantize_rowcol(do[:, q0:q1], row_dequant=True, col_dequant=True)
        do_r, do_c = dq_.row_dequant, dq_.col_dequant
        del dq_
        q_r = dequantize_bf16(_heads(q_row, q0, q1))
        q_c = dequantize_bf16(_heads(q_col, q0, q1))
        st, de = stats[:, q0:q1], delta[:, q0:q1]
        _launch_dkdv(q_r, q_c, _heads(k_row, h0, h1), _heads(v_row, h0, h1), do_r, do_c, st, de,
                     dk[:, h0:h1], dv[:, h0:h1], cfg1, True, args, common)
        del q_c, do_c
        k_r = dequantize_bf16(_heads(k_row, h0, h1))
        k_c = dequantize_bf16(_heads(k_col, h0, h1))
        v_r = dequantize_bf16(_heads(v_row, h0, h1))
        _launch_dq(q_r, k_r, k_c, v_r, do_r, st, de, dq[:, q0:q1], cfg2, True, args, common)
        del q_r, do_r, k_r, k_c, v_r


__all__ = ["attention_bwd"]
