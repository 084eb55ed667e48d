"""A/B of an environment switch on the whole-model benchmark: `benchmarks/models_bench.py` run in alternating
processes (order A B B A A B ...), arm A in the inherited environment, arm B with --env NAME=VALUE set (e.g.
MXATTN_GLUON_BWD=0), everything else equal.

Each run's ratios (mxfp8 / SDPA training step time, mxfp8 / SDPA decode tokens/s) are measured inside that run
against its own SDPA baseline, so a machine whose speed drifts between processes moves both sides of a ratio; this
script compares the two arms' per-run ratios: their medians, and B's median over A's.

Usage: python benchmarks/models_ab.py --env MXATTN_GLUON_BWD=0 [--runs 4] [--out-dir DIR] -- [models_bench options,
e.g. --train-only --models llama]. Writes ab.json (every run's ratios and its whole models.json) and ab.md to
--out-dir (default benchmarks/results/<gpu>/ab/, or ./ab-results on a machine without CUDA); each run writes into a
temporary folder, so a rerun replaces the two files and leaves nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


def arm_order(runs: int) -> List[str]:
    """ABBA-balanced order of `runs` runs per arm: A B B A A B B A ... (each arm first as often as the other)."""
    order = []
    for i in range(runs):
        order += ["A", "B"] if i % 2 == 0 else ["B", "A"]
    return order


def arm_environment(arm: str, name: str, value: str, base: Dict[str, str]) -> Dict[str, str]:
    """The environment of one run: `base` with the repository first on PYTHONPATH, and NAME=VALUE in arm B."""
    env = dict(base, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + ([base["PYTHONPATH"]]
                                                                          if base.get("PYTHONPATH") else [])))
    if arm == "B":
        env[name] = value
    return env


def row_ratios(result: dict) -> Dict[str, float]:
    """{row label: ratio} of one models_bench result (its models.json): training rows 'train <model> <mode>',
    generation rows 'generate <model> b<batch> <attention>' (every non-SDPA attention's tokens/s ratio)."""
    out = {}
    for r in result.get("train", []):
        out[f"train {r['model']} {r['mode']}"] = r["ratio"]
    for r in result.get("generate", []):
        for attn, ratio in r.get("ratio", {}).items():
            if attn != "sdpa":
                out[f"generate {r['model']} b{r['batch']} {attn}"] = ratio
    return out


def summarize(per_run: List[dict]) -> List[dict]:
    """Rows of {label, a, b (per-run ratios), a_median, b_median, b_over_a} from [{arm, ratios}], labels in
    first-seen order; a row one arm lacks gets None medians."""
    labels = []
    for run in per_run:
        labels += [k for k in run["ratios"] if k not in labels]
    rows = []
    for label in labels:
        a = [r["ratios"][label] for r in per_run if r["arm"] == "A" and label in r["ratios"]]
        b = [r["ratios"][label] for r in per_run if r["arm"] == "B" and label in r["ratios"]]
        am, bm = (statistics.median(x) if x else None for x in (a, b))
        rows.append(dict(label=label, a=a, b=b, a_median=am, b_median=bm,
                         b_over_a=(bm / am) if am and bm is not None else None))
    return rows


def markdown(env: str, rows: List[dict], bench_args: List[str]) -> str:
    fmt = (lambda x: "-" if x is None else f"{x:.3f}")
    lines = [f"# models_bench A/B: A = inherited environment, B = {env}", "",
             f"models_bench options: `{' '.join(bench_args) or '(defaults)'}`; runs alternate A B B A ...; each "
             "ratio is mxfp8 / SDPA from inside one run (training: time, lower is better; generate: tokens/s, "
             "higher is better).", "",
             "| row | A ratios | B ratios | A median | B median | B / A |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {', '.join(f'{x:.2f}' for x in r['a'])} | "
                     f"{', '.join(f'{x:.2f}' for x in r['b'])} | {fmt(r['a_median'])} | {fmt(r['b_median'])} | "
                     f"{fmt(r['b_over_a'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="NAME=VALUE set in arm B's environment")
    ap.add_argument("--runs", type=int, default=4, help="runs per arm (default 4)")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per models_bench run (default none)")
    a = ap.parse_args(own)
    name, sep, value = a.env.partition("=")
    if not sep or not name:
        ap.error(f"--env must be NAME=VALUE, got {a.env!r}")
    if a.runs < 1:
        ap.error(f"--runs must be at least 1, got {a.runs}")
    if "--out-dir" in bench_args:
        ap.error("pass --out-dir before '--' (each run writes under it)")
    out_dir = a.out_dir
    if out_dir is None:
        import torch
        if torch.cuda.is_available():
            from mxattn.bench import gpu_dir_name
            out_dir = os.path.join(HERE, "results", gpu_dir_name(torch.device("cuda")), "ab")
        else:
            out_dir = "ab-results"
    os.makedirs(out_dir, exist_ok=True)
    per_run = []
    for i, arm in enumerate(arm_order(a.runs)):
        env = arm_environment(arm, name, value, dict(os.environ))
        with tempfile.TemporaryDirectory(prefix=f"models_ab_{i}_{arm}_") as run_dir:
            cmd = [sys.executable, os.path.join(HERE, "models_bench.py"), *bench_args, "--out-dir", run_dir]
            print(f"run {i} arm {arm}: {' '.join(cmd)}", flush=True)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
                raise SystemExit(f"models_bench run {i} (arm {arm}) failed with exit status {done.returncode}")
            with open(os.path.join(run_dir, "models.json")) as f:
                models = json.load(f)
        ratios = row_ratios(models)
        per_run.append(dict(run=i, arm=arm, ratios=ratios, models=models))
        print(f"  {ratios}", flush=True)
    rows = summarize(per_run)
    with open(os.path.join(out_dir, "ab.json"), "w") as f:
        json.dump(dict(env=a.env, bench_args=bench_args, runs=per_run, rows=rows), f, indent=1)
    text = markdown(a.env, rows, bench_args)
    with open(os.path.join(out_dir, "ab.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
