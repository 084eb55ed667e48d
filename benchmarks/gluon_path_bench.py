"""The triton backend's forward data paths through the public API (quantization included), one run, CUDA GPU:

* gluon        the FP8 data path with the Gluon forward (the library's choice on Hopper where it takes the call)
* triton_fp8   the same path with the Triton forward (MXATTN_GLUON_FWD=0)
* bf16_scratch K/V dequantized to bf16 scratch by the quantizer, the Triton forward on it (the library's choice
               while the scratch fits 512 MiB); only where the problem allows it
* sdpa         torch SDPA on the bf16 inputs (cuDNN where it takes the call), the baseline of the ratios

Each path is timed as `mxattn.mxfp8_attention(..., backend="triton")` on bshd inputs: the forward without grad
(fwd) and forward+backward (fwd_bwd), CUDA-event medians over interleaved rounds (every path once per round, so
slow phases of the machine hit all alike); the peak memory the forward with grad adds (kept for the backward and
the call's scratch). The launch-plan caches are reset whenever the path changes, so a plan recorded on one path
never replays on another. Before timing, O of each path is compared with the Triton FP8 path's.

Usage: python benchmarks/gluon_path_bench.py [--config name:B:Hq:Hkv:S:D:causal ...] [--rounds N] [--json FILE]
(default configs: the bench's four, whose scratch fits, and three whose scratch exceeds the budget)
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

LARGE_CONFIGS = [("b8_h16_s8192_d128_causal", 8, 16, 16, 8192, 128, True),
                 ("b16_h16_s8192_d64", 16, 16, 16, 8192, 64, False),
                 ("b8_h32kv8_s16384_d128_causal", 8, 32, 8, 16384, 128, True)]


def _parse(spec: str):
    name, *nums = spec.split(":")
    b, hq, hkv, s, d, causal = (int(x) for x in nums)
    return name, b, hq, hkv, s, d, bool(causal)


def _fresh_plans():
    """Empty launch-plan caches (module globals the library reads at call time)."""
    from mxattn import attention, op_plans
    from mxattn.backends import triton_backend
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.plan_cache import PlanCache
    triton_backend._PLANS = PlanCache()
    triton_backend._AFFINE_PLANS = AffinePlanCache()
    op_plans.PLANS = PlanCache(max_entries=512, min_replays=16)
    op_plans.CALLS = PlanCache(max_entries=512, min_replays=16)
    op_plans.CALLS_AFFINE = AffinePlanCache()
    attention._PLANS.clear()


@contextlib.contextmanager
def path(name: str):
    """Run the triton backend on data path `name` (module settings restored after)."""
    from mxattn.backends import triton_backend
    from mxattn.kernels import triton_attention_fwd as tf
    saved = (triton_backend.GLUON_FORWARD, tf.fwd_streams_bf16)
    triton_backend.GLUON_FORWARD = name == "gluon"
    triton_backend._GLUON.clear()
    if name != "bf16_scratch":
        tf.fwd_streams_bf16 = lambda *a: False
    _fresh_plans()
    try:
        yield
    finally:
        triton_backend.GLUON_FORWARD, tf.fwd_streams_bf16 = saved
        triton_backend._GLUON.clear()
        _fresh_plans()


def bench_config(name, B, HQ, HKV, S, D, causal, rounds: int, reps: int):
    import mxattn
    from mxattn.bench import time_cuda
    from mxattn.kernels.triton_attention_fwd import fwd_streams_bf16
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, S, HKV, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    mask = "causal" if causal else "no_mask"
    paths = ["gluon", "triton_fp8"] + (["bf16_scratch"] if fwd_streams_bf16(B, HKV, S, D) else [])

    def fwd():
        with torch.no_grad():
            return mxattn.mxfp8_attention(q, k, v, attn_mask_type=mask, backend="triton")

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        mxattn.mxfp8_attention(*leaves, attn_mask_type=mask, backend="triton").backward(do)

    def sdpa(grad: bool):
        for t in leaves:
            t.grad = None
        qt, kt, vt = (t.transpose(1, 2) for t in (leaves if grad else (q, k, v)))
        o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=HQ != HKV)
        if grad:
            o.backward(do.transpose(1, 2))

    res = {"config": name, "paths": paths, "fwd_ms": {p: [] for p in paths + ["sdpa"]},
           "fwd_bwd_ms": {p: [] for p in paths + ["sdpa"]}, "peak_fwd_mib": {}, "max_ulps_vs_triton_fp8": {}}
    outs = {}
    for p in paths:  # agreement, warm-up (compiles) and peak memory of the forward with grad
        with path(p):
            outs[p] = fwd()
            fwd_bwd()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            o = mxattn.mxfp8_attention(*leaves, attn_mask_type=mask, backend="triton")
            torch.cuda.synchronize()
            res["peak_fwd_mib"][p] = (torch.cuda.max_memory_allocated() - base) / 2**20
            del o
    for p in paths:
        a = outs[p].contiguous().view(torch.int16).to(torch.int32)
        b = outs["triton_fp8"].contiguous().view(torch.int16).to(torch.int32)
        a, b = (torch.where(x < 0, -(x & 0x7FFF), x) for x in (a, b))
        res["max_ulps_vs_triton_fp8"][p] = int((a - b).abs().max().item())
    with torch.no_grad():
        sdpa(False)
    sdpa(True)
    for _ in range(rounds):
        for p in paths:
            with path(p):
                fwd()  # the plan caches' first calls, untimed
                res["fwd_ms"][p].append(time_cuda(fwd, 0, reps))
                res["fwd_bwd_ms"][p].append(time_cuda(fwd_bwd, 0, reps))
        with torch.no_grad():
            res["fwd_ms"]["sdpa"].append(time_cuda(lambda: sdpa(False), 0, reps))
        res["fwd_bwd_ms"]["sdpa"].append(time_cuda(lambda: sdpa(True), 0, reps))
    for kind in ("fwd_ms", "fwd_bwd_ms"):
        res[kind] = {p: statistics.median(v) for p, v in res[kind].items()}
    return res


def main():
    from mxattn.bench import DEFAULT_CONFIGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", type=_parse, help="name:B:Hq:Hkv:S:D:causal(0/1); repeatable")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median of their medians)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per path and round")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    import triton
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    results = []
    for cfg in args.config or (list(DEFAULT_CONFIGS) + LARGE_CONFIGS):
        r = bench_config(*cfg, rounds=args.rounds, reps=args.reps)
        results.append(r)
        print(f"\n{r['config']}: max ulps of O vs triton_fp8 {r['max_ulps_vs_triton_fp8']}")
        for p in r["paths"] + ["sdpa"]:
            f, fb = r["fwd_ms"][p], r["fwd_bwd_ms"][p]
            sf, sfb = r["fwd_ms"]["sdpa"] / f, r["fwd_bwd_ms"]["sdpa"] / fb
            peak = r["peak_fwd_mib"].get(p)
            print(f"  {p:13s} fwd {f:8.3f} ms ({sf:4.2f}x sdpa)  fwd+bwd {fb:8.3f} ms ({sfb:4.2f}x sdpa)"
                  + (f"  fwd peak +{peak:8.1f} MiB" if peak is not None else ""))
        print(f"  gluon vs triton_fp8: fwd {r['fwd_ms']['triton_fp8'] / r['fwd_ms']['gluon']:.2f}x, fwd+bwd "
              f"{r['fwd_bwd_ms']['triton_fp8'] / r['fwd_bwd_ms']['gluon']:.2f}x (>1: gluon faster)"
              + (f"; vs bf16_scratch: fwd {r['fwd_ms']['bf16_scratch'] / r['fwd_ms']['gluon']:.2f}x, fwd+bwd "
                 f"{r['fwd_bwd_ms']['bf16_scratch'] / r['fwd_bwd_ms']['gluon']:.2f}x"
                 if "bf16_scratch" in r["paths"] else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
