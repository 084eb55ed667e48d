"""Forward kernels at `python -m mxattn bench`'s default configs (mxattn.bench.DEFAULT_CONFIGS), one run, Hopper GPU:

* gluon          the warp-specialised Gluon forward (mxattn.kernels.gluon_attention_fwd) on FP8 Q/K/V
* gluon_nopp     the same without the consumer warpgroups' ping-pong (config=(stages, fp8 stages, False))
* triton_fp8     the Triton forward on the same FP8 operands (K/V dequantized on chip)
* triton_bf16kv  the Triton forward on bf16 K/V scratch (the backend's data path at these sizes: `fwd_streams_bf16`)
* gluon_bf16kv   the Gluon forward's bf16-K/V variant on the same scratch (TMA straight into its bf16 ring)
* sdpa_cudnn, sdpa_flash   torch SDPA on bf16 Q/K/V (mxattn.bench's runners: GQA through enable_gqa, or K/V
  expanded outside the timed region where a backend refuses it)

Kernel time only (operands quantized once, outside the timing), triton.testing.do_bench (median ms), TFLOP/s
from the kept (i, j) pairs, and the ratios of every kernel to sdpa_cudnn and of gluon to the two Triton paths.
Before timing, each config checks the outputs of gluon, gluon_bf16kv and triton_bf16kv against triton_fp8's
(share within one bf16 ulp).

--window W (a sliding window: keys kept where col > row - W) and --sink (fp32 sink logits per query head, drawn
from N(0, 1)) time the Gluon forward's window and sink variants against the Triton forward on the same operands
(torch SDPA takes neither: its rows are left out, and TFLOP/s count the window's kept pairs).

Usage: python benchmarks/gluon_fwd_bench.py [--config name:B:Hq:Hkv:S:D:causal ...] [--window W] [--sink]
[--json FILE]
"""

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402


def _parse(spec: str):
    name, *nums = spec.split(":")
    b, hq, hkv, s, d, causal = (int(x) for x in nums)
    return name, b, hq, hkv, s, d, bool(causal)


def _ordered_bf16(x):
    i = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def bench_config(name, B, HQ, HKV, S, D, causal, window=None, sink=False):
    from mxattn.bench import _sdpa_runner, kept_pairs
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    from mxattn.kernels.triton_quantize import quantize_qkv
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, HQ, S, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, HKV, S, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    qq, kq, vq = quantize_qkv(q, k, v, dict(col=False), dict(col=False), dict(row=False, col_seq_major=True))
    _, kb, vb = quantize_qkv(q, k, v, dict(col=False), dict(col=False, row_dequant=True),
                             dict(row=True, col=True, col_dequant=True))
    kw = dict(softmax_scale=1.0 / math.sqrt(D), offset=0, left_bound=window, right_bound=0 if causal else None,
              sink=torch.randn(HQ, device="cuda", generator=g) if sink else None)
    out = torch.empty(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
    stats = torch.empty(B, HQ, S, 1, device="cuda", dtype=torch.float32)
    fp8 = (qq.row.data, qq.row.scale, kq.row.data, kq.row.scale, vq.col_seq_major)
    runs = {
        "gluon": lambda: gf.attention_fwd_gluon(*fp8, out=out, stats=stats, **kw),
        "gluon_nopp": lambda: gf.attention_fwd_gluon(*fp8, out=out, stats=stats, config=(*gf.STAGES[D], False), **kw),
        "triton_fp8": lambda: tf.attention_fwd(*fp8, out=out, stats=stats, **kw),
        "triton_bf16kv": lambda: tf.attention_fwd(qq.row.data, qq.row.scale, kb.row_dequant, None, vb.col_dequant,
                                                  out=out, stats=stats, **kw),
        "gluon_bf16kv": lambda: gf.attention_fwd_gluon(qq.row.data, qq.row.scale, kb.row_dequant, None,
                                                       vb.col_dequant, out=out, stats=stats, **kw),
    }
    notes = []
    for kind in (() if window is not None or sink else ("cudnn", "flash")):
        got, note = _sdpa_runner(kind, q, k, v, causal, HQ != HKV)
        if note:
            notes.append(note)
        if got is not None:
            runs[f"sdpa_{kind}"] = got[0]
    # agreement with the Triton forward on the same operands before timing
    runs["triton_fp8"]()
    o_ref, s_ref = out.clone(), stats.clone()
    check = {}
    for path in ("gluon", "gluon_bf16kv", "triton_bf16kv"):
        runs[path]()
        torch.cuda.synchronize()
        ulps = (_ordered_bf16(out) - _ordered_bf16(o_ref)).abs()
        check[path] = dict(within_1ulp=(ulps <= 1).float().mean().item(), max_ulps=int(ulps.max().item()),
                           stats_max_abs=(stats - s_ref).abs().nan_to_num(0).max().item())
    flops = 4.0 * B * HQ * D * kept_pairs(S, S, causal, window)
    res = {"config": name, "window": window, "sink": sink, "check": check, "notes": notes}
    for key, fn in runs.items():
        ms = triton.testing.do_bench(fn, warmup=25, rep=200)
        res[f"{key}_ms"] = ms
        res[f"{key}_tflops"] = flops / ms / 1e9
    base = res.get("sdpa_cudnn_ms")
    for key in runs:
        if base:
            res[f"{key}_vs_cudnn"] = base / res[f"{key}_ms"]
    res["gluon_vs_triton_fp8"] = res["triton_fp8_ms"] / res["gluon_ms"]
    res["gluon_vs_triton_bf16kv"] = res["triton_bf16kv_ms"] / res["gluon_ms"]
    res["gluon_bf16kv_vs_triton_bf16kv"] = res["triton_bf16kv_ms"] / res["gluon_bf16kv_ms"]
    return res


def main():
    from mxattn.bench import DEFAULT_CONFIGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", type=_parse, help="name:B:Hq:Hkv:S:D:causal(0/1); repeatable")
    ap.add_argument("--window", type=int, default=None, help="sliding window: keys kept where col > row - W")
    ap.add_argument("--sink", action="store_true", help="fp32 sink logits per query head")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    results = []
    for cfg in args.config or DEFAULT_CONFIGS:
        r = bench_config(*cfg, window=args.window, sink=args.sink)
        results.append(r)
        checks = "; ".join(f"{name} {c['within_1ulp']:.5f} (max {c['max_ulps']} ulps, stats max abs diff "
                           f"{c['stats_max_abs']:.2e})" for name, c in r["check"].items())
        print(f"\n{r['config']}{'' if args.window is None else f' window {args.window}'}{' sink' if args.sink else ''}: "
              f"O within 1 ulp of triton_fp8: {checks} {'; '.join(r['notes'])}")
        for key in ("gluon", "gluon_nopp", "triton_fp8", "triton_bf16kv", "gluon_bf16kv", "sdpa_cudnn",
                    "sdpa_flash"):
            if f"{key}_ms" in r:
                ratio = r.get(f"{key}_vs_cudnn")
                print(f"  {key:14s} {r[key + '_ms']:8.3f} ms {r[key + '_tflops']:7.1f} TFLOP/s"
                      + (f"  {ratio:5.2f}x cudnn" if ratio else ""))
        print(f"  gluon vs triton_fp8 {r['gluon_vs_triton_fp8']:.2f}x, vs triton_bf16kv "
              f"{r['gluon_vs_triton_bf16kv']:.2f}x; gluon_bf16kv vs triton_bf16kv "
              f"{r['gluon_bf16kv_vs_triton_bf16kv']:.2f}x (>1: gluon faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
