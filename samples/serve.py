"""Serve a batch of prompts of different lengths with a Hugging Face decoder on MXFP8 attention, its KV cache
in MXFP8 (`mxattn.integrations.hf_cache.MXFP8Cache`, and the paged `MXFP8PagedCache` whose FP8 pages the attention
reads directly) against transformers' bf16 `DynamicCache`.

    python samples/serve.py                          # a random-weight Llama (GQA) from a config, CPU or GPU
    python samples/serve.py --model PATH             # a local checkpoint with its tokenizer
    python samples/serve.py --prompts 16 --new-tokens 64 --device cuda

Prompts are left-padded into one batch (transformers' batched generation); each cache serves the same batch with
greedy decoding. Printed per cache: generated tokens/s (prefill included, median of --repeats runs) and the
bytes the cache holds after the last step, then the MXFP8 cache's share of the bf16 cache's bytes (about 0.53x:
E4M3 bytes plus one E8M0 scale per 32 values, the open V block of 32 tokens in the model's dtype) and how many
prompts got the same tokens from both caches. With unpadded or right-padded batches the MXFP8 cache changes
nothing under mxattn's attention (bit for bit); with left padding a row's V blocks start at its first, padded,
position, so a prompt's values share block scales with padding rows there and its tokens may differ after a
near-tie (the module docstring of mxattn.integrations.hf_cache says why). The paged cache stores each prompt's
real tokens only (its V blocks start at the prompt's first token, as in an unpadded call); its bytes are its
pages, allocated for the padded prompt plus the new tokens of every row (--page-size tokens per page), and its
open V blocks (32 tokens per row and KV head in the model's dtype); printed against bf16 pages of the same capacity
too.
"""

import argparse
import statistics
import time
import warnings

import torch

import mxattn.integrations.transformers as mx_hf
from mxattn.integrations.hf_cache import MXFP8Cache, MXFP8PagedCache, cache_kwargs


def _dynamic_cache_bytes(cache) -> int:
    """Bytes of a transformers DynamicCache's keys and values."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def _model_and_batch(args, name):
    """(model, batch dict of left-padded input_ids and attention_mask, prompt lengths, pad id)."""
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        tok.pad_token = tok.pad_token or tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=name, dtype=args.dtype)
        texts = [f"Request {i}: " + "tell me about attention kernels " * (1 + 3 * i) for i in range(args.prompts)]
        batch = tok(texts, return_tensors="pt", padding=True)
        return model.to(args.device).eval(), batch.to(args.device), batch["attention_mask"].sum(1).tolist(), \
            tok.pad_token_id
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    cfg._attn_implementation = name
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(args.device, args.dtype).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.prompts,), generator=g).tolist()
    s = max(lengths)
    ids = torch.zeros(args.prompts, s, dtype=torch.long)
    mask = torch.zeros(args.prompts, s, dtype=torch.long)
    for i, n in enumerate(lengths):                                      # left padding
        ids[i, s - n:] = torch.randint(5, cfg.vocab_size, (n,), generator=g)
        mask[i, s - n:] = 1
    return model, dict(input_ids=ids.to(args.device), attention_mask=mask.to(args.device)), lengths, 0


def _serve(model, batch, make_cache, args, pad_id):
    """(new tokens [B, n], tokens/s median over the repeats, bytes of the last run's cache)."""
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad_id)
    times = []
    with torch.no_grad():
        model.generate(**batch, **cache_kwargs(make_cache()), **dict(kw, max_new_tokens=2, min_new_tokens=2))
        for _ in range(args.repeats):
            cache = make_cache()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(**batch, **cache_kwargs(cache), **kw)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    tokens = out[:, batch["input_ids"].shape[1]:]
    size = cache.nbytes() if isinstance(cache, (MXFP8Cache, MXFP8PagedCache)) else _dynamic_cache_bytes(cache)
    if isinstance(cache, MXFP8PagedCache):
        print(f"MXFP8PagedCache: {cache.nbytes() / cache.bf16_nbytes():.3f}x the bytes of bf16 pages of the same "
              f"capacity")
    return tokens, tokens.numel() / statistics.median(times), size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local checkpoint (AutoModelForCausalLM + AutoTokenizer); default: a "
                                    "random-weight Llama built from a config")
    ap.add_argument("--prompts", type=int, default=4, help="prompts in the batch (default 4)")
    ap.add_argument("--min-prompt", type=int, default=20, help="shortest random prompt, tokens (default 20)")
    ap.add_argument("--max-prompt", type=int, default=90, help="longest random prompt, tokens (default 90)")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per cache, median (default 2)")
    ap.add_argument("--page-size", type=int, default=32, help="MXFP8PagedCache tokens per page (default 32)")
    ap.add_argument("--backend", default="auto", help="mxattn backend: auto, cudnn, triton or reference")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model dtype")
    args = ap.parse_args()
    for flag in ("prompts", "min_prompt", "new_tokens", "repeats", "page_size"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_prompt < args.min_prompt:
        ap.error("--max-prompt must be at least --min-prompt")
    args.dtype = getattr(torch, args.dtype)
    warnings.filterwarnings("ignore", message="mxattn: backend='auto'")
    from transformers import DynamicCache
    name = mx_hf.register("mxfp8", backend=args.backend)
    model, batch, lengths, pad_id = _model_and_batch(args, name)
    print(f"serving {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens (left-padded), "
          f"{args.new_tokens} new tokens each, {args.dtype} on {args.device}, attention mxfp8 ({args.backend})")
    results = {}
    positions = batch["input_ids"].shape[1] + args.new_tokens
    for label, make in (("bf16 DynamicCache" if args.dtype == torch.bfloat16 else "DynamicCache",
                         lambda: DynamicCache(config=model.config)), ("MXFP8Cache", MXFP8Cache),
                        ("MXFP8PagedCache", lambda: MXFP8PagedCache(positions, page_size=args.page_size))):
        results[label] = _serve(model, batch, make, args, pad_id)
        _, tok_s, size = results[label]
        print(f"{label:18s} {tok_s:9.1f} tokens/s   cache {size / 2**20:8.3f} MiB")
    ref_label, (ref_tokens, _, ref_bytes) = next(iter(results.items()))
    for label in ("MXFP8Cache", "MXFP8PagedCache"):
        mx_tokens, _, mx_bytes = results[label]
        same = sum(int(torch.equal(a, b)) for a, b in zip(ref_tokens, mx_tokens))
        print(f"{label} bytes / {ref_label} bytes: {mx_bytes / ref_bytes:.3f}; {same} of {len(lengths)} prompts "
              f"got the same tokens as with the {ref_label}")


if __name__ == "__main__":
    main()
