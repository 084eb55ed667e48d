"""Helpers the profiling scripts share: cProfile of a repeated step on a CUDA machine (host time by Python
function) and the wall time per call of back-to-back calls."""
import cProfile
import pstats

import torch


def cprofile_steps(step, iterations: int, top: int, cumulative_filter: str = "", cumulative_top: int = 40) -> None:
    """Run step() `iterations` times under cProfile (device synchronised at the end) and print the `top`
    functions by own time; with `cumulative_filter` (a regex of file/function names) also those by cumulative
    time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    if cumulative_filter:
        stats.sort_stats("cumulative").print_stats(cumulative_filter, cumulative_top)


def wall_per_call(fn, n: int, warmup: int = 0, unit: float = 1e6) -> float:
    """Wall time per call of n back-to-back calls of fn (after `warmup` calls), the device synchronised at both
    ends, in `unit` per second (1e6: microseconds)."""
    import time

    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * unit
