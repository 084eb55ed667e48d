"""What a compiled transformers GPT-2 training step runs in Python with mxattn's attention against SDPA's, on a CPU
(no GPU): the models_bench.py GPT-2's structure (4 layers, n_embd 512, 8 heads) at B2 S64, torch.compile(model),
the triton backend with its launches stubbed (`cpu_host_harness.install_stubs`), SDPA on the CPU. Per attention:
Python function calls per step (cProfile) and the functions with the most own time, so a difference in the
compiled graph around the ops (guards, AOT wrappers, extra graph pieces) would show beside mxattn's own calls.
Compute time on the CPU is not a GPU host's: read the call counts and the mxattn/torch split, not the times.
Usage: python benchmarks/cpu_compiled_step_calls.py [--top N]"""
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import cpu_host_harness  # noqa: E402

STEPS = 20


def training_step(attn: str):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=512, n_positions=256, n_embd=512, n_layer=4, n_head=8, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    run = torch.compile(model)
    ids = torch.randint(0, 512, (2, 64))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    return step


def main() -> None:
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 15
    cpu_host_harness.install_stubs({})
    import mxattn.integrations.transformers as mx_hf
    mx_hf.register("mxfp8", backend="triton")
    for attn in ("sdpa", "mxfp8"):
        step = training_step(attn)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(STEPS):
            step()
        prof.disable()
        stats = pstats.Stats(prof, stream=io.StringIO())
        mine = sum(v[1] for k, v in stats.stats.items() if "mxattn" in k[0])
        print(f"=== {attn}: {stats.total_calls / STEPS:.0f} Python calls per step, {mine / STEPS:.0f} of them in "
              f"mxattn's files")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
