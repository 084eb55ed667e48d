"""Context-parallel MXFP8 attention: forward+backward time, tokens/s per GPU and memory per GPU against the
single-GPU call on the whole sequence, in the same run.

Launched with torchrun, one process per GPU (NCCL). For each total length L and comm type, every rank holds its
load-balanced shard (2 chunks of L / (2 * ranks) tokens) of q, k, v [1, L / ranks, H, D] bf16 and runs
`mxattn.context_parallel_attention` forward and backward; the time is the slowest rank's median over --reps
(CUDA events, after warm-up). The baseline is `mxattn.mxfp8_attention` on the whole length on rank 0 alone
("-" where it does not fit). Scaling efficiency = single-GPU time / (ranks * context-parallel time): 1.0 when
the work splits perfectly and the communication is hidden. With one process the rows measure the
context-parallel path's own cost over the plain call (its overhead).

    torchrun --nproc-per-node 2 benchmarks/context_parallel_bench.py                  # 32k, 64k, 128k causal
    torchrun --nproc-per-node 1 benchmarks/context_parallel_bench.py --lengths 32768  # one-rank overhead
    torchrun --nproc-per-node 2 benchmarks/context_parallel_bench.py --device cpu --lengths 256 --heads 4 \
        --kv-heads 2 --dim 64 --reps 1 --no-write                                         # a CPU smoke run

Writes benchmarks/results/<gpu>/context_parallel.json and .md (rank 0; --no-write to skip).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

try:
    import mxattn
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mxattn
from mxattn.bench import gpu_dir_name
from mxattn.context_parallel import shard_sequence


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--comm-types", nargs="+", default=["p2p", "all_gather", "a2a"],
                   choices=("p2p", "all_gather", "a2a"))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--mask", default="causal", choices=("causal", "no_mask"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--no-write", dest="write", action="store_false")
    p.add_argument("--out-dir", default=None, help="default benchmarks/results/<gpu-name>/")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(step, reps: int, device: torch.device) -> float:
    """Median wall time of step() (one warm-up call first), the device synchronised around each call."""
    step()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _inputs(length: int, args, device: torch.device, generator_seed: int):
    g = torch.Generator(device="cpu").manual_seed(generator_seed)
    shape_q, shape_kv = (1, length, args.heads, args.dim), (1, length, args.kv_heads, args.dim)
    q = torch.randn(shape_q, generator=g).to(device, torch.bfloat16)
    k = torch.randn(shape_kv, generator=g).to(device, torch.bfloat16)
    v = torch.randn(shape_kv, generator=g).to(device, torch.bfloat16)
    return q, k, v


def _fwd_bwd(fn, q, k, v):
    """A step: fn's forward and backward with a fixed dO (gradients w.r.t. q, k, v)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
    return step


def _peak_bytes(step, device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def measure_single(length: int, args, device: torch.device) -> dict:
    """Rank 0's whole-sequence call: {"ms", "peak_mib"} or {"error"} (out of memory)."""
    q, k, v = _inputs(length, args, device, 0)
    step = _fwd_bwd(lambda a, b, c: mxattn.mxfp8_attention(a, b, c, attn_mask_type=args.mask, backend=args.backend),
                    q, k, v)
    try:
        ms = _median_seconds(step, args.reps, device) * 1e3
        return dict(ms=ms, peak_mib=_peak_bytes(step, device) / 2**20)
    except torch.OutOfMemoryError:
        return dict(error="out of memory")


def measure_cp(length: int, comm_type: str, args, device: torch.device) -> dict:
    """This rank's context-parallel step: {"ms" (slowest rank), "peak_mib" (largest rank)}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = (shard_sequence(t, world, rank, seq_dim=1) for t in _inputs(length, args, device, 0))
    ranks = list(range(world))

    def call(a, b, c):
        return mxattn.context_parallel_attention(a, b, c, cp_group=dist.group.WORLD, cp_global_ranks=ranks,
                                                 cp_comm_type=comm_type, attn_mask_type=args.mask,
                                                 backend=args.backend)
    step = _fwd_bwd(call, q, k, v)
    ms = _median_seconds(step, args.reps, device) * 1e3
    peak = _peak_bytes(step, device) / 2**20
    worst = torch.tensor([ms, peak], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(ms=worst[0].item(), peak_mib=worst[1].item())


def markdown(rows, device_name: str, world: int, args) -> str:
    lines = [f"# Context-parallel MXFP8 attention, {world} x {device_name}", "",
             f"H {args.heads}/{args.kv_heads} D {args.dim}, {args.mask}, bf16, forward+backward; time: the slowest "
             "rank's median; efficiency = single-GPU time / (ranks x context-parallel time).", "",
             "| tokens | comm type | ms | tokens/s per GPU | efficiency | peak MiB per GPU | single-GPU ms | "
             "single-GPU peak MiB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        single = r["single"]
        eff = f"{single['ms'] / (world * r['ms']):.2f}" if "ms" in single else "-"
        lines.append(f"| {r['tokens']} | {r['comm_type']} | {r['ms']:.2f} | {r['tokens_per_s_per_gpu']:.0f} | {eff} | "
                     f"{r['peak_mib']:.0f} | {single.get('ms', float('nan')):.2f} | "
                     f"{single.get('peak_mib', float('nan')):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("launch with torchrun, e.g. torchrun --nproc-per-node 2 benchmarks/context_parallel_bench.py",
              file=sys.stderr)
        return 2
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA GPU: pass --device cpu for a smoke run", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    try:
        for length in args.lengths:
            single = measure_single(length, args, device) if rank == 0 else {}
            dist.barrier()
            for comm_type in args.comm_types:
                if comm_type == "a2a" and (args.heads % world or args.kv_heads % world):
                    continue
                row = dict(tokens=length, comm_type=comm_type, ranks=world, single=single,
                           **measure_cp(length, comm_type, args, device))
                row["tokens_per_s_per_gpu"] = length / world / (row["ms"] / 1e3)
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
        if rank == 0:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            text = markdown(rows, name, world, args)
            print(text)
            if args.write:
                out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                       gpu_dir_name(name))
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, "context_parallel.json"), "w") as f:
                    json.dump(dict(device=name, ranks=world, torch=torch.__version__, args=vars(args), rows=rows),
                              f, indent=1)
                with open(os.path.join(out_dir, "context_parallel.md"), "w") as f:
                    f.write(text)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
