"""Recipe variants on the triton backend (CUDA GPU): every MXFP8 variant against the reference backend (ref's
numerics, independent code) through the public API, on each of the kernels' data paths: the forward on bf16 K/V
scratch and on FP8 dequantized on chip, the one-launch forward that quantizes as it reads (no grad, one query
tile), the backward on bf16 scratch ("pre") and on FP8 ("fp8"); padded and packed batches with a learnable
sink; fp32 inputs (the bf16-V variant rounds V itself).

Tolerances are the triton backend's against ref (tests/triton/test_triton_gpu.py): O within one bf16 ulp in
>= 99% of elements and no element further than one ulp of O's largest magnitude, dQ/dK/dV relative RMS <= 1e-2.
Each variant must also land far closer to the reference backend's run of that variant than to the default
recipe's run in what the variant changes (O for forward fields, dQ and dK for dS's rounding), so a switch that
did nothing, or something else, fails; the measured errors are printed (pytest -s)."""

import math

import pytest
import torch

import mxattn
from mxattn import Recipe
from mxattn.recipe import all_variants
from triton_helpers import force_fp8_data_paths

pytestmark = pytest.mark.gpu

#: every MXFP8 variant (per-tensor scaling has no kernel: the triton backend refuses it, tests/recipe/test_recipe.py)
RECIPES = tuple(r for r in all_variants() if r.scaling == "mxfp8" and not r.is_default) + (
    Recipe(p_quant="none", v_operand="bf16", ds_quant="bf16"),
    Recipe(p_quant="lazy16", v_operand="bf16", ds_quant="bf16", scale_rounding="floor"))
IDS = [r.differences().replace("'", "") for r in RECIPES]

O_ULP_FRACTION = 0.99
GRAD_REL_RMS = 1e-2
#: a variant's distance to its reference run, as a fraction of its distance to the default recipe's run, at most
DISCRIMINATION = 0.2


def _bf16_ulp(r: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(r.float())
    return torch.ldexp(torch.ones_like(r, dtype=torch.float32), (e - 8).clamp(min=-133))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(b, hq, hkv, sq, skv, d, dtype=torch.bfloat16, seed=0, scale=2.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h, s: (torch.randn(b, s, h, d, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    return mk(hq, sq), mk(hkv, skv), mk(hkv, skv), mk(hq, sq).to(torch.bfloat16 if dtype == torch.float32 else dtype)


def _run(backend, recipe, q, k, v, do=None, **kw):
    """O and (with do) dQ, dK, dV of mxfp8_attention on bshd views (fresh leaves)."""
    leaves = [t.detach().clone().requires_grad_(do is not None) for t in (q, k, v)]
    with torch.set_grad_enabled(do is not None):
        o = mxattn.mxfp8_attention(*leaves, qkv_format="bshd", backend=backend, recipe=recipe, **kw)
    if do is None:
        return [o]
    return [o, *torch.autograd.grad(o, leaves, do)]


def _changed(recipe: Recipe, n: int) -> list:
    """Indices of [O, dQ, dK, dV][:n] that the recipe changes against the default (forward fields change O
    and everything after it; dS's rounding changes dQ and dK only)."""
    if recipe.p_quant != "fixed256" or recipe.v_operand != "fp8" or recipe.scale_rounding != "ceil":
        return [0]
    return [1, 2][:max(0, n - 1)]


def _compare(recipe, label, q, k, v, do=None, **kw):
    """The triton run of `recipe` checked (`_check`) against the reference backend's runs of it and of the
    default recipe, on the same inputs; returns the triton run's [O, dQ, dK, dV] (O alone without do)."""
    got = _run("triton", recipe, q, k, v, do, **kw)
    _check(got, _run("reference", recipe, q, k, v, do, **kw), _run("reference", None, q, k, v, do, **kw),
           f"{recipe.differences()} {label}", recipe)
    return got


def _check(got, want, default, label, recipe):
    """got (triton, the variant) against want (reference backend, the variant); default: the reference
    backend's run of the default recipe."""
    o, wo = got[0].float(), want[0].float()
    diff = (o - wo).abs()
    within = (diff <= _bf16_ulp(wo)).float().mean().item()
    errs = [_rel(g, w) for g, w in zip(got[1:], want[1:])]
    to_default = [_rel(g, d) for g, d in zip(got, default)]
    print(f"{label}: O within 1 ulp {within:.5f}, max abs {diff.max().item():.3g}; grads rel-RMS "
          f"{['%.2e' % e for e in errs]}; distance to the default recipe {['%.2e' % e for e in to_default]}")
    assert torch.isfinite(o).all()
    assert within >= O_ULP_FRACTION, within
    assert diff.max().item() <= _bf16_ulp(wo.abs().max()).item(), diff.max().item()
    for e in errs:
        assert e <= GRAD_REL_RMS, errs
    own = [_rel(got[0], want[0])] + errs
    for i in _changed(recipe, len(got)):  # (none for dS's rounding in a call without backward)
        assert own[i] <= DISCRIMINATION * to_default[i], (i, own, to_default)


@pytest.mark.parametrize("path", ["bf16_scratch", "fp8_on_chip"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_triton_variant_matches_the_reference_backend(recipe, path, monkeypatch):
    """Forward and backward, causal GQA at D 64 (bf16 scratch paths) or with the forward on FP8 K/V and the
    backward streaming FP8 (forced: the paths a large problem or D > 128 takes), sequence lengths not multiples
    of the tiles."""
    if path == "fp8_on_chip":
        force_fp8_data_paths(monkeypatch)
    _compare(recipe, path, *_inputs(2, 8, 2, 300, 300, 64, seed=1), attn_mask_type="causal")


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_triton_variant_head_dim_256_and_a_window(recipe):
    """D 256 (forward always on FP8 K/V on chip, the widest backward tiles), a sliding window, bottom-right
    alignment with Sq < Skv."""
    _compare(recipe, "d256 window", *_inputs(1, 4, 4, 96, 200, 256, seed=2), attn_mask_type="causal_bottom_right",
             window_size=(70, 0))


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_triton_variant_decode_step_one_launch(recipe):
    """No grad, one query row per sequence over 333 keys (the forward that quantizes Q, K, V as it reads, or
    rounds V to bf16): O against the reference backend, and fp32 inputs."""
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, _ = _inputs(4, 8, 2, 1, 333, 128, dtype=dtype, seed=3)
        got = _compare(recipe, f"decode {dtype}", q, k, v, attn_mask_type="causal_bottom_right")
        assert got[0].dtype == dtype


@pytest.mark.parametrize("recipe", [RECIPES[-1], Recipe(p_quant="lazy16"), Recipe(p_quant="none")],
                         ids=["all_fields", "lazy16", "p_none"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_triton_variant_varlen_with_a_learnable_sink(recipe, packed):
    """Padded (bshd + cu_seqlens) and packed (thd) batches of lengths 1..300 with a learnable sink (the lazy
    running max starts from it): O, dQ, dK, dV and dSink against the reference backend."""
    lens = [300, 1, 77, 160]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    hq, hkv, d = 4, 2, 64
    g = torch.Generator(device="cuda").manual_seed(5)
    sink = torch.randn(hq, device="cuda", generator=g)
    if packed:
        t = sum(lens)
        q, k, v, do = ((torch.randn(t, h, d, device="cuda", generator=g) * 2).bfloat16() for h in (hq, hkv, hkv, hq))
        kw = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                  max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    else:
        q, k, v, do = _inputs(len(lens), hq, hkv, max(lens), max(lens), d, seed=6)
        kw = dict(qkv_format="bshd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                  max_seqlen_q=max(lens), max_seqlen_kv=max(lens))

    def run(backend, r):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        s = sink.detach().clone().requires_grad_()
        o = mxattn.mxfp8_attention(*leaves, backend=backend, recipe=r, softmax_type="learnable",
                                   softmax_offset=s, **kw)
        grads = torch.autograd.grad(o, leaves + [s], do)
        if not packed:  # compare real rows only (padding rows are zeros in both)
            mask = torch.arange(max(lens), device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
            o = o[mask]
            grads = [x[mask] for x in grads[:3]] + [grads[3]]
        return [o, *grads]

    got, want, default = run("triton", recipe), run("reference", recipe), run("reference", None)
    _check(got[:4], want[:4], default[:4], f"{recipe.differences()} {'packed' if packed else 'padded'}", recipe)
    assert _rel(got[4], want[4]) <= 1e-3, (got[4], want[4])


def test_default_recipe_still_matches_after_variants_ran():
    """Variants and the default share launch plans' families only through the recipe key: the default's bits
    are the same before and after variant calls of the same signature."""
    q, k, v, do = _inputs(1, 4, 2, 130, 130, 64, seed=7)
    first = _run("triton", None, q, k, v, do, attn_mask_type="causal")
    for r in RECIPES:
        _run("triton", r, q, k, v, do, attn_mask_type="causal")
    again = _run("triton", None, q, k, v, do, attn_mask_type="causal")
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert math.isfinite(first[0].float().sum().item())


@pytest.mark.parametrize("recipe", [Recipe(v_operand="bf16"), Recipe(p_quant="lazy16", ds_quant="bf16",
                                                                     scale_rounding="floor")],
                         ids=["v_bf16", "lazy16_ds_bf16_floor"])
def test_compiled_variant_equals_eager(recipe):
    """torch.compile (inductor) of a variant's forward, backward outside: O, dQ, dK, dV equal the eager call's bit
    for bit (the same kernels through the custom ops; the bf16-V recipe's saved format through the fake kernels),
    also after a new sequence length."""
    torch._dynamo.reset()

    def forward(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton", recipe=recipe)

    compiled = torch.compile(forward)
    for s in (256, 300):
        q, k, v, do = _inputs(1, 4, 2, s, s, 64, seed=s)
        runs = []
        for fn in (forward, compiled):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            o = fn(*leaves)
            o.backward(do)
            runs.append([o.detach(), *(t.grad for t in leaves)])
        for name, a, b in zip(("o", "dq", "dk", "dv"), *runs):
            assert torch.equal(a, b), (s, name)
    torch._dynamo.reset()
