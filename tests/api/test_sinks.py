"""Attention sinks (TE's softmax_type) on the CPU: ref against FP64 autograd of plain attention with a sink
column, the public API and module (reference backend), variable lengths, and argument errors."""

import dataclasses
import math
import warnings

import pytest
import torch

import mxattn
from ref import mxfp8_ref

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")


def _fp64_attention_with_sink(q, k, v, sink, keep):
    """q [B,Hq,S,D], k/v [B,Hkv,S,D], sink [Hq], keep [Sq,Skv] bool: softmax over [scores, sink]."""
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep, float("-inf"))
    full = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = full.softmax(dim=-1)[..., :-1]
    return p @ v.repeat_interleave(g, 1), torch.logsumexp(full, dim=-1, keepdim=True)


@pytest.mark.parametrize("causal,hkv", [(False, 4), (True, 2), (True, 1)])
def test_ref_sink_equals_fp64_autograd(causal, hkv):
    gen = torch.Generator().manual_seed(1)
    b, hq, s, d = 2, 4, 70, 32
    q = torch.randn(b, hq, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, hkv, s, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = torch.randn(hq, generator=gen, dtype=torch.float64, requires_grad=True)
    do = torch.randn(b, hq, s, d, generator=gen, dtype=torch.float64)
    keep = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s, dtype=torch.bool)
    o64, lse64 = _fp64_attention_with_sink(q, k, v, sink, keep)
    o64.backward(do)
    opts = dict(causal=causal, quantize_inputs=False, out_dtype=torch.float64, sink=sink.detach())
    o, stats = mxfp8_ref.sdpa_fwd(q.detach(), k.detach(), v.detach(), **opts)
    assert torch.allclose(o, o64, atol=1e-10) and torch.allclose(stats, lse64, atol=1e-10)
    for given in (stats, None):
        grads = mxfp8_ref.sdpa_bwd(q.detach(), k.detach(), v.detach(), o, do, given, **opts)
        for got, want in zip(grads, (q.grad, k.grad, v.grad, sink.grad)):
            assert torch.allclose(got, want, atol=1e-10)


def _qkv(b=2, s=100, hq=4, hkv=2, d=32, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(b, s, hkv, d, generator=gen).to(dtype) for _ in range(2))
    do = torch.randn(b, s, hq, d, generator=gen).to(dtype)
    return q, k, v, do


def _run(q, k, v, do, offset=None, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    off = None if offset is None else offset.clone().requires_grad_()
    o = mxattn.mxfp8_attention(*leaves, backend="reference", softmax_offset=off, **kw)
    o.backward(do)
    return [o.detach()] + [leaf.grad for leaf in leaves] + ([off.grad] if off is not None else [])


def test_learnable_sink_api_against_fp64_and_ref():
    q, k, v, do = _qkv()
    offset = torch.tensor([-1.0, 0.5, 2.0, 0.0])
    o, dq, dk, dv, doff = _run(q, k, v, do, offset, attn_mask_type="causal", softmax_type="learnable")
    # exactly ref on the same bytes
    ro, rstats = mxfp8_ref.sdpa_fwd(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, sink=offset)
    assert torch.equal(o.transpose(1, 2), ro)
    *_, rdsink = mxfp8_ref.sdpa_bwd(*(t.transpose(1, 2) for t in (q, k, v)), ro, do.transpose(1, 2), rstats,
                                    causal=True, sink=offset)
    assert torch.equal(doff, rdsink)
    # MXFP8 level against FP64 attention with the sink (an independent oracle)
    q64, k64, v64 = (t.double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    off64 = offset.double().requires_grad_()
    o64, _ = _fp64_attention_with_sink(q64, k64, v64, off64, torch.ones(100, 100, dtype=torch.bool).tril())
    o64.backward(do.double().transpose(1, 2))
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(o.transpose(1, 2), o64) < 0.08
    assert rel(dq.transpose(1, 2), q64.grad) < 0.1
    assert rel(doff, off64.grad) < 0.08


def test_off_by_one_is_a_zero_sink_and_changes_o():
    q, k, v, do = _qkv(seed=2)
    o1 = _run(q, k, v, do, softmax_type="off-by-one")
    o0 = _run(q, k, v, do, torch.zeros(4), softmax_type="learnable")
    for a, b in zip(o1, o0):
        assert torch.equal(a, b)
    vanilla = _run(q, k, v, do)
    assert not torch.equal(o1[0], vanilla[0])
    # the sink only adds to the denominator: |O| shrinks row by row
    assert (o1[0].float().norm(dim=-1) <= vanilla[0].float().norm(dim=-1) * 1.01).all()


def test_sink_with_packed_sequences_and_an_empty_kv_sequence():
    lengths_kv = [9, 0, 64]
    cq = torch.tensor([0, 5, 35, 99], dtype=torch.int32)
    ck = torch.tensor([0, 9, 9, 73], dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    q, do = (torch.randn(99, 4, 32, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(73, 2, 32, generator=gen).bfloat16() for _ in range(2))
    offset = torch.tensor([0.3, -2.0, 1.0, 4.0])
    out = _run(q, k, v, do, offset, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
               cu_seqlens_q=cq, cu_seqlens_kv=ck, softmax_type="learnable")
    doff = torch.zeros(4)
    for b in range(3):
        sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if lengths_kv[b] == 0:
            assert torch.equal(out[0][sq], torch.zeros_like(out[0][sq]))
            continue
        ref = _run(q[sq][None], k[sk][None], v[sk][None], do[sq][None], offset,
                   attn_mask_type="causal_bottom_right", softmax_type="learnable")
        assert torch.equal(out[0][sq], ref[0][0]) and torch.equal(out[1][sq], ref[1][0])
        doff += ref[4]
    assert torch.allclose(out[4], doff, rtol=1e-6, atol=1e-6)
    assert all(torch.isfinite(t).all() for t in out)


def test_module_owns_the_learnable_offset():
    attn = mxattn.DotProductAttention(4, 32, num_gqa_groups=2, attn_mask_type="causal", backend="reference",
                                      softmax_type="learnable")
    assert list(attn.state_dict()) == ["softmax_offset"]
    assert torch.equal(attn.softmax_offset.detach(), torch.zeros(4))
    assert list(mxattn.DotProductAttention(4, 32, softmax_type="off-by-one").state_dict()) == []
    q, k, v, _ = _qkv(s=40)
    out = attn(q, k, v)
    out.float().square().sum().backward()
    assert attn.softmax_offset.grad is not None and attn.softmax_offset.grad.shape == (4,)
    attn.bfloat16()  # a bf16 model: the offset is used in fp32
    assert attn(q, k, v).dtype == torch.bfloat16


@pytest.mark.parametrize("kw,exc,match", [
    (dict(softmax_type="softer"), ValueError, "softmax_type must be one of"),
    (dict(softmax_type="learnable"), TypeError, "needs softmax_offset"),
    (dict(softmax_type="vanilla", softmax_offset=torch.zeros(4)), ValueError, "only used with"),
    (dict(softmax_type="off-by-one", softmax_offset=torch.zeros(4)), ValueError, "only used with"),
    (dict(softmax_type="learnable", softmax_offset=torch.zeros(3)), ValueError, r"shape \(4,\)"),
    (dict(softmax_type="learnable", softmax_offset=torch.zeros(4, dtype=torch.float64)), TypeError, "float32"),
    (dict(softmax_type="learnable", softmax_offset=torch.zeros(4, device="meta")), ValueError, "device"),
])
def test_sink_argument_errors(kw, exc, match):
    q, k, v, _ = _qkv(s=8)
    with pytest.raises(exc, match=match):
        mxattn.mxfp8_attention(q, k, v, backend="reference", **kw)
    with pytest.raises(ValueError, match="softmax_type"):
        mxattn.DotProductAttention(4, 32, softmax_type="softer")


def test_auto_choice_sees_the_softmax_type(monkeypatch):
    """backend='auto' is chosen from the whole Problem: the softmax type reaches every backend's support check
    (eager and under torch.compile), and the choice cache tells sink calls from vanilla ones."""
    from mxattn import backends
    from mxattn.backends.reference import ReferenceBackend
    seen = []
    real = ReferenceBackend.supports.__func__

    def recording(cls, problem):
        seen.append(problem.softmax_type)
        return real(cls, problem)

    monkeypatch.setattr(ReferenceBackend, "supports", classmethod(recording))
    q = torch.randn(1, 64, 2, 32).bfloat16()
    offset = torch.zeros(2)
    for softmax_type, kwargs in (("vanilla", {}), ("learnable", dict(softmax_offset=offset)),
                                 ("off-by-one", {})):
        mxattn.mxfp8_attention(q, q, q, softmax_type=softmax_type, **kwargs)
    assert seen == ["vanilla", "learnable", "off-by-one"]
    torch._dynamo.reset()
    seen.clear()
    torch.compile(lambda q: mxattn.mxfp8_attention(q, q, q, softmax_type="off-by-one"), fullgraph=True,
                  backend="aot_eager")(q)
    assert seen == ["off-by-one"]
    p = backends.Problem(torch.device("cpu"), torch.bfloat16, 2, 4, 2, 64, 64, 32, mxattn.MaskSpec(causal=True),
                         "packed", True, torch.bfloat16, "learnable")
    assert backends.Problem.decode(p.encode()) == p


def test_auto_routes_a_packed_sink_backward_away_from_an_old_cudnn(monkeypatch):
    """cuDNN below 9.26 refuses the packed backward with a sink: `auto` sees the sink and takes the next backend
    (here reference, on the CPU), naming cuDNN's reason; a vanilla call of the same shape is not refused."""
    pytest.importorskip("cudnn")
    from mxattn import backends
    from mxattn.backends.cudnn import backend as cb
    from mxattn.backends.cudnn import refusals as cudnn_refusals
    monkeypatch.setattr(cb.CudnnBackend, "availability", classmethod(lambda cls, device: (True, "pretend SM 10.0")))
    monkeypatch.setattr(cudnn_refusals.cudnn, "backend_version", lambda: 92500)
    p = backends.Problem(torch.device("cpu"), torch.bfloat16, 3, 4, 4, 128, 128, 64, mxattn.MaskSpec(causal=True),
                         "packed", True, torch.bfloat16, "learnable")
    ok, reason = backends.supports("cudnn", p)
    assert not ok and "sink" in reason and "9.26" in reason
    monkeypatch.setattr(backends, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="9.26"):
        assert backends.choose_backend("auto", p) == "reference"
    assert cb.known_refusal(dataclasses.replace(p, softmax_type="vanilla")) is None


def test_learnable_sink_forward_and_backward_compile_fullgraph():
    """torch.compile traces the backward of a learnable-sink call without a graph break (the autograd Function
    reads the saved sink without list.pop: Dynamo holds the saved tensors as a tuple) and gives the eager
    gradients, dSink included."""
    torch._dynamo.reset()
    q, k, v, do = _qkv(s=64)
    offset = torch.randn(4)

    def fwd_bwd(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, offset)]
        o = fn(*leaves)
        o.backward(do)
        return [o.detach(), *(t.grad for t in leaves)]

    def forward(q, k, v, offset):
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", softmax_type="learnable",
                                      softmax_offset=offset, backend="reference")

    expected = fwd_bwd(forward)
    got = fwd_bwd(torch.compile(forward, backend="aot_eager", fullgraph=True))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dsink"), got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
