"""Host time of one Gluon forward launch (`gluon_attention_fwd.attention_fwd_gluon`) against one Triton forward
launch (`triton_attention_fwd.attention_fwd`) on the same FP8 operands, CUDA GPU (SM 9.0).

Session 26 measured the Gluon path through the public API about 1 ms slower per call than its kernel time on the
H200 machine (benchmarks/results/nvidia-h200/gluon_fwd/gluon_path.txt); this script finds where that goes:

* host us per launch: wall time of the Python call alone (the GPU queue kept short by a synchronize every few
  launches, outside the timed region), median over rounds, for both kernels at one small shape;
* the same for the pieces of the Gluon launch: `unsupported_reason`, the two TensorDescriptors, and the launch
  through Triton's dispatcher;
* cProfile of 200 Gluon launches (by own time), which names the functions that cost.

Usage: python benchmarks/gluon_launch_cost.py [--d 128] [--seq 1024] [--calls 200]
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def host_us(fn, calls: int, rounds: int = 5) -> float:
    """Median over rounds of the mean host wall time of fn() in us (synchronising before each round)."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main():
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    from mxattn.kernels.triton_quantize import quantize_qkv
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    d, s = args.d, args.seq
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 8, s, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    qq, kq, vq = quantize_qkv(q, k, v, dict(col=False), dict(col=False), dict(row=False, col_seq_major=True))
    ops = (qq.row.data, qq.row.scale, kq.row.data, kq.row.scale, vq.col_seq_major)
    out = torch.empty_like(q)
    stats = torch.empty(1, 8, s, 1, device="cuda", dtype=torch.float32)
    kw = dict(softmax_scale=d ** -0.5, offset=0, left_bound=None, right_bound=0, out=out, stats=stats)
    gluon = lambda: gf.attention_fwd_gluon(*ops, **kw)  # noqa: E731
    triton_fwd = lambda: tf.attention_fwd(*ops, **kw)  # noqa: E731
    gluon()
    triton_fwd()
    k_layout, v_layout = gf.tma_layouts(d)
    vd = vq.col_seq_major.data
    pieces = {
        "gluon launch (whole)": gluon,
        "triton launch (whole)": triton_fwd,
        "unsupported_reason": lambda: gf.unsupported_reason(ops[0], ops[3], ops[4], k_data=ops[2]),
        "tma_layouts": lambda: gf.tma_layouts(d),
        "two TensorDescriptors": lambda: (
            TensorDescriptor(ops[2], list(ops[2].shape), list(ops[2].stride()), [1, 1, gf.BLOCK_N, d], k_layout),
            TensorDescriptor(vd, list(vd.shape), list(vd.stride()), [1, 1, d, gf.BLOCK_N], v_layout)),
    }
    for name, fn in pieces.items():
        print(f"{name:28s} {host_us(fn, args.calls):9.1f} us host per call")
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(args.calls):
        gluon()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"\ncProfile of {args.calls} Gluon launches (own time):\n{buf.getvalue()}")


if __name__ == "__main__":
    main()
