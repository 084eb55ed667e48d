"""The Gluon dK/dV kernel's synchronisation protocol and block walk (mxattn/kernels/gluon_dkdv_kernel.py),
simulated on the CPU under random interleavings: the producer (for t = 0, 1, ...: wait "empty" of stage t % NS,
one expect-tx arrival on "ready" and the stage's TMA copies, which land one by one in any order: four bf16 tiles,
and with STATS_LOADS 5 the block's LSE and delta too) and the two consumer warpgroups (per
visited query block: wait "ready", read the stage's tiles with their GEMMs, one "empty" arrival each), with
mbarrier phase/parity semantics (a wait on parity P passes once the barrier's phase parity differs from P; a
fresh barrier is in phase 0). Checks: no deadlock, a consumer only reads a stage holding the block it wants, the
producer never overwrites a stage a consumer still reads, every block reaches both consumers, in order. Also the
query-block walk (`_q_block_range`, ported below): the producer's single range [lo, hi) is the consumers' three
loops concatenated, blocks run without the mask only where every pair is kept, and no query row that sees one of
the CTA's keys is skipped.

A model of the kernel's control flow, kept in step with it by hand: change both together.
"""

import random

import pytest

from test_gluon_fwd_protocol import _Bar as _FwdBar


class _Bar(_FwdBar):
    """The forward's mbarrier model, with the completion of an expected transaction (a TMA copy landing)."""

    def complete_tx(self):
        self.tx -= 1
        assert self.tx >= 0
        self._complete()


def _cdiv(a, b):
    return -(-a // b)


def q_block_range(n0, SQ, SKV, offset, RB, has_rb, BM, BN, LB=0, has_lb=False):
    """`gluon_attention_bwd._q_block_range`, line by line (Python's // floors like the kernel's on the
    non-negative operands it divides)."""
    lo, hi, full_lo, full_hi = 0, SQ, 0, (SQ // BM) * BM
    if has_rb:
        lo = (max(n0 - offset - RB, 0) // BM) * BM
        full_lo = ((max(n0 + BN - 1 - offset - RB, 0) + BM - 1) // BM) * BM
    if has_lb:
        hi = min(SQ, max(n0 + BN - 1 - offset + LB, 0))
        full_hi = min(full_hi, (max(n0 - offset + LB - 1, 0) // BM) * BM)
    if n0 + BN > SKV:
        full_hi = 0
    full_lo = max(full_lo, lo)
    if full_hi <= full_lo:
        full_lo = full_hi = hi
    mask_hi = min(full_lo, hi)
    return lo, mask_hi, full_lo, full_hi, hi


def consumer_blocks(n0, SQ, SKV, offset, RB, has_rb, BM, BN, LB=0, has_lb=False):
    """[(m0, masked)] of one query head, as the consumer's three loops visit them."""
    lo, mask_hi, full_lo, full_hi, hi = q_block_range(n0, SQ, SKV, offset, RB, has_rb, BM, BN, LB, has_lb)
    return ([(m, True) for m in range(lo, mask_hi, BM)] + [(m, False) for m in range(full_lo, full_hi, BM)]
            + [(m, True) for m in range(max(full_hi, mask_hi), hi, BM)])


def producer_blocks(n0, SQ, SKV, offset, RB, has_rb, BM, BN, LB=0, has_lb=False):
    lo, _, _, _, hi = q_block_range(n0, SQ, SKV, offset, RB, has_rb, BM, BN, LB, has_lb)
    n_blk = _cdiv(max(hi - lo, 0), BM)
    return [lo + i * BM for i in range(n_blk)]


def _simulate(blocks, group, NS, seed, deferred=False, copies=4):
    """blocks: the m0 of one head's visited query blocks; the CTA walks them for `group` query heads. copies: TMA
    copies per stage (4 tiles; 6 with the LSE and delta of STATS_LOADS 5), each landing on its own. deferred:
    the consumers' software-pipelined last GEMM (DEFER): step t reads stage t % NS and the previous block's
    stage (its dK / dQ GEMM issued there) and releases the previous one at its end; the last block's stage is
    read and released after the walk."""
    rng = random.Random(seed)
    n_blk = len(blocks)
    ready = [_Bar(1) for _ in range(NS)]
    empty = [_Bar(2) for _ in range(NS)]  # one arrival per consumer warpgroup
    holds = [None] * NS
    readers = [set() for _ in range(NS)]
    landing = []  # TMA copies in flight: (stage, block)
    consumed = {0: [], 1: []}

    def producer():
        for t in range(group * n_blk):
            g = t // n_blk
            m0 = blocks[t - g * n_blk]
            s = t % NS
            yield empty[s], ((t // NS) & 1) ^ 1
            assert not readers[s], f"stage {s} overwritten while read by {readers[s]}"
            ready[s].tx += copies  # expect (one arrival with the bytes of every copy), then the copies
            ready[s].arrive()
            holds[s] = [None] * copies  # the copies write the stage from now on
            landing.extend((s, c, (g, m0)) for c in range(copies))

    def consumer(wg):
        t = 0
        prev = None  # deferred: (stage, block) of the previous block, still read by its last GEMM
        for g in range(group):
            for m0 in blocks:
                s = t % NS
                yield ready[s], (t // NS) & 1
                want = [(g, m0)] * copies
                assert holds[s] == want, f"wg {wg} wants {(g, m0)} in stage {s}, which holds {holds[s]}"
                readers[s].add(wg)
                yield None  # the GEMMs read the stage (and, deferred, the previous block's)
                assert holds[s] == want
                if deferred:
                    if prev is not None:
                        assert holds[prev[0]] == [prev[1]] * copies
                        readers[prev[0]].discard(wg)
                        empty[prev[0]].arrive()
                    prev = (s, (g, m0))
                else:
                    readers[s].discard(wg)
                    empty[s].arrive()
                consumed[wg].append((g, m0))
                t += 1
        if prev is not None:  # the last block's GEMM after the walk, then its stage
            yield None
            assert holds[prev[0]] == [prev[1]] * copies
            readers[prev[0]].discard(wg)
            empty[prev[0]].arrive()

    agents = {"p": producer(), 0: consumer(0), 1: consumer(1)}
    waiting = {k: None for k in agents}
    steps = 0
    while agents or landing:
        steps += 1
        assert steps < 100000
        options = [k for k in agents if waiting[k] is None or waiting[k][0].passes(waiting[k][1])]
        if landing:
            options.append("tma")
        assert options, f"deadlock: {waiting}"
        k = rng.choice(options)
        if k == "tma":
            s, c, blk = landing.pop(rng.randrange(len(landing)))  # copies land in any order, across stages too
            assert not readers[s]
            holds[s][c] = blk
            ready[s].complete_tx()
            continue
        waiting[k] = None
        try:
            w = next(agents[k])
            while w is None:
                w = next(agents[k])
            waiting[k] = w
        except StopIteration:
            del agents[k]
            del waiting[k]
    want = [(g, m0) for g in range(group) for m0 in blocks]
    assert consumed[0] == want and consumed[1] == want
    return consumed[0], consumed[1]


@pytest.mark.parametrize("NS,deferred", [(ns, d) for d in (False, True) for ns in (1, 2, 3, 4) if ns > 1 or not d],
                         ids=lambda x: str(x) if isinstance(x, int) else ("deferred" if x else "waited"))
@pytest.mark.parametrize("n_blk", [0, 1, 2, 5, 9])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("copies", [4, 6], ids=["tiles", "tiles+stats"])
def test_rings_never_deadlock_or_race(NS, n_blk, group, deferred, copies):
    """No deadlock or race at any ring depth (one stage only without deferred GEMMs:
    test_one_stage_with_deferred_gemms_deadlocks), with the four tiles per stage and with the LSE and delta too
    (STATS_LOADS 5)."""
    for seed in range(20):
        _simulate([64 * i for i in range(n_blk)], group, NS, seed, deferred, copies)


def test_one_stage_with_deferred_gemms_deadlocks():
    """Why dkdv_gluon / dq_gluon refuse stages=1 with defer on (`ring_stages`): the second block's stage is the
    first's, which the consumers release only after the second block is in."""
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate([0, 64], 1, 1, 0, deferred=True)
    from mxattn.kernels.gluon_attention_bwd import ring_stages
    with pytest.raises(ValueError, match="stages must be >= 2"):
        ring_stages(1, 4, defer=True)
    assert ring_stages(1, 4) == 1 and ring_stages(2, 4, defer=True) == 2 and ring_stages(None, 3, True) == 3


CASES = [(sq, skv, off, rb, has_rb, bm)
         for sq in (1, 31, 64, 100, 128, 200, 384)
         for skv in (1, 100, 128, 130, 300)
         for off in (-150, -64, 0, 37, 128)
         for rb in (0, 5)
         for has_rb in (False, True)
         for bm in (32, 64)]


@pytest.mark.parametrize("lb", [None, 1, 50, 200], ids=["no_window", "window1", "window50", "window200"])
@pytest.mark.parametrize("sq,skv,off,rb,has_rb,bm", CASES[::7] + [c for c in CASES if c[1] == 130 and c[4]])
def test_query_block_walk(sq, skv, off, rb, has_rb, bm, lb):
    """For every KV tile: the producer's blocks are the consumers' (in order, multiples of BM); an unmasked block
    keeps every (key, query) pair of the tile; every kept pair with key < SKV and query < SQ lies in a visited
    block (no block skipped that the Triton kernel, with its 32-row blocks, would visit with a kept pair). With a
    sliding window (lb: keys kept where key > query + offset - lb) too."""
    BN = 128
    has_lb, LB = lb is not None, lb or 0

    def kept(key, q):
        return (not has_rb or key <= q + off + rb) and (not has_lb or key > q + off - LB)

    for n0 in range(0, skv, BN):
        cons = consumer_blocks(n0, sq, skv, off, rb, has_rb, bm, BN, LB, has_lb)
        prod = producer_blocks(n0, sq, skv, off, rb, has_rb, bm, BN, LB, has_lb)
        assert [m for m, _ in cons] == prod
        assert all(m % bm == 0 for m in prod) and prod == sorted(set(prod))
        visited = set(prod)
        for m0, masked in cons:
            if not masked:
                for key in range(n0, n0 + BN):
                    for q in (m0, m0 + bm - 1):
                        assert key < skv and q < sq and kept(key, q), (n0, m0, key, q)
        for q in range(sq):
            for key in range(n0, min(n0 + BN, skv)):
                if kept(key, q):
                    assert (q // bm) * bm in visited, (n0, q, key)
                    break


def test_walk_matches_the_triton_kernels_band_range():
    """The bounds follow triton_common.band_block_range (KV_TILE, no left bound) at BM = 32, the Triton dK/dV
    kernel's query block: the same rows [lo, hi) up to the coarser block (lo rounded down to BM)."""
    BN = 128
    for sq, skv, off, rb, has_rb, _ in CASES[::5]:
        for n0 in range(0, skv, BN):
            lo32, _, _, _, hi32 = q_block_range(n0, sq, skv, off, rb, has_rb, 32, BN)
            lo64, _, _, _, hi64 = q_block_range(n0, sq, skv, off, rb, has_rb, 64, BN)
            assert hi32 == hi64 == sq
            assert lo64 == (lo32 // 64) * 64
