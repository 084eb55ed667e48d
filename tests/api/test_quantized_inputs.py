"""Attention on already-quantized inputs on the CPU: `mxfp8_attention_quantized` / `forward_quantized` of the
reference backend equal the unquantized call bit for bit (dense in every layout, padded, packed thd, sinks,
recipe variants); argument errors name the argument, before any kernel; the base class refuses with the
backend's name; the triton backend's host path (launches recorded, not made) makes exactly the forward kernel's
launch of the unquantized call, with its V operand laid out as the fused quantizer lays it out, and under
Triton's interpreter (tests/interpret_quantized_fwd.py) gives the unquantized call's bytes. The GPU's numbers:
test_quantized_inputs_gpu.py."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from repo_paths import ROOT

import mxattn
from mxattn import MXFP8Tensor, Recipe, quantize_attention_inputs, quantize_mxfp8
from mxattn.backends import pick_backend
from mxattn.backends.base import AttentionBackend, AttentionParams, Problem
from mxattn.backends.reference import ReferenceBackend
from mxattn.errors import MXFP8NotSupportedError
from mxattn.mask import MaskSpec
from mxattn.seqinfo import SeqInfo

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _randn(*shape, seed=0, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _dense(fmt="bshd", b=2, sq=70, skv=90, hq=4, hkv=2, d=64):
    shapes = {"bshd": lambda s, h: (b, s, h, d), "sbhd": lambda s, h: (s, b, h, d),
              "bhsd": lambda s, h: (b, h, s, d)}[fmt]
    return _randn(*shapes(sq, hq), seed=1), _randn(*shapes(skv, hkv), seed=2) * 3, _randn(*shapes(skv, hkv), seed=3)


def _padded(b=3, s_q=70, s_kv=100, hq=4, hkv=2, d=64):
    """A padded bshd batch whose padding rows hold huge values (they would change V's last block scale of each
    sequence if they were quantized as they are, instead of as zeros)."""
    q, k, v = _dense("bshd", b, s_q, s_kv, hq, hkv, d)
    len_q, len_kv = [70, 9, 33], [100, 40, 1]
    for b_, (lq, lk) in enumerate(zip(len_q, len_kv)):
        q[b_, lq:] = 3e4
        k[b_, lk:] = -3e4
        v[b_, lk:] = 3e4
    return q, k, v, dict(attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=_cu(len_q),
                         cu_seqlens_kv=_cu(len_kv))


def _packed(hq=4, hkv=2, d=64):
    len_q, len_kv = [20, 0, 45, 1], [40, 7, 70, 0]  # an empty query sequence, a sequence with no key
    q, k, v = (_randn(sum(n), h, d, seed=i) for i, (n, h) in enumerate(((len_q, hq), (len_kv, hkv), (len_kv, hkv))))
    return q, k, v, dict(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=_cu(len_q),
                         cu_seqlens_kv=_cu(len_kv))


def _quantized_kw(kw):
    """quantize_attention_inputs's arguments among mxfp8_attention's."""
    return {n: kw[n] for n in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "recipe") if n in kw}


def _both(q, k, v, backend="reference", **kw):
    """(mxfp8_attention's O, mxfp8_attention_quantized's O on quantize_attention_inputs' bytes), without grad."""
    with torch.no_grad():
        want = mxattn.mxfp8_attention(q, k, v, backend=backend, **kw)
        got = mxattn.mxfp8_attention_quantized(*quantize_attention_inputs(q, k, v, **_quantized_kw(kw)),
                                               backend=backend, **kw)
    return want, got


# --------------------------------------------------------------------------- bit for bit (reference backend)


CASES = {
    "bshd_causal": lambda: (*_dense("bshd"), dict(attn_mask_type="causal")),
    "sbhd_window": lambda: (*_dense("sbhd"), dict(qkv_format="sbhd", window_size=(20, 0))),
    "bhsd_no_mask_fp32_out": lambda: (*_dense("bhsd"), dict(qkv_format="bhsd", out_dtype=torch.float32,
                                                            softmax_scale=0.07)),
    "bshd_off_by_one": lambda: (*_dense("bshd"), dict(softmax_type="off-by-one", attn_mask_type="causal")),
    "padded": lambda: _padded(),
    "packed_learnable_sink": lambda: (*_packed()[:3], dict(_packed()[3], softmax_type="learnable",
                                                           softmax_offset=torch.tensor([0.5, -1.0, 2.0, 0.0]))),
    "lazy16": lambda: (*_dense("bshd"), dict(attn_mask_type="causal", recipe=Recipe(p_quant="lazy16"))),
    "bf16_v_packed": lambda: (*_packed()[:3], dict(_packed()[3], recipe=Recipe(v_operand="bf16"))),
    "floor_p_none_padded": lambda: (*_padded()[:3], dict(_padded()[3], recipe=Recipe(scale_rounding="floor",
                                                                                     p_quant="none"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_equals_the_unquantized_call_bit_for_bit(case):
    q, k, v, kw = CASES[case]()
    want, got = _both(q, k, v, **kw)
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype
    assert got.abs().sum() > 0
    assert torch.equal(got, want)


def test_the_padding_rule_is_what_makes_padded_inputs_equal():
    """V quantized with its padding rows as they are (huge values) has other last-block scales: the result
    differs (padding rows are read as given, scales included), so the equality above is no accident."""
    q, k, v, kw = _padded()
    want = mxattn.mxfp8_attention(q, k, v, backend="reference", **kw)
    qq, kq, _ = quantize_attention_inputs(q, k, v, cu_seqlens_q=kw["cu_seqlens_q"], cu_seqlens_kv=kw["cu_seqlens_kv"])
    v_as_is = quantize_mxfp8(v, axis=1)
    got = mxattn.mxfp8_attention_quantized(qq, kq, v_as_is, backend="reference", **kw)
    assert not torch.equal(got, want)


def test_backend_entry_point_returns_forwards_o_and_stats():
    """`forward_quantized` on [B, H, S, D] views gives `forward`'s (o, stats), padded with a sink."""
    q, k, v, kw = _padded()
    seq = SeqInfo(kw["cu_seqlens_q"], kw["cu_seqlens_kv"], 70, 100, False)
    params = AttentionParams(softmax_scale=0.1, mask=MaskSpec(causal=True, diagonal_alignment="bottom_right"),
                             seq=seq, sink=torch.tensor([0.0, 1.0, -1.0, 3.0]), needs_backward=False)
    qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
    be = ReferenceBackend()
    o, stats, saved = be.forward(qb, kb, vb, params)
    quantized = quantize_attention_inputs(qb, kb, vb, qkv_format="bhsd", cu_seqlens_q=seq.cu_seqlens_q,
                                          cu_seqlens_kv=seq.cu_seqlens_kv)
    o2, stats2 = be.forward_quantized(*quantized, params)
    assert torch.equal(o, o2) and torch.equal(stats, stats2)
    assert torch.isinf(stats2[1, :, 9:]).all() and torch.isfinite(stats2[1, :, :9]).all()


def test_quantize_attention_inputs_layouts():
    """q, k blocked along D, v along the layout's sequence axis, in the inputs' layout; thd's v segmented."""
    for fmt, s_axis in (("bshd", 1), ("sbhd", 0), ("bhsd", 2)):
        q, k, v = _dense(fmt)
        qq, kq, vq = quantize_attention_inputs(q, k, v, qkv_format=fmt)
        assert (qq.axis, kq.axis, vq.axis) == (3, 3, s_axis) and qq.shape == q.shape and vq.shape == v.shape
        assert torch.equal(vq.scale.view(torch.uint8), quantize_mxfp8(v, axis=s_axis).scale.view(torch.uint8))
        assert torch.equal(qq.data.view(torch.uint8), quantize_mxfp8(q, axis=-1).data.view(torch.uint8))
    q, k, v, kw = _packed()
    qq, kq, vq = quantize_attention_inputs(q, k, v, qkv_format="thd", cu_seqlens_q=kw["cu_seqlens_q"],
                                           cu_seqlens_kv=kw["cu_seqlens_kv"])
    assert vq.axis == 0 and torch.equal(vq.segments, kw["cu_seqlens_kv"]) and qq.segments is None
    _, _, vb = quantize_attention_inputs(q, k, v, qkv_format="thd", cu_seqlens_q=kw["cu_seqlens_q"],
                                         cu_seqlens_kv=kw["cu_seqlens_kv"], recipe=Recipe(v_operand="bf16"))
    assert vb.dtype == torch.bfloat16 and torch.equal(vb, v)


def test_empty_inputs_return_what_the_unquantized_call_returns():
    q, k, v = _dense("bshd", sq=5, skv=0)
    want, got = _both(q, k, v)
    assert torch.equal(got, want) and (got == 0).all() and got.shape == q.shape
    q, k, v = _dense("bshd", b=0)
    want, got = _both(q, k, v)
    assert got.shape == want.shape == (0, 70, 4, 64)


def test_takes_mxfp8_attentions_keyword_arguments():
    import inspect
    def keywords(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]
    want = keywords(mxattn.mxfp8_attention)
    got = keywords(mxattn.mxfp8_attention_quantized)
    assert [n for n, _ in got] == [n for n, _ in want] and len(got) == 15
    assert dict(got)["out_dtype"] is None and dict(got) == dict(want)


def test_under_torch_compile_the_call_runs_eagerly():
    q, k, v = _dense("bshd", sq=64, skv=64)
    inputs = quantize_attention_inputs(q, k, v)
    eager = mxattn.mxfp8_attention_quantized(*inputs, attn_mask_type="causal", backend="reference")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *x: mxattn.mxfp8_attention_quantized(*x, attn_mask_type="causal",
                                                                          backend="reference") * 2,
                             backend="eager")
    assert torch.equal(compiled(*inputs), eager * 2)


# --------------------------------------------------------------------------- errors name the argument


def _inputs():
    q, k, v = _dense("bshd", sq=64, skv=64)
    return quantize_attention_inputs(q, k, v)


def _call(q, k, v, **kw):
    return mxattn.mxfp8_attention_quantized(q, k, v, backend="reference", **kw)


def _with(x, **fields):
    return MXFP8Tensor.unchecked(*(fields.get(n, getattr(x, n)) for n in ("data", "scale", "axis", "segments")))


def test_errors_name_the_argument_and_what_was_expected():
    qq, kq, vq = _inputs()
    hp = _dense("bshd", sq=64, skv=64)
    cases = [
        (TypeError, r"q must be an mxattn\.MXFP8Tensor .*got Tensor", lambda: _call(hp[0], kq, vq)),
        (TypeError, r"k\.data must hold E4M3 elements \(torch\.float8_e4m3fn\), got torch\.float8_e5m2",
         lambda: _call(qq, quantize_mxfp8(hp[1], axis=-1, fp8_dtype=torch.float8_e5m2), vq)),
        (ValueError, r"v must have its blocks of 32 along S \(axis 1 of a bshd tensor", lambda: _call(qq, kq, kq)),
        (ValueError, r"q must have its blocks of 32 along D \(axis 3 of a bshd tensor", lambda: _call(vq, kq, vq)),
        (ValueError, r"v must have its blocks of 32 along S \(axis 0 of a sbhd tensor",
         lambda: _call(qq, kq, vq, qkv_format="sbhd")),
        (ValueError, r"q must be 3-D, got shape \(2, 64, 4, 64\)", lambda: _call(qq, kq, vq, qkv_format="thd")),
        (ValueError, r"qkv_format must be one of", lambda: _call(qq, kq, vq, qkv_format="bsd")),
        (ValueError, r"q\.scale has shape \(2, 64, 4, 1\), expected \(2, 64, 4, 2\)",
         lambda: _call(_with(qq, scale=qq.scale[..., :1]), kq, vq)),
        (TypeError, r"q\.scale must be a torch\.float8_e8m0fnu tensor, got torch\.uint8",
         lambda: _call(_with(qq, scale=qq.scale.view(torch.uint8)), kq, vq)),
        (ValueError, r"head_dim mismatch: q 64, k 32",
         lambda: _call(qq, *quantize_attention_inputs(hp[0], hp[1][..., :32], hp[2][..., :32])[1:])),
        (ValueError, r"query heads \(4\) must be divisible by key/value heads \(3\)",
         lambda: _call(qq, *quantize_attention_inputs(hp[0], _randn(2, 64, 3, 64), _randn(2, 64, 3, 64))[1:])),
        (ValueError, r"sequence length mismatch: k 64, v 32", lambda: _call(
            qq, kq, quantize_mxfp8(hp[2][:, :32], axis=1))),
        (TypeError, r"v must be a torch\.bfloat16 tensor under Recipe\(v_operand='bf16'\).*got MXFP8Tensor",
         lambda: _call(qq, kq, vq, recipe=Recipe(v_operand="bf16"))),
        (TypeError, r"v must be a torch\.bfloat16 tensor under Recipe\(v_operand='bf16'\).*got torch\.float16",
         lambda: _call(qq, kq, hp[2].half(), recipe=Recipe(v_operand="bf16"))),
        (TypeError, r"v must be an mxattn\.MXFP8Tensor", lambda: _call(qq, kq, hp[2])),
        (ValueError, r"recipe: scaling='per_tensor' has no MXFP8 inputs",
         lambda: _call(qq, kq, vq, recipe=Recipe(scaling="per_tensor"))),
        (TypeError, r"recipe must be an mxattn\.Recipe or None", lambda: _call(qq, kq, vq, recipe="lazy16")),
        (ValueError, r"v\.segments must be None for a dense or padded batch",
         lambda: _call(qq, kq, quantize_mxfp8(hp[2], axis=1, segments=_cu([2, 62])))),
        (ValueError, r"q\.segments must be None", lambda: _call(_with(qq, segments=_cu([64])), kq, vq)),
        (ValueError, r"cu_seqlens_q/cu_seqlens_kv are sequence lengths of a padded batch",
         lambda: _call(qq, kq, vq, cu_seqlens_q=_cu([64, 64]))),
        (ValueError, r"softmax_scale must be a positive finite float", lambda: _call(qq, kq, vq, softmax_scale=0)),
        (TypeError, r"out_dtype must be", lambda: _call(qq, kq, vq, out_dtype=torch.float8_e4m3fn)),
        (ValueError, r"softmax_offset is only used with softmax_type='learnable'",
         lambda: _call(qq, kq, vq, softmax_offset=torch.zeros(4))),
        (ValueError, r"q, k, v must be on one device", lambda: _call(qq, kq, _with(vq, data=vq.data.to("meta"),
                                                                                   scale=vq.scale.to("meta")))),
        (ValueError, r"v\.scale is on meta but v\.data on cpu",
         lambda: _call(qq, kq, _with(vq, scale=vq.scale.to("meta")))),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


def test_packed_v_must_be_segmented_at_cu_seqlens_kv():
    q, k, v, kw = _packed()
    qq, kq, vq = quantize_attention_inputs(q, k, v, **_quantized_kw(kw))
    with pytest.raises(ValueError, match=r"v of a packed \(thd\) batch must be quantized per sequence"):
        _call(qq, kq, quantize_mxfp8(v, axis=0), **kw)
    with pytest.raises(ValueError, match=r"v\.segments must equal cu_seqlens_kv .*\[0, 40, 47, 117, 117\]"):
        _call(qq, kq, vq, **dict(kw, cu_seqlens_kv=_cu([47, 0, 70, 0])))
    with pytest.raises(ValueError, match=r"qkv_format='thd' needs cu_seqlens_q"):
        _call(qq, kq, vq, qkv_format="thd")
    assert _call(qq, kq, vq, **dict(kw, cu_seqlens_kv=kw["cu_seqlens_kv"].clone())).shape == q.shape  # (values)


def test_grad_requested_is_refused_and_no_grad_mode_is_not():
    qq, kq, vq = _inputs()
    grad_k = _with(kq, data=kq.data.clone().requires_grad_())
    with pytest.raises(ValueError, match=r"k\.data requires grad, .*inference path without autograd"):
        _call(qq, grad_k, vq)
    with pytest.raises(TypeError, match=r"q\.data must hold E4M3"):
        _call(_with(qq, data=qq.data.float()), kq, vq)
    offset = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"softmax_offset requires grad, .*inference path without autograd"):
        _call(qq, kq, vq, softmax_type="learnable", softmax_offset=offset)
    hp_v = _dense("bshd", sq=64, skv=64)[2].requires_grad_()
    with pytest.raises(ValueError, match=r"^v requires grad"):
        _call(qq, kq, hp_v, recipe=Recipe(v_operand="bf16"))
    with torch.no_grad():
        assert torch.equal(_call(qq, grad_k, vq), _call(qq, kq, vq))
        o = _call(qq, kq, vq, softmax_type="learnable", softmax_offset=offset)
        o_bf16_v = _call(qq, kq, hp_v, recipe=Recipe(v_operand="bf16"))
    assert o.shape == o_bf16_v.shape == (2, 64, 4, 64) and not o.requires_grad


@needs_triton
def test_errors_come_before_any_kernel(monkeypatch, request):
    from triton_helpers import record_launches
    launched = record_launches(monkeypatch, request)
    qq, kq, vq = _inputs()
    with pytest.raises(ValueError, match="v must have its blocks of 32 along S"):
        mxattn.mxfp8_attention_quantized(qq, kq, kq, backend="triton")
    with pytest.raises(MXFP8NotSupportedError, match="head_dim 80 is not supported"):
        mxattn.mxfp8_attention_quantized(*quantize_attention_inputs(*(x[..., :80].repeat(1, 1, 1, 2)[..., :80]
                                                                      for x in _dense("bshd"))), backend="triton")
    assert launched == []


# --------------------------------------------------------------------------- backends without the entry point


class _PlainBackend(AttentionBackend):
    name = "plain"

    @classmethod
    def availability(cls, device):
        return True, "anywhere"

    def forward(self, q, k, v, params):
        raise AssertionError("not called")

    def backward(self, saved, o, stats, do, params):
        raise AssertionError("not called")


def _problem(**fields):
    base = dict(device=torch.device("cpu"), dtype=torch.float8_e4m3fn, batch=1, heads_q=2, heads_kv=2, seqlen_q=8,
                seqlen_kv=8, head_dim=64, mask=MaskSpec(), quantized=True)
    return Problem(**dict(base, **fields))


def test_a_backend_without_the_entry_point_refuses_with_its_name():
    qq, kq, vq = _inputs()
    with pytest.raises(MXFP8NotSupportedError, match=r"backend 'plain': has no entry point for already-quantized"):
        _PlainBackend().forward_quantized(qq, kq, vq, AttentionParams(softmax_scale=0.1, mask=MaskSpec()))
    ok, reason = _PlainBackend.supports(_problem())
    assert not ok and "no entry point for already-quantized inputs" in reason
    assert _PlainBackend.supports(_problem(quantized=False, dtype=torch.bfloat16))[0]
    assert not ReferenceBackend.supports(_problem(dtype=torch.float8_e5m2))[0]
    assert ReferenceBackend.supports(_problem()) == (True, "pure PyTorch; runs on any device")
    assert Problem.decode(_problem().encode()) == _problem()


def test_cudnn_refuses_recipe_variants_of_quantized_inputs(monkeypatch):
    """cuDNN runs the default recipe only: a named cudnn call with a variant is refused with the reason, and
    "auto" routes it elsewhere (here the reference)."""
    from mxattn.backends.cudnn import backend as cb
    monkeypatch.setattr(cb.CudnnBackend, "availability", classmethod(lambda cls, d: (True, "pretend")))
    q, k, v = _dense("bshd")
    recipe = Recipe(v_operand="bf16")
    inputs = quantize_attention_inputs(q, k, v, recipe=recipe)
    with pytest.raises(MXFP8NotSupportedError, match=r"backend 'cudnn' cannot run this call.*v_operand='bf16'"):
        mxattn.mxfp8_attention_quantized(*inputs, backend="cudnn", recipe=recipe)
    assert pick_backend("auto", _problem(recipe=recipe.encode())) == "reference"
    with pytest.raises(MXFP8NotSupportedError, match=r"backend 'cudnn': .*v_operand='bf16'"):
        cb.CudnnBackend().forward_quantized(*(mxattn.layouts.mx_to_bhsd(x, "bshd") for x in inputs[:2]),
                                            inputs[2].transpose(1, 2),
                                            AttentionParams(softmax_scale=0.1, mask=MaskSpec(), recipe=recipe))


# --------------------------------------------------------------------------- triton's host path (no GPU)


def _comparable(args):
    """Launch arguments with tensors as (shape, dtype, strides) (their memory differs between calls)."""
    return [(tuple(a.shape), a.dtype, a.stride()) if isinstance(a, torch.Tensor) else a for a in args]


TRITON_CASES = {
    "bf16_scratch_causal": lambda: (*_dense("bshd", sq=200, skv=300), dict(attn_mask_type="causal"), False),
    "fp8_d256_sink": lambda: (*_dense("bshd", sq=200, skv=300, d=256),
                              dict(softmax_type="off-by-one", attn_mask_type="causal"), False),
    "fp8_forced_padded": lambda: (*_padded()[:3], _padded()[3], True),
    "packed_sink_bf16": lambda: (*_packed()[:3], dict(_packed()[3], softmax_type="learnable",
                                                      softmax_offset=torch.tensor([0.5, -1.0, 2.0, 0.0])), False),
    "packed_sink_fp8": lambda: (*_packed()[:3], dict(_packed()[3], softmax_type="learnable",
                                                     softmax_offset=torch.tensor([0.5, -1.0, 2.0, 0.0])), True),
    "lazy16_bf16_v": lambda: (*_dense("sbhd", sq=200, skv=300), dict(qkv_format="sbhd", attn_mask_type="causal",
                                                                     recipe=Recipe(p_quant="lazy16", v_operand="bf16")),
                              False),
}


@needs_triton
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_host_path_makes_the_unquantized_calls_forward_launch(monkeypatch, request, case):
    """On CPU tensors with launches recorded: the quantized call is one launch, the forward kernel's, with the
    grid, constexprs and scalar arguments of the unquantized call's forward launch (which follows its
    quantizer's launch; a call with a backward, so that the one-launch path of short queries stays out) and
    tensor arguments of the same shapes, dtypes and strides."""
    from triton_helpers import force_fp8_data_paths, record_launches
    q, k, v, kw, fp8 = TRITON_CASES[case]()
    launched = record_launches(monkeypatch, request, keep_args=True)
    if fp8:
        force_fp8_data_paths(monkeypatch)
    with torch.no_grad():
        mxattn.mxfp8_attention_quantized(*quantize_attention_inputs(q, k, v, **_quantized_kw(kw)), backend="triton",
                                         **kw)
    quantized = list(launched)
    launched.clear()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    mxattn.mxfp8_attention(*leaves, backend="triton", **kw)
    assert [name for name, *_ in launched] == ["quantize_qkv_kernel", "attn_fwd_kernel"]
    assert [name for name, *_ in quantized] == ["attn_fwd_kernel"]
    (_, grid, kwargs, args), (_, want_grid, want_kwargs, want_args) = quantized[0], launched[1]
    assert grid == want_grid and kwargs == want_kwargs
    assert kwargs["KV_BF16"] == (not fp8 and q.shape[-1] <= 128)
    got, want = _comparable(args), _comparable(want_args)
    assert len(got) == len(want) > 40
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, (i, a, b)


@needs_triton
@pytest.mark.parametrize("kind", ["dense", "padded", "packed"])
def test_seq_major_columns_lays_v_out_as_the_kernel_reads_it(kind):
    """`seq_major_columns`: sequence b's rows at column 32 * (its first block row) + n of [B, H, D, L], zeros
    everywhere else (after each sequence up to its block end, on padding rows, between sequences), the scales
    as they are: the contract of `SeqMajorColumns` the forward kernel reads."""
    from mxattn.backends.triton_backend import seq_major_columns
    if kind == "packed":
        lengths = [20, 0, 45, 33, 1]
        v = _randn(1, 2, sum(lengths), 64) + 1  # (no zero byte among the real rows)
        cu = _cu(lengths)
        vq = quantize_mxfp8(v, axis=2, segments=cu)
        seq = SeqInfo(cu, cu, 45, 45, True)
        starts = [(int(cu[b]), int(cu[b]) // 32 + b, n) for b, n in enumerate(lengths)]
        spans = [(0, start, block0, n) for start, block0, n in starts]
    else:
        v = _randn(3, 2, 70, 64) + 1
        lengths = [70, 33, 0] if kind == "padded" else [70] * 3
        seq = SeqInfo(_cu(lengths), _cu(lengths), 70, 70, False) if kind == "padded" else None
        vq = quantize_mxfp8(v, axis=2)
        spans = [(b, 0, 0, n) for b, n in enumerate(lengths)]
    got = seq_major_columns(vq, seq)
    n_blocks = vq.scale.shape[2]
    assert got.data.shape == (v.shape[0], 2, 64, 32 * n_blocks) and got.data.stride(3) == 1
    assert got.scale is vq.scale or torch.equal(got.scale.view(torch.uint8), vq.scale.view(torch.uint8))
    cols = got.data.view(torch.uint8).transpose(2, 3)  # [B, H, L, D]
    written = torch.zeros(cols.shape, dtype=torch.bool)
    for b, start, block0, n in spans:
        rows = cols[b, :, 32 * block0:32 * block0 + n]
        assert torch.equal(rows, vq.data.view(torch.uint8)[b, :, start:start + n]), (b, n)
        written[b, :, 32 * block0:32 * block0 + n] = True
    assert (cols[~written] == 0).all()
    assert (vq.data.view(torch.uint8)[..., :] != 0).any() and written.any()


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("path", ["auto", "fp8"])
def test_triton_forward_under_the_interpreter_equals_the_unquantized_call(path):
    """tests/interpret_quantized_fwd.py runs the triton backend's quantizer and forward kernel under Triton's
    interpreter: the quantized call's O equals the unquantized call's bytes (dense, padded with NaN padding,
    packed with a sink, bf16-V + lazy16, D 256, a decode step against the one-launch kernel), on the data path
    each call chooses and on the FP8 path forced; a wrong V layout, scale or data path changes O (the
    interpreter's arithmetic stays within a bf16 ulp or two of the reference's)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, os.path.join(str(ROOT), "tests", "interpret_quantized_fwd.py"),
                          *(["fp8"] if path == "fp8" else [])], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 6, res.stdout
    for row in rows:
        assert row["equal"] and row["nonzero"] and not row["nan"], row
        assert row["max_abs_vs_reference"] <= 0.05, row
