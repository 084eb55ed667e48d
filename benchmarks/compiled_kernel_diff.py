"""Which GPU kernels a compiled training step of transformers' GPT-2 (models_bench.py's config) runs with mxattn's
attention that it does not run with SDPA, and the reverse: every kernel of 5 profiled steps of each (torch.profiler,
CUDA activity), per step its count and time, listed by the difference in time. Says where a compiled step's GPU
time goes beyond the attention kernels themselves (copies, casts, fused inductor kernels around the op).
Usage (CUDA machine): python benchmarks/compiled_kernel_diff.py [--eager] [--rows N]"""
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_bench as mb  # noqa: E402
from compiled_step_profile import training_step  # noqa: E402

STEPS = 5


def kernels(attn: str, compiled: bool) -> dict:
    """kernel name -> [launches per step, us per step] over STEPS profiled steps."""
    step = training_step(attn, compiled)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    out = collections.defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = out[e.name]
            row[0] += 1 / STEPS
            row[1] += e.device_time / STEPS
    del step
    torch.cuda.empty_cache()
    return out


def main():
    compiled = "--eager" not in sys.argv
    rows = int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 40
    mb.mx_hf.register(mb.NAME, backend="triton")
    runs = {attn: kernels(attn, compiled) for attn in ("sdpa", mb.NAME)}
    sdpa, mx = runs["sdpa"], runs[mb.NAME]
    total = {a: sum(t for _, t in r.values()) for a, r in runs.items()}
    print(f"{torch.cuda.get_device_name()}, GPT-2 training step {'compiled' if compiled else 'eager'}: GPU kernel "
          f"time per step sdpa {total['sdpa'] / 1e3:.3f} ms, mxfp8 {total[mb.NAME] / 1e3:.3f} ms")
    names = sorted(set(sdpa) | set(mx), key=lambda n: -abs(mx.get(n, [0, 0])[1] - sdpa.get(n, [0, 0])[1]))
    print(f"{'mxfp8 - sdpa us':>15} {'sdpa n':>7} {'sdpa us':>9} {'mxfp8 n':>8} {'mxfp8 us':>9}  kernel")
    for n in names[:rows]:
        a, b = sdpa.get(n, [0, 0]), mx.get(n, [0, 0])
        print(f"{b[1] - a[1]:15.1f} {a[0]:7.1f} {a[1]:9.1f} {b[0]:8.1f} {b[1]:9.1f}  {n[:110]}")


if __name__ == "__main__":
    main()
