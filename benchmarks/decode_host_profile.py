"""Host time of greedy decode by Python function: transformers' generate of a models_bench.py model (random
weights, bf16) with SDPA and with mxattn's attention over transformers' cache, each under cProfile after a
warm-up whose KV lengths the profiled call does not reuse. Prints per attention the wall time per decode step,
the attention function's cumulative host time per call and the functions with the most own time.
Usage (CUDA machine): python benchmarks/decode_host_profile.py [--model gpt2|llama] [--batch N] [--tokens N]"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_bench as mb  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=("gpt2", "llama"), help="models_bench.py's model")
    ap.add_argument("--batch", type=int, default=8, help="prompts per generate call (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens of the profiled call (default 64)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    args = ap.parse_args()
    import mxattn.integrations.transformers as mx_hf
    mx_hf.register(mb.NAME, backend="triton")
    factory = mb.llama_config if args.model == "llama" else mb.gpt2_config
    g = torch.Generator(device="cuda").manual_seed(1)
    for attn, fn_name in (("sdpa", "sdpa_attention_forward"), (mb.NAME, "mxfp8_attention_forward")):
        name, model, _, vocab = mb.build(factory, attn, False)
        model = model.to(torch.bfloat16).eval()
        ids = torch.randint(0, vocab, (args.batch, args.prompt), device="cuda", generator=g)
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)       # warm-up: other lengths
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t0
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prof.enable()
            model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kw)
            prof.disable()
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
        stats = pstats.Stats(prof)
        calls = [(v[0], v[3]) for k, v in stats.stats.items() if k[2] == fn_name]
        n_calls, cum = calls[0] if calls else (0, 0.0)
        print(f"## {name}, {attn}: batch {args.batch}, prompt {args.prompt}, {args.tokens} tokens (under cProfile)")
        print(f"decode step {(total - prefill) / (args.tokens - 1) * 1e3:.2f} ms; attention function "
              f"{fn_name}: {n_calls} calls, {cum / max(n_calls, 1) * 1e6:.0f} us per call")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print("\n".join(out.getvalue().splitlines()[6:]))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
