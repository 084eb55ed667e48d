"""Tuning run of the paged kernel's decode path: time per decode step of its configurations against
torch SDPA over a bf16 cache, same GPU, same run. Rows: the exact single pass (num_splits=1: its tile, checked
bit-equal to the dense path's 128-row / 8-warp tile), the exact (dequantizing) path on the 16-row tile (the
decode path before `triton_paged_decode`), then the decode path (DECODE) with the automatic split count under
(num_warps, num_stages) variants, with 256-token pages (one page-table read per block) and 64-token
pages (a gather per token); agreement of the default with the exact pass (max bf16 ulps, share equal).
Heads as benchmarks/decode_bench.py; GPU times of CUDA-graph replays (`decode_bench.graph_us`). --ncu: one
fast-tile call at batch 64 (or $NCU_BATCH) / 4k for Nsight Compute (`-k regex:_paged_attn`: both data paths
are `_paged_attn_kernel`; `_paged` alone also catches the append kernel). --splits: instead, the fast tile's
time per split count (the automatic choice first) at batch 1, 8, 64 and contexts 1k-32k; --cap N adds a register
cap of N per thread to the decode path's build (`DECODE_MAXNREG`) for that sweep.
Usage (CUDA machine): python benchmarks/paged_decode_tuning.py [--ncu | --splits [--cap N]]"""
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_bench as db  # noqa: E402
from mxattn.kernels import triton_paged_attention as tp  # noqa: E402
from mxattn.metrics import bf16_ulps  # noqa: E402

VARIANTS = [(4, 2, None), (4, 3, None), (4, 2, 128), (4, 3, 128), (4, 2, 168), (8, 2, 128)]


def setup(batch, context, page):
    db.PAGE = page
    cache, slots, k, v = db.fill_cache(batch, context)
    q = torch.randn(batch, db.HQ, db.D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def run(n):
        tp.paged_attention_fwd(q, cu, 1, slots_t, cache, softmax_scale=db.D ** -0.5, left_bound=None, out=out,
                               num_splits=n, max_seqlen_kv=context)
        return out
    return run, q, k, v


SPLITS = (1, 2, 4, 8, 16, 32, 64)


def split_sweep(cap=None):
    """Time per decode step of the fast tile per split count, against the automatic choice and SDPA (cap: the
    decode path's register cap, None for the library's)."""
    if cap is not None:
        tp.DECODE_MAXNREG = cap
    print(f"{torch.cuda.get_device_name()}: decode step, Hq {db.HQ} Hkv {db.HKV} D {db.D}, page 256, "
          f"register cap {tp.DECODE_MAXNREG}, us")
    print("batch context | sdpa | auto (splits) | " + " | ".join(f"{n} splits" for n in SPLITS) + " | best")
    for batch, context in ((1, 1024), (1, 4096), (1, 32768), (8, 1024), (8, 4096), (8, 16384), (64, 4096),
                           (64, 16384)):
        run, q, k, v = setup(batch, context, 256)
        sdpa = db.graph_us(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
        k = v = None
        programs = batch * db.HKV * triton.cdiv(db.HQ // db.HKV, tp.tile_heads(db.HQ // db.HKV, tp.FAST_TILE[0]))
        auto = tp.choose_splits(programs, triton.cdiv(context, tp.BLOCK_N), tp.sm_count(q.device))
        t_auto = db.graph_us(lambda: run(0))
        times = {n: db.graph_us(lambda: run(n)) for n in SPLITS if n * tp.BLOCK_N <= context}
        best = min(times, key=times.get)
        print(f"{batch:5d} {context:7d} | {sdpa:6.1f} | {t_auto:6.1f} ({auto}) | "
              + " | ".join(f"{times[n]:6.1f}" if n in times else "   -  " for n in SPLITS)
              + f" | {best} ({sdpa / times[best]:.2f}x sdpa's speed)", flush=True)
        torch.cuda.empty_cache()


def main():
    if "--splits" in sys.argv:
        split_sweep(int(sys.argv[sys.argv.index("--cap") + 1]) if "--cap" in sys.argv else None)
        return
    if "--ncu" in sys.argv:
        batch = int(os.environ.get("NCU_BATCH", 64))
        run, *_ = setup(batch, 4096, 256)
        for _ in range(3):
            run(0)
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}: decode step, Hq {db.HQ} Hkv {db.HKV} D {db.D}, us")
    real_exact, real_fast = tp.paged_config, tp.FAST_TILE
    print("batch context | sdpa | exact (= 128x8 tile) | dequantizing path on the decode tile | decode path, "
          "(warps, stages, register cap): " + " | ".join(map(str, VARIANTS)) + " | page 64 | default vs exact: max ulps, equal share")
    for batch, context in ((1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 4096), (64, 16384)):
        run, q, k, v = setup(batch, context, 256)
        sdpa = db.graph_us(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
        tp.paged_config = lambda d, ex=True, rows=0: (128, 8, 2) if ex else real_exact(d, ex, rows)
        dense_tile = run(1).clone()
        tp.paged_config = real_exact
        exact = run(1).clone()
        t_exact = db.graph_us(lambda: run(1))
        real_launch = tp.launch  # the exact (dequantizing) path on the fast tile: the decode path before DECODE
        tp.launch = lambda fn, grid, *a, **kw: real_launch(
            fn, grid, *a, **(dict(kw, DECODE=False) if fn is tp._paged_attn_kernel else kw))
        t_dequant = db.graph_us(lambda: run(0))
        tp.launch = real_launch
        times = []
        for warps, stages, maxnreg in VARIANTS:
            tp.FAST_TILE, tp.DECODE_MAXNREG = (16, warps, stages), maxnreg
            times.append(db.graph_us(lambda: run(0)))
        tp.FAST_TILE, tp.DECODE_MAXNREG = real_fast, None
        got = run(0).float()
        ulps = bf16_ulps(got, exact)
        k = v = None  # free the bf16 cache before the next one
        run, *_ = setup(batch, context, 64)
        t64 = db.graph_us(lambda: run(0))
        print(f"{batch:5d} {context:7d} | {sdpa:6.1f} | {t_exact:7.1f} ({torch.equal(exact, dense_tile)}) | "
              f"{t_dequant:6.1f} | " + " | ".join(f"{t:6.1f}" for t in times)
              + f" | {t64:6.1f} | {ulps.max().item():.0f}, {(got == exact.float()).float().mean().item():.4f}",
              flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
