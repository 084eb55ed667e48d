"""cProfile of a repeated step on a CUDA machine (host time by Python function), shared by the profiling scripts."""
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
