"""cProfile (host time by Python function) of compiled training steps of the models_bench.py GPT-2 with
mxattn's attention: what the custom ops' calls cost on the host. Usage: python benchmarks/compiled_step_cprofile.py"""
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_bench as mb  # noqa: E402

mb.mx_hf.register(mb.NAME, backend="triton")
name, model, shape, vocab = mb.build(mb.gpt2_config, mb.NAME, False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
run = torch.compile(model)
ids = torch.randint(0, vocab, (shape["batch"], shape["seq"]), device="cuda")


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(8):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    step()
torch.cuda.synchronize()
prof.disable()
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats("mxattn|_library|custom_ops", 40)
