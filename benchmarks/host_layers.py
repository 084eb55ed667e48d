"""Host time per layer of the eager call path on a CUDA machine: each layer of a planned tiny call (B1 S128 H8 D64,
bshd, causal, triton) called directly, from the public API down to one compiled kernel's launch and one
allocation, so the differences say what each layer costs on that host. Wall time per call (the kernels are tiny:
the host is the bottleneck), min over interleaved rounds of the mean of 300 calls; torch SDPA's call in the same
rounds. Usage: python benchmarks/host_layers.py [--grad]"""
import os
import sys

import torch
import torch.nn.functional as F

import mxattn
from mxattn import op_plans, ops
from mxattn.attention import _PLANS, _run_dense
from mxattn.runtime import triton_launch
from mxattn.layouts import to_bhsd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profiling import wall_per_call  # noqa: E402


def mean_us(fn, n=300):
    return wall_per_call(fn, n, warmup=20)


def _without_launches(fn):
    """fn() with the compiled kernels' launches skipped (what the replay costs besides issuing them)."""
    real = triton_launch.run_compiled
    triton_launch.run_compiled = lambda entry, grid, stream, args: None
    try:
        return fn()
    finally:
        triton_launch.run_compiled = real


def main():
    grad = "--grad" in sys.argv
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
               for _ in range(3))

    def call():
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")

    with torch.set_grad_enabled(grad):
        for _ in range(5):
            call()
        plan = next(p for p in _PLANS.values() if p.args.backend == "triton")
        qb, kb, vb = (to_bhsd(t, "bshd") for t in (q, k, v))
        args = plan.args.with_tensors(qb, kb, vb, None)
        roots = (qb, kb, vb, None, None, None)
        for _ in range(3):  # (without grad the public call replays whole: the op body's plan is recorded here)
            ops._fwd_impl(args, needs_backward=grad, eager=True)
        replay = next(p for p in op_plans.PLANS._plans.values() if hasattr(p, "replay"))
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(grad) for t in (q, k, v))
        do = torch.randn_like(qt)
        layers = {
            "torch SDPA (bhsd views)": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
            "mxfp8_attention (public API)": call,
            "_run_dense (planned call)": lambda: _run_dense(plan, q, k, v, None),
            "ops.attention": lambda: ops.attention(args),
            "ops._fwd_impl (op plan lookup + replay)": lambda: ops._fwd_impl(args, needs_backward=grad,
                                                                             eager=True),
            "LaunchPlan.replay (op body)": lambda: replay.replay(roots),
            "LaunchPlan.replay, launches not issued": lambda: _without_launches(lambda: replay.replay(roots)),
            "torch.empty_strided on cuda": lambda: torch.empty_strided((1, 8, 128, 64), (65536, 64, 512, 1),
                                                                        dtype=torch.bfloat16, device="cuda"),
            "Tensor.as_strided on cuda": lambda: do.as_strided((1, 8, 128, 64), (65536, 64, 512, 1), 0),
            "torch.cuda.current_device": torch.cuda.current_device,
        }
        if grad:
            do_bshd = do.transpose(1, 2)
            o_sdpa, o_mx = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), call()
            layers["torch SDPA forward+backward"] = lambda: F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True).backward(do)
            layers["mxfp8_attention forward+backward"] = lambda: call().backward(do_bshd)
            layers["torch SDPA backward alone"] = lambda: o_sdpa.backward(do, retain_graph=True)
            layers["mxfp8_attention backward alone"] = lambda: o_mx.backward(do_bshd, retain_graph=True)
            node = o_mx.grad_fn  # (_Attention's node: it takes and returns the caller's bshd layout)
            while node is not None and "_Attention" not in type(node).__name__:
                node = node.next_functions[0][0]
            layers["_Attention.backward called directly"] = lambda: node.apply(do_bshd)
        best = {name: float("inf") for name in layers}
        for _ in range(5):
            for name, fn in layers.items():
                best[name] = min(best[name], mean_us(fn))
    print(f"{torch.cuda.get_device_name()}, grad={grad}, op plan replays {replay.launch_count} launch(es), "
          f"{getattr(replay, 'allocations_per_replay', '?')} allocation(s)")
    for name, us in best.items():
        print(f"{name:45s} {us:8.1f} us")


if __name__ == "__main__":
    main()
