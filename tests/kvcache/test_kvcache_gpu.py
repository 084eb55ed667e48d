"""The paged MXFP8 KV cache on a CUDA GPU with backend="triton" (`mxattn.kernels.triton_paged_attention`).

Every step of a batch of sequences (chunked prefill, decode steps across V's 32-token blocks and page
boundaries, a speculative chunk) must equal `mxfp8_attention(..., backend="triton")` over the sequence's tokens
so far bit for bit (the kernel reads the pages' FP8 bytes; the dense call quantizes the same tokens), and agree
with the reference backend's cache call to the tolerance the triton backend keeps against `ref`.
"""

import warnings

import pytest
import torch

import mxattn
from mxattn.metrics import bf16_ulps

pytestmark = pytest.mark.gpu

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")


def _needs_triton():
    from mxattn.backends.triton_backend import TritonBackend
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, why = TritonBackend.availability(torch.device("cuda"))
    if not ok:
        pytest.skip(f"triton backend unavailable: {why}")


def _tokens(n, h, d, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, h, d, generator=g, device="cuda").to(dtype)


def _filled_caches(count, num_pages, hkv, d, lengths):
    """(count caches of pages of 64 tokens holding the same sequences, of these lengths; their slots)."""
    caches = [mxattn.MXFP8KVCache(num_pages=num_pages, page_size=64, kv_heads=hkv, head_dim=d,
                                  max_sequences=len(lengths), device="cuda") for _ in range(count)]
    slots = [[c.new_sequence() for _ in lengths] for c in caches]
    for c, s in zip(caches, slots):
        for i, (slot, n) in enumerate(zip(s, lengths)):
            c.append(slot, _tokens(n, hkv, d, i), _tokens(n, hkv, d, 10 + i))
    return caches, slots


def _dense(q, k, v, **kw):
    """mxfp8_attention of q [n, Hq, D] (the last n tokens) over k, v [L, Hkv, D], causal bottom-right, triton."""
    return mxattn.mxfp8_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                  attn_mask_type="causal_bottom_right", backend="triton", **kw)[0]


CASES = [  # (d, page_size, dtype, kw)
    (64, 32, torch.bfloat16, dict()),
    (64, 64, torch.bfloat16, dict(window_size=(40, 0))),
    (64, 32, torch.bfloat16, dict(softmax_type="learnable", softmax_offset=[0.5, -1.0, 2.0, 0.0])),
    (64, 128, torch.float16, dict(softmax_type="off-by-one")),
    (128, 32, torch.bfloat16, dict(softmax_scale=0.3, out_dtype=torch.float32)),
    (32, 256, torch.float32, dict()),
    (96, 64, torch.bfloat16, dict(window_size=(100, 0))),
    (64, 64, torch.bfloat16, dict(heads=(12, 2), softmax_type="off-by-one")),   # 6 heads per KV head: 8 rows each
    (128, 256, torch.bfloat16, dict(heads=(8, 1), window_size=(150, 0))),
]


@pytest.mark.parametrize("d,page_size,dtype,kw", CASES)
@torch.no_grad()
def test_paged_kernel_equals_dense_triton_attention_bit_for_bit(d, page_size, dtype, kw):
    """Three sequences in one call each step: a prefill (200, 45 and 7 tokens: several query tiles, sealed and
    open V blocks, page boundaries), decode steps one token at a time (GQA 4:2 unless given), a 3-token
    speculative chunk; one sequence sits out a step (no queries). One split (num_splits=1)."""
    _needs_triton()
    kw = dict(kw)
    if "softmax_offset" in kw:
        kw["softmax_offset"] = torch.tensor(kw["softmax_offset"], device="cuda")
    hq, hkv = kw.pop("heads", (4, 2))
    cache = mxattn.MXFP8KVCache(num_pages=64, page_size=page_size, kv_heads=hkv, head_dim=d, max_sequences=4,
                                dtype=dtype, device="cuda")
    slots = [cache.new_sequence() for _ in range(3)]
    total = {s: (_tokens(300, hkv, d, 10 + s, dtype), _tokens(300, hkv, d, 20 + s, dtype)) for s in slots}
    queries = {s: _tokens(300, hq, d, 30 + s, dtype) for s in slots}
    steps = [(200, 45, 7)] + [(1, 1, 1)] * 36 + [(1, 0, 1), (3, 3, 3)]
    held = {s: 0 for s in slots}
    for counts in steps:
        counts = dict(zip(slots, counts))
        cu_list = [0]
        for s in slots:
            cu_list.append(cu_list[-1] + counts[s])
        cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
        q = torch.cat([queries[s][held[s]:held[s] + counts[s]] for s in slots])
        k_new = torch.cat([total[s][0][held[s]:held[s] + counts[s]] for s in slots])
        v_new = torch.cat([total[s][1][held[s]:held[s] + counts[s]] for s in slots])
        out = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, k_new=k_new, v_new=v_new,
                                                  backend="triton", num_splits=1, **kw)
        for i, s in enumerate(slots):
            held[s] += counts[s]
            a, b = cu_list[i], cu_list[i + 1]
            if a == b:
                continue
            expected = _dense(q[a:b], total[s][0][:held[s]], total[s][1][:held[s]], **kw)
            assert out.dtype == expected.dtype
            assert torch.equal(out[a:b], expected), (s, held[s], (out[a:b].float() - expected.float()).abs().max())
    assert cache.seq_lens[slots].tolist() == [held[s] for s in slots]


SPLIT_CASES = [  # (d, page_size, kw)
    (128, 256, dict()),
    (64, 64, dict(window_size=(700, 0))),
    (64, 32, dict(softmax_type="learnable", softmax_offset=[3.0, -1.0, 0.5, 8.0, 0.0, 1.0])),
    (96, 128, dict(softmax_type="off-by-one")),
]


def _split_cache(d, page_size, hkv):
    """The split cases' cache on the GPU: three sequences of 3000, 37 and 1500 tokens; (cache, slots)."""
    cache = mxattn.MXFP8KVCache(num_pages=200, page_size=page_size, kv_heads=hkv, head_dim=d, max_sequences=3,
                                device="cuda")
    slots = [cache.new_sequence() for _ in range(3)]
    for i, (s, n) in enumerate(zip(slots, (3000, 37, 1500))):
        cache.append(s, _tokens(n, hkv, d, 70 + i), _tokens(n, hkv, d, 80 + i) * (1 + i))
    return cache, slots


@pytest.mark.parametrize("d,page_size,kw", SPLIT_CASES)
@torch.no_grad()
def test_split_kv_equals_one_split_to_fp32_rounding(d, page_size, kw):
    """Split KV (num_splits 2 .. 64, and the automatic choice) against one split: every P is rounded against the
    sequential pass's running max, so only the order of fp32 additions differs: no output more than one bf16 ulp
    away, at least 98% bit-equal. Three sequences (3000, 37 and 1500 tokens; one decode token, one, and a
    4-token chunk), GQA 6:2 (rows padded to 4 heads per KV head)."""
    _needs_triton()
    kw = dict(kw)
    if "softmax_offset" in kw:
        kw["softmax_offset"] = torch.tensor(kw["softmax_offset"], device="cuda")
    hq, hkv = 6, 2
    cache, slots = _split_cache(d, page_size, hkv)
    q = _tokens(6, hq, d, 90) * 2
    cu = torch.tensor([0, 1, 2, 6], dtype=torch.int32, device="cuda")
    call = lambda n: mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, backend="triton",  # noqa
                                                         num_splits=n, **kw).float()
    one = call(1)
    for n in (2, 5, 16, 64, 0):
        got = call(n)
        ulps = bf16_ulps(got, one)
        assert ulps.max().item() <= 1.0, (n, ulps.max().item())
        assert (got == one).float().mean().item() >= 0.98, (n, (got == one).float().mean().item())


@pytest.mark.parametrize("d,page_size,kw", SPLIT_CASES)
@torch.no_grad()
def test_stored_logits_equal_recomputed_ones_bit_for_bit(d, page_size, kw, monkeypatch):
    """The decode path's split passes with the logits workspace (STORE_S: pass 2 reads the S pass 1 wrote) and
    without it (SCORES_MAX_BYTES 0: pass 2 recomputes S from the pages): the same O bit for bit, at 2, 5 and 16
    splits. paged_attention_fwd directly (a replayed step would keep its recorded choice)."""
    _needs_triton()
    from mxattn.kernels import triton_paged_attention as tp
    hq, hkv = 6, 2
    cache, slots = _split_cache(d, page_size, hkv)
    q = _tokens(3, hq, d, 90) * 2
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    window = kw.get("window_size")
    sink = None
    if kw.get("softmax_type") == "learnable":
        sink = torch.tensor(kw["softmax_offset"], device="cuda")
    elif kw.get("softmax_type") == "off-by-one":
        sink = torch.zeros(hq, device="cuda")

    def run(n):
        out = torch.empty_like(q)
        tp.paged_attention_fwd(q, cu, 1, torch.tensor(slots, dtype=torch.int32, device="cuda"), cache,
                               softmax_scale=d ** -0.5, left_bound=None if window is None else window[0] + 1,
                               out=out, sink=sink, num_splits=n, max_seqlen_kv=3000)
        return out
    for n in (2, 5, 16):
        stored = run(n)
        with monkeypatch.context() as m:
            m.setattr(tp, "SCORES_MAX_BYTES", 0)
            recomputed = run(n)
        assert torch.equal(stored, recomputed), (n, (stored.float() - recomputed.float()).abs().max().item())


@torch.no_grad()
def test_paged_kernel_agrees_with_the_reference_cache_call():
    """The same cache read by the reference backend (ref.mxfp8_ref on the stored bytes): O within the triton
    backend's tolerance against ref (one bf16 ulp for >= 99.9% of elements, 1e-2 at most)."""
    _needs_triton()
    hq, hkv, d = 8, 2, 128
    cache = mxattn.MXFP8KVCache(num_pages=64, page_size=64, kv_heads=hkv, head_dim=d, max_sequences=2,
                                device="cuda")
    slots = [cache.new_sequence(), cache.new_sequence()]
    for i, s in enumerate(slots):
        cache.append(s, _tokens(700 + 77 * i, hkv, d, 40 + i), _tokens(700 + 77 * i, hkv, d, 50 + i) * 3)
    q = _tokens(32, hq, d, 60)  # a 16-token chunk per sequence
    cu = torch.tensor([0, 16, 32], dtype=torch.int32, device="cuda")
    got = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, backend="triton").float()
    want = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, backend="reference").float()
    assert (got - want).abs().max().item() <= 1e-2
    assert (bf16_ulps(got, want) <= 1).float().mean().item() >= 0.999


def test_auto_takes_the_paged_kernel_on_cuda(monkeypatch):
    _needs_triton()
    from mxattn.runtime import paged_step
    calls = []
    real = paged_step.paged_step
    monkeypatch.setattr(paged_step, "paged_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = mxattn.MXFP8KVCache(num_pages=4, page_size=32, kv_heads=1, head_dim=64, max_sequences=1, device="cuda")
    s = cache.new_sequence()
    cache.append(s, _tokens(40, 1, 64, 1), _tokens(40, 1, 64, 2))
    out = mxattn.mxfp8_attention_with_kvcache(_tokens(1, 2, 64, 3), cache, [s],
                                              cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device="cuda"))
    assert calls and out.shape == (1, 2, 64) and torch.isfinite(out).all()


def test_a_decode_step_with_host_offsets_never_waits_for_the_gpu():
    """With cu_seqlens_q on the CPU, a decode step (append of every sequence's new token, then the paged kernel)
    queues its work without synchronising the stream: a long kernel queued before it is still running when the
    call returns (a pageable host-to-device copy anywhere on the path would have waited for it). The step's
    output equals the same step on a second cache with cu_seqlens_q on the GPU."""
    _needs_triton()
    from mxattn.devices import host_to_device
    hq, hkv, d, n = 8, 2, 64, 4
    caches, slots = _filled_caches(2, 32, hkv, d, [40 + 9 * i for i in range(n)])
    cu_cpu = torch.arange(n + 1, dtype=torch.int32)
    outs = []
    for step in range(3):                       # the first steps compile and record; the last one is timed
        q, k, v = _tokens(n, hq, d, 20 + step), _tokens(n, hkv, d, 30 + step), _tokens(n, hkv, d, 40 + step)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)          # tens of milliseconds of GPU time queued first
        out = mxattn.mxfp8_attention_with_kvcache(q, caches[0], slots[0], cu_seqlens_q=cu_cpu, k_new=k,
                                                  v_new=v, backend="triton")
        busy = not torch.cuda.current_stream().query()
        want = mxattn.mxfp8_attention_with_kvcache(q, caches[1], slots[1], cu_seqlens_q=cu_cpu.cuda(), k_new=k,
                                                   v_new=v, backend="triton")
        outs.append((busy, torch.equal(out, want)))
    assert all(equal for _, equal in outs) and outs[-1][0], outs
    torch.cuda._sleep(100_000_000)
    t = host_to_device([[1, 2], [3, 4]], torch.int64, torch.device("cuda"))
    assert not torch.cuda.current_stream().query() and t.tolist() == [[1, 2], [3, 4]]


def _cache_bytes(cache):
    """Every tensor of a cache's state as raw bytes (NaN compares equal to itself)."""
    return {name: getattr(cache, name).view(torch.uint8) for name in ("k_data", "k_scale", "v_data", "v_scale",
                                                                       "v_tail", "page_table", "seq_lens")}


@pytest.mark.parametrize("d,page_size,dtype", [(64, 32, torch.bfloat16), (80, 64, torch.float16),
                                               (128, 128, torch.float32), (256, 64, torch.bfloat16)])
@torch.no_grad()
def test_the_append_kernel_writes_the_torch_paths_bytes(d, page_size, dtype):
    """On CUDA append_batch runs one Triton kernel (two when a call seals a block and opens another behind rows
    already open); the torch path (what any other device runs) is the oracle: after every call of a random
    schedule (1 to 3 sequences per call, 0 to 70 tokens each: decode steps, chunks that seal several blocks,
    cross pages and leave a new open block; K scaled over 1e-3 .. 1e2 per token and head, a NaN in K, an inf in
    V) the two caches hold the same bytes, and attention over them is equal."""
    _needs_triton()
    import random
    caches = [mxattn.MXFP8KVCache(num_pages=48, page_size=page_size, kv_heads=2, head_dim=d, max_sequences=3,
                                  dtype=dtype, device="cuda") for _ in range(2)]
    caches[1]._append_kernel = False
    assert caches[0]._append_kernel
    for c in caches:
        for _ in range(3):
            c.new_sequence()
    rnd = random.Random(d)
    g = torch.Generator(device="cuda").manual_seed(d)
    for step in range(16):
        slots = rnd.sample([0, 1, 2], rnd.randint(1, 3))
        counts = [rnd.choice([0, 1, 1, 1, 5, 31, 33, 70]) for _ in slots]
        if any(caches[0].length(s) + n > 48 * page_size // 3 for s, n in zip(slots, counts)):
            continue
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        k = torch.randn(cu[-1], 2, d, generator=g, device="cuda")
        k = (k * 10.0 ** torch.randint(-3, 3, (cu[-1], 2, 1), generator=g, device="cuda")).to(dtype)
        v = torch.randn(cu[-1], 2, d, generator=g, device="cuda").to(dtype)
        if step == 3 and cu[-1] > 3:
            k[2, 1, 5], v[1, 0, 3] = float("nan"), float("inf")
        for c in caches:
            c.append_batch(slots, k, v, cu)
        got, want = _cache_bytes(caches[0]), _cache_bytes(caches[1])
        for name in want:
            assert torch.equal(got[name], want[name]), (step, name, (got[name] != want[name]).sum().item())
    if d <= 128:
        q = _tokens(3, 4, d, 9, dtype)
        outs = [mxattn.mxfp8_attention_with_kvcache(q, c, [0, 1, 2], backend="triton", num_splits=1,
                                                    cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32))
                for c in caches]
        assert torch.allclose(outs[0], outs[1], rtol=0, atol=0, equal_nan=True)   # (the NaN key's sequence)


@torch.no_grad()
def test_a_decode_step_is_one_append_launch_and_the_attention(monkeypatch):
    """A decode step of several sequences (cu_seqlens_q on the CPU): the append is one kernel launch, and the
    attention reads the append's copy of the offsets (no second host-to-device copy)."""
    _needs_triton()
    from mxattn import kvcache
    from mxattn.kernels import triton_paged_append
    launches, copies = [], []
    from mxattn.runtime import paged_step
    monkeypatch.setattr(paged_step, "STEPS", paged_step.PlanCache())     # (this step runs the launchers)
    monkeypatch.setattr(kvcache, "_DEVICE_INTS", {})
    real_append, real_copy = triton_paged_append.launch, kvcache.host_to_device
    monkeypatch.setattr(triton_paged_append, "launch", lambda *a, **kw: launches.append(1) or real_append(*a, **kw))
    monkeypatch.setattr(kvcache, "host_to_device", lambda *a: copies.append(1) or real_copy(*a))
    cache = mxattn.MXFP8KVCache(num_pages=16, page_size=64, kv_heads=2, head_dim=64, max_sequences=4, device="cuda")
    slots = [cache.new_sequence() for _ in range(4)]
    for i, s in enumerate(slots):
        cache.append(s, _tokens(30 + i, 2, 64, i), _tokens(30 + i, 2, 64, 10 + i))
    launches.clear(), copies.clear()
    cu = torch.arange(5, dtype=torch.int32)
    out = mxattn.mxfp8_attention_with_kvcache(_tokens(4, 8, 64, 1), cache, slots, cu_seqlens_q=cu,
                                              k_new=_tokens(4, 2, 64, 2), v_new=_tokens(4, 2, 64, 3),
                                              backend="triton")
    assert len(launches) == 1 and len(copies) == 1 and torch.isfinite(out).all()
    assert cache.seq_lens[:4].tolist() == [31, 32, 33, 34]


@pytest.mark.parametrize("hq,hkv,d,window,sink,num_splits", [(8, 2, 64, None, False, 0), (4, 4, 128, 70, True, 0),
                                                             (6, 2, 80, None, True, 1), (8, 1, 64, None, False, 4)])
@torch.no_grad()
def test_replayed_steps_equal_the_steps_run_through_the_launchers(hq, hkv, d, window, sink, num_splits):
    """A decode loop (one token per sequence and step, then a 3-token speculative chunk) replays its steps
    (`mxattn.runtime.paged_step`: the append and attention launches recorded once per signature). A second cache
    fed the same tokens runs every step through Triton's launchers (the step plans cleared before each call), a
    third replays the plans the first recorded (as a model's layers share them): outputs and every byte of the
    caches are equal at every step, across V's 32-token seals, page boundaries, split counts and the sink and
    window options; most steps were replays."""
    _needs_triton()
    from mxattn.runtime import paged_step
    n = 3
    caches, slots = _filled_caches(3, 24, hkv, d, [20 + 13 * i for i in range(n)])
    kw = dict(window_size=None if window is None else (window, 0), num_splits=num_splits, backend="triton")
    if sink:
        kw.update(softmax_type="learnable", softmax_offset=torch.linspace(-1, 2, hq, device="cuda"))
    paged_step.STEPS.clear()
    replays_before = sum(s[1] for s in paged_step.STEPS._families.values())
    for step in range(60):
        per_seq = 3 if step == 59 else 1
        t = n * per_seq
        q, k, v = _tokens(t, hq, d, 100 + step), _tokens(t, hkv, d, 200 + step), _tokens(t, hkv, d, 300 + step)
        cu = torch.arange(0, t + 1, per_seq, dtype=torch.int32)
        got = mxattn.mxfp8_attention_with_kvcache(q, caches[0], slots[0], cu_seqlens_q=cu, k_new=k, v_new=v, **kw)
        shared = mxattn.mxfp8_attention_with_kvcache(q, caches[2], slots[2], cu_seqlens_q=cu, k_new=k, v_new=v,
                                                     **kw)
        saved = dict(paged_step.STEPS._plans), dict(paged_step.STEPS._families)
        paged_step.STEPS.clear()
        want = mxattn.mxfp8_attention_with_kvcache(q, caches[1], slots[1], cu_seqlens_q=cu, k_new=k, v_new=v,
                                                   **kw)
        paged_step.STEPS._plans.update(saved[0]), paged_step.STEPS._families.update(saved[1])
        assert torch.equal(got, want) and torch.equal(shared, want), step
        a, b, c = (_cache_bytes(x) for x in caches)
        for name in a:
            assert torch.equal(a[name], b[name]) and torch.equal(c[name], b[name]), (step, name)
    replays = sum(s[1] for s in paged_step.STEPS._families.values()) - replays_before
    assert replays >= 80, replays
