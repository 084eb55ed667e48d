"""The backward's prep pass (spec section 7): delta = rowsum(O * dO) in FP32 and, for the bf16-scratch data
path (mode "pre"), the streamed operands dequantized exactly to bf16 scratch: dO quantized to MXFP8 both ways
and Q's copies (`bwd_prep`, before the dK/dV kernel), K's and V's copies (`kv_prep`, before the dQ kernel).
One kernel (`_bwd_prep_kernel`, its KIND choosing the side) and its host-side launches; the dK/dV and dQ
kernels that read what it writes are in `triton_attention_bwd`.
"""

import torch
import triton
import triton.language as tl

from ..runtime.triton_launch import cdiv, launch
from .triton_bwd_tiles import _col_tile, _row_tile
from .triton_common import MX_BLOCK, dequant_cols, dequant_rows, load_tile, quantize_cols, quantize_rows, seq_span
from .triton_quantize import padded_head_dim, row_tiles, seq_programs
from ..seqinfo import grid_rows, grid_sequences, kernel_flags


#: zero rows after each sequence of a packed batch's gapped scratch (`bwd_prep` / `kv_prep` gap=PACKED_GAP, for the
#: Gluon backward kernels, whose TMA tiles start inside a sequence and span at most this many rows: the dK/dV
#: kernel's query blocks (32 or 64 rows), the dQ kernel's query tiles (two of 64) and KV blocks (64 or 128))
PACKED_GAP = 128

#: what `_bwd_prep_kernel` does (its KIND)
PREP_DELTA, PREP_Q, PREP_KV = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _bwd_prep_kernel(A, B, DELTA, RD, RS, CD, CS, OUT_A, OUT_B, OUT_R, OUT_C, CU,
                     sab, sah, sas, sbb, sbh, sbs, srdb, srdh, srds, srsb, srsh, srss, scsb, scsh, scss,
                     scdb, scdh, scds, HQ, H0, HC, S, D,
                     DP: tl.constexpr, BD: tl.constexpr, KIND: tl.constexpr, VARLEN: tl.constexpr,
                     PACKED: tl.constexpr, FLOOR: tl.constexpr = False, WITH_V: tl.constexpr = True,
                     GAP: tl.constexpr = 0):
    """The "pre" backward's operands for heads H0 .. H0 + HC, in one pass over 32 rows of one head (grid
    (32-row tiles, sequences * HC)); every input has a unit stride along D, scratch outputs are contiguous
    [B, HC, S, D] bf16, column-wise scales [.., blocks, D] (segmented for a packed batch).
    KIND PREP_Q (query side): A = O, B = dO: delta = rowsum(O * dO) fp32 into DELTA [B, HQ, S]; dO quantized
    both ways (as `quantize_rowcol` does) and dequantized into OUT_A (row-wise), OUT_B (column-wise); Q's saved
    copies (RD/RS row-wise, CD/CS column-wise) dequantized into OUT_R, OUT_C.
    KIND PREP_KV (key side): A/B = V's row-wise data and scales -> OUT_A; K's copies (RD/RS, CD/CS) -> OUT_R,
    OUT_C. KIND PREP_DELTA: delta alone (the FP8-streaming backward).
    Rows past a padded sequence's length get delta 0 and zeros; a packed batch's rows between sequences are
    not written. GAP (a packed batch's scratch for the Gluon kernels, `PACKED_GAP`): sequence b's scratch rows
    start at cu[b] + GAP * b and its GAP rows after its last are written as zeros (scratch [1, HC, S + GAP * B,
    D]; delta stays packed), so a TMA tile that starts inside a sequence reads zeros past its end, never the next
    sequence's rows. delta sums BD-column slices in order (fp32). FLOOR: dO quantized with the OCP scale rule;
    WITH_V False: PREP_KV skips V (the bf16-V recipe reads V as it is)."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HC).to(tl.int64)
    hl = (pid_bh % HC).to(tl.int64)  # head within the chunk (scratch)
    h = hl + H0  # head of the full tensors
    bt, start, length, blk0 = seq_span(CU, b, S, VARLEN, PACKED)
    if PACKED:
        if pid_s * MX_BLOCK >= length + GAP:
            return
        n_out = length + GAP
        n_delta = length
    else:
        n_out = S
        n_delta = S
    offs_s = pid_s * MX_BLOCK + tl.arange(0, MX_BLOCK)
    rows = start + offs_s
    if GAP > 0:  # the gapped scratch: sequence b's rows shifted by GAP * b, S + GAP * (sequences) rows in all
        rows_out = rows + GAP * b
        s_out = S + GAP * (tl.num_programs(1) // HC)
    else:
        rows_out = rows
        s_out = S
    row_ok = offs_s < length
    delta = tl.zeros((MX_BLOCK,), dtype=tl.float32)
    blk_ok = pid_s * MX_BLOCK + tl.arange(0, 1) < length  # this tile's one column-wise block
    for d0 in range(0, DP, BD):  # D in slices of BD columns (whole MXFP8 blocks): fewer live registers
        offs_d = d0 + tl.arange(0, BD)
        offs_k = d0 // MX_BLOCK + tl.arange(0, BD // MX_BLOCK)
        c_ok, kb_ok = offs_d < D, offs_k * MX_BLOCK < D
        st = (offs_s < n_out)[:, None] & c_ok[None, :]
        out = ((bt * HC + hl) * s_out + rows_out)[:, None] * D + offs_d[None, :]
        if KIND == PREP_KV:
            if WITH_V:
                v_r = _row_tile(A + bt * sab + h * sah + rows[:, None] * sas + offs_d[None, :],
                                B + bt * sbb + h * sbh + rows[:, None] * sbs + offs_k[None, :],
                                row_ok, c_ok, kb_ok, True, False, MX_BLOCK, BD, False)
                tl.store(OUT_A + out, v_r, mask=st)
        else:
            o = load_tile(A + bt * sab + h * sah + rows[:, None] * sas + offs_d[None, :], row_ok, c_ok, 0.0, True,
                          False)
            do = load_tile(B + bt * sbb + h * sbh + rows[:, None] * sbs + offs_d[None, :], row_ok, c_ok, 0.0, True,
                           False).to(tl.float32)
            delta += tl.sum(o.to(tl.float32) * do, axis=1)
            if KIND == PREP_Q:
                q, e = quantize_rows(do, MX_BLOCK, BD, FLOOR)
                tl.store(OUT_A + out, dequant_rows(q, e.to(tl.uint8), MX_BLOCK, BD), mask=st)
                q, e = quantize_cols(do, MX_BLOCK, BD, FLOOR)
                tl.store(OUT_B + out, dequant_cols(q, e.to(tl.uint8), MX_BLOCK, BD), mask=st)
        if KIND != PREP_DELTA:
            x_r = _row_tile(RD + bt * srdb + h * srdh + rows[:, None] * srds + offs_d[None, :],
                            RS + bt * srsb + h * srsh + rows[:, None] * srss + offs_k[None, :],
                            row_ok, c_ok, kb_ok, True, False, MX_BLOCK, BD, False)
            tl.store(OUT_R + out, x_r, mask=st)
            x_c = _col_tile(CD + bt * scdb + h * scdh + rows[:, None] * scds + offs_d[None, :],
                            CS + bt * scsb + h * scsh + (blk0 + pid_s) * scss + offs_d[None, :],
                            row_ok, blk_ok, c_ok, True, False, MX_BLOCK, BD, False)
            tl.store(OUT_C + out, x_c, mask=st)
    if KIND != PREP_KV:
        tl.store(DELTA + (bt * HQ + h) * S + rows, delta, mask=offs_s < n_delta)


#: (BD, num_warps) of `_bwd_prep_kernel` by padded head dim: whole rows up to 128 columns (faster than 64-column
#: slices)
PREP_TILES = {32: (32, 2), 64: (64, 4), 128: (128, 4), 256: (256, 8)}


def _prep(kind: int, a, b_, delta, row, col, h0: int, h1: int, rows: int, n_tiles: int, seq, cu, n_out: int,
          floor: bool = False, with_v: bool = True, gap: int = 0):
    """One launch of `_bwd_prep_kernel` for heads h0 .. h1 of [B, H, rows, D] inputs -> its n_out bf16 scratch
    tensors [B, h1 - h0, rows, D] (OUT_A, OUT_B, OUT_R, OUT_C order, the first n_out of them; PREP_KV without
    V: OUT_R, OUT_C). seq, cu: the lengths (`check_seq`) and (cu_q, cu_kv) as the launch passes them
    (`kernel_cu_seqlens`). floor, with_v: the kernel's FLOOR and WITH_V. gap: the kernel's GAP (a packed
    batch's gapped scratch, [1, h1 - h0, rows + gap * sequences, D])."""
    B, D = a.shape[0], row.data.shape[3] if row is not None else a.shape[3]
    dp = padded_head_dim(D)
    bd, warps = PREP_TILES[dp]
    n_seq = grid_sequences(seq, B)
    if gap:
        if seq is None or not seq.packed:
            raise ValueError("gap is for a packed batch's scratch (seq.packed)")
        n_tiles += cdiv(gap, MX_BLOCK.value)
    out_rows = rows + gap * n_seq
    out = [torch.empty((B, h1 - h0, out_rows, D), dtype=torch.bfloat16, device=a.device) for _ in range(n_out)]
    if row is not None:
        rs, cs = row.scale.view(torch.uint8), col.scale.view(torch.uint8)
        copies = (row.data, rs, col.data, cs)
        strides = (*row.data.stride()[:3], *rs.stride()[:3], *cs.stride()[:3], *col.data.stride()[:3])
    else:  # (stand-ins the kernel never reads)
        copies, strides = (a,) * 4, (0,) * 12
    if kind == PREP_KV.value and not with_v:  # OUT_R, OUT_C (OUT_A unwritten)
        outs = [a, a, out[0], out[1]]
    elif kind == PREP_KV.value:  # OUT_A, then OUT_R, OUT_C
        outs = [out[0], a, out[1], out[2]]
    else:
        outs = out + [a] * (4 - n_out)
    launch(_bwd_prep_kernel, (n_tiles, seq_programs(n_seq, h1 - h0)), a, b_, delta, *copies,
           *outs, cu[1] if kind == PREP_KV.value else cu[0],
           *a.stride()[:3], *b_.stride()[:3], *strides, delta.shape[1], h0, h1 - h0, rows, D, DP=dp, BD=bd,
           KIND=kind, **kernel_flags(seq), FLOOR=bool(floor), WITH_V=bool(with_v), GAP=int(gap), num_warps=warps)
    return out


def bwd_prep(o, do, q_row, q_col, delta, h0: int, h1: int, seq, cu, scratch: bool = True, floor: bool = False,
             gap: int = 0):
    """The "pre" backward's query-side operands for query heads h0 .. h1 in one launch: writes delta[:, h0:h1]
    (fp32 [B, HQ, SQ]) and returns the bf16 [B, h1 - h0, SQ, D] scratch (dO row-wise, dO column-wise, Q
    row-wise, Q column-wise), each the exact dequantization of that MXFP8 copy. o, do [B, HQ, SQ, D] bf16/fp16
    and q_row, q_col (MXFP8Tensor, segmented column scales for a packed batch) with a unit stride along D; seq:
    `check_seq`'s (None: dense), cu: (cu_seqlens_q, cu_seqlens_kv) as the kernels take them (`kernel_cu_seqlens`).
    scratch False: delta alone (q_row, q_col may be None; returns None). floor: dO's scales by the OCP rule.
    gap: for a packed batch, PACKED_GAP gives the gapped scratch [1, h1 - h0, SQ + gap * B, D] (sequence b's rows
    from cu[b] + gap * b, each followed by gap zero rows; the Gluon kernels' layout), 0 the packed one."""
    SQ = o.shape[2]
    for name, t in (("o", o), ("do", do)):
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along D")
    out = _prep((PREP_Q if scratch else PREP_DELTA).value, o, do, delta, q_row if scratch else None, q_col, h0, h1, SQ,
                row_tiles(grid_rows(seq, "q", SQ), MX_BLOCK.value), seq, cu, 4 if scratch else 0, floor,
                gap=gap if scratch else 0)
    return out if scratch else None


def kv_prep(k_row, k_col, v_row, h0: int, h1: int, seq, cu, gap: int = 0):
    """The key-side operands of the "pre" backward's dQ kernel for KV heads h0 .. h1 in one launch: the bf16
    [B, h1 - h0, SKV, D] dequantizations of K row-wise, K column-wise and V row-wise (MXFP8Tensors with a unit
    stride along D; K's column-wise scales segmented for a packed batch). v_row a bf16 tensor (the bf16-V
    recipe): its head slice as it is. gap: as `bwd_prep`'s (the scratch [1, h1 - h0, SKV + gap * B, D])."""
    SKV = k_row.data.shape[2]
    if isinstance(v_row, torch.Tensor):
        k_r, k_c = _prep(PREP_KV.value, k_row.data, k_row.data, k_row.data, k_row, k_col, h0, h1, SKV,
                         row_tiles(grid_rows(seq, "kv", SKV), MX_BLOCK.value), seq, cu, 2, with_v=False, gap=gap)
        return k_r, k_c, v_row[:, h0:h1]
    vs = v_row.scale.view(torch.uint8)
    v_r, k_r, k_c = _prep(PREP_KV.value, v_row.data, vs, vs, k_row, k_col, h0, h1, SKV,
                          row_tiles(grid_rows(seq, "kv", SKV), MX_BLOCK.value), seq, cu, 3, gap=gap)
    return k_r, k_c, v_r


__all__ = ["bwd_prep", "kv_prep", "PACKED_GAP"]
