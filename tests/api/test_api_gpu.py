"""The public API on a CUDA GPU: `auto` choice, and the GPU backend against the CPU reference backend."""

import warnings

import pytest
import torch

import mxattn
from mxattn.metrics import rel_rms

pytestmark = pytest.mark.gpu


def _inputs(fmt="bshd", b=2, s=384, hq=8, hkv=2, d=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen).bfloat16()
    k = torch.randn(b, s, hkv, d, generator=gen).bfloat16()
    v = torch.randn(b, s, hkv, d, generator=gen).bfloat16()
    do = torch.randn(b, s, hq, d, generator=gen).bfloat16()
    return q, k, v, do


def _fwd_bwd(q, k, v, do, device, backend, **kw):
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    o = mxattn.mxfp8_attention(*leaves, backend=backend, **kw)
    o.backward(do.to(device))
    return [t.cpu() for t in (o.detach(), *(leaf.grad for leaf in leaves))]


def test_auto_choice_matches_cudnn_support():
    from mxattn import backends
    backends._WARNED.clear()
    q, k, v, _ = _inputs()
    ok, reason = mxattn.cudnn_support()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mxattn.mxfp8_attention(q.cuda(), k.cuda(), v.cuda())
    notes = [str(w.message) for w in caught if "backend='auto'" in str(w.message)]
    if ok:
        assert notes == []
    else:
        assert len(notes) == 1 and "'triton'" in notes[0] and "cudnn" in notes[0]


# S=333 exercises masked tails; cuDNN's backward needs S % 64 == 0 for a bottom-right band, so that one uses 384
@pytest.mark.parametrize("mask,s", [("no_mask", 333), ("causal", 333), ("causal_bottom_right", 384)])
def test_gpu_backend_matches_reference_backend(mask, s):
    q, k, v, do = _inputs(s=s)
    gpu = _fwd_bwd(q, k, v, do, "cuda", "auto", attn_mask_type=mask)
    cpu = _fwd_bwd(q, k, v, do, "cpu", "reference", attn_mask_type=mask)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), gpu, cpu):
        assert rel_rms(a, b) < 1e-2, name


def test_compile_fullgraph_on_gpu():
    torch._dynamo.reset()
    q, k, v, _ = (t.cuda() for t in _inputs(s=256))
    fn = torch.compile(lambda q, k, v: mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal"), fullgraph=True)
    expected = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal")
    assert torch.equal(fn(q, k, v), expected)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_forward_and_backward_on_gpu(mode):
    """torch.compile (inductor; "reduce-overhead" replays CUDA graphs, which removes the host time of the
    eager calls) traces the backward through the custom ops, never into the kernels, and gives the eager
    call's O and gradients bit for bit (same kernels), call after call."""
    torch._dynamo.reset()
    q, k, v, do = (t.cuda() for t in _inputs(s=320))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step(q, k, v):
        o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal")
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    expected = [t.clone() for t in step(*leaves)]
    compiled = torch.compile(step, mode=mode)
    for _ in range(3):  # (reduce-overhead: warm-up, recording, replay)
        got = [t.clone() for t in compiled(*leaves)]
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
            assert torch.equal(a, b), (mode, name)
    for s in (200, 448):  # new sequence lengths: the second makes the sizes symbolic (dynamic shapes)
        q, k, v, do = (t.cuda() for t in _inputs(s=s, seed=s))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = [t.clone() for t in step(*leaves)]
        got = [t.clone() for t in compiled(*leaves)]
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
            assert torch.equal(a, b), (mode, s, name)


def test_compiled_fused_projection_calls_replay_packed_and_equal_eager(monkeypatch):
    """A compiled layer in GPT-2's shape (q, k, v as bhsd views of one fused projection, new values every step):
    the packed ops (`mxattn.runtime.saved_block`) give the eager call's O and gradients bit for bit at every step; from
    the third step the forward's replay hands its block over without copying (its launches issued by the
    generated code of `launch_plan`, through Triton's C launcher), and the backward replays onto the block."""
    from mxattn import op_plans
    from mxattn.runtime import saved_block
    torch._dynamo.reset()
    copies = []
    real_pack = saved_block.pack
    monkeypatch.setattr(saved_block, "pack", lambda tensors, layout: copies.append(1) or real_pack(tensors, layout))
    b, s, h, d = 4, 256, 8, 64

    def layer(x, do):  # x: the fused projection's output [B, S, 3 H D], viewed bshd as the HF path hands it over
        q, k, v = (t.view(b, s, h, d) for t in x.split(h * d, dim=2))
        o = mxattn.mxfp8_attention(q, k, v, qkv_format="bshd", attn_mask_type="causal", backend="triton")
        return (o, *torch.autograd.grad(o, x, do))

    compiled = torch.compile(layer)
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(b, s, 3 * h * d, generator=gen).bfloat16().cuda().requires_grad_()
        do = torch.randn(b, s, h, d, generator=gen).bfloat16().cuda()
        expected = [t.clone() for t in layer(x, do)]
        copies.clear()
        got = [t.clone() for t in compiled(x, do)]
        for name, a, e in zip(("o", "dx"), got, expected):
            assert torch.equal(a, e), (step, name)
        if step >= 2:
            assert copies == [], step
    assert any(key[0][0] == "bwd block" for key in op_plans.PLANS._plans)


@pytest.mark.parametrize("grad", [True, False])
def test_reduce_overhead_replays_follow_new_values(grad):
    """Under "reduce-overhead" the compiled calls replay CUDA graphs: mxattn's launches must be captured in them
    (on the capture stream), so calls with new values at one shape give new results, each equal to the eager
    call's bit for bit (a launch left out of the graph would hand back the recorded call's stale O); training
    (forward and backward) and inference (no grad)."""
    torch._dynamo.reset()

    def train(q, k, v, do):
        o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal")
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    def infer(q, k, v, do):
        return (mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal"),)

    step = train if grad else infer
    compiled = torch.compile(step, mode="reduce-overhead")
    with torch.set_grad_enabled(grad):
        for seed in range(5):  # warm-up, recording, then replays, each on new values
            q, k, v, do = (t.cuda() for t in _inputs(s=256, seed=10 + seed))
            leaves = [t.requires_grad_(grad) for t in (q, k, v)]
            expected = [t.clone() for t in step(*leaves, do)]
            got = [t.clone() for t in compiled(*leaves, do)]
            for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
                assert torch.equal(a, b), (seed, name)


@pytest.mark.parametrize("mask,hkv", [("no_mask", 8), ("causal", 2)])
def test_reference_backend_on_cuda_equals_cpu_bit_for_bit(mask, hkv):
    q, k, v, do = _inputs(s=200, hkv=hkv)
    gpu = _fwd_bwd(q, k, v, do, "cuda", "reference", attn_mask_type=mask)
    cpu = _fwd_bwd(q, k, v, do, "cpu", "reference", attn_mask_type=mask)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), gpu, cpu):
        assert torch.equal(a, b), name


def test_reference_backend_thd_on_cuda_equals_cpu_bit_for_bit():
    lengths = [5, 0, 70, 33]
    cu = torch.tensor([0, 5, 5, 75, 108], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q, do = (torch.randn(108, 4, 64, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(108, 2, 64, generator=gen).bfloat16() for _ in range(2))
    outs = []
    for dev in ("cuda", "cpu"):
        outs.append(_fwd_bwd(q, k, v, do, dev, "reference", qkv_format="thd", attn_mask_type="padding_causal",
                             cu_seqlens_q=cu.to(dev), cu_seqlens_kv=cu.to(dev)))
    assert sum(lengths) == 108
    for name, a, b in zip(("O", "dQ", "dK", "dV"), *outs):
        assert torch.equal(a, b), name


def test_fp32_inputs_on_gpu_route_and_come_back_fp32():
    """fp32 q/k/v on a Hopper GPU: auto picks a backend that runs them (triton quantizes fp32 directly) and O
    and the gradients are fp32; the numbers equal the reference backend on the same fp32 inputs."""
    q, k, v, do = (t.float() for t in _inputs(s=256))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpu = _fwd_bwd(q, k, v, do, "cuda", "auto", attn_mask_type="causal")
    cpu = _fwd_bwd(q, k, v, do, "cpu", "reference", attn_mask_type="causal")
    for name, a, b in zip(("O", "dQ", "dK", "dV"), gpu, cpu):
        assert a.dtype == torch.float32, name
        assert rel_rms(a, b) < 1e-2, name


def test_triton_infinities_match_the_reference_backend():
    """The triton backend propagates infinities as the reference backend does (and torch SDPA: see
    tests/api/test_attention_api.py::test_infinities_as_documented): the same NaN rows for +inf in K, the same
    infinite elements for +inf in V."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, 64, generator=g).bfloat16() for _ in range(3))
    k_inf, v_inf = k.clone(), v.clone()
    k_inf[0, 5, 0, 3] = float("inf")
    v_inf[0, 9, 1, 7] = float("inf")
    for kk, vv in ((k_inf, v), (k, v_inf)):
        ref = mxattn.mxfp8_attention(q, kk, vv, backend="reference")
        tri = mxattn.mxfp8_attention(q.cuda(), kk.cuda(), vv.cuda(), backend="triton").cpu()
        assert torch.equal(tri.isnan(), ref.isnan()) and torch.equal(tri.isinf(), ref.isinf())
        assert ref.isnan().any() or ref.isinf().any()
