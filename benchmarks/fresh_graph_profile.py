"""Where a forward+backward on a fresh autograd graph spends its host time beyond a forward alone plus a retained
graph's backward: wall time per call of the three (tiny call B1 S128 H8 D64, bhsd leaves, causal, triton), then
torch.profiler's CPU self time per call of the top operations for the fresh and the retained case.
Usage (CUDA machine): python benchmarks/fresh_graph_profile.py"""
import time, torch, mxattn
from torch.profiler import profile, ProfilerActivity
q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
call = lambda: mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="triton")
o = call()
modes = {"fresh fwd+bwd": lambda: call().backward(do), "fwd only": call,
         "retained bwd": lambda: o.backward(do, retain_graph=True)}
for name, fn in modes.items():
    for _ in range(30): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(200): fn()
    torch.cuda.synchronize(); print(f"{name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")
for name in ("fresh fwd+bwd", "retained bwd"):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50): modes[name]()
        torch.cuda.synchronize()
    print(f"=== {name}, CPU self time per call (50 calls)")
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"  {e.self_cpu_time_total / 50:8.1f} us self  {e.cpu_time_total / 50:8.1f} total  x{e.count / 50:4.1f}  {e.key[:70]}")
