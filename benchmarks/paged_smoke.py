"""Smoke run of the paged KV-cache kernel on a CUDA GPU, stage by stage with timings (a hang or a fault shows
where): one split vs the dense triton call, then split KV. Usage: python benchmarks/paged_smoke.py"""
import faulthandler
import sys
import time

import torch

import mxattn

faulthandler.dump_traceback_later(90, exit=True)


def stage(name, fn):
    t = time.time()
    print(f"{name} ...", flush=True)
    out = fn()
    torch.cuda.synchronize()
    print(f"{name}: {time.time() - t:.1f} s", flush=True)
    faulthandler.dump_traceback_later(90, exit=True)
    return out


def case(d, hq, hkv, n, nq, splits):
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = mxattn.MXFP8KVCache(num_pages=64, page_size=64, kv_heads=hkv, head_dim=d, max_sequences=1, device="cuda")
    s = cache.new_sequence()
    k = torch.randn(n, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(n, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    cache.append(s, k, v)
    q = torch.randn(nq, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    cu = torch.tensor([0, nq], dtype=torch.int32, device="cuda")
    got = stage(f"paged d{d} {hq}:{hkv} n{n} q{nq} splits{splits}", lambda: mxattn.mxfp8_attention_with_kvcache(
        q, cache, [s], cu_seqlens_q=cu, backend="triton", num_splits=splits))
    want = stage("dense", lambda: mxattn.mxfp8_attention(q[None], k[None], v[None], attn_mask_type="causal_bottom_right",
                                                         backend="triton")[0])
    print("equal:", torch.equal(got, want), "max diff", (got.float() - want.float()).abs().max().item(), flush=True)


print(torch.cuda.get_device_name(), flush=True)
case(64, 2, 1, 40, 1, 1)
case(128, 8, 2, 700, 1, 1)
case(128, 8, 2, 700, 5, 1)
case(128, 8, 2, 3000, 1, 4)
case(64, 6, 2, 3000, 3, 0)
sys.exit(0)
