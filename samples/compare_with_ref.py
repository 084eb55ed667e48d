"""Run an mxattn backend against the `ref` emulator (and FP64 attention) and print an error table.

    python samples/compare_with_ref.py --backend auto --seq 1000 --heads 8 --kv-heads 2 --causal

`ref.mxfp8_ref` is the independent yardstick of the kernels' numerics; a backend that emulates the recipe
exactly shows differences of the order of FP32 summation order only.
"""

import argparse
import math

import torch
import torch.nn.functional as F

import mxattn
from mxattn.metrics import max_abs, rel_rms
from ref import mxfp8_ref


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", choices=("auto", "cudnn", "triton", "reference"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    hkv = args.kv_heads or args.heads
    q = torch.randn(args.batch, args.heads, args.seq, args.head_dim, device=device).bfloat16()
    k = torch.randn(args.batch, hkv, args.seq, args.head_dim, device=device).bfloat16()
    v = torch.randn(args.batch, hkv, args.seq, args.head_dim, device=device).bfloat16()
    do = torch.randn_like(q)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = "causal" if args.causal else "no_mask"
    o = mxattn.mxfp8_attention(*leaves, qkv_format="bhsd", attn_mask_type=mask, backend=args.backend)
    o.backward(do)
    ours = [o.detach(), *(leaf.grad for leaf in leaves)]

    scale = 1 / math.sqrt(args.head_dim)
    cpu = [t.cpu() for t in (q, k, v, do)]
    o_ref, stats = mxfp8_ref.sdpa_fwd(*cpu[:3], attn_scale=scale, causal=args.causal)
    refs = [o_ref, *mxfp8_ref.sdpa_bwd(*cpu[:3], o_ref, cpu[3], stats, attn_scale=scale, causal=args.causal)]

    leaves64 = [t.cpu().double().requires_grad_() for t in (q, k, v)]
    groups = args.heads // hkv
    o64 = F.scaled_dot_product_attention(leaves64[0], *(t.repeat_interleave(groups, 1) for t in leaves64[1:]),
                                         is_causal=args.causal)
    o64.backward(cpu[3].double())
    exact = [o64.detach(), *(leaf.grad for leaf in leaves64)]

    print(f"backend {args.backend} on {device}: B{args.batch} H{args.heads}/{hkv} S{args.seq} D{args.head_dim}"
          f" {mask}")
    print(f"{'tensor':<7}{'max|ours-ref|':>15}{'relRMS(ours,ref)':>18}{'relRMS(ours,fp64)':>19}"
          f"{'relRMS(ref,fp64)':>18}")
    for name, a, r, e in zip(("O", "dQ", "dK", "dV"), ours, refs, exact):
        a = a.cpu()
        print(f"{name:<7}{max_abs(a, r):>15.3e}{rel_rms(a, r):>18.3e}{rel_rms(a, e):>19.3e}{rel_rms(r, e):>18.3e}")


if __name__ == "__main__":
    main()
