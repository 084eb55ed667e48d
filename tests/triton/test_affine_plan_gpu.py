"""Affine launch plans on a CUDA GPU: decode steps at ever new KV lengths, replayed by one plan once it is
trusted, give the same bytes as the triton backend's ordinary path, over transformers' cache layout, views
of a preallocated buffer, GQA, a sliding window, a learnable sink, fp16 and head dim 128, across lengths
whose Triton specialization classes differ (multiples of 16)."""

import pytest
import torch

import mxattn

pytestmark = pytest.mark.gpu

CASES = {
    "hf_cache_d64": dict(hq=8, hkv=8, d=64, layout="hf_cache"),
    "bshd_views_gqa_d128": dict(hq=8, hkv=2, d=128, layout="views"),
    "window_sink_fp16": dict(hq=4, hkv=2, d=64, layout="hf_cache", dtype=torch.float16, window=(40, 0),
                             sink=True),
}


def _steps(case, lengths):
    """O of one decode step (B 3, one query) per KV length, K and V the first n rows of a fixed buffer."""
    dtype = case.get("dtype", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = case["hq"], case["hkv"], case["d"]
    buffer = torch.randn(3, max(lengths), 2 * hkv, d, device="cuda", dtype=dtype, generator=g)
    sink = torch.randn(hq, device="cuda", generator=g) if case.get("sink") else None
    opts = dict(attn_mask_type="causal_bottom_right", window_size=case.get("window"), backend="triton")
    if sink is not None:
        opts.update(softmax_type="learnable", softmax_offset=sink)
    outs = []
    with torch.no_grad():
        for i, n in enumerate(lengths):
            q = torch.randn(3, 1, hq, d, device="cuda", dtype=dtype, generator=g)
            k, v = buffer[:, :n, :hkv], buffer[:, :n, hkv:]
            if case["layout"] == "hf_cache":  # [B, H, S, D] contiguous, read as bshd views
                k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
            outs.append(mxattn.mxfp8_attention(q, k, v, **opts))
    return outs


@pytest.mark.parametrize("level", ["backend", "call"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_affine_replays_equal_the_ordinary_path(name, level, monkeypatch):
    """level: the affine plan of the backend's forward, or of the whole public call (`op_plans.run_call`,
    what eager inference uses)."""
    from mxattn import attention, op_plans
    from mxattn.backends import triton_backend as tb
    from mxattn.runtime import affine_plan
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.plan_cache import PlanCache
    lengths = list(range(290, 341))
    monkeypatch.setattr(tb, "_PLANS", PlanCache())
    monkeypatch.setattr(tb, "_AFFINE_PLANS", AffinePlanCache())
    monkeypatch.setattr(affine_plan, "TRUST_AFTER", 10 ** 9)  # observes, never replays
    monkeypatch.setattr(tb, "_forward_key", lambda roots, params: None)
    monkeypatch.setattr(op_plans, "_REPLAYS", {"triton": False})
    monkeypatch.setattr(attention, "_PLANS", {})
    expected = _steps(CASES[name], lengths)
    monkeypatch.undo()
    fresh = AffinePlanCache()
    monkeypatch.setattr(attention, "_PLANS", {})
    if level == "backend":
        monkeypatch.setattr(op_plans, "_REPLAYS", {"triton": False})
        monkeypatch.setattr(tb, "_AFFINE_PLANS", fresh)
    else:
        monkeypatch.setattr(op_plans, "_REPLAYS", {})
        monkeypatch.setattr(op_plans, "CALLS_AFFINE", fresh)
        monkeypatch.setattr(op_plans, "CALLS", PlanCache(min_replays=16))
    got = _steps(CASES[name], lengths)
    # one trusted plan; a length dividing a buffer view's stride is keyed apart (one recording, then its own path)
    trusted = [p for p in fresh._plans.values() if p.trusted]
    assert len(trusted) == 1 and len(trusted[0].recordings) < 8
    for n, e, o in zip(lengths, expected, got):
        assert e.dtype == o.dtype and e.shape == o.shape and e.stride() == o.stride()
        assert torch.equal(e, o), n
