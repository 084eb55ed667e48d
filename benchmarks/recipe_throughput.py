"""Speed of each recipe on the triton backend against the default recipe and torch SDPA (bf16, cuDNN), measured in
the same run: forward and forward+backward of the public API (`mxfp8_attention`, quantization included), bshd
bf16; each figure the median over --rounds interleaved rounds (every recipe once per round, in a rotated order) of
a median of CUDA-event timings; ratios are time / the default recipe's time. --profile adds, per recipe, the
GPU time of each kernel in one forward+backward (torch.profiler).

Usage: python benchmarks/recipe_throughput.py [--batch 2 --heads 16 --seq 4096 --head-dim 128] [--out DIR]
Writes DIR/recipe_throughput.json and .md (DIR default benchmarks/results/<gpu>/)."""
import statistics
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import mxattn  # noqa: E402
from mxattn.bench import gpu_dir_name, time_cuda  # noqa: E402
from mxattn.recipe import all_variants  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.cuda.get_device_name()
    out_dir = a.out or os.path.join(ROOT, "benchmarks", "results", gpu_dir_name(dev))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(a.batch, a.seq, a.heads, a.head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    recipes = [r for r in all_variants() if r.scaling == "mxfp8"]
    recipes.append(mxattn.Recipe(p_quant="none", v_operand="bf16", ds_quant="bf16"))

    def mx(recipe):
        return lambda *t: mxattn.mxfp8_attention(*t, attn_mask_type="causal", backend="triton", recipe=recipe)

    def sdpa(*t):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in t), is_causal=True).transpose(1, 2)

    runs = [("sdpa_bf16", sdpa)] + [(r.differences(), mx(r)) for r in recipes]
    fwd, fb = {n: [] for n, _ in runs}, {n: [] for n, _ in runs}
    for rnd in range(a.rounds):
        for name, fn in runs[rnd % len(runs):] + runs[:rnd % len(runs)]:
            with torch.no_grad():
                fwd[name].append(time_cuda(lambda: fn(q, k, v), 2, a.iters))
            fb[name].append(time_cuda(lambda: torch.autograd.grad(fn(*leaves), leaves, do), 2, a.iters))
    rows = []
    for name, _ in runs:
        rows.append(dict(recipe=name, fwd_ms=statistics.median(fwd[name]), fwd_bwd_ms=statistics.median(fb[name]),
                         fwd_rounds=fwd[name], fwd_bwd_rounds=fb[name]))
        print(f"{name:60s} fwd {rows[-1]['fwd_ms']:7.3f} ms  fwd+bwd {rows[-1]['fwd_bwd_ms']:7.3f} ms", flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        for name, fn in runs:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.autograd.grad(fn(*leaves), leaves, do)
                torch.cuda.synchronize()
            print(f"--- {name}: GPU time per kernel, us")
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
                print(f"  {e.device_time_total:9.1f}  x{e.count}  {e.key[:90]}")
    base = next(r for r in rows if r["recipe"] == "default")
    for r in rows:
        r["fwd_vs_default"] = r["fwd_ms"] / base["fwd_ms"]
        r["fwd_bwd_vs_default"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    res = dict(device=dev, torch=torch.__version__, shape=dict(batch=a.batch, heads=a.heads, seq=a.seq,
                                                                head_dim=a.head_dim, causal=True), rows=rows)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "recipe_throughput.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = [f"# Recipe throughput on the triton backend ({dev})", "",
          f"torch {torch.__version__}; `python benchmarks/recipe_throughput.py`: B{a.batch} H{a.heads} S{a.seq} "
          f"D{a.head_dim} causal, bshd bf16, public API (quantization included), median over {a.rounds} interleaved "
          f"rounds of the median of {a.iters} CUDA-event timings; ratios against the default recipe in the same "
          "run.", "",
          "| recipe | fwd ms | fwd+bwd ms | fwd / default | fwd+bwd / default |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['recipe']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_vs_default']:.2f} | "
                  f"{r['fwd_bwd_vs_default']:.2f} |")
    with open(os.path.join(out_dir, "recipe_throughput.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
