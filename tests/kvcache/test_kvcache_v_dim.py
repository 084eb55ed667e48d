"""An `mxattn.MXFP8KVCache` whose V has another head dim than K (MLA: d_qk 192, d_v 128) on the CPU: pages of K
with d_qk and of V with d_v, every step of `mxfp8_attention_with_kvcache` (reference backend) equal to
`mxfp8_attention` over the sequence's tokens so far bit for bit; the paged kernels' refusals, bytes, errors."""

import warnings

import pytest
import torch

import mxattn

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")

DQK, DV = 192, 128


def _tokens(n, h, d, seed):
    return torch.randn(n, h, d, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _cache(**kw):
    return mxattn.MXFP8KVCache(num_pages=kw.pop("num_pages", 12), page_size=32, kv_heads=2, head_dim=DQK,
                               head_dim_v=DV, max_sequences=2, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(window_size=(20, 0), softmax_type="off-by-one")])
def test_prefill_then_decode_equals_attention_over_the_prefix_bit_for_bit(kw):
    """Two sequences in one call: a chunked prefill (45 and 7 tokens: a sealed V block, open ones, a page
    boundary), decode steps across the next block and page boundaries, a 3-token chunk (GQA 4:2)."""
    cache = _cache()
    slots = [cache.new_sequence(), cache.new_sequence()]
    keys = {s: _tokens(80, 2, DQK, 10 + s) for s in slots}
    values = {s: _tokens(80, 2, DV, 20 + s) for s in slots}
    queries = {s: _tokens(80, 4, DQK, 30 + s) for s in slots}
    held = {s: 0 for s in slots}
    for counts in [(45, 7)] + [(1, 1)] * 22 + [(3, 3)]:
        cu = torch.tensor([0, counts[0], sum(counts)], dtype=torch.int32)
        new = {s: slice(held[s], held[s] + n) for s, n in zip(slots, counts)}
        q = torch.cat([queries[s][new[s]] for s in slots])
        out = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, k_new=torch.cat(
            [keys[s][new[s]] for s in slots]), v_new=torch.cat([values[s][new[s]] for s in slots]), **kw)
        assert out.shape == (sum(counts), 4, DV)
        for i, s in enumerate(slots):
            held[s] = new[s].stop
            a, b = cu[i].item(), cu[i + 1].item()
            want = mxattn.mxfp8_attention(q[a:b].unsqueeze(0), keys[s][:held[s]].unsqueeze(0),
                                          values[s][:held[s]].unsqueeze(0), attn_mask_type="causal_bottom_right",
                                          backend="reference", **kw)[0]
            assert torch.equal(out[a:b], want), (s, held[s])
    assert cache.values(slots[0]).shape == (1, 2, 70, DV) and cache.keys(slots[0]).shape == (1, 2, 70, DQK)


def test_storage_and_bytes_follow_each_head_dim():
    cache = _cache(num_pages=4)
    assert cache.k_data.shape == (4, 2, 32, DQK) and cache.k_scale.shape == (4, 2, 32, DQK // 32)
    assert cache.v_data.shape == (4, 2, 32, DV) and cache.v_scale.shape == (4, 2, 1, DV)
    assert cache.v_tail.shape == (2, 2, 32, DV)
    assert cache.bf16_nbytes() == 4 * 2 * 32 * (DQK + DV) * 2
    same = mxattn.MXFP8KVCache(num_pages=4, page_size=32, kv_heads=2, head_dim=DQK, max_sequences=2)
    assert same.head_dim_v == DQK and same.v_data.shape == same.k_data.shape


@pytest.mark.parametrize("call,exc,match", [
    (lambda c, s: c.append(s, _tokens(2, 2, DQK, 0), _tokens(2, 2, DQK, 0)), ValueError,
     r"v must be \[n, 2, 128\], got \(2, 2, 192\)"),
    (lambda c, s: c.append(s, _tokens(2, 2, DV, 0), _tokens(2, 2, DV, 0)), ValueError,
     r"k must be \[n, 2, 192\], got \(2, 2, 128\)"),
    (lambda c, s: mxattn.mxfp8_attention_with_kvcache(_tokens(1, 4, DV, 0), c, [s],
                                                      cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32)),
     ValueError, r"q must be \[T, Hq, 192\]"),
])
def test_shape_errors_change_nothing(call, exc, match):
    cache = _cache(num_pages=2)
    slot = cache.new_sequence()
    cache.append(slot, _tokens(3, 2, DQK, 1), _tokens(3, 2, DV, 2))
    with pytest.raises(exc, match=match):
        call(cache, slot)
    assert cache.length(slot) == 3
    with pytest.raises(ValueError, match="head_dim_v must be a positive int"):
        mxattn.MXFP8KVCache(num_pages=2, page_size=32, kv_heads=1, head_dim=DQK, head_dim_v=0, max_sequences=1)


@pytest.mark.parametrize("name", ["triton", "cudnn"])
def test_paged_kernels_refuse_a_cache_of_two_head_dims_before_writing(monkeypatch, name):
    """The triton and cudnn paged paths read one head dim: each refuses with the reason (availability faked on
    the CPU), nothing is appended, and "auto" serves the call on the reference backend."""
    from mxattn import backends
    try:
        cls = backends.backend_class(name)
    except mxattn.MXFP8NotSupportedError:
        pytest.skip(f"the {name} backend cannot be imported here")
    monkeypatch.setattr(cls, "availability", classmethod(lambda c, device: (True, "faked")))
    monkeypatch.setattr(backends, "_CACHE_CHOICES", {})
    monkeypatch.setattr(backends, "_WARNED", set())
    cache = _cache(num_pages=2)
    slot = cache.new_sequence()
    q, k, v = _tokens(2, 4, DQK, 0), _tokens(2, 2, DQK, 1), _tokens(2, 2, DV, 2)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(mxattn.MXFP8NotSupportedError, match=f"backend '{name}'.*head_dim 192.*head_dim_v 128"):
        mxattn.mxfp8_attention_with_kvcache(q, cache, [slot], cu_seqlens_q=cu, k_new=k, v_new=v, backend=name)
    assert cache.length(slot) == 0
    with pytest.warns(RuntimeWarning, match=f"chose 'reference'.*{name}: q and k have head_dim 192"):
        out = mxattn.mxfp8_attention_with_kvcache(q, cache, [slot], cu_seqlens_q=cu, k_new=k, v_new=v)
    assert out.shape == (2, 4, DV) and cache.length(slot) == 2
