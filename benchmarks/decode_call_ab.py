"""A/B of the paged decode step's public eager call (`mxfp8_attention_with_kvcache`, triton) in one run: the
decode kernel's register cap (`DECODE_MAXNREG` None or 128) crossed with the split count (4 or 8, and the
library's choice), at batch 8 and contexts 1k and 4k (Hq 32, Hkv 8, D 128, pages of 256, as decode_bench.py).
Each figure: wall microseconds per call over 200 back-to-back calls (host and GPU together, as a generate loop
pays them), the median of 5 rounds (the kernels' GPU times: decode_bench.py), and two gauges of the host's speed
in the same run: torch SDPA's eager call over the bf16 cache and 200 tiny torch ops (`torch.add` on
8 elements). Written for session 18's unexplained figure (public call 383 us against session 17's 155-224).

Usage (CUDA machine): python benchmarks/decode_call_ab.py"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_bench as db  # noqa: E402
import mxattn  # noqa: E402
from mxattn.kernels import triton_paged_attention as tp  # noqa: E402


def wall_us(fn, n: int = 200, rounds: int = 5) -> float:
    """Median over rounds of the wall time per call of n back-to-back calls (synchronised at both ends)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call")
    tiny = torch.zeros(8, device="cuda")
    print(f"host gauge: torch.add on 8 elements {wall_us(lambda: torch.add(tiny, 1.0)):.1f}")
    for context in (1024, 4096):
        cache, slots, k, v = db.fill_cache(8, context)
        q = torch.randn(8, db.HQ, db.D, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(9, dtype=torch.int32, device="cuda")
        q4 = q[:, :, None]
        sdpa = wall_us(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
        print(f"batch 8, {context} tokens: torch SDPA eager call {sdpa:.1f}")
        for cap in (None, 128):
            for splits in (0, 4, 8):
                tp.DECODE_MAXNREG = cap
                call = lambda: mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu,  # noqa: E731
                                                                   backend="triton", num_splits=splits)
                print(f"  cap {cap}, num_splits {splits}: public call {wall_us(call):7.1f}", flush=True)
        del cache, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
