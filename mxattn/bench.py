"""`python -m mxattn bench`: the triton MXFP8 backend against torch SDPA in BF16 (cuDNN and flash), one GPU.

For each config it times (CUDA events, warm-up, median of --iters runs) the triton forward (with and without
the quantization of Q, K, V), backward (dO quantization included) and forward+backward, next to
`torch.nn.functional.scaled_dot_product_attention` in BF16 with its cuDNN and flash backends; it records the
peak memory of each forward+backward, and the fused quantizer's throughput against the same GPU's
device-to-device copy bandwidth. Results go to benchmarks/results/<gpu-name>/results.{json,md} (and
chart.png when matplotlib is importable; `--plot-from results.json` renders it elsewhere). The kernels' tuning
sweeps (block, warp and stage candidates) live outside the package: `python benchmarks/kernel_sweep.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from .bench_report import fmt, markdown, plot
from .cli import ArgumentParser

# (name, B, Hq, Hkv, S, D, causal)
DEFAULT_CONFIGS = [
    ("b2_h16_s4096_d128", 2, 16, 16, 4096, 128, False),
    ("b2_h16_s4096_d128_causal", 2, 16, 16, 4096, 128, True),
    ("b4_h16_s2048_d64", 4, 16, 16, 2048, 64, False),
    ("b1_h32kv8_s8192_d128_causal", 1, 32, 8, 8192, 128, True),
]


def gpu_dir_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (a folder name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def time_cuda(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median milliseconds of fn() over `iters` runs, each timed with its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_graph(fn: Callable[[], object], warmup: int, iters: int) -> Optional[float]:
    """Median milliseconds of CUDA-graph replays of fn() (no host launch overhead); None if capture fails."""
    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
    except Exception:  # some callable cannot be captured
        return None
    ms = time_cuda(g.replay, warmup, iters)
    del g
    return ms


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated above what was allocated before fn() ran (its results freed after)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def kept_bytes(fn: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward when fn(q, k, v) runs with grad-requiring
    copies of q, k, v (what stays alive between forward and backward)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    del out
    return int(sum(seen.values()))


def kept_pairs(s_q: int, s_kv: int, causal: bool, window: Optional[int] = None) -> int:
    """Number of (i, j) pairs the mask keeps (top-left causal or none; window: also keys j > i - window only)."""
    if not causal and window is None:
        return s_q * s_kv
    i = torch.arange(s_q, dtype=torch.int64)
    hi = torch.minimum(i + 1, torch.tensor(s_kv)) if causal else torch.full_like(i, s_kv)
    lo = torch.zeros_like(i) if window is None else torch.clamp(i - window + 1, min=0)
    return int(torch.clamp(hi - lo, min=0).sum())


def _sdpa_runner(kind: str, q, k, v, causal: bool, gqa: bool):
    """Callable forward for SDPA backend `kind` ('cudnn' or 'flash'), or (None, reason)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = SDPBackend.CUDNN_ATTENTION if kind == "cudnn" else SDPBackend.FLASH_ATTENTION
    note = ""
    kk, vv = k, v
    gqa_kw = {}
    if gqa:
        gqa_kw = {"enable_gqa": True}

    def make(kx, vx, kw):
        def run(qx=q):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qx, kx, vx, is_causal=causal, **kw)
        return run

    run = make(kk, vv, gqa_kw)
    try:
        run()
        torch.cuda.synchronize()
    except Exception as exc:  # backend refuses enable_gqa: expand K/V (copy outside the timed region)
        if not gqa:
            return None, f"{kind} unavailable: {type(exc).__name__}: {str(exc)[:120]}"
        rep = q.shape[1] // k.shape[1]
        kk = k.detach().repeat_interleave(rep, 1).requires_grad_(k.requires_grad)
        vv = v.detach().repeat_interleave(rep, 1).requires_grad_(v.requires_grad)
        run = make(kk, vv, {})
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc2:
            return None, f"{kind} unavailable: {type(exc2).__name__}: {str(exc2)[:120]}"
        note = "K/V expanded to Hq heads (backend refused enable_gqa)"
    return (run, (kk, vv)), note


#: rounds of the interleaved timings: each round times every implementation's forward, backward and
#: forward+backward once, in turn, and the median over the rounds is reported, so a drift of the GPU's clocks or
#: of a neighbour's load during a config hits the triton figures and their cuDNN baselines alike
ROUNDS = 3


def fwd_kernel_operands(k: torch.Tensor, v: torch.Tensor, fp8: bool = False) -> tuple:
    """(k_data, k_scale, v) for the forward kernel from bf16 k, v [B, Hkv, S, D], on the data path the triton
    backend takes for this problem (`fwd_streams_bf16`), or on the FP8 on-chip path when fp8."""
    from .kernels import triton_attention_fwd as tf
    from .kernels.triton_quantize import quantize_rowcol

    if not fp8 and tf.fwd_streams_bf16(k.shape[0], k.shape[1], k.shape[2], k.shape[3]):
        kq, vq = quantize_rowcol(k, col=False, row_dequant=True), quantize_rowcol(v, col_dequant=True)
        return kq.row_dequant, None, vq.col_dequant
    kq, vq = quantize_rowcol(k, col=False), quantize_rowcol(v, row=False, col_seq_major=True)
    return kq.row.data, kq.row.scale, vq.col_seq_major


def bench_config(cfg, warmup: int, iters: int, dtype=torch.bfloat16, rounds: int = ROUNDS) -> Dict:
    """Time one config; returns a dict of milliseconds (medians over `rounds` interleaved rounds of CUDA-event
    medians), TFLOP/s, ratios and peak bytes."""
    from .backends.base import AttentionParams
    from .attention import mxfp8_attention
    from .backends.triton_backend import TritonBackend, forward_kernel
    from .kernels.triton_quantize import quantize_rowcol
    from .mask import MaskSpec

    name, B, hq, hkv, S, D, causal = cfg
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, hq, S, D, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(B, hkv, S, D, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(B, hkv, S, D, device=dev, dtype=dtype, generator=gen)
    do = torch.randn(B, hq, S, D, device=dev, dtype=dtype, generator=gen)
    scale = 1.0 / math.sqrt(D)
    params = AttentionParams(softmax_scale=scale, mask=MaskSpec(causal=causal), out_dtype=dtype)
    fwd_flops = 4.0 * B * hq * D * kept_pairs(S, S, causal)
    res = {"config": name, "B": B, "Hq": hq, "Hkv": hkv, "S": S, "D": D, "causal": causal,
           "fwd_flop": fwd_flops, "rounds": rounds, "notes": []}

    be = TritonBackend()

    def tri_fb():
        o2, st2, sv2 = be.forward(q, k, v, params)
        return be.backward(sv2, o2, st2, do, params)
    res["triton_fwdbwd_peak_bytes"] = peak_bytes(tri_fb)
    res["triton_kept_bytes"] = kept_bytes(lambda x, y, z: mxfp8_attention(
        x, y, z, qkv_format="bhsd", attn_mask_type="causal" if causal else "no_mask", backend="triton"), q, k, v)
    # the forward is timed as SDPA's is, without a backward to come (no_grad: O alone, no copies kept; the
    # training-mode forward of both, which keeps what backward needs, is timed as fwd_train)
    infer = dataclasses.replace(params, needs_backward=False)
    res["triton_fwdbwd_graph_ms"] = time_graph(tri_fb, warmup, iters)
    res["triton_fwd_graph_ms"] = time_graph(lambda: be.forward(q, k, v, infer), warmup, iters)

    o, stats, saved = be.forward(q, k, v, params)
    qq, kv = quantize_rowcol(q), fwd_kernel_operands(k, v)
    ob, sb = torch.empty_like(q), torch.empty(B, hq, S, 1, device=dev)
    timed = {  # name -> callable, all timed once per round
        "triton_fwd": lambda: be.forward(q, k, v, infer),
        "triton_fwd_train": lambda: be.forward(q, k, v, params),
        "triton_fwd_kernel": lambda: forward_kernel(  # the kernel the backend runs (Gluon on Hopper, or Triton)
            qq.row.data, qq.row.scale, *kv, softmax_scale=scale, offset=0, left_bound=None,
            right_bound=0 if causal else None, out=ob, stats=sb),
        "triton_bwd": lambda: be.backward(saved, o, stats, do, params),
        "triton_fwdbwd": tri_fb,
    }
    for kind in ("cudnn", "flash"):
        qg = q.detach().requires_grad_(True)
        kg = k.detach().requires_grad_(True)
        vg = v.detach().requires_grad_(True)
        got, note = _sdpa_runner(kind, qg, kg, vg, causal, hq != hkv)
        if note:
            res["notes"].append(f"{kind}: {note}")
        if got is None:
            continue
        run, (kk, vv) = got
        leaves = (qg, kk, vv)

        def fb(run=run, leaves=leaves, qg=qg):  # (bound now: the loop rebinds the names)
            return torch.autograd.grad(run(qg), leaves, do)
        res[f"sdpa_{kind}_fwdbwd_peak_bytes"] = peak_bytes(fb)
        res[f"sdpa_{kind}_kept_bytes"] = kept_bytes(lambda x, y, z, run=run: run(x), qg, kk, vv)
        out = run(qg)  # its graph stays alive in the bwd callable's defaults

        def fwd(run=run):
            with torch.no_grad():
                return run(q)
        timed[f"sdpa_{kind}_fwd"] = fwd
        timed[f"sdpa_{kind}_fwd_train"] = lambda run=run, qg=qg: run(qg)
        timed[f"sdpa_{kind}_bwd"] = lambda out=out, leaves=leaves: torch.autograd.grad(out, leaves, do,
                                                                                       retain_graph=True)
        timed[f"sdpa_{kind}_fwdbwd"] = fb

    # GPU time alone, both sides replayed from CUDA graphs: `time_cuda` starts each call's clock from an idle queue,
    # so the host's work before the first launch is in those figures (the kernel row's most of all)
    res["triton_fwd_kernel_graph_ms"] = time_graph(timed["triton_fwd_kernel"], warmup, iters)
    for kind in ("cudnn", "flash"):
        if f"sdpa_{kind}_fwd" in timed:
            res[f"sdpa_{kind}_fwd_graph_ms"] = time_graph(timed[f"sdpa_{kind}_fwd"], warmup, iters)
            res[f"sdpa_{kind}_fwdbwd_graph_ms"] = time_graph(timed[f"sdpa_{kind}_fwdbwd"], warmup, iters)
    samples = {key: [] for key in timed}
    for _ in range(rounds):
        for key, fn in timed.items():
            samples[key].append(time_cuda(fn, warmup, iters))
    for key, ms in samples.items():
        res[f"{key}_ms"] = statistics.median(ms)
        res[f"{key}_ms_rounds"] = ms
    del o, stats, saved, qq, kv, ob, sb, timed

    mult = {"fwd": 1.0, "fwd_kernel": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
    for key, m in mult.items():
        for impl in ("triton", "sdpa_cudnn", "sdpa_flash"):
            ms = res.get(f"{impl}_{key}_ms")
            if ms is not None:
                res[f"{impl}_{key}_tflops"] = m * fwd_flops / (ms * 1e-3) / 1e12
    for key in ("fwd", "fwd_train", "bwd", "fwdbwd"):
        for ref in ("cudnn", "flash"):
            r = res.get(f"sdpa_{ref}_{key}_ms")
            if r:
                res[f"ratio_{key}_vs_{ref}"] = r / res[f"triton_{key}_ms"]
    r = res.get("sdpa_cudnn_fwd_ms")
    if r:
        res["ratio_fwd_kernel_vs_cudnn"] = r / res["triton_fwd_kernel_ms"]
    res.update(graph_ratios(res))
    return res


def graph_ratios(res: Dict) -> Dict:
    """{ratio_<x>_graph_vs_cudnn_graph: cuDNN's CUDA-graph ms / triton's} from a config's results, for x in
    fwd_kernel (against cuDNN's forward), fwd and fwdbwd; those whose figures are missing (a capture failed)
    are left out."""
    out = {}
    for ours, theirs in (("fwd_kernel", "fwd"), ("fwd", "fwd"), ("fwdbwd", "fwdbwd")):
        t, c = res.get(f"triton_{ours}_graph_ms"), res.get(f"sdpa_cudnn_{theirs}_graph_ms")
        if t and c:
            out[f"ratio_{ours}_graph_vs_cudnn_graph"] = c / t
    return out


def bench_quantizer(warmup: int, iters: int) -> Dict:
    """Fused quantizer (row+col, compact; and with swizzled scales) vs a device-to-device copy."""
    from .kernels.triton_quantize import quantize_rowcol

    dev = torch.device("cuda")
    shape = (4, 32, 4096, 128)
    n = math.prod(shape)
    x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    x_bshd = torch.randn((shape[0], shape[2], shape[1], shape[3]), device=dev, dtype=torch.bfloat16).transpose(1, 2)
    y = torch.empty_like(x)
    copy_ms = time_graph(lambda: y.copy_(x), warmup, iters) or time_cuda(lambda: y.copy_(x), warmup, iters)
    copy_bw = 2 * 2 * n / (copy_ms * 1e-3)
    out = {"shape": list(shape), "copy_ms": copy_ms, "copy_GBps": copy_bw / 1e9}
    qbytes = 2 * n + 2 * n + 2 * (n // 32)  # read bf16, write two fp8 copies and two scale arrays
    for label, fn in (("compact", lambda: quantize_rowcol(x)),
                      ("compact_bshd", lambda: quantize_rowcol(x_bshd)),
                      ("swizzled", lambda: quantize_rowcol(x, swizzle=True))):
        out[f"quant_{label}_eager_ms"] = time_cuda(fn, warmup, iters)
        ms = time_graph(fn, warmup, iters) or out[f"quant_{label}_eager_ms"]
        extra = 0
        if label == "swizzled":
            extra = 2 * (n // 32)
        bw = (qbytes + extra) / (ms * 1e-3)
        out[f"quant_{label}_ms"] = ms
        out[f"quant_{label}_GBps"] = bw / 1e9
        out[f"quant_{label}_vs_copy"] = bw / copy_bw
    return out


#: the variable-length config: a THD pack of 16 causal sequences, lengths drawn in [128, 4096] (seeded)
VARLEN_CONFIG = dict(name="thd16_h16_d128_causal", n_seq=16, min_len=128, max_len=4096, heads=16, head_dim=128,
                     seed=0)


def _bf16_varlen_runner(q, k, v, cu, max_len):
    """The BF16 attention a user would run on a packed batch on this GPU: torch's varlen_attn when this torch
    has it, else SDPA on a jagged nested tensor. Returns (forward callable, its name)."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        def run():
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, is_causal=True)
        run()
        return run, "torch.nn.attention.varlen.varlen_attn (bf16)"
    except Exception:  # older torch: jagged nested tensors through SDPA
        import torch.nn.functional as F
        offsets = cu.to(torch.int64)

        def run():
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(nq, nk, nv, is_causal=True).transpose(1, 2).values()
        run()
        return run, "SDPA on jagged nested tensors (bf16)"


def bench_varlen(warmup: int, iters: int, cfg=VARLEN_CONFIG) -> Dict:
    """Triton MXFP8 on a packed causal batch vs the BF16 varlen baseline, and the dense ratio at the same
    token count (16 equal sequences, triton vs SDPA cuDNN), all in this run."""
    from .attention import mxfp8_attention

    gen = torch.Generator().manual_seed(cfg["seed"])
    lengths = torch.randint(cfg["min_len"], cfg["max_len"] + 1, (cfg["n_seq"],), generator=gen).tolist()
    total, h, d = sum(lengths), cfg["heads"], cfg["head_dim"]
    dev = torch.device("cuda")
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q, k, v, do = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16).requires_grad_() for _ in range(4))
    flops = 4.0 * h * d * sum(kept_pairs(n, n, True) for n in lengths)
    kw = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
              max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths), backend="triton")
    res = {"config": cfg["name"], "lengths": lengths, "tokens": total, "fwd_flop": flops}
    with torch.no_grad():
        res["triton_fwd_ms"] = time_cuda(lambda: mxfp8_attention(q, k, v, **kw), warmup, iters)
    res["triton_fwdbwd_ms"] = time_cuda(
        lambda: torch.autograd.grad(mxfp8_attention(q, k, v, **kw), (q, k, v), do), warmup, iters)
    run, res["baseline"] = _bf16_varlen_runner(q, k, v, cu, max(lengths))
    with torch.no_grad():
        res["bf16_fwd_ms"] = time_cuda(run, warmup, iters)
    res["bf16_fwdbwd_ms"] = time_cuda(lambda: torch.autograd.grad(run(), (q, k, v), do), warmup, iters)
    seq = max(128, total // cfg["n_seq"] // 128 * 128)
    dense = bench_config((f"dense_b{cfg['n_seq']}_s{seq}", cfg["n_seq"], h, h, seq, d, True), warmup, iters)
    res["dense_config"] = dense["config"]
    for key in ("fwd", "fwdbwd"):
        res[f"triton_{key}_tflops"] = (1.0 if key == "fwd" else 3.5) * flops / (res[f"triton_{key}_ms"] * 1e-3) / 1e12
        res[f"ratio_{key}_vs_bf16_varlen"] = res[f"bf16_{key}_ms"] / res[f"triton_{key}_ms"]
        res[f"dense_ratio_{key}_vs_cudnn"] = dense.get(f"ratio_{key}_vs_cudnn")
        # the baseline-free check: MXFP8 varlen throughput over MXFP8 dense throughput at the same token count
        res[f"dense_triton_{key}_tflops"] = dense.get(f"triton_{key}_tflops")
        res[f"varlen_over_dense_tflops_{key}"] = res[f"triton_{key}_tflops"] / dense[f"triton_{key}_tflops"]
        if res[f"dense_ratio_{key}_vs_cudnn"]:
            res[f"varlen_over_dense_ratio_{key}"] = res[f"ratio_{key}_vs_bf16_varlen"] / res[f"dense_ratio_{key}_vs_cudnn"]
    return res


def bench_sink(warmup: int, iters: int, cfg=("b2_h16_s4096_d128_causal", 2, 16, 16, 4096, 128, True)) -> Dict:
    """Cost of softmax_type="learnable" (sink logits and their gradient) against "vanilla" on the triton
    backend, forward and forward+backward through the public API, in the same run."""
    from .attention import mxfp8_attention

    name, B, hq, hkv, S, D, causal = cfg
    dev = torch.device("cuda")
    q, do = (torch.randn(B, S, hq, D, device=dev, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    k, v = (torch.randn(B, S, hkv, D, device=dev, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    offset = torch.zeros(hq, device=dev, requires_grad=True)
    mask = "causal" if causal else "no_mask"
    res = {"config": name}
    for kind, kw, leaves in (("vanilla", {}, (q, k, v)),
                             ("learnable", dict(softmax_type="learnable", softmax_offset=offset), (q, k, v, offset))):
        def fwd(kw=kw):
            return mxfp8_attention(q, k, v, attn_mask_type=mask, backend="triton", **kw)
        with torch.no_grad():
            res[f"{kind}_fwd_ms"] = time_cuda(fwd, warmup, iters)
            res[f"{kind}_fwd_graph_ms"] = time_graph(fwd, warmup, iters)
        res[f"{kind}_fwdbwd_ms"] = time_cuda(lambda fwd=fwd, leaves=leaves: torch.autograd.grad(fwd(), leaves, do),
                                             warmup, iters)
    for key in ("fwd", "fwd_graph", "fwdbwd"):
        if res.get(f"learnable_{key}_ms") and res.get(f"vanilla_{key}_ms"):
            res[f"learnable_over_vanilla_{key}"] = res[f"learnable_{key}_ms"] / res[f"vanilla_{key}_ms"]
    return res


#: MLA's shapes (DeepSeek-V3: Q and K 192 wide, V and O 128): training (B, H, S) causal, and a decode step
#: (B, H, S_kv): one query per sequence against S_kv keys
MLA_TRAIN, MLA_DECODE, MLA_DIMS = (2, 128, 4096), (16, 128, 4096), (192, 128)


def bench_mla(warmup: int, iters: int) -> Dict:
    """MLA's head dims through the public API (`auto`: V zero-padded for the Triton kernels) against torch SDPA in
    bf16 on the same tensors, in the same run: the training shape's forward and forward+backward (causal), and a
    decode step's forward (no cache: K and V quantized by the call). Milliseconds and SDPA/mxattn ratios."""
    from .attention import mxfp8_attention

    dev, (dqk, dv) = torch.device("cuda"), MLA_DIMS
    F = torch.nn.functional
    res = {"dims": [dqk, dv], "train": list(MLA_TRAIN), "decode": list(MLA_DECODE)}
    for shape, causal, sq in ((MLA_TRAIN, True, MLA_TRAIN[2]), (MLA_DECODE, False, 1)):
        B, H, S = shape
        kind = "train" if causal else "decode"
        q = torch.randn(B, sq, H, dqk, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, S, H, dqk, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, S, H, dv, device=dev, dtype=torch.bfloat16)
        mask = "causal" if causal else "no_mask"
        ours = lambda q=q, k=k, v=v, mask=mask: mxfp8_attention(q, k, v, attn_mask_type=mask)  # noqa: E731
        theirs = lambda q=q, k=k, v=v, causal=causal: F.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        with torch.no_grad():
            res[f"{kind}_mxattn_fwd_ms"] = time_cuda(ours, warmup, iters)
            res[f"{kind}_sdpa_bf16_fwd_ms"] = time_cuda(theirs, warmup, iters)
        res[f"{kind}_sdpa_over_mxattn_fwd"] = res[f"{kind}_sdpa_bf16_fwd_ms"] / res[f"{kind}_mxattn_fwd_ms"]
        if causal:
            leaves = [t.requires_grad_() for t in (q, k, v)]
            do = torch.randn(B, sq, H, dv, device=dev, dtype=torch.bfloat16)
            res[f"{kind}_mxattn_fwdbwd_ms"] = time_cuda(lambda: torch.autograd.grad(ours(), leaves, do), warmup, iters)
            res[f"{kind}_sdpa_bf16_fwdbwd_ms"] = time_cuda(
                lambda: torch.autograd.grad(theirs(), leaves, do.transpose(1, 2)), warmup, iters)
            res[f"{kind}_sdpa_over_mxattn_fwdbwd"] = (res[f"{kind}_sdpa_bf16_fwdbwd_ms"] /
                                                      res[f"{kind}_mxattn_fwdbwd_ms"])
        del q, k, v
        torch.cuda.empty_cache()
    return res


def bench_host_overhead(iters: int = 200) -> Dict:
    """CPU time (`host_time_us`) of one public-API forward call on the triton backend, B2 H16 S4096 D128 bshd
    causal, and a thd pack of the same tokens, and of torch SDPA (cuDNN, bf16) on the bshd call for scale;
    microseconds."""
    from .attention import mxfp8_attention

    dev = torch.device("cuda")
    q, k, v = (torch.randn(2, 4096, 16, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 1000, 4096, 8192], dtype=torch.int32, device=dev)
    qt, kt, vt = (t.reshape(8192, 16, 128) for t in (q, k, v))
    calls = {"bshd_s4096": lambda: mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton"),
             "thd_8192_tokens": lambda: mxfp8_attention(qt, kt, vt, qkv_format="thd", attn_mask_type="padding_causal",
                                                        cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4096,
                                                        max_seqlen_kv=4096, backend="triton")}
    sdpa, _ = _sdpa_runner("cudnn", *(t.transpose(1, 2) for t in (q, k, v)), causal=True, gqa=False)
    if sdpa is not None:
        calls["sdpa_cudnn_bf16_bshd_s4096"] = sdpa[0]
    with torch.no_grad():
        return {f"{name}_fwd_host_us": host_time_us(fn, iters) for name, fn in calls.items()}


def host_time_us(fn, iters: int = 200, warmup: int = 5) -> float:
    """CPU thread time of one fn() call in microseconds: the median over `iters` calls, each issued after a
    synchronisation, so the launch queue is empty and no call waits for the GPU (in a loop without
    synchronisation, calls whose GPU work outlasts their host work fill the queue and their launches then
    spin, which thread time would count)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _parse_config(text: str):
    """'name:B:Hq:Hkv:S:D:causal' -> config tuple."""
    parts = text.split(":")
    if len(parts) != 7:
        raise argparse.ArgumentTypeError(f"config must be name:B:Hq:Hkv:S:D:causal(0/1), got {text!r}")
    name, *nums, causal = parts
    return (name, *(int(x) for x in nums), causal in ("1", "true", "True"))


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m mxattn bench`; returns the exit status."""
    ap = ArgumentParser(prog="python -m mxattn bench", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20, help="timed runs per measurement (median; >= 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs before each measurement (default 5)")
    ap.add_argument("--config", action="append", type=_parse_config,
                    help="name:B:Hq:Hkv:S:D:causal(0/1); repeatable; default: B2 H16 S4096 D128 dense and "
                         "causal, B4 H16 S2048 D64, B1 H32/8 S8192 D128 causal")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results/<gpu-name>/")
    ap.add_argument("--no-quantizer", action="store_true", help="skip the quantizer-vs-copy measurement")
    ap.add_argument("--no-varlen", action="store_true", help="skip the variable-length (thd) measurement")
    ap.add_argument("--no-sink", action="store_true", help="skip the attention-sink cost measurement")
    ap.add_argument("--no-mla", action="store_true", help="skip the MLA head dims (192/128) against SDPA")
    ap.add_argument("--only-extras", action="store_true",
                    help="only the variable-length, attention-sink and MLA measurements (no dense configs, no quantizer)")
    ap.add_argument("--plot-from", default=None, help="render chart.png next to an existing results.json")
    args = ap.parse_args(argv)
    if args.plot_from:
        try:
            with open(args.plot_from) as f:
                results = json.load(f)
        except OSError as exc:
            ap.error(f"--plot-from {args.plot_from}: {exc.strerror or exc}")
        except ValueError as exc:  # (json's decode error, a bad encoding)
            ap.error(f"--plot-from {args.plot_from}: not a results.json ({exc})")
        if not isinstance(results, dict) or not isinstance(results.get("configs", []), list):
            ap.error(f"--plot-from {args.plot_from}: not a results.json (no object with a 'configs' list)")
        png = os.path.join(os.path.dirname(os.path.abspath(args.plot_from)), "chart.png")
        if not plot(results, png):
            print("matplotlib is not installed: no chart", file=sys.stderr)
            return 1
        print(f"wrote {png}")
        return 0
    if args.iters < 20:
        ap.error("--iters must be at least 20")
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from .backends.triton_backend import TritonBackend
    ok, why = TritonBackend.availability(torch.device("cuda"))
    if not ok:
        print(f"triton backend unavailable: {why}", file=sys.stderr)
        return 2
    import triton

    gpu = torch.cuda.get_device_name()
    results = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "iters": args.iters,
               "warmup": args.warmup, "rounds": ROUNDS, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "configs": []}
    for cfg in ([] if args.only_extras else (args.config or DEFAULT_CONFIGS)):
        r = bench_config(cfg, args.warmup, args.iters)
        results["configs"].append(r)
        print(f"{r['config']}: triton fwd {r['triton_fwd_ms']:.3f} ms (kernel {r['triton_fwd_kernel_ms']:.3f}), "
              f"bwd {r['triton_bwd_ms']:.3f}, fwd+bwd {r['triton_fwdbwd_ms']:.3f}; cuDNN fwd "
              f"{fmt(r.get('sdpa_cudnn_fwd_ms'), 3)} bwd {fmt(r.get('sdpa_cudnn_bwd_ms'), 3)} fwd+bwd "
              f"{fmt(r.get('sdpa_cudnn_fwdbwd_ms'), 3)}", flush=True)
        torch.cuda.empty_cache()
    if not args.no_varlen:
        results["varlen"] = bench_varlen(args.warmup, args.iters)
        print({k: v for k, v in results["varlen"].items() if k != "lengths"}, flush=True)
    results["host"] = bench_host_overhead()
    print(results["host"], flush=True)
    if not args.no_sink:
        results["sink"] = bench_sink(args.warmup, args.iters)
        print(results["sink"], flush=True)
    if not args.no_mla:
        results["mla"] = bench_mla(args.warmup, args.iters)
        print(results["mla"], flush=True)
    if not args.no_quantizer and not args.only_extras:
        results["quantizer"] = bench_quantizer(args.warmup, args.iters)
    out_dir = args.out_dir or os.path.join("benchmarks", "results", gpu_dir_name(gpu))
    os.makedirs(out_dir, exist_ok=True)
    stem = "results_extras" if args.only_extras else "results"  # a partial run never overwrites the full one
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = markdown(results)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(md)
    if not args.only_extras:
        plot(results, os.path.join(out_dir, "chart.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
