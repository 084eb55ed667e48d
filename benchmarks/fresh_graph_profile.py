"""Where a forward+backward on a fresh autograd graph spends its host time beyond a forward alone plus a retained
graph's backward: wall time per call of the three (tiny call B1 S128 H8 D64, bhsd leaves, causal, triton), then
torch.profiler's CPU self time per call of the top operations for the fresh and the retained case.
Usage (CUDA machine): python benchmarks/fresh_graph_profile.py"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mxattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profiling import wall_per_call  # noqa: E402

q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
call = lambda: mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal",  # noqa: E731
                                      backend="triton")
o = call()
modes = {"fresh fwd+bwd": lambda: call().backward(do), "fwd only": call,
         "retained bwd": lambda: o.backward(do, retain_graph=True)}
for name, fn in modes.items():
    print(f"{name}: {wall_per_call(fn, 200, warmup=30):.1f} us")
for name in ("fresh fwd+bwd", "retained bwd"):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            modes[name]()
        torch.cuda.synchronize()
    print(f"=== {name}, CPU self time per call (50 calls)")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"  {e.self_cpu_time_total / 50:8.1f} us self  {e.cpu_time_total / 50:8.1f} total  "
              f"x{e.count / 50:4.1f}  {e.key[:70]}")
