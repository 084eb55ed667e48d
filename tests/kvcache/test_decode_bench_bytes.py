"""The decode benchmark's byte counts, checked against the cache itself on the CPU: the bytes a decode step must
read (`decode_bench.step_bytes`, the numerator of its bandwidth column) are the pages' bytes and scales of the
sequences' tokens, their open V rows, page-table entries and Q; the capacity row counts whole sequences of a
cache of that geometry."""

import sys

import pytest
import torch

import mxattn
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
decode_bench = pytest.importorskip("decode_bench")


@pytest.mark.parametrize("batch,context", [(1, 1024), (8, 4096), (3, 1000)])
def test_step_bytes_are_the_bytes_of_the_sequences_pages_open_rows_table_and_queries(batch, context):
    hq, hkv, d, page = decode_bench.HQ, decode_bench.HKV, decode_bench.D, decode_bench.PAGE
    pages = -(-context // page)
    cache = mxattn.MXFP8KVCache(num_pages=batch * pages, page_size=page, kv_heads=hkv, head_dim=d,
                                max_sequences=batch)
    slots = [cache.new_sequence() for _ in range(batch)]
    for s in slots:
        cache.append(s, torch.randn(context, hkv, d).bfloat16(), torch.randn(context, hkv, d).bfloat16())
    sealed = context - context % 32
    k_bytes = batch * context * hkv * (d + d // 32)                 # E4M3 rows and their row-wise scales
    v_bytes = batch * hkv * (sealed * d + sealed // 32 * d)         # sealed blocks and their column-wise scales
    open_rows = batch * hkv * (context % 32) * d * cache.v_tail.element_size()
    table, queries = batch * pages * cache.page_table.element_size(), batch * hq * d * 2
    assert decode_bench.step_bytes(batch, context) == k_bytes + v_bytes + open_rows + table + queries
    if context % page == 0:  # every page full: the pages' bytes and scales are the K and V terms above
        stored = sum(t.numel() * t.element_size() for t in (cache.k_data, cache.k_scale, cache.v_data, cache.v_scale))
        assert stored == k_bytes + v_bytes


def test_the_mxfp8_cache_holds_about_twice_the_sequences_of_a_bf16_cache():
    cap = decode_bench.capacity(budget=8 << 30, tokens=8192)
    assert cap["bf16_sequences"] == (8 << 30) // (8192 * decode_bench.HKV * decode_bench.D * 4)
    assert cap["mxfp8_bytes_per_sequence"] * cap["mxfp8_sequences"] <= 8 << 30
    assert 1.9 <= cap["ratio"] < 2.0  # (E4M3 bytes plus one E8M0 scale per 32 values: 0.516x bf16's bytes)
