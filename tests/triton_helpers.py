"""Shared by the Triton tests: the GPU tests, and the host-path tests that record launches on the CPU."""

import pytest
import torch


def triton_backend():
    """A TritonBackend on this CUDA device, or skip the test with the reason."""
    from mxattn.backends.triton_backend import TritonBackend
    ok, why = TritonBackend.availability(torch.device("cuda"))
    if not ok:
        pytest.skip(f"triton backend unavailable: {why}")
    return TritonBackend()


def as_bytes(t):
    return t.view(torch.uint8)


def same_values(a, b):
    """Equal values, NaN where the other has NaN (NaN bit patterns may differ)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def new_plan_caches() -> dict:
    """Empty launch-plan caches for every level the library keeps them (backend, op bodies, whole calls, call
    signatures): {(module, attribute name): cache}. Installed (`install_plan_caches`), they make the next calls
    record their own plans instead of replaying an earlier run's recordings (e.g. of another kernel choice)."""
    from mxattn import attention, op_plans
    from mxattn.backends import triton_backend as backend_module
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.plan_cache import PlanCache
    return {(backend_module, "_PLANS"): PlanCache(), (backend_module, "_AFFINE_PLANS"): AffinePlanCache(),
            (op_plans, "PLANS"): PlanCache(min_replays=16), (op_plans, "CALLS"): PlanCache(min_replays=16),
            (op_plans, "CALLS_AFFINE"): AffinePlanCache(), (attention, "_PLANS"): {}}


def install_plan_caches(caches: dict, set_attr=setattr) -> None:
    """Put `new_plan_caches()`'s caches in place (set_attr: e.g. a monkeypatch's setattr, undone after a test)."""
    for (module, name), cache in caches.items():
        set_attr(module, name, cache)


def force_fp8_data_paths(monkeypatch):
    """Make the triton backend take its FP8 data paths (the forward dequantizing K and V on chip, the backward
    streaming FP8), as a large problem or D > 128 does, and keep launch plans out of the way: they key on the
    call's signature, not on these module-level choices."""
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import triton_attention_bwd as tb, triton_attention_fwd as tf
    monkeypatch.setattr(tf, "fwd_streams_bf16", lambda *a: False)
    monkeypatch.setattr(tb, "bwd_streams_bf16", lambda *a: False)
    monkeypatch.setattr(backend_module, "_forward_key", lambda roots, params: None)
    monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)


def record_launches(monkeypatch, request, keep_kwargs: bool = False, keep_args: bool = False) -> list:
    """Run the triton backend's host path on CPU tensors: the CUDA checks relaxed and every launch recorded as
    (kernel name, grid), with keep_kwargs (kernel name, grid, keywords: constexprs and options), with keep_args
    (kernel name, grid, keywords, positional arguments), instead of made. Returns the list the launches are
    appended to."""
    from mxattn import checks
    from mxattn.backends import pick_backend, triton_backend as backend_module
    from mxattn.kernels import triton_attention_bwd as tb, triton_attention_fwd as tf, triton_quantize as tq
    from mxattn.kernels import triton_bwd_prep as tp

    real = checks.check_bhsd_tensor
    for module in (checks, backend_module, tq):
        monkeypatch.setattr(module, "check_bhsd_tensor", lambda x, n, d, dev=None: real(x, n, d))
    monkeypatch.setattr(backend_module.TritonBackend, "availability", classmethod(lambda cls, d: (True, "stub")))
    request.addfinalizer(pick_backend.cache_clear)  # (the stubbed answer must not outlive the test)
    launched = []

    def record(fn, grid, *args, **kwargs):
        name = fn.__name__.strip("_")
        launched.append((name, grid, kwargs, args) if keep_args else (name, grid, kwargs) if keep_kwargs else
                        (name, grid))

    for module in (tq, tf, tb, tp):
        monkeypatch.setattr(module, "launch", record)
    return launched


def stub_compiled_launches(monkeypatch, kernel_for) -> None:
    """`mxattn.runtime.triton_launch` on the CPU: Triton's dispatcher replaced by kernel_for(fn) (a stand-in
    with the compiled kernel's run(g0, g1, g2, stream, function, metadata, h0, h1, h2, *args)), which is run
    once, as the dispatcher would, and then cached and launched directly as a compiled kernel (launch plans
    record and replay it); device and stream 0, fresh launch caches."""
    from mxattn.runtime import triton_launch

    def first_launch(fn, grid, args, kwargs):
        kernel = kernel_for(fn)
        tail = [kwargs[n] for n in fn.arg_names[len(args):]]
        kernel.run(*(tuple(grid) + (1,) * (3 - len(grid))), None, None, None, None, None, None, *args, *tail)
        return kernel

    monkeypatch.setattr(triton_launch, "FAST_PATH", True)
    monkeypatch.setattr(triton_launch, "first_launch", first_launch)
    monkeypatch.setattr(triton_launch, "current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "current_stream", lambda device: 0)
    monkeypatch.setattr(triton_launch, "_CACHES", {})
