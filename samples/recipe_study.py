"""Study the MXFP8 attention recipe variants (`mxattn.Recipe`): error against FP64, dependence on future
tokens, and training loss over seeds. Writes a markdown table file and a JSON file.

    python samples/recipe_study.py --threads 1              # --size cpu: ~10 minutes on one CPU core
    python samples/recipe_study.py --skip-training          # parts 1 and 2 only (~15 s on one idle core)
    python samples/recipe_study.py --size gpu --device cuda # bigger shapes and model, on a GPU

Recipes: every entry of `mxattn.recipe.all_variants()` (the default cuDNN recipe and each single-field variant,
`scaling=per_tensor`, FP8 with one FP32 scale per tensor, among them), each run on the `reference` backend
(--backend: triton runs every MXFP8 recipe on a GPU, cudnn only the default), and BF16 attention (torch SDPA) as the baseline.

1. Error: relative RMS error (||x - x64|| / ||x64||) of O, dQ, dK and dV against FP64 attention (torch SDPA in
   float64 through autograd on the same bf16-rounded inputs and the same bf16 dO), causal and not, for inputs
   drawn from: "gaussian" (randn), "heavy_tailed" (Student-t, 3 degrees of freedom, scaled to unit variance),
   "outlier_channels" (randn with a few head-dim channels of K and V scaled by x20-x50; Q stays Gaussian, so
   the softmax is sharper: the table lists each case's logit spread) and "long" (randn at a longer sequence).
   dO is randn in every case. One input per seed (--seeds); each table cell is the mean over the seeds with the
   min-max range.
2. Future-token sensitivity (causal): for query rows 0..i, the keys and values at positions after i are
   redrawn -- in i's own 32-token block, or only in later blocks -- once as plain Gaussian values and once with
   one value row set to a large magnitude (--future-magnitudes); the largest change of rows 0..i's outputs is
   recorded (0 means bit for bit unchanged, as causality promises).
3. Training: samples/train_gpt.py's byte-level GPT (its `train_single`: same initial weights and batches per
   seed for every attention) with BF16 attention and with each recipe, for each seed; final training loss (mean
   of the last 10 steps) and validation loss, their mean and spread, and the differences from BF16 and from
   the default recipe paired by seed (same weights, same batches), and the training speed (tokens per second
   of the optimizer steps). --skip-training leaves this part out (--skip-errors part 1, --skip-future part 2).

Output: recipe_study.md and recipe_study.json in --out-dir (default benchmarks/results/<device>/recipe_study/,
<device> "cpu" or the lowercased GPU name with dashes), and PNG plots when matplotlib is installed.
Progress lines ("[k/N] ...") go to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import mxattn
except ImportError:  # running from a source checkout without `pip install -e .`: use the repo's copy
    sys.path.insert(0, ROOT)
    import mxattn
from mxattn import Recipe, quantize_mxfp8  # noqa: E402
from mxattn.recipe import all_variants  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recipe_study_plots import save_plots  # noqa: E402  (samples/recipe_study_plots.py: the PNG plots)

TRAIN_GPT = os.path.join(ROOT, "samples", "train_gpt.py")
BF16 = "bf16 (torch SDPA)"   # the baseline's row label
QK_ONLY = "Q,K MXFP8 only (rest FP64)"  # part 1's diagnostic row: the error every recipe shares
METRICS = ("O", "dQ", "dK", "dV")
DISTRIBUTIONS = ("gaussian", "heavy_tailed", "outlier_channels", "long")
MASKS = ("causal", "no_mask")
BLOCK = 32  # MXFP8 block size along the quantized axis

#: shapes and training configuration per --size. "long" is the long-sequence case's (batch, heads, seq);
#: "future": (heads, seq, head_dim, query rows i whose future is perturbed); "train": train_gpt.py options.
SIZES = {
    "tiny": dict(batch=1, heads=1, seq=64, head_dim=32, long=(1, 1, 128), future=(1, 96, 32, (9, 40)),
                 train=dict(layers=1, dim=32, heads=1, seq=32, batch=4, data_bytes=100_000), steps=4),
    "cpu": dict(batch=1, heads=2, seq=256, head_dim=64, long=(1, 2, 1024), future=(2, 128, 64, (9, 41, 70)),
                train=dict(layers=2, dim=128, heads=4, seq=64, batch=16, data_bytes=2_000_000), steps=200),
    "gpu": dict(batch=2, heads=8, seq=2048, head_dim=128, long=(1, 8, 8192),
                future=(8, 1024, 128, (9, 41, 300, 700)),
                train=dict(layers=6, dim=384, heads=6, seq=256, batch=64, data_bytes=4_000_000), steps=2000),
}


# ------------------------------------------------------------------------------------------ recipes


def recipe_label(recipe: Recipe) -> str:
    """"default", or the fields that differ from it as train_gpt.py's --recipe text ("p_quant=none")."""
    if recipe.is_default:
        return "default"
    return ",".join(part.replace("'", "") for part in recipe.differences().split(", "))


def study_recipes(only: Optional[Sequence[str]] = None) -> List[Tuple[str, Recipe]]:
    """(label, recipe) for every entry of `all_variants()`, the default first; only: the labels to keep besides
    the default (which always runs: the paired differences are taken against it)."""
    out = [(recipe_label(r), r) for r in all_variants()]
    return out if only is None else [(label, r) for label, r in out if label == "default" or label in only]


def parse_labels(text: Optional[str], known: Sequence[str], option: str, what: str, error) -> Optional[List[str]]:
    """`option`'s "label,label" -> the labels, in `known`'s order (None for text None); error(message) naming the
    known labels for an unknown one or an empty list ("unknown <what> label(s)")."""
    if text is None:
        return None
    labels = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in labels if x not in known]
    if unknown or not labels:
        error(f"{option}: unknown {what} label(s) {unknown or [text]}; known: {', '.join(known)}")
    return [label for label in known if label in labels]


def parse_recipe_labels(text: Optional[str], error) -> Optional[List[str]]:
    """--recipes "label,label" -> the labels (None for every recipe); error(message) for an unknown label."""
    return parse_labels(text, [label for label, _ in study_recipes()], "--recipes", "recipe", error)


# ------------------------------------------------------------------------------------------ inputs


def _student_t(shape, dof: int, generator: torch.Generator) -> torch.Tensor:
    """Student-t samples with `dof` degrees of freedom scaled to unit variance (dof >= 3), float32."""
    z = torch.randn(shape, generator=generator)
    chi2 = (torch.randn((dof,) + tuple(shape), generator=generator) ** 2).sum(0)
    return z / torch.sqrt(chi2 / dof) / math.sqrt(dof / (dof - 2))


def make_inputs(distribution: str, batch: int, heads: int, seq: int, head_dim: int, seed: int,
                device: torch.device) -> Tuple[torch.Tensor, ...]:
    """q, k, v, do [batch, heads, seq, head_dim] in bf16 (bhsd) for `distribution` (module docstring), drawn on
    the CPU from `seed` (the same numbers on every device)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    if distribution in ("gaussian", "long"):
        q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    elif distribution == "heavy_tailed":
        q, k, v = (_student_t(shape, 3, g) for _ in range(3))
    elif distribution == "outlier_channels":
        q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
        n = max(1, head_dim // 16)  # 4 of 64 channels, 8 of 128
        for t in (k, v):
            channels = torch.randperm(head_dim, generator=g)[:n]
            t[..., channels] *= 20.0 + 30.0 * torch.rand(n, generator=g)   # x20 .. x50
    else:
        raise ValueError(f"unknown distribution {distribution!r} (one of {DISTRIBUTIONS})")
    do = torch.randn(shape, generator=g)
    return tuple(t.to(torch.bfloat16).to(device) for t in (q, k, v, do))


def _grads(out, leaves, do):
    return torch.autograd.grad(out, leaves, do)


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def logit_std(q: torch.Tensor, k: torch.Tensor, rows: int = 256) -> float:
    """Standard deviation of the softmax logits q k^T / sqrt(d) (the first `rows` queries), a sharpness hint."""
    qd, kd = q[..., :rows, :].double(), k.double()
    return (qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])).std().item()


def _fp64_attention(q, k, v, do, causal: bool) -> List[torch.Tensor]:
    """[O, dQ, dK, dV] of torch SDPA in float64 through autograd (gradients of <O, do>)."""
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    o64 = F.scaled_dot_product_attention(*leaves64, is_causal=causal)
    return [o64.detach()] + list(_grads(o64, leaves64, do.double()))


def attention_errors(q, k, v, do, causal: bool, recipes: Sequence[Tuple[str, Recipe]],
                     backend: str = "reference") -> Dict[str, List[float]]:
    """rel-RMS errors [O, dQ, dK, dV] against FP64 attention (autograd on the same bf16 values) for each recipe
    on `backend`, for BF16 attention (torch SDPA on the bf16 inputs, key BF16), and for FP64 attention on Q and
    K rounded to MXFP8 along the head dim (as every recipe's Q K^T takes them; key QK_ONLY)."""
    exact = _fp64_attention(q, k, v, do, causal)
    errors = {}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ob = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    errors[BF16] = [rel_rms(a, b) for a, b in zip([ob.detach()] + list(_grads(ob, leaves, do)), exact)]
    qk = [quantize_mxfp8(t, axis=-1).dequantize() for t in (q, k)]
    errors[QK_ONLY] = [rel_rms(a, b) for a, b in zip(_fp64_attention(*qk, v, do, causal), exact)]
    mask = "causal" if causal else "no_mask"
    for label, recipe in recipes:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = mxattn.mxfp8_attention(*leaves, qkv_format="bhsd", attn_mask_type=mask, backend=backend,
                                   recipe=recipe)
        errors[label] = [rel_rms(a, b) for a, b in zip([o.detach()] + list(_grads(o, leaves, do)), exact)]
    return errors


# ------------------------------------------------------------------------------------------ summaries


def spread(values: Sequence[float]) -> dict:
    """mean, std (sample, 0 for one value), min, max and the values."""
    values = list(values)
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


class Progress:
    """'[k/N] message (elapsed)' lines on stderr."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def step(self, message: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {message} ({time.perf_counter() - self.start:.0f} s elapsed)",
              file=self.stream, flush=True)


# ------------------------------------------------------------------------------------------ part 1


def error_cases(size: dict) -> List[dict]:
    """The (distribution, mask, shape) cases of part 1."""
    cases = []
    for dist in DISTRIBUTIONS:
        b, h, s = size["long"] if dist == "long" else (size["batch"], size["heads"], size["seq"])
        for mask in MASKS:
            cases.append(dict(distribution=dist, mask=mask, batch=b, heads=h, seq=s, head_dim=size["head_dim"]))
    return cases


def run_errors(size: dict, seeds: Sequence[int], recipes, device: torch.device, backend: str,
               progress: Progress) -> List[dict]:
    """Part 1: per case, per recipe (and BF16): each metric's spread over the seeds and the logit spread."""
    results = []
    for case in error_cases(size):
        per_seed: Dict[str, List[List[float]]] = {}
        logits = []
        for seed in seeds:
            q, k, v, do = make_inputs(case["distribution"], case["batch"], case["heads"], case["seq"],
                                      case["head_dim"], seed, device)
            logits.append(logit_std(q, k))
            errs = attention_errors(q, k, v, do, case["mask"] == "causal", recipes, backend)
            for label, values in errs.items():
                per_seed.setdefault(label, []).append(values)
            progress.step(f"error {case['distribution']} {case['mask']} B{case['batch']} H{case['heads']} "
                          f"S{case['seq']} D{case['head_dim']} seed {seed}: O default "
                          f"{100 * errs['default'][0]:.2f}%")
        rows = {label: {m: spread([vals[i] for vals in per_seed[label]]) for i, m in enumerate(METRICS)}
                for label in per_seed}
        results.append(dict(case, logit_std=spread(logits), errors=rows))
    return results


# ------------------------------------------------------------------------------------------ part 2


def future_change(recipe: Recipe, q, k, v, i: int, region: str, magnitude: float, seed: int,
                  backend: str = "reference") -> Tuple[float, float]:
    """Largest |change| (and rel-RMS change) of causal output rows 0..i when the keys and values at positions
    in `region` after i are redrawn (randn from `seed`): "same_block" (i+1 .. the end of i's 32-token block) or
    "later_blocks" (from the next block on). magnitude > 0 also sets one value row in the region to it."""
    s = q.shape[-2]
    block_end = (i // BLOCK + 1) * BLOCK
    lo, hi = (i + 1, block_end) if region == "same_block" else (block_end, s)
    if not lo < hi <= s:
        raise ValueError(f"no {region} positions after row {i} in a sequence of {s}")
    g = torch.Generator().manual_seed(seed)
    k2, v2 = k.clone(), v.clone()
    shape = k[..., lo:hi, :].shape
    k2[..., lo:hi, :] = torch.randn(shape, generator=g).to(k.dtype).to(k.device)
    v2[..., lo:hi, :] = torch.randn(shape, generator=g).to(v.dtype).to(v.device)
    if magnitude > 0:
        v2[..., (lo + hi) // 2, :] = magnitude

    def rows(kk, vv):
        with torch.no_grad():
            out = mxattn.mxfp8_attention(q, kk, vv, qkv_format="bhsd", attn_mask_type="causal", backend=backend,
                                         recipe=recipe)
        return out[..., :i + 1, :].double()

    before, after = rows(k, v), rows(k2, v2)
    return (after - before).abs().max().item(), ((after - before).norm() / before.norm()).item()


def run_future(size: dict, seeds: Sequence[int], recipes, magnitudes: Sequence[float], device: torch.device,
               backend: str, progress: Progress) -> dict:
    """Part 2: per recipe and perturbation (region x magnitude), the largest change over the rows i and seeds."""
    heads, seq, head_dim, cuts = size["future"]
    columns = [(region, m) for region in ("same_block", "later_blocks") for m in [0.0] + list(magnitudes)]
    name = lambda region, m: f"{region}, {'redraw' if m == 0 else f'v={m:g}'}"  # noqa: E731
    out = {label: {name(region, m): {"max_abs": 0.0, "max_rel": 0.0} for region, m in columns}
           for label, _ in recipes}
    for seed in seeds:
        q, k, v, _ = make_inputs("gaussian", 1, heads, seq, head_dim, seed, device)
        for label, recipe in recipes:
            for region, m in columns:
                cell = out[label][name(region, m)]
                for i in cuts:
                    a, r = future_change(recipe, q, k, v, i, region, m, seed + 1000 * (i + 1), backend)
                    cell["max_abs"], cell["max_rel"] = max(cell["max_abs"], a), max(cell["max_rel"], r)
        progress.step(f"future tokens seed {seed}: default same-block, largest v: "
                      f"{out['default'][name('same_block', max(magnitudes, default=0.0))]['max_abs']:.2e}")
    return dict(heads=heads, seq=seq, head_dim=head_dim, rows=list(cuts), magnitudes=list(magnitudes),
                changes=out)


# ------------------------------------------------------------------------------------------ part 3


def load_train_gpt():
    """samples/train_gpt.py as a module."""
    spec = importlib.util.spec_from_file_location("train_gpt_for_study", TRAIN_GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_argv(config: dict, steps: int, seed: int, device: torch.device, backend: str) -> List[str]:
    """train_gpt.py's command-line arguments for one run."""
    argv = ["--steps", str(steps), "--seed", str(seed), "--device", str(device), "--backend", backend]
    for name, value in config.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def tokens_per_second(batch: int, seq: int, steps: int, seconds: float) -> float:
    """Training throughput: the batch * seq * steps tokens of a run over its `seconds` of training."""
    return batch * seq * steps / seconds if seconds > 0 else float("inf")


def run_seeds(runs: Dict[str, Dict[str, dict]]) -> List[int]:
    """The seeds of `runs` ({label: {seed (str): run}}), sorted; ValueError unless every label ran the same."""
    by_label = {label: sorted(int(s) for s in by_seed) for label, by_seed in runs.items()}
    first, seeds = next(iter(by_label.items()))
    for label, others in by_label.items():
        if others != seeds:
            raise ValueError(f"{label!r} ran seeds {others} but {first!r} ran seeds {seeds}")
    return seeds


def summarize_runs(runs: Dict[str, Dict[str, dict]], baseline: str, baseline_key: str) -> dict:
    """Per label of `runs` ({label: {seed (str): run}}, as in the JSON, with a "default" label): the spread over
    the seeds of the final and validation losses, of their differences paired by seed from `baseline`'s runs
    ("final_minus_<baseline_key>", ...) and from the default recipe's ("final_minus_default", ...), of the
    seconds and of the tokens per second."""
    seeds = [str(s) for s in run_seeds(runs)]
    others = ((baseline, baseline_key), ("default", "default"))

    summary = {}
    for label, by_seed in runs.items():
        row = {}
        for key in ("final", "val"):
            row[key] = spread([by_seed[s][key] for s in seeds])
            for other, name in others:
                row[f"{key}_minus_{name}"] = spread([by_seed[s][key] - runs[other][s][key] for s in seeds])
        for key in ("seconds", "tokens_per_s"):
            row[key] = spread([by_seed[s][key] for s in seeds])
        summary[label] = row
    return summary


def training_result(config: dict, runs: Dict[str, Dict[str, dict]]) -> dict:
    """Part 3's result from the training configuration and the runs ({label: {seed (str): run}}): the seeds,
    the runs and their summary (`summarize_runs` against BF16 attention)."""
    return dict(config=config, seeds=run_seeds(runs), runs=runs, summary=summarize_runs(runs, BF16, "bf16"))


def run_training(size: dict, steps: int, seeds: Sequence[int], recipes, device: torch.device, backend: str,
                 progress: Progress, on_run=None) -> dict:
    """Part 3: final and validation losses, seconds and tokens per second per attention and seed, and their
    summary (`training_result`). on_run: called after every run with the runs so far ({label: {seed: result}})."""
    tg = load_train_gpt()
    args = tg.parse_args(train_argv(size["train"], steps, seeds[0], device, backend))
    data = tg.load_splits(args)
    runs: Dict[str, Dict[int, dict]] = {}
    labels = [BF16] + [label for label, _ in recipes]
    for seed in seeds:
        argv = train_argv(size["train"], steps, seed, device, backend)
        for label in labels:
            recipe = dict(recipes).get(label)
            res = tg.train_single(argv, "bf16" if label == BF16 else "mxfp8", recipe, data=data)
            runs.setdefault(label, {})[seed] = {
                "final": res["final"], "val": res["val"], "seconds": res["seconds"], "first": res["loss"][0],
                "tokens_per_s": tokens_per_second(args.batch, args.seq, steps, res["seconds"])}
            progress.step(f"train {label} seed {seed}: final {res['final']:.4f}, val {res['val']:.4f}, "
                          f"{res['seconds']:.0f} s")
            if on_run is not None:
                on_run(runs)
    config = {k: v for k, v in vars(args).items() if k not in ("seed", "out", "recipe", "log_every")}
    return training_result(config, {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()})


# ------------------------------------------------------------------------------------------ output


def device_name(device: torch.device) -> str:
    """"cpu", or the GPU's name lowercased with spaces as dashes (benchmarks/results/<name>/)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return device.type


def default_out_dir(device: str) -> str:
    """benchmarks/results/<device name>/recipe_study/ of this repository."""
    return os.path.join(ROOT, "benchmarks", "results", device, "recipe_study")


def command_line(argv: Sequence[str], script: str = __file__) -> str:
    """The command line of `script` (default: this one) with `argv`, as the result records it."""
    return shlex.join(["python", os.path.relpath(os.path.abspath(script), ROOT)] + list(argv))


def _git_commit() -> Optional[str]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _pct(s: dict) -> str:
    return f"{100 * s['mean']:.2f} [{100 * s['min']:.2f}, {100 * s['max']:.2f}]"


def _signed(s: dict, digits: int = 4) -> str:
    """mean [min, max] with signs."""
    return f"{s['mean']:+.{digits}f} [{s['min']:+.{digits}f}, {s['max']:+.{digits}f}]"


def _span(s: dict, digits: int = 4) -> str:
    return f"{s['mean']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def _change(cell: dict) -> str:
    return "0 (bitwise)" if cell["max_abs"] == 0.0 else f"{cell['max_abs']:.2e}"


def render_markdown(result: dict) -> str:
    """The study as markdown tables (the JSON holds every number)."""
    lines = [f"# MXFP8 attention recipe study ({result['device']}, --size {result['size']})", "",
             f"Command: `{result['command']}`", "",
             f"- device: {result['device']} ({result['threads']} torch threads); torch {result['torch']}; "
             f"mxattn backend `{result['backend']}`; "
             f"commit {result['commit']}; {result['date']}",
             f"- seeds: {', '.join(map(str, result['seeds']))}; runtime: "
             + ", ".join(f"{k} {v:.1f} s" for k, v in result["seconds"].items()),
             f"- plots: {result['plots']}", "",
             ("Recipes (all run on the reference backend; " if result["backend"] == "reference" else
              f"Recipes (each on the backend `{result['backend']}` picks for it: triton on a CUDA GPU for every MXFP8 "
              "recipe, reference for per-tensor scaling; ")
             + "`default` is the cuDNN recipe, the others change one field of it; `bf16 (torch SDPA)` is BF16 "
             "attention, the baseline):", ""]
    lines += [f"- `{label}`: {fields}" for label, fields in result["recipes"].items()]
    if "errors" in result:
        lines += ["", "## 1. Error against FP64 attention", "",
                  "Relative RMS error ||x - x_fp64|| / ||x_fp64|| in percent, mean over the seeds [min, max]; "
                  "FP64 attention = torch SDPA in float64 through autograd on the same bf16 inputs and dO. "
                  "Inputs: gaussian = randn; heavy_tailed = Student-t (3 dof) at unit variance; "
                  "outlier_channels = randn with a few head-dim channels of K and V scaled x20-x50 (Q plain); "
                  "long = randn at the long sequence length; dO = randn throughout. "
                  f"`{QK_ONLY}`: FP64 attention on Q and K rounded to MXFP8 along the head dim (as every recipe's "
                  "Q K^T takes them), nothing else rounded: the part of the error no recipe field changes. "
                  "logit std: the spread of q k^T / sqrt(d), mean over the seeds (a sharper softmax amplifies "
                  "the logits' rounding).", ""]
        cases = result["errors"]
        lines += ["| case | shape | logit std |", "|---|---|---|"]
        lines += [f"| {c['distribution']} {c['mask']} | B{c['batch']} H{c['heads']} S{c['seq']} D{c['head_dim']} "
                  f"| {c['logit_std']['mean']:.2f} |" for c in cases]
        labels = list(cases[0]["errors"])
        for metric in METRICS:
            lines += ["", f"### {metric}", "",
                      "| recipe | " + " | ".join(f"{c['distribution']} {c['mask']}" for c in cases) + " |",
                      "|---|" + "---|" * len(cases)]
            for label in labels:
                lines.append(f"| {label} | " + " | ".join(_pct(c["errors"][label][metric]) for c in cases) + " |")
    if "future" in result:
        fut = result["future"]
        cols = list(next(iter(fut["changes"].values())))
        lines += ["", "## 2. Future-token sensitivity (causal)", "",
                  f"Largest |change| of the outputs of rows 0..i (i in {fut['rows']}; H{fut['heads']} S{fut['seq']} "
                  f"D{fut['head_dim']}, randn) when the keys and values after i are redrawn in i's own 32-token "
                  "block (same_block) or only in later blocks (later_blocks): as plain randn (redraw), or with one "
                  "redrawn value row set to M in every channel (v=M). Max over the rows i and the seeds; causal "
                  "attention should give 0.", "",
                  "| recipe | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for label, row in fut["changes"].items():
            lines.append(f"| {label} | " + " | ".join(_change(row[c]) for c in cols) + " |")
    if "training" in result:
        tr = result["training"]
        cfg = tr["config"]
        lines += ["", "## 3. Training (samples/train_gpt.py)", "",
                  f"Byte-level GPT, {cfg['layers']} layers, dim {cfg['dim']}, {cfg['heads']} heads, seq {cfg['seq']}, "
                  f"batch {cfg['batch']}, {cfg['steps']} steps, lr {cfg['lr']}, device {cfg['device']}, seeds "
                  f"{tr['seeds']}. Every attention starts from the same weights and sees the same batches for a "
                  f"given seed. final = mean training loss of the last {cfg['final_window']} steps; val = "
                  "validation loss. Entries: mean [min, max] over the seeds; the differences are paired by seed. "
                  "`straddles 0`: whether the per-seed differences from BF16 have both signs. A variant with no "
                  f"effect shows one sign on all {len(tr['seeds'])} seeds with probability "
                  f"{2 / 2 ** len(tr['seeds']):.2g} (chaotic training turns any rounding change into a different "
                  "trajectory), so `no` alone is weak evidence: compare the size of the differences with the "
                  "default's own difference from BF16. s / run: training seconds (the optimizer steps, batches "
                  "and validation left out); tokens/s: batch x seq x steps over them; both means over the seeds."]
        lines += ["", "| attention | final | final - bf16 | straddles 0 | final - default | val | val - bf16 | "
                  "s / run | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
        for label, row in tr["summary"].items():
            d = row["final_minus_bf16"]
            straddle = "-" if label == BF16 else "yes" if d["min"] <= 0 <= d["max"] else "no"
            lines.append(f"| {label} | {_span(row['final'])} (std {row['final']['std']:.4f}) | "
                         f"{_signed(d)} | {straddle} | {_signed(row['final_minus_default'])} | "
                         f"{_span(row['val'])} | {_signed(row['val_minus_bf16'])} | "
                         f"{row['seconds']['mean']:.0f} | {row['tokens_per_s']['mean']:.0f} |")
        lines += ["", "Per seed (final training loss):", "",
                  "| attention | " + " | ".join(f"seed {s}" for s in tr["seeds"]) + " |",
                  "|---|" + "---|" * len(tr["seeds"])]
        for label, by_seed in tr["runs"].items():
            lines.append(f"| {label} | " + " | ".join(f"{by_seed[str(s)]['final']:.4f}" for s in tr["seeds"]) + " |")
    return "\n".join(lines) + "\n"


def _dump(obj, path: str) -> None:
    """obj as JSON at path (written whole, then moved into place)."""
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def write_outputs(result: dict, out_dir: str) -> Dict[str, str]:
    """recipe_study.json, recipe_study.md and the plots in `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    result["plots"] = save_plots(result, out_dir)
    paths = {"json": os.path.join(out_dir, "recipe_study.json"), "md": os.path.join(out_dir, "recipe_study.md")}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    with open(paths["md"], "w") as f:
        f.write(render_markdown(result))
    return paths


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=tuple(SIZES), default="cpu",
                   help="shapes and training model: cpu (B1 H2 S256 D64, long S1024; 2-layer dim-128 GPT), "
                        "gpu (B2 H8 S2048 D128, long B1 H8 S8192; 6-layer dim-384 GPT; use --device cuda), "
                        "tiny (for tests)")
    p.add_argument("--device", default="cpu", help="torch device for every part (cpu, cuda, cuda:1, ...)")
    p.add_argument("--backend", default="reference", choices=("reference", "auto"),
                   help="mxattn backend: reference runs every recipe; auto runs each recipe on the fastest "
                        "backend that runs it (triton on a CUDA GPU for every MXFP8 recipe, reference for "
                        "per-tensor scaling)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (inputs and training runs)")
    p.add_argument("--seed", type=int, default=0, help="first seed; seeds are seed, seed+1, ...")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run (None: by --size, tiny 4, cpu 200, gpu 2000)")
    p.add_argument("--skip-training", action="store_true", help="run parts 1 and 2 only (no training)")
    p.add_argument("--skip-errors", action="store_true", help="leave part 1 (error against FP64) out")
    p.add_argument("--skip-future", action="store_true", help="leave part 2 (future-token sensitivity) out")
    p.add_argument("--future-magnitudes", default="256,4096",
                   help="comma-separated |v| of the outlier value row in part 2 (a plain redraw always runs)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the study, restored after it (None: torch's choice)")
    p.add_argument("--recipes", default=None,
                   help="comma-separated recipe labels to run besides the default (e.g. 'p_quant=none,"
                        "v_operand=bf16'; default: every recipe)")
    p.add_argument("--out-dir", default=None,
                   help="output directory (None: benchmarks/results/<device name>/recipe_study/ of this repository)")
    args = p.parse_args(argv)
    if args.skip_errors and args.skip_future and args.skip_training:
        p.error("--skip-errors, --skip-future and --skip-training together leave nothing to run")
    for name, value in (("seeds", args.seeds), ("steps", args.steps), ("threads", args.threads)):
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1, got {value}")
    args.recipe_labels = parse_recipe_labels(args.recipes, p.error)
    try:
        args.magnitudes = [float(x) for x in args.future_magnitudes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--future-magnitudes must be comma-separated numbers, got {args.future_magnitudes!r}")
    if any(not (m > 0 and math.isfinite(m)) for m in args.magnitudes):
        p.error(f"--future-magnitudes must be positive and finite, got {args.future_magnitudes!r}")
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    """Run the study; returns the result dict (also written as JSON) with "paths" of the files written."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, device)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: List[str], device: torch.device) -> dict:
    size = SIZES[args.size]
    steps = args.steps if args.steps is not None else size["steps"]
    seeds = list(range(args.seed, args.seed + args.seeds))
    recipes = study_recipes(args.recipe_labels)
    out_dir = args.out_dir or default_out_dir(device_name(device))

    total = (0 if args.skip_errors else len(error_cases(size)) * len(seeds)) \
        + (0 if args.skip_future else len(seeds)) + (0 if args.skip_training else len(seeds) * (1 + len(recipes)))
    progress = Progress(total)
    result = dict(command=command_line(argv), size=args.size, device=device_name(device), torch=torch.__version__,
                  backend=args.backend, steps=steps,
                  commit=_git_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"), seeds=seeds,
                  threads=torch.get_num_threads(),
                  recipes={label: r.differences() if not r.is_default else "the cuDNN recipe " + repr(r)
                           for label, r in recipes},
                  seconds={})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # backend="auto" notes
        if not args.skip_errors:
            start = time.perf_counter()
            result["errors"] = run_errors(size, seeds, recipes, device, args.backend, progress)
            result["seconds"]["errors"] = time.perf_counter() - start
        if not args.skip_future:
            start = time.perf_counter()
            result["future"] = run_future(size, seeds, recipes, args.magnitudes, device, args.backend, progress)
            result["seconds"]["future"] = time.perf_counter() - start
        if not args.skip_training:
            # parts 1 and 2 (when run) written first, and every training run as it ends: a run cut short (a time limit)
            # keeps what it measured (recipe_study_training_runs.json, replaced by the tables at the end)
            write_outputs(result, out_dir)
            runs_path = os.path.join(out_dir, "recipe_study_training_runs.json")
            start = time.perf_counter()
            result["training"] = run_training(size, steps, seeds, recipes, device, args.backend, progress,
                                              on_run=lambda runs: _dump(runs, runs_path))
            result["seconds"]["training"] = time.perf_counter() - start
            os.remove(runs_path)
    result["paths"] = write_outputs(result, out_dir)
    print(f"wrote {result['paths']['md']} and {result['paths']['json']} ({result['plots']})", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
