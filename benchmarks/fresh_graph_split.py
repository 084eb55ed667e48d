"""Where a forward+backward on a fresh autograd graph loses time on a CUDA machine: the tiny call (B1 S128 H8
D64, causal, bf16 leaves) in a loop of forward then backward, the host time of each half measured apart
(perf_counter around each, no synchronisation inside the loop), under four regimes: as users run it; the
backward on the calling thread (`torch.autograd.set_multithreading_enabled(False)`); Python's garbage collector
off; both. torch SDPA in the same rounds. Also the op plans' recordings and replays during the runs.
Usage (CUDA machine): python benchmarks/fresh_graph_split.py [--layout bshd|bhsd]"""
import contextlib
import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mxattn
from mxattn import op_plans

layout = sys.argv[sys.argv.index("--layout") + 1] if "--layout" in sys.argv else "bshd"
shape = (1, 128, 8, 64) if layout == "bshd" else (1, 8, 128, 64)
q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
to_sdpa = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
calls = {
    "torch SDPA": lambda: to_sdpa(F.scaled_dot_product_attention(to_sdpa(q), to_sdpa(k), to_sdpa(v),
                                                                  is_causal=True)),
    "mxfp8_attention": lambda: mxattn.mxfp8_attention(q, k, v, qkv_format=layout, attn_mask_type="causal",
                                                      backend="triton"),
}


@contextlib.contextmanager
def regime(single_thread: bool, no_gc: bool):
    if no_gc:
        gc.disable()
    try:
        with torch.autograd.set_multithreading_enabled(not single_thread):
            yield
    finally:
        gc.enable()


def split(call, n=300):
    """(median forward us, median backward us, wall us per iteration) of n fresh forward+backward iterations."""
    for _ in range(30):
        call().backward(do)
    torch.cuda.synchronize()
    fwd, bwd = [], []
    t_start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        o = call()
        t1 = time.perf_counter()
        o.backward(do)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
        del o
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t_start) / n
    return statistics.median(fwd) * 1e6, statistics.median(bwd) * 1e6, wall * 1e6


def main():
    print(f"{torch.cuda.get_device_name()}, layout {layout}, tiny call, fresh forward+backward per iteration")
    regimes = [("as users run it", False, False), ("backward on the calling thread", True, False),
               ("gc off", False, True), ("calling thread + gc off", True, True)]
    before = sum(s[0] for s in op_plans.PLANS._families.values()), sum(s[1] for s in op_plans.PLANS._families.values())
    best = {}
    for _ in range(3):  # interleaved rounds; the best of each
        for rname, single, no_gc in regimes:
            for cname, call in calls.items():
                with regime(single, no_gc):
                    r = split(call)
                key = (rname, cname)
                best[key] = min(best.get(key, r), r, key=lambda x: x[2])
    for rname, *_ in regimes:
        for cname in calls:
            f, b, w = best[(rname, cname)]
            print(f"{rname:32s} {cname:16s} forward {f:7.1f} us  backward {b:7.1f} us  wall/iter {w:7.1f} us")
    after = sum(s[0] for s in op_plans.PLANS._families.values()), sum(s[1] for s in op_plans.PLANS._families.values())
    print(f"op plans during the runs: {after[0] - before[0]} recordings, {after[1] - before[1]} replays; "
          f"last reason {op_plans.PLANS.last_reason}")


if __name__ == "__main__":
    main()
