"""Q/K and V of different head dims (MLA: DeepSeek-V3's d_qk 192, d_v 128) on the CPU (reference backend): O and
the gradients equal `ref` bit for bit (dense layouts, packed and padded batches, masks, GQA, a sink, the recipe
variants, return_lse) and are close to FP64 autograd; already-quantized inputs, empty inputs, the ops' fake
kernels and torch.compile; the shape errors, V zero-padded for a backend of one head dim (triton), the pairs the
cudnn backend takes and refuses, the module's (k_channels, v_channels)."""

import dataclasses
import math
import warnings

import pytest
import torch

import mxattn
from mxattn import backends
from mxattn.backends.base import Problem
from mxattn.layouts import from_bhsd, to_bhsd
from mxattn.mask import MaskSpec
from one_width_backend import one_width_triton
from pretend_backend import pretend_usable
from ref import mxfp8_ref

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")

DIMS = [(192, 128), (128, 64), (256, 128)]


def _randn(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen).to(dtype)


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _bhsd_inputs(dqk, dv, b=2, hq=4, hkv=2, sq=70, skv=100, seed=0):
    """q [B, Hq, Sq, dqk], k [B, Hkv, Skv, dqk], v [B, Hkv, Skv, dv], dO [B, Hq, Sq, dv] (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    return (_randn(b, hq, sq, dqk, gen=gen), _randn(b, hkv, skv, dqk, gen=gen), _randn(b, hkv, skv, dv, gen=gen),
            _randn(b, hq, sq, dv, gen=gen))


def _grads(q, k, v, do, sink=None, **kw):
    """(O, dq, dk, dv[, dsink]) of the reference backend on leaves made from q, k, v (and sink)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    offset = None if sink is None else sink.clone().requires_grad_()
    extra = {} if offset is None else dict(softmax_type="learnable", softmax_offset=offset)
    o = mxattn.mxfp8_attention(*leaves, backend="reference", **extra, **kw)
    o.backward(do)
    return (o.detach(), *(t.grad for t in leaves)) + (() if offset is None else (offset.grad,))


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# --------------------------------------------------------------------------- the user's call


def test_deepseek_v3_shapes_run_differentiably_with_the_qk_softmax_scale():
    q, k = torch.randn(1, 64, 2, 192), torch.randn(1, 64, 2, 192)
    v = torch.randn(1, 64, 2, 128)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = mxattn.mxfp8_attention(*leaves)
    assert o.shape == (1, 64, 2, 128) and o.dtype == torch.float32
    o.square().sum().backward()
    assert [t.grad.shape for t in leaves] == [q.shape, k.shape, v.shape]
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in leaves)
    # the default softmax scale is 1/sqrt(d_qk), as in torch SDPA and Transformer Engine
    assert torch.equal(o.detach(), mxattn.mxfp8_attention(q, k, v, softmax_scale=192 ** -0.5))
    assert not torch.equal(o.detach(), mxattn.mxfp8_attention(q, k, v, softmax_scale=128 ** -0.5))


# --------------------------------------------------------------------------- bit for bit against ref


@pytest.mark.parametrize("dqk,dv", DIMS)
@pytest.mark.parametrize("qkv_format,mask,softmax_type", [
    ("bshd", "no_mask", "vanilla"),
    ("sbhd", "causal", "learnable"),
    ("bhsd", "causal_bottom_right", "vanilla"),
])
def test_dense_layouts_equal_ref_bit_for_bit(dqk, dv, qkv_format, mask, softmax_type):
    """GQA 4:2, S_q 70 against S_kv 100 (partial blocks of 32 along S and, for d 64 + 32 = 96, none along D);
    ref with its own default scale 1/sqrt(d_qk)."""
    q, k, v, do = _bhsd_inputs(dqk, dv)
    sink = torch.tensor([-1.0, 0.5, 2.0, 0.0]) if softmax_type == "learnable" else None
    got = _grads(*(from_bhsd(t, qkv_format) for t in (q, k, v, do)), sink=sink, qkv_format=qkv_format,
                 attn_mask_type=mask)
    o, dq, dk, dvv = (to_bhsd(t, qkv_format) for t in got[:4])
    assert o.shape == (2, 4, 70, dv) and dq.shape == q.shape and dk.shape == k.shape and dvv.shape == v.shape
    opts = dict(causal=mask != "no_mask", sink=sink,
                diagonal_alignment="bottom_right" if mask.endswith("bottom_right") else "top_left")
    ro, stats = mxfp8_ref.sdpa_fwd(q, k, v, **opts)
    want = mxfp8_ref.sdpa_bwd(q, k, v, ro, do, stats, **opts)
    assert torch.equal(o, ro)
    for g, w in zip((dq, dk, dvv, *got[4:]), want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dqk,dv", DIMS)
@pytest.mark.parametrize("layout", ["thd", "padded"])
def test_packed_and_padded_batches_equal_ref_varlen_bit_for_bit(dqk, dv, layout):
    """Sequences of different lengths (one with queries but no keys) under a causal mask with a window, GQA, and
    (packed) an off-by-one sink; padding rows hold NaN and give zeros."""
    lens_q, lens_kv = [40, 20, 33], [50, 0, 64]
    gen = torch.Generator().manual_seed(5)
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    kw = dict(attn_mask_type="padding_causal_bottom_right", window_size=(24, 0), cu_seqlens_q=cu_q,
              cu_seqlens_kv=cu_kv)
    opts = dict(causal=True, diagonal_alignment="bottom_right", window=(25, None))  # (cuDNN's bounds)
    if layout == "thd":
        q, do = _randn(sum(lens_q), 4, dqk, gen=gen), _randn(sum(lens_q), 4, dv, gen=gen)
        k, v = _randn(sum(lens_kv), 2, dqk, gen=gen), _randn(sum(lens_kv), 2, dv, gen=gen)
        kw.update(qkv_format="thd", softmax_type="off-by-one")
        opts.update(layout="thd", sink=torch.zeros(4))
    else:
        q, k, v, do = _bhsd_inputs(dqk, dv, b=3, sq=max(lens_q), skv=max(lens_kv), seed=5)
        for x, lens in ((q, lens_q), (k, lens_kv), (v, lens_kv), (do, lens_q)):
            for b, n in enumerate(lens):
                x[b, :, n:] = float("nan")
        kw.update(qkv_format="bhsd")
        opts.update(layout="bhsd_padded")
    o, dq, dk, dvv = _grads(q, k, v, do, **kw)
    assert o.shape == (*q.shape[:-1], dv)
    ro, stats = mxfp8_ref.sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, **opts)
    want = mxfp8_ref.sdpa_bwd_varlen(q, k, v, ro, do.nan_to_num(0.0), stats, cu_q, cu_kv, **opts)[:3]
    assert torch.equal(o, ro)
    for g, w in zip((dq, dk, dvv), want):
        assert torch.equal(g, w)
    if layout == "padded":
        assert not o[0, :, 40:].any() and not o[1].any() and not dvv[0, :, 50:].any()


@pytest.mark.parametrize("recipe,ref_opts", [
    (mxattn.Recipe(p_quant="none"), dict(p_format="bf16")),
    (mxattn.Recipe(v_operand="bf16"), dict(v_format="bf16")),
    (mxattn.Recipe(ds_quant="bf16", scale_rounding="floor"), dict(ds_format="bf16", scale_rounding="floor")),
    (mxattn.Recipe(scaling="per_tensor"), dict(scaling="per_tensor")),
])
def test_recipe_variants_equal_ref_bit_for_bit(recipe, ref_opts):
    q, k, v, do = _bhsd_inputs(192, 128, sq=64, skv=64, seed=2)
    o, dq, dk, dvv = _grads(q, k, v, do, qkv_format="bhsd", attn_mask_type="causal", recipe=recipe)
    ro, stats = mxfp8_ref.sdpa_fwd(q, k, v, causal=True, **{n: w for n, w in ref_opts.items() if n != "ds_format"})
    want = mxfp8_ref.sdpa_bwd(q, k, v, ro, do, stats, causal=True, **ref_opts)
    assert torch.equal(o, ro)
    for g, w in zip((dq, dk, dvv), want):
        assert torch.equal(g, w)


def test_return_lse_and_its_gradient_equal_ref():
    q, k, v, do = _bhsd_inputs(192, 128, sq=64, skv=96, seed=3)
    w = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = mxattn.mxfp8_attention(*leaves, qkv_format="bhsd", attn_mask_type="causal_bottom_right",
                                    backend="reference", return_lse=True)
    torch.autograd.backward((o, lse), (do, w))
    opts = dict(causal=True, diagonal_alignment="bottom_right")
    ro, stats = mxfp8_ref.sdpa_fwd(q, k, v, **opts)
    assert o.shape == (2, 4, 64, 128) and torch.equal(o, ro) and torch.equal(lse, stats[..., 0])
    want = mxfp8_ref.sdpa_bwd(q, k, v, ro, do, stats, dstats=w.unsqueeze(-1), **opts)
    for t, g in zip(leaves, want):
        assert torch.equal(t.grad, g)


# --------------------------------------------------------------------------- against exact attention


def _fp64_attention(qd, kd, vd, keep):
    """Plain attention in float64 on [B, H, S, *] tensors (GQA by repetition), softmax scale 1/sqrt(d_qk)."""
    g = qd.shape[1] // kd.shape[1]
    s = qd @ kd.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(qd.shape[-1])
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    return p @ vd.repeat_interleave(g, 1)


def test_output_and_gradients_close_to_fp64_autograd_on_the_dequantized_inputs():
    """O and dQ, dK, dV of a causal GQA call against float64 attention on Q, K dequantized row-wise (blocks along
    d_qk) and V column-wise (blocks along S): the MXFP8 rounding of P, dO and dS alone."""
    q, k, v, do = _bhsd_inputs(192, 128, sq=96, skv=96, seed=6)
    o, dq, dk, dvv = _grads(q, k, v, do, qkv_format="bhsd", attn_mask_type="causal")
    leaves = [mxattn.quantize_mxfp8(q, axis=-1).dequantize().double().requires_grad_(),
              mxattn.quantize_mxfp8(k, axis=-1).dequantize().double().requires_grad_(),
              mxattn.quantize_mxfp8(v, axis=-2).dequantize().double().requires_grad_()]
    keep = torch.ones(96, 96, dtype=torch.bool).tril()
    exact = _fp64_attention(*leaves, keep)
    exact.backward(do.double())
    assert _rel(o, exact) < 0.02
    for got, leaf in zip((dq, dk, dvv), leaves):
        assert _rel(got, leaf.grad) < 0.05


# --------------------------------------------------------------------------- other entry points


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
@pytest.mark.parametrize("recipe", [None, mxattn.Recipe(v_operand="bf16")])
def test_already_quantized_inputs_equal_the_high_precision_call(qkv_format, recipe):
    gen = torch.Generator().manual_seed(7)
    kw = dict(qkv_format=qkv_format, attn_mask_type="causal")
    if qkv_format == "thd":
        cu = _cu([40, 57])
        q, k, v = _randn(97, 4, 192, gen=gen), _randn(97, 2, 192, gen=gen), _randn(97, 2, 128, gen=gen)
        kw.update(attn_mask_type="padding_causal", cu_seqlens_q=cu)
    else:
        q, k, v = _randn(2, 70, 4, 192, gen=gen), _randn(2, 70, 2, 192, gen=gen), _randn(2, 70, 2, 128, gen=gen)
    quantized = mxattn.quantize_attention_inputs(q, k, v, qkv_format=qkv_format, recipe=recipe,
                                                 cu_seqlens_q=kw.get("cu_seqlens_q"))
    o, lse = mxattn.mxfp8_attention_quantized(*quantized, backend="reference", recipe=recipe, return_lse=True, **kw)
    want_o, want_lse = mxattn.mxfp8_attention(q, k, v, backend="reference", recipe=recipe, return_lse=True, **kw)
    assert o.shape == (*q.shape[:-1], 128) and torch.equal(o, want_o) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("shapes", [((0, 8), (0, 8)), ((2, 0), (2, 8)), ((2, 8), (2, 0))])
def test_empty_inputs_give_an_output_of_vs_head_dim_and_zero_gradients(shapes):
    """B = 0, S_q = 0, S_kv = 0: as torch SDPA (an empty O, or zeros where there is no key), O with d_v."""
    (b, sq), (_, skv) = shapes
    q = torch.randn(b, sq, 4, 192, requires_grad=True)
    k = torch.randn(b, skv, 2, 192, requires_grad=True)
    v = torch.randn(b, skv, 2, 128, requires_grad=True)
    o = mxattn.mxfp8_attention(q, k, v, backend="reference")
    assert o.shape == (b, sq, 4, 128) and not o.any()
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            enable_gqa=True)
    assert o.shape == sdpa.transpose(1, 2).shape
    o.sum().backward()
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    o_lse, lse = mxattn.mxfp8_attention(q.detach(), k.detach(), v.detach(), backend="reference", return_lse=True)
    assert o_lse.shape == o.shape and lse.shape == (b, 4, sq)
    quantized = mxattn.quantize_attention_inputs(q.detach(), k.detach(), v.detach())
    assert torch.equal(mxattn.mxfp8_attention_quantized(*quantized, backend="reference", out_dtype=torch.float32), o)


def _op_case(layout):
    """(q, k, v, qkv_format, the five length fields) as `mxfp8_attention` hands them to the forward op."""
    gen = torch.Generator().manual_seed(1)
    if layout == "thd":
        cu = torch.tensor([0, 13, 13, 40], dtype=torch.int32)
        q, k, v = (_randn(40, h, d, gen=gen).permute(1, 0, 2).unsqueeze(0) for h, d in ((4, 96), (2, 96), (2, 64)))
        return q, k, v, "bshd", (cu, cu, 27, 27, True)
    q, k, v = (_randn(2, 40, h, d, gen=gen).permute(0, 2, 1, 3) for h, d in ((4, 96), (2, 96), (2, 64)))
    seq = (None, None, 0, 0, False)
    if layout == "padded":
        cu = torch.tensor([0, 13, 53], dtype=torch.int32)
        seq = (cu, cu, 40, 40, False)
    return q, k, v, "bshd", seq


@pytest.mark.parametrize("layout", ["dense", "padded", "thd"])
def test_ops_fake_kernels_give_vs_head_dim_to_o_and_dv(layout):
    """The custom ops' fake kernels (what torch.compile traces) promise O [B, Hq, Sq, d_v], dQ and dK of q's and
    k's shapes and dV of v's, in the layouts the real kernels return."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxattn import ops
    from mxattn.op_args import FwdArgs
    q, k, v, fmt, seq = _op_case(layout)
    args = FwdArgs(q, k, v, 0.125, False, None, 0, torch.bfloat16, fmt, "reference", *seq, None)
    for op in (ops.attention_fwd, ops.attention_fwd_no_grad, ops.attention_fwd_packed):
        torch.library.opcheck(op, tuple(args), test_utils=("test_schema", "test_faketensor"))
    o, stats, *saved = ops.attention_fwd(*args)
    assert o.shape == (*q.shape[:3], 64)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    po, block = ops.attention_fwd_packed(*args)
    calls = [(ops.attention_bwd, args.backward_args(do, o, stats, saved, list(k.shape), False)),
             (ops.attention_bwd_packed, args.packed_backward_args(do, po, block, list(k.shape), q.dtype, False,
                                                                  seq[:2], None))]
    grads = []
    for op, bwd in calls:
        got = op(*bwd)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*bwd._replace(do=mode.from_tensor(do)))
        for g, f, like in zip(got, fake, (q, k, v)):
            assert g.shape == f.shape == like.shape and g.stride() == f.stride()
        grads.append(got[:3])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_torch_compile_forward_and_backward_equal_eager():
    torch._dynamo.reset()

    def f(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference")

    q, k, v, do = (from_bhsd(t, "bshd") for t in _bhsd_inputs(192, 128, sq=64, skv=64, seed=8))
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(do)
        results.append((out.detach(), *(t.grad for t in leaves)))
    assert results[0][0].shape == (2, 64, 4, 128)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- errors and refusals


@pytest.mark.parametrize("make,exc,match", [
    (lambda q, k, v: (q, k[..., :128], v), ValueError,
     r"head_dim mismatch: q 192, k 128 .*k's head dim must equal q's \(v's, head_dim_v 128, may differ\)"),
    (lambda q, k, v: (q, k, v[..., :0]), ValueError, r"empty input: head_dim 192, head_dim_v 0"),
    (lambda q, k, v: (q, k, v[:, :, :1]), ValueError, r"k and v must have the same number of heads"),
])
def test_shape_errors_name_what_is_expected(make, exc, match):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn(1, 64, 4, 192, gen=gen), _randn(1, 64, 2, 192, gen=gen), _randn(1, 64, 2, 128, gen=gen)
    with pytest.raises(exc, match=match):
        mxattn.mxfp8_attention(*make(q, k, v), backend="reference")


def _problem(head_dim_v, head_dim=192):
    return Problem(device=torch.device("cpu"), dtype=torch.bfloat16, batch=1, heads_q=4, heads_kv=2, seqlen_q=64,
                   seqlen_kv=64, head_dim=head_dim, mask=MaskSpec(), needs_backward=True, head_dim_v=head_dim_v)


def test_problem_head_dim_v_defaults_to_head_dim():
    assert _problem(None).head_dim_v == 192 and _problem(None) == _problem(192)
    assert Problem.decode(_problem(128).encode()) == _problem(128)


def test_triton_runs_one_head_dim_so_v_is_zero_padded_for_it(monkeypatch):
    cls, widths = one_width_triton(monkeypatch)
    ok, reason = cls.supports(_problem(128))
    assert not ok and "head_dim 192" in reason and "head_dim_v 128" in reason  # (the class takes one width)
    assert backends.v_padding("triton", _problem(128)) == 64
    assert backends.v_padding("reference", _problem(128)) == 0 and backends.v_padding("triton", _problem(192)) == 0
    q, k, v, do = _bhsd_inputs(192, 128, sq=64, skv=96)
    want = _grads(q, k, v, do, qkv_format="bhsd", attn_mask_type="causal")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = mxattn.mxfp8_attention(*leaves, qkv_format="bhsd", attn_mask_type="causal", backend="triton")
    o.backward(do)
    assert widths == [192] and o.shape == want[0].shape and o.is_contiguous()
    # zero channels change none of V's block scales: the reference backend's numbers on V as it is, bit for bit
    for got, ref_value in zip((o.detach(), *(t.grad for t in leaves)), want):
        assert torch.equal(got, ref_value)


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_auto_takes_triton_with_v_padded_in_every_layout_and_with_return_lse(monkeypatch, qkv_format):
    _, widths = one_width_triton(monkeypatch)
    monkeypatch.setattr(backends, "_WARNED", set())
    q, k, v, do = (from_bhsd(t, "bshd") for t in _bhsd_inputs(192, 128, b=1 if qkv_format == "thd" else 2,
                                                                sq=96, skv=96))
    kw = dict(qkv_format="bshd", attn_mask_type="causal")
    if qkv_format == "thd":
        q, k, v, do = (t[0] for t in (q, k, v, do))
        kw = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=_cu([40, 56]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = mxattn.mxfp8_attention(q, k, v, **kw)
        o_lse, lse = mxattn.mxfp8_attention(q, k, v, return_lse=True, **kw)
    messages = [str(w.message) for w in caught if "backend='auto'" in str(w.message)]
    assert messages and all("chose 'triton'" in m for m in messages), messages
    assert widths == [192, 192]
    want, want_lse = mxattn.mxfp8_attention(q, k, v, backend="reference", return_lse=True, **kw)
    assert torch.equal(o, want) and torch.equal(o_lse, want) and torch.equal(lse, want_lse)


@pytest.fixture
def cudnn_validating(monkeypatch):
    """The cudnn backend believes it is usable; its up-front check validates the graphs with cuDNN's deviceless
    validation (SM 10.0) instead of planning them, and its forward raises "a kernel ran"."""
    cls = pretend_usable(monkeypatch, "cudnn")
    import cudnn
    if cudnn.backend_version() < 92100:
        pytest.skip(f"cuDNN {cudnn.backend_version()} < 9.21 cannot validate MXFP8 graphs")
    from mxattn.backends.cudnn import backend as cudnn_backend
    monkeypatch.setattr(cudnn_backend, "_support_handle", lambda device: (None, 0))
    cudnn_backend.clear_support_cache()
    yield cls
    cudnn_backend.clear_support_cache()


@pytest.mark.parametrize("dqk,dv", [(192, 128), (128, 64), (64, 128)])
def test_cudnn_takes_the_pairs_its_graphs_validate(cudnn_validating, dqk, dv):
    """(192, 128) and pairs of dims up to 128 pass the up-front check (forward and backward graphs validated by
    cuDNN) and the call reaches the cudnn backend's forward."""
    assert cudnn_validating.supports_distinct_v_dim
    assert cudnn_validating.supports(_problem(dv, dqk)) == (True, "cuDNN forward and backward validated")
    q, k, v, _ = _bhsd_inputs(dqk, dv, sq=64, skv=64)
    with pytest.raises(AssertionError, match="a kernel ran"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="cudnn")


def test_cudnn_takes_a_pair_its_graphs_refuse_with_v_zero_padded_to_q_s_width(cudnn_validating, monkeypatch):
    """(256, 128) is no graph's pair but (256, 256) is: the call reaches the cudnn backend with V 256 wide."""
    assert not cudnn_validating.supports(_problem(128, 256))[0]
    assert backends.v_padding("cudnn", _problem(128, 256)) == 128
    assert backends.v_padding("cudnn", _problem(128, 192)) == 0  # (a pair the graphs take runs as it is)
    widths = []

    def forward(self, q, k, v, params):
        widths.append(v.shape[3])
        raise AssertionError("a kernel ran")

    monkeypatch.setattr(cudnn_validating, "forward", forward)
    q, k, v, _ = _bhsd_inputs(256, 128, sq=64, skv=64)
    with pytest.raises(AssertionError, match="a kernel ran"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="cudnn")
    assert widths == [256]


@pytest.mark.parametrize("dqk,dv", [(192, 64), (192, 192), (128, 192)])
def test_cudnn_refuses_the_pairs_its_graphs_do_not_take_with_the_reason(cudnn_validating, dqk, dv):
    ok, reason = cudnn_validating.supports(_problem(dv, dqk))
    assert not ok and f"head_dim {dqk}" in reason and f"head_dim_v {dv}" in reason
    assert "d_qk == 192 and d_v == 128" in reason and "reference" in reason
    q, k, v, _ = _bhsd_inputs(dqk, dv, sq=64, skv=64)
    with pytest.raises(mxattn.MXFP8NotSupportedError, match=f"backend 'cudnn'.*head_dim_v {dv}"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="cudnn")


# --------------------------------------------------------------------------- the module


@pytest.mark.parametrize("qkv_format", ["bshd", "thd"])
def test_module_takes_k_and_v_channels(qkv_format):
    module = mxattn.DotProductAttention(4, (192, 128), num_gqa_groups=2, qkv_format=qkv_format,
                                        attn_mask_type="padding_causal" if qkv_format == "thd" else "causal",
                                        backend="reference")
    q, k, v, _ = _bhsd_inputs(192, 128, b=1 if qkv_format == "thd" else 2, sq=64, skv=64)
    q, k, v = (from_bhsd(t, "bshd")[0] if qkv_format == "thd" else from_bhsd(t, "bshd") for t in (q, k, v))
    kw = dict(cu_seqlens_q=_cu([30, 34])) if qkv_format == "thd" else {}
    out = module(q, k, v, **kw)
    want = mxattn.mxfp8_attention(q, k, v, qkv_format=qkv_format, attn_mask_type=module.attn_mask_type,
                                  backend="reference", **kw)
    assert out.shape == (*q.shape[:-2], 4 * 128) and torch.equal(out, want.reshape(out.shape))
    assert module.kv_channels == (192, 128) and "kv_channels=(192, 128)" in repr(module)
    with pytest.raises(ValueError, match=r"value has 2 heads of size 192; this module expects 2 heads of size 128"):
        module(q, k, k, **kw)
    with pytest.raises(ValueError, match=r"key has 2 heads of size 128; this module expects 2 heads of size 192"):
        module(q, v, v, **kw)


@pytest.mark.parametrize("kv_channels", [(192,), (192, 0), (192, 128, 64), (192, True), "192", 0])
def test_module_refuses_bad_kv_channels(kv_channels):
    with pytest.raises(ValueError, match=r"kv_channels must be a positive int or a \(k_channels, v_channels\) pair"):
        mxattn.DotProductAttention(4, kv_channels)


# --------------------------------------------------------------------------- the triton kernels (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dqk,dv", [(192, 128), (128, 64)])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_triton_runs_mla_with_v_padded_as_the_reference_backend_does(dqk, dv, layout):
    """The real kernels on V zero-padded to Q's head dim: O and every gradient equal the call on a V the caller
    padded, bit for bit, and are the reference backend's on V as it is to the kernels' rounding (one bf16 ulp
    in places); O is as wide as V."""
    from mxattn.backends.triton_backend import TritonBackend
    ok, reason = TritonBackend.availability(torch.device("cuda"))
    if not ok:
        pytest.skip(reason)
    on_gpu = dataclasses.replace(_problem(dv, dqk), device=torch.device("cuda"))
    assert backends.v_padding("triton", on_gpu) == dqk - dv
    q, k, v, do = (from_bhsd(t, "bshd").cuda() for t in _bhsd_inputs(dqk, dv, b=1 if layout == "thd" else 2,
                                                                       hq=8, hkv=2, sq=384, skv=384))
    kw = dict(qkv_format="bshd", attn_mask_type="causal")
    if layout == "thd":
        q, k, v, do = (t[0] for t in (q, k, v, do))
        kw = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=_cu([100, 200, 84]).cuda())

    def run(backend, pad_by_hand=False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        value = torch.nn.functional.pad(leaves[2], (0, dqk - dv)) if pad_by_hand else leaves[2]
        o = mxattn.mxfp8_attention(leaves[0], leaves[1], value, backend=backend, **kw)[..., :dv]
        (o.float() * do.float()).sum().backward()
        return (o.detach(), *(t.grad for t in leaves))

    got = run("triton")
    assert got[0].shape[-1] == dv
    for a, b in zip(got, run("triton", pad_by_hand=True)):
        assert torch.equal(a, b)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, run("reference")):
        assert _rel(a.float(), b.float()) <= 5e-3, (name, _rel(a.float(), b.float()))


def test_v_is_padded_under_torch_compile_as_eagerly(monkeypatch):
    """The padding decision is a constant of the trace (no graph break): compiled forward and backward on the
    one-width stand-in equal the reference backend's eager numbers on V as it is."""
    _, widths = one_width_triton(monkeypatch)
    q, k, v, do = _bhsd_inputs(192, 128, sq=64, skv=64)
    want = _grads(q, k, v, do, qkv_format="bhsd", attn_mask_type="causal")

    def step(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = compiled(*leaves)
    o.backward(do)
    assert widths and set(widths) == {192}
    for got, ref_value in zip((o.detach(), *(t.grad for t in leaves)), want):
        assert torch.equal(got, ref_value)
