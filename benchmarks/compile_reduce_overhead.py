"""Eager calls against torch.compile(mode="reduce-overhead") (CUDA graphs: no host time per call) and torch SDPA
cuDNN BF16, forward and forward+backward, CUDA-event medians of 30 steps each timed with the GPU idle before
it; checks the compiled O and gradients equal the eager ones. Usage (CUDA machine): python benchmarks/compile_reduce_overhead.py"""
import statistics

import torch

import mxattn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
dev = torch.device("cuda")
def attn(q, k, v):
    return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
def sdpa(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
def step_ms(fn, q, k, v, do, n=30):
    def one():
        o = fn(q, k, v)
        return [g.clone() for g in torch.autograd.grad(o, (q, k, v), do)]
    for _ in range(5): one()
    ts = []
    for _ in range(n):
        torch.compiler.cudagraph_mark_step_begin()
        torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
        s.record(); g = one(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts), g
def fwd_ms(fn, q, k, v, n=30):
    with torch.no_grad():
        for _ in range(5): fn(q, k, v)
        ts = []
        for _ in range(n):
            torch.compiler.cudagraph_mark_step_begin()
            torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
            s.record(); o = fn(q, k, v); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts), o.clone()
for (B, S, H, D) in ((2, 4096, 16, 128), (4, 2048, 16, 64), (1, 1024, 16, 128), (1, 8192, 16, 128)):
    torch._dynamo.reset()  # (one compiled function per head dim, as each model layer has its own)
    compiled = torch.compile(attn, mode="reduce-overhead")
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
    res = {}
    for name, fn in (("eager", attn), ("compiled_ro", compiled), ("sdpa_cudnn", sdpa)):
        t, g = step_ms(fn, q, k, v, do)
        tf, o = fwd_ms(fn, q, k, v)
        res[name] = (t, tf, g, o)
    same_o = torch.equal(res["eager"][3], res["compiled_ro"][3])
    same_g = all(torch.equal(a, b) for a, b in zip(res["eager"][2], res["compiled_ro"][2]))
    print((B, S, H, D), " ".join(f"{n}: fwd {r[1]:.3f} fwd+bwd {r[0]:.3f} ms" for n, r in res.items()),
          f"| compiled==eager O {same_o} grads {same_g}", flush=True)
