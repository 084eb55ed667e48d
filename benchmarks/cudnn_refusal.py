"""On a CUDA GPU that is not Blackwell: how fast, and how cleanly, the cudnn backend refuses.

Prints cudnn_support()'s reason, the MXFP8NotSupportedError messages of the three paths (backend, typed
function, cuDNN's own planning), the time per refusal over 100 tries, and the change in GPU memory, process RSS
and open file descriptors. Usage: python benchmarks/cudnn_refusal.py [--tries 100]
"""

import argparse
import gc
import os
import statistics
import time

import torch

import cudnn
from mxattn import cudnn_graphs as cg
from mxattn.backends.base import AttentionParams
from mxattn.backends.cudnn_backend import CudnnBackend, cudnn_forward
from mxattn.cudnn_support import cudnn_support
from mxattn.errors import MXFP8NotSupportedError
from mxattn.formats import quantize_mxfp8
from mxattn.mask import MaskSpec


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tries", type=int, default=100)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()} SM {'.'.join(map(str, torch.cuda.get_device_capability()))}, "
          f"cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}")
    print("cudnn_support():", cudnn_support())
    mask = MaskSpec(causal=True)
    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    qr, vc = quantize_mxfp8(q, -1), quantize_mxfp8(q, -2)
    cfg = cg.GraphConfig.from_layout(1, 4, 4, 256, 256, 128, layout="bshd", mask=mask)
    handle = cudnn.create_handle()
    paths = {
        "CudnnBackend.forward": lambda: CudnnBackend().forward(q, q, q, AttentionParams(0.125, mask)),
        "cudnn_forward": lambda: cudnn_forward(qr, qr, vc, attn_scale=0.125),
        "plan forward graph": lambda: cg.plan_graph(cg.build_forward_graph(cfg, handle), cfg, "forward"),
        "plan backward graph": lambda: cg.plan_graph(cg.build_backward_graph(cfg, handle), cfg, "backward"),
    }
    for name, fn in paths.items():
        try:
            fn()
            print(f"{name}: did NOT raise")
        except MXFP8NotSupportedError as exc:
            print(f"{name}: MXFP8NotSupportedError: {exc}")
    gc.collect()
    torch.cuda.synchronize()
    mem0, rss0, fds0 = torch.cuda.memory_allocated(), _rss(), len(os.listdir("/proc/self/fd"))
    times = []
    for _ in range(args.tries):
        t0 = time.perf_counter()
        for fn in paths.values():
            try:
                fn()
            except MXFP8NotSupportedError:
                pass
        times.append(time.perf_counter() - t0)
    gc.collect()
    torch.cuda.synchronize()
    print(f"{args.tries} tries of all four paths: median {statistics.median(times) * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms per try; GPU memory delta {torch.cuda.memory_allocated() - mem0} B, "
          f"RSS delta {(_rss() - rss0) / 2**20:.2f} MiB, open fds delta {len(os.listdir('/proc/self/fd')) - fds0}")
    cudnn.destroy_handle(handle)


if __name__ == "__main__":
    main()
