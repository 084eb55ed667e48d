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
[--iters 10] [--stages N] [--block-m N (dK/dV only)]
[--variant name:defer=0|1[,block_n=N (dQ)][,block_m=N][,stages=N][,stats_loads=N (dK/dV)] ...]
[--padded (dK/dV)] [--json FILE]
(e.g. --variant base:defer=0 --variant pipelined:defer=1: the software-pipelined dK / dQ GEMM against the
waited one, interleaved in one run, outputs compared bit for bit)
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


def _distinct(values):
    """The one value of `values`, or their sorted list where the variants differ (a report's stages / block rows)."""
    xs = sorted(set(values))
    return xs[0] if len(xs) == 1 else xs


def padded_lengths(B: int, S: int):
    """The per-sequence lengths of --padded: a padded batch of B sequences in S rows, the first full and each next
    one shorter by S / (2B), none below 1 (B = 2, S = 4096: 4096, 3072)."""
    return [max(S - (b * S) // (2 * B), 1) for b in range(B)]


def _padded_seq(B: int, S: int):
    """SeqInfo of `padded_lengths` (padded, not packed) on the GPU."""
    from mxattn.seqinfo import SeqInfo
    cu = [0]
    for n in padded_lengths(B, S):
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, device="cuda", dtype=torch.int32)
    return SeqInfo(cu_t, cu_t, S, S, False)


def _kernels(kernel, B, HQ, HKV, S, D, causal, stages, block_m, variants=None, padded=False):
    """(runs {"triton": fn, <variant>: fn ...}, [(label, output, triton output)], GEMMs of the pass, the Gluon
    kernel's (stages, block rows)) of the dK/dV pass (kernel "dkdv") or the dQ pass ("dq") on one config's inputs.
    variants: {name: launch keywords of the Gluon kernel (`_variant`)}; {"gluon": {}} by default. padded (dK/dV):
    the Gluon launches take the inputs as a padded batch (`padded_lengths`, bottom-right causal), the Triton one
    stays dense (its outputs and time are then a reference point, not the same problem)."""
    from test_gluon_bwd_gpu import _pre_inputs, _triton_dkdv
    variants = variants or {"gluon": {}}
    scale = 1.0 / math.sqrt(D)
    rb = 0 if causal else None
    g = torch.Generator(device="cuda").manual_seed(0)
    runs, outputs = {}, []
    if kernel == "dq":
        from test_gluon_dq_gpu import _dq_inputs, _triton_dq
        from mxattn.kernels import gluon_attention_dq as gd
        ins, _ = _dq_inputs(B, HQ, HKV, S, S, D, 0, rb, g, scale)
        dq_t = torch.empty(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
        runs["triton"] = lambda: _triton_dq(*ins, dq_t, scale, 0, rb)
        for name, kw in variants.items():
            dq_g = torch.empty(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
            kw = {"stages": stages, **kw}
            runs[name] = lambda dq_g=dq_g, kw=kw: gd.dq_gluon(*ins, dq_g, softmax_scale=scale, offset=0,
                                                             right_bound=rb, **kw)
            outputs.append((f"{name} dq", dq_g, dq_t))
        return runs, outputs, 3, (_distinct(kw.get("stages", stages) or gd.STAGES[D] for kw in variants.values()),
                                  gd.BLOCK_M)
    from mxattn.kernels import gluon_attention_bwd as gb
    ins = _pre_inputs(B, HQ, HKV, S, S, D, 0, rb, g, scale)
    dk_t, dv_t = (torch.empty(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs["triton"] = lambda: _triton_dkdv(*ins, dk_t, dv_t, scale, 0, rb)
    extra = dict(seq=_padded_seq(B, S), bottom_right=causal) if padded else {}
    launched = []  # each variant's (block rows, ring depth or None, defer) as dkdv_gluon resolves them
    for name, kw in variants.items():
        dk_g, dv_g = (torch.empty(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kw = {"stages": stages, "block_m": block_m, **kw, **extra}  # a variant's own ring depth / block rows win
        launched.append(gb.resolve_schedule(D, gb.STATS_LOADS[D] if kw.get("stats_loads") is None
                                            else kw["stats_loads"], False, False, kw["block_m"], kw["stages"],
                                            kw.get("defer")))
        runs[name] = lambda dk_g=dk_g, dv_g=dv_g, kw=kw: gb.dkdv_gluon(
            *ins, dk_g, dv_g, softmax_scale=scale, offset=0, right_bound=rb, **kw)
        outputs += [(f"{name} dk", dk_g, dk_t), (f"{name} dv", dv_g, dv_t)]
    return runs, outputs, 4, (_distinct(ns or gb.STAGES[D] for _, ns, _ in launched),
                              _distinct(bm for bm, _, _ in launched))


def bench_config(name, B, HQ, HKV, S, D, causal, rounds, iters, stages=None, block_m=None, kernel="dkdv",
                 variants=None, padded=False):
    runs, outputs, gemms, (ns, bm) = _kernels(kernel, B, HQ, HKV, S, D, causal, stages, block_m, variants, padded)
    for fn in runs.values():
        fn()
    torch.cuda.synchronize()
    check = {}
    for label, x, ref in outputs:
        ulps = (_ordered_bf16(x) - _ordered_bf16(ref)).abs()
        check[label] = dict(exact=(ulps == 0).float().mean().item(), within_1ulp=(ulps <= 1).float().mean().item(),
                            max_ulps=ulps.max().item())
    first = {}  # each output of every variant against the first variant's (bit-equal where the GEMMs are the same)
    for label, x, _ in outputs:
        kind = label.split()[-1]
        if kind in first:
            check[label]["equal_to_" + first[kind][0]] = bool(torch.equal(x, first[kind][1]))
        else:
            first[kind] = (label.split()[0], x)
    ms = _time(runs, rounds, iters)
    pairs = S * (S + 1) // 2 if causal else S * S
    flops = gemms * 2 * B * HQ * pairs * D  # the pass's GEMMs (dK/dV: S, dP, dV, dK; dQ: S, dP, dQ)
    gluon = [k for k in runs if k != "triton"]
    out = dict(kernel=kernel, config=name, B=B, Hq=HQ, Hkv=HKV, S=S, D=D, causal=causal, padded=padded,
               lengths=padded_lengths(B, S) if padded else None, stages=ns, block_m=bm,
               ms=ms, ratio_gluon_over_triton=ms[gluon[0]] / ms["triton"],
               ratios_over_first_variant={k: ms[k] / ms[gluon[0]] for k in gluon[1:]},
               variants=variants or {"gluon": {}},
               tflops={k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()}, agreement=check)
    del runs, outputs
    torch.cuda.empty_cache()
    return out


def _variant(text):
    """name[:key=value,...] -> (name, launch keywords): defer=0/1, block_n=N (dQ), block_m=N, stages=N and
    stats_loads=N (dK/dV)."""
    name, _, rest = text.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in ("defer", "block_n", "block_m", "stages", "stats_loads"):
            raise argparse.ArgumentTypeError(f"unknown variant key {key!r} in {text!r}")
        kw[key] = bool(int(value)) if key == "defer" else int(value)
    return name, kw


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
    parser.add_argument("--variant", action="append", type=_variant,
                        help="name[:defer=0|1,block_n=N,block_m=N,stages=N,stats_loads=N]: a Gluon launch to time "
                             "(repeatable; A/B in one run, ratios to the first); one default launch named gluon when "
                             "none")
    parser.add_argument("--padded", action="store_true",
                        help="dK/dV: the Gluon launches take a padded batch (lengths S, S - S/2B, ...; bottom-right "
                             "causal); the Triton launch stays dense")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.dq and args.block_m is not None:
        parser.error("--block-m sets the dK/dV kernel's query block; the dQ kernel's is fixed (BLOCK_M)")
    if args.dq and args.padded:
        parser.error("--padded is for the dK/dV pass")
    if not torch.cuda.is_available():
        sys.exit("gluon_bwd_bench.py needs a CUDA GPU (an sm_90 one for the Gluon kernel)")
    if torch.cuda.get_device_capability()[0] != 9:
        sys.exit(f"the Gluon backward kernels are built for sm_90, this is {torch.cuda.get_device_name()}")
    from mxattn.bench import DEFAULT_CONFIGS
    results = dict(device=torch.cuda.get_device_name(), configs=[])
    for cfg in args.config or DEFAULT_CONFIGS:
        r = bench_config(*cfg, args.rounds, args.iters, args.stages, args.block_m, "dq" if args.dq else "dkdv",
                         dict(args.variant) if args.variant else None, args.padded)
        results["configs"].append(r)
        times = ", ".join(f"{k} {v:.3f} ms" for k, v in r["ms"].items())
        ratios = "".join(f", {k} / first {v:.3f}" for k, v in r["ratios_over_first_variant"].items())
        shape = f", padded {r['lengths']}" if args.padded else ""
        print(f"{r['kernel']} {r['config']} (stages {r['stages']}, block_m {r['block_m']}{shape}): {times} "
              f"(first gluon / triton {r['ratio_gluon_over_triton']:.3f}{ratios}); agreement {r['agreement']}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
