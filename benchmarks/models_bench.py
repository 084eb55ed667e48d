"""Whole-model benchmark: transformers models built from configs (random weights), torch SDPA against mxattn's
MXFP8 attention through the project's own HF registration, same seed, same run.

Measured per model (ratios mxfp8 / sdpa in the same run):
  * training step time (bf16 autocast, AdamW), eager and under torch.compile(model), both models timed in
    alternating rounds (the shared host's slow phases fall on both; ratio = median of the per-round ratios);
  * inference: prefill of --prompt tokens + --new-tokens greedy decode steps, batch 1 and 8, with transformers'
    KV cache and (mxattn) with MXFP8PagedCache, timed in alternating rounds: tokens/s of the decode phase (and
    the prefill time);
and, for the op itself, a tiny call (B1 S128 H8 D64, bshd, bf16): wall time per call in a loop (forward
without grad, forward+backward) and the host (CPU thread) time of one public-API forward at B2 H16 S4096 D128.

With --hf-extras (or only those with --hf-extras-only), the Hugging Face extras on a Llama: batched greedy generation
of 8 left-padded prompts of 256-1024 tokens, --new-tokens new ones, tokens/s against SDPA's; and training
tokens/s of the same documents padded (right padding) and padding-free (cu_seq_lens kwargs), for each attention.

Usage (CUDA machine with transformers): python benchmarks/models_bench.py [--quick] [--backend triton] [--hf-extras]
Writes benchmarks/results/<gpu>/models.json and models.md (or --out-dir). Smoke run of the script on a CPU (tiny
models and lengths, no figures): --device cpu --backend reference [--hf-extras-only] --out-dir DIR.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mxattn  # noqa: E402
import mxattn.integrations.transformers as mx_hf  # noqa: E402
from mxattn.bench import gpu_dir_name  # noqa: E402

NAME = "mxfp8"


def gpt2_config(quick: bool):
    from transformers import GPT2Config, GPT2LMHeadModel
    if DEVICE != "cuda":                    # smoke run of the script: a tiny model
        cfg = GPT2Config(vocab_size=512, n_positions=256, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
        return "gpt2_tiny", cfg, GPT2LMHeadModel, dict(batch=16, seq=512)
    cfg = GPT2Config(vocab_size=8192, n_positions=2048, n_embd=512, n_layer=4, n_head=8, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return "gpt2_l4_e512_h8", cfg, GPT2LMHeadModel, dict(batch=16, seq=512)


def llama_config(quick: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    if DEVICE != "cuda":                    # smoke run of the script: a tiny model
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return "llama_tiny", cfg, LlamaForCausalLM, dict(batch=8, seq=1024)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4 if quick else 8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    return "llama_gqa_h1024_l%d_16q4kv" % cfg.num_hidden_layers, cfg, LlamaForCausalLM, dict(batch=8, seq=1024)


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build(factory, attn: str, quick: bool, seed: int = 0):
    name, cfg, cls, shape = factory(quick)
    if DEVICE != "cuda":                    # smoke run of the script: small shapes
        shape = dict(batch=2, seq=64)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).to(DEVICE)
    return name, model, shape, cfg.vocab_size


def median_time(fn, warmup: int, iters: int, clock=time.perf_counter, sync_timed: bool = True,
                unit: float = 1e3) -> float:
    """Median of clock() around fn() over iters runs after warmup, times unit (ms by default). sync_timed: the
    device synchronisation is inside the timed span (wall time of the work); else after it (host time)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = clock()
        fn()
        if sync_timed:
            sync()
        times.append((clock() - t0) * unit)
        if not sync_timed:
            sync()
    return statistics.median(times)


def releases_memory(fn):
    """fn, then free what it held (its model, optimizer, compiled graphs) before the next measurement."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    return wrapper


def cuda_time(fn, warmup: int, iters: int) -> float:
    """Median ms of fn() over iters timed runs (each synchronised) after warmup."""
    return median_time(fn, warmup, iters)


@releases_memory
def train_pair(factory, compiled: bool, quick: bool, rounds: int = 9) -> dict:
    """Training step time of the model with SDPA and with mxattn, both built (same seed, same batch) and then
    timed in alternating rounds (ABBA order; `cuda_time` each round), so the shared host's slow phases fall on
    both: median ms per attention over the rounds and the median of the per-round ratios (9 rounds of 20 steps:
    with 5 of 10 the same tree's compiled GPT-2 ratio moved 1.15-1.37 between calls)."""
    steps, losses, first_s = {}, {}, {}
    for attn in ("sdpa", NAME):
        name, model, shape, vocab = build(factory, attn, quick)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")
        run = torch.compile(model) if compiled else model
        g = torch.Generator(device=DEVICE).manual_seed(0)
        ids = torch.randint(0, vocab, (shape["batch"], shape["seq"]), device=DEVICE, generator=g)
        losses[attn] = []

        def step(run=run, opt=opt, ids=ids, out=losses[attn]):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.detach())

        t0 = time.perf_counter()
        step()
        sync()
        first_s[attn] = time.perf_counter() - t0
        steps[attn] = step
    per_round = {a: [] for a in steps}
    iters = 4 if quick else 20
    for r in range(2 if quick else rounds):
        for attn in (("sdpa", NAME) if r % 2 == 0 else (NAME, "sdpa")):
            per_round[attn].append(cuda_time(steps[attn], warmup=2, iters=iters))
    torch._dynamo.reset()
    ratios = [m / s for m, s in zip(per_round[NAME], per_round["sdpa"])]
    return dict(model=name, batch=shape["batch"], seq=shape["seq"], mode="compiled" if compiled else "eager",
                sdpa_ms=statistics.median(per_round["sdpa"]), mxfp8_ms=statistics.median(per_round[NAME]),
                ratio=statistics.median(ratios), rounds_sdpa_ms=per_round["sdpa"], rounds_mxfp8_ms=per_round[NAME],
                first_step_s_sdpa=first_s["sdpa"], first_step_s_mxfp8=first_s[NAME],
                loss_sdpa=float(losses["sdpa"][-1]), loss_mxfp8=float(losses[NAME][-1]))


PAGED = NAME + " + MXFP8PagedCache"


@releases_memory
@torch.no_grad()
def generate_pair(factory, batch: int, prompt: int, new_tokens: int, quick: bool) -> dict:
    """Greedy generation of `batch` prompts of `prompt` tokens with SDPA, with mxattn over transformers' bf16
    cache and with mxattn over `MXFP8PagedCache` (its pages read by the paged kernel), timed in alternating
    rounds (rotating order): per attention the median over the rounds of the prefill time (a generate call of
    one token) and of the decode tokens/s (batch * (new_tokens - 1) tokens over a full call's time minus that
    round's prefill), and the median of the per-round ratios to SDPA. The first round meets every KV length for
    the first time in the process (torch SDPA's cuDNN path then builds a graph per length, mxattn compiles a
    Triton specialization or two): it is reported apart (`first_round_tok_s`) and left out of the medians."""
    from mxattn.integrations.hf_cache import MXFP8PagedCache, cache_kwargs
    models = {}
    for attn in ("sdpa", NAME):
        name, model, _, vocab = build(factory, attn, quick)
        models[attn] = model.to(torch.bfloat16).eval()
    g = torch.Generator(device=DEVICE).manual_seed(1)
    ids = torch.randint(0, vocab, (batch, prompt), device=DEVICE, generator=g)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    runs = {"sdpa": (models["sdpa"], dict), NAME: (models[NAME], dict),
            PAGED: (models[NAME], lambda: cache_kwargs(MXFP8PagedCache(prompt + new_tokens, page_size=64)))}

    def generate(attn: str, n: int):
        model, cache = runs[attn]
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw, **cache())
        sync()
        return time.perf_counter() - t0, out

    # a short warm-up on purpose: the timed steps meet KV lengths no earlier call had, as in serving, so they run
    # the unplanned host path (a warm-up over the same lengths would let them replay launch plans recorded then,
    # the best case, as in compiled_step_profile.py --decode)
    for attn in runs:
        generate(attn, 4)
    prefill, tok_s, tokens = ({a: [] for a in runs} for _ in range(3))
    names = list(runs)
    first_round = {}
    for r in range(3 if quick else 5):
        for attn in names[r % 3:] + names[:r % 3]:
            first, _ = generate(attn, 1)
            total, out = generate(attn, new_tokens)
            rate = batch * (new_tokens - 1) / max(total - first, 1e-9)
            if r == 0:
                first_round[attn] = rate
                continue
            prefill[attn].append(first * 1e3)
            tok_s[attn].append(rate)
            tokens[attn] = out[:, prompt:].tolist()
    med = statistics.median
    return dict(model=name, batch=batch, prompt=prompt, new_tokens=new_tokens,
                prefill_ms={a: med(v) for a, v in prefill.items()}, tok_s={a: med(v) for a, v in tok_s.items()},
                ratio={a: med([x / y for x, y in zip(v, tok_s["sdpa"])]) for a, v in tok_s.items()},
                rounds_tok_s=tok_s, first_round_tok_s=first_round,
                same_tokens={a: sum(x == y for p, q in zip(tokens["sdpa"], t) for x, y in zip(p, q))
                             / (batch * new_tokens) for a, t in tokens.items()})


def _documents(vocab: int, lengths, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).to(DEVICE) for n in lengths]


@releases_memory
@torch.no_grad()
def left_padded_generate(factory, attn: str, lengths, new_tokens: int, quick: bool) -> dict:
    """Batched greedy generation of prompts of different lengths, left-padded (HF's side for decoders)."""
    name, model, _, vocab = build(factory, attn, quick)
    model = model.to(torch.bfloat16).eval()
    prompts = _documents(vocab, lengths, seed=3)
    s = max(lengths)
    ids = torch.stack([torch.cat([p.new_zeros(s - len(p)), p]) for p in prompts])
    am = (torch.arange(s, device=DEVICE).unsqueeze(0) >= (s - torch.tensor(lengths, device=DEVICE)).unsqueeze(1))
    kw = dict(attention_mask=am.long(), do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)   # short warm-up: new KV lengths when timed
    runs = []
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sync()
        runs.append(time.perf_counter() - t0)
    return dict(model=name, attn=attn, tokens_per_s=len(lengths) * new_tokens / statistics.median(runs),
                tokens=out[:, s:].tolist())


@releases_memory
def padding_free_training(factory, attn: str, lengths, quick: bool) -> dict:
    """Training tokens/s on the same documents, padded (one row each, right padding) and padding-free (one row of
    concatenated documents with restarting position ids and the cu_seq_lens kwargs, as
    DataCollatorWithFlattening makes it)."""
    name, model, _, vocab = build(factory, attn, quick)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE == "cuda")
    docs = _documents(vocab, lengths, seed=4)
    s, n_tok = max(lengths), sum(lengths)
    padded = torch.stack([torch.cat([d, d.new_zeros(s - len(d))]) for d in docs])
    am = (torch.arange(s, device=DEVICE).unsqueeze(0) < torch.tensor(lengths, device=DEVICE).unsqueeze(1)).long()
    labels = padded.masked_fill(am == 0, -100)
    flat = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d), device=DEVICE) for d in docs]).unsqueeze(0)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    flat_labels = torch.cat([torch.cat([d[:1].new_full((1,), -100), d[1:]]) for d in docs]).unsqueeze(0)
    out = {}
    for kind, batch in (("padded", dict(input_ids=padded, attention_mask=am, labels=labels)),
                        ("padding_free", dict(input_ids=flat, position_ids=pos, labels=flat_labels,
                                              cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=s,
                                              max_length_k=s))):
        def step():
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model(**batch, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[kind] = n_tok / (cuda_time(step, warmup=2, iters=4 if quick else 10) / 1e3)
    return dict(model=name, attn=attn, **out)


def tiny_call_figures(backend: str) -> dict:
    """Wall time per call of a tiny attention call (host-bound) and host time of a large forward."""
    import torch.nn.functional as F
    g = torch.Generator(device=DEVICE).manual_seed(2)
    q, k, v = (torch.randn(1, 128, 8, 64, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def per_call_us(fn, n=300):
        for _ in range(30):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n * 1e6

    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    mx = lambda a, b, c: mxattn.mxfp8_attention(a, b, c, qkv_format="bhsd", attn_mask_type="causal",  # noqa: E731
                                                backend=backend)
    out = {}
    with torch.no_grad():
        out["tiny_fwd_us"] = {"sdpa": per_call_us(lambda: sdpa(qt, kt, vt)), "mxfp8": per_call_us(lambda: mx(qt, kt, vt))}
    qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))
    do = torch.randn_like(qt)
    out["tiny_fwd_bwd_us"] = {name: per_call_us(lambda f=f: f(qg, kg, vg).backward(do))
                              for name, f in (("sdpa", sdpa), ("mxfp8", mx))}
    # host (CPU thread) time of one public-API forward at B2 H16 S4096 D128 (no grad), kernels in flight
    big = [torch.randn(2, 4096, 16, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3)]
    bigt = [t.transpose(1, 2) for t in big]

    def host_us(fn, n=30):
        return median_time(fn, 5, n, clock=time.thread_time, sync_timed=False, unit=1e6)

    with torch.no_grad():
        out["host_fwd_b2_h16_s4096_us"] = {
            "sdpa": host_us(lambda: F.scaled_dot_product_attention(*bigt)),
            "mxfp8": host_us(lambda: mxattn.mxfp8_attention(*big, backend=backend))}
    for entry in out.values():
        entry["ratio"] = entry["mxfp8"] / entry["sdpa"]
    return out


def markdown(res: dict) -> str:
    lines = [f"# Whole-model benchmark ({res['device']})", "",
             f"torch {res['torch']}, transformers {res['transformers']}, mxattn backend `{res['backend']}`; "
             "random-weight models built from configs, same seed; ratio = mxfp8 / sdpa (time) or mxfp8 / sdpa "
             "(tokens/s), measured in the same run by `python benchmarks/models_bench.py`."]
    if res["train"]:
        lines += ["", "## Training step (bf16 autocast, fused AdamW), median ms over alternating rounds (`train_pair`)", "",
                  "| model | B x S | mode | sdpa ms | mxfp8 ms | ratio (target <= 1.15) | final loss sdpa / mxfp8 |",
                  "|---|---|---|---|---|---|---|"]
    for row in res["train"]:
        lines.append(f"| {row['model']} | {row['batch']} x {row['seq']} | {row['mode']} | {row['sdpa_ms']:.2f} | "
                     f"{row['mxfp8_ms']:.2f} | {row['ratio']:.2f} | {row['loss_sdpa']:.4f} / {row['loss_mxfp8']:.4f} |")
    if res["generate"]:
        lines += ["", "## Inference: prefill + greedy decode (bf16 weights), medians over alternating rounds "
                  "(`generate_pair`)", "",
                  "mxfp8: mxattn's attention over transformers' bf16 cache (every step quantizes the cached K/V); "
                  "paged: mxattn's attention over `MXFP8PagedCache` (the paged kernel reads the FP8 pages). Prefill: "
                  "a generate call of one token. Medians over rounds after the first, which meets every KV length for "
                  "the first time in the process (its tokens/s in the JSON, `first_round_tok_s`).", "",
                  "| model | batch | prompt + new | prefill ms sdpa / mxfp8 / paged | decode tok/s sdpa | mxfp8 | "
                  "ratio (target >= 0.9) | paged | ratio | greedy tokens equal to sdpa's: mxfp8 / paged |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["generate"]:
        p, t, r, same = row["prefill_ms"], row["tok_s"], row["ratio"], row["same_tokens"]
        lines.append(f"| {row['model']} | {row['batch']} | {row['prompt']} + {row['new_tokens']} | "
                     f"{p['sdpa']:.1f} / {p[NAME]:.1f} / {p[PAGED]:.1f} | {t['sdpa']:.0f} | {t[NAME]:.0f} | "
                     f"{r[NAME]:.2f} | {t[PAGED]:.0f} | {r[PAGED]:.2f} | {same[NAME]:.0%} / {same[PAGED]:.0%} |")
    if res["calls"]:
        lines += ["", "## One attention call", "", "| measurement | sdpa us | mxfp8 us | ratio (target <= 1.5) |",
                  "|---|---|---|---|"]
    for key, entry in res["calls"].items():
        lines.append(f"| {key} | {entry['sdpa']:.1f} | {entry['mxfp8']:.1f} | {entry['ratio']:.2f} |")
    if res.get("left_padded_generate"):
        g = res["left_padded_generate"]
        lines += ["", "## Batched generation with left padding (bf16 weights)", "",
                  f"{g['model']}, batch {len(g['prompts'])}, prompts {g['prompts']}, {g['new_tokens']} new tokens "
                  f"(prefill included): sdpa {g['tok_s_sdpa']:.0f} tok/s, mxfp8 {g['tok_s_mxfp8']:.0f} tok/s, ratio "
                  f"{g['ratio']:.2f} (target >= 0.9); greedy tokens equal to sdpa's: {g['same_tokens']:.0%}"]
    if res.get("padding_free"):
        lines += ["", "## Padding-free vs padded training, same documents (training tokens/s)", "",
                  "| attention | padded | padding-free | padding-free / padded (target >= 1) |", "|---|---|---|---|"]
        lines += [f"| {r['attn']} | {r['padded']:.0f} | {r['padding_free']:.0f} | {r['ratio_free_to_padded']:.2f} |"
                  for r in res["padding_free"]]
    if res.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="triton", help="mxattn backend of the HF registration (default triton)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and a 4-layer Llama (a smoke run)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile training steps")
    ap.add_argument("--train-only", action="store_true",
                    help="only the training rows (no generation rows, no single-call rows)")
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens (default 512)")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy decode steps (default 128)")
    ap.add_argument("--models", default="gpt2,llama", help="comma-separated subset of gpt2,llama")
    ap.add_argument("--generate-only", action="store_true", help="only the inference rows (no training steps)")
    ap.add_argument("--calls-only", action="store_true",
                    help="only the one-call figures (tiny call wall time, host time of a large forward)")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results/<gpu-name>/")
    ap.add_argument("--hf-extras", action="store_true",
                    help="also left-padded batch-8 generation (prompts 256-1024) and padding-free vs padded "
                         "training tokens/s of the same documents (Llama)")
    ap.add_argument("--hf-extras-only", action="store_true",
                    help="only the --hf-extras rows (no training, generation or call rows)")
    ap.add_argument("--device", default="cuda",
                    help="cuda (the figures), or cpu for a smoke run of the script (tiny models and shapes)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("models_bench needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    import transformers
    warnings.filterwarnings("ignore")
    mx_hf.register(NAME, backend=args.backend)
    factories = {"gpt2": gpt2_config, "llama": llama_config}
    chosen = [] if args.hf_extras_only or args.calls_only else [factories[m] for m in args.models.split(",")]
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    res = dict(device=device, torch=torch.__version__, transformers=transformers.__version__,
               backend=args.backend, train=[], generate=[], calls={})
    res["calls"] = tiny_call_figures(args.backend) if DEVICE == "cuda" and not (args.hf_extras_only or
                                                                                  args.train_only or
                                                                                  args.generate_only) else {}
    print(json.dumps(res["calls"], indent=1), flush=True)
    for factory in chosen:
        for compiled in (() if args.generate_only else (False,) if args.no_compile else (False, True)):
            try:
                row = train_pair(factory, compiled, args.quick)
            except Exception as exc:  # a failure is a result too: recorded, and the other rows still run
                res.setdefault("errors", []).append(f"train {factory.__name__} compiled={compiled}: "
                                                    f"{type(exc).__name__}: {str(exc)[:800]}")
                print(res["errors"][-1], flush=True)
                torch._dynamo.reset()
                continue
            res["train"].append(row)
            print(row, flush=True)
        for batch in (() if args.train_only else (1, 8)):
            row = generate_pair(factory, batch, args.prompt, args.new_tokens, args.quick)
            res["generate"].append(row)
            print(row, flush=True)
    if args.hf_extras or args.hf_extras_only:
        g = torch.Generator().manual_seed(5)
        gen_lengths = torch.randint(256, 1025, (8,), generator=g).tolist() if DEVICE == "cuda" else [9, 16, 5]
        doc_lengths = torch.randint(128, 1025, (16,), generator=g).tolist() if DEVICE == "cuda" else [9, 16, 5]
        factory = llama_config
        r = {a: left_padded_generate(factory, a, gen_lengths, args.new_tokens, args.quick) for a in ("sdpa", NAME)}
        same = sum(x == y for a, b in zip(r["sdpa"]["tokens"], r[NAME]["tokens"]) for x, y in zip(a, b))
        res["left_padded_generate"] = dict(model=r["sdpa"]["model"], prompts=gen_lengths,
                                           new_tokens=args.new_tokens, tok_s_sdpa=r["sdpa"]["tokens_per_s"],
                                           tok_s_mxfp8=r[NAME]["tokens_per_s"],
                                           ratio=r[NAME]["tokens_per_s"] / r["sdpa"]["tokens_per_s"],
                                           same_tokens=same / (len(gen_lengths) * args.new_tokens))
        print(res["left_padded_generate"], flush=True)
        res["padding_free"] = [padding_free_training(factory, a, doc_lengths, args.quick) for a in ("sdpa", NAME)]
        for row in res["padding_free"]:
            row["documents"] = doc_lengths
            row["ratio_free_to_padded"] = row["padding_free"] / row["padded"]
            print(row, flush=True)
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                           gpu_dir_name(device))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out_dir, "models.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
