"""Recipe variants (`mxattn.Recipe`), on the CPU.

- `Recipe`: defaults, hashing, validation errors naming the field, the string form the custom ops carry.
- The reference backend against `ref` bit for bit for every variant, forward and backward, dense and variable
  lengths. The recipe is translated to ref's options here, by hand (`REF_FWD`, `REF_BWD`), not by mxattn's code,
  and ref quantizes with its own quantizers (floor rounding and per-tensor FP8 are checked against mxattn's too).
- FP64 autograd oracles for each variant; P in bf16 and bf16 V come closer to FP64 than the default.
- The causal coupling through V's column-wise scale: measured for the default, absent (bit for bit) with bf16 V.
- cudnn refuses variants with the reason, triton refuses per-tensor scaling; "auto" routes a variant to a
  backend that runs it.
- `DotProductAttention`, the transformers registration and torch.compile carry the recipe through.
"""

import dataclasses
import sys
import warnings

import pytest
from repo_paths import ROOT
import torch
import torch.nn.functional as F

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mxattn  # noqa: E402
from mxattn import MXFP8NotSupportedError, Recipe  # noqa: E402
from mxattn import backends  # noqa: E402
from mxattn.backends import Problem  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402
from mxattn.per_tensor import quantize_per_tensor  # noqa: E402
from ref import mxfp8_ref as R  # noqa: E402
from bhsd_inputs import bhsd_inputs as _inputs  # noqa: E402

# every single-field variant, and two combinations (the FlashAttention tracker's "MXFP8 for QK^T, BF16 for PV",
# and several changes at once)
VARIANTS = {
    "default": Recipe(),
    "lazy16": Recipe(p_quant="lazy16"),
    "p_none": Recipe(p_quant="none"),
    "v_bf16": Recipe(v_operand="bf16"),
    "ds_bf16": Recipe(ds_quant="bf16"),
    "floor": Recipe(scale_rounding="floor"),
    "per_tensor": Recipe(scaling="per_tensor"),
    "bf16_pv": Recipe(p_quant="none", v_operand="bf16", ds_quant="bf16"),
    "mixed": Recipe(p_quant="lazy16", v_operand="bf16", scale_rounding="floor"),
}
# ref's keyword options for each variant, forward and backward (written from ref's docstring, not from mxattn)
REF_FWD = {
    "default": {},
    "lazy16": dict(p_scale=16.0, rescale_threshold=4.0),
    "p_none": dict(p_format="bf16"),
    "v_bf16": dict(v_format="bf16"),
    "ds_bf16": {},
    "floor": dict(scale_rounding="floor"),
    "per_tensor": dict(scaling="per_tensor"),
    "bf16_pv": dict(p_format="bf16", v_format="bf16"),
    "mixed": dict(p_scale=16.0, rescale_threshold=4.0, v_format="bf16", scale_rounding="floor"),
}
REF_BWD = {
    "default": {},
    "lazy16": {},                       # the cuDNN frontend reference's backward keeps P's scale 256
    "p_none": dict(p_format="bf16"),
    "v_bf16": dict(v_format="bf16"),
    "ds_bf16": dict(ds_format="bf16"),
    "floor": dict(scale_rounding="floor"),
    "per_tensor": dict(scaling="per_tensor"),
    "bf16_pv": dict(p_format="bf16", v_format="bf16", ds_format="bf16"),
    "mixed": dict(v_format="bf16", scale_rounding="floor"),
}
VARLEN_VARIANTS = [n for n, r in VARIANTS.items() if r.scaling == "mxfp8"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # "backend='auto' chose 'reference' on cpu"
        yield


def _u8(t):
    return t.view(torch.uint8)


def _rel(a, b):
    b = b.double()
    return ((a.double() - b).norm() / b.norm()).item()


def _bhsd(b=2, hq=4, hkv=2, sq=150, skv=200, d=48, seed=0, dtype=torch.bfloat16):
    """q [b,hq,sq,d], k, v [b,hkv,skv,d], do (random, seeded); by default two KV blocks of 128 (the second
    partial) and a head dim that is not a multiple of 32."""
    return _inputs(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d, dtype=dtype, seed=seed)


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


# --------------------------------------------------------------------------- the Recipe object


def test_default_recipe_fields_hash_and_frozen():
    r = Recipe()
    assert (r.p_quant, r.v_operand, r.ds_quant, r.scale_rounding, r.scaling) == \
        ("fixed256", "fp8", "fp8", "ceil", "mxfp8")
    assert r.is_default and r.differences() == "default"
    assert hash(r) == hash(Recipe()) and r == Recipe()
    variant = Recipe(v_operand="bf16")
    assert not variant.is_default and variant != r and variant.differences() == "v_operand='bf16'"
    assert len({r, Recipe(), variant, Recipe(v_operand="bf16")}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.p_quant = "none"


def test_all_variants_lists_the_default_and_each_single_field_change():
    from mxattn.recipe import CHOICES, all_variants
    variants = all_variants()
    assert variants[0] == Recipe() and len(set(variants)) == len(variants)
    assert len(variants) == 1 + sum(len(v) - 1 for v in CHOICES.values())
    assert all(r.differences().count("=") == 1 for r in variants[1:])
    assert {r for n, r in VARIANTS.items() if n not in ("bf16_pv", "mixed")} == set(variants)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(p_quant="fixed16"), ValueError, "Recipe.p_quant must be one of"),
    (dict(v_operand="fp16"), ValueError, "Recipe.v_operand"),
    (dict(ds_quant="mxfp8"), ValueError, "Recipe.ds_quant"),
    (dict(scale_rounding="round_up"), ValueError, "Recipe.scale_rounding"),
    (dict(scaling="per_block"), ValueError, "Recipe.scaling"),
    (dict(p_quant=256), TypeError, "Recipe.p_quant must be a str"),
    (dict(scaling="per_tensor", scale_rounding="floor"), ValueError, "Recipe.scale_rounding='floor'"),
])
def test_recipe_validation_names_the_field(kwargs, exc, words):
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(".", r"\.")):
        Recipe(**kwargs)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_encode_decode_round_trip(name):
    r = VARIANTS[name]
    key = r.encode()
    assert isinstance(key, str) and Recipe.decode(key) == r
    assert (key == Recipe().encode()) == (name == "default")


def test_decode_refuses_malformed_keys():
    with pytest.raises(ValueError, match="5 comma-separated fields"):
        Recipe.decode("fixed256,fp8")
    with pytest.raises(ValueError, match="Recipe.scaling"):
        Recipe.decode("fixed256,fp8,fp8,ceil,nope")


def test_problem_encode_decode_carries_the_recipe():
    p = Problem(device=torch.device("cpu"), dtype=torch.bfloat16, batch=2, heads_q=4, heads_kv=2, seqlen_q=64,
                seqlen_kv=64, head_dim=64, mask=MaskSpec(causal=True), recipe=VARIANTS["mixed"].encode())
    key = p.encode(without_sizes=True)
    assert all(isinstance(x, (str, int, bool, type(None), torch.dtype)) for x in key)
    back = Problem.decode(key)
    assert Recipe.decode(back.recipe) == VARIANTS["mixed"] and back.batch is None
    assert Problem.decode(p.encode()) == p


def test_bad_recipe_arguments_raise_naming_recipe():
    q, k, v, _ = _bhsd(b=1, hq=2, hkv=2, sq=32, skv=32, d=32)
    with pytest.raises(TypeError, match="recipe must be an mxattn.Recipe"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", recipe="fixed256")
    with pytest.raises(TypeError, match="recipe must be an mxattn.Recipe"):
        mxattn.DotProductAttention(2, 32, recipe={"p_quant": "none"})


def test_per_tensor_refuses_variable_lengths():
    q, k, v, _ = _bhsd(b=2, hq=2, hkv=2, sq=40, skv=40, d=32)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    with pytest.raises(ValueError, match="recipe: scaling='per_tensor' is a dense-batch baseline"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="padding", cu_seqlens_q=cu,
                               recipe=Recipe(scaling="per_tensor"))
    with pytest.raises(ValueError, match="scaling: 'per_tensor' has no variable-length form"):
        R.sdpa_fwd_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                          torch.tensor([0, 40]), torch.tensor([0, 40]), scaling="per_tensor")


# --------------------------------------------------------------------------- quantizers: mxattn vs ref


def test_floor_rounding_matches_ref_and_the_ocp_rule():
    g = torch.Generator().manual_seed(5)
    mag = 10 ** (torch.rand(64, 96, generator=g) * 10 - 5)
    x = torch.randn(64, 96, generator=g) * mag
    x[3, :32] = 0.0
    x[5, 7] = float("nan")
    x[9, 40] = float("inf")
    x[11, 64:] = 448.0 * 2.0 ** torch.arange(-4, 28).float()  # amax exactly a power of two times 448
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for axis in (-1, 0):
            mine = quantize_mxfp8(xd, axis=axis, scale_rounding="floor")
            data, scale = R.quantize(xd, axis, scale_rounding="floor")
            assert torch.equal(_u8(mine.scale), _u8(scale)) and torch.equal(_u8(mine.data), _u8(data))
    # the OCP rule on a normal block: e = floor(log2(amax)) - 8 (+127 bias), so 448 * 2^k lands in e = 127 + k
    # and saturates nothing; 449 * 2^k has the same exponent and its maximum saturates to 448
    for k in (-3, 0, 5):
        blk = torch.full((32,), 0.5 * 2.0**k)
        blk[0] = 449.0 * 2.0**k
        q = quantize_mxfp8(blk, scale_rounding="floor")
        assert _u8(q.scale).item() == 127 + k
        assert q.data[0].float().item() == 448.0


def test_per_tensor_matches_ref_and_te_current_scaling():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 5, 40, 48, generator=g) * 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        mine = quantize_per_tensor(xd)
        data, scale_inv = R.quantize_per_tensor(xd)
        assert torch.equal(_u8(mine.data), _u8(data)) and torch.equal(mine.scale_inv, scale_inv)
        amax = xd.float().abs().max()
        scale = torch.tensor(448.0) / amax                                     # TE: fp8_max / amax, FP32
        assert torch.equal(mine.scale_inv, torch.tensor(1.0) / scale)
        assert torch.equal(_u8(mine.data), _u8((xd.float() * scale).to(torch.float8_e4m3fn)))
        assert mine.data.float().abs().max().item() == 448.0                  # the maximum maps to 448
    for special, scale_inv in ((torch.zeros(4, 32), 1.0), (torch.tensor([[float("inf"), 1.0]]), 1.0),
                               (torch.full((2, 32), 1e-39), torch.finfo(torch.float32).max ** -1)):
        mine, (data, sinv) = quantize_per_tensor(special), R.quantize_per_tensor(special)
        assert torch.equal(_u8(mine.data), _u8(data)) and torch.equal(mine.scale_inv, sinv)
        assert mine.scale_inv.item() == pytest.approx(scale_inv, rel=1e-5)
    nan = torch.tensor([[1.0, float("nan")]])                                 # a NaN anywhere: all NaN
    assert torch.isnan(quantize_per_tensor(nan).dequantize()).all()
    data, sinv = R.quantize_per_tensor(nan)
    assert torch.isnan(data.float()).all() and torch.isnan(sinv)


# --------------------------------------------------------------------------- reference backend == ref, bit for bit


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_reference_backend_equals_ref_dense(name, mask):
    """Each variant on the reference backend gives ref's bits: O, dQ, dK, dV (GQA, two KV blocks of 128 so the
    lazy rescale can act, a head dim that is not a multiple of 32)."""
    recipe = VARIANTS[name]
    q, k, v, do = _bhsd()
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = mxattn.mxfp8_attention(qg, kg, vg, qkv_format="bhsd", attn_mask_type=mask, backend="reference",
                               recipe=recipe)
    dq, dk, dv = _grads(o, (qg, kg, vg), do)
    causal = mask == "causal"
    o_ref, stats = R.sdpa_fwd(q, k, v, causal=causal, **REF_FWD[name])
    assert torch.equal(o, o_ref)
    for mine, theirs in zip((dq, dk, dv), R.sdpa_bwd(q, k, v, o_ref, do, stats, causal=causal, **REF_BWD[name])):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", ["p_none", "per_tensor", "lazy16"])
def test_reference_backend_equals_ref_with_a_learnable_sink(name):
    recipe = VARIANTS[name]
    q, k, v, do = _bhsd(b=1, sq=96, skv=160, d=64, seed=3)
    offset = torch.linspace(-1.0, 2.0, 4).requires_grad_()
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = mxattn.mxfp8_attention(qg, kg, vg, qkv_format="bhsd", attn_mask_type="causal_bottom_right",
                               backend="reference", softmax_type="learnable", softmax_offset=offset, recipe=recipe)
    grads = _grads(o, (qg, kg, vg, offset), do)
    sink = offset.detach()
    opts = dict(causal=True, diagonal_alignment="bottom_right", sink=sink)
    o_ref, stats = R.sdpa_fwd(q, k, v, **opts, **REF_FWD[name])
    assert torch.equal(o, o_ref)
    for mine, theirs in zip(grads, R.sdpa_bwd(q, k, v, o_ref, do, stats, **opts, **REF_BWD[name])):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("name", VARLEN_VARIANTS)
@pytest.mark.parametrize("layout", ["thd", "padded"])
def test_reference_backend_equals_ref_varlen(name, layout):
    """Packed and padded batches: blocks restart at every sequence under every MXFP8 variant (ref runs each
    sequence alone); padding holds NaN, which must reach nothing."""
    recipe = VARIANTS[name]
    lens = [70, 0, 33, 150]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    if layout == "thd":
        T = int(cu[-1])
        q, k, v, do = (torch.randn(T, h, 48, generator=g).bfloat16() for h in (4, 2, 2, 4))
        call = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        ref_in = (q, k, v)
        ref_layout = "thd"
    else:
        S = max(lens)
        q, k, v, do = (torch.randn(len(lens), S, h, 48, generator=g).bfloat16() for h in (4, 2, 2, 4))
        valid = torch.arange(S)[None, :] < torch.tensor(lens)[:, None]
        q, k, v = (t.masked_fill(~valid[:, :, None, None], float("nan")) for t in (q, k, v))
        do = do.masked_fill(~valid[:, :, None, None], 0.0)
        call = dict(qkv_format="bshd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu)
        ref_in = tuple(t.transpose(1, 2) for t in (q, k, v))
        ref_layout = "bhsd_padded"
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o = mxattn.mxfp8_attention(qg, kg, vg, backend="reference", recipe=recipe, **call)
    grads = _grads(o, (qg, kg, vg), do)
    o_ref, stats = R.sdpa_fwd_varlen(*ref_in, cu, cu, layout=ref_layout, causal=True, **REF_FWD[name])
    as_call = (lambda t: t) if layout == "thd" else (lambda t: t.transpose(1, 2))
    do_ref = do if layout == "thd" else do.transpose(1, 2)
    assert torch.equal(o, as_call(o_ref))
    ref_grads = R.sdpa_bwd_varlen(*ref_in, o_ref, do_ref, stats, cu, cu, layout=ref_layout, causal=True,
                                  **REF_BWD[name])
    for mine, theirs in zip(grads, ref_grads):
        assert torch.equal(mine, as_call(theirs))
        assert not torch.isnan(mine).any()


def test_fp32_inputs_quantize_from_fp32_under_a_variant():
    recipe = VARIANTS["mixed"]
    q, k, v, do = _bhsd(b=1, sq=64, skv=64, d=32, dtype=torch.float32, seed=8)
    o = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference", recipe=recipe)
    o_ref, _ = R.sdpa_fwd(q, k, v, **REF_FWD["mixed"])
    assert o.dtype == torch.float32 and torch.equal(o, o_ref.float())


# --------------------------------------------------------------------------- FP64 oracles

# rel-RMS bounds against FP64 autograd (measured values for this input about 0.8x of these)
FP64_BOUNDS = {  # O, dQ, dK, dV
    "default": (0.057, 0.084, 0.084, 0.060),
    "lazy16": (0.057, 0.084, 0.084, 0.060),
    "p_none": (0.053, 0.084, 0.084, 0.052),
    "v_bf16": (0.047, 0.077, 0.077, 0.060),
    "ds_bf16": (0.057, 0.078, 0.077, 0.060),
    "floor": (0.062, 0.100, 0.098, 0.064),
    "per_tensor": (0.056, 0.085, 0.084, 0.059),
    "bf16_pv": (0.041, 0.069, 0.068, 0.052),
    "mixed": (0.051, 0.094, 0.092, 0.064),
}


@pytest.fixture(scope="module")
def fp64_errors():
    """rel-RMS errors of O, dQ, dK, dV against FP64 autograd for each variant and for BF16 attention (torch
    SDPA on the same bf16 inputs), causal, GQA 4:2, S = 192."""
    q, k, v, do = _bhsd(b=2, sq=192, skv=192, d=64, seed=0)
    rep = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64 = F.scaled_dot_product_attention(q64, rep(k64), rep(v64), is_causal=True)
    exact = (o64,) + _grads(o64, (q64, k64, v64), do.double())
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    ob = F.scaled_dot_product_attention(qb, rep(kb), rep(vb), is_causal=True)
    errors = {"bf16_sdpa": [_rel(a, b) for a, b in zip((ob,) + _grads(ob, (qb, kb, vb), do), exact)]}
    for name, recipe in VARIANTS.items():
        qm, km, vm = (t.clone().requires_grad_() for t in (q, k, v))
        o = mxattn.mxfp8_attention(qm, km, vm, qkv_format="bhsd", attn_mask_type="causal", backend="reference",
                                   recipe=recipe)
        errors[name] = [_rel(a, b) for a, b in zip((o,) + _grads(o, (qm, km, vm), do), exact)]
    return errors


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fp64_oracle_tolerances(fp64_errors, name):
    errs = fp64_errors[name]
    for what, err, bound in zip(("O", "dQ", "dK", "dV"), errs, FP64_BOUNDS[name]):
        assert err < bound, f"{name}: {what} rel-RMS {err:.4f} >= {bound}"
        assert err > fp64_errors["bf16_sdpa"][("O", "dQ", "dK", "dV").index(what)], (name, what)


def test_bf16_p_and_v_approach_bf16_attention(fp64_errors):
    """P in bf16 and bf16 V remove the P and V quantization errors: O (and, with P in bf16, dV) come closer to
    FP64 than the default, most with both, and dS in bf16 lowers dQ and dK; what remains is Q and K in MXFP8,
    so BF16 attention stays closer still."""
    e = fp64_errors
    o = {n: e[n][0] for n in e}
    assert o["bf16_sdpa"] < o["bf16_pv"] < min(o["p_none"], o["v_bf16"])
    assert max(o["p_none"], o["v_bf16"]) < o["default"]
    assert o["bf16_pv"] < 0.8 * o["default"]
    assert e["p_none"][3] < 0.95 * e["default"][3]                        # dV = P^T dO with P in bf16
    for i in (1, 2):                                                      # dQ, dK
        assert e["ds_bf16"][i] < 0.97 * e["default"][i]
        assert e["bf16_pv"][i] < e["default"][i]


# --------------------------------------------------------------------------- causal coupling through V's scale


def _future_change(recipe, magnitude: float, i: int = 9):
    """rel-RMS change of output rows 0..i (causal) when keys and values after row i, in the same 32-token block,
    change and one of them gets |v| = magnitude; (rel change, bitwise equal)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g).bfloat16() for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, i + 1:32] = torch.randn(1, 2, 31 - i, 64, generator=g).bfloat16()
    v2[:, :, i + 1:32] = torch.randn(1, 2, 31 - i, 64, generator=g).bfloat16()
    v2[:, :, 20] = magnitude
    run = lambda kk, vv: mxattn.mxfp8_attention(q, kk, vv, qkv_format="bhsd", attn_mask_type="causal",  # noqa
                                                backend="reference", recipe=recipe)[:, :, :i + 1]
    before, after = run(k, v), run(k2, v2)
    return _rel(after, before), torch.equal(after, before)


@pytest.mark.parametrize("name", ["v_bf16", "bf16_pv", "mixed"])
def test_bf16_v_has_no_future_token_dependence(name):
    """With bf16 V, output rows 0..9 are bit for bit unchanged when the keys and values of rows 10..31 (same
    32-token block) change, however large: nothing couples a row to later tokens."""
    for magnitude in (16.0, 4096.0, 65536.0):
        change, same = _future_change(VARIANTS[name], magnitude)
        assert same and change == 0.0, (name, magnitude)


def test_default_depends_on_future_tokens_through_v_scale():
    """The default's coupling, measured: V's column-wise E8M0 scale covers 32 tokens, so a later token's large
    value raises the scale of earlier ones and flushes their small elements (E4M3 keeps its relative precision
    until values fall below its normal range, so the effect grows with the outlier): measured rel-RMS change
    of rows 0..9: ~1e-6 (|v| = 16), ~7e-5 (256), ~5e-3 (4096), ~0.15 (65536). P in bf16 does not remove it;
    per-tensor scaling couples every token."""
    changes = [_future_change(Recipe(), m)[0] for m in (16.0, 256.0, 4096.0, 65536.0)]
    assert all(a < b for a, b in zip(changes, changes[1:])), changes
    assert 1e-7 < changes[0] < 1e-4 and 1e-3 < changes[2] < 3e-2 and changes[3] > 0.05, changes
    assert _future_change(VARIANTS["p_none"], 4096.0)[0] > 1e-3
    assert _future_change(VARIANTS["per_tensor"], 4096.0)[0] > 1e-2


# --------------------------------------------------------------------------- backends: refusal and routing


def test_cudnn_refuses_variants_with_the_reason():
    q, k, v, _ = _bhsd(b=1, hq=2, hkv=2, sq=32, skv=32, d=64)
    with pytest.raises(MXFP8NotSupportedError, match="cuDNN's MXFP8 SDPA graphs implement only the default") as info:
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="cudnn", recipe=VARIANTS["v_bf16"])
    assert "v_operand='bf16'" in str(info.value) and "backend='reference'" in str(info.value)
    cls = backends.backend_class("cudnn")
    assert cls.supports_recipe(Recipe())[0]
    for name, recipe in VARIANTS.items():
        assert cls.supports_recipe(recipe)[0] == (name == "default")


def test_triton_runs_every_mxfp8_recipe_and_refuses_per_tensor_with_the_reason():
    """The Triton kernels run each MXFP8 variant as constexpr specialisations (`runtime.recipe_flags`, checked
    on the GPU against the reference backend in test_recipe_triton_gpu.py); per-tensor scaling has no kernel."""
    from mxattn.runtime.recipe_flags import DEFAULT_FLAGS, kernel_recipe
    cls = backends.backend_class("triton")
    for name, recipe in VARIANTS.items():
        ok, reason = cls.supports_recipe(recipe)
        assert ok == (recipe.scaling == "mxfp8"), (name, reason)
        if not ok:
            assert "per_tensor" in reason and "backend='reference'" in reason
            with pytest.raises(ValueError, match="recipe: scaling='per_tensor' has no Triton kernel"):
                kernel_recipe(recipe)
    assert kernel_recipe(Recipe()) == DEFAULT_FLAGS == kernel_recipe(None)
    flags = kernel_recipe(Recipe(p_quant="lazy16", v_operand="bf16", ds_quant="bf16", scale_rounding="floor"))
    assert flags.fwd() == dict(P_MODE=1, LOG2_PS=4.0, V_RAW=True, FLOOR=True)
    assert flags.bwd() == dict(P_BF16=False, DS_BF16=True, V_RAW=True, FLOOR=True)  # lazy16's backward: fixed256
    assert kernel_recipe(Recipe(p_quant="none")).bwd()["P_BF16"] and kernel_recipe(Recipe(p_quant="none")).fwd() \
        == dict(P_MODE=2, LOG2_PS=8.0, V_RAW=False, FLOOR=False)
    q, k, v, _ = _bhsd(b=1, hq=2, hkv=2, sq=32, skv=32, d=64)
    with pytest.raises(MXFP8NotSupportedError, match="per_tensor' has no Triton kernel"):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="triton", recipe=VARIANTS["per_tensor"])


def _pretend_available(monkeypatch):
    from mxattn.backends.cudnn.backend import CudnnBackend
    from mxattn.backends.triton_backend import TritonBackend
    for cls in (CudnnBackend, TritonBackend):
        monkeypatch.setattr(cls, "availability", classmethod(lambda c, device: (True, "pretend")))


def test_auto_routes_each_recipe_to_a_backend_that_runs_it(monkeypatch):
    """With cudnn and triton pretending to be available, the default recipe goes to cudnn, every MXFP8 variant
    to triton and per-tensor scaling to reference (sizes unknown, as under torch.compile, so no cuDNN planning
    runs); the warning names why."""
    _pretend_available(monkeypatch)
    problem = Problem(device=torch.device("cpu"), dtype=torch.bfloat16, batch=None, heads_q=4, heads_kv=2,
                      seqlen_q=None, seqlen_kv=None, head_dim=64, mask=MaskSpec(causal=True), needs_backward=True)
    assert backends.pick_backend("auto", problem) == "cudnn"
    for name, recipe in VARIANTS.items():
        if name == "default":
            continue
        p = dataclasses.replace(problem, recipe=recipe.encode())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backends._WARNED.clear()
            expected = "reference" if recipe.scaling == "per_tensor" else "triton"
            assert backends.pick_backend("auto", p) == expected, name
        assert any("cudnn: cuDNN's MXFP8 SDPA graphs" in str(w.message) for w in caught), name
        for refused in ("cudnn", "triton") if recipe.scaling == "per_tensor" else ("cudnn",):
            with pytest.raises(MXFP8NotSupportedError, match=recipe.differences().replace("'", ".")):
                backends.pick_backend(refused, p)


def test_auto_runs_a_variant_and_matches_the_reference_backend():
    q, k, v, _ = _bhsd(b=1, sq=64, skv=64, d=64, seed=4)
    recipe = VARIANTS["bf16_pv"]
    auto = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", recipe=recipe)
    ref = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="reference",
                                 recipe=recipe)
    assert torch.equal(auto, ref)


def test_plan_cache_keeps_recipes_apart():
    """Repeated dense calls reuse a plan per signature: the recipe is part of it (default, variant, default
    again give the default's bits twice and the variant's once)."""
    q, k, v, _ = _bhsd(b=1, sq=64, skv=64, d=64, seed=5)
    call = lambda r: mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference", recipe=r)  # noqa
    first, variant, again = call(None), call(VARIANTS["p_none"]), call(Recipe())
    assert torch.equal(first, again) and not torch.equal(first, variant)
    assert torch.equal(variant, R.sdpa_fwd(q, k, v, p_format="bf16")[0])


# --------------------------------------------------------------------------- pass-through: module, HF, compile


def test_dot_product_attention_passes_the_recipe():
    recipe = VARIANTS["mixed"]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 70, 4, 64, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 70, 2, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    mod = mxattn.DotProductAttention(4, 64, num_gqa_groups=2, attn_mask_type="causal", backend="reference",
                                     recipe=recipe)
    assert mod.recipe == recipe and "recipe=Recipe(p_quant='lazy16'" in repr(mod)
    assert mxattn.DotProductAttention(4, 64).recipe == Recipe()
    out = mod(q, k, v)
    expected = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference", recipe=recipe)
    assert torch.equal(out, expected.reshape(2, 70, -1))
    default = mxattn.DotProductAttention(4, 64, num_gqa_groups=2, attn_mask_type="causal", backend="reference")
    assert not torch.equal(default(q, k, v), out)
    do = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), do), _grads(expected.reshape(2, 70, -1), (q, k, v), do)):
        assert torch.equal(a, b)


def test_transformers_registration_passes_the_recipe():
    transformers = pytest.importorskip("transformers")
    from mxattn.integrations import transformers as mx_hf
    recipe = VARIANTS["v_bf16"]
    fn = mx_hf.make_attention_function("reference", recipe=recipe)
    assert fn.mxattn_recipe == recipe and mx_hf.make_attention_function().mxattn_recipe == Recipe()
    with pytest.raises(TypeError, match="recipe must be an mxattn.Recipe"):
        mx_hf.make_attention_function("reference", recipe="bf16")
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(10)
    query = torch.randn(2, 4, 40, 32, generator=g).bfloat16()                 # transformers' [B, H, S, D]
    key, value = (torch.randn(2, 2, 40, 32, generator=g).bfloat16() for _ in range(2))
    out, _ = fn(module, query, key, value, None, scaling=0.2)
    expected = mxattn.mxfp8_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                      attn_mask_type="causal", softmax_scale=0.2, backend="reference", recipe=recipe)
    assert torch.equal(out, expected)
    # registered under a name: a tiny Llama runs with it, padded batch included, and differs from the default
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers import AttentionInterface
    mx_hf.register("mxfp8_recipe_test", backend="reference", recipe=recipe)
    mx_hf.register("mxfp8_default_test", backend="reference")
    try:
        assert AttentionInterface._global_mapping["mxfp8_recipe_test"].mxattn_recipe == recipe
        cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(3, 64, (2, 40), generator=g)
        am = torch.ones(2, 40, dtype=torch.long)
        am[1, 30:] = 0
        logits = {}
        for name in ("mxfp8_recipe_test", "mxfp8_default_test"):
            model.set_attn_implementation(name)
            with torch.no_grad():
                logits[name] = model(input_ids=ids, attention_mask=am).logits
        a, b = logits["mxfp8_recipe_test"], logits["mxfp8_default_test"]
        assert not torch.equal(a, b) and _rel(a, b) < 0.1
    finally:
        mx_hf.unregister("mxfp8_recipe_test")
        mx_hf.unregister("mxfp8_default_test")


def test_torch_compile_fullgraph_with_a_variant():
    """Under torch.compile the recipe reaches the custom ops as a string and the saved inputs' fake layouts
    match the real ones: compiled forward and backward equal eager bit for bit."""
    torch._dynamo.reset()
    recipe = VARIANTS["bf16_pv"]

    def f(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference", recipe=recipe)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 48, 4, 64, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 48, 2, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    out = compiled(q, k, v)
    expected = f(q, k, v)
    assert torch.equal(out, expected)
    do = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), do), _grads(expected, (q, k, v), do)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["p_none", "per_tensor"])
def test_custom_op_passes_opcheck_with_a_variant(name):
    from mxattn import ops
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 40, 4, 64, generator=g).bfloat16().permute(0, 2, 1, 3)
    k, v = (torch.randn(2, 40, 2, 64, generator=g).bfloat16().permute(0, 2, 1, 3) for _ in range(2))
    args = (q, k, v, 0.125, False, None, 0, torch.bfloat16, "bshd", "reference", None, None, 0, 0, False, None,
            VARIANTS[name].encode())
    torch.library.opcheck(ops.attention_fwd, args, test_utils=("test_schema", "test_faketensor"))
