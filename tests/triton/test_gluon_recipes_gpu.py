"""Recipe variants (`mxattn.Recipe`) and fp16 inputs on the Gluon kernels (Hopper), through the public API on the
triton backend, against the Triton kernels on the same inputs:

* the backward: the dK/dV and dQ kernels take every variant's backward switches (P rounded to bf16, dS rounded to
  bf16, the floor scale rule for dS's blocks, bf16 V); with the forward fixed, the gradients of the Gluon kernels
  equal the Triton kernels' bit for bit (MXATTN_GLUON_BWD=0's path);
* the forward: the Gluon forward takes every P recipe (fixed256, lazy16, none) with either scale rule, bf16 V on its
  bf16-K/V variant (the bf16-scratch path), and writes bf16 or fp16 O; O within one ulp of the Triton forward's in
  >= 99.9% of elements (as tests/triton/test_gluon_fwd_gpu.py); bf16 V on the FP8 path runs the Triton forward.

Each variant's numbers against the reference backend are tests/recipe/test_recipe_triton_gpu.py's."""

import pytest
import torch

from mxattn import Recipe
from test_gluon_fwd_gpu import _is_hopper, _ordered_bf16 as _ordered

pytestmark = pytest.mark.gpu

#: one variant per backward switch, the lazy16 P (whose backward rounds P as fixed256), and all switches at once
RECIPES = (Recipe(p_quant="none"), Recipe(ds_quant="bf16"), Recipe(scale_rounding="floor"),
           Recipe(v_operand="bf16"), Recipe(p_quant="lazy16"),
           Recipe(p_quant="none", v_operand="bf16", ds_quant="bf16", scale_rounding="floor"))
IDS = [r.differences().replace("'", "") for r in RECIPES]


def _counted(monkeypatch, module, name, calls):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(name) or real(*a, **k))


def _setup(monkeypatch, D, dtype=torch.bfloat16, HQ=8, HKV=2, B=2, S=700):
    """Skips off Hopper. No launch plans (each run takes the body: which kernel runs is not in the plan key), the
    backward kernels' size minimums off, the Gluon launches counted -> (the backend module, the list of the Gluon
    launches' names, one per call, a fused bshd QKV projection [B, S, HQ + 2 HKV, D], dO, its split sizes)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from mxattn.kernels import gluon_attention_fwd as gf
    from test_gluon_fwd_gpu import _fresh_plan_caches
    _fresh_plan_caches(monkeypatch)
    monkeypatch.setattr(backend_module, "_forward_key", lambda roots, params: None)
    monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)
    monkeypatch.setattr(gd, "MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MIN_QUERY_ROWS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MHA_MIN_QUERY_ROWS", {64: 0, 128: 0})
    calls = []
    _counted(monkeypatch, gf, "attention_fwd_gluon", calls)
    _counted(monkeypatch, gb, "dkdv_gluon", calls)
    _counted(monkeypatch, gd, "dq_gluon", calls)
    g = torch.Generator(device="cuda").manual_seed(31 + D)
    qkv = torch.randn(B, S, HQ + 2 * HKV, D, device="cuda", generator=g).to(dtype)
    do = torch.randn(B, S, HQ, D, device="cuda", generator=g).to(dtype)
    return backend_module, calls, qkv, do, (HQ, HKV, HKV)


def _forwards_agree(monkeypatch, backend_module, calls, qkv, split, gluon_runs: bool, recipe=None):
    """O of the Gluon forward (GLUON_FORWARD on; it must run exactly where gluon_runs) and of the Triton forward
    (off), no grad, causal, on q, k, v split from qkv: within one ulp in >= 99.9% of elements; returns O."""
    import mxattn
    outs = []
    for on in (True, False):
        monkeypatch.setattr(backend_module, "GLUON_FORWARD", on)
        monkeypatch.setattr(backend_module, "_GLUON", {})
        calls.clear()
        with torch.no_grad():
            q, k, v = qkv.split(split, dim=2)
            outs.append(mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton", recipe=recipe))
        torch.cuda.synchronize()
        assert calls.count("attention_fwd_gluon") == (1 if on and gluon_runs else 0), calls
    ulps = (_ordered(outs[0]) - _ordered(outs[1])).abs()
    assert (ulps <= 1).float().mean().item() >= 0.999, f"max {ulps.max().item()} ulps"
    return outs[0]


def _backwards_equal(monkeypatch, backend_module, calls, qkv, do, split, recipe=None):
    """Gradients of the fused projection through the public API with the Gluon backward kernels (GLUON_BACKWARD on:
    both must run) and with the Triton kernels (off), the forward the same: equal bit for bit; returns them."""
    import mxattn
    grads = []
    for on in (True, False):
        monkeypatch.setattr(backend_module, "GLUON_BACKWARD", on)
        calls.clear()
        x = qkv.clone().requires_grad_(True)
        q, k, v = x.split(split, dim=2)
        mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton", recipe=recipe).backward(do)
        torch.cuda.synchronize()
        assert ("dkdv_gluon" in calls) == on and ("dq_gluon" in calls) == on, calls
        grads.append(x.grad)
    assert torch.isfinite(grads[0]).all()
    assert torch.equal(grads[0], grads[1])
    return grads[0]


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("D", [64, 128])
def test_recipe_backward_on_the_gluon_kernels_equals_the_triton_kernels(monkeypatch, recipe, D):
    backend_module, calls, qkv, do, split = _setup(monkeypatch, D)
    _backwards_equal(monkeypatch, backend_module, calls, qkv, do, split, recipe)


@pytest.mark.parametrize("path", ["bf16_scratch", "fp8"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
@pytest.mark.parametrize("D", [64, 128])
def test_recipe_forward_on_the_gluon_kernel_matches_the_triton_forward(monkeypatch, recipe, D, path):
    """On both data paths of the forward (bf16 scratch, these sizes' own; FP8 on chip, forced): every P recipe runs
    the Gluon forward, bf16 V on the bf16-scratch path only."""
    backend_module, calls, qkv, _, split = _setup(monkeypatch, D)
    if path == "fp8":
        from triton_helpers import force_fp8_data_paths
        force_fp8_data_paths(monkeypatch)
    takes = not (path == "fp8" and recipe.v_operand == "bf16")
    _forwards_agree(monkeypatch, backend_module, calls, qkv, split, takes, recipe)


@pytest.mark.parametrize("D", [64, 128])
def test_fp16_inputs_run_the_gluon_forward_and_backward(monkeypatch, D):
    """fp16 q, k, v: the Gluon forward writes fp16 O (within one fp16 ulp of the Triton forward's in >= 99.9% of
    elements), and the backward's Gluon kernels give the Triton kernels' fp16 gradients bit for bit (the Triton
    forward before both)."""
    backend_module, calls, qkv, do, split = _setup(monkeypatch, D, torch.float16)
    assert _forwards_agree(monkeypatch, backend_module, calls, qkv, split, True).dtype == torch.float16
    monkeypatch.setattr(backend_module, "GLUON_FORWARD", False)
    monkeypatch.setattr(backend_module, "_GLUON", {})
    assert _backwards_equal(monkeypatch, backend_module, calls, qkv, do, split).dtype == torch.float16
