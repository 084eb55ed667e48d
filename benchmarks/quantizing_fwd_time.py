"""GPU time of the Triton one-launch quantizing forward (`triton_attention_fwd.attention_fwd_quantizing`: decode
steps and short query chunks without a backward), CUDA GPU. For before/after comparisons of that kernel across
trees (its signature is the same since session 20): run this file from each tree's root.

Each case: q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D] bf16, causal (bottom-right offset Skv - Sq); the launch is
captured in a CUDA graph and its replays timed with CUDA events (`triton.testing.do_bench_cudagraph`), so the
figure is the kernel's GPU time, not the host's.
Usage: python benchmarks/quantizing_fwd_time.py [--rep MS]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

CASES = [  # (B, Hq, Hkv, Sq, Skv, D)
    (8, 32, 8, 1, 4096, 64), (1, 32, 8, 1, 8192, 64), (4, 16, 16, 16, 2048, 64),
    (8, 32, 8, 1, 4096, 128), (4, 16, 16, 16, 2048, 128),
]


def main():
    import triton.testing
    from mxattn.kernels import triton_attention_fwd as tf
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rep", type=int, default=200, help="ms of replays per case")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, hq, hkv, sq, skv, d in CASES:
        q = torch.randn(B, hq, sq, d, device="cuda", generator=g).to(torch.bfloat16)
        k, v = (torch.randn(B, hkv, skv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        out = torch.empty_like(q)
        stats = torch.empty(B, hq, sq, 1, device="cuda", dtype=torch.float32)

        def run():
            tf.attention_fwd_quantizing(q, k, v, softmax_scale=d ** -0.5, offset=skv - sq, left_bound=None,
                                        right_bound=0, out=out, stats=stats)
        run()
        torch.cuda.synchronize()
        us = triton.testing.do_bench_cudagraph(run, rep=args.rep) * 1e3
        print(f"B{B} Hq{hq} Hkv{hkv} Sq{sq} Skv{skv} D{d}: {us:8.1f} us")


if __name__ == "__main__":
    main()
