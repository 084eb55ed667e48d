"""Recipe variants on a CUDA GPU: the reference backend runs every variant on the GPU with the CPU's bits (ref's
math is device-independent, and so must be the quantizers: floor rounding, per-tensor FP8, bf16 V), and
"auto" sends each recipe to a backend that runs it.

The triton backend's variants are compared with the reference backend in test_recipe_triton_gpu.py."""

import dataclasses
import warnings

import pytest
import torch

import mxattn
from mxattn import Recipe
from mxattn.recipe import all_variants

pytestmark = pytest.mark.gpu

RECIPES = all_variants() + (Recipe(p_quant="none", v_operand="bf16", ds_quant="bf16"),
                            Recipe(p_quant="lazy16", v_operand="bf16", scale_rounding="floor"))


def _run(device, recipe, q, k, v, do, backend="reference"):
    leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
    o = mxattn.mxfp8_attention(*leaves, qkv_format="bhsd", attn_mask_type="causal", backend=backend,
                               recipe=recipe)
    grads = torch.autograd.grad(o, leaves, do.to(device))
    return [t.cpu() for t in (o, *grads)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.differences())
def test_reference_backend_on_cuda_equals_cpu(recipe):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 4, 200, 64, generator=g) * 3).bfloat16()
    k, v = ((torch.randn(2, 2, 260, 64, generator=g) * 3).bfloat16() for _ in range(2))
    do = torch.randn(2, 4, 200, 64, generator=g).bfloat16()
    for a, b in zip(_run("cuda", recipe, q, k, v, do), _run("cpu", recipe, q, k, v, do)):
        assert torch.equal(a, b)


def test_auto_on_cuda_routes_variants_to_a_backend_that_runs_them():
    """On a CUDA GPU without Blackwell, "auto" sends every MXFP8 variant to triton (its kernels run them,
    tests/recipe/test_recipe_triton_gpu.py) and per-tensor scaling to reference; the call gives that backend's
    bits."""
    from mxattn.backends import Problem, pick_backend
    from mxattn.mask import MaskSpec
    problem = Problem(device=torch.device("cuda"), dtype=torch.bfloat16, batch=1, heads_q=4, heads_kv=2,
                      seqlen_q=256, seqlen_kv=256, head_dim=64, mask=MaskSpec(causal=True), needs_backward=True)
    fast = pick_backend("auto", problem)
    if fast == "reference":
        pytest.skip("neither cudnn nor triton runs on this GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for recipe in RECIPES[1:]:
            want = "reference" if recipe.scaling == "per_tensor" else "triton"
            assert pick_backend("auto", dataclasses.replace(problem, recipe=recipe.encode())) == want, recipe
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 4, 256, 64, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, 2, 256, 64, generator=g, device="cuda").bfloat16() for _ in range(2))
    for recipe, backend in ((Recipe(v_operand="bf16"), "triton"), (Recipe(scaling="per_tensor"), "reference")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            o = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", recipe=recipe)
        expected = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend=backend,
                                          recipe=recipe)
        assert torch.equal(o, expected)
