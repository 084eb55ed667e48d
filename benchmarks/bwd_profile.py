"""Per-kernel GPU time of the triton backward (torch.profiler), for finding where its time goes.

Usage: python benchmarks/bwd_profile.py [--mode pre|fp8] [--causal] [--gluon] [--timeline] [B H S D]
--gluon: mode "pre" with the Gluon dK/dV and dQ kernels where they take the chunk (as the backend runs it on
Hopper). Prints one line per kernel name: total ms over the profiled calls / calls, and the share of the total.
--timeline: instead, one eager TritonBackend.backward call (as `python -m mxattn bench` times it) with the GPU
idle before it: each kernel's start and duration, and the gaps in which the GPU waited for the host."""
import argparse
import collections
import math

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[2, 16, 4096, 128])
    ap.add_argument("--mode", default="pre", choices=("pre", "fp8"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--gluon", action="store_true")
    args = ap.parse_args()
    if args.timeline:
        timeline(*args.shape, causal=args.causal)
        return
    from mxattn.kernels import triton_attention_bwd as tb
    from mxattn.kernels.triton_quantize import quantize_rowcol
    B, H, S, D = args.shape
    dev = torch.device("cuda")
    q, k, v, do, o = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(5))
    st = torch.randn(B, H, S, 1, device=dev).abs() + 8.0
    qq, kq, vq, dq_ = (quantize_rowcol(t) for t in (q, k, v, do))
    g = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    mk = dict(softmax_scale=1 / math.sqrt(D), offset=0, left_bound=None, right_bound=0 if args.causal else None)
    if args.gluon:
        from mxattn.kernels import gluon_attention_bwd, gluon_attention_dq
        mk.update(gluon_dkdv=gluon_attention_bwd, gluon_dq=gluon_attention_dq)

    def run():
        tb.attention_bwd(qq.row, qq.col, kq.row, kq.col, vq.row, dq_.row, dq_.col, o, do, st, dq=g[0], dk=g[1],
                         dv=g[2], mode=args.mode, **mk)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            run()
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:60]] += e.device_time_total / 1e3
    all_ms = sum(tot.values())
    print(f"B{B} H{H} S{S} D{D} causal={args.causal} mode={args.mode} gluon={args.gluon}: {all_ms / args.reps:.3f} ms of kernels per call")
    for name, ms in sorted(tot.items(), key=lambda x: -x[1]):
        print(f"  {ms / args.reps:8.3f} ms  {100 * ms / all_ms:5.1f}%  {name}")


def timeline(B: int, H: int, S: int, D: int, causal: bool) -> None:
    from mxattn.backends.base import AttentionParams
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.mask import MaskSpec
    dev = torch.device("cuda")
    q, k, v, do = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    params = AttentionParams(softmax_scale=D ** -0.5, mask=MaskSpec(causal=causal), out_dtype=torch.bfloat16)
    be = TritonBackend()
    o, st, saved = be.forward(q, k, v, params)
    for _ in range(3):
        be.backward(saved, o, st, do, params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        be.backward(saved, o, st, do, params)
        b.record()
        b.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    t0 = ev[0].time_range.start
    prev = t0
    busy = 0.0
    print(f"B{B} H{H} S{S} D{D} causal={causal}: event time {a.elapsed_time(b):.3f} ms")
    for e in ev:
        gap = e.time_range.start - prev
        busy += e.time_range.end - e.time_range.start
        dur = e.time_range.end - e.time_range.start
        print(f"  start {(e.time_range.start - t0) / 1e3:7.3f} ms  dur {dur / 1e3:6.3f}  gap before {gap / 1e3:6.3f}"
              f"  {e.name[:50]}")
        prev = max(prev, e.time_range.end)
    print(f"  kernels busy {busy / 1e3:.3f} ms of {(prev - t0) / 1e3:.3f} ms from the first kernel's start")
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    top = sorted(cpu, key=lambda e: -e.cpu_time_total)[:12]
    for e in top:
        print(f"  cpu {e.cpu_time_total / 1e3:7.3f} ms  {e.name[:70]}")


if __name__ == "__main__":
    main()
