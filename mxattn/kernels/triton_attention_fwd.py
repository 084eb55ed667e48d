"""Triton MXFP8 attention forward (spec section 6) for GPUs without MXFP8 tensor cores (Hopper, Ada, Ampere).

Q and K (row-wise) and V (column-wise) arrive as E4M3 data with compact E8M0 scales. Each tile is dequantized
exactly to BF16 (E4M3 * 2^k fits BF16) and multiplied on the BF16 tensor cores with FP32 accumulation. The
softmax is online over 128-wide KV blocks taken in ascending order, as the reference does; P is quantized to
E4M3 with the fixed scale 256 before the P V product. Output: O (bf16/fp16) and log-sum-exp stats (fp32).

Variable lengths (`seq`, a `mxattn.seqinfo.SeqInfo`): the grid is (query tiles of the longest sequence,
sequences * heads); `seq_prologue` gives each program its sequence's rows and lengths, every index below it is
relative to the sequence start, and programs whose tile starts past their sequence's end exit at once (in a
padded batch after writing O = 0 and stats = -inf on the padding rows of their tile). So a sequence's numbers
are those of a dense call on that sequence alone, bit for bit.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..runtime.triton_launch import launch
from .triton_common import (LN2, LOG2E, band_block_range, dequant_cols, dequant_rows,
                            load_tile, program_prologue, quantize_cols, quantize_rows, round_p, seq_prologue,
                            softmax_block, softmax_start, tile_offsets)
from ..runtime.recipe_flags import DEFAULT_FLAGS, KernelRecipe
from ..seqinfo import SeqInfo, grid_rows, grid_sequences, kernel_cu_seqlens, kernel_flags
from .triton_quantize import check_cu_seqlens, padded_head_dim, row_tiles, seq_programs

BLOCK_N = 128  # KV block of the online softmax: fixed by the recipe, not a tuning knob




@triton.jit
def _attend_kv_block(acc, m_i, l_i, q, k_ptrs, ks_ptrs, v_ptrs, vs_ptrs, j, rows, offs_n, offs_d, offs_kb,
                     stride_kn, stride_ksn, stride_vn, stride_vsn, len_kv, D, qk_scale, offset, LB, RB,
                     MASK: tl.constexpr, HAS_LB: tl.constexpr, HAS_RB: tl.constexpr, BN: tl.constexpr,
                     DP: tl.constexpr, EVEN_D: tl.constexpr, KV_BF16: tl.constexpr, QDQ: tl.constexpr,
                     P_MODE: tl.constexpr, LOG2_PS: tl.constexpr, V_RAW: tl.constexpr, FLOOR: tl.constexpr):
    """One step of the online softmax over KV block j, rows [n0, n0 + BN) with n0 = j * BN. K and V tiles are
    either FP8 (K row-wise, V column-wise seq-major) dequantized on chip, (KV_BF16) their exact bf16
    dequantizations read as they are, or (QDQ) the caller's K and V read as they are and quantized here, K
    row-wise and V column-wise in blocks of 32 rows from n0 (a multiple of 32 from the sequence's start, as the
    quantizer's blocks), then dequantized: the same bf16 tiles the quantizer's row_dequant / col_dequant hold.
    The softmax arithmetic is `softmax_block`'s. MASK: the block needs the band/length mask (else every element
    is kept). Recipe variants (`recipe_flags`): P_MODE / LOG2_PS how P is scaled and rounded, V_RAW V read as a
    [B,H,S,D] tensor and rounded to bf16 (never quantized; the caller's in QDQ, a bf16 copy otherwise), FLOOR
    the OCP scale rule where this kernel quantizes (QDQ)."""
    n0 = j * BN  # from the block index, so the compiler knows n0's alignment (16-byte loads along V's rows)
    cols = n0 + offs_n
    d_ok = offs_d < D
    kt = load_tile(k_ptrs + n0 * stride_kn, cols < len_kv, d_ok, 0.0, MASK, EVEN_D)
    if QDQ:
        kq, ke = quantize_rows(kt.to(tl.float32), BN, DP, FLOOR)
        kt = dequant_rows(kq, ke.to(tl.uint8), BN, DP)
    elif not KV_BF16:
        ks = load_tile(ks_ptrs + n0 * stride_ksn, cols < len_kv, offs_kb * 32 < D, 127, MASK, EVEN_D)
        kt = dequant_rows(kt, ks, BN, DP)
    p, alpha, m_new, l_i = softmax_block(tl.dot(q, tl.trans(kt)), m_i, l_i, rows, cols, len_kv, qk_scale, offset,
                                         LB, RB, MASK, HAS_LB, HAS_RB, P_MODE, LOG2_PS)
    if V_RAW:
        vt = load_tile(v_ptrs + n0 * stride_vn, cols < len_kv, d_ok, 0.0, MASK, EVEN_D).to(tl.bfloat16)
    elif QDQ:
        vt = load_tile(v_ptrs + n0 * stride_vn, cols < len_kv, d_ok, 0.0, MASK, EVEN_D)
        vq, ve = quantize_cols(vt.to(tl.float32), BN, DP, FLOOR)
        vt = dequant_cols(vq, ve.to(tl.uint8), BN, DP)
    elif KV_BF16:
        vt = load_tile(v_ptrs + n0 * stride_vn, cols < len_kv, d_ok, 0.0, MASK, EVEN_D)
    else:
        # V's rows are zero up to the end of the sequence's last block: a whole-block mask keeps 16-byte loads
        vt = load_tile(v_ptrs + n0 * stride_vn, cols < tl.cdiv(len_kv, 32) * 32, d_ok, 0.0, MASK, EVEN_D)
        vs_blk = n0 // 32 + tl.arange(0, BN // 32)
        vs = load_tile(vs_ptrs + (n0 // 32) * stride_vsn, vs_blk * 32 < len_kv, d_ok, 127, MASK, EVEN_D)
        vt = dequant_cols(vt, vs, BN, DP)
    acc = acc * alpha[:, None] + tl.dot(round_p(p, P_MODE), vt)
    return acc, m_new, l_i


@triton.jit
def _attn_fwd_kernel(
        Q, QS, K, KS, V, VS, O, LSE, CU_Q, CU_KV, SINK,
        sqb, sqh, sqs, sqsb, sqsh, sqss,
        skb, skh, sks, sksb, sksh, skss,
        svb, svh, svs, svd, svsb, svsh, svss,
        sob, soh, sos, slb, slh, sls,
        HQ, GROUP, SQ, SKV, D, qk_scale, offset, LB, RB,
        HAS_LB: tl.constexpr, HAS_RB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
        EVEN_D: tl.constexpr, VARLEN: tl.constexpr, PACKED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
        HAS_SINK: tl.constexpr,
        KV_BF16: tl.constexpr, QDQ: tl.constexpr,
        P_MODE: tl.constexpr = 0, LOG2_PS: tl.constexpr = 8.0, V_RAW: tl.constexpr = False,
        FLOOR: tl.constexpr = False):
    """Grid (query tiles, sequences * HQ). Q row-wise FP8 with scales [B,H,S,DP/32-ish]. K, V: FP8 (K
    row-wise like Q; V column-wise, data seq-major [B,H,D,L] (`SeqMajorColumns`, strides svb, svh, svs = 1,
    svd), scales [B,H,L/32,D], segmented for a packed batch), or (KV_BF16) the exact bf16 dequantizations
    [B,H,S,D] of K row-wise and V column-wise (KS, VS unread). Every other tensor has a unit stride along D.
    QDQ: Q, K, V are the caller's [B,H,S,D] tensors (bf16/fp16/fp32; QS, KS, VS unread), quantized tile by tile
    here (Q row-wise once, K and V per KV block: `_attend_kv_block`) into the bf16 tiles the other paths read, so
    the numbers equal theirs bit for bit; worth it where one query tile covers the sequence (decode steps).
    SQ, SKV: the tensors' row counts;
    len_q, len_kv: the sequence's. HAS_SINK: SINK holds fp32 [HQ] sink logits; the online softmax starts from
    them (max = sink, sum = 1). P_MODE, LOG2_PS, V_RAW, FLOOR: the recipe (`_attend_kv_block`; V_RAW: V
    [B,H,S,D] like K, VS unread)."""
    tile, hq, hk, bt, q0, kv0, len_q, len_kv, qb0, kvb0, offset, n_out = program_prologue(
        CU_Q, CU_KV, HQ, GROUP, SQ, SKV, offset, VARLEN, PACKED, BOTTOM_RIGHT, True, HAS_RB)
    m0, rows, offs_n, offs_d, offs_kb, _, _ = tile_offsets(tile, D, BM, BN, DP)
    if VARLEN:
        if m0 >= len_q:  # no query row of this sequence in the tile
            if not PACKED:
                _store_out(O, LSE, bt, hq, q0, rows, offs_d, sob, soh, sos, slb, slh, sls, n_out, D,
                           tl.zeros([BM, DP], tl.float32), tl.full([BM], float("-inf"), tl.float32))
            return

    q_rows = (rows < len_q)[:, None]
    q = tl.load(Q + bt * sqb + hq * sqh + q0 * sqs + rows[:, None] * sqs + offs_d[None, :],
                mask=q_rows & ((offs_d < D) | EVEN_D)[None, :], other=0.0)
    if QDQ:
        qq, qe = quantize_rows(q.to(tl.float32), BM, DP, FLOOR)
        q = dequant_rows(qq, qe.to(tl.uint8), BM, DP)
    else:
        qs = tl.load(QS + bt * sqsb + hq * sqsh + q0 * sqss + rows[:, None] * sqss + offs_kb[None, :],
                     mask=q_rows & (offs_kb * 32 < D)[None, :], other=127)
        q = dequant_rows(q, qs, BM, DP)

    k_ptrs = K + bt * skb + hk * skh + kv0 * sks + offs_n[:, None] * sks + offs_d[None, :]
    ks_ptrs = KS + bt * sksb + hk * sksh + kv0 * skss + offs_n[:, None] * skss + offs_kb[None, :]
    if KV_BF16 or QDQ or V_RAW:  # [B,H,S,D] like K
        v_row0 = kv0
    else:  # seq-major FP8 (svs = 1): each sequence from its first block's column
        v_row0 = kvb0 * 32
    v_ptrs = V + bt * svb + hk * svh + v_row0 * svs + offs_n[:, None] * svs + offs_d[None, :] * svd
    vs_ptrs = VS + bt * svsb + hk * svsh + kvb0 * svss + tl.arange(0, BN // 32)[:, None] * svss + offs_d[None, :]

    # KV range touched by rows [m0, m0 + BM) and the sub-range where no element is masked
    lo, mask_hi, full_lo, full_hi, hi = band_block_range(m0, len_kv, offset, LB, RB, HAS_LB, HAS_RB, BM, BN)

    m_i, l_i, acc = softmax_start(SINK, hq, HAS_SINK, BM, DP, LOG2_PS)
    args = (q, k_ptrs, ks_ptrs, v_ptrs, vs_ptrs)
    strides = (sks, skss, svs, svss, len_kv, D, qk_scale, offset, LB, RB)
    for j in range(lo // BN, tl.cdiv(mask_hi, BN)):
        acc, m_i, l_i = _attend_kv_block(acc, m_i, l_i, *args, j, rows, offs_n, offs_d, offs_kb, *strides,
                                         True, HAS_LB, HAS_RB, BN, DP, EVEN_D, KV_BF16, QDQ, P_MODE, LOG2_PS, V_RAW, FLOOR)
    for j in range(full_lo // BN, full_hi // BN):
        acc, m_i, l_i = _attend_kv_block(acc, m_i, l_i, *args, j, rows, offs_n, offs_d, offs_kb, *strides,
                                         False, HAS_LB, HAS_RB, BN, DP, EVEN_D, KV_BF16, QDQ, P_MODE, LOG2_PS, V_RAW, FLOOR)
    for j in range(tl.cdiv(tl.maximum(full_hi, mask_hi), BN), tl.cdiv(hi, BN)):  # (start: a multiple of BN, or hi)
        acc, m_i, l_i = _attend_kv_block(acc, m_i, l_i, *args, j, rows, offs_n, offs_d, offs_kb, *strides,
                                         True, HAS_LB, HAS_RB, BN, DP, EVEN_D, KV_BF16, QDQ, P_MODE, LOG2_PS, V_RAW, FLOOR)

    has = l_i != 0.0  # a NaN row (l_i NaN) stays NaN
    if VARLEN:
        has = has & (rows < len_q)  # padding rows of a padded tile saw zero queries, not no keys
    denom = tl.where(has, l_i, 1.0)  # both acc and l_i carry the factor P_SCALE
    o = tl.where(has[:, None], acc / denom[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.math.log2(denom) - LOG2_PS) * LN2, float("-inf"))
    _store_out(O, LSE, bt, hq, q0, rows, offs_d, sob, soh, sos, slb, slh, sls, n_out, D, o, lse)


@triton.jit
def _store_out(O, LSE, bt, hq, q0, offs_m, offs_d, sob, soh, sos, slb, slh, sls, n_out, D, o, lse):
    """Rows offs_m < n_out of O (o, fp32 [BM, DP], cast to O's dtype; unit stride along D) and of the stats
    (lse [BM])."""
    tl.store(O + bt * sob + hq * soh + q0 * sos + offs_m[:, None] * sos + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=(offs_m < n_out)[:, None] & (offs_d < D)[None, :])
    tl.store(LSE + bt * slb + hq * slh + q0 * sls + offs_m * sls, lse, mask=offs_m < n_out)


#: (BLOCK_M, num_warps, num_stages) of the forward kernel by padded head dim (the KV block is BLOCK_N)
FWD_CONFIGS = {32: (128, 8, 3), 64: (64, 4, 2), 128: (128, 8, 3), 256: (64, 8, 2)}


#: (BLOCK_M, num_warps, num_stages) of the forward kernel on bf16 K/V (smem operands Triton pipelines; head
#: dims up to 128: three stages of 128-row bf16 K and V tiles fill the shared memory). The fastest measured; at
#: D64 and D32 one warp group per program (two programs per SM) beats 8 warps, dense and causal
BF16_FWD_CONFIGS = {32: (128, 4, 3), 64: (64, 4, 3), 128: (128, 8, 3)}
#: bytes of bf16 scratch (exact dequantizations) one data path may hold at once: the forward's K + V copies, the
#: backward's largest head chunk (`triton_attention_bwd.bwd_streams_bf16`); beyond it the kernels read FP8
SCRATCH_BUDGET_BYTES = 512 << 20


def fwd_streams_bf16(batch: int, heads_kv: int, rows_kv: int, head_dim: int) -> bool:
    """The problem's choice of forward data path: True when K and V should be dequantized to bf16 in HBM by
    the quantizer (exact, one extra write of 4 bytes per K/V element pair, freed after the kernel) and read as
    plain bf16 operands, which Triton pipelines into the tensor cores (faster than dequantizing FP8 on chip);
    False (FP8 dequantized on chip, no scratch) for head
    dims above 128 or when the scratch would exceed SCRATCH_BUDGET_BYTES. Same numbers either way."""
    dp = padded_head_dim(head_dim)
    return dp <= max(BF16_FWD_CONFIGS) and 2 * 2 * batch * heads_kv * rows_kv * head_dim <= SCRATCH_BUDGET_BYTES


def _fwd_config(dp: int, v_raw: bool = False):
    """(BLOCK_M, num_warps, num_stages) for padded head dim dp (v_raw: V read in bf16, twice the FP8 tile's
    bytes; above D 128 its tiles then take one stage: two of 128 x 256 bf16 V and FP8 K tiles exceed the H100's
    shared memory)."""
    bm, warps, stages = FWD_CONFIGS[dp]
    return (bm, warps, 1) if v_raw and dp > 128 else (bm, warps, stages)


def _check_seq_major_v(v, batch: int, heads: int, rows: int, d: int):
    """(data, scale bytes) of V's column-wise copy `v` (a SeqMajorColumns) after checking its shapes against
    K's [batch, heads, rows, d]; raises ValueError before the launch."""
    data, scale = getattr(v, "data", None), getattr(v, "scale", None)
    if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise ValueError("v must be V's column-wise copy as SeqMajorColumns (quantize_rowcol(v, col_seq_major=True)"
                         f".col_seq_major), got {type(v).__name__}")
    n_blocks = scale.shape[2] if scale.dim() == 4 else -1
    if tuple(scale.shape) != (batch, heads, n_blocks, d) or n_blocks * 32 < rows or \
            tuple(data.shape) != (batch, heads, d, n_blocks * 32):
        raise ValueError(f"v.data must be [{batch}, {heads}, {d}, L] and v.scale [{batch}, {heads}, L / 32, {d}] "
                         f"with L >= {rows}, got {tuple(data.shape)} and {tuple(scale.shape)}")
    return data, scale.view(torch.uint8)


def _check_sink(sink: Optional[torch.Tensor], q: torch.Tensor) -> None:
    """A sink must be None or a contiguous fp32 [Hq] tensor on q's device ([B,Hq,Sq,D])."""
    if sink is not None and (sink.dtype != torch.float32 or tuple(sink.shape) != (q.shape[1],)
                             or not sink.is_contiguous() or sink.device != q.device):
        raise ValueError(f"sink must be a contiguous float32 tensor of shape ({q.shape[1]},) on "
                         f"{q.device}, got {sink.dtype} {tuple(sink.shape)} on {sink.device}")


def _unit_d(name: str, t: torch.Tensor) -> None:
    if t.shape[3] > 1 and t.stride(3) != 1:
        raise ValueError(f"{name} must have unit stride along its last axis, got strides {tuple(t.stride())}")


def attention_fwd(q_data, q_scale, k_data, k_scale, v, *, softmax_scale: float,
                  offset: int, left_bound, right_bound, out: torch.Tensor, stats: torch.Tensor,
                  config=None, seq=None, bottom_right: bool = False, sink: Optional[torch.Tensor] = None,
                  flags: KernelRecipe = DEFAULT_FLAGS) -> None:
    """Launch the forward kernel.

    q_data [B,Hq,Sq,D] e4m3, q_scale [B,Hq,Sq,ceil(D/32)] e8m0 (row-wise). K and V in one of two forms:
    FP8 (dequantized on chip): k_data/k_scale like q's with Hkv heads and Skv rows, and v V's column-wise copy
    as `SeqMajorColumns` (quantize_rowcol(v, col_seq_major=True): data [B,Hkv,D,L] e4m3, scales
    [B,Hkv,L/32,D] e8m0); or bf16 (k_scale None, see `fwd_streams_bf16`): k_data the exact bf16 dequantization
    [B,Hkv,Skv,D] of K's row-wise copy and v that of V's column-wise copy (quantize_rowcol's row_dequant and
    col_dequant), both with a unit stride along D.
    Writes out [B,Hq,Sq,D] (bf16/fp16) and stats [B,Hq,Sq,1] fp32 (natural log-sum-exp, -inf for empty rows).
    Every tensor needs a unit stride along its last axis. offset: diagonal offset (0 top_left, Skv-Sq
    bottom_right). config: optional (BLOCK_M, num_warps, num_stages) override (benchmark sweeps).
    seq: optional SeqInfo-like object (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed)
    making the call variable-length (module docstring); a packed batch has B = 1 and V's scales segmented
    ([1,Hkv,Skv//32 + n_seq,D]) as `SeqMajorColumns` describes. The band mask then applies per sequence:
    bottom_right=True takes each sequence's len_kv - len_q as its offset (offset must then be 0), else offset is used (0 = top_left).
    sink: optional fp32 [Hq] contiguous sink logits (attention sinks): they join every row's softmax
    denominator and the stats; a row with no key then gets O = 0 and stats = sink.
    flags: the recipe's switches (`recipe_flags`); with flags.v_raw, v is V rounded to bf16 [B,Hkv,Skv,D] (unit
    stride along D) with K in either form.
    """
    _check_sink(sink, q_data)
    B, HQ, SQ, D = q_data.shape
    HKV, SKV = k_data.shape[1], k_data.shape[2]
    seq = check_seq(seq, q_data, k_data, bottom_right, offset)
    dp = padded_head_dim(D)
    u8 = torch.uint8
    kv_bf16 = k_scale is None
    if kv_bf16:
        if dp > max(BF16_FWD_CONFIGS) or k_data.dtype != torch.bfloat16 or not isinstance(v, torch.Tensor) or \
                v.dtype != torch.bfloat16 or v.shape != k_data.shape:
            raise ValueError(f"with k_scale None, k_data and v must be bf16 tensors of one shape "
                             f"[B, Hkv, Skv, D <= {max(BF16_FWD_CONFIGS)}], got {k_data.dtype} {tuple(k_data.shape)} "
                             f"and {getattr(v, 'dtype', type(v).__name__)} {tuple(getattr(v, 'shape', ()))}")
        v_data, vs, ks = v, q_scale.view(u8), q_scale.view(u8)  # (scales unread)
        v_strides = v.stride()[:3] + (1,)
        bm, warps, stages = config if config is not None else BF16_FWD_CONFIGS[dp]
    else:
        ks = k_scale.view(u8)
        if flags.v_raw:
            if not isinstance(v, torch.Tensor) or v.dtype != torch.bfloat16 or v.shape != k_data.shape:
                raise ValueError(f"with flags.v_raw, v must be a bf16 tensor of k_data's shape {tuple(k_data.shape)}, "
                                 f"got {getattr(v, 'dtype', type(v).__name__)} {tuple(getattr(v, 'shape', ()))}")
            v_data, vs, v_strides = v, ks, v.stride()[:3] + (1,)  # (vs unread)
        else:
            v_data, vs = _check_seq_major_v(v, B, HKV, SKV, D)
            v_strides = v_data.stride()[:2] + (1, v_data.stride(2))
        bm, warps, stages = config if config is not None else _fwd_config(dp, flags.v_raw)
    qs = q_scale.view(u8)
    for name, t in (("q_data", q_data), ("k_data", k_data), ("v.data", v_data), ("out", out), ("q_scale", qs),
                    ("k_scale", ks), ("v.scale", vs)):
        _unit_d(name, t)
    _launch_fwd(q_data, qs, k_data, ks, v_data, vs, v_strides, out, stats, sink, seq, softmax_scale, offset,
                left_bound, right_bound, bottom_right, (bm, warps, stages), kv_bf16=kv_bf16, qdq=False, flags=flags)


def _launch_fwd(q, qs, k, ks, v, vs, v_strides, out, stats, sink, seq, softmax_scale, offset, left_bound,
                right_bound, bottom_right, config, *, kv_bf16: bool, qdq: bool, flags: KernelRecipe) -> None:
    """The forward kernel's launch (arguments checked by the callers; seq: `check_seq`'s, stats stands in for
    the lengths of a dense call)."""
    bm, warps, stages = config
    B, HQ, SQ, D = q.shape
    HKV, SKV = k.shape[1], k.shape[2]
    dp = padded_head_dim(D)
    launch(
        _attn_fwd_kernel, (row_tiles(grid_rows(seq, "q", SQ), bm), seq_programs(grid_sequences(seq, B), HQ)),
        q, qs, k, ks, v, vs, out, stats, *kernel_cu_seqlens(seq, stats), stats if sink is None else sink,
        *q.stride()[:3], *qs.stride()[:3],
        *k.stride()[:3], *ks.stride()[:3],
        *v_strides, *vs.stride()[:3],
        *out.stride()[:3], *stats.stride()[:3],
        HQ, HQ // HKV, SQ, SKV, D, float(softmax_scale) * LOG2E.value, int(offset),
        0 if left_bound is None else int(left_bound), 0 if right_bound is None else int(right_bound),
        HAS_LB=left_bound is not None, HAS_RB=right_bound is not None,
        BM=bm, BN=BLOCK_N, DP=dp, EVEN_D=dp == D, **kernel_flags(seq, bottom_right), HAS_SINK=sink is not None,
        KV_BF16=kv_bf16, QDQ=qdq, **flags.fwd(), num_warps=warps, num_stages=stages)


def quantizing_fwd_config(rows_q: int, head_dim: int, dtype: torch.dtype):
    """(BLOCK_M, num_warps, num_stages) of `attention_fwd_quantizing` for queries of up to rows_q rows per
    sequence (its longest), or None where that path does not apply: head dims above 128, or queries beyond one
    tile (each tile would quantize K and V again; the quantizer's single pass is cheaper there). The tile and
    warps are the bf16 path's (`BF16_FWD_CONFIGS`): another tile shape issues other MMA instructions, whose
    FP32 sums may differ in the last bit, and the two paths must agree bit for bit. Shared memory holds two
    stages of 16-bit K and V tiles, one of fp32 ones."""
    dp = padded_head_dim(head_dim)
    if dp > max(BF16_FWD_CONFIGS) or rows_q > BF16_FWD_CONFIGS[dp][0]:
        return None
    bm, warps, _ = BF16_FWD_CONFIGS[dp]
    return bm, warps, 1 if dtype == torch.float32 else 2


def attention_fwd_quantizing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                             offset: int, left_bound, right_bound, out: torch.Tensor, stats: torch.Tensor,
                             seq=None, bottom_right: bool = False, sink: Optional[torch.Tensor] = None,
                             config=None, flags: KernelRecipe = DEFAULT_FLAGS) -> None:
    """The forward in one launch, without the quantizer: q [B,Hq,Sq,D], k and v [B,Hkv,Skv,D] bf16/fp16/fp32
    (the caller's tensors, unit stride along D, any other strides) are quantized inside the kernel (Q row-wise,
    K row-wise, V column-wise in blocks of 32 rows from each sequence's start) into exactly the bf16 tiles
    `attention_fwd` reads from the quantizer, so out and stats equal its results bit for bit. Meant for calls
    without a backward whose queries fit one tile (`quantizing_fwd_config`: decode steps, short chunks); other
    arguments as `attention_fwd`'s (flags: the recipe; with flags.v_raw V is rounded to bf16 as it is read).
    Raises ValueError where the path does not apply."""
    B, HQ, SQ, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or HQ % max(k.shape[1], 1):
        raise ValueError(f"k and v must be [B={B}, Hkv, Skv, D={D}] with Hkv dividing {HQ}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        _unit_d(name, t)
    seq = check_seq(seq, q, k, bottom_right, offset)
    rows = grid_rows(seq, "q", SQ)
    if config is None:
        config = quantizing_fwd_config(rows, D, max(q.dtype, k.dtype, v.dtype, key=lambda t: t.itemsize))
        if config is None:
            tile = BF16_FWD_CONFIGS.get(padded_head_dim(D), (0,))[0]
            raise ValueError(f"attention_fwd_quantizing takes head dims up to {max(BF16_FWD_CONFIGS)} and the "
                             f"query rows of one tile per sequence ({tile} at D={D}), got D={D} and {rows} rows")
    _check_sink(sink, q)
    _launch_fwd(q, q, k, k, v, v, v.stride()[:3] + (1,), out, stats, sink, seq, softmax_scale, offset, left_bound,
                right_bound, bottom_right, config, kv_bf16=False, qdq=True, flags=flags)


def check_seq(seq: Optional[SeqInfo], q: torch.Tensor, k: torch.Tensor, bottom_right: bool = False,
              offset: int = 0) -> Optional[SeqInfo]:
    """Host checks of an attention kernel's variable-length arguments; returns seq. seq: None (dense) or a
    SeqInfo-like object (cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, packed); q [B,Hq,Sq,D],
    k [B,Hkv,Skv,D] (data tensors). The launches read it through `mxattn.seqinfo`'s grid_rows, grid_sequences,
    kernel_cu_seqlens and kernel_flags. Raises ValueError/TypeError before any launch."""
    if seq is None:
        if bottom_right:
            raise ValueError("bottom_right=True is for variable-length calls (seq); a dense call passes its "
                             "offset (Skv - Sq)")
        return None
    packed = bool(seq.packed)
    check_cu_seqlens(seq.cu_seqlens_q, "seq.cu_seqlens_q", q, packed)
    check_cu_seqlens(seq.cu_seqlens_kv, "seq.cu_seqlens_kv", k, packed)
    if seq.cu_seqlens_q.numel() != seq.cu_seqlens_kv.numel():
        raise ValueError(f"seq.cu_seqlens_q and seq.cu_seqlens_kv describe different batch sizes: "
                         f"{seq.cu_seqlens_q.numel() - 1} and {seq.cu_seqlens_kv.numel() - 1}")
    if bottom_right and offset != 0:
        raise ValueError(f"with bottom_right=True each sequence has its own offset; pass offset=0, got {offset}")
    return seq


__all__ = ["attention_fwd", "attention_fwd_quantizing", "quantizing_fwd_config", "fwd_streams_bf16", "check_seq", "band_block_range", "load_tile",
           "program_prologue", "SCRATCH_BUDGET_BYTES", "seq_prologue", "BLOCK_N", "LOG2E"]
