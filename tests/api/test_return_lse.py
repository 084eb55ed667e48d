"""`mxfp8_attention(..., return_lse=True)` on the CPU (reference backend): lse against FP64 log-sum-exp of the
dequantized scores, gradients of O and lse against `ref`'s backward with the same dstats (bit for bit) and
against FP64 autograd, the merge of partial attentions over key blocks, the module, torch.compile, recipes, the
backend choice and argument errors."""

import math
import warnings

import pytest
import torch

import mxattn
from mxattn import backends
from pretend_backend import pretend_usable
from ref import mxfp8_ref

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _randn(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen).to(dtype)


def _bshd(b=2, sq=70, skv=70, hq=4, hkv=2, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return _randn(b, sq, hq, d, gen=gen), _randn(b, skv, hkv, d, gen=gen), _randn(b, skv, hkv, d, gen=gen)


def _row_dq(x):
    """x dequantized as the kernels read it for Q K^T: MXFP8 blocks of 32 along the head dim (the last axis)."""
    return mxattn.quantize_mxfp8(x, axis=-1).dequantize(torch.float32).double()


def _keep(sq, skv, mask, window=(-1, -1)):
    """Bool [sq, skv]: TE's rule, query i keeps key j when i + o - left <= j <= i + o + right (o = skv - sq
    bottom-right, 0 top-left; causal types right = 0)."""
    o = skv - sq if mask.endswith("bottom_right") else 0
    left, right = window
    right = 0 if "causal" in mask else right
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    keep = torch.ones(sq, skv, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + o + right
    if left >= 0:
        keep &= j >= i + o - left
    return keep


def _fp64_attention(qd, kd, vd, keep, sink=None):
    """O, lse of plain attention in float64 on [B, H, S, D] tensors (GQA by repetition), with an optional sink
    column [Hq] in the softmax; rows with nothing give O = 0 and lse = -inf (the sink's logit with a sink)."""
    g = qd.shape[1] // kd.shape[1]
    s = qd @ kd.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(qd.shape[-1])
    s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    p = p[..., :-1] if sink is not None else p
    return p @ vd.repeat_interleave(g, 1), lse


def _sink_kwargs(softmax_type, hq, requires_grad=False):
    if softmax_type != "learnable":
        return dict(softmax_type=softmax_type), None
    offset = torch.tensor([-1.0, 0.5, 2.0, 0.0][:hq]).requires_grad_(requires_grad)
    return dict(softmax_type="learnable", softmax_offset=offset), offset


def _sink_logits(softmax_type, hq):
    return {"vanilla": None, "off-by-one": torch.zeros(hq)}.get(softmax_type, torch.tensor([-1.0, 0.5, 2.0, 0.0]))


# --------------------------------------------------------------------------- lse against FP64


@pytest.mark.parametrize("mask,sq,skv,window,softmax_type", [
    ("no_mask", 70, 70, None, "vanilla"),
    ("causal", 70, 70, (16, 0), "learnable"),
    ("causal_bottom_right", 70, 40, None, "vanilla"),      # the first 30 rows keep no key: -inf
    ("causal_bottom_right", 70, 40, None, "off-by-one"),   # ... and the sink logit 0 with a sink
])
def test_lse_is_the_fp64_logsumexp_of_the_dequantized_scores(mask, sq, skv, window, softmax_type):
    q, k, v = _bshd(sq=sq, skv=skv)
    kw, _ = _sink_kwargs(softmax_type, 4)
    o, lse = mxattn.mxfp8_attention(q, k, v, attn_mask_type=mask, window_size=window, backend="reference",
                                    return_lse=True, **kw)
    assert lse.shape == (2, 4, sq) and lse.dtype == torch.float32 and o.shape == q.shape
    qd, kd = (_row_dq(t).transpose(1, 2) for t in (q, k))
    keep = _keep(sq, skv, mask, window or (-1, -1))
    _, want = _fp64_attention(qd, kd, kd, keep, _sink_logits(softmax_type, 4))
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[~finite] == float("-inf")).all()
    torch.testing.assert_close(lse[finite].double(), want[finite], rtol=0, atol=1e-5)
    if mask == "causal_bottom_right":
        assert not keep[:30].any()
        assert bool(finite[:, :, :30].all()) == (softmax_type != "vanilla")
    # O is the plain call's
    assert torch.equal(o, mxattn.mxfp8_attention(q, k, v, attn_mask_type=mask, window_size=window,
                                                 backend="reference", **kw))


@pytest.mark.parametrize("layout", ["thd", "padded"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_lse_of_packed_and_padded_batches(layout, softmax_type):
    """Per-sequence lse; the sequence with queries but no keys gives -inf (or the sink); padding rows -inf."""
    lens_q, lens_kv = [40, 20, 33], [50, 0, 64]
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 4, 2, 32
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    kw, _ = _sink_kwargs(softmax_type, hq)
    sink = _sink_logits(softmax_type, hq)
    if layout == "thd":
        q, k, v = (_randn(n, h, d, gen=gen) for n, h in ((sum(lens_q), hq), (sum(lens_kv), hkv),
                                                         (sum(lens_kv), hkv)))
        o, lse = mxattn.mxfp8_attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                                        cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, backend="reference",
                                        return_lse=True, **kw)
        assert lse.shape == (hq, sum(lens_q))
        rows = lambda x, cu, b: x[cu[b]:cu[b + 1]]  # noqa: E731
        lse_rows = lambda b: lse[:, cq[b]:cq[b + 1]]  # noqa: E731
    else:
        q, k, v = (_randn(3, s, h, d, gen=gen) for s, h in ((48, hq), (64, hkv), (64, hkv)))
        o, lse = mxattn.mxfp8_attention(q, k, v, attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=cu_q,
                                        cu_seqlens_kv=cu_kv, backend="reference", return_lse=True, **kw)
        assert lse.shape == (3, hq, 48)
        for b, n in enumerate(lens_q):
            assert (lse[b, :, n:] == float("-inf")).all()  # padding rows
        rows = lambda x, cu, b: x[b, :cu[b + 1] - cu[b]]  # noqa: E731
        lse_rows = lambda b: lse[b, :, :lens_q[b]]  # noqa: E731
    for b, (nq, nk) in enumerate(zip(lens_q, lens_kv)):
        qd = _row_dq(rows(q, cq, b)).transpose(0, 1).unsqueeze(0)
        kd = _row_dq(rows(k, ckv, b)).transpose(0, 1).unsqueeze(0)
        _, want = _fp64_attention(qd, kd, kd, _keep(nq, nk, "padding_causal_bottom_right"), sink)
        got = lse_rows(b).double()
        assert torch.equal(torch.isfinite(got), torch.isfinite(want[0]))
        finite = torch.isfinite(want[0])
        torch.testing.assert_close(got[finite], want[0][finite], rtol=0, atol=1e-5)
    if sink is None:
        assert (lse_rows(1) == float("-inf")).all()
    else:
        assert torch.equal(lse_rows(1), sink.view(-1, 1).expand(hq, lens_q[1]))


# --------------------------------------------------------------------------- gradients


def _loss_grads(q, k, v, w1, w2, **kw):
    """(O, lse, dq, dk, dv, dsink) of loss = (O * w1).sum() + (lse * w2).sum() (w1 None: lse alone)."""
    offset = kw.pop("softmax_offset", None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    off = None if offset is None else offset.detach().clone().requires_grad_()
    o, lse = mxattn.mxfp8_attention(*leaves, softmax_offset=off, backend="reference", return_lse=True, **kw)
    loss = (lse * w2).sum() + (0 if w1 is None else (o * w1).sum())
    loss.backward()
    return o.detach(), lse.detach(), *(t.grad for t in leaves), None if off is None else off.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
@pytest.mark.parametrize("with_o", [True, False])
def test_gradients_equal_ref_with_dstats_and_fp64_autograd(softmax_type, with_o):
    """bshd, causal, GQA: the reference backend's gradients are ref's backward given the same dstats, bit for
    bit (dO = 0 when only lse reaches the loss), and close to FP64 autograd of plain attention."""
    q, k, v = _bshd(sq=70, skv=70)
    gen = torch.Generator().manual_seed(7)
    w1 = _randn(2, 70, 4, 32, gen=gen) if with_o else None
    w2 = torch.randn(2, 4, 70, generator=gen) * 4
    kw, offset = _sink_kwargs(softmax_type, 4)
    o, lse, dq, dk, dv, dsink = _loss_grads(q, k, v, w1, w2, attn_mask_type="causal", **kw)
    sink = None if offset is None else offset.detach()
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    ro, rstats = mxfp8_ref.sdpa_fwd(qb, kb, vb, causal=True, sink=sink)
    assert torch.equal(o.transpose(1, 2), ro) and torch.equal(lse, rstats[..., 0])
    do = torch.zeros_like(ro) if w1 is None else w1.transpose(1, 2)
    want = mxfp8_ref.sdpa_bwd(qb, kb, vb, ro, do, rstats, causal=True, sink=sink, dstats=w2.unsqueeze(-1))
    got = (dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)) + ((dsink,) if sink is not None else ())
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    if w1 is None:
        assert not dv.any()  # P^T dO with dO = 0
    # FP64 autograd on the dequantized inputs (V as the forward reads it: blocks along S)
    q64, k64 = (_row_dq(t).transpose(1, 2).requires_grad_() for t in (q, k))
    v64 = mxattn.quantize_mxfp8(v, axis=1).dequantize(torch.float32).double().transpose(1, 2).requires_grad_()
    off64 = None if sink is None else sink.double().requires_grad_()
    o64, lse64 = _fp64_attention(q64, k64, v64, _keep(70, 70, "causal"), off64)
    loss = (lse64 * w2.double()).sum() + (0 if w1 is None else (o64 * w1.double().transpose(1, 2)).sum())
    loss.backward()
    assert _rel(dq.transpose(1, 2), q64.grad) < 0.05 and _rel(dk.transpose(1, 2), k64.grad) < 0.05
    if w1 is not None:
        assert _rel(dv.transpose(1, 2), v64.grad) < 0.05
    if sink is not None:
        assert _rel(dsink, off64.grad) < 0.02


def test_an_unused_lse_leaves_the_plain_gradients():
    q, k, v = _bshd(sq=64, skv=64, seed=9)
    do = _randn(2, 64, 4, 32, gen=torch.Generator().manual_seed(1))
    grads = []
    for return_lse in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mxattn.mxfp8_attention(*leaves, attn_mask_type="causal", backend="reference", return_lse=return_lse)
        (out[0] if return_lse else out).backward(do)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_packed_gradients_equal_ref_varlen_with_dstats(softmax_type):
    """thd with a sequence that has queries but no keys (with a sink, its lse is the sink: dsink takes its
    dstats whole)."""
    lens_q, lens_kv = [40, 20, 33], [50, 0, 64]
    gen = torch.Generator().manual_seed(5)
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    tq, tk = sum(lens_q), sum(lens_kv)
    q, k, v, w1 = _randn(tq, 4, 32, gen=gen), _randn(tk, 2, 32, gen=gen), _randn(tk, 2, 32, gen=gen), \
        _randn(tq, 4, 32, gen=gen)
    w2 = torch.randn(4, tq, generator=gen)
    kw, offset = _sink_kwargs(softmax_type, 4)
    o, lse, dq, dk, dv, dsink = _loss_grads(q, k, v, w1, w2, qkv_format="thd", attn_mask_type="padding_causal",
                                            cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kw)
    sink = None if offset is None else offset.detach()
    opts = dict(layout="thd", causal=True, sink=sink)
    ro, rstats = mxfp8_ref.sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, **opts)
    assert torch.equal(o, ro) and torch.equal(lse, rstats.t())
    want = mxfp8_ref.sdpa_bwd_varlen(q, k, v, ro, w1, rstats, cu_q, cu_kv, dstats=w2.t().contiguous(), **opts)
    for g, r in zip((dq, dk, dv, dsink), want):
        assert torch.equal(g, r)
    if sink is not None:  # the keyless sequence's share: exactly its dstats
        keyless = w2[:, 40:60].sum(dim=1)
        no_lse = mxfp8_ref.sdpa_bwd_varlen(q, k, v, ro, w1, rstats, cu_q, cu_kv,
                                           dstats=torch.cat([w2[:, :40], torch.zeros(4, 20), w2[:, 60:]], 1).t(),
                                           **opts)[3]
        torch.testing.assert_close(dsink - no_lse, keyless, rtol=0, atol=1e-5)


@pytest.mark.parametrize("recipe,ref_fwd,ref_bwd", [
    (mxattn.Recipe(ds_quant="bf16", v_operand="bf16"), dict(v_format="bf16"), dict(v_format="bf16", ds_format="bf16")),
    (mxattn.Recipe(scaling="per_tensor"), dict(scaling="per_tensor"), dict(scaling="per_tensor")),
])
def test_recipe_variants_take_dstats(recipe, ref_fwd, ref_bwd):
    q, k, v = _bshd(sq=64, skv=96, seed=2)
    gen = torch.Generator().manual_seed(11)
    w1, w2 = _randn(2, 64, 4, 32, gen=gen), torch.randn(2, 4, 64, generator=gen)
    o, lse, dq, dk, dv, _ = _loss_grads(q, k, v, w1, w2, recipe=recipe)
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    ro, rstats = mxfp8_ref.sdpa_fwd(qb, kb, vb, **ref_fwd)
    assert torch.equal(o.transpose(1, 2), ro) and torch.equal(lse, rstats[..., 0])
    want = mxfp8_ref.sdpa_bwd(qb, kb, vb, ro, w1.transpose(1, 2), rstats, dstats=w2.unsqueeze(-1), **ref_bwd)
    for g, r in zip((dq, dk, dv), want):
        assert torch.equal(g.transpose(1, 2), r)


# --------------------------------------------------------------------------- merging partial attentions


@pytest.mark.parametrize("softmax_type,recipe", [("vanilla", None), ("learnable", None),
                                                  ("vanilla", mxattn.Recipe(p_quant="none"))])
def test_merge_of_two_key_blocks_is_the_whole_call(softmax_type, recipe):
    """Keys [0, n) against [0, m) and [m, n), m a multiple of 32 (the same V blocks): lse = logaddexp(lse_1,
    lse_2) and O = sum_i exp(lse_i - lse) O_i in fp32, a sink entering once (the first part's). P's E4M3 rounding
    follows each call's running max, so the merge differs from the whole call by P's quantization noise: it is as
    close to FP64 attention as the whole call is (and within bf16 rounding of it when P is not quantized)."""
    q, k, v = _bshd(sq=80, skv=160, seed=4)
    kw, _ = _sink_kwargs(softmax_type, 4)
    opts = dict(backend="reference", return_lse=True, out_dtype=torch.float32, recipe=recipe)
    o, lse = mxattn.mxfp8_attention(q, k, v, **opts, **kw)
    o1, lse1 = mxattn.mxfp8_attention(q, k[:, :96], v[:, :96], **opts, **kw)
    o2, lse2 = mxattn.mxfp8_attention(q, k[:, 96:], v[:, 96:], **opts)
    merged_lse = torch.logaddexp(lse1, lse2)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=1e-5)
    weight = lambda part: torch.exp(part - merged_lse).transpose(1, 2).unsqueeze(-1)  # noqa: E731 ([B,S,H,1])
    merged = weight(lse1) * o1 + weight(lse2) * o2
    assert o.dtype == torch.float32
    if recipe is not None:
        assert _rel(merged, o) < 5e-3
        return
    qd, kd = (_row_dq(t).transpose(1, 2) for t in (q, k))
    vd = mxattn.quantize_mxfp8(v, axis=1).dequantize(torch.float32).double().transpose(1, 2)
    exact, _ = _fp64_attention(qd, kd, vd, _keep(80, 160, "no_mask"), _sink_logits(softmax_type, 4))
    exact = exact.transpose(1, 2)
    assert _rel(merged, o) < 0.04 and _rel(merged, exact) < 1.1 * _rel(o, exact)


# --------------------------------------------------------------------------- module, compile, empty calls


def test_module_returns_lse_and_trains_its_sink():
    layer = mxattn.DotProductAttention(4, 32, num_gqa_groups=2, attn_mask_type="causal", softmax_type="learnable",
                                       backend="reference")
    with torch.no_grad():
        layer.softmax_offset.copy_(torch.tensor([-1.0, 0.5, 2.0, 0.0]))
    q, k, v = _bshd(sq=64, skv=64)
    out, lse = layer(q, k, v, return_lse=True)
    assert out.shape == (2, 64, 128) and lse.shape == (2, 4, 64)
    o, want = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", softmax_type="learnable",
                                     softmax_offset=layer.softmax_offset.detach(), backend="reference",
                                     return_lse=True)
    assert torch.equal(out, o.reshape(2, 64, 128)) and torch.equal(lse, want)
    assert torch.equal(layer(q, k, v), out)  # return_lse=False: the output alone
    lse.sum().backward()
    # d lse / d sink = P_sink = exp(sink - lse), summed over batch and rows
    expected = torch.exp(layer.softmax_offset.detach().view(1, -1, 1) - lse.detach()).sum(dim=(0, 2))
    torch.testing.assert_close(layer.softmax_offset.grad, expected, rtol=1e-5, atol=1e-5)
    out_b, lse_b = layer(*(t.transpose(1, 2) for t in (q, k, v)), qkv_format="bhsd", return_lse=True)
    assert torch.equal(out_b, o.transpose(1, 2)) and torch.equal(lse_b, lse)


def test_a_compiled_function_gives_the_eager_results():
    q, k, v = _bshd(sq=64, skv=64, seed=6)

    def f(q, k, v):
        o, lse = mxattn.mxfp8_attention(q * 2, k, v, attn_mask_type="causal", backend="reference", return_lse=True)
        return o.float().sum(-1) + lse.transpose(1, 2)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in leaves)]

    torch._dynamo.reset()
    for got, want in zip(run(torch.compile(f, backend="aot_eager")), run(f)):
        assert torch.equal(got, want)


def test_empty_calls():
    q, k, v = _bshd(sq=16, skv=16)
    offset = torch.tensor([-1.0, 0.5, 2.0, 0.0], requires_grad=True)
    o, lse = mxattn.mxfp8_attention(q, k[:, :0], v[:, :0], backend="reference", return_lse=True)
    assert not o.any() and lse.shape == (2, 4, 16) and (lse == float("-inf")).all()
    o, lse = mxattn.mxfp8_attention(q, k[:, :0], v[:, :0], backend="reference", return_lse=True,
                                    softmax_type="learnable", softmax_offset=offset)
    assert torch.equal(lse, offset.detach().view(1, -1, 1).expand(2, 4, 16))
    lse.sum().backward()
    assert torch.equal(offset.grad, torch.full((4,), 32.0))


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_already_quantized_inputs_give_the_same_lse(qkv_format):
    q, k, v = _bshd(b=1, sq=64, skv=96, seed=8)
    kw = dict(attn_mask_type="causal_bottom_right", softmax_type="off-by-one")
    if qkv_format == "thd":
        q, k, v = q[0], k[0], v[0]
        kw = dict(kw, attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=_cu([24, 40]),
                  cu_seqlens_kv=_cu([64, 32]))
    inputs = mxattn.quantize_attention_inputs(q, k, v, qkv_format=qkv_format, cu_seqlens_q=kw.get("cu_seqlens_q"),
                                              cu_seqlens_kv=kw.get("cu_seqlens_kv"))
    o, lse = mxattn.mxfp8_attention_quantized(*inputs, qkv_format=qkv_format, backend="reference", return_lse=True,
                                              **kw)
    want_o, want_lse = mxattn.mxfp8_attention(q, k, v, qkv_format=qkv_format, backend="reference", return_lse=True,
                                              **kw)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert lse.shape == ((4, 64) if qkv_format == "thd" else (1, 4, 64))


# --------------------------------------------------------------------------- backend choice and errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_explicit_cudnn_refuses_a_differentiable_lse(monkeypatch):
    q, k, v = (t.requires_grad_() for t in _bshd(sq=32, skv=32))
    pretend_usable(monkeypatch, "cudnn")
    with pytest.raises(mxattn.MXFP8NotSupportedError, match="backend 'cudnn'.*log-sum-exp"):
        mxattn.mxfp8_attention(q, k, v, backend="cudnn", return_lse=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_auto_passes_over_cudnn_to_the_triton_backward(monkeypatch):
    """A differentiable lse: cuDNN's backward takes no dLSE, the Triton backward does (delta - dLSE)."""
    pretend_usable(monkeypatch, "cudnn")
    pretend_usable(monkeypatch, "triton")
    monkeypatch.setattr(backends, "_WARNED", set())
    q, k, v = (t.requires_grad_() for t in _bshd(sq=32, skv=32))
    with pytest.raises(AssertionError, match="a triton kernel ran"):
        mxattn.mxfp8_attention(q, k, v, return_lse=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_auto_falls_back_to_reference_with_the_reason(monkeypatch):
    pretend_usable(monkeypatch, "cudnn")
    monkeypatch.setattr(backends, "_WARNED", set())
    q, k, v = (t.requires_grad_() for t in _bshd(sq=32, skv=32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, lse = mxattn.mxfp8_attention(q, k, v, return_lse=True)
        mxattn.mxfp8_attention(q, k, v, return_lse=True)
    messages = [str(w.message) for w in caught if "backend='auto'" in str(w.message)]
    assert len(messages) == 1 and "'reference'" in messages[0] and "log-sum-exp" in messages[0]
    assert torch.equal(lse, mxattn.mxfp8_attention(q, k, v, backend="reference", return_lse=True)[1])


def test_the_choice_sees_stats_grad_and_kernel_out_dtypes(monkeypatch):
    """out_dtype=float32 reaches the backends as the kernels' dtype (bf16 here), on both paths; stats_grad is
    set exactly when a gradient will be wanted."""
    import mxattn.attention as attention_module
    import mxattn.attention_lse as lse_module
    seen = []

    def recording(name, problem):
        seen.append(problem)
        return backends.choose_backend(name, problem)

    monkeypatch.setattr(attention_module, "_PLANS", {})  # (a planned call makes no choice)
    monkeypatch.setattr(attention_module, "choose_backend", recording)
    monkeypatch.setattr(lse_module, "choose_backend", recording)
    q, k, v = (t.float() for t in _bshd(sq=32, skv=32))
    o = mxattn.mxfp8_attention(q, k, v, out_dtype=torch.float32, backend="reference")
    o_lse, lse = mxattn.mxfp8_attention(q.requires_grad_(), k, v, out_dtype=torch.float32, backend="reference",
                                        return_lse=True)
    with torch.no_grad():
        mxattn.mxfp8_attention(q, k, v, backend="reference", return_lse=True)
    assert [p.out_dtype for p in seen] == [torch.bfloat16] * 3
    assert [p.stats_grad for p in seen] == [False, True, False]
    assert o.dtype == o_lse.dtype == torch.float32 and torch.equal(o, o_lse.detach())


@pytest.mark.parametrize("bad", [1, "yes", None, torch.tensor(True)])
def test_return_lse_must_be_a_bool(bad):
    q, k, v = _bshd(sq=32, skv=32)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        mxattn.mxfp8_attention(q, k, v, backend="reference", return_lse=bad)
    layer = mxattn.DotProductAttention(4, 32, num_gqa_groups=2, backend="reference")
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        layer(q, k, v, return_lse=bad)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        mxattn.mxfp8_attention_quantized(*mxattn.quantize_attention_inputs(q, k, v), backend="reference",
                                         return_lse=bad)


def test_ref_checks_dstats():
    q, k, v = (torch.randn(1, 2, 32, 32) for _ in range(3))
    o, stats = mxfp8_ref.sdpa_fwd(q, k, v)
    with pytest.raises(ValueError, match="dstats"):
        mxfp8_ref.sdpa_bwd(q, k, v, o, o, stats, dstats=torch.zeros(1, 2, 32))
    with pytest.raises(TypeError, match="dstats"):
        mxfp8_ref.sdpa_bwd(q, k, v, o, o, stats, dstats=torch.zeros(1, 2, 32, 1, dtype=torch.int32))


def test_rows_without_keys_pass_no_nan_gradient_from_a_logsumexp_merge():
    """Bottom-right causal with more queries than keys: the first rows keep no key (lse = -inf). A merge through
    torch.logsumexp hands those rows a NaN gradient; it must not reach dQ, dK, dV."""
    q, k, v = _bshd(sq=64, skv=32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = mxattn.mxfp8_attention(*leaves, attn_mask_type="causal_bottom_right", backend="reference",
                                    return_lse=True)
    assert torch.isneginf(lse).any()
    merged = torch.logsumexp(torch.stack([lse, torch.full_like(lse, float("-inf"))]), dim=0)
    (o.float().sum() + merged.clamp_min(-1e4).sum()).backward()  # (the -inf rows get a zero gradient, then NaN)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
