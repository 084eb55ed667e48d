"""Fused Triton MXFP8 quantizer, and the device helpers the attention kernels share.

`quantize_rowcol` reads a bf16/fp16/fp32 [B, H, S, D] tensor once (any strides) and writes row-wise (blocks of
32 along D) and column-wise (blocks of 32 along S) E4M3 data with compact E8M0 scales, and on request the
scales in F8_128x4 order too. The `@triton.jit` helpers below (E8M0 arithmetic, tile dequantization and
quantize-dequantize) are used by the forward and backward kernels as well.

Scale rule (spec section 2, round-up): ``e = biased_exponent(amax / 448) + (mantissa != 0)``, clamped to
[0, 254]; ``e = 0`` when ``amax / 448 <= 2^-127``; ``e = 255`` for NaN (the whole block becomes NaN).
Elements: ``RNE_saturate_E4M3(x * 2^(127 - e))`` (the hardware conversion saturates to +-448).
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .triton_launch import launch


@triton.jit
def scale_exponent_from_bits(abits):
    """Bits (int32) of amax = max |x| (NaN patterns compare above inf) -> E8M0 biased exponent, int32.

    Division-free: for FP32 amax = M * 2^E, RN(amax / 448) <= 2^k exactly when amax <= 448 * 2^k (the next FP32
    above 448 * 2^k already exceeds the rounding threshold 448 * 2^k * (1 + 2^-24)), so the round-up exponent
    is E - 8 when M <= 1.75 (mantissa field <= 0x600000) and E - 7 otherwise; clamped to [0, 254]. inf gives
    254, NaN 255. Identical to the rule on exponent(RN(amax / 448)) for every BF16/FP16 amax; for FP32 amax it
    differs only at the single value 1.75 * 2^-119 + 2^-142 (a subnormal quotient).
    """
    expo = (abits >> 23) & 0xFF
    mant = abits & 0x7FFFFF
    e = tl.minimum(tl.maximum(expo - 8 + (mant > 0x600000).to(tl.int32), 0), 254)
    e = tl.where(expo == 255, tl.where(mant != 0, 255, 254), e)
    return e


@triton.jit
def block_amax_bits(x, axis: tl.constexpr):
    """Bits of max |x| along `axis` as int32: an integer max of the sign-cleared bit patterns, so a NaN
    (pattern above inf) wins, unlike tl.max on floats."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=axis)


@triton.jit
def pow2_of_biased(e):
    """int32 tile e in [0, 254] -> fp32 2^(e - 127) (exact, 2^-127 as a subnormal)."""
    bits = tl.where(e == 0, 0x400000, e << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def inv_pow2_of_biased(e):
    """int32 tile e in [0, 254] -> fp32 2^(127 - e) (exact; e = 254 gives 2^-127 as a subnormal)."""
    bits = tl.where(e >= 254, 0x400000, (254 - e) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2_of_biased_bf16(s):
    """uint8 tile of E8M0 bytes (0..254) -> bf16 2^(e - 127) (exact; byte 0 gives the subnormal 2^-127)."""
    e = s.to(tl.int16)
    bits = tl.where(e == 0, 0x40, e << 7).to(tl.int16)
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def dequant_rows(x, s, R: tl.constexpr, C: tl.constexpr):
    """x fp8 [R, C] with E8M0 bytes s (uint8) [R, C // 32] along axis 1 -> bf16 [R, C].

    E4M3 -> BF16 is exact and so is the product with a power of two in BF16 (BF16 has FP32's exponent range;
    only results below 2^-126 lose bits, the spec's section 8 caveat)."""
    y = tl.reshape(x.to(tl.bfloat16), (R, C // 32, 32)) * pow2_of_biased_bf16(s)[:, :, None]
    return tl.reshape(y, (R, C))


@triton.jit
def dequant_cols(x, s, R: tl.constexpr, C: tl.constexpr):
    """x fp8 [R, C] with E8M0 bytes s (uint8) [R // 32, C] along axis 0 -> bf16 [R, C] (as dequant_rows)."""
    y = tl.reshape(x.to(tl.bfloat16), (R // 32, 32, C)) * pow2_of_biased_bf16(s)[:, None, :]
    return tl.reshape(y, (R, C))


@triton.jit
def qdq_rows(x, R: tl.constexpr, C: tl.constexpr):
    """fp32 [R, C] -> MXFP8 (E4M3, blocks of 32 along axis 1) and back, as bf16 [R, C]."""
    x3 = tl.reshape(x, (R, C // 32, 32))
    e = scale_exponent_from_bits(block_amax_bits(x3, 2))
    q = (x3 * inv_pow2_of_biased(e)[:, :, None]).to(tl.float8e4nv)
    y = q.to(tl.float32) * pow2_of_biased(e)[:, :, None]
    return tl.reshape(y, (R, C)).to(tl.bfloat16)


@triton.jit
def _swizzle_offset(m, k, KP):
    """Byte offset of (m, k) inside one F8_128x4 slab whose padded column count is KP (spec section 4)."""
    return ((m // 128) * (KP // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


@triton.jit
def _quantize_rowcol_kernel(
        X, sxb, sxh, sxs, sxd,
        QR, sqrb, sqrh, sqrs, sqrd, SR,
        QC, sqcb, sqch, sqcs, sqcd, SC,
        SRZ, SCZ, RDQ, CDQ,
        H, S, D, NR, NC, SRZ_KP, SRZ_SLAB, SCZ_KP, SCZ_SLAB,
        BS: tl.constexpr, BD: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, SWZ: tl.constexpr,
        ROW_DQ: tl.constexpr, COL_DQ: tl.constexpr):
    """One [BS, BD] tile of x read once -> row-wise and/or column-wise E4M3 data and E8M0 scales, and on
    request their exact BF16 dequantizations (contiguous [B, H, S, D]) for kernels that stream BF16."""
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_s = pid_s * BS + tl.arange(0, BS)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask = (offs_s < S)[:, None] & (offs_d < D)[None, :]
    x = tl.load(X + b * sxb + h * sxh + offs_s[:, None] * sxs + offs_d[None, :] * sxd, mask=mask,
                other=0.0).to(tl.float32)
    if ROW:
        x3 = tl.reshape(x, (BS, BD // 32, 32))
        e = scale_exponent_from_bits(block_amax_bits(x3, 2))
        y = tl.where((e == 255)[:, :, None], float("nan"), x3 * inv_pow2_of_biased(e)[:, :, None])
        q = tl.reshape(y.to(tl.float8e4nv), (BS, BD))
        tl.store(QR + b * sqrb + h * sqrh + offs_s[:, None] * sqrs + offs_d[None, :] * sqrd, q, mask=mask)
        if ROW_DQ:
            dq = tl.reshape(tl.reshape(q.to(tl.bfloat16), (BS, BD // 32, 32)) *
                            pow2_of_biased_bf16(e.to(tl.uint8))[:, :, None], (BS, BD))
            tl.store(RDQ + (pid_bh.to(tl.int64) * S + offs_s[:, None]) * D + offs_d[None, :], dq, mask=mask)
        offs_k = pid_d * (BD // 32) + tl.arange(0, BD // 32)
        smask = (offs_s < S)[:, None] & (offs_k < NR)[None, :]
        tl.store(SR + (pid_bh.to(tl.int64) * S + offs_s[:, None]) * NR + offs_k[None, :], e.to(tl.uint8),
                 mask=smask)
        if SWZ:
            off = _swizzle_offset(offs_s[:, None], offs_k[None, :], SRZ_KP)
            tl.store(SRZ + pid_bh.to(tl.int64) * SRZ_SLAB + off, e.to(tl.uint8), mask=smask)
    if COL:
        x3 = tl.reshape(x, (BS // 32, 32, BD))
        e = scale_exponent_from_bits(block_amax_bits(x3, 1))
        y = tl.where((e == 255)[:, None, :], float("nan"), x3 * inv_pow2_of_biased(e)[:, None, :])
        q = tl.reshape(y.to(tl.float8e4nv), (BS, BD))
        tl.store(QC + b * sqcb + h * sqch + offs_s[:, None] * sqcs + offs_d[None, :] * sqcd, q, mask=mask)
        if COL_DQ:
            dq = tl.reshape(tl.reshape(q.to(tl.bfloat16), (BS // 32, 32, BD)) *
                            pow2_of_biased_bf16(e.to(tl.uint8))[:, None, :], (BS, BD))
            tl.store(CDQ + (pid_bh.to(tl.int64) * S + offs_s[:, None]) * D + offs_d[None, :], dq, mask=mask)
        offs_j = pid_s * (BS // 32) + tl.arange(0, BS // 32)
        smask = (offs_j < NC)[:, None] & (offs_d < D)[None, :]
        tl.store(SC + (pid_bh.to(tl.int64) * NC + offs_j[:, None]) * D + offs_d[None, :], e.to(tl.uint8),
                 mask=smask)
        if SWZ:
            off = _swizzle_offset(offs_d[None, :], offs_j[:, None], SCZ_KP)
            tl.store(SCZ + pid_bh.to(tl.int64) * SCZ_SLAB + off, e.to(tl.uint8), mask=smask)


_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RowColQuantized(NamedTuple):
    """What `quantize_rowcol` returns; entries not asked for are None.

    row / col: mxattn.formats.MXFP8Tensor (axis 3 / axis 2, compact E8M0 scales).
    row_swizzled: uint8-compatible E8M0 [B, H, Sp, ceil(ceil(D/32)/4)*4] in F8_128x4 order.
    col_swizzled: E8M0 [B, H, ceil(D/128)*128, ceil(ceil(S/32)/4)*4] in F8_128x4 order (M = D, K = S blocks).
    row_dequant / col_dequant: contiguous bf16 [B, H, S, D], the exact dequantization of row / col.
    """

    row: Optional[object]
    col: Optional[object]
    row_swizzled: Optional[torch.Tensor]
    col_swizzled: Optional[torch.Tensor]
    row_dequant: Optional[torch.Tensor] = None
    col_dequant: Optional[torch.Tensor] = None


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _data_like(x: torch.Tensor) -> torch.Tensor:
    """FP8 tensor with x's strides when x is dense, else contiguous (the MXFP8Tensor data convention)."""
    if x.is_contiguous() or _is_dense(x):
        return torch.empty_like(x, dtype=torch.float8_e4m3fn, memory_format=torch.preserve_format)
    return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)


def _is_dense(x: torch.Tensor) -> bool:
    """True when x's elements exactly fill a storage block of numel elements (any dimension order)."""
    order = sorted(range(x.dim()), key=lambda i: x.stride(i))
    expected = 1
    for i in order:
        if x.shape[i] != 1 and x.stride(i) != expected:
            return False
        expected *= x.shape[i]
    return True


#: (BLOCK_S, num_warps, max BLOCK_D) of the quantizer (fastest of a sweep on an H200). Small tiles keep registers low
#: (about 90 per thread), so many programs are resident per SM to hide memory latency.
QUANT_TILE = (32, 2, 64)


def quantize_rowcol(x: torch.Tensor, *, row: bool = True, col: bool = True, swizzle: bool = False,
                    row_dequant: bool = False, col_dequant: bool = False, tile=None) -> RowColQuantized:
    """Fused MXFP8 quantizer: x [B, H, S, D] bf16/fp16/fp32 (any strides, CUDA) read once ->
    row-wise (blocks of 32 along D) and/or column-wise (blocks of 32 along S) E4M3 data with compact E8M0
    scales, and on request the scales also in F8_128x4 order and the exact bf16 dequantizations.
    Bit-identical to mxattn.quantize_mxfp8. tile: optional (BLOCK_S multiple of 32, num_warps[, max BLOCK_D])
    override."""
    from ..checks import check_bhsd_tensor
    from ..formats import MXFP8Tensor

    check_bhsd_tensor(x, "x", _IN_DTYPES, "cuda")
    if not (row or col):
        raise ValueError("quantize_rowcol: at least one of row, col must be True")
    if (row_dequant and not row) or (col_dequant and not col):
        raise ValueError("quantize_rowcol: row_dequant needs row=True and col_dequant needs col=True")
    B, H, S, D = x.shape
    nr, nc = _cdiv(D, 32), _cdiv(S, 32)
    dev = x.device
    # pointers of outputs not asked for are never dereferenced (their stores sit under false constexprs), so
    # an existing tensor stands in for them instead of fresh allocations (host time per call matters here)
    qr = _data_like(x) if row else None
    sr = torch.empty((B, H, S, nr), dtype=torch.uint8, device=dev) if row else None
    qc = _data_like(x) if col else qr
    sc = torch.empty((B, H, nc, D), dtype=torch.uint8, device=dev) if col else sr
    qr = qc if qr is None else qr
    sr = sc if sr is None else sr
    srz_kp, scz_kp = _cdiv(nr, 4) * 4, _cdiv(nc, 4) * 4
    srz_slab, scz_slab = _cdiv(S, 128) * 128 * srz_kp, _cdiv(D, 128) * 128 * scz_kp
    srz = torch.zeros((B, H, _cdiv(S, 128) * 128, srz_kp), dtype=torch.uint8, device=dev) \
        if (swizzle and row) else sr
    scz = torch.zeros((B, H, _cdiv(D, 128) * 128, scz_kp), dtype=torch.uint8, device=dev) \
        if (swizzle and col) else sc
    rdq = torch.empty((B, H, S, D), dtype=torch.bfloat16, device=dev) if row_dequant else None
    cdq = torch.empty((B, H, S, D), dtype=torch.bfloat16, device=dev) if col_dequant else None
    if x.numel() > 0:
        bs, warps, *bd_ = tile if tile is not None else QUANT_TILE
        if bs < 32 or bs % 32:
            raise ValueError(f"tile BLOCK_S must be a positive multiple of 32, got {bs}")
        bd = min(bd_[0] if bd_ else 128, max(32, triton.next_power_of_2(D)))
        grid = (_cdiv(S, bs), _cdiv(D, bd), B * H)
        qr_st = qr.stride() if row else (0, 0, 0, 0)
        qc_st = qc.stride() if col else (0, 0, 0, 0)
        launch(_quantize_rowcol_kernel, grid,
               x, *x.stride(), qr, *qr_st, sr, qc, *qc_st, sc, srz, scz, x if rdq is None else rdq,
               x if cdq is None else cdq, H, S, D, nr, nc, srz_kp, srz_slab, scz_kp, scz_slab,
               BS=bs, BD=bd, ROW=row, COL=col, SWZ=swizzle, ROW_DQ=row_dequant, COL_DQ=col_dequant,
               num_warps=warps)
    e8 = torch.float8_e8m0fnu
    return RowColQuantized(
        MXFP8Tensor(qr, sr.view(e8), 3) if row else None,
        MXFP8Tensor(qc, sc.view(e8), 2) if col else None,
        srz.view(e8) if (swizzle and row) else None,
        scz.view(e8) if (swizzle and col) else None,
        rdq if row_dequant else None,
        cdq if col_dequant else None)


@triton.jit
def _dequant_kernel(X, sxb, sxh, sxs, S_, ssb, ssh, sss, Y, H, S, D,
                    AXIS_ROW: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
    """MXFP8 tile (row-wise: scales [.., S, D/32]; column-wise: scales [.., S/32, D]) -> bf16 Y [B*H, S, D]."""
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_s = pid_s * BS + tl.arange(0, BS)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask = (offs_s < S)[:, None] & (offs_d < D)[None, :]
    x = tl.load(X + b * sxb + h * sxh + offs_s[:, None] * sxs + offs_d[None, :], mask=mask, other=0.0)
    if AXIS_ROW:
        offs_k = pid_d * (BD // 32) + tl.arange(0, BD // 32)
        sc = tl.load(S_ + b * ssb + h * ssh + offs_s[:, None] * sss + offs_k[None, :],
                     mask=(offs_s < S)[:, None] & (offs_k * 32 < D)[None, :], other=127)
        y = dequant_rows(x, sc, BS, BD)
    else:
        offs_j = pid_s * (BS // 32) + tl.arange(0, BS // 32)
        sc = tl.load(S_ + b * ssb + h * ssh + offs_j[:, None] * sss + offs_d[None, :],
                     mask=(offs_j * 32 < S)[:, None] & (offs_d < D)[None, :], other=127)
        y = dequant_cols(x, sc, BS, BD)
    tl.store(Y + (pid_bh.to(tl.int64) * S + offs_s[:, None]) * D + offs_d[None, :], y, mask=mask)


def dequantize_bf16(t, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MXFP8Tensor [B, H, S, D] (axis 3 row-wise or axis 2 column-wise, unit stride along D) -> contiguous
    bf16 [B, H, S, D], the exact dequantization the attention kernels use (bf16 products by powers of two).
    out: optional contiguous bf16 buffer of that shape to write into."""
    B, H, S, D = t.data.shape
    if t.axis not in (2, 3):
        raise ValueError(f"t.axis must be 2 or 3 for a [B, H, S, D] tensor, got {t.axis}")
    if t.data.stride(3) != 1:
        raise ValueError("t.data must have unit stride along D")
    y = out if out is not None else torch.empty((B, H, S, D), dtype=torch.bfloat16, device=t.data.device)
    if t.data.numel() == 0:
        return y
    sc = t.scale.view(torch.uint8)
    bd = min(128, max(32, triton.next_power_of_2(D)))
    grid = (_cdiv(S, 32), _cdiv(D, bd), B * H)
    launch(_dequant_kernel, grid, t.data, *t.data.stride()[:3], sc, *sc.stride()[:3], y, H, S, D,
           AXIS_ROW=t.axis == 3, BS=32, BD=bd, num_warps=4)
    return y
