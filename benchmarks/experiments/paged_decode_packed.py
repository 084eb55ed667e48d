"""Experiment (not product code): a decode kernel over the paged MXFP8 cache with the query heads of one KV head
packed into the rows of a 16-row tile and the KV range split across programs (flash-decoding), against the
product's bit-exact paged kernel (one program per query head, the dense path's 64/128-row tile).

Why: `benchmarks/decode_bench.py` measured the product kernel at 5-30x SDPA's time over a bf16 cache. A decode
step has one query row per head, so a 128-row tile does 128x the needed MMA work and each of a GQA group's
query heads reads and dequantizes the KV head's pages again; one program per (sequence, head) also leaves most
SMs idle at batch 1. This kernel shows what packing + split-KV gain, and what they cost in numerics: P is
rounded to E4M3 relative to each split's running max instead of the sequence's (the recipe's online softmax is
sequential), and 16-row tiles use other MMA instructions. The two-pass variant (exact=True) first finds each
split's maximum logits, then starts every split from the maximum over the earlier ones, so P is rounded as in the
sequential pass (benchmarks/split_kv_numerics.py shows this on the CPU). Printed: time per decode step against
SDPA and the product kernel, and agreement with the product kernel (max abs difference, relative RMS, share of
equal elements). The session-11 H100 run (results/nvidia-h100-80gb-hbm3/session11/paged_decode_packed_214ce7e.txt)
predates the two-pass variant.
Usage (CUDA machine): python benchmarks/experiments/paged_decode_packed.py
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mxattn.kernels.triton_common import (LOG2E, dequant_cols, dequant_rows, quantize_cols, quantize_rows,  # noqa: E402
                                          round_p_to_bf16, softmax_block, softmax_start)


@triton.jit
def _packed_split_kernel(Q, OP, MP, LP, MSTART, SEQ_LENS, PT, KD, KS, VD, VS, VT, spt,
                         skd_p, skd_h, skd_n, sks_p, sks_h, sks_n, svd_p, svd_h, svd_n, svs_p, svs_h, svs_n,
                         svt_s, svt_h, svt_n, HQ, HKV, GROUP, D, PAGE, BLOCKS_PER_SPLIT, N_SPLITS, qk_scale,
                         BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr, FROM_PREFIX: tl.constexpr,
                         MAX_ONLY: tl.constexpr):
    """Grid (splits, B * HKV): sequence b (slot b), KV head hk, KV blocks of split s; rows = the GROUP query heads
    (one decode query each). Writes the split's unnormalised O, max and sum to OP [B, HKV, S, BM, DP], MP, LP
    [B, HKV, S, BM]. FROM_PREFIX: the running max starts from MSTART [B, HKV, S, BM] (the maximum of the
    logits over the earlier splits) instead of -inf, so every block rounds P against the sequential pass's
    running max. MAX_ONLY: the first pass: only the split's row maximum of the logits, to MP."""
    s = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    hk = (pid % HKV).to(tl.int64)
    len_kv = tl.load(SEQ_LENS + b)
    sealed = len_kv - len_kv % 32
    rows = tl.arange(0, BM)
    offs_d = tl.arange(0, DP)
    offs_n = tl.arange(0, BN)
    offs_kb = tl.arange(0, DP // 32)
    d_ok = offs_d < D
    q_ok = (rows < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(Q + (b * HQ + hk * GROUP + rows)[:, None] * D + offs_d[None, :], mask=q_ok, other=0.0)
    qq, qe = quantize_rows(q.to(tl.float32), BM, DP)
    q = dequant_rows(qq, qe.to(tl.uint8), BM, DP)
    m_i, l_i, acc = softmax_start(Q, 0, False, BM, DP)
    base = ((b * HKV + hk) * N_SPLITS + s) * BM
    if FROM_PREFIX:
        m_i = tl.load(MSTART + base + rows)
    pos = rows * 0 + len_kv - 1  # every row is the sequence's last position (decode)
    j0 = s * BLOCKS_PER_SPLIT
    j1 = tl.minimum(j0 + BLOCKS_PER_SPLIT, tl.cdiv(len_kv, BN))
    for j in range(j0, j1):
        cols = j * BN + offs_n
        valid = cols < len_kv
        page = tl.load(PT + b * spt + cols // PAGE, mask=valid, other=0).to(tl.int64)
        row = cols % PAGE
        kt = tl.load(KD + page[:, None] * skd_p + hk * skd_h + row[:, None] * skd_n + offs_d[None, :],
                     mask=valid[:, None] & d_ok[None, :], other=0.0)
        ks = tl.load(KS + page[:, None] * sks_p + hk * sks_h + row[:, None] * sks_n + offs_kb[None, :],
                     mask=valid[:, None] & (offs_kb * 32 < D)[None, :], other=127)
        kt = dequant_rows(kt, ks, BN, DP)
        qk = tl.dot(q, tl.trans(kt))
        if MAX_ONLY:  # (qk_scale > 0: max(qk) * qk_scale is the max of the scaled logits, as softmax_block has it)
            m_i = tl.maximum(m_i, tl.max(tl.where(valid[None, :], qk, float("-inf")), axis=1) * qk_scale)
        else:
            p, alpha, m_i, l_i = softmax_block(qk, m_i, l_i, pos, cols, len_kv, qk_scale, 0, 0,
                                               0, True, False, True)
            in_pages = cols < sealed
            vt = tl.load(VD + page[:, None] * svd_p + hk * svd_h + row[:, None] * svd_n + offs_d[None, :],
                         mask=in_pages[:, None] & d_ok[None, :], other=0.0)
            blk = j * BN + tl.arange(0, BN // 32) * 32
            blk_page = tl.load(PT + b * spt + blk // PAGE, mask=blk < sealed, other=0).to(tl.int64)
            vs = tl.load(VS + blk_page[:, None] * svs_p + hk * svs_h + ((blk % PAGE) // 32)[:, None] * svs_n
                         + offs_d[None, :], mask=(blk < sealed)[:, None] & d_ok[None, :], other=127)
            vt = dequant_cols(vt, vs, BN, DP)
            if j * BN + BN > sealed:
                open_rows = valid & (cols >= sealed)
                raw = tl.load(VT + b * svt_s + hk * svt_h + (cols - sealed)[:, None] * svt_n + offs_d[None, :],
                              mask=open_rows[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                vq, ve = quantize_cols(raw, BN, DP)
                vt = tl.where(open_rows[:, None], dequant_cols(vq, ve.to(tl.uint8), BN, DP), vt)
            acc = acc * alpha[:, None] + tl.dot(round_p_to_bf16(p), vt)
    tl.store(MP + base + rows, m_i)
    if not MAX_ONLY:
        tl.store(OP + (base + rows)[:, None] * DP + offs_d[None, :], acc)
        tl.store(LP + base + rows, l_i)


def packed_decode(q, cache, splits: int, scale: float, exact: bool = False):
    """O [B, HQ, D] of one decode query per sequence (slot b = sequence b) via the packed split kernel and a
    torch combine of the splits. exact: first a pass for each split's maximum logits, then every split starts
    from the maximum over the earlier ones (P rounded as the sequential recipe rounds it)."""
    B, hq, d = q.shape
    hkv = cache.kv_heads
    group = hq // hkv
    bm, dp, bn = max(16, triton.next_power_of_2(group)), max(32, triton.next_power_of_2(d)), 128
    max_len = int(cache.seq_lens[:B].max())
    n_blocks = -(-max_len // bn)
    per_split = -(-n_blocks // splits)
    op = torch.empty(B, hkv, splits, bm, dp, device=q.device, dtype=torch.float32)
    mp = torch.full((B, hkv, splits, bm), float("-inf"), device=q.device)
    lp = torch.zeros(B, hkv, splits, bm, device=q.device)
    kd, ks, vd, vs, vt = cache.k_data, cache.k_scale.view(torch.uint8), cache.v_data, \
        cache.v_scale.view(torch.uint8), cache.v_tail
    args = (cache.seq_lens, cache.page_table, kd, ks, vd, vs, vt, cache.page_table.stride(0),
            kd.stride(0), kd.stride(1), kd.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            vd.stride(0), vd.stride(1), vd.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
            vt.stride(0), vt.stride(1), vt.stride(2), hq, hkv, group, d, cache.page_size, per_split, splits,
            scale * LOG2E.value)
    start = mp
    if exact:
        _packed_split_kernel[(splits, B * hkv)](q, op, mp, lp, mp, *args, BM=bm, BN=bn, DP=dp, FROM_PREFIX=False,
                                                MAX_ONLY=True, num_warps=4, num_stages=2)
        running = torch.cummax(mp, dim=2).values          # max over splits 0..s
        start = torch.cat([torch.full_like(running[:, :, :1], float("-inf")), running[:, :, :-1]], dim=2)
        mp = torch.full_like(mp, float("-inf"))
    _packed_split_kernel[(splits, B * hkv)](q, op, mp, lp, start.contiguous(), *args, BM=bm, BN=bn, DP=dp,
                                            FROM_PREFIX=exact, MAX_ONLY=False, num_warps=4, num_stages=2)
    m = mp.amax(dim=2, keepdim=True)
    w = torch.exp2(mp - m).nan_to_num(0.0)
    o = (op * w[..., None]).sum(2) / (lp * w).sum(2)[..., None]
    return o[:, :, :group, :d].reshape(B, hq, d).to(q.dtype)


def main():
    import decode_bench as db
    from triton.testing import do_bench
    import torch.nn.functional as F
    from mxattn.kernels.triton_paged_attention import paged_attention_fwd
    print(f"{torch.cuda.get_device_name()}: decode step, Hq {db.HQ} Hkv {db.HKV} D {db.D}, times in us")
    print("batch context | sdpa_bf16 | product kernel | packed splits=1 | packed best (splits) | vs product: "
          "max abs, rel RMS, equal share | two-pass exact best (splits) | vs product")
    for batch, context in ((1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 4096), (64, 16384)):
        cache, slots, k, v = db.fill_cache(batch, context)
        q = torch.randn(batch, db.HQ, db.D, device="cuda", dtype=torch.bfloat16)
        scale = db.D ** -0.5
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        product = lambda: paged_attention_fwd(q, cu, 1, slots_t, cache, softmax_scale=scale,  # noqa: E731
                                              left_bound=None, out=out)
        sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)  # noqa: E731
        product()
        exact = out.float().clone()
        times = {n: do_bench(lambda n=n: packed_decode(q, cache, n, scale)) * 1e3 for n in (1, 4, 16, 64)}
        best = min(times, key=times.get)
        exact_times = {n: do_bench(lambda n=n: packed_decode(q, cache, n, scale, exact=True)) * 1e3
                       for n in (4, 16, 64)}
        best_exact = min(exact_times, key=exact_times.get)

        def agreement(o):
            diff = (o.float() - exact).abs()
            return f"{diff.max().item():.2e}, {(diff.norm() / exact.norm()).item():.2e}, " \
                   f"{(diff == 0).float().mean().item():.3f}"
        print(f"{batch:5d} {context:7d} | {do_bench(sdpa) * 1e3:9.1f} | {do_bench(product) * 1e3:14.1f} | "
              f"{times[1]:15.1f} | {times[best]:12.1f} ({best:2d}) | "
              f"{agreement(packed_decode(q, cache, best, scale))} | {exact_times[best_exact]:12.1f} "
              f"({best_exact:2d}) | {agreement(packed_decode(q, cache, best_exact, scale, exact=True))}", flush=True)
        del cache, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
