"""The bf16-scratch backward's head-chunk size against its time and peak memory, at `python -m mxattn bench`'s
default configs (mxattn.bench.DEFAULT_CONFIGS).

attention_bwd (mode "pre") dequantizes the streamed operands of one chunk of KV heads at a time into bf16 scratch;
a chunk holds max(heads for WAVES waves of dK/dV programs, PRE_BUDGET_BYTES // scratch per head) heads. Each
setting below patches those two numbers, starts from empty launch-plan caches, and measures through the triton
backend (`TritonBackend.forward` / `.backward`, as the bench does):
  - backward time (CUDA-event medians over interleaved rounds, each setting timed once per round),
  - peak bytes of forward+backward above what was allocated before (`mxattn.bench.peak_bytes`),
  - the gradients, which must be bit-equal to the first setting's (the chunking changes no number).
Ratios are to the first setting (the library's default) and to torch SDPA cuDNN BF16 in the same run.

Usage: python benchmarks/bwd_scratch_budget.py [--rounds 9] [--iters 10] [--budgets-mib 128,32,0] [--waves 2,1]
[--json FILE]
"""

import argparse
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # (tests/triton_helpers.py: the library's plan caches)

import torch  # noqa: E402


_CACHES = {}


def _setting(budget_mib: int, waves: int):
    """Patch the chunk rule (PRE_BUDGET_BYTES, and the waves of programs a chunk must fill) and put in place this
    setting's own launch-plan caches (empty the first time): a replay never runs another setting's chunks."""
    from mxattn.kernels import triton_attention_bwd as bwd
    from mxattn.runtime.triton_launch import sm_count
    from triton_helpers import install_plan_caches, new_plan_caches
    bwd.PRE_BUDGET_BYTES = budget_mib << 20
    bwd.sm_count = lambda dev: max(1, sm_count(dev) * waves // 2)  # attention_bwd asks for 2 * sm_count programs
    if (budget_mib, waves) not in _CACHES:
        _CACHES[budget_mib, waves] = new_plan_caches()
    install_plan_caches(_CACHES[budget_mib, waves])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budgets-mib", default="128,32,0")
    ap.add_argument("--waves", default="2,1")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from mxattn.backends.base import AttentionParams
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.bench import DEFAULT_CONFIGS, _sdpa_runner, peak_bytes
    from mxattn.kernels import triton_attention_bwd as bwd
    from mxattn.mask import MaskSpec
    default_budget = bwd.PRE_BUDGET_BYTES >> 20
    settings = [(default_budget, 2)] + [(int(b), int(w)) for b in a.budgets_mib.split(",")
                                        for w in a.waves.split(",") if (int(b), int(w)) != (default_budget, 2)]
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}: torch {torch.__version__}; settings (budget MiB, waves): {settings}")
    out = []
    for name, B, hq, hkv, S, D, causal in DEFAULT_CONFIGS:
        g = torch.Generator(device=dev).manual_seed(0)
        q, do = (torch.randn(B, hq, S, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(B, hkv, S, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        params = AttentionParams(softmax_scale=1.0 / math.sqrt(D), mask=MaskSpec(causal=causal),
                                 out_dtype=torch.bfloat16)
        be = TritonBackend()
        runs, peaks, grads = {}, {}, {}
        for budget, waves in settings:
            _setting(budget, waves)
            o, st, saved = be.forward(q, k, v, params)
            key = f"budget{budget}_waves{waves}"
            grads[key] = [t.clone() for t in be.backward(saved, o, st, do, params)[:3]]

            def fb():  # (under this setting: measured at once)
                o2, st2, sv2 = be.forward(q, k, v, params)
                return be.backward(sv2, o2, st2, do, params)
            peaks[key] = peak_bytes(fb)

            def run(budget=budget, waves=waves, saved=saved, o=o, st=st):
                _setting(budget, waves)
                return be.backward(saved, o, st, do, params)
            runs[key] = run
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        got, note = _sdpa_runner("cudnn", qg, kg, vg, causal, hq != hkv)  # as the bench runs it
        if got is None:
            raise SystemExit(f"{name}: torch SDPA's cuDNN backend is the baseline here and did not run: {note}")
        sdpa, (kk_, vv_) = got
        og = sdpa(qg)
        runs["sdpa_cudnn"] = lambda: torch.autograd.grad(og, (qg, kk_, vv_), do, retain_graph=True)
        peaks["sdpa_cudnn"] = peak_bytes(lambda: torch.autograd.grad(sdpa(qg), (qg, kk_, vv_), do))
        samples = {kk: [] for kk in runs}
        for fn in runs.values():
            fn()
        torch.cuda.synchronize()
        for _ in range(a.rounds):
            for kk, fn in runs.items():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(a.iters):
                    fn()
                e.record()
                e.synchronize()
                samples[kk].append(s.elapsed_time(e) / a.iters)
        ms = {kk: statistics.median(v_) for kk, v_ in samples.items()}
        first = next(iter(grads))
        row = {"config": name, "bwd_ms": ms, "peak_mib": {kk: p / 2 ** 20 for kk, p in peaks.items()},
               "grads_bit_equal_to_default": {kk: all(torch.equal(x, y) for x, y in zip(gr, grads[first]))
                                              for kk, gr in grads.items()}}
        out.append(row)
        print(f"\n{name}: SDPA cuDNN bwd {ms['sdpa_cudnn']:.3f} ms, peak fwd+bwd {row['peak_mib']['sdpa_cudnn']:.0f} MiB")
        print("| setting | bwd ms | vs default | vs cuDNN (time ratio cuDNN/triton) | peak MiB | peak / cuDNN | "
              "grads equal |")
        print("|---|---|---|---|---|---|---|")
        for kk in grads:
            print(f"| {kk} | {ms[kk]:.3f} | {ms[kk] / ms[first]:.3f} | {ms['sdpa_cudnn'] / ms[kk]:.2f} | "
                  f"{row['peak_mib'][kk]:.0f} | {row['peak_mib'][kk] / row['peak_mib']['sdpa_cudnn']:.2f} | "
                  f"{row['grads_bit_equal_to_default'][kk]} |")
        del runs, grads, og
        _CACHES.clear()
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "settings": settings, "configs": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
