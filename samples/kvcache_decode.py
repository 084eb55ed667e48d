"""Serve two sequences from a paged MXFP8 KV cache: a chunked prefill, then decode steps, one call per step.

    python samples/kvcache_decode.py [--device cuda] [--backend triton|reference]

Each step's output (num_splits=1: the sequential pass) is compared with `mxattn.mxfp8_attention` over the
sequence's tokens so far on the same backend (they agree bit for bit: the reference backend on any device, the
Triton paged kernel on a CUDA GPU), and the cache's bytes with a bf16 cache of the same pages. The last step is
read again with the default num_splits=0, the fast decode path on a GPU (16-row tiles, split KV), which agrees with
the sequential pass to fp32 rounding: printed in bf16 ulps. Exits with status 1 if a step differs.
"""

import argparse
import sys

import torch

import mxattn
from mxattn.metrics import bf16_ulps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--backend", default=None,
                    help="triton or reference (default: triton on cuda, reference on cpu)")
    args = ap.parse_args(argv)
    backend = args.backend or ("triton" if args.device == "cuda" else "reference")
    hq, hkv, d, steps = 8, 2, 64, 40
    cache = mxattn.MXFP8KVCache(num_pages=16, page_size=64, kv_heads=hkv, head_dim=d, max_sequences=2,
                                device=args.device)
    slots = [cache.new_sequence(), cache.new_sequence()]
    g = torch.Generator().manual_seed(0)
    prompt_lengths = (50, 23)
    total = [prompt_lengths[i] + steps for i in range(2)]
    q_all, k_all, v_all = ([torch.randn(n, h, d, generator=g).bfloat16().to(args.device) for n in total]
                           for h in (hq, hkv, hkv))
    held, exact = [0, 0], True
    for step in range(steps + 1):
        counts = list(prompt_lengths) if step == 0 else [1, 1]           # prefill chunk, then one token each
        cu = torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32, device=args.device)
        pick = lambda xs: torch.cat([x[held[i]:held[i] + counts[i]] for i, x in enumerate(xs)])  # noqa: E731
        q = pick(q_all)
        out = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, k_new=pick(k_all),
                                                  v_new=pick(v_all), num_splits=1, backend=backend)
        for i in range(2):
            a, b = cu[i].item(), cu[i + 1].item()
            n = held[i] + counts[i]
            expected = mxattn.mxfp8_attention(q_all[i][held[i]:n].unsqueeze(0), k_all[i][:n].unsqueeze(0),
                                              v_all[i][:n].unsqueeze(0), attn_mask_type="causal_bottom_right",
                                              backend=backend)[0]
            exact &= torch.equal(out[a:b], expected)
            held[i] = n
    print(f"backend {backend} on {args.device}: sequences of {held[0]} and {held[1]} tokens (prefill "
          f"{prompt_lengths}, then {steps} decode steps)")
    print(f"every step equal to mxfp8_attention over the prefix, bit for bit: {exact}")
    fast = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, backend=backend).float()
    last = out.float()
    ulps = bf16_ulps(fast, last)
    print(f"last step again with the default num_splits=0: at most {ulps.max().item():.0f} bf16 ulp(s) from the "
          f"sequential pass, {(fast == last).float().mean().item():.1%} of elements equal")
    print(f"cache bytes: {cache.nbytes() / 1e6:.2f} MB, a bf16 cache of the same pages: "
          f"{cache.bf16_nbytes() / 1e6:.2f} MB ({cache.nbytes() / cache.bf16_nbytes():.2f}x)")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
