"""backend="cudnn" of `mxfp8_attention_with_kvcache`: cuDNN's paged MXFP8 SDPA graph (`mxattn.backends.cudnn.paged`).

CPU: the graphs are lowered without a GPU for SM 10.0 and cuDNN's own validation runs on them (page tables, page
pools, F8_128x4 scale pools); the variant pack a call builds from a cache matches the graph slot by slot and holds
the cache's definition (V's open blocks sealed into their pages from the rows they hold); off Blackwell the call
refuses before writing. Blackwell (SM 10.x, cuDNN >= 9.21): O against the reference backend's cache call.
"""

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

import mxattn  # noqa: E402
from mxattn.backends.cudnn import graphs as cg  # noqa: E402
from mxattn.backends.cudnn.buffers import col_scale_buffer, row_scale_buffer  # noqa: E402
from mxattn.backends.cudnn.config import col_scale_dims, col_scale_stride, row_scale_dims  # noqa: E402
from mxattn.backends.cudnn.paged import (PagedGraphConfig, PagedUid, build_paged_forward_graph,  # noqa: E402
                                         check_pack, paged_graph_refusal, paged_operands, require_paged_graph)
from mxattn.errors import MXFP8NotSupportedError  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402
from mxattn.metrics import rel_rms  # noqa: E402

needs_mxfp8_cudnn = pytest.mark.skipif(cudnn.backend_version() < 92100,
                                       reason=f"cuDNN {cudnn.backend_version()} < 9.21 cannot validate MXFP8 graphs")


def _band(left=None):
    return MaskSpec(diagonal_alignment="bottom_right", left_bound=left, right_bound=0)


CASES = {  # name: PagedGraphConfig keywords
    "decode_gqa_page128_d128": dict(b=4, h_q=32, h_kv=8, s_q=1, d=128, num_pages=32, page_size=128, max_pages=8),
    "chunk64_page64_d64_window": dict(b=2, h_q=8, h_kv=8, s_q=64, d=64, num_pages=16, page_size=64, max_pages=8,
                                      mask=_band(41)),
    "decode_sink_fp16_page256": dict(b=3, h_q=16, h_kv=4, s_q=1, d=128, num_pages=12, page_size=256, max_pages=4,
                                     out_dtype=torch.float16, sink=True),
    "speculative4_page32_d64": dict(b=8, h_q=8, h_kv=2, s_q=4, d=64, num_pages=64, page_size=32, max_pages=8),
}


@needs_mxfp8_cudnn
@pytest.mark.parametrize("name", list(CASES))
def test_paged_graph_lowers_with_the_cache_geometry_and_cudnn_gives_its_verdict(name):
    """The graph builds (the Python frontend's validate() accepts it) and lowers to cuDNN's C++ frontend without a
    GPU (SM 10.0); its JSON holds the page pools, the page tables [B, 1, max_pages, 1] int32, the F8_128x4 scale
    pools and the lengths as the slot specs say. cuDNN's own validation then gives its verdict: this machine's
    cuDNN (9.28) refuses MXFP8 SDPA over paged K/V, and the refusal names that."""
    cfg = PagedGraphConfig(attn_scale=0.125, **CASES[name])
    j = cg.graph_json(build_paged_forward_graph(cfg), validate=False)
    tensors = {t["uid"]: t for t in (j["tensors"].values() if isinstance(j["tensors"], dict) else j["tensors"])}
    pool = (cfg.num_pages, cfg.h_kv, cfg.page_size, cfg.d)
    assert tensors[PagedUid.K]["dim"] == list(pool) and tensors[PagedUid.V]["dim"] == list(pool)
    assert tensors[PagedUid.TABLE_K]["dim"] == [cfg.b, 1, cfg.max_pages, 1]
    assert tensors[PagedUid.TABLE_V]["data_type"] == "INT32"
    assert tensors[PagedUid.SF_K]["dim"] == list(row_scale_dims(*pool))
    sf_v = col_scale_dims(*pool)
    assert tensors[PagedUid.SF_V]["dim"] == list(sf_v) and tensors[PagedUid.SF_V]["stride"] == list(
        col_scale_stride(sf_v))
    assert all(tensors[u]["reordering_type"] == "F8_128x4" for u in (PagedUid.SF_Q, PagedUid.SF_K, PagedUid.SF_V))
    assert (PagedUid.SINK in tensors) == cfg.sink
    for uid, (shape, stride, _) in cfg.specs.items():
        assert tensors[uid]["dim"] == list(shape) and tensors[uid]["stride"] == list(stride), PagedUid(uid).name
    refusal = paged_graph_refusal(cfg)
    if cudnn.backend_version() // 100 <= 928:       # 9.28.x and before: refused (measured)
        assert refusal is not None and "paged" in refusal, refusal
    if refusal is not None:
        with pytest.raises(MXFP8NotSupportedError) as err:
            require_paged_graph(cfg, torch.device("cuda"))
        assert "refuses its MXFP8 SDPA graph over paged K/V" in str(err.value) and refusal in str(err.value)


@pytest.mark.parametrize("bad,match", [(dict(page_size=48), "multiple of 32"), (dict(h_q=6), "divisible"),
                                       (dict(mask=MaskSpec(causal=True)), "bottom-right"),
                                       (dict(out_dtype=torch.float32), "out_dtype"), (dict(s_q=0), "s_q")])
def test_config_rejects_bad_values(bad, match):
    kw = dict(CASES["decode_gqa_page128_d128"], attn_scale=0.1)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        PagedGraphConfig(**kw)


def _filled_cache(lengths, page_size=64, d=64, hkv=2, seed=0):
    cache = mxattn.MXFP8KVCache(num_pages=16, page_size=page_size, kv_heads=hkv, head_dim=d,
                                max_sequences=len(lengths) + 1)
    g = torch.Generator().manual_seed(seed)
    cache.new_sequence()                     # slot 0 unused: the call's slots are not 0..B-1
    slots = [cache.new_sequence() for _ in lengths]
    for s, n in zip(slots, lengths):
        for chunk in (n // 2, n - n // 2):   # two appends: a block sealed across calls
            cache.append(s, torch.randn(chunk, hkv, d, generator=g).bfloat16(),
                         torch.randn(chunk, hkv, d, generator=g).bfloat16() * 3)
    return cache, slots


def test_variant_pack_matches_the_graph_and_holds_the_caches_definition():
    """paged_operands on a CPU cache: every slot has the graph's shape, strides and dtype; V's pages read through
    the page table give each sequence's `cache.values(slot)` bytes (open blocks sealed from the rows they hold,
    the rest of the block zero); Q's padded rows are the queries quantized row-wise, the padding zero; the row
    index picks the queries back."""
    lengths = (45, 64, 7)
    cache, slots = _filled_cache(lengths)
    hq, d = 4, 64
    cu = [0, 1, 4, 6]                                    # 1, 3 and 2 new queries
    q = torch.randn(cu[-1], hq, d).bfloat16()
    cfg = PagedGraphConfig(b=3, h_q=hq, h_kv=2, s_q=3, d=d, num_pages=16, page_size=64,
                           max_pages=cache.page_table.shape[1], attn_scale=0.125)
    pack, rows = paged_operands(cfg, q, cu, cache, slots)
    check_pack(cfg, pack)
    assert rows.tolist() == [0, 3, 4, 5, 6, 7]
    for i, (s, n) in enumerate(zip(slots, lengths)):
        want = cache.values(s)                          # [1, H, L, D] bytes, scales [1, H, ceil(L/32), D]
        pages = [cache._pages[s][p // 64] for p in range(n)]
        got = torch.stack([cache.v_data[pg, :, p % 64] for p, pg in zip(range(n), pages)], dim=1)
        assert torch.equal(got.view(torch.uint8), want.data[0].view(torch.uint8))
        blocks = torch.stack([cache.v_scale[cache._pages[s][(32 * j) // 64], :, (32 * j) % 64 // 32]
                              for j in range(-(-n // 32))], dim=1)
        assert torch.equal(blocks.view(torch.uint8), want.scale[0].view(torch.uint8))
        if n % 32:                                   # the open block's rows past the length are zero
            last = n - n % 32
            page, off = cache._pages[s][last // 64], last % 64
            assert not cache.v_data.view(torch.uint8)[page, :, off + n % 32:off + 32].any()
        table = pack[PagedUid.TABLE_K][i, 0, :len(cache._pages[s]), 0].tolist()
        assert table == cache._pages[s]
    assert pack[PagedUid.SEQ_LEN_KV].flatten().tolist() == list(lengths)
    assert pack[PagedUid.SEQ_LEN_Q].flatten().tolist() == [1, 3, 2]
    qq = quantize_mxfp8(q, axis=-1)
    qdata = pack[PagedUid.Q].permute(0, 2, 1, 3).reshape(9, hq, d).view(torch.uint8)
    assert torch.equal(qdata.index_select(0, rows), qq.data.view(torch.uint8))
    assert not qdata[[1, 2, 8]].any()
    assert torch.equal(pack[PagedUid.SF_K], row_scale_buffer(cache.k_scale))
    assert torch.equal(pack[PagedUid.SF_V].view(torch.uint8), col_scale_buffer(cache.v_scale).view(torch.uint8))
    with pytest.raises(ValueError, match="TABLE_K"):
        check_pack(cfg, {**pack, int(PagedUid.TABLE_K): pack[PagedUid.TABLE_K][:, :, :1]})


def test_cudnn_backend_refuses_off_blackwell_before_writing():
    cache, slots = _filled_cache((40,))
    before = cache.v_tail.clone(), cache.length(slots[0])
    k = torch.randn(1, 2, 64).bfloat16()
    with pytest.raises(MXFP8NotSupportedError, match="backend 'cudnn'.*(refuses|Blackwell)"):
        mxattn.mxfp8_attention_with_kvcache(torch.randn(1, 4, 64).bfloat16(), cache, slots,
                                            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), k_new=k,
                                            v_new=k, backend="cudnn")
    assert torch.equal(cache.v_tail, before[0]) and cache.length(slots[0]) == before[1]


def _blackwell_ready():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        return False, "needs a Blackwell (SM 10.x) GPU"
    from mxattn.backends.cudnn.support import cudnn_support
    return cudnn_support()


@pytest.mark.blackwell
@pytest.mark.parametrize("kw", [dict(), dict(window_size=(40, 0)), dict(softmax_type="off-by-one"),
                                dict(softmax_type="learnable", softmax_offset=[0.5, -1.0, 2.0, 0.0])])
@torch.no_grad()
def test_cudnn_paged_forward_agrees_with_the_reference_cache_call(kw):
    """Prefill chunks, decode steps across block and page boundaries and a 3-token chunk through cuDNN's paged
    graph, each step against the reference backend's call on the same cache (the tolerance the dense cudnn
    backend keeps against ref: cuDNN's forward may scale P by 16 with lazy rescaling)."""
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    hq, hkv, d = 4, 2, 64
    kw = dict(kw)
    if "softmax_offset" in kw:
        kw["softmax_offset"] = torch.tensor(kw["softmax_offset"], device="cuda")
    cache = mxattn.MXFP8KVCache(num_pages=32, page_size=64, kv_heads=hkv, head_dim=d, max_sequences=3,
                                device="cuda")
    slots = [cache.new_sequence() for _ in range(3)]
    g = torch.Generator(device="cuda").manual_seed(3)
    for step, counts in enumerate([(200, 45, 7)] + [(1, 1, 1)] * 40 + [(3, 0, 3)]):
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        q, k, v = (torch.randn(cu[-1], h, d, generator=g, device="cuda").bfloat16() for h in (hq, hkv, hkv))
        cu_t = torch.tensor(cu, dtype=torch.int32)
        got = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu_t, k_new=k, v_new=v,
                                                  backend="cudnn", **kw)
        want = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu_t, backend="reference", **kw)
        torch.testing.assert_close(got.float(), want.float(), atol=0.12, rtol=0.2)
        assert rel_rms(got, want) < 0.03, f"step {step}: O rel RMS {rel_rms(got, want):.4f}"
