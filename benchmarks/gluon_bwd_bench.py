"""The backward's dK/dV pass (or, with --dq, its dQ pass) at `python -m mxattn bench`'s default configs
(mxattn.bench.DEFAULT_CONFIGS): the Triton kernel of mode "pre" (`triton_attention_bwd._launch_dkdv` /
`_launch_dq`, its default config) against the Gluon warp-specialised one (`gluon_attention_bwd.dkdv_gluon` /
`gluon_attention_dq.dq_gluon`) on the same inputs, built as attention_bwd builds them in mode "pre" (fused
quantizer, prep pass: bf16 scratch of Q and dO both ways, delta; `kv_prep`: K both ways and V; all heads in one
chunk).

Kernel time only: CUDA-event medians over interleaved rounds (each round times ITERS launches of each kernel in
turn), and the ratio gluon / triton from the same run. Before timing, each config checks the Gluon outputs (dK
and dV, or dQ) against the Triton kernel's (share bit-equal, share within one bf16 ulp). CUDA only (an sm_90 GPU
for Gluon).

Usage: python benchmarks/gluon_bwd_bench.py [--dq] [--config name:B:Hq:Hkv:S:D:causal ...] [--rounds 15]
[--iters 10] [--stages N] [--block-m N (dK/dV only)] [--json FILE]
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


def _kernels(kernel, B, HQ, HKV, S, D, causal, stages, block_m):
    """(runs {"triton": fn, "gluon": fn}, [(label, gluon output, triton output)], GEMMs of the pass, the Gluon
    kernel's (stages, block rows)) of the dK/dV pass (kernel "dkdv") or the dQ pass ("dq") on one config's inputs."""
    from test_gluon_bwd_gpu import _pre_inputs, _triton_dkdv
    scale = 1.0 / math.sqrt(D)
    rb = 0 if causal else None
    g = torch.Generator(device="cuda").manual_seed(0)
    if kernel == "dq":
        from test_gluon_dq_gpu import _dq_inputs, _triton_dq
        from mxattn.kernels import gluon_attention_dq as gd
        ins, _ = _dq_inputs(B, HQ, HKV, S, S, D, 0, rb, g, scale)
        dq_t, dq_g = (torch.empty(B, HQ, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        runs = {"triton": lambda: _triton_dq(*ins, dq_t, scale, 0, rb),
                "gluon": lambda: gd.dq_gluon(*ins, dq_g, softmax_scale=scale, offset=0, right_bound=rb,
                                             stages=stages)}
        return runs, [("dq", dq_g, dq_t)], 3, (stages or gd.STAGES[D], gd.BLOCK_M)
    from mxattn.kernels import gluon_attention_bwd as gb
    ins = _pre_inputs(B, HQ, HKV, S, S, D, 0, rb, g, scale)
    dk_t, dv_t, dk_g, dv_g = (torch.empty(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    runs = {
        "triton": lambda: _triton_dkdv(*ins, dk_t, dv_t, scale, 0, rb),
        "gluon": lambda: gb.dkdv_gluon(*ins, dk_g, dv_g, softmax_scale=scale, offset=0, right_bound=rb,
                                       stages=stages, block_m=block_m),
    }
    return runs, [("dk", dk_g, dk_t), ("dv", dv_g, dv_t)], 4, (stages or gb.STAGES[D], block_m or gb.BLOCK_M[D])


def bench_config(name, B, HQ, HKV, S, D, causal, rounds, iters, stages=None, block_m=None, kernel="dkdv"):
    runs, outputs, gemms, (ns, bm) = _kernels(kernel, B, HQ, HKV, S, D, causal, stages, block_m)
    for fn in runs.values():
        fn()
    torch.cuda.synchronize()
    check = {}
    for label, x, ref in outputs:
        ulps = (_ordered_bf16(x) - _ordered_bf16(ref)).abs()
        check[label] = dict(exact=(ulps == 0).float().mean().item(), within_1ulp=(ulps <= 1).float().mean().item(),
                            max_ulps=ulps.max().item())
    ms = _time(runs, rounds, iters)
    pairs = S * (S + 1) // 2 if causal else S * S
    flops = gemms * 2 * B * HQ * pairs * D  # the pass's GEMMs (dK/dV: S, dP, dV, dK; dQ: S, dP, dQ)
    out = dict(kernel=kernel, config=name, B=B, Hq=HQ, Hkv=HKV, S=S, D=D, causal=causal, stages=ns, block_m=bm,
               ms=ms, ratio_gluon_over_triton=ms["gluon"] / ms["triton"],
               tflops={k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()}, agreement=check)
    del runs, outputs
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
    parser.add_argument("--dq", action="store_true",
                        help="the dQ pass (gluon_attention_dq.dq_gluon vs the Triton dQ kernel) instead of dK/dV")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.dq and args.block_m is not None:
        parser.error("--block-m sets the dK/dV kernel's query block; the dQ kernel's is fixed (BLOCK_M)")
    if not torch.cuda.is_available():
        sys.exit("gluon_bwd_bench.py needs a CUDA GPU (an sm_90 one for the Gluon kernel)")
    if torch.cuda.get_device_capability()[0] != 9:
        sys.exit(f"the Gluon backward kernels are built for sm_90, this is {torch.cuda.get_device_name()}")
    from mxattn.bench import DEFAULT_CONFIGS
    results = dict(device=torch.cuda.get_device_name(), configs=[])
    for cfg in args.config or DEFAULT_CONFIGS:
        r = bench_config(*cfg, args.rounds, args.iters, args.stages, args.block_m, "dq" if args.dq else "dkdv")
        results["configs"].append(r)
        print(f"{r['kernel']} {r['config']} (stages {r['stages']}, block_m {r['block_m']}): triton "
              f"{r['ms']['triton']:.3f} ms, gluon {r['ms']['gluon']:.3f} ms "
              f"(gluon / triton {r['ratio_gluon_over_triton']:.3f}); agreement {r['agreement']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
