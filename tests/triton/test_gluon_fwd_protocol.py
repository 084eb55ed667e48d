"""The Gluon forward's synchronisation protocol (mxattn/kernels/gluon_fwd_kernel.py), simulated on the CPU under
random interleavings: the producer (TMA into the FP8 ring, dequantization into the bf16 ring), the two consumer
warpgroups (S GEMM of block j issued with the P V GEMM of block j - 1, stage release after it) and the ping-pong
turns, with mbarrier phase/parity semantics (a wait on parity P passes once the barrier's phase parity differs
from P; a fresh barrier is in phase 0). Checks: no deadlock, a consumer only reads a stage holding the block it
wants, the producer never overwrites a stage a consumer GEMM still reads, every block reaches the consumers, in
order. The visited blocks are lo, ..., lo + n_blk - 1 (a sliding window starts at lo > 0: `_kv_block_range`);
the rings, parities and turns count visited blocks (j), the TMA and the masks see block lo + j.

A model of the kernel's control flow, kept in step with it by hand: change both together.
"""

import random

import pytest


class _Bar:
    """An mbarrier: `count` arrivals (and every expected transaction) complete a phase."""

    def __init__(self, count):
        self.count, self.pending, self.phase, self.tx = count, count, 0, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity):
        return (self.phase & 1) != parity


def _simulate(n_blk, NS, NF, pingpong, seed, lo=0):
    rng = random.Random(seed)
    fp8 = [_Bar(1) for _ in range(NF)]
    ready = [_Bar(1) for _ in range(NS)]
    empty = [_Bar(2) for _ in range(NS)]  # one arrival per consumer warpgroup
    turn = [_Bar(1), _Bar(1)]
    fp8_holds, bf16_holds = [None] * NF, [None] * NS
    readers = [set() for _ in range(NS)]
    tma_in_flight = []
    consumed = {0: [], 1: []}

    def producer():
        def issue(f, blk):  # expect (one arrival with its bytes) + the two TMA copies
            fp8[f].tx += 1
            fp8[f].arrive()
            tma_in_flight.append((f, blk))
        for i in range(NF):
            if i < n_blk:
                issue(i, lo + i)
        for j in range(n_blk):
            f, s = j % NF, j % NS
            yield fp8[f], (j // NF) & 1
            assert fp8_holds[f] == lo + j
            yield empty[s], ((j // NS) & 1) ^ 1
            assert not readers[s], f"stage {s} overwritten while read by {readers[s]}"
            bf16_holds[s] = lo + j
            yield None
            ready[s].arrive()
            if j + NF < n_blk:
                issue(f, lo + j + NF)

    def consumer(wg):
        def turn_wait(e):
            return (turn[wg], (e + 1 - wg) & 1) if pingpong else None

        def turn_pass():
            if pingpong:
                turn[1 - wg].arrive()
        if n_blk == 0:
            return
        yield ready[0], 0
        yield turn_wait(0)
        assert bf16_holds[0] == lo
        readers[0].add(wg)
        turn_pass()
        yield None
        for j in range(1, n_blk):
            s, sp = j % NS, (j - 1) % NS
            yield ready[s], (j // NS) & 1
            yield turn_wait(j)
            assert bf16_holds[s] == lo + j and bf16_holds[sp] == lo + j - 1
            readers[s].add(wg)
            turn_pass()
            yield None
            readers[sp].discard(wg)
            consumed[wg].append(lo + j - 1)
            empty[sp].arrive()
        sl = (n_blk - 1) % NS
        yield turn_wait(n_blk)
        assert bf16_holds[sl] == lo + n_blk - 1
        turn_pass()
        yield None
        readers[sl].discard(wg)
        consumed[wg].append(lo + n_blk - 1)
        empty[sl].arrive()

    actors = {"producer": producer(), "wg0": consumer(0), "wg1": consumer(1)}
    waiting = {k: None for k in actors}
    done = set()
    for _ in range(200000):
        if tma_in_flight and rng.random() < 0.3:  # the bytes of the oldest TMA land
            f, blk = tma_in_flight.pop(0)
            fp8_holds[f] = blk
            fp8[f].tx -= 1
            fp8[f]._complete()
        runnable = [k for k in actors if k not in done and (waiting[k] is None or waiting[k][0].passes(waiting[k][1]))]
        if not runnable:
            if len(done) == len(actors):
                assert consumed[0] == consumed[1] == list(range(lo, lo + n_blk))
                return
            if not tma_in_flight:
                raise AssertionError(f"deadlock: n_blk={n_blk} NS={NS} NF={NF} pingpong={pingpong} lo={lo}")
            continue
        k = rng.choice(runnable)
        try:
            waiting[k] = next(actors[k])
        except StopIteration:
            done.add(k)
    raise AssertionError("simulation did not finish")


@pytest.mark.parametrize("NS,NF", [(2, 2), (3, 3), (2, 1), (3, 2), (2, 3)])
@pytest.mark.parametrize("pingpong", [True, False])
def test_protocol_has_no_deadlock_or_race(NS, NF, pingpong):
    for n_blk in range(0, 9):
        for seed in range(40):
            _simulate(n_blk, NS, NF, pingpong, seed)


@pytest.mark.parametrize("NS,NF", [(2, 2), (3, 3), (2, 1)])
@pytest.mark.parametrize("lo", [1, 2, 3, 5])
def test_protocol_from_a_nonzero_first_block(NS, NF, lo):
    """A sliding window's range starts at block lo > 0 (also lo not a multiple of NS or NF): counting the visited
    blocks for the rings keeps the protocol of a range from 0."""
    for pingpong in (True, False):
        for n_blk in range(0, 7):
            for seed in range(15):
                _simulate(n_blk, NS, NF, pingpong, seed, lo=lo)


def _block_range(m0, skv, offset, lb, rb, bm=128, bn=128):
    """`_kv_block_range` (and the Triton kernel's band_block_range, in blocks) on host ints: (lo, n)."""
    hi = skv if rb is None else min(skv, max(m0 + bm + offset + rb, 0))
    hi_blk = -(-hi // bn)
    lo = 0 if lb is None else max(m0 + offset - lb + 1, 0) // bn
    return lo, max(hi_blk - lo, 0)


def test_block_range_covers_exactly_the_blocks_with_kept_keys():
    """The visited blocks are exactly those holding a key some row of the tile keeps (mxattn.mask's band; the
    Triton kernel's range at a 128-row tile is the same formula), in a brute force over windows, offsets and
    tiles."""
    bm = bn = 128
    for skv in (1, 127, 128, 300, 700):
        for offset in (-200, 0, 37, 400):
            for lb in (None, 1, 5, 128, 129, 300):
                for rb in (None, 0, 3, 200):
                    for m0 in range(0, 640, bm):
                        lo, n = _block_range(m0, skv, offset, lb, rb)
                        kept = set()
                        for r in range(m0, m0 + bm):
                            a = 0 if lb is None else max(r + offset - lb + 1, 0)
                            b = skv - 1 if rb is None else min(skv - 1, r + offset + rb)
                            kept.update(range(a // bn, b // bn + 1) if a <= b else ())
                        want = sorted(kept)
                        got = list(range(lo, lo + n))
                        # (a tile that keeps no key may still visit a block, masked whole, as the Triton kernel does)
                        assert got == want or not want, (skv, offset, lb, rb, m0, lo, n, want)


def test_one_bf16_stage_deadlocks():
    """The consumer holds block j - 1's V stage while it needs block j's K: the bf16 ring needs two stages (the
    launcher refuses fewer)."""
    with pytest.raises(AssertionError, match="deadlock"):
        _simulate(2, 1, 1, True, 0)


def test_launcher_refuses_one_bf16_stage():
    pytest.importorskip("triton")
    import torch
    from mxattn.kernels import gluon_attention_fwd as gf
    from mxattn.kernels.triton_quantize import SeqMajorColumns
    q = torch.zeros(1, 2, 64, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.zeros(1, 2, 64, 4, dtype=torch.uint8)
    v = SeqMajorColumns(torch.zeros(1, 2, 128, 64, dtype=torch.uint8).view(torch.float8_e4m3fn),
                        torch.zeros(1, 2, 2, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="two bf16 stages"):
        gf.attention_fwd_gluon(q, s, q, s, v, softmax_scale=0.1, offset=0, left_bound=None, right_bound=None,
                               out=torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16), stats=torch.zeros(1, 2, 64, 1),
                               config=(1, 1))
