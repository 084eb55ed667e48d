"""The @gluon.jit helpers the Gluon Hopper forward, dK/dV and dQ kernels share: the element conversions (E4M3 ->
bf16, P's E4M3 rounding, the exact dequantization of MX blocks: the Gluon copies of `triton_common`'s, as a
@gluon.jit function cannot call a @triton.jit one) and the sequence geometry (a program's query tile and head, a
padded or packed sequence's lengths and first rows, the KV blocks a query tile visits)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.jit import constexpr_function

from .triton_common import (E4M3_TO_BF16_ASM, E4M3_TO_BF16_CONSTRAINTS, E4M3_TO_BF16_PACK, ROUND_P_ASM,
                            ROUND_P_CONSTRAINTS, ROUND_P_PACK)


# --------------------------------------------------------------------------- element helpers (triton_common's)
@gluon.jit
def _e4m3_to_bf16_biased(x):
    """uint8 E4M3 patterns -> bf16 x * 2^-120, exactly (integer ops; triton_common.e4m3_to_bf16_biased)."""
    return gl.inline_asm_elementwise(asm=E4M3_TO_BF16_ASM, constraints=E4M3_TO_BF16_CONSTRAINTS, args=[x],
                                     dtype=gl.bfloat16, is_pure=True, pack=E4M3_TO_BF16_PACK)


@gluon.jit
def _round_p_to_bf16(p):
    """fp32 p in [0, 448] -> bf16 E4M3(p) (RNE, saturating; triton_common.round_p_to_bf16)."""
    return gl.inline_asm_elementwise(asm=ROUND_P_ASM, constraints=ROUND_P_CONSTRAINTS, args=[p], dtype=gl.bfloat16,
                                     is_pure=True, pack=ROUND_P_PACK)


@gluon.jit
def _dequant3(x, s):
    """x uint8 E4M3 [R, C // 32, 32], s uint8 E8M0 [R, C // 32] (SliceLayout(2, x's)) -> bf16 [R, C // 32, 32]:
    e4m3_to_bf16_biased(x) * f1 * f2 as triton_common.dequant_rows (f1 = 2^(min(e, 134) - 7), f2 the rest, NaN
    for e = 255)."""
    e = s.to(gl.int16)
    f1 = ((gl.minimum(e, 134) + 120) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
    f2 = gl.where(e == 255, 0x7FC0, (gl.maximum(e, 134) - 7) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
    y = _e4m3_to_bf16_biased(x)
    return y * gl.expand_dims(f1, 2) * gl.expand_dims(f2, 2)


@constexpr_function
def _chunk_layouts(C, warps):
    """(2-D, 3-D) blocked layouts of a [rows, C] FP8 chunk, 16 contiguous bytes per thread along C, the 3-D one the
    [rows, C // 32, 32] view with the same thread mapping (one MX block = two threads)."""
    tc = C // 16
    l2 = gl.BlockedLayout([1, 16], [32 // tc, tc], [warps, 1], [1, 0])
    l3 = gl.BlockedLayout([1, 1, 16], [32 // tc, C // 32, 2], [warps, 1, 1], [2, 1, 0])
    return l2, l3


# --------------------------------------------------------------------------- sequence geometry
@gluon.jit
def _tile_of_program(HQ, HAS_RB: gl.constexpr):
    """(query tile, b, hq) of this program; causal-style bands number programs heaviest tile first
    (triton_common.program_prologue's BY_TILE)."""
    tile = gl.program_id(0)
    pid_bh = gl.program_id(1)
    if HAS_RB:
        n_tiles = gl.num_programs(0)
        n_bh = gl.num_programs(1)
        linear = pid_bh * n_tiles + tile
        tile = n_tiles - 1 - linear // n_bh
        pid_bh = linear % n_bh
    return tile, pid_bh // HQ, pid_bh % HQ


@gluon.jit
def _kv_blocks(m0, SKV, offset, RB, HAS_RB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """Number of KV blocks the CTA's query rows [m0, m0 + BM) meet (from block 0)."""
    hi = SKV
    if HAS_RB:
        hi = gl.minimum(SKV, gl.maximum(m0 + BM + offset + RB, 0))
    return gl.cdiv(hi, BN)


@gluon.jit
def _kv_block_range(m0, SKV, offset, LB, RB, HAS_LB: gl.constexpr, HAS_RB: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr):
    """(lo, n): the CTA's query rows [m0, m0 + BM) visit the KV blocks lo, lo + 1, ..., lo + n - 1, in that order
    (triton_common.band_block_range's [lo, hi) at the same tile, in blocks). The producer and both consumer
    warpgroups take the range from here, and index their rings by the count i = j - lo of visited blocks. With
    HAS_LB (keys kept where col > row + offset - LB) the first block is the one holding column
    m0 + offset - LB + 1 (or 0); without it lo is the constant 0."""
    hi_blk = _kv_blocks(m0, SKV, offset, RB, HAS_RB, BM, BN)
    lo = 0
    n = hi_blk
    if HAS_LB:
        lo = gl.maximum(m0 + offset - LB + 1, 0) // BN
        n = gl.maximum(hi_blk - lo, 0)
    return lo, n


@gluon.jit
def _seq_lengths(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr):
    """(len_q, len_kv, offset) of batch b: with VARLEN (a padded batch: sequence b is rows 0 .. len of batch b,
    lengths from the int32 cu_seqlens CU_Q / CU_KV) its lengths and, with BOTTOM_RIGHT, its own diagonal offset
    len_kv - len_q (triton_common.seq_prologue's); else the tensors' SQ, SKV and the offset passed in."""
    len_q = SQ
    len_kv = SKV
    if VARLEN:
        len_q = gl.load(CU_Q + b + 1) - gl.load(CU_Q + b)
        len_kv = gl.load(CU_KV + b + 1) - gl.load(CU_KV + b)
        if BOTTOM_RIGHT:
            offset = len_kv - len_q
    return len_q, len_kv, offset


@gluon.jit
def _seq_rows(CU_Q, CU_KV, b, PACKED: gl.constexpr):
    """(bt, q0, kv0, kvb0) of sequence b: the tensors' batch index, the sequence's first query and key rows and
    the first column block of V's seq-major data (triton_common.seq_span's): in a packed batch (thd, the tensors'
    batch 0) q0 = cu_q[b], kv0 = cu_kv[b] and kvb0 = kv0 // 32 + b (V quantized per sequence: segments restart at
    each sequence's first key); else (b, 0, 0, 0)."""
    bt = b
    q0 = 0
    kv0 = 0
    kvb0 = 0
    if PACKED:
        bt = b * 0
        q0 = gl.load(CU_Q + b)
        kv0 = gl.load(CU_KV + b)
        kvb0 = kv0 // 32 + b
    return bt, q0, kv0, kvb0


@gluon.jit
def _visited_blocks(m_cta, len_q, len_kv, offset, LB, RB, HAS_LB: gl.constexpr, HAS_RB: gl.constexpr,
                    BM: gl.constexpr, BN: gl.constexpr, VARLEN: gl.constexpr):
    """`_kv_block_range` of the CTA's rows [m_cta, m_cta + BM) over its sequence's len_kv keys, none where the
    tile starts past the sequence's len_q rows (VARLEN: a padded tile; its rows get O = 0 and stats = -inf): the
    range all three partitions walk."""
    lo, n = _kv_block_range(m_cta, len_kv, offset, LB, RB, HAS_LB, HAS_RB, BM, BN)
    if VARLEN:
        n = n * (m_cta < len_q).to(gl.int32)
    return lo, n
