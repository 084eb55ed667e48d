"""The Gluon forward's block schedule (mxattn/kernels/gluon_fwd_kernel.py) against the Triton forward's
(triton_attention_fwd._attn_fwd_kernel with triton_common.band_block_range), simulated on the CPU: which KV blocks
each row set meets, in which order, and which of them are masked. Both schedules run the same per-block step
(`triton_common.softmax_block`'s arithmetic, P rounded to E4M3 * 256, acc * alpha + P V) on float64 operands chosen
so that every product sum is exact (small integers for Q and K, V on a coarse grid), so the two must agree bit for
bit on every row below SQ: a block counted twice, skipped, masked wrongly or taken out of order shows up.

The Gluon schedule is a hand copy of `_kv_blocks`, `_softmax_step`'s need_mask and `_consumer`'s loops (n_full);
the Triton one of `band_block_range` and the forward kernel's three loops: change them together.
"""

import math

import pytest
import torch

BN = 128


@pytest.fixture(autouse=True)
def _one_thread():
    """Thousands of tiny float64 products: one thread is several times faster than a contended pool."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _step(acc, m, l, q, k, v, rows, n0, skv, qk_scale, offset, rb, mask):
    """One KV block [n0, n0 + BN) for query rows `rows` (softmax_block + round_p + acc * alpha + P V)."""
    cols = n0 + torch.arange(BN)
    kb = torch.zeros(BN, k.shape[1], dtype=k.dtype)
    vb = torch.zeros(BN, v.shape[1], dtype=v.dtype)
    n = max(0, min(BN, skv - n0))
    kb[:n], vb[:n] = k[n0:n0 + n], v[n0:n0 + n]
    s = q @ kb.T  # exact (integers)
    if mask:
        keep = (cols < skv)[None, :].expand(len(rows), BN)
        if rb is not None:
            keep = keep & (cols[None, :] <= rows[:, None] + offset + rb)
        s = torch.where(keep, s, -math.inf)
    m_new = torch.maximum(m, s.max(dim=1).values * qk_scale)
    m_use = torch.where(m_new == -math.inf, 0.0, m_new)
    alpha = torch.exp2(m - m_use)
    p = torch.exp2(s * qk_scale - (m_use - 8.0)[:, None])
    l = l * alpha + p.sum(dim=1)
    pq = p.float().to(torch.float8_e4m3fn).double()  # RNE to E4M3 (p <= 256 here: no saturation needed)
    acc = acc * alpha[:, None] + pq @ vb  # exact: E4M3 values times a coarse grid
    return acc, m_new, l


def _finish(acc, m, l):
    has = l != 0
    denom = torch.where(has, l, 1.0)
    o = torch.where(has[:, None], acc / denom[:, None], 0.0)
    lse = torch.where(has, (m + torch.log2(denom) - 8.0) * math.log(2), -math.inf)
    return o, lse


def _start(n, d):
    return torch.zeros(n, d, dtype=torch.float64), torch.full((n,), -math.inf, dtype=torch.float64), \
        torch.zeros(n, dtype=torch.float64)


def triton_blocks(t0, bm, skv, offset, rb, bn):
    """[(KV block, masked)] that a Triton kernel's query tile of rows [t0, t0 + bm) visits with blocks of bn keys:
    band_block_range (no left bound; rb None: no band) and the kernels' three loops (masked, full, masked)."""
    lo, hi, full_lo = 0, skv, 0
    full_hi = (skv // bn) * bn
    if rb is not None:
        hi = min(skv, max(t0 + bm + offset + rb, 0))
        full_hi = min(full_hi, (max(t0 + offset + rb + 1, 0) // bn) * bn)
    full_lo = max(full_lo, lo)
    if full_hi <= full_lo:
        full_lo = full_hi = hi
    mask_hi = min(full_lo, hi)
    blocks = [(j, True) for j in range(lo // bn, -(-mask_hi // bn))]
    blocks += [(j, False) for j in range(full_lo // bn, full_hi // bn)]
    return blocks + [(j, True) for j in range(-(-max(full_hi, mask_hi) // bn), -(-hi // bn))]


def _triton_schedule(q, k, v, skv, qk_scale, offset, rb, bm):
    """triton_attention_fwd._attn_fwd_kernel's loops over band_block_range (no left bound), tiles of bm rows."""
    sq, d = q.shape
    o, lse = torch.zeros(sq, d, dtype=torch.float64), torch.zeros(sq, dtype=torch.float64)
    for t0 in range(0, sq, bm):
        rows = torch.arange(t0, t0 + bm)
        qt = torch.zeros(bm, d, dtype=q.dtype)
        qt[:min(bm, sq - t0)] = q[t0:t0 + bm]
        acc, m, l = _start(bm, d)
        for j, msk in triton_blocks(t0, bm, skv, offset, rb, BN):
            acc, m, l = _step(acc, m, l, qt, k, v, rows, j * BN, skv, qk_scale, offset, rb, msk)
        ot, lt = _finish(acc, m, l)
        n = min(bm, sq - t0)
        o[t0:t0 + n], lse[t0:t0 + n] = ot[:n], lt[:n]
    return o, lse


def _gluon_schedule(q, k, v, skv, qk_scale, offset, rb):
    """gluon_attention_fwd: CTAs of 128 rows, two consumer warpgroups of 64 (n_blk from the CTA's rows, n_full
    and need_mask from the warpgroup's)."""
    sq, d = q.shape
    BM, BMW = 128, 64
    o, lse = torch.zeros(sq, d, dtype=torch.float64), torch.zeros(sq, dtype=torch.float64)
    for m_cta in range(0, sq, BM):
        hi = skv if rb is None else min(skv, max(m_cta + BM + offset + rb, 0))
        n_blk = -(-hi // BN)  # _kv_blocks
        for wg in range(2):
            m0 = m_cta + wg * BMW
            if m0 >= sq:
                continue
            rows = torch.arange(m0, m0 + BMW)
            qt = torch.zeros(BMW, d, dtype=q.dtype)
            qt[:min(BMW, sq - m0)] = q[m0:m0 + BMW]
            acc, m, l = _start(BMW, d)

            def need_mask(n0):
                nm = n0 + BN > skv
                if rb is not None:
                    nm = nm or (n0 + BN - 1 > m0 + offset + rb)
                return nm
            if n_blk > 0:
                acc, m, l = _step(acc, m, l, qt, k, v, rows, 0, skv, qk_scale, offset, rb, need_mask(0))
                n_full = min(n_blk, skv // BN)
                if rb is not None:
                    n_full = min(n_full, max(m0 + offset + rb + 1, 0) // BN)
                for j in range(1, n_full):
                    acc, m, l = _step(acc, m, l, qt, k, v, rows, j * BN, skv, qk_scale, offset, rb, False)
                for j in range(max(n_full, 1), n_blk):
                    acc, m, l = _step(acc, m, l, qt, k, v, rows, j * BN, skv, qk_scale, offset, rb,
                                      need_mask(j * BN))
            ot, lt = _finish(acc, m, l)
            n = min(BMW, sq - m0)
            o[m0:m0 + n], lse[m0:m0 + n] = ot[:n], lt[:n]
    return o, lse


CASES = [(sq, skv) for sq in (1, 50, 65, 128, 129, 300) for skv in (1, 50, 128, 129, 300, 777)]


@pytest.mark.parametrize("D,triton_bm", [(64, 64), (128, 128)])
@pytest.mark.parametrize("rb", [None, 0, -3, 70])
def test_gluon_block_schedule_matches_triton(D, triton_bm, rb):
    g = torch.Generator().manual_seed(D + (rb or 0))
    for sq, skv in CASES:
        q = torch.randint(-3, 4, (sq, D), generator=g).double()
        k = torch.randint(-3, 4, (skv, D), generator=g).double()
        v = torch.randint(-8, 9, (skv, D), generator=g).double() / 4
        # the diagonal just before / at a block or warpgroup edge (offset + rb = 62, 63, 126, 127)
        edges = {e - (rb or 0) for e in (62, 63, 126, 127)}
        for offset in sorted({0, skv - sq, -100, 200} | edges):
            ref = _triton_schedule(q, k, v, skv, 0.11, offset, rb, triton_bm)
            got = _gluon_schedule(q, k, v, skv, 0.11, offset, rb)
            for a, b, what in ((got[0], ref[0], "O"), (got[1], ref[1], "stats")):
                same = (a == b) | (torch.isnan(a) & torch.isnan(b)) | ((a == b) & (a == -math.inf))
                assert bool(same.all()), f"{what} differs: D={D} rb={rb} sq={sq} skv={skv} offset={offset}"
