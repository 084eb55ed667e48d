"""Why does a sink cost what it costs? Times the triton forward kernel alone (CUDA-graph replays, no host
overhead) with and without sink logits, and the public-API forward, on one config; prints the compiled
kernels' registers and spills. Usage: python benchmarks/sink_kernel_probe.py"""

import math

import torch

from mxattn import mxfp8_attention
from mxattn.bench import fwd_kernel_operands, time_cuda, time_graph
from mxattn.kernels import triton_attention_fwd as tf
from mxattn.kernels.triton_launch import _CACHES
from mxattn.kernels.triton_quantize import quantize_rowcol

B, H, S, D = 2, 16, 4096, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qq, kv = quantize_rowcol(q), fwd_kernel_operands(k, v)
o, st = torch.empty_like(q), torch.empty(B, H, S, 1, device="cuda")
sink = torch.zeros(H, device="cuda")
mk = dict(softmax_scale=1 / math.sqrt(D), offset=0, left_bound=None, right_bound=0, out=o, stats=st)
for name, extra in (("vanilla", {}), ("sink", dict(sink=sink)), ("vanilla", {}), ("sink", dict(sink=sink))):
    fn = lambda extra=extra: tf.attention_fwd(qq.row.data, qq.row.scale, *kv, **mk, **extra)  # noqa: E731
    print(f"kernel {name}: graph {time_graph(fn, 5, 30):.3f} ms, eager {time_cuda(fn, 5, 30):.3f} ms", flush=True)
for cache in _CACHES.values():
    for kernel, _ in cache.values():
        print("compiled:", kernel.name, "regs", kernel.n_regs, "spills", kernel.n_spills)
qa, ka, va = (t.transpose(1, 2) for t in (q, k, v))
off = torch.zeros(H, device="cuda", requires_grad=True)
with torch.no_grad():
    for name, kw in (("vanilla", {}), ("learnable", dict(softmax_type="learnable", softmax_offset=off)),
                     ("off-by-one", dict(softmax_type="off-by-one"))):
        fn = lambda kw=kw: mxfp8_attention(qa, ka, va, attn_mask_type="causal", backend="triton", **kw)  # noqa
        print(f"api {name}: eager {time_cuda(fn, 5, 30):.3f} ms, graph {time_graph(fn, 5, 30) or float('nan'):.3f}")
