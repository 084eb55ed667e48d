"""Host work of the cudnn backend's path against the triton backend's, measured on a CPU (no GPU needed).

On a GPU every aten operation the Python path issues is a kernel launch (and host time); the graph execution
itself is one cuDNN call. This script runs the `cudnn` backend's forward and backward on small CPU tensors with
the graph build and `graph.execute` stubbed (no cuDNN call) and counts the aten operations issued through
torch's dispatcher (a TorchDispatchMode), and does the same for the `triton` backend with its
Triton launches stubbed (`cpu_host_harness.install_stubs`), which issue no aten operation besides allocations.

    python benchmarks/cudnn_host_ops.py
"""
import sys
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import cpu_host_harness  # noqa: E402

import mxattn  # noqa: E402
from mxattn.backends import cudnn_backend as cb  # noqa: E402

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
    """cudnn backend on CPU tensors: supported, no handle, and graphs neither built nor executed."""
    cb.CudnnBackend.availability = classmethod(lambda cls, device: (True, "stubbed"))
    cb.CudnnBackend.supports = classmethod(lambda cls, problem: (True, "stubbed"))
    cb._supported_state = lambda device: None

    def fake_forward(q_row, k_row, v_col, *, attn_scale, mask, out_dtype, seq=None, sink=None):
        b, h, s, d = q_row.data.shape
        return (torch.empty((b, h, s, d), dtype=out_dtype), torch.empty((b, h, s, 1)), None)

    def fake_backward(q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats, **kw):
        return (torch.empty_like(o), torch.empty(k_row.data.shape, dtype=o.dtype),
                torch.empty(v_row.data.shape, dtype=o.dtype))

    cb.cudnn_forward, cb.cudnn_backward = fake_forward, fake_backward


def count(backend: str, q, k, v) -> int:
    """aten launches of one forward+backward (after a first call that fills the caches)."""
    def fwd_bwd():
        mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend=backend).backward(torch.ones_like(q))

    fwd_bwd()
    counter = CountOps()
    with counter:
        fwd_bwd()
    return counter.launches()


def main():
    warnings.simplefilter("ignore")
    launches = Counter()
    cpu_host_harness.install_stubs(launches)
    stub_cudnn()
    q, k, v = (torch.randn(1, 128, 8, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ops_triton = count("triton", q, k, v)
    launches.clear()
    count("triton", q, k, v)
    triton_launches = sum(launches.values()) // 2  # count() runs two forward+backward calls
    ops_cudnn = count("cudnn", q, k, v)
    print("one forward+backward of B1 S128 H8 D64 causal, bf16 (kernels and graph execution stubbed, CPU tensors)")
    print(f"triton: {triton_launches} Triton launches + {ops_triton} aten launches")
    print(f"cudnn:  2 graph executions + {ops_cudnn} aten launches (its MXFP8 quantization runs as torch ops)")


if __name__ == "__main__":
    main()
