"""Launch plans on a CUDA GPU: the triton backend's replayed calls (second and later calls of a signature)
give the same bytes as its ordinary path, forward and backward, over layouts, views, masks, GQA, sinks,
dtypes, both data paths and misaligned inputs."""

import pytest
import torch

import mxattn

pytestmark = pytest.mark.gpu

CASES = {
    "bshd_causal_gqa_d64": dict(shape=(2, 200, 8, 2, 64), layout="bshd", mask="causal"),
    "bhsd_views_gqa": dict(shape=(2, 200, 8, 2, 64), layout="bhsd_views", mask="causal"),
    "unbind_window_d128": dict(shape=(2, 300, 4, 4, 128), layout="unbind", mask="causal", window=(64, 0)),
    "sbhd_fp16_nomask": dict(shape=(2, 130, 4, 2, 64), layout="sbhd", dtype=torch.float16),
    "fp32_inputs": dict(shape=(1, 96, 2, 2, 64), dtype=torch.float32, mask="causal"),
    "learnable_sink": dict(shape=(2, 160, 4, 2, 64), mask="causal", softmax="learnable"),
    "off_by_one": dict(shape=(1, 160, 4, 4, 64), softmax="off-by-one"),
    "decode_step": dict(shape=(2, 1, 8, 2, 128), kv_len=333, mask="causal_bottom_right"),
    "d256_fp8_on_chip": dict(shape=(1, 128, 2, 2, 256), mask="causal"),
    "misaligned_q": dict(shape=(1, 96, 2, 2, 64), layout="misaligned"),
    "padded_causal": dict(shape=(2, 200, 4, 2, 64), mask="padding_causal", lengths=[150, 200]),
    "packed_thd": dict(shape=(1, 200, 4, 2, 64), layout="thd", mask="padding_causal", lengths=[70, 130]),
}


def _inputs(case, seed):
    """(q, k, v, the leaves whose gradients are compared, sink or None, dO)."""
    b, s, hq, hkv, d = case["shape"]
    skv = case.get("kv_len", s)
    dtype = case.get("dtype", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    layout = case.get("layout", "bshd")
    if layout == "thd":
        q, k, v = (rnd(s, h, d).requires_grad_() for h in (hq, hkv, hkv))
        return q, k, v, [q, k, v], None, rnd(s, hq, d)
    if layout == "unbind":  # views of one qkv tensor, its gradient compared
        base = rnd(b, s, 3, hq, d).requires_grad_()
        q, k, v = base.unbind(2)
        leaves = [base]
    else:
        if layout == "sbhd":
            q, k, v = rnd(s, b, hq, d), rnd(skv, b, hkv, d), rnd(skv, b, hkv, d)
        elif layout == "misaligned":  # q 2 bytes past a 16-byte boundary (Triton specializes on alignment)
            q = rnd(b * s * hq * d + 1)[1:].view(b, s, hq, d)
            k, v = rnd(b, skv, hkv, d), rnd(b, skv, hkv, d)
        else:
            q, k, v = rnd(b, s, hq, d), rnd(b, skv, hkv, d), rnd(b, skv, hkv, d)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        leaves = [q, k, v]
    sink = (torch.randn(hq, device="cuda", generator=g) * 0.5).requires_grad_() \
        if case.get("softmax") == "learnable" else None
    do = rnd(s, b, hq, d) if layout == "sbhd" else rnd(b, s, hq, d)
    return q, k, v, leaves + ([sink] if sink is not None else []), sink, do


def _run(case, seed, grad=True):
    """[O] without grad, else [O, the leaves' gradients]."""
    q, k, v, leaves, sink, do = _inputs(case, seed)
    lengths = case.get("lengths")
    if lengths is not None:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        seq = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    else:
        seq = {}
    layout = case.get("layout")
    if layout == "bhsd_views":  # torch SDPA's usual inputs: bhsd views of bshd tensors, O in q's layout
        q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
    kwargs = dict(qkv_format={"sbhd": "sbhd", "thd": "thd", "bhsd_views": "bhsd"}.get(layout, "bshd"), **seq,
                  attn_mask_type=case.get("mask", "no_mask"), window_size=case.get("window"), backend="triton",
                  softmax_type=case.get("softmax", "vanilla"), softmax_offset=sink)
    if not grad:
        with torch.no_grad():
            return [mxattn.mxfp8_attention(q, k, v, **kwargs)]
    o = mxattn.mxfp8_attention(q, k, v, **kwargs)
    o.backward(do)
    return [o.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("grad", [True, False])
def test_replayed_calls_equal_the_ordinary_path(name, grad, monkeypatch):
    """Four calls per signature (the first runs, the second records, the third and fourth replay; an eager
    backward keyed on its forward's plan records on the third call and replays on the fourth). With grad the
    ops' bodies replay (`op_plans.PLANS`), without it the whole call (`op_plans.CALLS`)."""
    from mxattn import attention, op_plans
    from mxattn.backends import triton_backend as tb
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.launch_plan import LaunchPlan
    from mxattn.runtime.plan_cache import PlanCache
    case = CASES[name]
    if name == "d256_fp8_on_chip" and grad:  # the FP8-streaming backward too (scratch over a tiny budget)
        from mxattn.kernels import triton_attention_bwd as tbwd
        monkeypatch.setattr(tbwd, "SCRATCH_BUDGET_BYTES", 1)
    fresh, fresh_ops, fresh_calls = PlanCache(), PlanCache(min_replays=16), PlanCache(min_replays=16)
    monkeypatch.setattr(tb, "_PLANS", fresh)
    monkeypatch.setattr(op_plans, "PLANS", fresh_ops)
    monkeypatch.setattr(op_plans, "CALLS", fresh_calls)
    monkeypatch.setattr(op_plans, "CALLS_AFFINE", AffinePlanCache())
    forward_key, backward_key = tb._forward_key, tb._backward_key
    monkeypatch.setattr(tb, "_forward_key", lambda roots, params: None)
    monkeypatch.setattr(tb, "_backward_key", lambda roots, params: None)
    monkeypatch.setattr(tb, "_AFFINE_PLANS", AffinePlanCache())
    monkeypatch.setattr(op_plans, "_REPLAYS", {"triton": False})
    monkeypatch.setattr(attention, "_PLANS", {})  # (call plans remember whether their calls replay)
    expected = [_run(case, seed, grad) for seed in (1, 2, 3, 4)]  # no plan at any level
    monkeypatch.setattr(tb, "_forward_key", forward_key)
    monkeypatch.setattr(tb, "_backward_key", backward_key)
    monkeypatch.setattr(op_plans, "_REPLAYS", {})
    monkeypatch.setattr(attention, "_PLANS", {})
    got = [_run(case, seed, grad) for seed in (1, 2, 3, 4)]
    # without grad the whole call replays, but for padded batches (no whole-call plans) and fp32 inputs (O cast
    # to fp32 by torch: the call's recording is refused, its op body replays)
    serving = fresh_calls if not (grad or case.get("lengths") or case.get("dtype") == torch.float32) else fresh_ops
    assert serving.last_reason == "recorded" or (case.get("softmax") == "learnable" and grad)
    assert any(isinstance(p, LaunchPlan) for p in serving._plans.values())
    if grad and case.get("softmax") != "learnable":
        assert any(k[0][0] == "bwd after" and isinstance(p, LaunchPlan) for k, p in fresh_ops._plans.items())
    for exp, out in zip(expected, got):
        assert len(exp) == len(out)
        for e, o in zip(exp, out):
            assert e.dtype == o.dtype and e.shape == o.shape and e.stride() == o.stride()
            assert torch.equal(e, o)


def test_bhsd_views_give_the_bshd_calls_bytes_in_qs_layout():
    """bhsd views of bshd tensors (as models hand torch SDPA) give the bshd call's O and gradients bit for bit,
    O in q's layout (no copy into dense bhsd), eager with and without grad."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 160, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2, 8))
    runs = []
    for views in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        args = [t.transpose(1, 2) for t in leaves] if views else leaves
        fmt = "bhsd" if views else "bshd"
        o = mxattn.mxfp8_attention(*args, qkv_format=fmt, attn_mask_type="causal", backend="triton")
        o.backward(do.transpose(1, 2) if views else do)
        with torch.no_grad():
            o_inference = mxattn.mxfp8_attention(*args, qkv_format=fmt, attn_mask_type="causal", backend="triton")
        if views:
            assert o.stride() == args[0].stride() and o_inference.stride() == args[0].stride()
            o, o_inference = o.transpose(1, 2), o_inference.transpose(1, 2)
        runs.append([o.detach(), o_inference] + [t.grad for t in leaves])
    for name, a, b in zip(("O", "O without grad", "dQ", "dK", "dV"), *runs):
        assert torch.equal(a, b), name
