"""The functional API and autograd on the reference backend: exactness against `ref`, layouts, masks, GQA,
backend choice, bad input, NaN."""

import math
import warnings

import pytest
import torch
from bhsd_inputs import bhsd_inputs as _inputs

import mxattn
from mxattn.layouts import from_bhsd
from ref import mxfp8_ref

MASKS = [  # (attn_mask_type or (attn_mask_type, bottom_right_diagonal), window_size) -> ref kwargs
    ("no_mask", None, dict(causal=False, diagonal_alignment="top_left", window=(None, None))),
    ("causal", None, dict(causal=True, diagonal_alignment="top_left", window=(None, None))),
    ("causal_bottom_right", None, dict(causal=True, diagonal_alignment="bottom_right", window=(None, None))),
    # a no_mask window is aligned bottom-right, as Transformer Engine aligns it by default (its
    # bottom_right_diagonal=None); the same band as top-left where S_q == S_kv
    ("no_mask", (16, 8), dict(causal=False, diagonal_alignment="bottom_right", window=(17, 8))),
    (("no_mask", False), (16, 8), dict(causal=False, diagonal_alignment="top_left", window=(17, 8))),
    ("causal", (40, 0), dict(causal=True, diagonal_alignment="top_left", window=(41, None))),
    # (24, -1) means the same but TE warns about it: a causal type's window is (left, 0)
    ("causal_bottom_right", (24, 0), dict(causal=True, diagonal_alignment="bottom_right", window=(25, None))),
]


def _run_bhsd(q, k, v, do, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = mxattn.mxfp8_attention(*leaves, qkv_format="bhsd", backend="reference", **kw)
    o.backward(do)
    return o.detach(), *(leaf.grad for leaf in leaves)


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("mask_type,window,ref_kw", MASKS)
@pytest.mark.parametrize("hq,hkv,sq,skv", [(4, 4, 96, 96), (4, 2, 96, 80), (4, 1, 70, 130)])
def test_functional_equals_ref_bit_for_bit(mask_type, window, ref_kw, hq, hkv, sq, skv):
    q, k, v, do = _inputs(hq=hq, hkv=hkv, sq=sq, skv=skv)
    # (attn_mask_type, bottom_right_diagonal) where the case names the diagonal
    mask_type, diagonal = mask_type if isinstance(mask_type, tuple) else (mask_type, None)
    o, dq, dk, dv = _run_bhsd(q, k, v, do, attn_mask_type=mask_type, window_size=window,
                              bottom_right_diagonal=diagonal)
    scale = 1 / math.sqrt(q.shape[-1])
    o_ref, stats = mxfp8_ref.sdpa_fwd(q, k, v, attn_scale=scale, out_dtype=torch.bfloat16, **ref_kw)
    dq_ref, dk_ref, dv_ref = mxfp8_ref.sdpa_bwd(q, k, v, o_ref, do, stats, attn_scale=scale,
                                                out_dtype=torch.bfloat16, **ref_kw)
    assert _bits_equal(o, o_ref)
    assert _bits_equal(dq, dq_ref) and _bits_equal(dk, dk_ref) and _bits_equal(dv, dv_ref)


def test_module_gradients_equal_ref_bit_for_bit():
    q, k, v, do = _inputs(hq=4, hkv=2, sq=64, skv=64, d=32)
    module = mxattn.DotProductAttention(4, 32, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal",
                                        backend="reference")
    leaves = [from_bhsd(t, "bshd").contiguous().requires_grad_() for t in (q, k, v)]
    out = module(*leaves)
    assert out.shape == (2, 64, 4 * 32)
    out.backward(from_bhsd(do, "bshd").reshape(2, 64, -1))
    o_ref, stats = mxfp8_ref.sdpa_fwd(q, k, v, causal=True)
    grads_ref = mxfp8_ref.sdpa_bwd(q, k, v, o_ref, do, stats, causal=True)
    assert _bits_equal(from_bhsd(o_ref, "bshd").reshape(2, 64, -1), out.detach())
    for leaf, g_ref in zip(leaves, grads_ref):
        assert _bits_equal(leaf.grad, from_bhsd(g_ref, "bshd"))


@pytest.mark.parametrize("mask_type", ["no_mask", "causal_bottom_right"])
def test_layouts_give_identical_results(mask_type):
    q, k, v, do = _inputs(hq=4, hkv=2, sq=64, skv=96, d=64)
    results = {}
    for fmt in ("bshd", "sbhd", "bhsd"):
        leaves = [from_bhsd(t, fmt).contiguous().requires_grad_() for t in (q, k, v)]
        o = mxattn.mxfp8_attention(*leaves, qkv_format=fmt, attn_mask_type=mask_type, backend="reference")
        assert o.shape == leaves[0].shape and o.is_contiguous()
        o.backward(from_bhsd(do, fmt))
        to_bhsd = mxattn.layouts.to_bhsd
        results[fmt] = [to_bhsd(t, fmt) for t in (o.detach(), *(leaf.grad for leaf in leaves))]
    for fmt in ("sbhd", "bhsd"):
        for a, b in zip(results["bshd"], results[fmt]):
            assert _bits_equal(a, b)


def test_fp16_and_fp32_inputs():
    q, k, v, do = _inputs(hq=2, hkv=2, sq=40, skv=40, d=32, dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = mxattn.mxfp8_attention(*leaves, qkv_format="bhsd", backend="reference")
    assert o.dtype == torch.float32  # like torch SDPA: the inputs' dtype (computed in bf16, cast at the end)
    ref_o, _ = mxfp8_ref.sdpa_fwd(q, k, v, out_dtype=torch.bfloat16)
    assert _bits_equal(o, ref_o.float())
    o.backward(do)
    assert all(leaf.grad.dtype == torch.float32 for leaf in leaves)
    o_bf16 = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference", out_dtype=torch.bfloat16)
    assert o_bf16.dtype == torch.bfloat16 and _bits_equal(o_bf16, ref_o)
    o16 = mxattn.mxfp8_attention(*(t.half() for t in (q, k, v)), qkv_format="bhsd", backend="reference")
    assert o16.dtype == torch.float16
    ref16, _ = mxfp8_ref.sdpa_fwd(q.half(), k.half(), v.half(), out_dtype=torch.float16)
    assert _bits_equal(o16, ref16)


def test_auto_picks_reference_on_cpu_and_warns_once():
    from mxattn import backends
    backends._WARNED.clear()
    q, k, v, _ = _inputs(hq=2, hkv=2, sq=32, skv=32, d=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o_auto = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd")
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd")
    messages = [str(w.message) for w in caught if "backend='auto'" in str(w.message)]
    assert len(messages) == 1
    assert "'reference'" in messages[0] and "cudnn" in messages[0] and "triton" in messages[0]
    assert _bits_equal(o_auto, mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("backend", ["cudnn", "triton"])
def test_explicit_gpu_backend_on_cpu_raises_with_reason(backend):
    q, k, v, _ = _inputs(hq=2, hkv=2, sq=32, skv=32, d=32)
    with pytest.raises(mxattn.MXFP8NotSupportedError, match=backend) as info:
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend=backend)
    assert len(str(info.value)) > 40  # carries a reason, not just a name


def test_nan_input_gives_nan_output():
    q, k, v, _ = _inputs(b=1, hq=1, hkv=1, sq=64, skv=64, d=32)
    q[0, 0, 5, 3] = float("nan")
    o = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference")
    assert torch.isnan(o[0, 0, 5]).all()
    assert not torch.isnan(o[0, 0, 40]).any()


BAD_INPUTS = [
    (lambda q, k, v: (q[:1], k, v), ValueError, "batch size mismatch"),
    (lambda q, k, v: (q, k[:, :, :-1], v), ValueError, "sequence length mismatch"),
    (lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "head_dim mismatch"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, "divisible"),
    (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, r"q has dtype torch.int32; mxattn accepts"),
    (lambda q, k, v: (q, k.to(torch.float8_e4m3fn), v), TypeError, "k has dtype torch.float8_e4m3fn"),
    (lambda q, k, v: (q, k, v.double()), TypeError, "v has dtype torch.float64"),
    (lambda q, k, v: (q, k, v.half()), TypeError, "share one dtype"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, "one device"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), ValueError, "empty input: head_dim 0"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
    (lambda q, k, v: (q, k.numpy(), v), TypeError, "k must be a torch.Tensor"),
]


@pytest.mark.parametrize("mutate,exc,match", BAD_INPUTS)
def test_bad_input_raises_before_any_kernel(mutate, exc, match, monkeypatch):
    from mxattn.backends import reference
    monkeypatch.setattr(reference.ReferenceBackend, "forward", lambda *a: pytest.fail("kernel ran"))
    q, k, v, _ = _inputs(b=2, hq=4, hkv=2, sq=32, skv=32, d=64, dtype=torch.float32)
    with pytest.raises(exc, match=match):
        mxattn.mxfp8_attention(*mutate(q, k, v), qkv_format="bhsd", backend="reference")


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(qkv_format="bsdh"), ValueError, "qkv_format must be one of"),
    (dict(attn_mask_type="arbitrary"), ValueError, "attn_mask_type must be one of"),
    (dict(attn_mask_type="padding"), ValueError, "needs cu_seqlens_q"),
    (dict(window_size=(4,)), ValueError, "window_size"),
    (dict(attn_mask_type="causal", window_size=(-1, 4)), ValueError, "window_size"),   # TE rejects it too
    (dict(window_size=(4, -1)), ValueError, "window_size"),
    (dict(window_size=(4, 4), bottom_right_diagonal=1), TypeError, "bottom_right_diagonal"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(out_dtype=torch.float64), TypeError, "out_dtype"),
    (dict(backend="flash"), ValueError, "backend must be one of"),
])
def test_bad_options_raise(kwargs, exc, match):
    q, k, v, _ = _inputs(b=1, hq=2, hkv=2, sq=32, skv=32, d=32)
    kwargs.setdefault("qkv_format", "bhsd")
    with pytest.raises(exc, match=match):
        mxattn.mxfp8_attention(q, k, v, backend=kwargs.pop("backend", "reference"), **kwargs)


def test_unsupported_head_dim_lists_supported(monkeypatch):
    from mxattn.backends import reference
    monkeypatch.setattr(reference.ReferenceBackend, "supported_head_dims", (64, 128))
    q, k, v, _ = _inputs(b=1, hq=2, hkv=2, sq=32, skv=32, d=32)
    with pytest.raises(mxattn.MXFP8NotSupportedError,
                       match=r"backend 'reference' cannot run this call on cpu: head_dim 32 is not supported "
                             r"\(supported: 64, 128\)"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference")


def test_backend_input_dtypes_are_checked(monkeypatch):
    from mxattn.backends import reference
    monkeypatch.setattr(reference.ReferenceBackend, "input_dtypes", (torch.bfloat16, torch.float16))
    q, k, v, _ = _inputs(b=1, hq=2, hkv=2, sq=32, skv=32, d=32, dtype=torch.float32)
    with pytest.raises(mxattn.MXFP8NotSupportedError,
                       match=r"backend 'reference' cannot run this call on cpu: takes q, k, v in torch.bfloat16, "
                             r"torch.float16, got torch.float32"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference")


def test_an_eager_decode_step_returns_o_without_a_copy(monkeypatch):
    """Without a gradient, eager: O whose strides differ from the dense layout's only on size-1 axes (a decode
    step's query axis, as the backends allocate O like q) is returned as it is; the ops re-stride such an O
    as a view (their fakes promise exact strides); any other difference is copied into the dense layout."""
    from mxattn import ops
    from mxattn.op_args import FwdArgs
    q, k, v, _ = _inputs(hq=4, hkv=2, sq=1, skv=40, d=64)            # bhsd, q [1, 4, 1, 64]
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)               # bshd-dense storage read as bhsd
    args = FwdArgs(qs, k, v, 0.125, True, None, 0, torch.bfloat16, "bshd", "reference", None, None, 0, 0,
                   False, None)
    copies, real = [], ops.empty_bhsd
    monkeypatch.setattr(ops, "empty_bhsd", lambda *a: copies.append(a) or real(*a))
    eager = ops._fwd_impl(args, needs_backward=False, eager=True)
    assert copies == []
    exact = ops._fwd_impl(args, needs_backward=False)
    assert copies == [] and torch.equal(eager, exact)  # the op's promise: a view re-strided on size-1 axes
    assert exact.stride() == ops.dense_strides_bhsd(tuple(exact.shape), "bshd")
    assert all(a == b or n == 1 for a, b, n in zip(eager.stride(), exact.stride(), eager.shape))


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 4, 1, 8), (2, 1, 3, 1)])
def test_dense_strides_match_an_allocation_in_that_layout(fmt, shape):
    from mxattn.layouts import dense_strides_bhsd, empty_bhsd
    assert empty_bhsd(shape, fmt, torch.float32, "cpu").stride() == dense_strides_bhsd(shape, fmt)


def test_eager_paths_agree_with_the_library_ops(monkeypatch):
    """The eager call skips torch.library's dispatch: with a gradient it runs the autograd.Function on the ops'
    bodies, without one a forward that keeps nothing. Both give the ops' numbers bit for bit, forward and
    backward (the ops are what torch.compile traces, checked in test_module_compile_memory.py)."""
    from mxattn import ops
    from mxattn.op_args import FwdArgs
    q, k, v, _ = _inputs(hq=4, hkv=2, sq=70, skv=90, d=64)
    args = (q, k, v, 0.125, True, None, 0, torch.bfloat16, "bhsd", "reference", None, None, 0, 0, False, None)
    o_op, stats, *saved = ops.attention_fwd(*args)
    assert torch.equal(ops.attention_fwd_no_grad(*args), o_op)
    calls = []
    real = ops._fwd_body  # (args, needs_backward, eager)
    monkeypatch.setattr(ops, "_fwd_body", lambda *a: calls.append(a[1:]) or real(*a))
    with torch.no_grad():
        o_inf = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal_bottom_right",
                                       softmax_scale=0.125, backend="reference")
    assert calls[-1] == (False, True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o_grad = mxattn.mxfp8_attention(qg, kg, vg, qkv_format="bhsd", attn_mask_type="causal_bottom_right",
                                    softmax_scale=0.125, backend="reference")
    assert calls[-1] == (True, True) and o_grad.grad_fn is not None
    assert torch.equal(o_inf, o_op) and torch.equal(o_grad.detach(), o_op)
    do = torch.randn_like(o_grad)
    grads = torch.autograd.grad(o_grad, (qg, kg, vg), do)
    op_grads = ops.attention_bwd(*FwdArgs(*args).backward_args(do, o_op, stats, saved, list(k.shape), False))
    for a, b in zip(grads, op_grads[:3]):
        assert torch.equal(a, b)
    assert op_grads[3].numel() == 0


def test_cudnn_refusal_names_the_hardware_before_the_library(monkeypatch):
    """Without a Blackwell GPU no cuDNN upgrade helps: the reason leads with the hardware, then the library."""
    import importlib
    support = importlib.import_module("mxattn.backends.cudnn.support")
    monkeypatch.setattr(support, "backend_facts", lambda: (91900, "cuDNN 9.19.0 loaded from /x/libcudnn.so.9"))
    ok, reason = support.cudnn_support("cpu")
    assert not ok and reason.startswith("cpu is not a CUDA device")
    assert reason.index("Blackwell") < reason.index("older than 9.21.0") < reason.index("pip install")


def test_repeated_dense_calls_reuse_a_plan_and_still_check_new_signatures(monkeypatch):
    """A dense eager call's checks and backend choice run once per signature (shapes, strides, dtypes, devices,
    options, grad mode): the repeated call skips them and gives the same bytes; any change of signature runs
    the checks again, so bad input still raises its clear error."""
    from mxattn import attention as attention_module
    monkeypatch.setattr(attention_module, "_PLANS", {})
    checks = []
    real_validate = attention_module.validate_inputs
    monkeypatch.setattr(attention_module, "validate_inputs", lambda *a: (checks.append(a[3]), real_validate(*a)))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 64, 4, 32, generator=gen).bfloat16() for _ in range(3))
    first = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference")
    again = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference")
    assert torch.equal(first, again) and len(checks) == 1
    # a new option, layout, grad mode or softmax type is a new signature: checked once, then planned
    mxattn.mxfp8_attention(q, k, v, attn_mask_type="no_mask", backend="reference")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))                         # the same data as bhsd views
    assert torch.equal(mxattn.mxfp8_attention(qt, kt, vt, qkv_format="bhsd", attn_mask_type="causal",
                                              backend="reference").transpose(1, 2), first)
    sink = mxattn.mxfp8_attention(q, k, v, softmax_type="off-by-one", backend="reference")
    assert torch.equal(mxattn.mxfp8_attention(q, k, v, softmax_type="off-by-one", backend="reference"), sink)
    assert len(checks) == 3 + 1
    # an input that differs from a planned one only in what the checks read raises the checks' error
    with pytest.raises(TypeError, match="share one dtype"):
        mxattn.mxfp8_attention(q, k.half(), v, attn_mask_type="causal", backend="reference")
    with pytest.raises(ValueError, match="head_dim mismatch"):
        mxattn.mxfp8_attention(q, k[..., :16], v, attn_mask_type="causal", backend="reference")
    with pytest.raises(ValueError, match="softmax_scale"):
        mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference", softmax_scale=-1.0)
    # learnable sink: its tensor's dtype and shape are part of the signature
    offset = torch.zeros(4)
    mxattn.mxfp8_attention(q, k, v, softmax_type="learnable", softmax_offset=offset, backend="reference")
    with pytest.raises(TypeError, match="float32"):
        mxattn.mxfp8_attention(q, k, v, softmax_type="learnable", softmax_offset=offset.double(),
                               backend="reference")
    # gradients through a planned call equal the first call's
    grads = []
    for _ in range(2):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        mxattn.mxfp8_attention(qg, kg, vg, attn_mask_type="causal", backend="reference").float().sum().backward()
        grads.append([t.grad for t in (qg, kg, vg)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
def test_decode_steps_at_new_kv_lengths_share_one_plan(monkeypatch, fmt):
    """Generation attends one more key per step: a dense plan serves every KV length when the backend choice
    read none (checks once, results equal to an unplanned call's), while a KV length of 0 or k and v of
    different lengths still get the checks' answers. A backend whose support reads the sizes (cuDNN where it
    runs) keeps the plan to its length."""
    from mxattn import attention as attention_module
    from mxattn.backends import choice_reads_sizes
    from mxattn.backends.cudnn.backend import CudnnBackend
    monkeypatch.setattr(attention_module, "_PLANS", {})
    checks = []
    real_validate = attention_module.validate_inputs
    monkeypatch.setattr(attention_module, "validate_inputs", lambda *a: (checks.append(a[3]), real_validate(*a)))
    gen = torch.Generator().manual_seed(5)
    q = from_bhsd(torch.randn(2, 4, 1, 32, generator=gen).bfloat16(), fmt)
    kv = torch.randn(2, 2, 60, 32, generator=gen).bfloat16()
    outs = []
    with torch.no_grad():
        for n in range(20, 30):
            k, v = from_bhsd(kv[:, :, :n], fmt), from_bhsd(kv[:, :, 20:20 + n], fmt)
            outs.append(mxattn.mxfp8_attention(q, k, v, qkv_format=fmt, attn_mask_type="causal_bottom_right",
                                               backend="reference"))
        assert len(checks) == 1
        monkeypatch.setattr(attention_module, "_PLANS", {})
        for n, planned in zip(range(20, 30), outs):
            k, v = from_bhsd(kv[:, :, :n], fmt), from_bhsd(kv[:, :, 20:20 + n], fmt)
            assert torch.equal(mxattn.mxfp8_attention(q, k, v, qkv_format=fmt, attn_mask_type="causal_bottom_right",
                                                      backend="reference"), planned)
            monkeypatch.setattr(attention_module, "_PLANS", {})
        k = from_bhsd(kv[:, :, :25], fmt)
        mxattn.mxfp8_attention(q, k, k, qkv_format=fmt, attn_mask_type="causal_bottom_right", backend="reference")
        with pytest.raises(ValueError, match="sequence length mismatch"):
            mxattn.mxfp8_attention(q, k, from_bhsd(kv[:, :, :24], fmt), qkv_format=fmt,
                                   attn_mask_type="causal_bottom_right", backend="reference")
        empty = from_bhsd(kv[:, :, :0], fmt)
        zeros = mxattn.mxfp8_attention(q, empty, empty, qkv_format=fmt, attn_mask_type="causal_bottom_right",
                                       backend="reference")
        assert zeros.shape == q.shape and not zeros.any()
    plan = next(iter(attention_module._PLANS.values()))
    assert plan.kv_len is None
    problem = plan.args._replace(q=q, k=k, v=k).problem("vanilla", False)
    assert not choice_reads_sizes("auto", "reference", problem)
    monkeypatch.setattr(CudnnBackend, "availability", classmethod(lambda cls, device: (True, "stub")))
    assert choice_reads_sizes("auto", "reference", problem) and choice_reads_sizes("cudnn", "cudnn", problem)
    assert not choice_reads_sizes("triton", "triton", problem)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("empty", ["batch", "queries", "keys"])
def test_empty_inputs_behave_like_torch_sdpa(fmt, empty, monkeypatch):
    """B = 0, S_q = 0, S_kv = 0: the shape torch SDPA returns (zeros when there is no key), differentiable with
    zero gradients, and no kernel runs."""
    import torch.nn.functional as F
    from mxattn.backends import reference
    monkeypatch.setattr(reference.ReferenceBackend, "forward", lambda *a: pytest.fail("kernel ran"))
    b, sq, skv = {"batch": (0, 8, 8), "queries": (2, 0, 8), "keys": (2, 8, 0)}[empty]
    q = from_bhsd(torch.randn(b, 4, sq, 32), fmt).requires_grad_()
    k, v = (from_bhsd(torch.randn(b, 2, skv, 32), fmt).requires_grad_() for _ in range(2))
    o = mxattn.mxfp8_attention(q, k, v, qkv_format=fmt, attn_mask_type="causal", backend="reference")
    to = lambda t: t.permute(*{"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}[fmt])  # noqa
    kk, vv = (to(t).repeat_interleave(2, dim=1) for t in (k, v))
    expected = F.scaled_dot_product_attention(to(q), kk, vv)
    assert o.shape == q.shape and o.dtype == q.dtype and torch.equal(to(o), expected)
    o.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and not t.grad.any() for t in (q, k, v))


def test_cu_seqlens_need_a_padding_mask_type():
    q = torch.randn(2, 16, 2, 32)
    cu = torch.tensor([0, 10, 26], dtype=torch.int32)
    with pytest.raises(ValueError, match="padding attn_mask_type"):
        mxattn.mxfp8_attention(q, q, q, attn_mask_type="causal", cu_seqlens_q=cu, backend="reference")


def test_infinities_as_documented():
    """Infinities propagate as in torch SDPA (mxfp8_attention's docstring): +inf in one K element makes NaN
    exactly the rows SDPA makes NaN (q . k = +inf meets the softmax's max subtraction); +inf in one V element
    makes infinite exactly the elements of O that SDPA makes infinite."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=g) for _ in range(3))
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)  # noqa
    k_inf = k.clone()
    k_inf[0, 5, 0, 3] = float("inf")
    o, s = mxattn.mxfp8_attention(q, k_inf, v, backend="reference"), sdpa(q, k_inf, v)
    nan_rows = o.isnan().any(-1)
    assert nan_rows.any() and torch.equal(nan_rows, s.isnan().any(-1))
    assert not nan_rows[:, :, 1].any()                                  # the other head is untouched
    v_inf = v.clone()
    v_inf[0, 5, 0, 3] = float("inf")
    o, s = mxattn.mxfp8_attention(q, k, v_inf, backend="reference"), sdpa(q, k, v_inf)
    assert o.isinf().any() and torch.equal(o.isinf(), s.isinf()) and not o.isnan().any()


@pytest.mark.parametrize("kwargs,exc", [(dict(softmax_scale={"a": 1}), ValueError),
                                        (dict(window_size=[[1], 0]), ValueError)])
def test_unhashable_options_get_the_checks_error(kwargs, exc):
    q = torch.randn(1, 32, 2, 32)
    with pytest.raises(exc):
        mxattn.mxfp8_attention(q, q, q, backend="reference", **kwargs)


@pytest.mark.parametrize("fmt,dtype", [("bshd", torch.bfloat16), ("sbhd", torch.bfloat16), ("bshd", torch.float32)])
def test_dense_layouts_add_no_layout_nodes_and_give_the_bhsd_calls_results(fmt, dtype):
    """q, k, v in bshd or sbhd: the attention's autograd node takes them and returns O in their layout (the
    [B, H, S, D] views made inside it, no permute nodes), with O and the gradients of the same call in bhsd,
    viewed in that layout (first call and the signature's planned later calls alike)."""
    from mxattn.layouts import from_bhsd, to_bhsd
    q, k, v = (torch.randn(1, 2, 64, 32, dtype=dtype, requires_grad=True) for _ in range(3))
    o_ref = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="reference")
    do = torch.randn_like(o_ref)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    for _ in range(3):
        xs = [from_bhsd(t.detach(), fmt).contiguous().requires_grad_() for t in (q, k, v)]
        o = mxattn.mxfp8_attention(*xs, qkv_format=fmt, attn_mask_type="causal", backend="reference")
        node = o.grad_fn if dtype != torch.float32 else o.grad_fn.next_functions[0][0]  # (fp32: O cast from bf16)
        assert "_Attention" in type(node).__name__
        assert [type(n).__name__ for n, _ in node.next_functions if n is not None] == ["AccumulateGrad"] * 3
        assert o.dtype == dtype and torch.equal(to_bhsd(o, fmt), o_ref)
        grads = torch.autograd.grad(o, xs, from_bhsd(do, fmt))
        assert all(g.dtype == dtype and g.shape == x.shape and torch.equal(to_bhsd(g, fmt), r)
                   for g, x, r in zip(grads, xs, grads_ref))


def test_bhsd_inputs_add_no_layout_nodes_to_the_autograd_graph():
    """bhsd is the kernels' own order: the call makes no permute views of q, k, v or O (each would be an autograd
    node, and host time, per call), so O's grad_fn is the attention's own node and its inputs are the leaves'."""
    q, k, v = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="reference")
    assert "_Attention" in type(o.grad_fn).__name__
    assert [type(n).__name__ for n, _ in o.grad_fn.next_functions if n is not None] == ["AccumulateGrad"] * 3
    bshd = mxattn.mxfp8_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask_type="causal",
                                  backend="reference")
    assert torch.equal(bshd.transpose(1, 2), o)
    k_is_v = mxattn.mxfp8_attention(q, k, k, qkv_format="bhsd", backend="reference")  # one tensor twice
    k_is_v.sum().backward()
    assert k.grad is not None and q.grad is not None
