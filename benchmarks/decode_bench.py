"""Decode-step attention over a KV cache: mxattn's paged MXFP8 cache read by the Triton paged kernel against
torch SDPA over a bf16 cache, same GPU, same run.

One decode step: each of `batch` sequences has `context` cached tokens and one new query token (Llama-like
heads: 32 query heads, 8 KV heads, head dim 128). Kernel times are GPU times: each step is captured in a CUDA
graph and its replays timed with CUDA events (triton.testing.do_bench, L2 flushed), as a serving loop replays
its decode step; the public calls are timed eagerly (host included), against SDPA's eager call:
  * sdpa_bf16_us: F.scaled_dot_product_attention(q [B, 32, 1, 128], K/V [B, 8, L, 128] bf16, enable_gqa=True),
    a dense contiguous cache (SDPA's best case: no page table);
  * mxfp8_kernel_us: the paged kernel alone (mxattn.kernels.triton_paged_attention) over the MXFP8 pages, with
    the split count it chooses (num_splits=0; `splits`), and mxfp8_one_split_us with num_splits=1 (the
    bit-exact single pass);
  * mxfp8_call_us: the public mxfp8_attention_with_kvcache call (checks, then the kernel; no append), with
    cu_seqlens_q on the GPU (read back each call) and, mxfp8_call_host_cu_us, on the CPU; sdpa_call_us: SDPA's
    eager call.
Ratios are mxfp8 / sdpa (time; target for the kernel: <= 1.0 at batch >= 8 and context >= 4k). Cache bytes per
token: MXFP8 pages (E4M3 + E8M0 scales, K and V) against bf16. Bandwidth: the bytes a step must read (the pages'
K and V bytes and scales, the open V rows, page-table entries, Q; `step_bytes`) over the kernel's GPU time, and
that as a fraction of the GPU's HBM bandwidth (from its memory clock and bus width where torch reports them, else
the nominal figure of the GPU's name). Contexts 1k to 128k (a row is skipped when its caches do not fit).
Capacity: how many sequences of 8k tokens each cache holds in one budget of cache memory (`capacity`).
Usage (CUDA machine): python benchmarks/decode_bench.py [--quick] [--out-dir DIR]"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import mxattn
from mxattn.runtime.triton_launch import sm_count
from mxattn.kernels.triton_paged_attention import choose_splits, paged_attention_fwd

HQ, HKV, D, PAGE = 32, 8, 128, 256
#: nominal HBM bandwidth (bytes/s) by GPU name, where torch does not report the memory clock and bus width
NOMINAL_HBM = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12, "NVIDIA H100 PCIe": 2.0e12}
#: the capacity row: sequences of CAPACITY_TOKENS tokens in CAPACITY_BUDGET bytes of cache memory
CAPACITY_TOKENS, CAPACITY_BUDGET = 8192, 32 << 30


def step_bytes(batch: int, context: int, hq: int = HQ, hkv: int = HKV, d: int = D, page: int = PAGE) -> int:
    """Bytes one decode step over the paged MXFP8 cache must read: per sequence and KV head, K's E4M3 bytes and
    one E8M0 scale per 32 channels of each token, V's sealed blocks (E4M3 bytes, one scale per 32 tokens and
    channel) and its open rows (bf16), one int32 page-table entry per page; Q's bf16 rows."""
    sealed = context - context % 32
    per_head = context * (d + d // 32) + sealed * d + (sealed // 32) * d + (context % 32) * d * 2
    return batch * (hkv * per_head + -(-context // page) * 4 + hq * d * 2)


def capacity(budget: int = CAPACITY_BUDGET, tokens: int = CAPACITY_TOKENS, hkv: int = HKV, d: int = D,
             page: int = PAGE) -> dict:
    """Sequences of `tokens` tokens that `budget` bytes of cache memory hold: a bf16 cache (K and V, 2 bytes per
    value) against `mxattn.MXFP8KVCache` (its pages' bytes and scales, and per sequence its open V block and
    page-table row, measured on a cache of that geometry)."""
    pages = -(-tokens // page)
    one = mxattn.MXFP8KVCache(num_pages=pages, page_size=page, kv_heads=hkv, head_dim=d, max_sequences=1)
    per_seq = one.nbytes()
    bf16 = tokens * hkv * d * 2 * 2
    return dict(budget_bytes=budget, tokens=tokens, bf16_sequences=budget // bf16, mxfp8_sequences=budget // per_seq,
                mxfp8_bytes_per_sequence=per_seq, bf16_bytes_per_sequence=bf16,
                ratio=(budget // per_seq) / (budget // bf16))


def hbm_bandwidth(device) -> tuple:
    """(bytes/s, where it came from) of the GPU's HBM: 2 x memory clock x bus width where torch reports them,
    else NOMINAL_HBM by name, else (None, "unknown")."""
    props = torch.cuda.get_device_properties(device)
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock and width:
        return 2 * clock * 1e3 * width / 8, "memory clock x bus width"
    nominal = NOMINAL_HBM.get(props.name)
    return (nominal, "nominal") if nominal else (None, "unknown")


def fill_cache(batch: int, context: int):
    """An MXFP8KVCache holding `batch` sequences of `context` random tokens, and the same K/V as bf16 [B,H,L,D]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = batch * -(-context // PAGE)
    cache = mxattn.MXFP8KVCache(num_pages=pages, page_size=PAGE, kv_heads=HKV, head_dim=D, max_sequences=batch,
                                device="cuda")
    k = torch.randn(batch, context, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, context, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    slots = []
    for b in range(batch):
        slots.append(cache.new_sequence())
        cache.append(slots[-1], k[b], v[b])
    return cache, slots, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def graph_us(fn) -> float:
    """GPU time of fn (a sequence of launches) in us: captured once in a CUDA graph and replayed under
    triton.testing.do_bench (L2 flushed between replays), so the host's launch cost is left out, as a serving
    loop that replays its decode step leaves it out."""
    from triton.testing import do_bench
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay) * 1e3


def measure(batch: int, context: int) -> dict:
    from triton.testing import do_bench
    cache, slots, k, v = fill_cache(batch, context)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q_thd = q[:, :, 0].contiguous()                                      # [T = B, Hq, D]
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    slots_t = torch.tensor(slots, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_thd)
    scale = D ** -0.5
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    kernel = lambda n=0: paged_attention_fwd(q_thd, cu, 1, slots_t, cache, softmax_scale=scale,  # noqa: E731
                                             left_bound=None, out=out, num_splits=n, max_seqlen_kv=context)
    call = lambda cu=cu: mxattn.mxfp8_attention_with_kvcache(q_thd, cache, slots, cu_seqlens_q=cu,  # noqa: E731
                                                             backend="triton")
    cu_host = cu.cpu()
    ref = sdpa()[:, :, 0].float()
    got = call().float()
    rel = ((got - ref).norm() / ref.norm()).item()
    kernel(1)
    one = out.float().clone()
    kernel(0)
    split_vs_one = ((out.float() - one).norm() / one.norm()).item()
    row = dict(batch=batch, context=context, sdpa_bf16_us=graph_us(sdpa), mxfp8_kernel_us=graph_us(kernel),
               splits=choose_splits(batch * HKV, -(-context // 128), sm_count(q.device)),
               mxfp8_one_split_us=graph_us(lambda: kernel(1)),
               sdpa_call_us=do_bench(sdpa) * 1e3,
               mxfp8_call_us=do_bench(call) * 1e3, mxfp8_call_host_cu_us=do_bench(lambda: call(cu_host)) * 1e3,
               rel_rms_vs_sdpa=rel, rel_rms_split_vs_one=split_vs_one,
               cache_bytes_per_token=cache.nbytes() / (batch * context),
               bf16_bytes_per_token=2 * HKV * D * 2)
    row["kernel_ratio"] = row["mxfp8_kernel_us"] / row["sdpa_bf16_us"]
    row["step_bytes"] = step_bytes(batch, context)
    row["kernel_GBps"] = row["step_bytes"] / row["mxfp8_kernel_us"] / 1e3
    peak, _ = hbm_bandwidth(q.device)
    row["hbm_fraction"] = row["kernel_GBps"] * 1e9 / peak if peak else None
    row["one_split_ratio"] = row["mxfp8_one_split_us"] / row["sdpa_bf16_us"]
    row["call_ratio"] = row["mxfp8_call_us"] / row["sdpa_call_us"]
    del cache, k, v
    torch.cuda.empty_cache()
    return row


def markdown(rows, device: str, cap: dict, hbm: tuple) -> str:
    lines = [f"# Decode-step attention over a KV cache ({device})", "",
             f"torch {torch.__version__}; Hq {HQ}, Hkv {HKV}, D {D}, page {PAGE} tokens; one query token per "
             "sequence; `python benchmarks/decode_bench.py`. Times in us (CUDA events, L2 flushed); ratio = mxfp8 / "
             "sdpa (target <= 1.0 at batch >= 8, context >= 4k). Kernel columns: CUDA-graph replays (GPU time); public "
             "call: eager (host included), its ratio against SDPA's eager call.", "",
             "| batch | context | SDPA bf16 cache | MXFP8 paged kernel (splits) | ratio | one split | ratio | SDPA eager call "
             "| public call | ratio | public call, cu_seqlens on the CPU | rel. RMS vs SDPA | split vs one split | bytes/token MXFP8 / "
             "bf16 | kernel GB/s | HBM fraction |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['sdpa_bf16_us']:.1f} | {r['mxfp8_kernel_us']:.1f} "
                     f"({r['splits']}) | {r['kernel_ratio']:.2f} | {r['mxfp8_one_split_us']:.1f} | "
                     f"{r['one_split_ratio']:.2f} | {r['sdpa_call_us']:.1f} | {r['mxfp8_call_us']:.1f} | "
                     f"{r['call_ratio']:.2f} | "
                     f"{r['mxfp8_call_host_cu_us']:.1f} | "
                     f"{r['rel_rms_vs_sdpa']:.3f} | {r['rel_rms_split_vs_one']:.1e} | "
                     f"{r['cache_bytes_per_token'] / r['bf16_bytes_per_token']:.3f} | {r['kernel_GBps']:.0f} | "
                     + ("-" if r["hbm_fraction"] is None else f"{r['hbm_fraction']:.2f}") + " |")
    peak, source = hbm
    lines += ["", "HBM bandwidth " + ("unknown" if peak is None else f"{peak / 1e12:.2f} TB/s ({source})")
              + "; kernel GB/s = bytes a step must read (pages, scales, open rows, page table, Q) / kernel time.",
              "", f"Capacity: in {cap['budget_bytes'] / 2**30:.0f} GiB of cache memory, {cap['bf16_sequences']} "
              f"sequences of {cap['tokens']} tokens in a bf16 cache, {cap['mxfp8_sequences']} in the MXFP8 cache "
              f"({cap['ratio']:.2f}x; {cap['mxfp8_bytes_per_sequence']} against {cap['bf16_bytes_per_sequence']} "
              "bytes per sequence)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8, contexts 1k and 4k only")
    ap.add_argument("--out-dir", default=None, help="default benchmarks/results/<gpu-name>/")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    grid = [(8, 1024), (8, 4096)] if args.quick else \
        [(b, c) for b in (1, 8, 64) for c in (1024, 4096, 16384, 32768, 131072)]
    rows = []
    for batch, context in grid:
        try:
            rows.append(measure(batch, context))
        except torch.cuda.OutOfMemoryError:  # (the bf16 and MXFP8 caches of this row do not fit together)
            torch.cuda.empty_cache()
            print(json.dumps(dict(batch=batch, context=context, skipped="out of memory")), flush=True)
            continue
        print(json.dumps(rows[-1]), flush=True)
    cap, hbm = capacity(), hbm_bandwidth(torch.device("cuda"))
    device = torch.cuda.get_device_name()
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                           device.lower().replace(" ", "-"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_bench.json"), "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, rows=rows, capacity=cap,
                       hbm_bytes_per_s=hbm[0], hbm_source=hbm[1]), f, indent=1)
    text = markdown(rows, device, cap, hbm)
    with open(os.path.join(out_dir, "decode_bench.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
