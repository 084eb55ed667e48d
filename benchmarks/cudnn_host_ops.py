"""Host work of the cudnn backend's path against the triton backend's, measured on a CPU (no GPU needed).

On a GPU every aten operation the Python path issues is a kernel launch (and host time); the graph execution
itself is one cuDNN call. This script runs the `cudnn` backend's forward and backward on small CPU tensors with
the graph build and `graph.execute` stubbed (no cuDNN call) and counts the aten operations issued through
torch's dispatcher (a TorchDispatchMode), and does the same for the `triton` backend with its
Triton launches stubbed (`cpu_host_harness.install_stubs`), which issue no aten operation besides allocations.

--profile: then cProfile of 500 forward+backward calls of the cudnn backend (fused quantizer), each function's own
time (or the cumulative time with --cumulative), after the table.

--rounds N: interleaved timing rounds (default 15).

    python benchmarks/cudnn_host_ops.py [--rounds N] [--profile [--cumulative]]
"""
import statistics
import sys
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import cpu_host_harness  # noqa: E402

import mxattn  # noqa: E402
from mxattn.backends.cudnn import backend as cb  # noqa: E402
from mxattn.backends.cudnn import run as cudnn_run  # noqa: E402
from mxattn.kernels import triton_quantize as tq  # noqa: E402

ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
               "aten.zeros.default", "aten.new_empty.default"}


class CountOps(TorchDispatchMode):
    """Counts the aten operations dispatched while active (views and allocations apart: they launch nothing)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def launches(self):
        views = ("view", "permute", "transpose", "slice", "select", "unsqueeze", "expand", "as_strided", "alias",
                 "detach", "squeeze", "t.default", "_unsafe_view")
        return sum(n for op, n in self.ops.items()
                   if op not in ALLOCATIONS and not any(v in op for v in views))


def stub_cudnn():
    """cudnn backend on CPU tensors: supported, no handle, graph configs and variant packs built as on a GPU,
    the graphs neither planned nor executed."""
    plans = {}

    def planned(key, kind, device, make_config):
        if key not in plans:
            plans[key] = cudnn_run.PlannedGraph(kind, make_config(), None, 0)
        return plans[key]

    cb.CudnnBackend.availability = classmethod(lambda cls, device: (True, "stubbed"))
    cb.CudnnBackend.supports = classmethod(lambda cls, problem: (True, "stubbed"))
    cb._supported_state = lambda device: None
    cudnn_run.planned = planned
    cudnn_run.execute = lambda plan, pack, device: None


def count(backend: str, q, k, v) -> int:
    """aten launches of one forward+backward (after a first call that fills the caches)."""
    def fwd_bwd():
        mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend=backend).backward(torch.ones_like(q))

    fwd_bwd()
    counter = CountOps()
    with counter:
        fwd_bwd()
    return counter.launches()


#: (label, backend, fused quantizer) of the rows; on a GPU the cudnn backend quantizes with the fused Triton kernel
#: (CUDA tensors, Triton importable)
ROWS = (("triton", "triton", None), ("cudnn, torch-op quantizer", "cudnn", False),
        ("cudnn, fused Triton quantizer", "cudnn", True))


def use_quantizer(fused) -> None:
    cb._quantizer_for = (lambda x: tq.quantize_rowcol) if fused else (lambda x: None)


def interleaved_us(q, k, v, rounds: int, n: int = 40) -> dict:
    """(label, "fwd+bwd" or "fwd") -> per-round median host times (us) of a forward+backward, and of a forward
    alone (with grad: what the backward needs is kept, then dropped), the rows timed one after another in each
    round (the torch-op quantizer's row, 15x slower, in the first round only), so that a load shared by the CPU
    touches every row alike."""
    do = torch.ones_like(q)
    out = {(label, part): [] for label, _, _ in ROWS for part in ("fwd+bwd", "fwd")}
    for r in range(rounds):
        for label, backend, fused in ROWS:
            if fused is False and r:
                continue
            use_quantizer(fused)

            def fwd(backend=backend):
                return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend=backend)

            out[label, "fwd+bwd"].append(cpu_host_harness.per_call_us(lambda: fwd().backward(do), n=n))
            out[label, "fwd"].append(cpu_host_harness.per_call_us(fwd, n=n))
    return out


def _spread(xs) -> str:
    return f"{statistics.median(xs):7.0f} us [{min(xs):.0f}-{max(xs):.0f}]" if len(xs) > 1 else f"{xs[0]:7.0f} us"


def main():
    warnings.simplefilter("ignore")
    launches = Counter()
    cpu_host_harness.install_stubs(launches)
    stub_cudnn()
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 15
    q, k, v = (torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    print(f"one forward+backward of B1 S128 H8 D64 causal, bf16 (Triton kernels and cuDNN graph execution "
          f"stubbed, CPU tensors; host time = median wall time per call, median [range] over {rounds} interleaved "
          "rounds of 40 calls on this CPU)")
    counts = {}
    for label, backend, fused in ROWS:
        use_quantizer(fused)
        ops = count(backend, q, k, v)
        launches.clear()
        count(backend, q, k, v)
        counts[label] = (sum(launches.values()) // 2, ops)  # count() runs two forward+backward calls
    times = interleaved_us(q, k, v, rounds)
    for label, _, _ in ROWS:
        kernels, ops = counts[label]
        extra = " + 2 graph executions" if label.startswith("cudnn") else ""
        print(f"{label:32s} {kernels:3d} Triton launches{extra} + {ops:4d} aten launches, host "
              f"{_spread(times[label, 'fwd+bwd'])}; forward alone {_spread(times[label, 'fwd'])}")
    for part in ("fwd+bwd", "fwd"):
        ratios = [c / t for c, t in zip(times[ROWS[2][0], part], times[ROWS[0][0], part])]
        print(f"host time ratio cudnn (fused quantizer) / triton, {part:7s}: {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] (per round)")
    if "--profile" in sys.argv:
        profile_cudnn(q, k, v)


def profile_cudnn(q, k, v, calls: int = 500) -> None:
    """cProfile of `calls` forward+backward calls of the cudnn backend with the fused quantizer (caches warm)."""
    import cProfile
    use_quantizer(True)
    do = torch.ones_like(q)

    def fwd_bwd():
        mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="cudnn").backward(do)

    for _ in range(20):
        fwd_bwd()
    sort = "cumulative" if "--cumulative" in sys.argv else "tottime"
    cProfile.runctx(f"for _ in range({calls}): fwd_bwd()", globals(), {"fwd_bwd": fwd_bwd}, sort=sort)


if __name__ == "__main__":
    main()
