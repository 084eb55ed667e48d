"""What a compiled transformers GPT-2 training step runs in Python with mxattn's attention against SDPA's, on a CPU
(no GPU): `compiled_step_profile.training_step` (models_bench.py's GPT-2 as it builds it off CUDA: 2 layers,
n_embd 128, 4 heads, B2 S64; AdamW), torch.compile(model), the triton backend with its launches stubbed
(`cpu_host_harness.install_stubs`), SDPA on the CPU. Per attention: Python function calls per step (cProfile) and
the functions with the most own time, so a difference in the compiled graph around the ops (guards, AOT wrappers,
extra graph pieces) would show beside mxattn's own calls.
Compute time on the CPU is not a GPU host's: read the call counts and the mxattn/torch split, not the times.
Usage: python benchmarks/cpu_compiled_step_calls.py [--top N]"""
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cpu_host_harness  # noqa: E402
import models_bench as mb  # noqa: E402
from compiled_step_profile import training_step  # noqa: E402

STEPS = 20


def main() -> None:
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 15
    cpu_host_harness.install_stubs({})
    mb.DEVICE = "cpu"
    mb.mx_hf.register(mb.NAME, backend="triton")
    for attn in ("sdpa", mb.NAME):
        step = training_step(attn, compiled=True)
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
