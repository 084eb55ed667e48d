"""The Gluon forward's synchronisation protocol (mxattn/kernels/gluon_attention_fwd.py), simulated on the CPU under
random interleavings: the producer (TMA into the FP8 ring, dequantization into the bf16 ring), the two consumer
warpgroups (S GEMM of block j issued with the P V GEMM of block j - 1, stage release after it) and the ping-pong
turns, with mbarrier phase/parity semantics (a wait on parity P passes once the barrier's phase parity differs
from P; a fresh barrier is in phase 0). Checks: no deadlock, a consumer only reads a stage holding the block it
wants, the producer never overwrites a stage a consumer GEMM still reads, every block reaches the consumers.

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


def _simulate(n_blk, NS, NF, pingpong, seed):
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
                issue(i, i)
        for j in range(n_blk):
            f, s = j % NF, j % NS
            yield fp8[f], (j // NF) & 1
            assert fp8_holds[f] == j
            yield empty[s], ((j // NS) & 1) ^ 1
            assert not readers[s], f"stage {s} overwritten while read by {readers[s]}"
            bf16_holds[s] = j
            yield None
            ready[s].arrive()
            if j + NF < n_blk:
                issue(f, j + NF)

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
        assert bf16_holds[0] == 0
        readers[0].add(wg)
        turn_pass()
        yield None
        for j in range(1, n_blk):
            s, sp = j % NS, (j - 1) % NS
            yield ready[s], (j // NS) & 1
            yield turn_wait(j)
            assert bf16_holds[s] == j and bf16_holds[sp] == j - 1
            readers[s].add(wg)
            turn_pass()
            yield None
            readers[sp].discard(wg)
            consumed[wg].append(j - 1)
            empty[sp].arrive()
        sl = (n_blk - 1) % NS
        yield turn_wait(n_blk)
        assert bf16_holds[sl] == n_blk - 1
        turn_pass()
        yield None
        readers[sl].discard(wg)
        consumed[wg].append(n_blk - 1)
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
                assert consumed[0] == consumed[1] == list(range(n_blk))
                return
            if not tma_in_flight:
                raise AssertionError(f"deadlock: n_blk={n_blk} NS={NS} NF={NF} pingpong={pingpong}")
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
