"""Packed batches (thd, padding-free training) through the public API's backward, CUDA GPU (Hopper for the Gluon
kernels): the triton backend with its Gluon dK/dV and dQ kernels on gapped scratch (the library's choice where
both take the call) against the same call with MXATTN_GLUON_BWD=0's Triton kernels, interleaved rounds.

Each config packs documents of seeded random lengths (uniform in [lo, hi], the last one cut to fill T tokens)
into one thd batch, q, k, v as views split from one fused QKV; the step timed is `mxfp8_attention(...,
qkv_format="thd")` forward and backward (dO given), CUDA-event medians over interleaved rounds (each path once
per round), launch-plan caches reset whenever the path changes. Before timing, the two paths' gradients are
compared (bit-equal expected) and the Gluon kernels' calls are counted (0 means they did not take the call:
their length heuristics see the longest document, e.g. the D64 dQ kernel's MIN_KEYS).

Usage: python benchmarks/packed_bwd_bench.py [--config name:T:Hq:Hkv:D:causal:lo:hi ...] [--rounds N]
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402

DEFAULT_CONFIGS = ["t16k_h16_d128_causal:16384:16:16:128:1:256:2048",
                   "t16k_h16_d128:16384:16:16:128:0:512:4096",
                   "t32k_h32kv8_d128_causal:32768:32:8:128:1:1024:8192",
                   "t16k_h16_d64:16384:16:16:64:0:2048:4096"]


def _parse(spec: str):
    name, *nums = spec.split(":")
    t, hq, hkv, d, causal, lo, hi = (int(x) for x in nums)
    return name, t, hq, hkv, d, bool(causal), lo, hi


def doc_lengths(total: int, lo: int, hi: int, seed: int = 0):
    """Seeded document lengths uniform in [lo, hi] whose sum is `total` (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", action="append", type=_parse)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    import mxattn
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from gluon_path_bench import _fresh_plans

    calls = {"dkdv": 0, "dq": 0}
    for module, name, key in ((gb, "dkdv_gluon", "dkdv"), (gd, "dq_gluon", "dq")):
        real = getattr(module, name)

        def counted(*a, real=real, key=key, **k):
            calls[key] += 1
            return real(*a, **k)
        setattr(module, name, counted)
    print(f"device: {torch.cuda.get_device_name()}")
    for name, total, hq, hkv, d, causal, lo, hi in args.config or [_parse(c) for c in DEFAULT_CONFIGS]:
        lens = doc_lengths(total, lo, hi)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        qkv = torch.randn(total, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        do = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kw = dict(qkv_format="thd", backend="triton", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                  max_seqlen_kv=max(lens), attn_mask_type="padding_causal" if causal else "padding")
        x = qkv.clone().requires_grad_(True)
        q, k, v = x.split([hq, hkv, hkv], dim=1)

        def step():
            x.grad = None
            mxattn.mxfp8_attention(q, k, v, **kw).backward(do)

        grads, ran = {}, {}
        for path in ("gluon", "triton"):
            backend_module.GLUON_BACKWARD = path == "gluon"
            _fresh_plans()
            calls.update(dkdv=0, dq=0)
            step()
            torch.cuda.synchronize()
            grads[path], ran[path] = x.grad.clone(), dict(calls)
        equal = torch.equal(grads["gluon"], grads["triton"])
        times = {"gluon": [], "triton": []}
        for _ in range(args.rounds):
            for path in times:
                backend_module.GLUON_BACKWARD = path == "gluon"
                _fresh_plans()
                for _ in range(2):
                    step()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    step()
                end.record()
                torch.cuda.synchronize()
                times[path].append(start.elapsed_time(end) / args.iters)
        ms = {p: statistics.median(t) for p, t in times.items()}
        print(f"{name}: {len(lens)} docs ({min(lens)}..{max(lens)} tokens), fwd+bwd gluon {ms['gluon']:.3f} ms, "
              f"triton {ms['triton']:.3f} ms, gluon / triton {ms['gluon'] / ms['triton']:.3f}; Gluon kernel calls "
              f"per step {ran['gluon']} (triton path {ran['triton']}); gradients bit-equal: {equal}", flush=True)
    backend_module.GLUON_BACKWARD = True


if __name__ == "__main__":
    main()
