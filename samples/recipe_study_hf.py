"""Train a transformers model with each MXFP8 attention recipe (`mxattn.Recipe`), over seeds: the
Hugging Face counterpart of part 3 of samples/recipe_study.py (which trains samples/train_gpt.py's GPT).

    python samples/recipe_study_hf.py --threads 1                 # --size cpu: a few minutes on one CPU core
    python samples/recipe_study_hf.py --size gpu --device cuda    # a bigger model on a GPU

The model is transformers' `LlamaForCausalLM` built from a config (random weights, grouped-query attention: two
query heads per KV head, rotary positions, tied embeddings) on the bytes of Python's standard library, as
train_gpt.py reads them. For each seed the weights are drawn once (attention "sdpa") and loaded into every other
model, and every model sees the same batches and learning-rate schedule; the attention is torch SDPA (the
baseline) or mxattn's, registered with transformers under one name per recipe through
`mxattn.integrations.transformers.register(name, backend=..., recipe=...)` (the `reference` backend by default:
it runs every recipe; on a GPU "auto" runs every MXFP8 recipe in Triton and per-tensor scaling on reference).
AdamW with warm-up and cosine decay, bf16 autocast, gradients clipped to norm 1.

Output: the final training loss (mean of the last 10 steps) and the validation loss per recipe, their mean and
spread over seeds, the differences from SDPA and from the default recipe paired by seed, and the training speed
(tokens per second of the optimizer steps), in
recipe_study_hf.md and recipe_study_hf.json (--out-dir, default benchmarks/results/<device>/recipe_study/).
Progress lines ("[k/N] ...") go to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recipe_study as rs  # noqa: E402  (samples/recipe_study.py: recipes, spreads, progress, data)

SDPA = "sdpa"
#: model and training configuration per --size (LlamaConfig fields, then the training loop's)
SIZES = {
    "tiny": dict(model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1), seq=32, batch=4, steps=4, lr=3e-3, data_bytes=100_000),
    "cpu": dict(model=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2), seq=64, batch=16, steps=200, lr=3e-3, data_bytes=2_000_000),
    "gpu": dict(model=dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                           num_key_value_heads=4), seq=256, batch=32, steps=2000, lr=1e-3, data_bytes=4_000_000),
}
FINAL_WINDOW = 10


def build_llama(size: dict, attention: str, device: torch.device, state: Optional[dict] = None):
    """LlamaForCausalLM of `size` with attn_implementation `attention` on `device`; weights from `state` when
    given (else as drawn from torch's current seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=rs.load_train_gpt().VOCAB_SIZE, max_position_embeddings=size["seq"],
                         tie_word_embeddings=True, attn_implementation=attention, **size["model"])
    model = LlamaForCausalLM(config)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device)


def train_one(size: dict, steps: int, seed: int, attention: str, state: dict, data, device: torch.device) -> dict:
    """Train one model from `state` on seed's batches -> {"final", "val", "seconds", "first", "tokens_per_s"}
    ("seconds": the optimizer steps' time; "tokens_per_s": batch * seq * steps over it)."""
    tg = rs.load_train_gpt()
    train_data, val_data = data
    model = build_llama(size, attention, device, state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=size["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(seed)

    def loss_of(x, y):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    losses, seconds = [], 0.0
    model.train()
    for step in range(steps):
        x, y = tg.get_batch(train_data, size["batch"], size["seq"], generator, device)
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = tg.lr_at(step, steps, size["lr"])
        loss = loss_of(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        seconds += time.perf_counter() - start
    model.eval()
    val_gen = torch.Generator().manual_seed(12345)  # the same held-out batches for every model
    with torch.no_grad():
        val = sum(loss_of(*tg.get_batch(val_data, size["batch"], size["seq"], val_gen, device)).item()
                  for _ in range(4)) / 4
    window = min(FINAL_WINDOW, steps)
    return {"final": sum(losses[-window:]) / window, "val": val, "seconds": seconds, "first": losses[0],
            "tokens_per_s": rs.tokens_per_second(size["batch"], size["seq"], steps, seconds)}


def run(size: dict, steps: int, seeds: Sequence[int], device: torch.device, backend: str,
        progress: rs.Progress, only: Optional[Sequence[str]] = None) -> dict:
    """Every recipe (or the default and those labelled in `only`) and SDPA for every seed -> the study's recipe
    labels, the runs ({label: {seed (str): run}}) and their summary (`training_summary`: spreads, paired
    differences)."""
    import mxattn.integrations.transformers as mx_hf
    tg = rs.load_train_gpt()
    data_bytes = tg.load_stdlib_bytes(size["data_bytes"])
    split = int(0.9 * data_bytes.numel())
    data = (data_bytes[:split], data_bytes[split:])
    recipes = rs.study_recipes(only)
    labels = [SDPA] + [label for label, _ in recipes]
    names = {label: mx_hf.register(f"mxfp8study{i}", backend=backend, recipe=r)
             for i, (label, r) in enumerate(recipes)}
    runs: Dict[str, Dict[int, dict]] = {}
    try:
        for seed in seeds:
            torch.manual_seed(seed)
            state = {k: v.clone() for k, v in build_llama(size, SDPA, torch.device("cpu")).state_dict().items()}
            for label in labels:
                res = train_one(size, steps, seed, names.get(label, SDPA), state, data, device)
                runs.setdefault(label, {})[seed] = res
                progress.step(f"train {label} seed {seed}: final {res['final']:.4f}, val {res['val']:.4f}, "
                              f"{res['seconds']:.0f} s")
    finally:
        for name in names.values():
            mx_hf.unregister(name)
    runs_json = {label: {str(s): r for s, r in by_seed.items()} for label, by_seed in runs.items()}
    return dict(recipes=labels[1:], runs=runs_json, summary=training_summary(runs_json))


def training_summary(runs: Dict[str, Dict[str, dict]]) -> dict:
    """The summary of `runs` ({label: {seed (str): run}}): `recipe_study.summarize_runs` against SDPA."""
    return rs.summarize_runs(runs, SDPA, "sdpa")


def write_outputs(result: dict, out_dir: Optional[str]) -> Dict[str, str]:
    """recipe_study_hf.md and recipe_study_hf.json in `out_dir` (None: the device's results folder); prints the
    markdown and returns the paths."""
    out_dir = out_dir or rs.default_out_dir(result["device"])
    os.makedirs(out_dir, exist_ok=True)
    paths = {"md": os.path.join(out_dir, "recipe_study_hf.md"), "json": os.path.join(out_dir, "recipe_study_hf.json")}
    with open(paths["md"], "w") as f:
        f.write(render_markdown(result))
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    print(render_markdown(result))
    print(f"wrote {paths['md']} and {paths['json']}", file=sys.stderr)
    return paths


def render_markdown(result: dict) -> str:
    """The result as a markdown table."""
    s = result["summary"]
    lines = [f"# MXFP8 attention recipes: training transformers' Llama ({result['device']})", "",
             (f"`{result['command']}`; torch {result['torch']}, transformers {result['transformers']}, backend "
             f"{result['backend']}, commit {result['commit']}, {result['date']}. Model: {result['model']}; "
             f"{result['steps']} steps of batch {result['batch']} x {result['seq']} bytes, seeds {result['seeds']}. "
             "Losses: mean [min, max] over seeds; differences paired by seed (same weights, same batches). "
             "Seconds per run: the optimizer steps' time; tokens/s: batch x seq x steps over it; means over seeds."),
             "",
             "| attention | final train loss | validation loss | final - SDPA | final - default | val - SDPA | "
             "seconds per run | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for label, row in s.items():
        lines.append(f"| {label} | {rs._span(row['final'])} | {rs._span(row['val'])} | "
                     f"{rs._signed(row['final_minus_sdpa'])} | {rs._signed(row['final_minus_default'])} | "
                     f"{rs._signed(row['val_minus_sdpa'])} | {row['seconds']['mean']:.1f} | "
                     f"{row['tokens_per_s']['mean']:.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=tuple(SIZES), default="cpu", help="model and training size")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    p.add_argument("--backend", default="reference", choices=("reference", "auto"),
                   help="mxattn backend of every recipe (reference runs them all)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds")
    p.add_argument("--seed", type=int, default=0, help="first seed; seeds are seed, seed+1, ...")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the size's)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out-dir", default=None, help="default benchmarks/results/<device>/recipe_study/")
    p.add_argument("--recipes", default=None,
                   help="comma-separated recipe labels to run besides the default (default: every recipe)")
    args = p.parse_args(argv)
    args.recipe_labels = rs.parse_recipe_labels(args.recipes, p.error)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    """Run the study; returns the result (also written as JSON)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size = SIZES[args.size]
    steps = args.steps if args.steps is not None else size["steps"]
    seeds = list(range(args.seed, args.seed + args.seeds))
    progress = rs.Progress(len(seeds) * (1 + len(rs.study_recipes(args.recipe_labels))))
    import transformers
    result = dict(command=rs.command_line(argv, __file__), device=rs.device_name(device),
                  torch=torch.__version__, transformers=transformers.__version__, backend=args.backend,
                  commit=rs._git_commit(), date=datetime.datetime.now().isoformat(timespec="seconds"), seeds=seeds,
                  steps=steps, batch=size["batch"], seq=size["seq"],
                  model="LlamaForCausalLM " + ", ".join(f"{k}={v}" for k, v in size["model"].items()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # backend="auto" notes
        result.update(run(size, steps, seeds, device, args.backend, progress, args.recipe_labels))
    write_outputs(result, args.out_dir)
    return result


if __name__ == "__main__":
    main()
