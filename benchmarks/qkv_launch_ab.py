"""Host time of the forward's Q/K/V quantization in one launch (`quantize_qkv`, what the backend does) against
three `quantize_rowcol` launches, interleaved call by call on one machine (the device hosts' speed drifts
between runs): per call, synchronise, then time the call's CPU wall time; medians over 280 calls.
Usage (CUDA machine): python benchmarks/qkv_launch_ab.py"""
import time, statistics
import torch
import mxattn
from mxattn.kernels import triton_quantize as tq
fused = tq.quantize_qkv
def three(q, k, v, a, b, c):
    return tq.quantize_rowcol(q, **a), tq.quantize_rowcol(k, **b), tq.quantize_rowcol(v, **c)
def host_us(fn):
    torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); return (time.perf_counter() - t0) * 1e6
dev = torch.device("cuda")
for (B, S, H, D) in ((4, 2048, 16, 64), (2, 4096, 16, 128)):
    q, k, v = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    qb, kb, vb = (t.detach().transpose(1, 2) for t in (q, k, v))
    a, b, c = dict(), dict(row_dequant=True), dict(col_dequant=True)
    call = lambda: mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
    res = {}
    for rep in range(300):
        for name, impl in (("fused", fused), ("three", three)):
            tq.quantize_qkv = impl
            res.setdefault(f"quant {name}", []).append(host_us(lambda: impl(qb, kb, vb, a, b, c)))
            res.setdefault(f"fwd(grad) {name}", []).append(host_us(call))
            with torch.no_grad():
                res.setdefault(f"fwd(nograd) {name}", []).append(host_us(call))
    print((B, S, H, D), "  ".join(f"{k_} {statistics.median(v_[20:]):.0f}" for k_, v_ in res.items()), flush=True)
    tq.quantize_qkv = fused
