"""Is the tiny call's forward+backward host-bound or GPU-bound? torch.profiler over 20 forward+backward calls
(B1 S128 H8 D64, bhsd leaves, causal) of torch SDPA and of mxfp8_attention (triton): wall time per call, the
GPU's busy time per call (sum of kernel times) and the top kernels by GPU time. Where the GPU's time per call
is near the wall time, host work is hidden behind the kernels. Usage (CUDA machine):
python benchmarks/tiny_step_profile.py"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import mxattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profiling import wall_per_call  # noqa: E402


def main():
    q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    calls = {
        "torch SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do),
        "mxfp8_attention": lambda: mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal",
                                                          backend="triton").backward(do),
    }
    n = 20
    for name, fn in calls.items():
        wall = wall_per_call(fn, 200, warmup=30)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
        gpu = sum(e.device_time_total for e in events) / n
        print(f"{name}: wall {wall:.1f} us per forward+backward, GPU kernels {gpu:.1f} us per call "
              f"({len(events)} kernel kinds)")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:8]:
            print(f"    {e.device_time_total / n:8.1f} us  x{e.count // n:<2d} {e.key[:90]}")


if __name__ == "__main__":
    main()
