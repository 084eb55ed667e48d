"""Where the compiled (or eager) GPT-2 training step's extra time over SDPA goes, by ablation on a CUDA machine:
models_bench.py's GPT-2 trained with four attention functions, in alternating rounds in one process:

* sdpa: transformers' SDPA (cuDNN BF16);
* mxfp8: mxattn's attention through its HF registration (backend triton), as users run it;
* mxfp8 host only: the same, every replayed Triton launch skipped (the host path, the allocations and the
  graph around the ops unchanged; the attention kernels do not run, so its losses are meaningless);
* null: an attention function that returns query + key + value (no attention at all; the same projections,
  gradients flowing to Q, K and V): the floor of the rest of the step.

Then mxfp8 - host only is what the attention kernels add to the wall time (zero where the step is host-bound),
host only - null what mxattn's host path and its ops add, sdpa - null what SDPA's attention costs.
Wall ms per step: per arm the median over rounds of 10 back-to-back steps, the device synchronised at the ends.
Usage (CUDA machine): python benchmarks/compiled_step_ablation.py [--eager] [--rounds N]"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_bench as mb  # noqa: E402
from compiled_step_profile import training_step  # noqa: E402
from profiling import wall_per_call  # noqa: E402

from mxattn.kernels import triton_launch  # noqa: E402

#: while True, replayed launches are skipped (`skip_replayed_launches`)
SKIP = [False]
NULL = "mxattn_ablation_null"


def skip_replayed_launches() -> None:
    """Wrap Triton's launchers as launch-plan replays bind them (`launch_plan._compile_issue` asks for them when a
    plan first replays), so that each launch is skipped while SKIP[0] is set. Call before any step runs."""
    direct, run = triton_launch.direct_launcher, triton_launch.run_compiled

    def direct_launcher(entry):
        found = direct(entry)
        if found is None:
            return None
        launch, between = found
        return (lambda *args: None if SKIP[0] else launch(*args)), between

    def run_compiled(entry, grid, stream, args):
        if not SKIP[0]:
            run(entry, grid, stream, args)

    triton_launch.direct_launcher, triton_launch.run_compiled = direct_launcher, run_compiled


def register_null() -> None:
    """An HF attention function without attention (`NULL`): query + key + value in transformers' output layout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def null_attention(module, query, key, value, attention_mask, **kwargs):
        return (query + key + value).transpose(1, 2).contiguous(), None

    AttentionInterface.register(NULL, null_attention)
    AttentionMaskInterface.register(NULL, sdpa_mask)


def main() -> None:
    compiled = "--eager" not in sys.argv
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 7
    skip_replayed_launches()
    mb.mx_hf.register(mb.NAME, backend="triton")
    register_null()
    arms = {"sdpa": training_step("sdpa", compiled), "mxfp8": training_step(mb.NAME, compiled),
            "mxfp8 host only": training_step(mb.NAME, compiled), "null": training_step(NULL, compiled)}
    times = {name: [] for name in arms}
    for r in range(rounds):
        for name, step in (arms.items() if r % 2 == 0 else reversed(arms.items())):
            SKIP[0] = name == "mxfp8 host only"
            try:
                times[name].append(wall_per_call(step, 10, warmup=2, unit=1e3))
            finally:
                SKIP[0] = False
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"GPT-2 (models_bench), {'compiled' if compiled else 'eager'} training step, {torch.cuda.get_device_name()}"
          f", medians of {rounds} rounds (ms/step)")
    for name, t in times.items():
        print(f"  {name:16s} {med[name]:7.2f}   rounds: {' '.join(f'{x:.2f}' for x in t)}")
    print(f"  mxfp8 / sdpa                  {med['mxfp8'] / med['sdpa']:.3f}")
    print(f"  attention kernels' share      {med['mxfp8'] - med['mxfp8 host only']:+.2f} ms (mxfp8 - host only)")
    print(f"  mxattn host path and ops      {med['mxfp8 host only'] - med['null']:+.2f} ms (host only - null)")
    print(f"  SDPA's attention              {med['sdpa'] - med['null']:+.2f} ms (sdpa - null)")


if __name__ == "__main__":
    main()
