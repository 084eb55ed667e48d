"""The Gluon dQ kernel's synchronisation protocol and KV block walk (mxattn/kernels/gluon_attention_dq.py), on the
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


def gluon_walk(m0, SKV, offset, RB, has_rb, BN):
    """[(block, masked)] as both consumer warpgroups visit them (the producer loads blocks 0 .. n_blk - 1)."""
    n_full, n_blk = kv_blocks(m0, SKV, offset, RB, has_rb, BN)
    return [(j, False) for j in range(n_full)] + [(j, True) for j in range(n_full, n_blk)]


def triton_walk(m0, SKV, offset, RB, has_rb, BN):
    """[(block, masked)] of `_dq_kernel`'s three loops over band_block_range (query tile, no left bound)."""
    return triton_blocks(m0, BM, SKV, offset, RB if has_rb else None, BN)


@pytest.mark.parametrize("NS,deferred", [(ns, d) for d in (False, True) for ns in (1, 2, 3, 4) if ns > 1 or not d],
                         ids=lambda x: str(x) if isinstance(x, int) else ("deferred" if x else "waited"))
@pytest.mark.parametrize("n_blk", [0, 1, 2, 5, 9])
def test_ring_never_deadlocks_or_races(NS, n_blk, deferred):
    """No deadlock or race at any ring depth (one stage only without deferred GEMMs: test_gluon_bwd_protocol)."""
    for seed in range(20):
        _simulate(list(range(n_blk)), 1, NS, seed, deferred, copies=3)  # K_r, V_r, K_c


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
