"""mxattn.MXFP8KVCache and mxfp8_attention_with_kvcache (reference backend, CPU): every step equals
mxfp8_attention over the sequence's tokens so far, bit for bit; pages, slots, errors, bytes. The triton
backend's paged kernel: tests/kvcache/test_kvcache_gpu.py."""

import warnings

import pytest
import torch

import mxattn

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")


def _tokens(n, h, d, seed, dtype=torch.bfloat16):
    return torch.randn(n, h, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _expected(q, k, v, **kw):
    """mxfp8_attention of q [n, Hq, D] (the last n tokens) over k, v [L, Hkv, D], causal bottom-right."""
    return mxattn.mxfp8_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                  attn_mask_type="causal_bottom_right", backend="reference", **kw)[0]


@pytest.mark.parametrize("kw", [dict(), dict(window_size=(20, 0)), dict(softmax_type="off-by-one"),
                                dict(softmax_type="learnable", softmax_offset=torch.tensor([0.5, -1.0, 2.0, 0.0])),
                                dict(softmax_scale=0.3, out_dtype=torch.float32)])
def test_prefill_then_decode_equals_attention_over_the_prefix_bit_for_bit(kw):
    """Two sequences of different lengths in one call: a chunked prefill (45 tokens: a sealed V block, an open
    one and a page boundary at 32), then decode steps one token at a time across the next block and page
    boundaries (GQA 4:2), then a 3-token speculative chunk."""
    hq, hkv, d = 4, 2, 64
    cache = mxattn.MXFP8KVCache(num_pages=16, page_size=32, kv_heads=hkv, head_dim=d, max_sequences=4)
    slots = [cache.new_sequence(), cache.new_sequence()]
    total = {s: (_tokens(120, hkv, d, 10 + s), _tokens(120, hkv, d, 20 + s)) for s in slots}
    queries = {s: _tokens(120, hq, d, 30 + s) for s in slots}
    steps = [(45, 7)] + [(1, 1)] * 40 + [(3, 3)]
    held = {s: 0 for s in slots}
    for n0, n1 in steps:
        counts = dict(zip(slots, (n0, n1)))
        cu = torch.tensor([0, n0, n0 + n1], dtype=torch.int32)
        q = torch.cat([queries[s][held[s]:held[s] + counts[s]] for s in slots])
        k_new = torch.cat([total[s][0][held[s]:held[s] + counts[s]] for s in slots])
        v_new = torch.cat([total[s][1][held[s]:held[s] + counts[s]] for s in slots])
        out = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, k_new=k_new, v_new=v_new, **kw)
        for i, s in enumerate(slots):
            held[s] += counts[s]
            a, b = cu[i].item(), cu[i + 1].item()
            expected = _expected(q[a:b], total[s][0][:held[s]], total[s][1][:held[s]], **kw)
            assert torch.equal(out[a:b], expected), (s, held[s])
    assert cache.seq_lens[slots].tolist() == [held[s] for s in slots]


def test_pages_are_released_and_reused():
    cache = mxattn.MXFP8KVCache(num_pages=3, page_size=32, kv_heads=1, head_dim=32, max_sequences=2)
    a = cache.new_sequence()
    cache.append(a, _tokens(70, 1, 32, 1), _tokens(70, 1, 32, 2))          # 3 pages
    b = cache.new_sequence()
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.append(b, _tokens(1, 1, 32, 3), _tokens(1, 1, 32, 4))
    assert cache.page_table[a].tolist()[:3] == [0, 1, 2] and cache.seq_lens[a].item() == 70
    cache.release(a)
    k, v = _tokens(40, 1, 32, 5), _tokens(40, 1, 32, 6)
    cache.append(b, k, v)
    q = _tokens(1, 1, 32, 7)
    out = mxattn.mxfp8_attention_with_kvcache(q, cache, [b], cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32))
    assert torch.equal(out, _expected(q, k, v))
    with pytest.raises(RuntimeError, match="slots are in use"):
        cache.new_sequence(), cache.new_sequence()


def test_bytes_against_a_bf16_cache():
    cache = mxattn.MXFP8KVCache(num_pages=64, page_size=64, kv_heads=8, head_dim=128, max_sequences=8)
    ratio = cache.nbytes() / cache.bf16_nbytes()
    assert 0.5 < ratio < 0.56, ratio


@pytest.mark.parametrize("call,exc,match", [
    (lambda c, s: c.append(s, _tokens(2, 2, 64, 0), _tokens(2, 2, 64, 0)), ValueError, r"k must be \[n, 1, 32\]"),
    (lambda c, s: c.append(s, _tokens(2, 1, 32, 0, torch.float32), _tokens(2, 1, 32, 0)), TypeError, "dtype|bfloat16"),
    (lambda c, s: c.append(7, _tokens(2, 1, 32, 0), _tokens(2, 1, 32, 0)), ValueError, "slot"),
    (lambda c, s: mxattn.mxfp8_attention_with_kvcache(_tokens(2, 2, 16, 0), c, [s],
                                                      cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)),
     ValueError, r"q must be \[T, Hq, 32\]"),
    (lambda c, s: mxattn.mxfp8_attention_with_kvcache(_tokens(2, 2, 32, 0), c, [s],
                                                      cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32)),
     ValueError, "rise from 0 to T=2"),
    (lambda c, s: mxattn.mxfp8_attention_with_kvcache(_tokens(2, 2, 32, 0), c, [s], backend="triton",
                                                      cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)),
     mxattn.MXFP8NotSupportedError, "backend 'triton' cannot run this call on cpu: the triton backend runs on "
                                    "CUDA devices only"),
    (lambda c, s: mxattn.mxfp8_attention_with_kvcache(_tokens(2, 2, 32, 0), c, [s], backend="cudnn",
                                                      k_new=_tokens(2, 1, 32, 0), v_new=_tokens(2, 1, 32, 0),
                                                      cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)),
     mxattn.MXFP8NotSupportedError, "backend 'cudnn'"),
    (lambda c, s: mxattn.mxfp8_attention_with_kvcache(_tokens(2, 2, 32, 0), c, [s], softmax_scale=-1.0,
                                                      cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)),
     ValueError, "softmax_scale"),
    (lambda c, s: mxattn.mxfp8_attention_with_kvcache(_tokens(5, 2, 32, 0), c, [s],
                                                      cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)),
     ValueError, "fewer than its 5 queries"),
])
def test_bad_input_raises_a_clear_error(call, exc, match):
    cache = mxattn.MXFP8KVCache(num_pages=2, page_size=32, kv_heads=1, head_dim=32, max_sequences=1)
    slot = cache.new_sequence()
    cache.append(slot, _tokens(3, 1, 32, 1), _tokens(3, 1, 32, 2))
    with pytest.raises(exc, match=match):
        call(cache, slot)
    assert cache.length(slot) == 3  # nothing appended by a refused call
    with pytest.raises(ValueError, match="multiple of 32"):
        mxattn.MXFP8KVCache(num_pages=2, page_size=48, kv_heads=1, head_dim=32, max_sequences=1)


def test_the_cache_reports_its_device_as_its_tensors_do():
    """device="cuda" is stored with its index, so tensors made with device="cuda" (reported as cuda:0) match it;
    on the CPU the same: the storage's own device."""
    cache = mxattn.MXFP8KVCache(num_pages=1, page_size=32, kv_heads=1, head_dim=32, max_sequences=1, device="cpu")
    assert cache.device == cache.k_data.device == torch.zeros(1).device


def test_cat_bytes_joins_strided_scale_slices():
    """The cache joins E8M0 scale slices of its pages through uint8 views (CUDA's cat lacks e8m0 on strided
    inputs); the bytes come back in order, dtype kept."""
    from mxattn.formats import cat_bytes
    raw = torch.arange(2 * 3 * 8 * 4, dtype=torch.uint8).view(2, 3, 8, 4)
    scale = raw.view(torch.float8_e8m0fnu)
    parts = [scale[1, :, 2:5], scale[0, :, 0:3]]
    out = cat_bytes(parts, dim=1)
    assert out.dtype == torch.float8_e8m0fnu
    assert torch.equal(out.view(torch.uint8), torch.cat([raw[1, :, 2:5], raw[0, :, 0:3]], dim=1))


def _cache_call(q, cache):
    """A `CacheCall` of one sequence's decode step (q [1, Hq, D]) on `cache`, as `mxfp8_attention_with_kvcache`
    builds it after its checks."""
    from mxattn.backends import CacheCall
    return CacheCall(q, cache, [0], [0, 1], torch.tensor([0, 1], dtype=torch.int32), None, None, 0.125, None,
                     "vanilla", None, 0, torch.bfloat16, torch.bfloat16)


def test_backend_choice_of_the_cache_call(monkeypatch):
    """The cache call's backend is chosen as every call's is (`pick_cache_backend`): auto takes cudnn where cuDNN
    serves the call, else the Triton paged kernel where the triton backend runs and the head dim is at most 128,
    else the reference with a one-time warning naming why; a named backend that cannot run raises with the reason
    before anything is appended. (Host logic on the CPU: the triton backend's availability is faked.)"""
    from mxattn import backends
    from mxattn.backends.triton_backend import TritonBackend
    small = mxattn.MXFP8KVCache(num_pages=1, page_size=32, kv_heads=1, head_dim=64, max_sequences=1)
    wide = mxattn.MXFP8KVCache(num_pages=1, page_size=32, kv_heads=1, head_dim=256, max_sequences=1)
    monkeypatch.setattr(TritonBackend, "availability", classmethod(lambda cls, device: (True, "faked")))
    monkeypatch.setattr(backends, "_CACHE_CHOICES", {})
    monkeypatch.setattr(backends, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="chose 'triton'.*cudnn: "):
        assert backends.pick_cache_backend("auto", _cache_call(torch.zeros(1, 2, 64), small)) == "triton"
    assert backends.pick_cache_backend("reference", _cache_call(torch.zeros(1, 2, 64), small)) == "reference"
    with pytest.warns(RuntimeWarning, match="head dims up to 128"):
        assert backends.pick_cache_backend("auto", _cache_call(torch.zeros(1, 2, 256), wide)) == "reference"
    with pytest.raises(mxattn.MXFP8NotSupportedError, match="head dims up to 128, the cache has 256"):
        backends.pick_cache_backend("triton", _cache_call(torch.zeros(1, 2, 256), wide))
    with pytest.raises(mxattn.MXFP8NotSupportedError, match="backend 'cudnn' cannot run this call on cpu"):
        backends.pick_cache_backend("cudnn", _cache_call(torch.zeros(1, 2, 64), small))
    with pytest.raises(ValueError, match="backend must be one of"):
        mxattn.mxfp8_attention_with_kvcache(torch.zeros(1, 2, 64), small, [0],
                                            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), backend="nope")


def test_the_cache_call_checks_q_against_the_cache_device():
    cache = mxattn.MXFP8KVCache(num_pages=1, page_size=32, kv_heads=1, head_dim=64, max_sequences=1)
    slot = cache.new_sequence()
    with pytest.raises(ValueError, match="q must be on the cache's device"):
        mxattn.mxfp8_attention_with_kvcache(torch.zeros(1, 2, 64, device="meta"), cache, [slot],
                                            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32))


def test_paged_kernel_launch_arguments_without_a_gpu(monkeypatch):
    """The paged kernel's grid (query tiles of the longest query run, sequences x KV heads: a tile packs the
    group's query heads with BM / heads query tokens) and its tile come from the dense path's config; strides are
    the cache's own (launch recorded, not made). Split KV: a max pass, a split pass and the combine."""
    pytest.importorskip("triton")
    from mxattn.kernels import triton_paged_attention as tp
    launched = []
    monkeypatch.setattr(tp, "launch", lambda fn, grid, *a, **kw: launched.append((fn, grid, a, kw)))
    cache = mxattn.MXFP8KVCache(num_pages=4, page_size=64, kv_heads=2, head_dim=128, max_sequences=3)
    q = torch.zeros(150, 8, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 130, 150], dtype=torch.int32)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    tp.paged_attention_fwd(q, cu, 129, slots, cache, softmax_scale=0.1, left_bound=None, out=torch.empty_like(q))
    (fn, grid, args, kw), = launched
    bm = tp.paged_config(128)[0]
    assert bm == 64 and kw["GP"] == 4  # 4 query heads per KV head: 16 query tokens per 64-row tile
    assert fn is tp._paged_attn_kernel and grid == (9, 3 * 2)  # 129 queries need nine tiles
    assert not kw["DECODE"] and "maxnreg" not in kw  # the exact data path
    assert kw["BM"] == bm and kw["DP"] == 128 and kw["EVEN_D"] and not kw["HAS_LB"] and not kw["HAS_SINK"]
    assert kw["PASS"] == tp.SINGLE.value
    assert args[10] is cache.page_table and args[11] is cache.k_data
    launched.clear()
    tp.paged_attention_fwd(q, cu, 129, slots, cache, softmax_scale=0.1, left_bound=None, out=torch.empty_like(q),
                           num_splits=3)
    assert [(f, g, k.get("PASS")) for f, g, _, k in launched] == [
        (tp._paged_attn_kernel, (27, 6), tp.MAX_PASS.value), (tp._paged_attn_kernel, (27, 6), tp.SPLIT_PASS.value),
        (tp._combine_splits_kernel, (150, 8), None)]
    mp, mf, lp, op = launched[1][2][2:6]
    assert mp.shape == mf.shape == lp.shape == (3, 150, 8) and op.shape == (3, 150, 8, 128)
    assert launched[2][3]["SP"] == 4
    assert tp.paged_config(256) is None
    with pytest.raises(ValueError, match="head dims up to 128"):
        tp.paged_attention_fwd(torch.zeros(1, 2, 256), cu[:2], 1, slots[:1], cache, softmax_scale=0.1,
                               left_bound=None, out=torch.zeros(1, 2, 256))


def test_append_kernel_launch_plan_without_a_gpu(monkeypatch):
    """The Triton append's host side (CUDA caches take it; forced here on the CPU, launches recorded): pages
    are taken and mapped first, one metadata tensor [cu, slots, lengths before] feeds the kernel, the grid spans
    the most 32-token blocks any sequence touches, and the tail pass runs only when a call seals a block and
    opens another behind rows already open. The host lengths advance; nothing is written on an error."""
    pytest.importorskip("triton")
    from mxattn.kernels import triton_paged_append as ta
    launched = []
    monkeypatch.setattr(ta, "launch", lambda fn, grid, *a, **kw: launched.append((grid, a, kw)))
    cache = mxattn.MXFP8KVCache(num_pages=8, page_size=64, kv_heads=2, head_dim=80, max_sequences=3)
    cache._append_kernel = True
    slots = [cache.new_sequence() for _ in range(3)]

    def append(lengths, sl=slots):
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        k = torch.zeros(cu[-1], 2, 80, dtype=torch.bfloat16)
        launched.clear()
        cache.append_batch(sl, k, k, cu)
        return [(grid, kw["TAIL_PASS"], kw["DP"]) for grid, _, kw in launched], launched

    plan, calls = append([40, 1, 0])           # blocks 0-1 of slot 0, block 0 of slot 1
    assert plan == [((3, 2, 2), False, 128)]
    meta = calls[0][1][0]
    assert meta.dtype == torch.int32 and meta.tolist() == [0, 40, 41, 41, 0, 1, 2, 0, 0, 0]
    assert [cache.length(s) for s in slots] == [40, 1, 0] and cache.page_table[:2, 0].tolist() == [0, 1]
    plan, _ = append([1, 1, 1])                # decode step: one block each, no tail pass
    assert plan == [((3, 1, 2), False, 128)]
    plan, _ = append([30, 5, 0])               # slot 0: 41 -> 71 seals block 1 (open rows 9) and opens block 2
    assert plan == [((3, 2, 2), False, 128), ((3, 1, 2), True, 128)]
    plan, _ = append([25, 0, 0])               # slot 0: 71 -> 96 seals block 2 exactly: no new open block
    assert plan == [((3, 1, 2), False, 128)]
    assert [cache.length(s) for s in slots] == [96, 7, 1] and cache.page_table[0, :2].tolist() == [0, 3]
    with pytest.raises(RuntimeError, match="out of pages"):
        append([600, 0, 0])
    assert launched == [] and cache.length(slots[0]) == 96


def test_split_count_fills_the_gpu_and_keeps_blocks_per_split():
    pytest.importorskip("triton")
    from mxattn.kernels.triton_paged_attention import PROGRAMS_PER_SM, choose_splits
    assert PROGRAMS_PER_SM == 4
    assert choose_splits(programs=132, kv_blocks=256, sms=132) == 1          # the programs fill the GPU
    assert choose_splits(programs=8, kv_blocks=256, sms=132) == 64           # batch 1 / 32k: 66 wanted, pow2 64
    assert choose_splits(programs=8, kv_blocks=32, sms=132) == 32            # batch 1 / 4k: a block per split
    assert choose_splits(programs=8, kv_blocks=8, sms=132) == 8              # batch 1 / 1k
    assert choose_splits(programs=64, kv_blocks=32, sms=132) == 8            # batch 8 / 4k: 9 wanted
    assert choose_splits(programs=64, kv_blocks=1024, sms=132) == 8
    assert choose_splits(programs=128, kv_blocks=1024, sms=132) == 4         # batch 16: 5 wanted
    assert choose_splits(programs=8, kv_blocks=20, sms=132) == 16
    assert choose_splits(programs=8, kv_blocks=1, sms=132) == 1              # one block: nothing to split
    assert choose_splits(programs=1, kv_blocks=10 ** 6, sms=132) == 64       # at most MAX_KV_SPLITS


def test_num_splits_is_checked_before_any_work():
    cache = mxattn.MXFP8KVCache(num_pages=2, page_size=32, kv_heads=1, head_dim=32, max_sequences=1)
    s = cache.new_sequence()
    cu = torch.tensor([0, 1], dtype=torch.int32)
    for bad in (-1, 65, 1.5, True):
        with pytest.raises(ValueError, match="num_splits must be an int in \\[0, 64\\]"):
            mxattn.mxfp8_attention_with_kvcache(torch.zeros(1, 1, 32), cache, [s], cu_seqlens_q=cu,
                                                k_new=torch.zeros(1, 1, 32), v_new=torch.zeros(1, 1, 32),
                                                num_splits=bad, backend="reference")
        assert cache.length(s) == 0


def test_decode_takes_the_fast_tile_and_splits_on_an_idle_gpu(monkeypatch):
    """num_splits=0 (the default): a decode step (4 query heads per KV head, one token: 4 rows) takes the 16-row
    FAST_TILE and the decode data path (DECODE, with DECODE_MAXNREG); with 2 sequences x 2 KV heads on a 132-SM
    GPU it splits a 1k- or 4k-token sequence (max pass, split pass, combine); num_splits=1 keeps the exact tile and
    path (launches recorded, not made). With the rule's four programs per SM, 4 programs want 132 splits: 8 blocks of 128 tokens
    give 8 splits at 1k, 32 at 4k; a 128-token sequence (one block) is not split."""
    pytest.importorskip("triton")
    from mxattn.kernels import triton_paged_attention as tp
    launched = []
    monkeypatch.setattr(tp, "launch", lambda fn, grid, *a, **kw: launched.append((fn, grid, kw)))
    monkeypatch.setattr(tp, "sm_count", lambda device: 132)
    cache = mxattn.MXFP8KVCache(num_pages=4, page_size=64, kv_heads=2, head_dim=128, max_sequences=2)
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    for max_kv, n in ((128, 1), (1024, 8), (4096, 32)):
        launched.clear()
        tp.paged_attention_fwd(q, cu, 1, slots, cache, softmax_scale=0.1, left_bound=None, out=torch.empty_like(q),
                               num_splits=0, max_seqlen_kv=max_kv)
        assert launched[0][2]["BM"] == tp.FAST_TILE[0] and launched[0][2]["num_warps"] == tp.FAST_TILE[1]
        assert launched[0][1] == (n, 2 * 2)
        # the FP8-operand decode path runs every pass of the fast tile, the split combine stays the same
        assert [fn for fn, _, _ in launched] == ([tp._paged_attn_kernel] if n == 1 else
                                                 [tp._paged_attn_kernel] * 2 + [tp._combine_splits_kernel])
        assert [(kw["DECODE"], kw["maxnreg"]) for _, _, kw in launched[:2 if n > 1 else 1]] == (
            [(True, tp.DECODE_MAXNREG)] * (2 if n > 1 else 1))
        assert [kw.get("PASS") for _, _, kw in launched] == ([tp.SINGLE.value] if n == 1 else
                                                             [tp.MAX_PASS.value, tp.SPLIT_PASS.value, None])
    launched.clear()
    tp.paged_attention_fwd(q, cu, 1, slots, cache, softmax_scale=0.1, left_bound=None, out=torch.empty_like(q),
                           num_splits=1, max_seqlen_kv=4096)
    assert [(fn, kw["BM"], kw["PASS"], kw["DECODE"]) for fn, _, kw in launched] == [
        (tp._paged_attn_kernel, tp.paged_config(128)[0], tp.SINGLE.value, False)]


def test_reference_backend_ignores_num_splits():
    """The reference backend is the sequential definition whatever num_splits says."""
    cache = mxattn.MXFP8KVCache(num_pages=8, page_size=32, kv_heads=1, head_dim=32, max_sequences=1)
    s = cache.new_sequence()
    g = torch.Generator().manual_seed(5)
    cache.append(s, torch.randn(150, 1, 32, generator=g).bfloat16(), torch.randn(150, 1, 32, generator=g).bfloat16())
    q = torch.randn(1, 2, 32, generator=g).bfloat16()
    cu = torch.tensor([0, 1], dtype=torch.int32)
    outs = [mxattn.mxfp8_attention_with_kvcache(q, cache, [s], cu_seqlens_q=cu, num_splits=n, backend="reference")
            for n in (0, 1, 7)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


def _storage(cache):
    return [t.view(torch.uint8) if t.element_size() == 1 else t for t in
            (cache.k_data, cache.k_scale, cache.v_data, cache.v_scale, cache.page_table, cache.seq_lens)]


def test_batched_append_stores_each_sequence_as_its_own_quantization():
    """append_batch (one set of batched writes for every sequence of a call), over chunks that cross V blocks
    and 64-token pages, empty entries and decode steps: each sequence's stored K is its tokens quantized row-wise
    and its V its tokens quantized column-wise from its first token (`quantize_mxfp8` of the raw tokens, byte
    for byte); lengths, page tables and seq_lens agree, no page is shared."""
    from mxattn.formats import quantize_mxfp8
    h, d = 2, 64
    cache = mxattn.MXFP8KVCache(num_pages=24, page_size=64, kv_heads=h, head_dim=d, max_sequences=4)
    for _ in range(3):
        cache.new_sequence()
    slots = [2, 0, 1]
    raw = {s: ([], []) for s in slots}
    for step, counts in enumerate([(45, 0, 100), (1, 31, 1), (20, 1, 130), (1, 1, 1), (0, 64, 3)]):
        k = _tokens(sum(counts), h, d, 100 + step)
        v = _tokens(sum(counts), h, d, 200 + step)
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        cache.append_batch(slots, k, v, cu)
        used = []
        for s, a, b in zip(slots, cu, cu[1:]):
            raw[s][0].append(k[a:b])
            raw[s][1].append(v[a:b])
            ks, vs = (torch.cat(parts).transpose(0, 1).unsqueeze(0) for parts in raw[s])
            n = ks.shape[2]
            assert cache.length(s) == n and cache.seq_lens[s].item() == n
            for got, want in ((cache.keys(s), quantize_mxfp8(ks, axis=-1)),
                              (cache.values(s), quantize_mxfp8(vs, axis=-2))):
                assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (step, s)
                assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8)), (step, s)
            table = cache.page_table[s].tolist()
            pages = -(-n // 64)
            assert all(p >= 0 for p in table[:pages]) and all(p == -1 for p in table[pages:])
            used += table[:pages]
        assert len(used) == len(set(used))


def test_a_batched_append_that_does_not_fit_changes_nothing():
    cache = mxattn.MXFP8KVCache(num_pages=3, page_size=32, kv_heads=1, head_dim=32, max_sequences=2)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, _tokens(40, 1, 32, 1), _tokens(40, 1, 32, 2))
    before = [t.clone() for t in _storage(cache)] + [cache.v_tail.clone()]
    with pytest.raises(RuntimeError, match="out of pages"):   # a needs 1 more page (fits), b needs 2
        cache.append_batch([a, b], _tokens(70, 1, 32, 3), _tokens(70, 1, 32, 4), [0, 10, 70])
    assert all(torch.equal(x, y) for x, y in zip(_storage(cache) + [cache.v_tail], before))
    assert (cache.length(a), cache.length(b)) == (40, 0)
    with pytest.raises(ValueError, match="cu must rise"):
        cache.append_batch([a, b], _tokens(3, 1, 32, 3), _tokens(3, 1, 32, 4), [0, 2])
    with pytest.raises(ValueError, match="distinct"):
        cache.append_batch([a, a], _tokens(3, 1, 32, 3), _tokens(3, 1, 32, 4), [0, 1, 3])
    assert cache.slot_tensor([b, a]).tolist() == [b, a] and cache.slot_tensor([b, a]) is cache.slot_tensor((b, a))


def test_state_follows_the_history_of_slots_pages_and_appends():
    """`MXFP8KVCache.state`: caches made alike and changed alike (new sequences, appends, releases) have equal
    states whatever the values written; a different geometry, count, order or release gives another state. The page
    choice of an append (`_plan_pages`) changes nothing until the pages are taken (`_map_pages`), which refuses a
    choice the cache no longer matches."""
    def make(**kw):
        geometry = dict(num_pages=6, page_size=32, kv_heads=1, head_dim=32, max_sequences=3)
        return mxattn.MXFP8KVCache(**{**geometry, **kw})

    def feed(cache, seed, n=(40, 3)):
        a, b = cache.new_sequence(), cache.new_sequence()
        cache.append_batch([a, b], _tokens(sum(n), 1, 32, seed), _tokens(sum(n), 1, 32, seed + 1), [0, n[0], sum(n)])
        return a, b

    x, y = make(), make()
    assert x.state == y.state and make(num_pages=7).state != x.state and make(head_dim=64).state != x.state
    feed(x, 1)
    assert x.state != y.state
    feed(y, 9)                                         # other values, the same history
    assert x.state == y.state and x._pages == y._pages and torch.equal(x.page_table, y.page_table)
    z = make()
    feed(z, 1, n=(41, 2))
    assert z.state != x.state
    before = (x.state, [list(p) if p is not None else None for p in x._pages], list(x._free), x.page_table.clone())
    k, v = _tokens(30, 1, 32, 3), _tokens(30, 1, 32, 4)
    slots, cu, starts, counts, table = x._plan_pages([0, 1], k, v, [0, 25, 30])
    assert (starts, counts) == ([40, 3], [25, 5]) and [(s, i) for s, i, _ in table] == [(0, 2)]
    assert (x.state, x._pages, x._free) == before[:3] and torch.equal(x.page_table, before[3])
    x.release(1)
    assert x.state != y.state
    y.release(1)
    assert x.state == y.state
    with pytest.raises(RuntimeError, match="changed since"):   # the release put slot 1's pages on the free list
        x._map_pages(table)


def test_the_reference_backend_returns_no_step():
    cache = mxattn.MXFP8KVCache(num_pages=2, page_size=32, kv_heads=1, head_dim=32, max_sequences=1)
    a = cache.new_sequence()
    k, v, q = _tokens(5, 1, 32, 1), _tokens(5, 1, 32, 2), _tokens(5, 1, 32, 3)
    o, step = mxattn.mxfp8_attention_with_kvcache(q, cache, [a], cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32),
                                                  k_new=k, v_new=v, backend="reference", return_step=True)
    assert step is None and torch.equal(o, _expected(q, k, v))
