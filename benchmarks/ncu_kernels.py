"""The triton backend's kernels for Nsight Compute: one training step's launches (quantize Q/K/V, forward, backward
prep, dK/dV, dQ), the FP8-on-chip Triton forward and, on an SM 9.0 GPU, the Gluon warp-specialised forward on the
same FP8 operands (`gluon_attention_fwd`), inside a profiler range, after warm-up calls outside it.

Run under Nsight Compute by benchmarks/ncu_kernels.sh (which gives ncu --profile-from-start off, so only the
range is profiled): python benchmarks/ncu_kernels.py [--causal] [B H S D].
Without ncu it runs the same calls (a smoke test)."""
import argparse
import math

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="*", type=int, default=[2, 16, 4096, 128])
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    from mxattn.backends.base import AttentionParams
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.bench import fwd_kernel_operands
    from mxattn.kernels import triton_attention_fwd as tf
    from mxattn.kernels.triton_quantize import quantize_rowcol
    from mxattn.mask import MaskSpec

    B, H, S, D = args.shape
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    scale = 1.0 / math.sqrt(D)
    params = AttentionParams(softmax_scale=scale, mask=MaskSpec(causal=args.causal), out_dtype=torch.bfloat16)
    be = TritonBackend()
    qq, kv8 = quantize_rowcol(q), fwd_kernel_operands(k, v, fp8=True)
    ob, sb = torch.empty_like(q), torch.empty(B, H, S, 1, device=dev)
    gluon = None
    if torch.cuda.get_device_capability() == (9, 0):
        from mxattn.kernels import gluon_attention_fwd as gluon
    fwd_kw = dict(softmax_scale=scale, offset=0, left_bound=None, right_bound=0 if args.causal else None)

    def step():
        o, stats, saved = be.forward(q, k, v, params)  # quantize_qkv + the forward kernel (bf16 K/V path)
        be.backward(saved, o, stats, do, params)  # prep, dK/dV, kv prep, dQ per chunk of heads
        tf.attention_fwd(qq.row.data, qq.row.scale, *kv8, out=ob, stats=sb, **fwd_kw)  # FP8-on-chip forward
        if gluon is not None:  # the Gluon forward on the same operands
            gluon.attention_fwd_gluon(qq.row.data, qq.row.scale, *kv8, out=ob, stats=sb, **fwd_kw)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one step at B{B} H{H} S{S} D{D}{' causal' if args.causal else ''} on "
          f"{torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
