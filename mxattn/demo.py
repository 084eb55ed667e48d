"""`python -m mxattn demo`: MXFP8 attention forward+backward on the best backend this machine has.

Prints the relative-RMS error of O, dQ, dK, dV against FP64 attention and against BF16 attention
(torch SDPA), the backend used and the time taken, each step as it runs. The default shape depends on the
device: B1 H8 S1024 D128 on a CUDA GPU, B1 H8 S256 D128 on the CPU (the pure-PyTorch reference backend, sized
to finish in a few seconds).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

from .attention import mxfp8_attention
from .backends import Problem, pick_backend
from .errors import MXFP8NotSupportedError
from .mask import MaskSpec
from .formats import quantize_mxfp8
from .metrics import rel_rms


#: default shapes (batch, heads, seq, head_dim) by device type: the CPU runs the pure-PyTorch reference backend
DEFAULTS = {"cuda": dict(batch=1, heads=8, seq=1024, head_dim=128),
            "cpu": dict(batch=1, heads=8, seq=256, head_dim=128)}


def _sdpa_grads(q, k, v, do, causal: bool, dtype):
    """torch SDPA in `dtype` on [B,H,S,D] inputs -> (o, dq, dk, dv) as float64."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(groups, dim=1) for t in leaves[1:])
    o = F.scaled_dot_product_attention(leaves[0], kk, vv, is_causal=causal)
    o.backward(do.to(dtype))
    return [t.double() for t in (o.detach(), *(leaf.grad for leaf in leaves))]


def backend_line(device: torch.device, name: str, asked: str = "auto") -> str:
    """One short line: which backend runs on `device` and why (full reasons: `python -m mxattn info`)."""
    if asked != "auto":
        why = "asked for"
    elif name == "cudnn":
        why = "cuDNN's MXFP8 kernels on Blackwell"
    elif device.type != "cuda":
        why = "no CUDA device"
    elif name == "triton":
        major, minor = torch.cuda.get_device_capability(device)
        why = f"sm_{major}{minor}: cuDNN's MXFP8 kernels need Blackwell, Triton emulates them"
    else:
        why = "neither cudnn nor triton can run this call"
    return f"{device.type}: {name} backend ({why})"


def run(batch=1, heads=8, kv_heads=None, seq=1024, head_dim=128, causal=False, backend="auto", device=None,
        seed=0, log=None):
    """Run the demo once; returns a dict with the backend, timings and the error table. log: None, or a function
    called with one line of text per step as it runs (the backend chosen, forward, backward, the references)."""
    log = log or (lambda line: None)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kv_heads = kv_heads or heads
    shape = f"B{batch} H{heads}/{kv_heads} S{seq} D{head_dim} {'causal' if causal else 'no mask'}"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape_q, shape_kv = (batch, heads, seq, head_dim), (batch, kv_heads, seq, head_dim)
    q, k, v = (torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in (shape_q, shape_kv, shape_kv))
    do = torch.randn(shape_q, generator=gen).to(device, torch.bfloat16)
    problem = Problem(device=device, dtype=torch.bfloat16, batch=batch, heads_q=heads, heads_kv=kv_heads,
                      seqlen_q=seq, seqlen_kv=seq, head_dim=head_dim, mask=MaskSpec(causal=causal),
                      needs_backward=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one line below says which backend runs and why
        name = pick_backend(backend, problem)
    reason = backend_line(device, name, backend)
    log(f"mxattn demo: MXFP8 attention, {shape}, bf16 inputs, device {device}")
    log(f"{reason}; `python -m mxattn info` gives every backend's reasons")

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = "causal" if causal else "no_mask"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":  # one untimed call compiles kernels / builds graphs
        log("warm-up call (compiles the kernels / builds the graphs once)...")
        mxfp8_attention(*leaves, qkv_format="bhsd", attn_mask_type=mask, backend=name).backward(do)
        for leaf in leaves:
            leaf.grad = None
    sync()
    t0 = time.perf_counter()
    o = mxfp8_attention(*leaves, qkv_format="bhsd", attn_mask_type=mask, backend=name)
    sync()
    t1 = time.perf_counter()
    log(f"forward: quantize Q, K, V to MXFP8 and attend ({(t1 - t0) * 1e3:.1f} ms)")
    o.backward(do)
    sync()
    t2 = time.perf_counter()
    log(f"backward: dQ, dK, dV ({(t2 - t1) * 1e3:.1f} ms)")
    mx = [o.detach(), *(leaf.grad for leaf in leaves)]

    log("references: torch SDPA in FP64 and in BF16, forward and backward...")
    exact = _sdpa_grads(q, k, v, do, causal, torch.float64)
    bf16 = _sdpa_grads(q, k, v, do, causal, torch.bfloat16)
    # what one MXFP8 rounding costs these inputs (blocks along D): the scale of the errors to expect below
    operand_error = max(rel_rms(quantize_mxfp8(t, axis=-1).dequantize(torch.float64), t.double()) for t in (q, k, v))
    rows = []
    for i, label in enumerate(("O", "dQ", "dK", "dV")):
        rows.append((label, rel_rms(mx[i], exact[i]), rel_rms(mx[i], bf16[i]), rel_rms(bf16[i], exact[i])))
    return dict(backend=name, reason=reason, device=str(device), fwd_s=t1 - t0, bwd_s=t2 - t1, rows=rows,
                shape=shape, operand_error=operand_error)


def _device_error(device: str):
    """None when torch can use `device`, else the one-line reason."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        return f"--device {device!r} is not a device ({exc})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        return f"--device {device}: {why}; run without --device (the CPU and the reference backend) or on a GPU"
    if dev.type not in ("cpu", "cuda"):
        return f"--device {device}: the demo runs on cpu or cuda"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mxattn demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu, cpu = DEFAULTS["cuda"], DEFAULTS["cpu"]
    parser.add_argument("--batch", type=int, default=None,
                        help=f"batch size (default {gpu['batch']} on a GPU, {cpu['batch']} on the CPU)")
    parser.add_argument("--heads", type=int, default=None,
                        help=f"query heads (default {gpu['heads']} on a GPU, {cpu['heads']} on the CPU)")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads, dividing --heads (default: --heads; fewer is GQA)")
    parser.add_argument("--seq", type=int, default=None,
                        help=f"sequence length of q and k/v (default {gpu['seq']} on a GPU, {cpu['seq']} on the CPU)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help=f"head dimension (default {gpu['head_dim']} on a GPU, {cpu['head_dim']} on the CPU)")
    parser.add_argument("--causal", action="store_true", help="causal mask (default: no mask)")
    parser.add_argument("--backend", default="auto", choices=("auto", "cudnn", "triton", "reference"),
                        help="mxattn backend (default auto: the best this machine has)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = parser.parse_args(argv)
    if args.device is not None and _device_error(args.device):
        parser.exit(2, f"python -m mxattn demo: error: {_device_error(args.device)}\n")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for name, value in DEFAULTS[torch.device(device).type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("batch", "heads", "seq", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    print(f"mxattn demo: running B{args.batch} H{args.heads} S{args.seq} D{args.head_dim} on {device} "
          "(MXFP8 forward + backward, then FP64 and BF16 references)...", flush=True)
    try:
        result = run(args.batch, args.heads, args.kv_heads, args.seq, args.head_dim, args.causal, args.backend,
                     device, log=lambda line: print(line, flush=True))
    except (MXFP8NotSupportedError, ValueError, TypeError) as exc:
        parser.exit(2, f"python -m mxattn demo: error: {exc}\n")
    print(f"time: forward {result['fwd_s'] * 1e3:.1f} ms, backward {result['bwd_s'] * 1e3:.1f} ms")
    print()
    print("relative RMS error        MXFP8 vs FP64   MXFP8 vs BF16   (BF16 vs FP64)")
    for label, vs64, vs16, base in result["rows"]:
        print(f"  {label:<22} {vs64:>13.3e}   {vs16:>13.3e}   {base:>13.3e}")
    worst = max(vs64 / base for _, vs64, _, base in result["rows"] if base > 0)
    print(f"(one MXFP8 rounding of these Q, K, V costs {result['operand_error']:.2e} relative RMS; the outputs "
          f"carry a few such roundings (Q, K, V, P, dO, dS), so MXFP8's errors against FP64 are of that order, "
          f"here up to {worst:.0f}x BF16's)")
    if result["device"] == "cpu":
        print("(times are the pure-PyTorch reference backend on the CPU, not a GPU kernel's speed; "
              "--seq 1024 runs the GPU's default shape)")
    return 0
