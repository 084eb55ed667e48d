"""Where the compiled (or eager) GPT-2 training step's extra time over SDPA goes, by ablation on a CUDA machine:
models_bench.py's GPT-2 trained with four attention functions, in alternating rounds in one process:

* sdpa: transformers' SDPA (cuDNN BF16);
* mxfp8: mxattn's attention through its HF registration (backend triton), as users run it;
* mxfp8 host only: the same, every replayed Triton launch skipped (the host path, the allocations and the
  graph around the ops unchanged; the attention kernels do not run, so its losses are meaningless);
* null op: an attention function calling a custom op pair of the packed ops' shape (forward: Q, K, V in bshd
  views -> O and a uint8 block of the forward's saved size; backward: dO, O, the block -> dQ, dK, dV), whose
  bodies only allocate their outputs: what the op boundary costs (dispatch, graph outputs, saved tensors) without
  mxattn's Python;
* null: an attention function that returns query + key + value (no attention at all; the same projections,
  gradients flowing to Q, K and V): the floor of the rest of the step.

Then mxfp8 - host only is what the attention kernels add to the wall time (zero where the step is host-bound),
host only - null op what mxattn's Python host path adds, null op - null what the op boundary costs, sdpa - null
what SDPA's attention costs.
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
NULL, NULL_OP = "mxattn_ablation_null", "mxattn_ablation_null_op"
#: the forward's saved bytes per element of Q, K or V (the recipe keeps about 7 bytes per element: Q and K in both
#: orientations, V, O's stats and scales): the null op's block
SAVED_BYTES_PER_ELEMENT = 7


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


def register_null_op() -> None:
    """The `NULL_OP` attention function: a custom op pair that only allocates (module docstring)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    lib = torch.library.Library("mxattn_ablation", "DEF")
    lib.define("fwd(Tensor q, Tensor k, Tensor v) -> Tensor[]")
    lib.define("bwd(Tensor do, Tensor o, Tensor block, Tensor k) -> (Tensor, Tensor, Tensor)")

    def fwd(q, k, v):
        return [torch.empty(q.shape, dtype=q.dtype, device=q.device),
                torch.empty(q.numel() * SAVED_BYTES_PER_ELEMENT, dtype=torch.uint8, device=q.device)]

    def bwd(do, o, block, k):
        return (torch.empty(do.shape, dtype=do.dtype, device=do.device),
                torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(k.shape, dtype=k.dtype, device=k.device))

    for name, fn in (("fwd", fwd), ("bwd", bwd)):
        lib.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"mxattn_ablation::{name}", fn, lib=lib)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output[0], output[1], inputs[1])

    def backward(ctx, grads):
        o, block, k = ctx.saved_tensors
        return torch.ops.mxattn_ablation.bwd(grads[0], o, block, k)

    torch.library.register_autograd("mxattn_ablation::fwd", backward, setup_context=setup_context, lib=lib)
    _LIBRARIES.append(lib)

    def null_op_attention(module, query, key, value, attention_mask, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return torch.ops.mxattn_ablation.fwd(q, k, v)[0], None

    AttentionInterface.register(NULL_OP, null_op_attention)
    AttentionMaskInterface.register(NULL_OP, sdpa_mask)


#: libraries kept alive (a dropped `torch.library.Library` removes its ops)
_LIBRARIES: list = []


def main() -> None:
    compiled = "--eager" not in sys.argv
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 7
    skip_replayed_launches()
    mb.mx_hf.register(mb.NAME, backend="triton")
    register_null()
    register_null_op()
    arms = {"sdpa": training_step("sdpa", compiled), "mxfp8": training_step(mb.NAME, compiled),
            "mxfp8 host only": training_step(mb.NAME, compiled), "null op": training_step(NULL_OP, compiled),
            "null": training_step(NULL, compiled)}
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
    print(f"  mxattn's Python host path     {med['mxfp8 host only'] - med['null op']:+.2f} ms (host only - null op)")
    print(f"  the op boundary               {med['null op'] - med['null']:+.2f} ms (null op - null)")
    print(f"  SDPA's attention              {med['sdpa'] - med['null']:+.2f} ms (sdpa - null)")


if __name__ == "__main__":
    main()
