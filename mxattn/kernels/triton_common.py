"""The `@triton.jit` device helpers and recipe constants that mxattn's Triton kernels share (the fused quantizer,
the attention forward and backward): per-sequence spans and kernel prologues, E8M0 arithmetic, tile
dequantization, quantization and quantize-dequantize, the block ranges of the band mask and masked tile loads.

Scale rule (spec section 2, round-up): ``e = biased_exponent(amax / 448) + (mantissa != 0)``, clamped to
[0, 254]; ``e = 0`` when ``amax / 448 <= 2^-127``; ``e = 255`` for NaN (the whole block becomes NaN).
Elements: ``RNE_saturate_E4M3(x * 2^(127 - e))`` (the hardware conversion saturates to +-448).
"""

import triton
import triton.language as tl

from .. import constants

# --------------------------------------------------------------------------- recipe constants (spec sections 6, 7)
# tl.constexpr so that @triton.jit code can read them; host code uses `.value`.
#: elements per MXFP8 block (one E8M0 scale each)
MX_BLOCK = tl.constexpr(constants.MX_BLOCK)
#: fixed power-of-two scale of P before its E4M3 cast (Pq = E4M3(P * 256) / 256)
P_SCALE = tl.constexpr(256.0)
P_DESCALE = tl.constexpr(1.0 / 256.0)
LOG2_P_SCALE = tl.constexpr(8.0)
#: the kernels run the softmax in base 2: exp(x) = exp2(x * LOG2E), ln(y) = log2(y) * LN2
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# --------------------------------------------------------------------------- recipe variants (`mxattn.Recipe`)
# Each variant is a constexpr specialisation: the default values below compile to the default recipe's code.
#: the forward's P rounding (P_MODE): E4M3(P * 256) | E4M3(P * 16) with a lazy running max | bf16(P)
P_FIXED256, P_LAZY16, P_BF16 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
#: the lazy16 forward moves its running max only when a block's max exceeds it by more than this (log2 units,
#: i.e. 4 * ln 2 in the logits' units: P then reaches up to 2^4)
LAZY_THRESHOLD = tl.constexpr(4.0)


# --------------------------------------------------------------------------- inline PTX (one definition)
# The asm text, constraints and pack of `e4m3_to_bf16_biased` and `round_p_to_bf16`, shared with the Gluon
# forward's copies of those helpers (gluon_common: a @gluon.jit function cannot call a @triton.jit one).
# The text goes into the PTX as written (indentation included).
#: uint8 E4M3 patterns (four per register, $2) -> two registers of bf16 pairs x * 2^-120 ($0, $1)
E4M3_TO_BF16_ASM = tl.constexpr("""{
        .reg .b32 lo, hi;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 $0, lo, 0x87F087F0;
        and.b32 $1, hi, 0x87F087F0;
        }""")
E4M3_TO_BF16_CONSTRAINTS = tl.constexpr("=r,=r,r")
E4M3_TO_BF16_PACK = tl.constexpr(4)
#: fp32 pair ($1, $2) in [0, 448] -> bf16 pair E4M3(p) ($0)
ROUND_P_ASM = tl.constexpr("""{
        .reg .b16 h;
        .reg .b32 w, t, c;
        cvt.rn.satfinite.e4m3x2.f32 h, $2, $1;
        cvt.rn.f16x2.e4m3x2 w, h;
        shr.b32 t, w, 3;
        mov.b32 c, 0x77807780;
        mul.rn.bf16x2 $0, t, c;
        }""")
ROUND_P_CONSTRAINTS = tl.constexpr("=r,r,r")
ROUND_P_PACK = tl.constexpr(2)


@triton.jit
def seq_span(CU, b, S, VARLEN: tl.constexpr, PACKED: tl.constexpr):
    """Where sequence b (int64) lies in a [B, H, S, D] tensor -> (bt, start, length, blk0):
    the batch index into the tensor, its first row, its length and its first column-wise scale row.
    Dense (VARLEN False): (b, 0, S, 0). Padded: (b, 0, cu[b+1] - cu[b], 0). Packed: (0, cu[b], len_b,
    cu[b] // 32 + b). Row offsets come back as int64 scalars (they multiply row strides of a whole pack)."""
    zero = b * 0
    if VARLEN:
        first = tl.load(CU + b)
        length = tl.load(CU + b + 1) - first
        if PACKED:
            bt = zero
            start = first.to(tl.int64)
            blk0 = start // MX_BLOCK + b
        else:
            bt = b
            start = zero
            blk0 = zero
    else:
        bt = b
        start = zero
        length = S
        blk0 = zero
    return bt, start, length, blk0


@triton.jit
def scale_exponent_from_bits(abits, FLOOR: tl.constexpr = False):
    """Bits (int32) of amax = max |x| (NaN patterns compare above inf) -> E8M0 biased exponent, int32.
    FLOOR (`Recipe.scale_rounding="floor"`, the OCP rule): the exponent field of amax minus 8, clamped to
    [0, 254], NaN 255 (+inf: 247); the default is the round-up rule below.

    Division-free: for FP32 amax = M * 2^E, RN(amax / 448) <= 2^k exactly when amax <= 448 * 2^k (the next FP32
    above 448 * 2^k already exceeds the rounding threshold 448 * 2^k * (1 + 2^-24)), so the round-up exponent
    is E - 8 when M <= 1.75 (mantissa field <= 0x600000) and E - 7 otherwise; clamped to [0, 254]. inf gives
    254, NaN 255. Identical to the rule on exponent(RN(amax / 448)) for every BF16/FP16 amax; for FP32 amax it
    differs only at the single value 1.75 * 2^-119 + 2^-142 (a subnormal quotient).
    """
    expo = (abits >> 23) & 0xFF
    mant = abits & 0x7FFFFF
    if FLOOR:
        e = tl.minimum(tl.maximum(expo - 8, 0), 254)
        e = tl.where((expo == 255) & (mant != 0), 255, e)
    else:
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
def e4m3_to_bf16_biased(x):
    """uint8 tile of E4M3 bit patterns -> bf16 tile holding x * 2^-120, exactly, with integer operations only
    (no conversion instructions): the E4M3 magnitude bits shifted left by 4 are a BF16 pattern whose exponent
    field is E4M3's, so normal values land 120 binades low and E4M3 subnormals land on BF16 subnormals.
    Four bytes per 32-bit register: one byte permute (sign-extending each byte into a 16-bit lane), one shift,
    one mask per pair."""
    return tl.inline_asm_elementwise(asm=E4M3_TO_BF16_ASM, constraints=E4M3_TO_BF16_CONSTRAINTS, args=[x],
                                     dtype=tl.bfloat16, is_pure=True, pack=E4M3_TO_BF16_PACK)


@triton.jit
def round_p_to_bf16(p):
    """fp32 tile p in [0, 448] -> bf16 tile E4M3(p) (round to nearest even, the recipe's rounding of P * 256),
    exactly, in four instructions per pair: the E4M3 conversion, E4M3 -> F16 (exact), a right shift by 3 that
    turns each F16 pattern (sign 0, low three mantissa bits 0) into the BF16 pattern of p * 2^-112 (E4M3
    subnormals are F16 normals, so they stay exact), and one BF16 multiply by 2^112. A NaN p gives an
    unspecified value that may spill into the other lane of its pair: the callers' row sums of the unrounded
    p carry a NaN row to NaN instead."""
    return tl.inline_asm_elementwise(asm=ROUND_P_ASM, constraints=ROUND_P_CONSTRAINTS, args=[p], dtype=tl.bfloat16,
                                     is_pure=True, pack=ROUND_P_PACK)


@triton.jit
def round_p(p, P_MODE: tl.constexpr = 0):
    """The forward's P (times its power-of-two scale, fp32 [BM, BN]) as the P V product takes it, bf16: E4M3
    (`round_p_to_bf16`) for the fixed256 and lazy16 recipes, rounded to bf16 (RNE) for P_BF16 (`p_quant="none"`:
    bf16(P * 2^k) = bf16(P) * 2^k)."""
    if P_MODE == P_BF16:
        return p.to(tl.bfloat16)
    return round_p_to_bf16(p)


@triton.jit
def dequant_factors_bf16(s):
    """uint8 tile of E8M0 bytes -> (f1, f2), bf16 tiles with e4m3_to_bf16_biased(x) * f1 * f2 == x * 2^(e - 127)
    exactly (f1 = 2^(min(e, 134) - 7) carries the 2^120 back, f2 = 2^(max(e, 134) - 134) the rest; both normal
    BF16 numbers). e = 255 (the NaN scale) gives f2 = NaN: the whole block dequantizes to NaN."""
    e = s.to(tl.int16)
    f1 = ((tl.minimum(e, 134) + 120) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    f2 = tl.where(e == 255, 0x7FC0, (tl.maximum(e, 134) - 7) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return f1, f2


@triton.jit
def dequant_rows(x, s, R: tl.constexpr, C: tl.constexpr):
    """x fp8 [R, C] with E8M0 bytes s (uint8) [R, C // 32] along axis 1 -> bf16 [R, C].

    E4M3 -> BF16 is exact and so are the products with powers of two in BF16 (BF16 has FP32's exponent range;
    only results below about 2^-133 lose bits, the spec's section 8 caveat)."""
    f1, f2 = dequant_factors_bf16(s)
    y = tl.reshape(e4m3_to_bf16_biased(x.to(tl.uint8, bitcast=True)), (R, C // 32, 32))
    y = y * f1[:, :, None] * f2[:, :, None]
    return tl.reshape(y, (R, C))


@triton.jit
def dequant_cols(x, s, R: tl.constexpr, C: tl.constexpr):
    """x fp8 [R, C] with E8M0 bytes s (uint8) [R // 32, C] along axis 0 -> bf16 [R, C] (as dequant_rows)."""
    f1, f2 = dequant_factors_bf16(s)
    y = tl.reshape(e4m3_to_bf16_biased(x.to(tl.uint8, bitcast=True)), (R // 32, 32, C))
    y = y * f1[:, None, :] * f2[:, None, :]
    return tl.reshape(y, (R, C))


@triton.jit
def quantize_rows(x, R: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr = False):
    """fp32 [R, C] -> (E4M3 [R, C], int32 E8M0 exponents [R, C // 32]), blocks of 32 along axis 1; a block
    holding a NaN gets exponent 255 and NaN elements. FLOOR: the OCP scale rule (elements then saturate)."""
    x3 = tl.reshape(x, (R, C // 32, 32))
    e = scale_exponent_from_bits(block_amax_bits(x3, 2), FLOOR)
    y = tl.where((e == 255)[:, :, None], float("nan"), x3 * inv_pow2_of_biased(e)[:, :, None])
    return tl.reshape(y.to(tl.float8e4nv), (R, C)), e


@triton.jit
def quantize_cols(x, R: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr = False):
    """fp32 [R, C] -> (E4M3 [R, C], int32 E8M0 exponents [R // 32, C]), blocks of 32 along axis 0 (as
    quantize_rows)."""
    x3 = tl.reshape(x, (R // 32, 32, C))
    e = scale_exponent_from_bits(block_amax_bits(x3, 1), FLOOR)
    y = tl.where((e == 255)[:, None, :], float("nan"), x3 * inv_pow2_of_biased(e)[:, None, :])
    return tl.reshape(y.to(tl.float8e4nv), (R, C)), e


@triton.jit
def qdq_rows(x, R: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr = False):
    """fp32 [R, C] -> MXFP8 (E4M3, blocks of 32 along axis 1) and back, as bf16 [R, C] (FLOOR: the OCP scale
    rule)."""
    x3 = tl.reshape(x, (R, C // 32, 32))
    e = scale_exponent_from_bits(block_amax_bits(x3, 2), FLOOR)
    q = (x3 * inv_pow2_of_biased(e)[:, :, None]).to(tl.float8e4nv)
    y = q.to(tl.float32) * pow2_of_biased(e)[:, :, None]
    return tl.reshape(y, (R, C)).to(tl.bfloat16)


@triton.jit
def seq_prologue(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN: tl.constexpr, PACKED: tl.constexpr,
                 BOTTOM_RIGHT: tl.constexpr):
    """The per-sequence prologue of the attention kernels: sequence b (int64) ->
    (bt, q0, kv0, len_q, len_kv, qb0, kvb0, offset): the batch index into the tensors, the first query and key
    rows, the lengths, the first column-wise scale rows of the Q side and of the K/V side (`seq_span`), and the
    diagonal offset of the band mask (varlen bottom-right: len_kv - len_q of this sequence; else the `offset`
    passed in). Dense (VARLEN False): (b, 0, 0, SQ, SKV, 0, 0, offset)."""
    bt, q0, len_q, qb0 = seq_span(CU_Q, b, SQ, VARLEN, PACKED)
    _, kv0, len_kv, kvb0 = seq_span(CU_KV, b, SKV, VARLEN, PACKED)
    if VARLEN:
        if BOTTOM_RIGHT:
            offset = len_kv - len_q
    return bt, q0, kv0, len_q, len_kv, qb0, kvb0, offset


@triton.jit
def program_prologue(CU_Q, CU_KV, H, GROUP, SQ, SKV, offset, VARLEN: tl.constexpr, PACKED: tl.constexpr,
                     BOTTOM_RIGHT: tl.constexpr, Q_SIDE: tl.constexpr, BY_TILE: tl.constexpr):
    """The prologue of the attention kernels, whose grid is (tiles of rows, sequences * H) (H heads, GROUP of
    them per KV head: the query heads, or the KV heads with GROUP 1) -> (tile, h, hk, bt, q0, kv0, len_q,
    len_kv, qb0, kvb0, offset, n_out): the program's tile and head and its KV head, then `seq_prologue`'s
    values, and n_out, the rows of its side (Q_SIDE: the query rows, else the KV rows) that it may write: the
    sequence's own in a packed batch, all of the tensor's otherwise (a padded batch's padding rows get zeros).
    BY_TILE (a causal-style band, whose tiles' work differs by up to the sequence's length in blocks): the
    programs are numbered tile-major, heaviest tiles first (the last query tiles, the first KV tiles). CUDA
    starts programs in linear order (axis 0 fastest), so every sequence and head starts its costly tiles before
    any cheap one, and the cheap ones fill the tail instead of one costly tile running alone at the end."""
    tile = tl.program_id(0)
    pid_bh = tl.program_id(1)
    if BY_TILE:
        n_tiles = tl.num_programs(0)
        n_bh = tl.num_programs(1)
        linear = pid_bh * n_tiles + tile
        tile = linear // n_bh
        pid_bh = linear % n_bh
        if Q_SIDE:
            tile = n_tiles - 1 - tile
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    bt, q0, kv0, len_q, len_kv, qb0, kvb0, offset = seq_prologue(CU_Q, CU_KV, b, SQ, SKV, offset, VARLEN,
                                                                 PACKED, BOTTOM_RIGHT)
    if Q_SIDE:
        n_out = SQ
        if PACKED:
            n_out = len_q
    else:
        n_out = SKV
        if PACKED:
            n_out = len_kv
    return tile, h, h // GROUP, bt, q0, kv0, len_q, len_kv, qb0, kvb0, offset, n_out


@triton.jit
def tile_offsets(tile, D, T: tl.constexpr, O: tl.constexpr, DP: tl.constexpr):
    """Offsets of a program's tile (after `program_prologue`): tile `tile` of T rows of its own side, blocks of O
    rows of the other side, head dim D padded to DP -> (t0, rows, offs_o, offs_d, offs_kb, d_ok, kb_ok): the
    tile's first row and its rows, the rows within one block of the other side, the head-dim columns and the
    scale columns (one per 32 of them), and which of those exist (d_ok: offs_d < D, kb_ok: offs_kb * 32 < D)."""
    t0 = tile * T
    rows = t0 + tl.arange(0, T)
    offs_o = tl.arange(0, O)
    offs_d = tl.arange(0, DP)
    offs_kb = tl.arange(0, DP // 32)
    return t0, rows, offs_o, offs_d, offs_kb, offs_d < D, offs_kb * 32 < D


@triton.jit
def band_block_range(t0, S, offset, LB, RB, HAS_LB: tl.constexpr, HAS_RB: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, KV_TILE: tl.constexpr = False, SKV=0):
    """The blocks of the other side that a tile meets under the band mask -> (lo, mask_hi, full_lo, full_hi, hi),
    int32 row bounds: blocks [lo, mask_hi) and [max(full_hi, mask_hi), hi) need the mask, [full_lo, full_hi) are
    fully kept. A query tile (rows [t0, t0 + BM)): the KV blocks (BN rows) among S keys. KV_TILE (key rows
    [t0, t0 + BN) of a sequence of SKV keys): the query blocks (BM rows) among S queries that see them, fully kept
    only when the tile lies inside the SKV keys."""
    zero = t0 * 0  # keeps every bound a run-time i32 (both branches of the `if`s below agree in type)
    lo = zero
    hi = zero + S
    full_lo = zero
    if KV_TILE:
        full_hi = zero + (S // BM) * BM
        if HAS_RB:
            lo = (tl.maximum(t0 - offset - RB, 0) // BM) * BM
            full_lo = ((tl.maximum(t0 + BN - 1 - offset - RB, 0) + BM - 1) // BM) * BM
        if HAS_LB:
            hi = tl.minimum(S, tl.maximum(t0 + BN - 1 - offset + LB, 0))
            full_hi = tl.minimum(full_hi, (tl.maximum(t0 - offset + LB - 1, 0) // BM) * BM)
        if t0 + BN > SKV:
            full_hi = zero
    else:
        full_hi = zero + (S // BN) * BN
        if HAS_RB:
            hi = tl.minimum(S, tl.maximum(t0 + BM + offset + RB, 0))
            full_hi = tl.minimum(full_hi, (tl.maximum(t0 + offset + RB + 1, 0) // BN) * BN)
        if HAS_LB:
            lo = (tl.maximum(t0 + offset - LB + 1, 0) // BN) * BN
            full_lo = ((tl.maximum(t0 + BM + offset - LB, 0) + BN - 1) // BN) * BN
    full_lo = tl.maximum(full_lo, lo)
    if full_hi <= full_lo:
        full_lo = hi
        full_hi = hi
    mask_hi = tl.minimum(full_lo, hi)
    return lo, mask_hi, full_lo, full_hi, hi


@triton.jit
def softmax_start(SINK, h, HAS_SINK: tl.constexpr, BM: tl.constexpr, DP: tl.constexpr,
                  LOG2_PS: tl.constexpr = 8.0):
    """The forward's online softmax before any key -> (m_i, l_i, acc): max -inf, sum 0 and a zero accumulator
    [BM, DP]; with a sink (HAS_SINK: SINK holds fp32 logits per query head, h this program's) the sink joins
    first: max = its logit (log2 units), sum = 1 (units of P's scale 2^LOG2_PS)."""
    if HAS_SINK:
        m_i = tl.zeros([BM], tl.float32) + tl.load(SINK + h) * LOG2E
        l_i = tl.full([BM], 2.0 ** LOG2_PS, tl.float32)
    else:
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
    return m_i, l_i, tl.zeros([BM, DP], tl.float32)


@triton.jit
def mask_logits(qk, rows, cols, len_kv, offset, LB, RB, MASK: tl.constexpr, HAS_LB: tl.constexpr,
                HAS_RB: tl.constexpr):
    """qk [BM, BN] of query rows `rows` and key rows `cols` (positions) with the keys at or past len_kv and
    outside the band (offset, LB, RB) set to -inf under MASK (else qk unchanged)."""
    if MASK:
        keep = (cols < len_kv)[None, :]
        if HAS_RB:
            keep = keep & (cols[None, :] <= rows[:, None] + offset + RB)
        if HAS_LB:
            keep = keep & (cols[None, :] > rows[:, None] + offset - LB)
        qk = tl.where(keep, qk, float("-inf"))
    return qk


@triton.jit
def block_max(qk, m_i, qk_scale):
    """The running max (log2 units) after masked logits qk [BM, BN]: max(m_i, max(qk) * qk_scale) (qk_scale > 0,
    so max(qk) * qk_scale == max(qk * qk_scale) exactly)."""
    return tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)


@triton.jit
def softmax_block(qk, m_i, l_i, rows, cols, len_kv, qk_scale, offset, LB, RB, MASK: tl.constexpr,
                  HAS_LB: tl.constexpr, HAS_RB: tl.constexpr, P_MODE: tl.constexpr = 0,
                  LOG2_PS: tl.constexpr = 8.0):
    """One KV block's step of the forward's online softmax (spec section 6), shared by the attention kernels:
    qk fp32 [BM, BN] = Q K^T of query rows `rows` and key rows `cols` (positions in the sequence), m_i the
    running max (log2 units) and l_i the running sum (units of P's scale 2^LOG2_PS) -> (p, alpha, m_new, l_i):
    p = P * 2^LOG2_PS (256 by default) for the rounding of P, alpha the factor that rescales the accumulator,
    the new max and sum. MASK: keys at or past len_kv and outside the band (offset, LB, RB) count as -inf.
    P_LAZY16: the running max becomes the block's max only where none was set yet or the block's exceeds it
    by more than LAZY_THRESHOLD (else it stays, and P reaches up to 2^LAZY_THRESHOLD)."""
    qk = mask_logits(qk, rows, cols, len_kv, offset, LB, RB, MASK, HAS_LB, HAS_RB)
    if P_MODE == P_LAZY16:
        m_blk = tl.max(qk, axis=1) * qk_scale
        m_new = tl.where((m_i == float("-inf")) | (m_blk - m_i > LAZY_THRESHOLD), m_blk, m_i)
    else:
        m_new = block_max(qk, m_i, qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk * qk_scale - (m_use - LOG2_PS)[:, None])  # P * 2^LOG2_PS
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def load_tile(ptrs, row_ok, col_ok, other, MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """A [R, C] tile of ptrs: under MASK the rows where row_ok [R] is false read as `other`, and columns where
    col_ok [C] is false do unless EVEN_D (no column mask there: an always-true mask along the contiguous axis
    would cost the 16-byte loads)."""
    if MASK:
        x = tl.load(ptrs, mask=row_ok[:, None] & (col_ok | EVEN_D)[None, :], other=other)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=col_ok[None, :], other=other)
    return x
