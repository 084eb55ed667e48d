"""Train a small byte-level (character-level) GPT twice -- BF16 vs MXFP8 attention -- and compare the losses.

Both models start from the same weights and see the same batches; the only difference is the attention
kernel inside each block:

  * "bf16":  torch's `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on bf16 inputs (the baseline)
  * "mxfp8": `mxattn.DotProductAttention`, which quantizes Q, K, V (and dO in backward) to MXFP8

The text is the source code of Python's standard library (every machine with Python has it), read as bytes,
so the vocabulary is the 256 byte values. The last 10% is held out for a validation loss.

Weights are fp32; forward and backward run under `torch.autocast(dtype=torch.bfloat16)` on CPU and CUDA,
so the q, k, v projections (nn.Linear) hand bf16 tensors to the attention.

    python samples/train_gpt.py                        # tiny default config, a minute or two on a CPU
    python samples/train_gpt.py --device cuda --steps 2000 --layers 6 --dim 384 --heads 6 --seq 256 --batch 64
    python samples/train_gpt.py --backend reference --recipe p_quant=none,v_operand=bf16   # a recipe variant

`--recipe` picks the MXFP8 model's numerics (`mxattn.Recipe`, a comma-separated field=value list; the default
recipe when not given). cudnn runs only the default recipe and triton every MXFP8 one (not per-tensor
scaling); --backend auto picks a backend that runs the recipe asked for. `train_single` trains one model alone, as `main` trains it (samples/recipe_study.py
uses it for many seeds and recipes).

Prints both loss curves, the final training losses, the validation losses, and saves a plot
(samples/out/train_gpt_loss.png by default; needs matplotlib, `pip install mxattn[samples]`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import fields
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    import mxattn
except ImportError:  # running from a source checkout without `pip install -e .`: use the repo's copy
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mxattn

VOCAB_SIZE = 256  # byte-level: every byte value is a token


def parse_recipe(text: str) -> "mxattn.Recipe":
    """A `mxattn.Recipe` from a comma-separated ``field=value`` list (the --recipe syntax), e.g.
    ``"p_quant=none,v_operand=bf16"``; unnamed fields keep the default, and ``""`` or ``"default"`` is the
    default recipe. Raises ValueError (naming --recipe) on a malformed item, an unknown or repeated field, or a
    value the field does not allow."""
    names = [f.name for f in fields(mxattn.Recipe)]
    text = text.strip()
    if text in ("", "default"):
        return mxattn.Recipe()
    chosen: Dict[str, str] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"--recipe: expected field=value items separated by commas, got {item.strip()!r} "
                             f"in {text!r} (fields: {', '.join(names)})")
        if name not in names:
            raise ValueError(f"--recipe: unknown field {name!r} (fields: {', '.join(names)})")
        if name in chosen:
            raise ValueError(f"--recipe: field {name!r} given twice")
        chosen[name] = value
    try:
        return mxattn.Recipe(**chosen)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--recipe: {exc}") from None


# ----------------------------------------------------------------------------------------------- data

def load_stdlib_bytes(num_bytes: int) -> torch.Tensor:
    """The first `num_bytes` bytes of Python's standard library sources as a uint8 tensor [num_bytes].

    Reads the .py files directly in the directory holding `os.py`, in sorted name order (deterministic).
    """
    stdlib_dir = os.path.dirname(os.__file__)
    names = sorted(name for name in os.listdir(stdlib_dir) if name.endswith(".py"))
    chunks, total = [], 0
    for name in names:
        with open(os.path.join(stdlib_dir, name), "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
        if total >= num_bytes:
            break
    data = b"".join(chunks)[:num_bytes]
    if len(data) < num_bytes:
        raise ValueError(f"num_bytes={num_bytes} but the standard library in {stdlib_dir} only has {len(data)}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator, device: torch.device):
    """Random windows of `data`: inputs x [batch, seq] int64 and next-byte targets y [batch, seq] int64."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    windows = data[idx].long().to(device)
    return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------------------------- model

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; `attention` picks the kernel: "bf16" (torch SDPA) or "mxfp8" (mxattn,
    with `recipe`: None for the default recipe, or an `mxattn.Recipe`).

    forward(x [b, s, dim]) -> [b, s, dim]. Both kernels get bf16 q, k, v of shape [b, s, heads, head_dim].
    """

    def __init__(self, dim: int, heads: int, attention: str, backend: str = "auto",
                 recipe: Optional["mxattn.Recipe"] = None):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        if attention not in ("bf16", "mxfp8"):
            raise ValueError(f"attention must be 'bf16' or 'mxfp8', got {attention!r}")
        if recipe is not None and attention != "mxfp8":
            raise ValueError(f"a recipe applies to attention='mxfp8' only, got attention={attention!r}")
        self.heads, self.head_dim, self.attention = heads, dim // heads, attention
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        if attention == "mxfp8":
            # No parameters: swapping it in keeps the state_dict identical to the bf16 model's.
            self.mxfp8_attn = mxattn.DotProductAttention(heads, self.head_dim, qkv_format="bshd",
                                                         attn_mask_type="causal", backend=backend,
                                                         recipe=recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).to(torch.bfloat16)  # bf16 already under autocast; explicit for clarity
        q, k, v = qkv.view(b, s, 3, self.heads, self.head_dim).unbind(dim=2)  # each [b, s, h, d]
        if self.attention == "mxfp8":
            out = self.mxfp8_attn(q, k, v)  # [b, s, h*d]
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)  # [b, h, s, d]
            out = out.transpose(1, 2).reshape(b, s, -1)
        return self.proj(out)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x)). [b, s, dim] -> [b, s, dim]."""

    def __init__(self, dim: int, heads: int, attention: str, backend: str,
                 recipe: Optional["mxattn.Recipe"] = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, attention, backend, recipe)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT. forward(idx [b, s] int64) -> logits [b, s, VOCAB_SIZE] (float32). `recipe` (mxfp8 only):
    the attention's `mxattn.Recipe`, None for the default."""

    def __init__(self, layers: int, dim: int, heads: int, max_seq: int, attention: str,
                 backend: str = "auto", tied: bool = True, recipe: Optional["mxattn.Recipe"] = None):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB_SIZE, dim)
        self.pos_emb = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention, backend, recipe) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB_SIZE, bias=False)
        if tied:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)).float()


# ------------------------------------------------------------------------------------------- training

def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warmup over the first 10% of steps, then cosine decay to lr/10."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def loss_fn(model: GPT, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-byte cross-entropy (a float32 scalar), forward under bf16 autocast."""
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.view(-1, VOCAB_SIZE), y.reshape(-1))


def make_optimizer(model: GPT, args) -> torch.optim.Optimizer:
    """AdamW at --lr (the schedule sets each step's rate), betas (0.9, 0.95), weight decay 0.1."""
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)


def train_step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, step: int,
               args, device: torch.device) -> float:
    """One optimizer step at the scheduled learning rate (gradients clipped to norm 1); returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args.steps, args.lr)
    loss = loss_fn(model, x, y, device)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()  # .item() syncs, so the timing is honest on CUDA too


def load_splits(args):
    """(training bytes, validation bytes): the first --data-bytes of the stdlib sources, split 90% / 10%."""
    data = load_stdlib_bytes(args.data_bytes)
    split = int(0.9 * data.numel())
    return data[:split], data[split:]


def build_model(args, attention: str, device: torch.device, recipe: Optional["mxattn.Recipe"] = None) -> GPT:
    """The model `main` trains for `attention` ("bf16" or "mxfp8"): the weights are those of the BF16 model
    built right after torch.manual_seed(--seed), so every attention and recipe starts from the same ones."""
    torch.manual_seed(args.seed)
    config = dict(layers=args.layers, dim=args.dim, heads=args.heads, max_seq=args.seq, tied=not args.untied)
    base = GPT(attention="bf16", **config)
    if attention == "bf16":
        if recipe is not None:
            raise ValueError("a recipe applies to attention='mxfp8' only")
        return base.to(device)
    model = GPT(attention=attention, backend=args.backend, recipe=recipe, **config)
    model.load_state_dict(base.state_dict())
    return model.to(device)


def train_single(argv: Optional[List[str]], attention: str, recipe: Optional["mxattn.Recipe"] = None,
                 data=None) -> dict:
    """Train one model alone with `main`'s arguments (`argv`, parsed as `main` parses them; --recipe is
    ignored here, pass `recipe`): the same initial weights, batches and learning-rate schedule as `main`'s
    model of that attention, so the losses equal `main`'s (on the CPU, bit for bit). Prints nothing.

    `data`: (training, validation) bytes from `load_splits`, to share between calls. Returns "loss" (per-step
    training losses), "final" (mean of the last --final-window), "val" (validation loss), "seconds"
    (training time), "args" (dict)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    train_data, val_data = data if data is not None else load_splits(args)
    model = build_model(args, attention, device, recipe)
    optimizer = make_optimizer(model, args)
    generator = torch.Generator().manual_seed(args.seed)
    losses, seconds = [], 0.0
    for step in range(args.steps):
        x, y = get_batch(train_data, args.batch, args.seq, generator, device)
        start = time.perf_counter()
        losses.append(train_step(model, optimizer, x, y, step, args, device))
        seconds += time.perf_counter() - start
    window = min(args.final_window, args.steps)
    return {"loss": losses, "final": sum(losses[-window:]) / window,
            "val": validation_loss(model, val_data, args, device), "seconds": seconds, "args": vars(args)}


@torch.no_grad()
def validation_loss(model: GPT, val_data: torch.Tensor, args, device: torch.device, batches: int = 4) -> float:
    """Mean loss over `batches` fixed held-out batches (the same ones for every model)."""
    model.eval()
    generator = torch.Generator().manual_seed(args.seed + 1)
    losses = [loss_fn(model, *get_batch(val_data, args.batch, args.seq, generator, device), device).item()
              for _ in range(batches)]
    model.train()
    return sum(losses) / len(losses)


def save_plot(curves: Dict[str, List[float]], steps: List[int], path: str, title: str) -> Optional[str]:
    """Plot the loss curves into `path` (PNG); returns the path, or None if matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install mxattn[samples]); skipping the plot")
        return None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, losses in curves.items():
        ax.plot(steps, losses, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per model")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128, help="model width (heads * head_dim)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="sequence length (bytes)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--device", default=default_device)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                   help="directory for the PNG plot")
    p.add_argument("--backend", default="auto", help="mxattn backend: auto, cudnn, triton or reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-bytes", type=int, default=2_000_000, help="bytes of stdlib source to use")
    p.add_argument("--untied", action="store_true", help="separate output head instead of tied embeddings")
    p.add_argument("--log-every", type=int, default=25, help="print the losses every N steps")
    p.add_argument("--final-window", type=int, default=10, help="final loss = mean of the last N steps")
    p.add_argument("--recipe", default=None,
                   help="the MXFP8 model's mxattn.Recipe as comma-separated field=value items, e.g. "
                        "p_quant=none,v_operand=bf16 (fields: p_quant, v_operand, ds_quant, scale_rounding, "
                        "scaling); not given: the default recipe. Variants run on --backend reference (or auto)")
    args = p.parse_args(argv)
    if args.recipe is not None:
        try:
            parse_recipe(args.recipe)
        except ValueError as exc:
            p.error(str(exc))
    for name in ("steps", "layers", "dim", "heads", "seq", "batch", "data_bytes", "log_every", "final_window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.data_bytes // 10 <= args.seq + 1:
        p.error(f"--data-bytes ({args.data_bytes}) is too small: the 10% validation split must hold more than "
                f"--seq + 1 ({args.seq + 1}) bytes")
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    """Train the BF16-SDPA and MXFP8 models side by side; returns curves, final and validation losses.

    Returned keys: "steps" (list of int), "loss_bf16", "loss_mxfp8" (per-step training losses),
    "final_bf16", "final_mxfp8" (mean of the last --final-window steps), "val_bf16", "val_mxfp8",
    "seconds_bf16", "seconds_mxfp8" (training time after the first step), "first_step_seconds_bf16",
    "first_step_seconds_mxfp8", "png" (path or None), "recipe" (the MXFP8 model's
    mxattn.Recipe), "args" (dict).
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    recipe = None if args.recipe is None else parse_recipe(args.recipe)

    train_data, val_data = load_splits(args)

    # Same initial weights: build the baseline from the seed, copy its weights into the MXFP8 model.
    models = {"bf16": build_model(args, "bf16", device),
              "mxfp8": build_model(args, "mxfp8", device, recipe)}
    optimizers = {name: make_optimizer(m, args) for name, m in models.items()}
    n_params = sum(p.numel() for p in models["bf16"].parameters())
    recipe_note = "" if recipe is None else f", recipe {recipe.differences()}"
    print(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads of {args.dim // args.heads}, "
          f"seq {args.seq}, batch {args.batch}, {n_params / 1e6:.2f}M parameters, device {device}, "
          f"mxattn backend {args.backend!r}{recipe_note}; {train_data.numel():,} training bytes")

    # Same batches: one generator draws each step's batch, and both models train on it.
    generator = torch.Generator().manual_seed(args.seed)
    losses = {name: [] for name in models}
    seconds = {name: 0.0 for name in models}  # after the first step (on a GPU, that step compiles the kernels)
    first_step = {name: 0.0 for name in models}
    print(f"{'step':>6} {'loss_bf16':>10} {'loss_mxfp8':>11}")
    for step in range(args.steps):
        x, y = get_batch(train_data, args.batch, args.seq, generator, device)
        for name, model in models.items():
            start = time.perf_counter()
            losses[name].append(train_step(model, optimizers[name], x, y, step, args, device))  # (.item(): synced)
            (seconds if step else first_step)[name] += time.perf_counter() - start
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"{step:>6} {losses['bf16'][-1]:>10.4f} {losses['mxfp8'][-1]:>11.4f}")

    window = min(args.final_window, args.steps)
    final = {name: sum(curve[-window:]) / window for name, curve in losses.items()}
    val = {name: validation_loss(model, val_data, args, device) for name, model in models.items()}
    rel = abs(final["mxfp8"] - final["bf16"]) / final["bf16"]
    print(f"final training loss (mean of last {window} steps): bf16 {final['bf16']:.4f}, "
          f"mxfp8 {final['mxfp8']:.4f} (relative difference {100 * rel:.2f}%)")
    print(f"validation loss: bf16 {val['bf16']:.4f}, mxfp8 {val['mxfp8']:.4f}")
    print(f"training time of steps 1-{args.steps - 1}: bf16 {seconds['bf16']:.1f} s, mxfp8 {seconds['mxfp8']:.1f} s "
          f"(first step, where a GPU compiles the kernels: bf16 {first_step['bf16']:.1f} s, "
          f"mxfp8 {first_step['mxfp8']:.1f} s; a one-off run beside the loss check, not a benchmark: "
          f"benchmarks/models_bench.py times whole models)")

    steps = list(range(args.steps))
    png = save_plot({"BF16 attention (torch SDPA)": losses["bf16"],
                     f"MXFP8 attention (mxattn, {args.backend}{recipe_note})": losses["mxfp8"]}, steps,
                    os.path.join(args.out, "train_gpt_loss.png"),
                    f"byte-level GPT on Python stdlib: {args.layers}L d{args.dim} h{args.heads} s{args.seq}")
    if png:
        print(f"loss plot saved to {png}")
    return {"steps": steps, "loss_bf16": losses["bf16"], "loss_mxfp8": losses["mxfp8"],
            "final_bf16": final["bf16"], "final_mxfp8": final["mxfp8"],
            "val_bf16": val["bf16"], "val_mxfp8": val["mxfp8"],
            "seconds_bf16": seconds["bf16"], "seconds_mxfp8": seconds["mxfp8"],
            "first_step_seconds_bf16": first_step["bf16"], "first_step_seconds_mxfp8": first_step["mxfp8"], "png": png,
            "recipe": mxattn.Recipe() if recipe is None else recipe, "args": vars(args)}


if __name__ == "__main__":
    main()
