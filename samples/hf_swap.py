"""Swap a Hugging Face model's attention for MXFP8 attention and measure the agreement.

    python samples/hf_swap.py                       # a small Llama-like model (GQA) built from a config, CPU
    python samples/hf_swap.py --arch qwen2          # sliding-window + full layers
    python samples/hf_swap.py --arch bert           # an encoder with a padding mask
    python samples/hf_swap.py --model PATH          # a local checkpoint (AutoModelForCausalLM / AutoModel)

The same weights run a right-padded batch with attn_implementation="sdpa" (or --baseline eager) and "mxfp8";
the sample prints the relative RMS error and max |diff| of the output on real tokens, and for a LM the top-1
agreement of the next-token logits. Runs in well under 30 s on a CPU (reference backend) by default.
"""

import argparse
import time
import warnings

import torch

import mxattn.integrations.transformers as mx_hf


def small_model(arch: str, layers: int, seed: int):
    from transformers import (BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
    common = dict(vocab_size=512, max_position_embeddings=512)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=2, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                          num_key_value_heads=2, use_sliding_window=True, sliding_window=32,
                          layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                          **common)
        cls = Qwen2ForCausalLM
    else:
        cfg = BertConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                         attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, **common)
        cls = BertModel
    torch.manual_seed(seed)
    return cls(cfg).eval()


def load(path: str):
    from transformers import AutoModel, AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except (ValueError, KeyError):
        return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=("llama", "qwen2", "bert"), default="llama")
    ap.add_argument("--model", help="local checkpoint to load instead of building a small model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=96, help="longest sequence of the batch")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--baseline", choices=("sdpa", "eager"), default="sdpa")
    ap.add_argument("--backend", default="auto", help="mxattn backend (auto, cudnn, triton, reference)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="mxattn: backend='auto'")

    name = mx_hf.register("mxfp8", backend=args.backend)
    model = load(args.model) if args.model else small_model(args.arch, args.layers, args.seed)
    model.to(args.device)
    vocab = model.config.vocab_size

    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.linspace(args.seq, max(1, args.seq // 3), args.batch).round().long()   # right padding
    ids = torch.randint(5, vocab, (args.batch, args.seq), generator=g)
    mask = (torch.arange(args.seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids, mask = ids.masked_fill(mask == 0, 0).to(args.device), mask.to(args.device)
    valid = mask.bool()

    outs, times = {}, {}
    sync = torch.cuda.synchronize if torch.device(args.device).type == "cuda" else (lambda: None)
    for impl in (args.baseline, name):
        model.set_attn_implementation(impl)
        for call in ("first", "warm"):  # the first call compiles the kernels on a GPU; the second runs them
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask)
            sync()
            times[impl, call] = time.perf_counter() - t0
        outs[impl] = (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).float()

    ref, mx = outs[args.baseline][valid], outs[name][valid]
    rel = ((mx - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    what = "logits" if ref.shape[-1] == vocab else "last hidden state"
    print(f"model: {args.model or args.arch} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{model.config.num_hidden_layers} layers), batch {args.batch}, lengths {lengths.tolist()} (right padded), "
          f"device {args.device}")
    print(f"forward time, first call: {args.baseline} {times[args.baseline, 'first']:.2f} s, {name} (backend "
          f"{args.backend}) {times[name, 'first']:.2f} s (on a GPU it compiles the kernels); second call: "
          f"{args.baseline} {1e3 * times[args.baseline, 'warm']:.1f} ms, {name} {1e3 * times[name, 'warm']:.1f} ms "
          f"(one call, not a benchmark: benchmarks/models_bench.py times whole models)")
    print(f"{what} on {int(valid.sum())} real tokens, {name} vs {args.baseline}:")
    print(f"  rel-RMS {rel:.3e}   max |diff| {(mx - ref).abs().max().item():.3e}   "
          f"(max |{args.baseline}| {ref.abs().max().item():.3e})")
    if what == "logits":
        top1 = (mx.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"  top-1 agreement of next-token logits: {100 * top1:.2f}%")
    else:
        print("  top-1: n/a (no LM head)")


if __name__ == "__main__":
    main()
