"""What is alive at the peak of one forward+backward, by the code that allocated it: the triton backend (as
`python -m mxattn bench` runs it, `TritonBackend.forward` then `.backward`; with the default bf16 scratch budget
and with MXATTN_BWD_SCRATCH_MIB=0's) against torch SDPA cuDNN BF16 (`torch.autograd.grad`), at the bench's
default configs (`mxattn.bench.DEFAULT_CONFIGS`). The bench's peak-memory ratio (its target: <= 1.0x cuDNN for MHA) is
read off the same `mxattn.bench.peak_bytes` measure; this script says where the bytes go.

How: `torch.cuda.memory._record_memory_history` over the call, then the allocator's trace replayed (allocations
and frees in order) to find the peak and the blocks alive there; each block is labelled by the innermost Python
frame in mxattn that allocated it (launch plans are emptied first, so the call runs its body), for SDPA the
innermost Python frame (none for what autograd's backward thread allocates). Bytes allocated before the call (the inputs q, k, v, dO)
are outside, as in `peak_bytes`. CUDA only.

Usage: python benchmarks/peak_memory_breakdown.py [--json FILE]
"""

import argparse
import collections
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

MIB = 2 ** 20


#: frames that allocate on another function's behalf (launch plans recording or replaying a call)
_PASS_THROUGH = ("launch_plan.py", "affine_plan.py", "peak_memory_breakdown")


def _label(frames, marker: str) -> str:
    """'file.py:function' of the innermost frame whose file path holds `marker` (frames innermost first),
    launch plans' own frames skipped."""
    for f in frames:
        name = f.get("filename", "")
        if marker in name and not any(p in name for p in _PASS_THROUGH):
            return f"{os.path.basename(name)}:{f.get('name', '?')}"
    return "(other)" if frames else "(no Python frame: autograd's backward thread)"


def _clear_launch_plans() -> None:
    """Empty every launch-plan cache, so the next call runs its body (whose frames name what it allocates)
    rather than a plan's replay."""
    import gc
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.plan_cache import PlanCache
    for obj in gc.get_objects():
        if isinstance(obj, (PlanCache, AffinePlanCache)):
            obj.clear()


def live_at_peak(fn, marker: str):
    """(peak bytes above the start, {label: (bytes, blocks)} alive at the peak, peak_bytes' figure) of fn()."""
    from mxattn.bench import peak_bytes
    _clear_launch_plans()  # (plans recorded under another scratch budget replay that budget's chunks)
    measured = peak_bytes(fn)  # the bench's own figure, and a warm-up (compiles, caches, launch plans)
    torch.cuda.synchronize()
    _clear_launch_plans()
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=1_000_000)
    try:
        out = fn()
        torch.cuda.synchronize()
        del out
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, groups = replay(snap["device_traces"][torch.cuda.current_device()], marker)
    return peak, groups, measured


def replay(trace, marker: str):
    """The allocator's trace (`torch.cuda.memory._snapshot()["device_traces"][device]`: events in order, each a dict
    with action, addr, size, frames) replayed -> (peak bytes above the start, {label: [bytes, blocks]} of the blocks
    alive at the peak, labelled by `_label`). A block counts from its "alloc" to its "free_requested" (when
    memory_allocated drops); blocks allocated before the trace began are outside; other actions are ignored."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for ev in trace:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], _label(ev.get("frames", []), marker))
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif act == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    groups = collections.defaultdict(lambda: [0, 0])
    for size, label in at_peak.values():
        groups[label][0] += size
        groups[label][1] += 1
    return peak, dict(groups)


def run_config(cfg):
    from mxattn.bench import _sdpa_runner
    from mxattn.backends.base import AttentionParams
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.kernels import triton_attention_bwd as tab
    from mxattn.mask import MaskSpec

    name, B, hq, hkv, S, D, causal = cfg
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(B, h, S, D, device=dev, dtype=torch.bfloat16, generator=gen)
                   for h in (hq, hkv, hkv, hq))
    params = AttentionParams(softmax_scale=1.0 / math.sqrt(D), mask=MaskSpec(causal=causal), out_dtype=q.dtype)
    be = TritonBackend()

    def tri_fb():
        o, st, sv = be.forward(q, k, v, params)
        return be.backward(sv, o, st, do, params)

    rows = {}
    rows["triton (default scratch budget)"] = live_at_peak(tri_fb, "/mxattn/")
    budget = tab.PRE_BUDGET_BYTES
    tab.PRE_BUDGET_BYTES = 0  # MXATTN_BWD_SCRATCH_MIB=0: chunks of about two waves of programs only
    try:
        rows["triton (MXATTN_BWD_SCRATCH_MIB=0)"] = live_at_peak(tri_fb, "/mxattn/")
    finally:
        tab.PRE_BUDGET_BYTES = budget
    qg = q.detach().requires_grad_(True)
    kg, vg = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
    got, note = _sdpa_runner("cudnn", qg, kg, vg, causal, hq != hkv)
    if got is not None:
        run, (kk, vv) = got
        rows["SDPA cuDNN bf16"] = live_at_peak(lambda: torch.autograd.grad(run(qg), (qg, kk, vv), do), "/")
    return name, rows, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    from mxattn.bench import DEFAULT_CONFIGS
    print(f"# Live blocks at the forward+backward's peak, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("(bytes above what was allocated before the call: q, k, v, dO are outside; MiB = 2^20 bytes)\n")
    out = []
    for cfg in DEFAULT_CONFIGS:
        try:
            name, rows, note = run_config(cfg)
        except Exception as exc:  # one config's failure does not hide the others'
            print(f"## {cfg[0]}: failed: {type(exc).__name__}: {exc}\n")
            continue
        base = rows.get("SDPA cuDNN bf16", (None,))[0]
        print(f"## {name}" + (f" ({note})" if note else ""))
        for impl, (peak, groups, measured) in rows.items():
            ratio = f", {peak / base:.2f}x cuDNN's" if base else ""
            print(f"\n{impl}: peak {peak / MIB:.1f} MiB from the trace ({measured / MIB:.1f} by peak_bytes){ratio}")
            print("| allocated by | MiB alive at the peak | blocks |\n|---|---|---|")
            for label, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
                print(f"| {label} | {size / MIB:.1f} | {n} |")
            out.append({"config": name, "impl": impl, "peak_bytes": peak, "peak_bytes_measured": measured,
                        "live_at_peak": {k: {"bytes": s, "blocks": n} for k, (s, n) in groups.items()}})
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
