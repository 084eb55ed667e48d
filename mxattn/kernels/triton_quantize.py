"""Fused Triton MXFP8 quantizer (the device helpers it shares with the attention kernels: `triton_common`).

`quantize_rowcol` reads a bf16/fp16/fp32 [B, H, S, D] tensor once (any strides) and writes row-wise (blocks of
32 along D) and column-wise (blocks of 32 along S) E4M3 data with compact E8M0 scales, and on request the
scales in F8_128x4 order too. The `@triton.jit` helpers below (E8M0 arithmetic, tile dequantization and
quantize-dequantize, in `triton_common`) are used by the forward and backward kernels as well.

Scale rule (spec section 2, round-up): ``e = biased_exponent(amax / 448) + (mantissa != 0)``, clamped to
[0, 254]; ``e = 0`` when ``amax / 448 <= 2^-127``; ``e = 255`` for NaN (the whole block becomes NaN).
Elements: ``RNE_saturate_E4M3(x * 2^(127 - e))`` (the hardware conversion saturates to +-448).

Variable lengths (`seq_span`): with ``cu_seqlens`` a padded batch ([B, H, S, D], sequence b = rows
``0 .. len_b`` of batch b) is quantized with the rows past each length read as zeros, and a packed one
([1, H, T, D], sequence b = rows ``cu[b] .. cu[b+1]``) has its column-wise blocks restarting at every sequence
start, the column scales being [1, H, T // 32 + B, D] with sequence b's blocks from row ``cu[b] // 32 + b``
(`mxattn.formats.segment_block_start`; unused rows hold byte 0).
"""

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..checks import check_bhsd_tensor
from ..formats import MXFP8Tensor
from ..layouts import empty_bhsd
from ..seqinfo import covered_rows
from ..runtime.triton_launch import cdiv, launch, pow2_ceil
from ..constants import INPUT_DTYPES
from .triton_common import (  # noqa: F401 -- the shared helpers, also importable from here
    LN2, LOG2_P_SCALE, LOG2E, MX_BLOCK, P_DESCALE, P_SCALE, block_amax_bits, dequant_cols, dequant_factors_bf16,
    dequant_rows, e4m3_to_bf16_biased, inv_pow2_of_biased, pow2_of_biased, qdq_rows, quantize_cols, quantize_rows,
    round_p_to_bf16, scale_exponent_from_bits, seq_span)





@triton.jit
def _swizzle_offset(m, k, KP):
    """Byte offset of (m, k) inside one F8_128x4 slab whose padded column count is KP (spec section 4)."""
    return ((m // 128) * (KP // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


#: how many of `_quantize_tile`'s run-time arguments the fused Q/K/V launch passes per tensor: all but the six
#: of the swizzled scales, which it does not write
TILE_ARGS_NO_SWIZZLE = 25


@triton.jit
def _quantize_tile(
        pid_s, pid_d, pid_bh,
        X, sxb, sxh, sxs, sxd,
        QR, sqrb, sqrh, sqrs, sqrd, SR,
        QC, sqcb, sqch, sqcs, sqcd, SC,
        RDQ, CDQ, CU, H, S, D, NR, NC,
        SRZ, SCZ, SRZ_KP, SRZ_SLAB, SCZ_KP, SCZ_SLAB,
        BS: tl.constexpr, BD: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, SWZ: tl.constexpr,
        ROW_DQ: tl.constexpr, COL_DQ: tl.constexpr, VARLEN: tl.constexpr, PACKED: tl.constexpr,
        COL_SEQ_MAJOR: tl.constexpr, FLOOR: tl.constexpr):
    """Tile (pid_s, pid_d) of sequence * head pid_bh: a [BS, BD] tile of x read once -> row-wise and/or
    column-wise E4M3 data and E8M0 scales, and on request their exact BF16 dequantizations (contiguous
    [B, H, S, D]; the backward's bf16 scratch). offs_s are rows of the program's sequence (`seq_span`).
    COL_SEQ_MAJOR: the column-wise data goes to QC = [B, H, D, L] (strides sqc*: unit along L) with sequence row
    n at column blk0 * 32 + n, zeros up to the end of its last block (`SeqMajorColumns`). FLOOR: the OCP scale
    rule (`Recipe.scale_rounding="floor"`)."""
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    bt, start, length, blk0 = seq_span(CU, b, S, VARLEN, PACKED)
    # rows written: a packed program owns its sequence's rows only; a padded one writes zeros on padding
    if PACKED:
        n_out = length
    else:
        n_out = S
    if pid_s * BS >= n_out:  # past the rows to write (a grid sized for a longer tensor, or sequence)
        return
    slab = (bt * H + h) * S + start  # first row of (bt, h) in the contiguous [B, H, S, *] outputs
    offs_s = pid_s * BS + tl.arange(0, BS)
    offs_d = pid_d * BD + tl.arange(0, BD)
    dmask = (offs_d < D)[None, :]
    mask = (offs_s < n_out)[:, None] & dmask
    x = tl.load(X + bt * sxb + h * sxh + start * sxs + offs_s[:, None] * sxs + offs_d[None, :] * sxd,
                mask=(offs_s < length)[:, None] & dmask, other=0.0).to(tl.float32)
    if ROW:
        q, e = quantize_rows(x, BS, BD, FLOOR)
        tl.store(QR + bt * sqrb + h * sqrh + start * sqrs + offs_s[:, None] * sqrs + offs_d[None, :] * sqrd, q,
                 mask=mask)
        if ROW_DQ:
            tl.store(RDQ + slab * D + offs_s[:, None] * D + offs_d[None, :], dequant_rows(q, e.to(tl.uint8), BS, BD),
                     mask=mask)
        offs_k = pid_d * (BD // 32) + tl.arange(0, BD // 32)
        smask = (offs_s < n_out)[:, None] & (offs_k < NR)[None, :]
        tl.store(SR + slab * NR + offs_s[:, None] * NR + offs_k[None, :], e.to(tl.uint8), mask=smask)
        if SWZ:  # never with PACKED (refused on the host)
            off = _swizzle_offset(offs_s[:, None], offs_k[None, :], SRZ_KP)
            tl.store(SRZ + pid_bh.to(tl.int64) * SRZ_SLAB + off, e.to(tl.uint8), mask=smask)
    if COL:
        q, e = quantize_cols(x, BS, BD, FLOOR)
        if COL_SEQ_MAJOR:  # whole blocks, the rows past the sequence's end zeros (also in a NaN block)
            q = tl.where((offs_s < length)[:, None], q, 0.0)
            tl.store(QC + bt * sqcb + h * sqch + (blk0 * MX_BLOCK + offs_s)[:, None] * sqcs + offs_d[None, :] * sqcd,
                     q, mask=(offs_s < tl.cdiv(n_out, MX_BLOCK) * MX_BLOCK)[:, None] & dmask)
        else:
            tl.store(QC + bt * sqcb + h * sqch + start * sqcs + offs_s[:, None] * sqcs + offs_d[None, :] * sqcd, q,
                     mask=mask)
        if COL_DQ:
            tl.store(CDQ + slab * D + offs_s[:, None] * D + offs_d[None, :], dequant_cols(q, e.to(tl.uint8), BS, BD),
                     mask=mask)
        offs_j = pid_s * (BS // 32) + tl.arange(0, BS // 32)  # blocks of this sequence (from its start)
        if PACKED:
            smask = (offs_j * 32 < n_out)[:, None] & dmask
        else:
            smask = (offs_j < NC)[:, None] & dmask
        tl.store(SC + ((bt * H + h) * NC + blk0) * D + offs_j[:, None] * D + offs_d[None, :], e.to(tl.uint8),
                 mask=smask)
        if SWZ:
            off = _swizzle_offset(offs_d[None, :].to(tl.int64), offs_j[:, None], SCZ_KP)  # K spans all slabs
            tl.store(SCZ + pid_bh.to(tl.int64) * SCZ_SLAB + off, e.to(tl.uint8), mask=smask)


@triton.jit
def _quantize_rowcol_kernel(
        X, sxb, sxh, sxs, sxd, QR, sqrb, sqrh, sqrs, sqrd, SR, QC, sqcb, sqch, sqcs, sqcd, SC,
        RDQ, CDQ, CU, H, S, D, NR, NC, SRZ, SCZ, SRZ_KP, SRZ_SLAB, SCZ_KP, SCZ_SLAB,
        BS: tl.constexpr, BD: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, SWZ: tl.constexpr,
        ROW_DQ: tl.constexpr, COL_DQ: tl.constexpr, VARLEN: tl.constexpr, PACKED: tl.constexpr,
        COL_SEQ_MAJOR: tl.constexpr, FLOOR: tl.constexpr = False):
    """`_quantize_tile` for one tensor. Grid (row tiles, D tiles, sequences * H)."""
    _quantize_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2),
                   X, sxb, sxh, sxs, sxd, QR, sqrb, sqrh, sqrs, sqrd, SR, QC, sqcb, sqch, sqcs, sqcd, SC,
                   RDQ, CDQ, CU, H, S, D, NR, NC, SRZ, SCZ, SRZ_KP, SRZ_SLAB, SCZ_KP, SCZ_SLAB,
                   BS, BD, ROW, COL, SWZ, ROW_DQ, COL_DQ, VARLEN, PACKED, COL_SEQ_MAJOR, FLOOR)


@triton.jit
def _quantize_qkv_kernel(
        X0, s0xb, s0xh, s0xs, s0xd, QR0, s0rb, s0rh, s0rs, s0rd, SR0, QC0, s0cb, s0ch, s0cs, s0cd, SC0,
        RDQ0, CDQ0, CU0, H0, S0, D0, NR0, NC0,
        X1, s1xb, s1xh, s1xs, s1xd, QR1, s1rb, s1rh, s1rs, s1rd, SR1, QC1, s1cb, s1ch, s1cs, s1cd, SC1,
        RDQ1, CDQ1, CU1, H1, S1, D1, NR1, NC1,
        X2, s2xb, s2xh, s2xs, s2xd, QR2, s2rb, s2rh, s2rs, s2rd, SR2, QC2, s2cb, s2ch, s2cs, s2cd, SC2,
        RDQ2, CDQ2, CU2, H2, S2, D2, NR2, NC2,
        N0, N1,
        BS: tl.constexpr, BD: tl.constexpr, VARLEN: tl.constexpr, PACKED: tl.constexpr,
        ROW0: tl.constexpr, COL0: tl.constexpr, ROW_DQ0: tl.constexpr, COL_DQ0: tl.constexpr, CSM0: tl.constexpr,
        ROW1: tl.constexpr, COL1: tl.constexpr, ROW_DQ1: tl.constexpr, COL_DQ1: tl.constexpr, CSM1: tl.constexpr,
        ROW2: tl.constexpr, COL2: tl.constexpr, ROW_DQ2: tl.constexpr, COL_DQ2: tl.constexpr, CSM2: tl.constexpr,
        FLOOR: tl.constexpr = False):
    """`_quantize_tile` for three tensors (the forward's Q, K, V) in one launch, each with its own outputs
    (ROWi, COLi, ROW_DQi, COL_DQi, CSMi = COL_SEQ_MAJOR) and no swizzled scales. Grid (row tiles of the
    longest, D tiles, N0 + N1 + N2 = the three tensors' sequences * heads, in that order; N2 may be 0: Q and K
    alone). FLOOR: the OCP scale rule for all three."""
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_z = tl.program_id(2)
    if pid_z < N0:
        _quantize_tile(pid_s, pid_d, pid_z, X0, s0xb, s0xh, s0xs, s0xd, QR0, s0rb, s0rh, s0rs, s0rd, SR0,
                       QC0, s0cb, s0ch, s0cs, s0cd, SC0, RDQ0, CDQ0, CU0, H0, S0, D0, NR0, NC0, SR0, SR0, 0, 0, 0, 0,
                       BS, BD, ROW0, COL0, False, ROW_DQ0, COL_DQ0, VARLEN, PACKED, CSM0, FLOOR)
    elif pid_z < N0 + N1:
        _quantize_tile(pid_s, pid_d, pid_z - N0, X1, s1xb, s1xh, s1xs, s1xd, QR1, s1rb, s1rh, s1rs, s1rd, SR1,
                       QC1, s1cb, s1ch, s1cs, s1cd, SC1, RDQ1, CDQ1, CU1, H1, S1, D1, NR1, NC1, SR1, SR1, 0, 0, 0, 0,
                       BS, BD, ROW1, COL1, False, ROW_DQ1, COL_DQ1, VARLEN, PACKED, CSM1, FLOOR)
    else:
        _quantize_tile(pid_s, pid_d, pid_z - N0 - N1, X2, s2xb, s2xh, s2xs, s2xd, QR2, s2rb, s2rh, s2rs, s2rd,
                       SR2, QC2, s2cb, s2ch, s2cs, s2cd, SC2, RDQ2, CDQ2, CU2, H2, S2, D2, NR2, NC2, SR2, SR2, 0, 0,
                       0, 0, BS, BD, ROW2, COL2, False, ROW_DQ2, COL_DQ2, VARLEN, PACKED, CSM2, FLOOR)




class RowColQuantized(NamedTuple):
    """What `quantize_rowcol` returns; entries not asked for are None.

    row / col: mxattn.formats.MXFP8Tensor (axis 3 / axis 2, compact E8M0 scales).
    row_swizzled: uint8-compatible E8M0 [B, H, Sp, ceil(ceil(D/32)/4)*4] in F8_128x4 order.
    col_swizzled: E8M0 [ceil(D/128)*128, B*H*S32p] (S32p = ceil(ceil(S/32)/4)*4): the column scales of every
        (b, h) slab, each padded to S32p blocks, as one [B*H*S32p, D] matrix transposed and in F8_128x4 order
        (M = D, K = S blocks of all slabs): the bytes of the cuDNN graph's column-wise scale tensor
        (`mxattn.backends.cudnn.buffers.col_scale_bytes`).
    row_dequant / col_dequant: contiguous bf16 [B, H, S, D], the exact dequantization of row / col.
    """

    row: Optional[object]
    col: Optional[object]
    row_swizzled: Optional[torch.Tensor]
    col_swizzled: Optional[torch.Tensor]
    row_dequant: Optional[torch.Tensor] = None
    col_dequant: Optional[torch.Tensor] = None
    col_seq_major: Optional["SeqMajorColumns"] = None


class SeqMajorColumns(NamedTuple):
    """Column-wise MXFP8 data laid out for the attention forward's P V product (the V operand): data
    [B, H, D, L] e4m3, unit stride along L (so a thread's 16 consecutive rows share one scale), where row n of
    sequence b sits at column ``blk0_b * 32 + n`` (blk0_b = 0 for a dense or padded batch, cu[b] // 32 + b for
    a packed one: every sequence starts 32-aligned) and the rows after a sequence's end up to its last block's
    end are zeros, also in a NaN block (so a kernel may load whole blocks: 0 * P = 0); L = 32 * scale.shape[2]. scale: the compact column-wise E8M0 scales [B, H, L / 32, D]
    (segmented for a packed batch), as in the `col` MXFP8Tensor."""

    data: torch.Tensor
    scale: torch.Tensor


def padded_head_dim(d: int) -> int:
    """The head dim the kernels' tiles span: the least power of two >= d, at least one MXFP8 block (32)."""
    return max(MX_BLOCK.value, pow2_ceil(d))


#: CUDA's limit on the y and z extents of a grid (the attention and quantizer grids put sequences * heads there)
MAX_GRID_YZ = 65535


def seq_programs(batch: int, heads: int, cu_seqlens: Optional[torch.Tensor] = None, packed: bool = False) -> int:
    """Programs along the (sequence, head) axis of a kernel grid: (number of sequences) * heads, the sequences
    being cu_seqlens.numel() - 1 for a packed batch and the tensor batch otherwise. Raises ValueError beyond
    what a CUDA grid holds."""
    n_seq = cu_seqlens.numel() - 1 if packed else batch
    n = n_seq * heads
    if n > MAX_GRID_YZ:
        raise ValueError(f"{n_seq} sequences x {heads} heads = {n} programs exceed the CUDA grid limit "
                         f"{MAX_GRID_YZ}; split the batch")
    return n


def row_tiles(n_rows: int, block: int) -> int:
    """Programs along S for tiles of `block` rows over the n_rows a grid covers (`mxattn.seqinfo.covered_rows`)."""
    return cdiv(n_rows, block)


def check_cu_seqlens(cu_seqlens, name: str, x: torch.Tensor, packed: bool) -> None:
    """Shape/dtype/device checks of one side's cumulative lengths against its [B, H, S, D] tensor x (host
    side, before any launch; the values are trusted: `mxattn.seqinfo.make_seqinfo` checked them)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 [batch + 1]), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 >= 2 offsets, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != x.device:
        raise ValueError(f"{name} must be on {x.device}, got {cu_seqlens.device}")
    if packed and x.shape[0] != 1:
        raise ValueError(f"a packed batch is a [1, H, T, D] view, got batch size {x.shape[0]}")
    if not packed and cu_seqlens.numel() - 1 != x.shape[0]:
        raise ValueError(f"{name} has {cu_seqlens.numel()} entries but the padded batch has "
                         f"{x.shape[0]} sequences (expected {x.shape[0] + 1})")


def col_scale_rows(n_rows: int, cu_seqlens: Optional[torch.Tensor] = None, packed: bool = False) -> int:
    """Rows of a column-wise scale tensor: ceil(S / 32), or T // 32 + B for a packed batch (segments)."""
    if packed:
        return n_rows // MX_BLOCK.value + cu_seqlens.numel() - 1
    return cdiv(n_rows, MX_BLOCK.value)


def _data_like(x: torch.Tensor, data_layout: Optional[str] = None) -> torch.Tensor:
    """FP8 tensor with x's strides when x is non-overlapping and dense, else contiguous (the MXFP8Tensor data
    convention; torch's preserve_format rule, for x with a unit stride along D as the callers pass it);
    data_layout (a qkv_format): dense in that layout's order whatever x's strides."""
    if data_layout is not None:
        return empty_bhsd(tuple(x.shape), data_layout, torch.float8_e4m3fn, x.device)
    return torch.empty_like(x, dtype=torch.float8_e4m3fn)


#: (BLOCK_S, num_warps, max BLOCK_D) of the quantizer (the fastest measured). Small tiles keep registers low (about
#: 90 per thread), so many programs are resident per SM to hide memory latency.
QUANT_TILE = (32, 2, 64)


def quantize_rowcol(x: torch.Tensor, *, row: bool = True, col: bool = True, swizzle: bool = False,
                    row_dequant: bool = False, col_dequant: bool = False, tile=None,
                    cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                    packed: bool = False, col_seq_major: bool = False, floor: bool = False,
                    data_layout: Optional[str] = None) -> RowColQuantized:
    """Fused MXFP8 quantizer: x [B, H, S, D] bf16/fp16/fp32 (any strides, CUDA) read once ->
    row-wise (blocks of 32 along D) and/or column-wise (blocks of 32 along S) E4M3 data with compact E8M0
    scales, and on request the scales also in F8_128x4 order and the exact bf16 dequantizations.
    Bit-identical to mxattn.quantize_mxfp8. tile: optional (BLOCK_S multiple of 32, num_warps[, max BLOCK_D])
    override.
    cu_seqlens (int32 [B+1] on x's device) makes x a variable-length batch (module docstring): padded
    (packed False; rows past each length are read as zeros, = quantize_mxfp8 of the zeroed tensor) or packed
    (x [1, H, T, D]; the column-wise copy is segmented, = quantize_mxfp8(x, axis=2, segments=cu_seqlens)).
    max_seqlen bounds the longest sequence of a packed batch (sizes the grid; default T). swizzle is not
    available for a packed batch. col_seq_major: return the column-wise copy as `SeqMajorColumns` (the forward
    kernel's V layout) in the col_seq_major field instead of an MXFP8Tensor in col (not with col_dequant).
    floor: the OCP scale rule (`Recipe.scale_rounding="floor"`; equal to quantize_mxfp8's) instead of round-up.
    data_layout (a qkv_format): the FP8 data dense in that layout's order (else in x's layout when x is
    dense, contiguous otherwise)."""
    call = _prepare(x, row=row, col=col, swizzle=swizzle, row_dequant=row_dequant, col_dequant=col_dequant,
                    tile=tile, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, packed=packed,
                    col_seq_major=col_seq_major, floor=floor, data_layout=data_layout)
    if x.numel() > 0:
        _launch_one(call)
    return call.result


def _launch_one(c: "_QuantizeCall") -> None:
    launch(_quantize_rowcol_kernel, c.grid, *c.args, **c.flags, BS=c.bs, BD=c.bd, VARLEN=c.varlen, PACKED=c.packed,
           num_warps=c.warps)


class _QuantizeCall(NamedTuple):
    """One tensor's launch of `_quantize_tile`, prepared: its run-time arguments (in order), grid, per-tensor
    constexprs (ROW, COL, SWZ, ROW_DQ, COL_DQ, COL_SEQ_MAJOR), tile (bs, bd, warps), the variable-length flags
    and what the caller gets back once it ran."""

    args: tuple
    grid: tuple
    flags: dict
    bs: int
    bd: int
    warps: int
    varlen: bool
    packed: bool
    result: RowColQuantized


def _prepare(x: torch.Tensor, *, row: bool, col: bool, swizzle: bool, row_dequant: bool, col_dequant: bool, tile,
             cu_seqlens: Optional[torch.Tensor], max_seqlen: Optional[int], packed: bool,
             col_seq_major: bool, floor: bool = False, data_layout: Optional[str] = None) -> _QuantizeCall:
    """`quantize_rowcol`'s checks and output allocations (its arguments), without the launch."""
    if not (row or col):
        raise ValueError("quantize_rowcol: at least one of row, col must be True")
    if (row_dequant and not row) or (col_dequant and not col):
        raise ValueError("quantize_rowcol: row_dequant needs row=True and col_dequant needs col=True")
    if col_seq_major and (not col or col_dequant or swizzle):
        raise ValueError("quantize_rowcol: col_seq_major needs col=True and excludes col_dequant and swizzle")
    if col_dequant and not row:
        # Triton 3.6 compiles this one combination wrongly on sm_90 (the bf16 copy differs from the column-wise
        # bytes it was made from), so it is refused rather than worked around
        raise ValueError("quantize_rowcol: col_dequant needs row=True")
    check_bhsd_tensor(x, "x", INPUT_DTYPES, "cuda")
    varlen = cu_seqlens is not None
    if varlen:
        check_cu_seqlens(cu_seqlens, "cu_seqlens", x, packed)
        if packed and swizzle:
            raise ValueError("quantize_rowcol: swizzle=True is not available for a packed batch (packed=True)")
    elif packed:
        raise ValueError("quantize_rowcol: packed=True needs cu_seqlens")
    packed = varlen and bool(packed)
    B, H, S, D = x.shape
    nr, nc = cdiv(D, 32), col_scale_rows(S, cu_seqlens, packed)
    dev = x.device
    # pointers of outputs not asked for are never dereferenced (their stores sit under false constexprs), so
    # an existing tensor stands in for them instead of fresh allocations (host time per call matters here)
    qr = _data_like(x, data_layout) if row else None
    sr = torch.empty((B, H, S, nr), dtype=torch.uint8, device=dev) if row else None
    if col_seq_major:  # [B, H, D, L]: every element is written by the kernel (zeros after each sequence)
        qc = torch.empty((B, H, D, nc * MX_BLOCK.value), dtype=torch.float8_e4m3fn, device=dev).transpose(2, 3)
    else:
        qc = _data_like(x, data_layout) if col else qr
    # segmented scales: the rows between sequences belong to no block and hold byte 0
    sc = (torch.zeros if packed else torch.empty)((B, H, nc, D), dtype=torch.uint8, device=dev) if col else sr
    qr = qc if qr is None else qr
    sr = sc if sr is None else sr
    # row-wise: one [Sp, D32p] F8_128x4 slab per (b, h); column-wise: cuDNN's order, the [B*H*S32p, D] matrix of
    # every slab's blocks (each padded to S32p) transposed and swizzled as one (M = D, K = B*H*S32p), so slab
    # (b, h) starts S32p / 4 atoms of 512 bytes further along K (`mxattn.backends.cudnn.buffers.col_scale_bytes`)
    srz_kp, s32p = cdiv(nr, 4) * 4, cdiv(nc, 4) * 4
    srz_slab, scz_kp, scz_slab = cdiv(S, 128) * 128 * srz_kp, B * H * s32p, s32p * 128
    srz = torch.zeros((B, H, cdiv(S, 128) * 128, srz_kp), dtype=torch.uint8, device=dev) \
        if (swizzle and row) else sr
    scz = torch.zeros((cdiv(D, 128) * 128, scz_kp), dtype=torch.uint8, device=dev) \
        if (swizzle and col) else sc
    rdq = torch.empty((B, H, S, D), dtype=torch.bfloat16, device=dev) if row_dequant else None
    cdq = torch.empty((B, H, S, D), dtype=torch.bfloat16, device=dev) if col_dequant else None
    bs, warps, *bd_ = tile if tile is not None else QUANT_TILE
    if bs < 32 or bs % 32:
        raise ValueError(f"tile BLOCK_S must be a positive multiple of 32, got {bs}")
    bd = min(bd_[0] if bd_ else 128, padded_head_dim(D))
    grid = (row_tiles(covered_rows(S, max_seqlen, packed), bs), cdiv(D, bd), seq_programs(B, H, cu_seqlens, packed))
    qr_st = qr.stride() if row else (0, 0, 0, 0)
    qc_st = qc.stride() if col else (0, 0, 0, 0)
    args = (x, *x.stride(), qr, *qr_st, sr, qc, *qc_st, sc, x if rdq is None else rdq, x if cdq is None else cdq,
            cu_seqlens if varlen else sr, H, S, D, nr, nc, srz, scz, srz_kp, srz_slab, scz_kp, scz_slab)
    flags = dict(ROW=row, COL=col, SWZ=swizzle, ROW_DQ=row_dequant, COL_DQ=col_dequant, COL_SEQ_MAJOR=col_seq_major,
                 FLOOR=bool(floor))
    e8 = torch.float8_e8m0fnu
    result = RowColQuantized(
        MXFP8Tensor.unchecked(qr, sr.view(e8), 3) if row else None,
        MXFP8Tensor.unchecked(qc, sc.view(e8), 2, cu_seqlens if packed else None)
        if col and not col_seq_major else None,
        srz.view(e8) if (swizzle and row) else None,
        scz.view(e8) if (swizzle and col) else None,
        rdq if row_dequant else None,
        cdq if col_dequant else None,
        SeqMajorColumns(qc.transpose(2, 3), sc.view(e8)) if col_seq_major else None)
    return _QuantizeCall(args, grid, flags, bs, bd, warps, varlen, packed, result)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], q_kw: dict, k_kw: dict,
                 v_kw: Optional[dict], floor: bool = False
                 ) -> Tuple[RowColQuantized, RowColQuantized, Optional[RowColQuantized]]:
    """`quantize_rowcol(q, **q_kw)`, `(k, **k_kw)` and `(v, **v_kw)` in one launch (the forward's three
    quantizations; the same bytes as three calls). q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D]; the keyword sets
    must agree on the tile and on whether the batch is packed or padded, and exclude swizzle. v None (with
    v_kw None): Q and K alone (the bf16-V recipe), and None in V's place. floor: the OCP scale rule for all."""
    if v is None:
        c0, c1 = calls = [_prepare(x, **{**_QUANT_DEFAULTS, **kw}, floor=floor) for x, kw in ((q, q_kw), (k, k_kw))]
        c2 = c1._replace(grid=(0, c1.grid[1], 0), result=None)  # no programs: its arguments are K's, never read
    else:
        c0, c1, c2 = calls = [_prepare(x, **{**_QUANT_DEFAULTS, **kw}, floor=floor)
                              for x, kw in ((q, q_kw), (k, k_kw), (v, v_kw))]
    common = (c0.bs, c0.bd, c0.warps, c0.varlen, c0.packed)
    if c0.flags["SWZ"] or c1.flags["SWZ"] or c2.flags["SWZ"] or \
            (c1.bs, c1.bd, c1.warps, c1.varlen, c1.packed) != common or \
            (c2.bs, c2.bd, c2.warps, c2.varlen, c2.packed) != common:
        raise ValueError("quantize_qkv: the three calls must share tile and lengths kind, without swizzle")
    rows, programs = max(c0.grid[0], c1.grid[0], c2.grid[0]), c0.grid[2] + c1.grid[2] + c2.grid[2]
    if programs > MAX_GRID_YZ:  # more sequences * heads than one grid axis holds: a launch per tensor
        for c, x in zip(calls, (q, k, v)):
            if x.numel() > 0:
                _launch_one(c)
    elif rows and c0.grid[1]:
        flags = {}
        for names, c in zip(_QKV_FLAG_NAMES, (c0, c1, c2)):
            f = c.flags
            flags.update(zip(names, (f["ROW"], f["COL"], f["ROW_DQ"], f["COL_DQ"], f["COL_SEQ_MAJOR"])))
        n = TILE_ARGS_NO_SWIZZLE
        launch(_quantize_qkv_kernel, (rows, c0.grid[1], programs),
               *c0.args[:n], *c1.args[:n], *c2.args[:n], c0.grid[2], c1.grid[2], BS=c0.bs, BD=c0.bd,
               VARLEN=c0.varlen, PACKED=c0.packed, **flags, FLOOR=bool(floor), num_warps=c0.warps)
    return c0.result, c1.result, c2.result


#: the per-tensor constexpr names of `_quantize_qkv_kernel`
_QKV_FLAG_NAMES = tuple(tuple(f"{name}{i}" for name in ("ROW", "COL", "ROW_DQ", "COL_DQ", "CSM")) for i in range(3))

_QUANT_DEFAULTS = dict(row=True, col=True, swizzle=False, row_dequant=False, col_dequant=False, tile=None,
                       cu_seqlens=None, max_seqlen=None, packed=False, col_seq_major=False, data_layout=None)
