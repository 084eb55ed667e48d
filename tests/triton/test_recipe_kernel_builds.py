"""The recipe variants' kernel specialisations build for sm_90 without a GPU (Triton's compiler and ptxas on the
CPU): each switch of `mxattn.runtime.recipe_flags` on the kernels it reaches, one configuration each. Their
numbers are checked on the GPU (tests/recipe/test_recipe_triton_gpu.py); the default recipe's machine code is
fingerprinted by benchmarks/default_recipe_sass.py."""

import sys

import pytest

pytest.importorskip("triton")

from repo_paths import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from default_recipe_sass import builds  # noqa: E402
from triton_compile import compile_for  # noqa: E402

from mxattn import Recipe  # noqa: E402
from mxattn.runtime.recipe_flags import kernel_recipe  # noqa: E402

#: (recipe, the default_recipe_sass builds it reaches)
CASES = [
    (Recipe(scale_rounding="floor"), ["quantize qkv", "prep q d128", "dkdv d64 pre", "dq d128 fp8", "fwd d64 quantizing"]),
    (Recipe(p_quant="none"), ["fwd d64 bf16-kv", "dkdv d64 pre"]),
    (Recipe(p_quant="lazy16"), ["fwd d128 fp8-kv", "fwd d256 fp8-kv"]),
    (Recipe(v_operand="bf16"), ["fwd d256 fp8-kv", "fwd d64 quantizing", "dkdv d128 fp8", "dq d64 pre", "prep kv d128"]),
    (Recipe(ds_quant="bf16"), ["dkdv d128 fp8", "dq d128 fp8"]),
]


def _switches(recipe, name: str, fn) -> dict:
    flags = kernel_recipe(recipe)
    if name.startswith("fwd"):
        out = flags.fwd()
    elif name.startswith(("dkdv", "dq")):
        out = flags.bwd()
    elif name.startswith("prep"):
        out = dict(FLOOR=flags.floor, WITH_V=not flags.v_raw)
    else:
        out = dict(FLOOR=flags.floor)
    return {k: v for k, v in out.items() if k in fn.arg_names}


@pytest.mark.parametrize("recipe,names", CASES, ids=[r.differences() for r, _ in CASES])
def test_variant_kernels_build_for_sm90(recipe, names):
    table = {b[0]: b for b in builds()}
    for name in names:
        _, fn, types, constexprs, warps, stages = table[name]
        switches = _switches(recipe, name, fn)
        assert switches, name
        if switches.get("V_RAW"):  # V is then a bf16 tensor (the kernels read it as it is)
            types = {**types, "V": "*bf16"}
        kernel = compile_for(fn, types, {**constexprs, **switches}, num_warps=warps, num_stages=stages)
        assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024, name
        ptx = kernel.asm["ptx"]
        if name == "fwd d64 bf16-kv":  # P rounded to bf16: no E4M3 conversion left in a kernel fed bf16 K/V
            assert "cvt.rn.satfinite.e4m3x2.f32" not in ptx


def test_default_fwd_rounds_p_to_e4m3():
    """The counterpart of the p_quant="none" check above: the default forward on bf16 K/V converts P to E4M3."""
    table = {b[0]: b for b in builds()}
    _, fn, types, constexprs, warps, stages = table["fwd d64 bf16-kv"]
    kernel = compile_for(fn, types, constexprs, num_warps=warps, num_stages=stages)
    assert "cvt.rn.satfinite.e4m3x2.f32" in kernel.asm["ptx"]


def test_bf16_v_forward_at_d256_fits_shared_memory():
    """The bf16-V forward above D 128 takes one pipeline stage (`_fwd_config`): on the H100 the two-stage build
    asked for 256 KiB of shared memory (OutOfResources in a device run; this offline build, whose integer
    specialisations differ, reports less), and one stage needs less than two here too."""
    from mxattn.kernels import triton_attention_fwd as tf
    _, fn, types, constexprs, warps, _ = {b[0]: b for b in builds()}["fwd d256 fp8-kv"]
    types = {**types, "V": "*bf16"}
    divisible = [p.name for p in fn.params if not p.is_constexpr and
                 (types.get(p.name, "").startswith("*") or p.name.startswith("s") or p.name == "D")]
    shared = {}
    for stages in (2, tf._fwd_config(256, v_raw=True)[2]):
        kernel = compile_for(fn, types, {**constexprs, **kernel_recipe(Recipe(v_operand="bf16")).fwd()},
                             num_warps=warps, num_stages=stages, divisible=divisible)
        shared[stages] = kernel.metadata.shared
    assert shared[1] <= 227 * 1024 and shared[1] < shared[2], shared
    assert tf._fwd_config(256) == tf.FWD_CONFIGS[256]  # the default recipe keeps its stages


#: the Gluon kernels' recipe builds (`compile_sm90` keywords): each backward switch at once at both head dims (and
#: the padded causal bottom-right build, whose default keeps 56 stack bytes), the forward's bf16 P with fp16 O, its
#: lazy16 P with a sink and its bf16 V on the bf16-K/V variant
GLUON_CASES = [
    ("gluon_attention_bwd", 64, False, dict(flags=kernel_recipe(Recipe(p_quant="none", v_operand="bf16",
                                                                       ds_quant="bf16"))), (0, 0)),
    ("gluon_attention_bwd", 128, False, dict(flags=kernel_recipe(Recipe(p_quant="none", v_operand="bf16",
                                                                        scale_rounding="floor"))), (0, 0)),
    ("gluon_attention_bwd", 128, True, dict(flags=kernel_recipe(Recipe(scale_rounding="floor")), varlen=True,
                                            bottom_right=True), (56, 48)),
    ("gluon_attention_dq", 128, True, dict(flags=kernel_recipe(Recipe(scale_rounding="floor"))), (0, 0)),
    ("gluon_attention_dq", 64, False, dict(flags=kernel_recipe(Recipe(ds_quant="bf16"))), (0, 0)),
    ("gluon_attention_fwd", 128, True, dict(flags=kernel_recipe(Recipe(p_quant="none")), o_dtype="fp16"), (0, 0)),
    ("gluon_attention_fwd", 64, True, dict(flags=kernel_recipe(Recipe(p_quant="lazy16")), has_sink=True), (0, 0)),
    ("gluon_attention_fwd", 128, False, dict(flags=kernel_recipe(Recipe(v_operand="bf16")), kv_bf16=True), (0, 0)),
]


@pytest.mark.parametrize("module,d,causal,kwargs,allowance", GLUON_CASES,
                         ids=["dkdv-d64-p-v-ds", "dkdv-d128-p-v-floor", "dkdv-d128-causal-padded-floor",
                              "dq-d128-causal-floor", "dq-d64-ds", "fwd-d128-causal-p-fp16", "fwd-d64-causal-lazy16-sink",
                              "fwd-d128-bf16kv-v"])
def test_gluon_recipe_variants_build_for_sm90a_without_spills(module, d, causal, kwargs, allowance):
    """The Gluon kernels' recipe specialisations build for sm_90a like their default builds: no spills, wgmma
    left asynchronous, within shared memory (the padded causal bottom-right dK/dV build keeps its default's 56 stack
    bytes of loop bounds); an E4M3 conversion is left exactly where the recipe still rounds P or dS to E4M3."""
    import importlib
    from test_gluon_fwd_gpu import _assert_sm90_build
    mod = importlib.import_module(f"mxattn.kernels.{module}")
    try:
        kernel = mod.compile_sm90(d, causal, **kwargs)
    except Exception as e:  # noqa: BLE001 (a Triton without Gluon's Hopper ops here)
        pytest.skip(f"cannot compile for sm_90a here: {e}")
    _assert_sm90_build(kernel, *allowance)
    flags = kwargs.get("flags")
    if module == "gluon_attention_fwd":  # what the kernel still rounds to E4M3: P (fwd, dK/dV), dS (dK/dV, dQ)
        rounds = kwargs["flags"].p_mode != 2
    elif module == "gluon_attention_dq":
        rounds = not flags.ds_bf16
    else:
        rounds = not (flags.p_mode == 2 and flags.ds_bf16)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in kernel.asm["ptx"]) == rounds
