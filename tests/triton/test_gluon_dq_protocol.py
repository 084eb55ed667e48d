"""The Gluon dQ kernel's synchronisation protocol and KV block walk (mxattn/kernels/gluon_dq_kernel.py), on the
CPU. The ring is the dK/dV kernel's (producer: per visited block t wait "empty" of stage t % NS, one expect-tx
arrival on "ready", the TMA copies land later; two consumer warpgroups: wait "ready", read, one "empty" arrival
each) with one query head and the KV blocks 0 .. n_blk - 1 for blocks: test_gluon_bwd_protocol's simulation
under random interleavings. The one-shot "q_ready" barrier (armed once before the ring, waited once with parity
0 by each consumer) needs no simulation.

The walk (`_kv_blocks`, `_kv_full_blocks`, ported below) against the Triton dQ kernel's
(triton_common.band_block_range for a query tile without a left bound, and `_dq_kernel`'s three loops: the
forward schedule test's port, `triton_blocks`): at the
same BN the same blocks in the same order, masked alike; at the Triton kernel's own BN (64 at D128, 32 at D64)
its keys and more only under the mask; every block run without the mask keeps every (query, key) pair of the
CTA's rows.

A model of the kernel's control flow, kept in step with it by hand: change both together.
"""

import pytest

from test_gluon_bwd_protocol import _cdiv, _simulate
from test_gluon_fwd_schedule import triton_blocks

BM = 128  # the CTA's query rows (gluon_attention_dq.BLOCK_M, the Triton dQ kernel's BM in mode "pre")


def kv_blocks(m0, SKV, offset, RB, has_rb, BN):
    """(n_full, n_blk): `_kv_full_blocks` and gluon_attention_fwd's `_kv_blocks`, line by line."""
    hi = SKV
    n_full = SKV // BN
    if has_rb:
        hi = min(SKV, max(m0 + BM + offset + RB, 0))
        n_full = min(n_full, max(m0 + offset + RB + 1, 0) // BN)
    return n_full, _cdiv(hi, BN)


def gluon_walk(m0, SKV, offset, RB, has_rb, BN, LB=None):
    """[(block, masked)] as both consumer warpgroups visit them (the producer loads blocks lo .. lo + n_blk - 1);
    LB: a sliding window (HAS_LB), `_consumer`'s lo / j_lb lines."""
    n_full, n_blk = kv_blocks(m0, SKV, offset, RB, has_rb, BN)
    if LB is None:
        return [(j, False) for j in range(n_full)] + [(j, True) for j in range(n_full, n_blk)]
    lo = max(m0 + offset - LB + 1, 0) // BN  # gluon_attention_fwd._kv_block_range with HAS_LB
    n_blk = max(n_blk - lo, 0)
    n_full = min(max(n_full - lo, 0), n_blk)
    j_lb = max(min(_cdiv(max(m0 + BM + offset - LB, 0), BN) - lo, n_blk), 0)
    n_full = max(n_full, j_lb)
    visits = [(t, True) for t in range(0, j_lb)] + [(t, False) for t in range(j_lb, n_full)]
    visits += [(t, True) for t in range(n_full, n_blk)]
    return [(lo + t, masked) for t, masked in visits]


def triton_window_walk(m0, SKV, offset, RB, has_rb, BN, LB):
    """[(block, masked)] of triton_common.band_block_range (query tile, with a left bound) and the Triton dQ
    kernel's three loops (masked, full, masked)."""
    lo, hi, full_lo, full_hi = 0, SKV, 0, (SKV // BN) * BN
    if has_rb:
        hi = min(SKV, max(m0 + BM + offset + RB, 0))
        full_hi = min(full_hi, (max(m0 + offset + RB + 1, 0) // BN) * BN)
    lo = (max(m0 + offset - LB + 1, 0) // BN) * BN
    full_lo = ((max(m0 + BM + offset - LB, 0) + BN - 1) // BN) * BN
    full_lo = max(full_lo, lo)
    if full_hi <= full_lo:
        full_lo = full_hi = hi
    mask_hi = min(full_lo, hi)
    blocks = [(j, True) for j in range(lo // BN, _cdiv(mask_hi, BN))]
    blocks += [(j, False) for j in range(full_lo // BN, full_hi // BN)]
    return blocks + [(j, True) for j in range(_cdiv(max(full_hi, mask_hi), BN), _cdiv(hi, BN))]


def triton_walk(m0, SKV, offset, RB, has_rb, BN):
    """[(block, masked)] of `_dq_kernel`'s three loops over band_block_range (query tile, no left bound)."""
    return triton_blocks(m0, BM, SKV, offset, RB if has_rb else None, BN)


@pytest.mark.parametrize("NS,deferred", [(ns, d) for d in (False, True) for ns in (1, 2, 3, 4) if ns > 1 or not d],
                         ids=lambda x: str(x) if isinstance(x, int) else ("deferred" if x else "waited"))
@pytest.mark.parametrize("n_blk", [0, 1, 2, 5, 9])
def test_ring_never_deadlocks_or_races(NS, n_blk, deferred):
    """No deadlock or race at any ring depth (one stage only without deferred GEMMs: test_gluon_bwd_protocol)."""
    every_block = [(0, j) for j in range(n_blk)]
    for seed in range(20):
        # (_simulate raises on a deadlock or a stage read while overwritten; each warpgroup must see every block)
        assert _simulate(list(range(n_blk)), 1, NS, seed, deferred, copies=3) == (every_block, every_block)


CASES = [(sq, skv, off, rb, has_rb)
         for sq in (1, 64, 65, 128, 200, 384)
         for skv in (1, 31, 64, 100, 128, 130, 300)
         for off in (-300, -150, -64, 0, 37, 128)
         for rb in (0, 5)
         for has_rb in (False, True)]


@pytest.mark.parametrize("BN,triton_bn", [(128, 32), (64, 64)], ids=["d64", "d128"])
def test_kv_block_walk(BN, triton_bn):
    """Per query tile: the walk is the Triton kernel's at the same BN (blocks, order, masks); at the Triton
    kernel's own BN its keys, more only in masked blocks; an unmasked block keeps every pair of the tile's 128
    rows; every kept (query < SQ, key < SKV) pair lies in a visited block."""
    for sq, skv, off, rb, has_rb in CASES:
        for m0 in range(0, sq, BM):
            walk = gluon_walk(m0, skv, off, rb, has_rb, BN)
            assert walk == triton_walk(m0, skv, off, rb, has_rb, BN), (sq, skv, off, rb, has_rb, m0)
            # the Triton kernel's keys (at its BN) are visited here too; the others here only in masked blocks
            ours = {key: masked for j, masked in walk for key in range(j * BN, min(skv, j * BN + BN))}
            for j, _ in triton_walk(m0, skv, off, rb, has_rb, triton_bn):
                assert all(key in ours for key in range(j * triton_bn, min(skv, j * triton_bn + triton_bn)))
            hi = max((j * triton_bn + triton_bn for j, _ in triton_walk(m0, skv, off, rb, has_rb, triton_bn)),
                     default=0)
            assert all(masked for key, masked in ours.items() if key >= hi)
            assert [j for j, _ in walk] == list(range(len(walk)))
            for j, masked in walk:
                if not masked:
                    for key in (j * BN, j * BN + BN - 1):
                        assert key < skv and (not has_rb or key <= m0 + off + rb), (m0, j, key)
            visited = {j for j, _ in walk}
            for q in range(m0, min(m0 + BM, sq)):
                top = skv - 1 if not has_rb else min(skv - 1, q + off + rb)
                if top >= 0:
                    assert top // BN in visited, (m0, q, top)


@pytest.mark.parametrize("lb", [1, 50, 127, 128, 200, 500])
@pytest.mark.parametrize("BN", [128, 64], ids=["d64", "d128"])
def test_kv_block_walk_with_a_window(BN, lb):
    """A sliding window (keys kept where key > query + offset - lb): per query tile the walk covers every kept
    (query < SQ, key < SKV) pair, keeps every pair of the tile's rows in its unmasked blocks, visits blocks in
    ascending order from the window's first, and equals the Triton kernel's at the same BN wherever that one keeps
    no empty block (both visit the same blocks; the masks may differ only where both choices compute the same)."""
    for sq, skv, off, rb, has_rb in CASES[::3]:
        for m0 in range(0, sq, BM):
            walk = gluon_walk(m0, skv, off, rb, has_rb, BN, lb)
            blocks = [j for j, _ in walk]
            assert blocks == sorted(set(blocks))
            assert blocks == [j for j, _ in triton_window_walk(m0, skv, off, rb, has_rb, BN, lb)], (m0, sq, skv)

            def kept(key, q):
                return key < skv and (not has_rb or key <= q + off + rb) and key > q + off - lb
            for j, masked in walk:
                if not masked:
                    for key in (j * BN, j * BN + BN - 1):
                        for q in (m0, m0 + BM - 1):
                            assert kept(key, q), (m0, j, key, q)
            visited = set(blocks)
            for q in range(m0, min(m0 + BM, sq)):
                for key in range(skv):
                    if kept(key, q):
                        assert key // BN in visited, (m0, q, key)
