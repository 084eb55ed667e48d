"""The triton backend under torch.compile on a CUDA GPU: the compiled graph launches the Triton kernels itself
(`mxattn.triton_ops`, no mxattn op left in Inductor's code), and its O and gradients equal the eager call's bit
for bit, for views, layouts, GQA, masks, sinks, padded batches and calls without a gradient."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import mxattn
from mxattn import triton_ops

pytestmark = pytest.mark.gpu

KERNELS = ("_quantize_qkv_kernel", "_attn_fwd_kernel", "_bwd_prep_kernel", "_dkdv_kernel", "_dq_kernel")


def _fused_qkv(b, s, hq, hkv, d, seed):
    """q [b, s, hq, d] and k, v views unbound from one [b, s, 2, hkv, d] projection (as in a transformer)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen).bfloat16().cuda()
    kv = torch.randn(b, s, 2, hkv, d, generator=gen).bfloat16().cuda()
    do = torch.randn(b, s, hq, d, generator=gen).bfloat16().cuda()
    return q, kv, do


def _forward(kw):
    def forward(q, kv, offset=None):
        k, v = kv.unbind(2)
        extra = dict(softmax_offset=offset) if offset is not None else {}
        return mxattn.mxfp8_attention(q, k, v, backend="triton", **kw, **extra)
    return forward


def _fwd_bwd(forward, leaves, do):
    """O and the leaves' gradients of forward(*leaves) with O's gradient do (fresh gradients)."""
    for t in leaves:
        t.grad = None
    o = forward(*leaves)
    o.backward(do)
    return [o.detach().clone(), *(t.grad.clone() for t in leaves)]


CASES = {
    "causal_gqa": dict(attn_mask_type="causal"),
    "window_bottom_right": dict(attn_mask_type="causal_bottom_right", window_size=(64, 0)),
    "learnable_sink": dict(attn_mask_type="causal", softmax_type="learnable"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_graph_launches_the_kernels_and_equals_eager(case):
    torch._dynamo.reset()
    kw = dict(CASES[case])
    q, kv, do = _fused_qkv(2, 256, 8, 2, 64, seed=1)
    leaves = [q.requires_grad_(), kv.requires_grad_()]
    if kw.get("softmax_type") == "learnable":
        leaves.append(torch.randn(8, device="cuda").requires_grad_())
    forward = _forward(kw)
    expected = _fwd_bwd(forward, leaves, do)
    compiled = torch.compile(forward, fullgraph=True)
    got, codes = run_and_get_code(_fwd_bwd, compiled, leaves, do)
    code = "\n".join(codes)
    if case == "learnable_sink":  # (the generic ops: `triton_ops.applies`)
        assert "torch.ops.mxattn.attention_fwd" in code
    else:
        for name in KERNELS:
            assert name in code, name
        assert "torch.ops.mxattn.attention_fwd" not in code and "torch.ops.mxattn.attention_bwd" not in code
        assert "mxattn.triton_attention" not in code  # decomposed into the launches, not called as ops
    for _ in range(2):  # and call after call
        for name, a, b in zip(("o", "dq", "dkv"), got, expected):
            assert torch.equal(a, b), (case, name)
        if len(got) > 3:  # dsink: torch ops over the backward's delta, which Inductor fuses (its own sum order)
            torch.testing.assert_close(got[3], expected[3], rtol=1e-5, atol=1e-6)
        got = _fwd_bwd(compiled, leaves, do)


def test_compiled_padded_batch_and_sbhd_equal_eager():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    s, b = 192, 3
    q, k, v, do = (torch.randn(s, b, 8, 64, generator=gen).bfloat16().cuda() for _ in range(4))
    lens = torch.tensor([0, 150, 342, 534], dtype=torch.int32, device="cuda")  # lengths 150, 192, 192

    def forward(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, qkv_format="sbhd", attn_mask_type="padding_causal",
                                      backend="triton", cu_seqlens_q=lens, cu_seqlens_kv=lens, max_seqlen_q=s,
                                      max_seqlen_kv=s)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _fwd_bwd(forward, leaves, do)
    got, codes = run_and_get_code(_fwd_bwd, torch.compile(forward, fullgraph=True), leaves, do)
    assert "_dkdv_kernel" in "\n".join(codes)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
        assert torch.equal(a, b), name


def test_compiled_no_grad_calls_equal_eager():
    """Inference under torch.compile: the one-launch forward (one query tile, a decode step) and the two-launch
    one, both without saved copies."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(4)
    for sq in (1, 300):
        q = torch.randn(4, 8, sq, 64, generator=gen).bfloat16().cuda()
        k, v = (torch.randn(4, 2, 700, 64, generator=gen).bfloat16().cuda() for _ in range(2))
        fn = lambda q, k, v: mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd",  # noqa: E731
                                                    attn_mask_type="causal_bottom_right", backend="triton")
        with torch.no_grad():
            expected = fn(q, k, v)
            got, codes = run_and_get_code(torch.compile(fn, fullgraph=True), q, k, v)
        assert "_attn_fwd_kernel" in "\n".join(codes)
        assert torch.equal(got, expected), sq


def test_generic_ops_when_disabled(monkeypatch):
    """MXATTN_TRITON_OPS=0 (here the module switch): the compiled graph calls the generic ops, same numbers."""
    torch._dynamo.reset()
    monkeypatch.setattr(triton_ops, "ENABLED", False)
    q, kv, do = _fused_qkv(1, 128, 4, 4, 64, seed=2)
    leaves = [q.requires_grad_(), kv.requires_grad_()]
    forward = _forward(dict(attn_mask_type="causal"))
    expected = _fwd_bwd(forward, leaves, do)
    got, codes = run_and_get_code(_fwd_bwd, torch.compile(forward, fullgraph=True), leaves, do)
    assert "torch.ops.mxattn.attention_fwd" in "\n".join(codes)
    for name, a, b in zip(("o", "dq", "dkv"), got, expected):
        assert torch.equal(a, b), name
