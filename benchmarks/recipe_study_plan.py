"""The plan of benchmarks/recipe_study_gpu.sh: the GPU recipe study's training runs -- every (script, seed, run)
of samples/recipe_study.py (GPT) and samples/recipe_study_hf.py (Llama), a run being the baseline or one recipe --
and the parts-1-and-2 job of recipe_study.py spread over the GPUs so that each GPU's estimated time is about the
same, in few processes (each process pays the start-up: imports, data, CUDA context, the first Triton compiles).

    python benchmarks/recipe_study_plan.py --gpus 4 --seeds 3 --steps 1000     # the plan; 4 GPUs

A process trains a rectangle of runs: consecutive seeds (--seed k --seeds n) times a set of run labels (--runs),
the same labels for each of its seeds. A GPU runs its processes one after another; its estimated time is its
runs' plus one start-up per process, its runs grouped into as few rectangles as they allow (`processes`). The
planner (`make_plan`) gives the heavy jobs (the per-tensor runs, parts 1 and 2) longest first each to the GPU whose
time grows least, lays the other runs in a row of (script, seed) blocks and cuts it into one stretch per GPU that
fills it to about the average (few blocks per GPU: few processes), then moves and swaps runs while the longest
GPU time, else the number of processes, shrinks.

Estimated cost (seconds, estimates; override with the options): an MXFP8 run on Triton or a BF16 baseline run of
the GPT takes STEP_S = 0.02 s per step + 1 s (session 18, H100: 4-7 s at 250 steps once compiled); the per-tensor
recipe (scaling=per_tensor, on the reference backend) takes --per-tensor-weight = 9 times that (session 18: 43-49 s
at 250 steps; measured, not the ~3.5 first assumed); a transformers Llama run --hf-weight = 1 times the GPT run of
the same recipe (not measured on a GPU: a guess -- half the GPT's tokens per step, a wider model and more Python
per layer); each process --process-s = 20 s of start-up (session 18: the first run took ~10 s more than the
next, the Triton compiles, plus imports and data); the parts-1-and-2 job --parts12-s = 90 s (session 18).

Output: stdout, one line per process, tab-separated: GPU index (into the GPU list), shard name, script, first
seed, number of seeds, the --runs labels comma-separated ("*" for every run of the study; "-" for the parts-1-and-2
job, which has no seeds of its own: the fields are then "-" too) and the estimated seconds (no field is empty);
stderr, the plan in words (each GPU's processes and estimated time, against the ideal: the total over the number
of GPUs, a lower bound that counts one start-up per script).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "samples"))
import recipe_study as rs  # noqa: E402
import recipe_study_hf as rs_hf  # noqa: E402

SCRIPTS = {"gpt": ("recipe_study.py", rs.BF16), "hf": ("recipe_study_hf.py", rs_hf.SDPA)}
PER_TENSOR = "scaling=per_tensor"
STEP_S, RUN_S = 0.02, 1.0          # a GPT run: STEP_S per step + RUN_S (validation, model build)
DEFAULTS = dict(per_tensor_weight=9.0, hf_weight=1.0, process_s=20.0, parts12_s=90.0)

Run = Tuple[str, int, str]         # (script key, seed, label)


def study_labels(script: str) -> List[str]:
    """The run labels of `script` ("gpt", "hf") in the study's order: its baseline, then every recipe of
    `recipe_study.study_recipes()`."""
    return [SCRIPTS[script][1]] + [label for label, _ in rs.study_recipes()]


def study_runs(seeds: int) -> List[Run]:
    """Every (script, seed, label) training run of the study: both scripts, seeds 0..seeds-1, every label."""
    return [(script, seed, label) for script in SCRIPTS for seed in range(seeds) for label in study_labels(script)]


def run_cost(run: Run, steps: int, per_tensor_weight: float, hf_weight: float) -> float:
    """The estimated seconds of one training run (module docstring)."""
    script, _, label = run
    return (STEP_S * steps + RUN_S) * (per_tensor_weight if label == PER_TENSOR else 1.0) \
        * (hf_weight if script == "hf" else 1.0)


def _ranges(seeds: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted seeds -> maximal runs of consecutive seeds as (first, count)."""
    out: List[Tuple[int, int]] = []
    for seed in seeds:
        if out and out[-1][0] + out[-1][1] == seed:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((seed, 1))
    return out


def processes(runs: Sequence[Run]) -> List[Tuple[str, int, int, List[str]]]:
    """The fewest processes (script, first seed, number of seeds, labels) found for a GPU's `runs`: per script,
    either the seeds grouped (consecutive seeds with the same labels) or the labels grouped (labels with the same
    seeds, split into consecutive ranges), whichever gives fewer; labels in the study's order."""
    out = []
    for script in SCRIPTS:
        mine = [(seed, label) for s, seed, label in runs if s == script]
        if not mine:
            continue
        by_seed: Dict[int, frozenset] = {}
        for seed, label in mine:
            by_seed[seed] = by_seed.get(seed, frozenset()) | {label}
        seed_major = []
        for seed in sorted(by_seed):
            last = seed_major[-1] if seed_major else None
            if last and last[0] + last[1] == seed and by_seed[seed] == last[2]:
                seed_major[-1] = (last[0], last[1] + 1, last[2])
            else:
                seed_major.append((seed, 1, by_seed[seed]))
        by_label: Dict[str, List[int]] = {}
        for seed, label in mine:
            by_label.setdefault(label, []).append(seed)
        groups: Dict[Tuple[int, ...], set] = {}
        for label, seeds in by_label.items():
            groups.setdefault(tuple(sorted(seeds)), set()).add(label)
        label_major = [(first, count, frozenset(labels)) for seeds, labels in groups.items()
                       for first, count in _ranges(seeds)]
        best = min((seed_major, label_major), key=len)
        out += [(script, first, count, [label for label in study_labels(script) if label in labels])
                for first, count, labels in sorted(best, key=lambda p: (p[0], sorted(p[2])))]
    return out


class Plan:
    """Runs assigned to GPUs, with the costs to weigh them (see `make_plan`)."""

    def __init__(self, ngpus: int, cost: Dict[Run, float], process_s: float, parts12_s: float):
        self.ngpus, self.cost, self.process_s, self.parts12_s = ngpus, cost, process_s, parts12_s
        self.gpu_runs: List[List[Run]] = [[] for _ in range(ngpus)]
        self.parts12_gpu: Optional[int] = None

    def load(self, gpu: int, runs: Optional[Sequence[Run]] = None) -> float:
        """GPU `gpu`'s estimated seconds (with `runs` in place of its runs when given)."""
        runs = self.gpu_runs[gpu] if runs is None else runs
        return (sum(self.cost[r] for r in runs) + self.process_s * len(processes(runs))
                + (self.parts12_s if self.parts12_gpu == gpu else 0.0))

    def loads(self) -> List[float]:
        return [self.load(g) for g in range(self.ngpus)]

    def score(self) -> Tuple[float, int, float]:
        """What the planner minimizes: the longest GPU time, then the number of processes, then the sum of squares."""
        loads = self.loads()
        return (round(max(loads), 6), sum(len(processes(r)) for r in self.gpu_runs),
                round(sum(x * x for x in loads), 6))

    def total(self) -> float:
        """The ideal's numerator: every run, the parts-1-and-2 job and one start-up per script."""
        return sum(self.cost.values()) + self.parts12_s + self.process_s * len(SCRIPTS)


def make_plan(ngpus: int, seeds: int, steps: int, per_tensor_weight: float = DEFAULTS["per_tensor_weight"],
              hf_weight: float = DEFAULTS["hf_weight"], process_s: float = DEFAULTS["process_s"],
              parts12_s: float = DEFAULTS["parts12_s"], parts12: bool = True) -> Plan:
    """Every run of `study_runs(seeds)` (and the parts-1-and-2 job unless parts12 is False) assigned to one of
    `ngpus` GPUs: the heavy jobs (per-tensor runs, parts 1 and 2) longest first, each to the GPU whose time grows
    least; then the other runs, in a row of (script, seed) blocks ordered by the GPU holding the block's heavy
    run, cut into one stretch per GPU that fills it to about the average (a stretch touches few blocks: few
    processes, and a block's stretch on the GPU of its heavy run joins its process); then improved by single
    moves and swaps (`_improve`)."""
    runs = study_runs(seeds)
    cost = {r: run_cost(r, steps, per_tensor_weight, hf_weight) for r in runs}
    plan = Plan(ngpus, cost, process_s, parts12_s)
    heavy: List[Tuple[float, object]] = [(cost[r], r) for r in runs if r[2] == PER_TENSOR]
    for _, job in sorted(heavy + ([(parts12_s, "parts12")] if parts12 else []), key=lambda j: (-j[0], str(j[1]))):
        gpu = min(range(ngpus), key=lambda g: (plan.load(g, plan.gpu_runs[g] + ([] if job == "parts12" else [job]))
                                               + (parts12_s if job == "parts12" else 0.0), g))
        if job == "parts12":
            plan.parts12_gpu = gpu
        else:
            plan.gpu_runs[gpu].append(job)
    home = {r[:2]: g for g, rs_ in enumerate(plan.gpu_runs) for r in rs_}
    row = sorted((r for r in runs if r[2] != PER_TENSOR), key=lambda r: (home.get(r[:2], ngpus), r[:2]))
    for gpu in range(ngpus):
        target = (sum(cost[r] for r in row) + sum(plan.load(g) for g in range(gpu, ngpus))) / (ngpus - gpu)
        while row and (gpu == ngpus - 1 or plan.load(gpu, plan.gpu_runs[gpu] + row[:1]) - target
                       <= target - plan.load(gpu)):
            plan.gpu_runs[gpu].append(row.pop(0))
    _improve(plan)
    return plan


def _improve(plan: Plan, rounds: int = 500) -> None:
    """Moves of one run (or of the parts-1-and-2 job) to another GPU, and swaps of two runs of two GPUs, while
    `plan.score()` improves (the first improving change each round)."""
    loads = plan.loads()
    counts = [len(processes(r)) for r in plan.gpu_runs]

    def score(la: float, lb: float, ca: int, cb: int, a: int, b: int) -> Tuple[float, int, float]:
        new = [la if g == a else lb if g == b else x for g, x in enumerate(loads)]
        return (round(max(new), 6), sum(counts) - counts[a] - counts[b] + ca + cb,
                round(sum(x * x for x in new), 6))

    def candidates(a: int, b: int):
        """(runs of a, runs of b, parts-1-and-2 GPU) after each move or swap from a to b."""
        ra, rb = plan.gpu_runs[a], plan.gpu_runs[b]
        if plan.parts12_gpu == a:
            yield ra, rb, b
        for i, run in enumerate(ra):
            rest = ra[:i] + ra[i + 1:]
            yield rest, rb + [run], plan.parts12_gpu
            for j, other in enumerate(rb):
                if plan.cost[other] < plan.cost[run]:
                    yield rest + [other], rb[:j] + [run] + rb[j + 1:], plan.parts12_gpu

    best = score(loads[0], loads[0], counts[0], counts[0], 0, 0)
    for _ in range(rounds):
        change = None
        for a in sorted(range(plan.ngpus), key=lambda g: -loads[g]):
            for b in range(plan.ngpus):
                if a == b:
                    continue
                for ra, rb, p12 in candidates(a, b):
                    parts12, plan.parts12_gpu = plan.parts12_gpu, p12
                    la, lb = plan.load(a, ra), plan.load(b, rb)
                    plan.parts12_gpu = parts12
                    ca, cb = len(processes(ra)), len(processes(rb))
                    new = score(la, lb, ca, cb, a, b)
                    if new < best:
                        change = (new, a, b, ra, rb, p12, la, lb, ca, cb)
                        break
                if change:
                    break
            if change:
                break
        if change is None:
            return
        best, a, b, plan.gpu_runs[a], plan.gpu_runs[b], plan.parts12_gpu, loads[a], loads[b], counts[a], \
            counts[b] = change


def plan_lines(plan: Plan) -> List[Tuple[int, str, str, str, str, str, float]]:
    """The plan's processes: (GPU index, shard name, script, first seed, number of seeds, --runs labels comma-
    separated ("*" for all; "-" for the parts-1-and-2 job), estimated seconds), each GPU's in order."""
    out = []
    for gpu in range(plan.ngpus):
        if plan.parts12_gpu == gpu:
            out.append((gpu, "gpt_parts12", SCRIPTS["gpt"][0], "-", "-", "-", plan.parts12_s))
        for k, (script, first, count, labels) in enumerate(processes(plan.gpu_runs[gpu])):
            est = plan.process_s + sum(plan.cost[(script, seed, label)] for seed in range(first, first + count)
                                       for label in labels)
            runs = "*" if labels == study_labels(script) else ",".join(labels)
            out.append((gpu, f"{script}_gpu{gpu}_{k}", SCRIPTS[script][0], str(first), str(count), runs, est))
    return out


def describe(plan: Plan, steps: int, gpus: Optional[Sequence[str]] = None) -> str:
    """The plan in words: each GPU's processes with their estimated seconds, and each GPU's total against the
    ideal."""
    loads = plan.loads()
    ideal = plan.total() / plan.ngpus
    lines = [f"plan: {sum(len(r) for r in plan.gpu_runs)} training runs ({steps} steps each) and "
             f"{'the parts-1-and-2 job' if plan.parts12_gpu is not None else 'no parts-1-and-2 job'} on "
             f"{plan.ngpus} GPU(s); estimated seconds (estimates, see benchmarks/recipe_study_plan.py): longest GPU "
             f"{max(loads):.0f} s, ideal {ideal:.0f} s ({max(loads) / ideal:.2f}x)"]
    for gpu in range(plan.ngpus):
        lines.append(f"  GPU {gpus[gpu] if gpus else gpu}: ~{loads[gpu]:.0f} s")
        for _, name, script, first, count, runs, est in (p for p in plan_lines(plan) if p[0] == gpu):
            what = ("parts 1 and 2" if runs == "-" else
                    f"seeds {first}..{int(first) + int(count) - 1}, runs: {'all' if runs == '*' else runs}")
            lines.append(f"    {name}: {script} {what} (~{est:.0f} s)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Plan:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu-ids", default=None, help="the GPUs' comma-separated ids, for the plan in words")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. seeds-1")
    p.add_argument("--steps", type=int, default=rs.SIZES["gpu"]["steps"], help="training steps per run")
    p.add_argument("--no-parts12", action="store_true", help="plan the training runs only")
    for name, value in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=float, default=value, help="see the module docstring")
    args = p.parse_args(argv)
    gpus = args.gpu_ids.split(",") if args.gpu_ids else None
    if args.gpus < 1 or args.seeds < 1 or args.steps < 1 or (gpus and len(gpus) != args.gpus):
        p.error("--gpus, --seeds and --steps must be at least 1, and --gpu-ids name --gpus GPUs")
    plan = make_plan(args.gpus, args.seeds, args.steps, args.per_tensor_weight, args.hf_weight, args.process_s,
                     args.parts12_s, not args.no_parts12)
    print(describe(plan, args.steps, gpus), file=sys.stderr)
    for line in plan_lines(plan):
        print("\t".join(map(str, line[:-1])) + f"\t{line[-1]:.0f}")
    return plan


if __name__ == "__main__":
    main()
