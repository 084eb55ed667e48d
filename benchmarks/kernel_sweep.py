"""Tuning sweep of the Triton kernels (a development aid, not part of the package): times each block / warp /
stage candidate of the forward (bf16-scratch and FP8-on-chip data paths), the backward (both data paths) and the
fused quantizer on the bench's configs, and writes benchmarks/results/<gpu-name>/sweep.json. The kernels' chosen
configurations (BF16_FWD_CONFIGS, the backward's and the quantizer's tables) are this sweep's fastest candidates;
rerun it after a kernel change or on a new GPU to check them.
Usage (CUDA machine): python benchmarks/kernel_sweep.py [--kernels fwd,bwd_pre,...] [--config name:B:Hq:Hkv:S:D:causal]
[--iters N] [--warmup N] [--out-dir DIR]"""
import argparse
import json
import math
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mxattn.bench import (DEFAULT_CONFIGS, _parse_config, fwd_kernel_operands, gpu_dir_name, kept_pairs,  # noqa: E402
                          time_cuda, time_graph)

FWD_SWEEP = [(128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2)]
BWD_SWEEP = [((64, 128, 8, 2), (128, 64, 8, 2)), ((64, 128, 8, 1), (128, 64, 8, 3)),
             ((64, 128, 8, 3), (128, 32, 8, 3)), ((32, 128, 8, 2), (64, 64, 4, 3)),
             ((32, 128, 8, 2), (128, 32, 8, 3)), ((64, 128, 8, 3), (64, 64, 4, 3)),
             ((32, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 4, 2), (128, 64, 8, 1))]
#: kernel groups `sweep` can time
SWEEP_KERNELS = ("fwd", "fwd_fp8_on_chip", "bwd_pre", "bwd_fp8", "quantize")


def sweep(cfg, warmup: int, iters: int, kernels=SWEEP_KERNELS) -> List[Dict]:
    """Time the kernels (the groups named in `kernels`, see SWEEP_KERNELS) under each block/warp/stage
    candidate for one config. The backward is timed in both data paths ("pre": bf16 scratch, "fp8")."""
    from mxattn.kernels import triton_attention_bwd as tb
    from mxattn.kernels import triton_attention_fwd as tf
    from mxattn.kernels.triton_quantize import quantize_rowcol

    name, B, hq, hkv, S, D, causal = cfg
    dev = torch.device("cuda")
    q, do = (torch.randn(B, hq, S, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, hkv, S, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    qq, dq_, kq, vq = quantize_rowcol(q), quantize_rowcol(do), quantize_rowcol(k), quantize_rowcol(v)
    kv, kv_fp8 = fwd_kernel_operands(k, v), fwd_kernel_operands(k, v, fp8=True)
    o, st = torch.empty_like(q), torch.empty(B, hq, S, 1, device=dev)
    fl = 4.0 * B * hq * D * kept_pairs(S, S, causal)
    mk = dict(softmax_scale=1 / math.sqrt(D), offset=0, left_bound=None, right_bound=0 if causal else None)
    rows = []

    def rec(kernel, params, fn, mult):
        try:
            ms = time_cuda(fn, warmup, iters)
            rows.append({"config": name, "kernel": kernel, "params": params, "ms": ms,
                         "tflops": mult * fl / ms / 1e9})
        except Exception as exc:
            rows.append({"config": name, "kernel": kernel, "params": params,
                         "error": f"{type(exc).__name__}: {exc}"[:200]})
        print(rows[-1], flush=True)
    for label, operands in (("fwd", kv), ("fwd_fp8_on_chip", kv_fp8)):
        for c in (FWD_SWEEP if label in kernels else ()):
            rec(label, c, lambda: tf.attention_fwd(qq.row.data, qq.row.scale, *operands, out=o, stats=st, config=c,
                                                   **mk), 1.0)
    tf.attention_fwd(qq.row.data, qq.row.scale, *kv, out=o, stats=st, **mk)
    g = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    for mode in ("pre", "fp8"):
        for c in (BWD_SWEEP if f"bwd_{mode}" in kernels else ()):
            rec(f"bwd_{mode}", c, lambda: tb.attention_bwd(
                qq.row, qq.col, kq.row, kq.col, vq.row, dq_.row, dq_.col, o, do, st, dq=g[0], dk=g[1], dv=g[2],
                config=c, mode=mode, **mk), 2.5)
    n = q.numel()
    for tile in (((32, 4), (32, 4, 64), (32, 2, 64), (64, 4, 64), (32, 8)) if "quantize" in kernels else ()):
        ms = time_graph(lambda: quantize_rowcol(q, tile=tile), warmup, iters)
        rows.append({"config": name, "kernel": "quantize", "params": tile, "ms": ms,
                     "GBps": (4 * n + 2 * (n // 32)) / ms / 1e6})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/kernel_sweep.py", description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(SWEEP_KERNELS),
                    help=f"comma list of {', '.join(SWEEP_KERNELS)} (default: all)")
    ap.add_argument("--config", action="append", type=_parse_config,
                    help="name:B:Hq:Hkv:S:D:causal(0/1); repeatable; default: the bench's configs")
    ap.add_argument("--iters", type=int, default=20, help="timed runs per measurement (median; default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs before each measurement (default 5)")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results/<gpu-name>/")
    args = ap.parse_args(argv)
    kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    if not kernels or any(k not in SWEEP_KERNELS for k in kernels):
        ap.error(f"--kernels takes a comma list of {', '.join(SWEEP_KERNELS)}, got {args.kernels!r}")
    if not torch.cuda.is_available():
        print("the sweep needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    rows = [row for cfg in (args.config or DEFAULT_CONFIGS) for row in sweep(cfg, args.warmup, args.iters, kernels)]
    out_dir = args.out_dir or os.path.join("benchmarks", "results", gpu_dir_name(gpu))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump({"gpu": gpu, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
