"""Where a compiled training step's time goes: transformers' GPT-2 (the models_bench.py config) under
torch.compile with SDPA and with mxattn's attention; per step the wall time, the GPU kernel time (sum over
kernels, torch.profiler) and the top operators by GPU time and by host time; --cprofile: instead, cProfile (host
time by Python function) of mxattn's compiled steps. --decode: the same for greedy decode steps of the bf16
model with the KV cache (batch --batch, default 1; a "step" is one generate call: a 512-token prefill and
--tokens greedy tokens, default 16; --paged: mxattn's run over MXFP8PagedCache, a new cache per call). Its warm-up generates the same tokens, so the timed decode steps meet KV
lengths seen before and replay launch plans: the best case (models_bench.py times first-seen lengths).
--llama: decode with models_bench.py's Llama (GQA 16:4, hidden 1024, 8 layers) instead of the GPT-2.
Usage (CUDA machine): python benchmarks/compiled_step_profile.py [--eager | --decode [--batch N] [--tokens N] [--paged]
[--llama]] [--cprofile]"""
import os
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_bench as mb  # noqa: E402
from profiling import cprofile_steps, wall_per_call  # noqa: E402


def training_step(attn: str, compiled: bool):
    """A training step function of the GPT-2 with attention `attn` (compiled or eager), on models_bench's device
    (`mb.DEVICE`: its tiny GPT-2 at small shapes off CUDA)."""
    name, model, shape, vocab = mb.build(mb.gpt2_config, attn, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    run = torch.compile(model) if compiled else model
    ids = torch.randint(0, vocab, (shape["batch"], shape["seq"]), device=mb.DEVICE)

    def step():
        with torch.autocast(mb.DEVICE, dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(8):
        step()
    mb.sync()
    return step


def decode_step(attn: str, batch: int, tokens: int = 16, paged: bool = False, factory=None):
    """A function that prefills 512 tokens and generates `tokens` greedy ones with the GPT-2 (or models_bench's
    model `factory`) in bf16 and its KV cache (paged: an MXFP8PagedCache, for mxattn's attention)."""
    from mxattn.integrations.hf_cache import MXFP8PagedCache, cache_kwargs
    name, model, _, vocab = mb.build(factory or mb.gpt2_config, attn, False)
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, vocab, (batch, 512), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None,
              max_new_tokens=tokens + 1, min_new_tokens=tokens + 1)

    @torch.no_grad()
    def generate():
        cache = cache_kwargs(MXFP8PagedCache(512 + tokens + 1, page_size=64)) if paged else {}
        model.generate(ids, **kw, **cache)        # the prefill (and its token) and `tokens` decode steps

    for _ in range(2):
        generate()
    torch.cuda.synchronize()
    return generate


def gpu_ms_per_step(events, steps: int) -> float:
    """The GPU's busy time per step in ms from a profile's `key_averages()`: the GPU's own rows only (kernels,
    copies, fills; us each), since an operator's CPU row carries its kernels' time as well."""
    return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / steps / 1e3


def main():
    compiled = "--eager" not in sys.argv
    decode = "--decode" in sys.argv
    batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 1
    tokens = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 16
    factory = mb.llama_config if "--llama" in sys.argv else mb.gpt2_config
    mb.mx_hf.register(mb.NAME, backend="triton")

    def make(attn):
        return decode_step(attn, batch, tokens, "--paged" in sys.argv and attn != "sdpa", factory) if decode \
            else training_step(attn, compiled)

    if "--cprofile" in sys.argv:
        cprofile_steps(make(mb.NAME), 20, 30, "mxattn|_library|custom_ops")
        return
    mode = (f"decode batch {batch} (per prefill + {tokens} tokens){' paged' * ('--paged' in sys.argv)}" if decode
            else ("compiled" if compiled else "eager"))
    for attn in ("sdpa", mb.NAME):
        step = make(attn)
        wall = wall_per_call(step, 10, unit=1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = gpu_ms_per_step(events, 5)
        print(f"\n=== {attn} {mode}: wall {wall:.2f} ms/step, GPU kernels {gpu:.2f} ms/step")
        print(events.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
