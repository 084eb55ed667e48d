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
token: MXFP8 pages (E4M3 + E8M0 scales, K and V) against bf16.
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
    row["one_split_ratio"] = row["mxfp8_one_split_us"] / row["sdpa_bf16_us"]
    row["call_ratio"] = row["mxfp8_call_us"] / row["sdpa_call_us"]
    del cache, k, v
    torch.cuda.empty_cache()
    return row


def markdown(rows, device: str) -> str:
    lines = [f"# Decode-step attention over a KV cache ({device})", "",
             f"torch {torch.__version__}; Hq {HQ}, Hkv {HKV}, D {D}, page {PAGE} tokens; one query token per "
             "sequence; `python benchmarks/decode_bench.py`. Times in us (CUDA events, L2 flushed); ratio = mxfp8 / "
             "sdpa (target <= 1.0 at batch >= 8, context >= 4k). Kernel columns: CUDA-graph replays (GPU time); public "
             "call: eager (host included), its ratio against SDPA's eager call.", "",
             "| batch | context | SDPA bf16 cache | MXFP8 paged kernel (splits) | ratio | one split | ratio | SDPA eager call "
             "| public call | ratio | public call, cu_seqlens on the CPU | rel. RMS vs SDPA | split vs one split | bytes/token MXFP8 / "
             "bf16 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['sdpa_bf16_us']:.1f} | {r['mxfp8_kernel_us']:.1f} "
                     f"({r['splits']}) | {r['kernel_ratio']:.2f} | {r['mxfp8_one_split_us']:.1f} | "
                     f"{r['one_split_ratio']:.2f} | {r['sdpa_call_us']:.1f} | {r['mxfp8_call_us']:.1f} | "
                     f"{r['call_ratio']:.2f} | "
                     f"{r['mxfp8_call_host_cu_us']:.1f} | "
                     f"{r['rel_rms_vs_sdpa']:.3f} | {r['rel_rms_split_vs_one']:.1e} | "
                     f"{r['cache_bytes_per_token'] / r['bf16_bytes_per_token']:.3f} |")
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
        [(b, c) for b in (1, 8, 64) for c in (1024, 4096, 16384, 32768)]
    rows = []
    for batch, context in grid:
        rows.append(measure(batch, context))
        print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name()
    out_dir = args.out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                           device.lower().replace(" ", "-"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode_bench.json"), "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, rows=rows), f, indent=1)
    text = markdown(rows, device)
    with open(os.path.join(out_dir, "decode_bench.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
