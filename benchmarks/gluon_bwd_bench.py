"""The backward's dK/dV pass at `python -m mxattn bench`'s default configs (mxattn.bench.DEFAULT_CONFIGS): the
Triton dK/dV kernel of mode "pre" (`triton_attention_bwd._launch_dkdv`, its default config) against the Gluon
warp-specialised one (`gluon_attention_bwd.dkdv_gluon`) on the same inputs, built as attention_bwd builds them in
mode "pre" (fused quantizer, prep pass: bf16 scratch of Q and dO both ways, delta; all heads in one chunk).

Kernel time only: CUDA-event medians over interleaved rounds (each round times ITERS launches of each kernel in
turn), and the ratio gluon / triton from the same run. Before timing, each config checks the Gluon dK and dV
against the Triton kernel's (share bit-equal, share within one bf16 ulp). CUDA only (an sm_90 GPU for Gluon).

Usage: python benchmarks/gluon_bwd_bench.py [--config name:B:Hq:Hkv:S:D:causal ...] [--rounds 15] [--iters 10]
[--stages N] [--block-m N] [--json FILE]
"""

import argparse
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "triton")]

import torch  # noqa: E402
from gluon_fwd_bench import _ordered_bf16, _parse  # noqa: E402


def _time(runs: dict, rounds: int, iters: int) -> dict:
    """{name: median ms per launch} over `rounds` interleaved rounds of `iters` launches each."""
    samples = {k: [] for k in runs}
    for fn in runs.values():  # warm-up (compilation, caches)
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_config(name, B, HQ, HKV, S, D, causal, rounds, iters, stages=None, block_m=None):
    from test_gluon_bwd_gpu import _pre_inputs, _triton_dkdv
    from mxattn.kernels import gluon_attention_bwd as gb
    scale = 1.0 / math.sqrt(D)
    rb = 0 if causal else None
    g = torch.Generator(device="cuda").manual_seed(0)
    ins = _pre_inputs(B, HQ, HKV, S, S, D, 0, rb, g, scale)
    dk_t, dv_t, dk_g, dv_g = (torch.empty(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    runs = {
        "triton": lambda: _triton_dkdv(*ins, dk_t, dv_t, scale, 0, rb),
        "gluon": lambda: gb.dkdv_gluon(*ins, dk_g, dv_g, softmax_scale=scale, offset=0, right_bound=rb,
                                       stages=stages, block_m=block_m),
    }
    for fn in runs.values():
        fn()
    torch.cuda.synchronize()
    check = {}
    for label, x, ref in (("dk", dk_g, dk_t), ("dv", dv_g, dv_t)):
        ulps = (_ordered_bf16(x) - _ordered_bf16(ref)).abs()
        check[label] = dict(exact=(ulps == 0).float().mean().item(), within_1ulp=(ulps <= 1).float().mean().item(),
                            max_ulps=ulps.max().item())
    ms = _time(runs, rounds, iters)
    pairs = S * (S + 1) // 2 if causal else S * S
    flops = 4 * 2 * B * HQ * pairs * D  # the pass's four GEMMs (S, dP, dV, dK)
    out = dict(config=name, B=B, Hq=HQ, Hkv=HKV, S=S, D=D, causal=causal, stages=stages or gb.STAGES[D],
               block_m=block_m or gb.BLOCK_M[D],
               ms=ms, ratio_gluon_over_triton=ms["gluon"] / ms["triton"],
               tflops={k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()}, agreement=check)
    del ins
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", type=_parse, help="name:B:Hq:Hkv:S:D:causal (repeatable)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--stages", type=int, default=None, help="the Gluon kernel's ring depth (default STAGES)")
    parser.add_argument("--block-m", type=int, default=None,
                        help="the Gluon kernel's query rows per streamed block (default BLOCK_M)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gluon_bwd_bench.py needs a CUDA GPU (an sm_90 one for the Gluon kernel)")
    if torch.cuda.get_device_capability()[0] != 9:
        sys.exit(f"the Gluon dK/dV kernel is built for sm_90, this is {torch.cuda.get_device_name()}")
    from mxattn.bench import DEFAULT_CONFIGS
    results = dict(device=torch.cuda.get_device_name(), configs=[])
    for cfg in args.config or DEFAULT_CONFIGS:
        r = bench_config(*cfg, args.rounds, args.iters, args.stages, args.block_m)
        results["configs"].append(r)
        print(f"{r['config']} (stages {r['stages']}, block_m {r['block_m']}): triton {r['ms']['triton']:.3f} ms, gluon {r['ms']['gluon']:.3f} ms "
              f"(gluon / triton {r['ratio_gluon_over_triton']:.3f}); agreement {r['agreement']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
