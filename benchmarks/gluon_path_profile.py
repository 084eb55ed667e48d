"""Where the public API's time goes on the Gluon forward path against the Triton FP8 path (the triton backend,
no-grad forward, bshd inputs), CUDA GPU (SM 9.0): for each path, the CUDA-event time per call after warm-up,
the host time per call, and a torch.profiler table of the calls (kernels with their GPU time, CUDA runtime calls
such as synchronizations and copies). Written for session 26's finding that the Gluon path through the public
API took about 1 ms more per call than its kernel (benchmarks/results/nvidia-h200/gluon_fwd/gluon_path.txt).

--grad: forward+backward calls instead (session 27's bench measured the Gluon path's forward+backward 0.82-0.98x
the Triton FP8 path's at the bench's default configs although its forward was 1.12-1.31x faster).

Usage: python benchmarks/gluon_path_profile.py [--config name:B:Hq:Hkv:S:D:causal] [--calls N] [--layout L] [--grad]
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402


def main():
    import mxattn
    from mxattn.bench import time_cuda
    from gluon_path_bench import _parse, path
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="b4_h16_s2048_d64:4:16:16:2048:64:0")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--layout", choices=["bshd", "bhsd"], default="bshd")
    ap.add_argument("--grad", action="store_true", help="time forward+backward calls")
    args = ap.parse_args()
    name, B, HQ, HKV, S, D, causal = _parse(args.config)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, name, args.layout,
          "forward+backward" if args.grad else "forward, no grad")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (lambda h: (B, S, h, D)) if args.layout == "bshd" else (lambda h: (B, h, S, D))
    q, k, v = (torch.randn(*shape(h), device="cuda", generator=g).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    mask = "causal" if causal else "no_mask"

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    do = torch.randn_like(q)

    def fwd():
        if args.grad:
            for t in leaves:
                t.grad = None
            mxattn.mxfp8_attention(*leaves, qkv_format=args.layout, attn_mask_type=mask, backend="triton").backward(do)
            return None
        with torch.no_grad():
            return mxattn.mxfp8_attention(q, k, v, qkv_format=args.layout, attn_mask_type=mask, backend="triton")

    for p in ("gluon", "triton_fp8"):
        with path(p):
            for _ in range(5):
                fwd()
            torch.cuda.synchronize()
            ms = time_cuda(fwd, 5, args.calls)
            host = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fwd()
                host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            print(f"\n== {p}: {ms:.3f} ms per call (CUDA events), host {statistics.median(host):.1f} us per call")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    fwd()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
