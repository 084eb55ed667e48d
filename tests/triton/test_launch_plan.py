"""Launch plans (mxattn.runtime.launch_plan) on the CPU: a body's allocations, views and Triton launches are
recorded once and replayed for new tensors with every pointer re-based; anything else is refused. Triton's
dispatcher and the compiled kernels' launcher are replaced by recorders (no GPU); the GPU tests compare the
triton backend's replayed results with its ordinary path bit for bit."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")


class _Kernel:
    """A compiled kernel's stand-in: run() records (name, grid, run-time args as addresses or values)."""

    function = packed_metadata = None

    def __init__(self, name, log):
        self.name, self.log = name, log

    def run(self, g0, g1, g2, stream, function, metadata, h0, h1, h2, *args):
        self.log.append((self.name, (g0, g1, g2), [("ptr", a.data_ptr()) if isinstance(a, torch.Tensor) else a
                                                   for a in args]))


class _Launcher:
    """Triton 3.6's launcher of a compiled kernel as replays may call it (`triton_launch.direct_launcher`): its
    C `launch` takes the grid, the stream, then (function, cooperative, pdl, two scratch buffers, metadata,
    launch metadata, two hooks) before the kernel's arguments; calling the launcher itself is `_Kernel.run`."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, *args):
        _Kernel.run(self.kernel, *args)

    def launch(self, g0, g1, g2, stream, function, cooperative, pdl, scratch, profile_scratch, metadata,
               launch_metadata, enter_hook, exit_hook, *args):
        assert (function, metadata, enter_hook, exit_hook) == ("function", "metadata", None, None)
        self.kernel.direct += 1
        _Kernel.run(self.kernel, g0, g1, g2, stream, function, metadata, None, None, None, *args)


class _DirectKernel(_Kernel):
    """A compiled kernel whose launcher a replay calls directly (`_Launcher`); counts those launches."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, name, log):
        super().__init__(name, log)
        self.direct = 0
        self.run = _Launcher(self)


class _Log(list):
    """A launch log (list) that also holds the stand-in kernels by name (`kernels`)."""


@pytest.fixture(params=["wrapper", "direct"])
def launcher(monkeypatch, request):
    """triton_launch with its dispatcher and launcher stubbed (replays calling the launcher's Python wrapper, or
    its C launch directly); returns the launch log."""
    from triton_helpers import stub_compiled_launches
    log, kernels = _Log(), {}
    kind = _Kernel if request.param == "wrapper" else _DirectKernel
    stub_compiled_launches(monkeypatch, lambda fn: kernels.setdefault(fn.__name__, kind(fn.__name__, log)))
    log.kernels = kernels
    yield log


@pytest.fixture
def paged_stubs(monkeypatch):
    """The paged cache calls' triton path on the CPU (with `launcher`): the backend available, a 132-SM GPU for
    the split choice, a fresh plan cache for the steps."""
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.kernels import triton_paged_attention
    from mxattn.runtime import paged_step
    monkeypatch.setattr(TritonBackend, "availability", classmethod(lambda cls, device: (True, "")))
    monkeypatch.setattr(triton_paged_attention, "sm_count", lambda device: 132)
    monkeypatch.setattr(paged_step, "STEPS", paged_step.PlanCache(min_replays=16))


@pytest.fixture
def hf_triton_steps(monkeypatch):
    """(the attn_implementation name transformers knows mxattn's triton attention by, the list PagedStep
    constructions append to): for the HF paged-cache tests, with `launcher` and `paged_stubs`."""
    pytest.importorskip("transformers")
    import warnings

    import mxattn.integrations.transformers as mx_hf
    from mxattn import kvcache_step
    planned = []

    class CountedStep(kvcache_step.PagedStep):
        def __init__(self, *args, **kwargs):
            planned.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(kvcache_step, "PagedStep", CountedStep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        name = mx_hf.register("mxfp8_hf_steps_test", backend="triton")
    yield name, planned
    mx_hf.unregister(name)


def _fn(name, n_args):
    """A jit function's stand-in as `launch` reads it (name, parameter names: n_args run-time, then BLOCK)."""
    return SimpleNamespace(__name__=name, arg_names=[f"a{i}" for i in range(n_args)] + ["BLOCK"])


def _body(x, y):
    """Outputs (whole allocations, one transposed), scratch with overlapping and disjoint lifetimes, views."""
    from mxattn.runtime.triton_launch import launch
    out = torch.empty_like(x)
    stats = torch.empty((3, 5), dtype=torch.float32).t()
    a = torch.empty(1000, dtype=torch.uint8)
    launch(_fn("k0", 4), (4,), x, a, x.numel(), 0.5, BLOCK=32)
    b = torch.empty(300, dtype=torch.bfloat16)
    launch(_fn("k1", 3), (2, 3), a[10:], b, True, BLOCK=16)
    del a
    c = torch.empty(2000, dtype=torch.uint8)
    launch(_fn("k2", 5), (1,), b, c, out[1:], y[:, 2], stats, BLOCK=64)
    return [out, stats, None]


def test_replay_rebases_every_pointer(launcher):
    from mxattn.runtime.launch_plan import record
    x, y = torch.randn(4, 8), torch.randn(6, 6, dtype=torch.float64)
    outputs, plan, reason = record(lambda: _body(x, y), (x, y))
    assert reason == "recorded" and plan.launch_count == 3
    recorded = list(launcher)
    launcher.clear()
    x2, y2 = torch.randn(4, 8), torch.randn(6, 6, dtype=torch.float64)
    out2, stats2, none = plan.replay((x2, y2))
    assert none is None and out2.shape == x.shape and stats2.shape == (5, 3) and stats2.stride() == (1, 5)
    assert [(n, g) for n, g, _ in launcher] == [(n, g) for n, g, _ in recorded]
    (_, _, a0), (_, _, a1), (_, _, a2) = launcher
    # roots and outputs at the recorded offsets of the new tensors; non-pointer arguments unchanged
    assert a0[0] == x2.data_ptr() and a0[2:] == [x.numel(), 0.5, 32]  # (the constexpr tail last)
    assert a1[2] is True
    assert a2[2] == out2.data_ptr() + out2.stride(0) * 4 and a2[3] == y2.data_ptr() + 2 * 8
    assert a2[4] == stats2.data_ptr()
    # scratch: a's view at +10, b and c live together and do not overlap, a and b overlapped in lifetime
    a_ptr, b_ptr, c_ptr = a0[1], a1[1], a2[1]
    assert a1[0] == a_ptr + 10
    assert b_ptr == a2[0]
    assert abs(b_ptr - a_ptr) >= 1000 and (c_ptr >= b_ptr + 600 or c_ptr + 2000 <= b_ptr)
    assert plan.workspace_bytes <= 1024 + 768 + 2048  # no more than the three together, 256-aligned
    assert all(p % 256 == a_ptr % 256 for p in (b_ptr, c_ptr))


def test_empty_outputs_replay_as_empty_allocations_of_their_own(launcher):
    """An empty output (the backward op's dsink without a learnable sink), even two of them, replays as an empty
    tensor of its own: one allocation each, no second allocation to view, and the plan is not refused."""
    from mxattn.runtime.launch_plan import record
    from mxattn.runtime.triton_launch import launch

    def body(x):
        out = torch.empty_like(x)
        launch(_fn("k0", 2), (1,), x, out, BLOCK=32)
        return [out, torch.empty((0,), dtype=torch.float32), x.new_empty((2, 0), dtype=torch.bfloat16)]

    x = torch.randn(4, 8)
    outputs, plan, reason = record(lambda: body(x), (x,))
    assert reason == "recorded" and [kind for kind, _ in plan._outputs] == ["whole"] * 3
    assert plan.allocations_per_replay == 3
    launcher.clear()
    x2 = torch.randn(4, 8)
    out2, empty, empty2 = plan.replay((x2,))
    assert (empty.shape, empty.dtype, empty2.shape, empty2.dtype) == ((0,), torch.float32, (2, 0), torch.bfloat16)
    assert launcher[0][2][:2] == [x2.data_ptr(), out2.data_ptr()]


def test_a_replay_calls_the_c_launcher_directly_where_it_may(launcher):
    """A replay issues its launches through generated code: Triton's C launch function directly for kernels
    without scratch memory (`triton_launch.direct_launcher`), else the launcher's Python wrapper; the recording
    and the first calls go through the wrapper."""
    from mxattn.runtime.launch_plan import record
    x, y = torch.randn(4, 8), torch.randn(6, 6, dtype=torch.float64)
    _, plan, _ = record(lambda: _body(x, y), (x, y))
    kernels = launcher.kernels.values()
    assert sum(getattr(k, "direct", 0) for k in kernels) == 0
    plan.replay((torch.randn(4, 8), torch.randn(6, 6, dtype=torch.float64)))
    plan.replay((torch.randn(4, 8), torch.randn(6, 6, dtype=torch.float64)))
    expected = 2 if all(isinstance(k, _DirectKernel) for k in kernels) else 0
    assert [getattr(k, "direct", 0) for k in kernels] == [expected] * 3
    if expected:  # a kernel that needs scratch memory keeps the wrapper
        k0 = launcher.kernels["k0"]
        k0.run.global_scratch_size = 64
        _, plan, _ = record(lambda: _body(x, y), (x, y))
        plan.replay((torch.randn(4, 8), torch.randn(6, 6, dtype=torch.float64)))
        assert [k.direct for k in kernels] == [2, 3, 3]


def test_plans_of_one_structure_share_their_generated_code(launcher):
    """A replay's generated code reads every value from its plan's constants, so plans that differ only in
    sizes, offsets and grids (an affine plan's instantiation at each decode step's length, say) share one
    compiled function, and each replays its own values."""
    from mxattn.runtime.launch_plan import record
    plans = []
    for n in (8, 12):
        x, y = torch.randn(4, n), torch.randn(6, 6, dtype=torch.float64)
        plans.append((record(lambda: _body(x, y), (x, y))[1], n))
    logs = []
    for plan, n in plans:
        launcher.clear()
        plan.replay((torch.randn(4, n), torch.randn(6, 6, dtype=torch.float64)))
        logs.append(list(launcher))
    (p8, _), (p12, _) = plans
    assert p8._issue[0] is p12._issue[0] and p8._issue[1] != p12._issue[1]
    assert logs[0][0][2][2] == 4 * 8 and logs[1][0][2][2] == 4 * 12  # k0's x.numel(), each plan's own


def test_outputs_from_carve_from_on_are_views_of_one_allocation(launcher):
    """record(..., carve_from=1): the first output keeps its own allocation, the later whole outputs are views
    of one block at 256-byte boundaries (their recorded shapes, strides, dtypes; a zero-filled one zeroed), and
    each launch writes where the returned view lies."""
    from mxattn.runtime.launch_plan import record
    from mxattn.runtime.triton_launch import launch
    x = torch.randn(4, 8)

    def body():
        out = torch.empty_like(x)
        stats = torch.empty((3, 5), dtype=torch.float32).t()
        fp8 = torch.empty((7, 9), dtype=torch.float8_e4m3fn)
        count = torch.zeros(5, dtype=torch.int32)
        launch(_fn("k", 5), (1,), x, out, stats, fp8, count, BLOCK=8)
        return [out, stats, fp8, count]

    _, plan, reason = record(body, (x,), carve_from=1)
    assert reason == "recorded" and plan.allocations_per_replay == 2
    _, uncarved, _ = record(body, (x,))
    assert uncarved.allocations_per_replay == 4
    launcher.clear()
    x2 = torch.randn(4, 8)
    out, stats, fp8, count = plan.replay((x2,))
    block = stats.untyped_storage()
    assert out.untyped_storage().data_ptr() != block.data_ptr()
    assert fp8.untyped_storage().data_ptr() == count.untyped_storage().data_ptr() == block.data_ptr()
    assert [t.data_ptr() - block.data_ptr() for t in (stats, fp8, count)] == [0, 256, 512]
    assert (stats.shape, stats.stride(), fp8.shape, fp8.dtype, count.dtype) == (
        (5, 3), (1, 5), (7, 9), torch.float8_e4m3fn, torch.int32)
    assert torch.equal(count, torch.zeros(5, dtype=torch.int32))
    (_, _, args), = launcher
    assert args[:5] == [x2.data_ptr(), out.data_ptr(), stats.data_ptr(), fp8.data_ptr(), count.data_ptr()]
    # packed: the carved tail left in its block (returned last), zero fills done; unpack makes the same views
    assert plan.packs_from == 1
    launcher.clear()
    out, block = plan.replay((x2,), packed=True)
    block.fill_(7)  # (freed: the next block likely reuses this memory, which its zero fill must clear)
    del out, block
    launcher.clear()
    out, block = plan.replay((x2,), packed=True)
    views = plan.unpack(block)
    assert [(t.shape, t.stride(), t.dtype, t.data_ptr() - block.data_ptr()) for t in views] == [
        ((5, 3), (1, 5), torch.float32, 0), ((7, 9), (9, 1), torch.float8_e4m3fn, 256), ((5,), (1,), torch.int32, 512)]
    assert torch.equal(views[2], torch.zeros(5, dtype=torch.int32))
    (_, _, args), = launcher
    assert args[:5] == [x2.data_ptr(), out.data_ptr(), *[t.data_ptr() for t in views]]
    assert uncarved.packs_from is None


def test_zero_filled_scratch_is_zeroed_where_it_was_allocated(launcher):
    """A zero-filled scratch buffer sharing bytes with an earlier one is zeroed after that one's last launch."""
    from mxattn.runtime.launch_plan import record
    from mxattn.runtime.triton_launch import launch
    x = torch.randn(64)

    def body():
        a = torch.empty(4096, dtype=torch.uint8)
        launch(_fn("k", 2), (1,), x, a, BLOCK=1)
        del a
        b = torch.zeros(4096, dtype=torch.uint8)
        out = torch.zeros(16)
        launch(_fn("k", 3), (1,), x, b, out, BLOCK=1)
        return [out]

    _, plan, reason = record(body, (x,))
    assert reason == "recorded" and plan.workspace_bytes == 4096 and plan.launch_count == 2
    assert [entry is None for entry, *_ in plan._launches] == [False, True, False]
    out, = plan.replay((x,))
    assert torch.equal(out, torch.zeros(16))


def test_scratch_reuses_memory_of_finished_lifetimes(launcher):
    """A scratch buffer allocated after another's last use shares its bytes (peak as in the recorded run)."""
    from mxattn.runtime.launch_plan import record
    from mxattn.runtime.triton_launch import launch
    x = torch.randn(64)

    def body():
        a = torch.empty(4096, dtype=torch.uint8)
        launch(_fn("k", 2), (1,), x, a, BLOCK=1)
        b = torch.empty(4096, dtype=torch.uint8)
        launch(_fn("k", 2), (1,), x, b, BLOCK=1)
        out = torch.empty(4)
        launch(_fn("k", 2), (1,), x, out, BLOCK=1)
        return [out]

    _, plan, reason = record(body, (x,))
    assert reason == "recorded" and plan.workspace_bytes == 4096


@pytest.mark.parametrize("case, expected", [
    ("copy", "aten.clone"), ("foreign", "did not allocate"), ("no_launch", "launched no kernel"),
    ("output_is_root", "an output is"), ("fill", "aten.zero_")])
def test_recording_refuses_what_a_replay_cannot_repeat(launcher, case, expected):
    from mxattn.runtime.launch_plan import record
    from mxattn.runtime.triton_launch import launch
    x, foreign = torch.randn(8), torch.randn(8)

    def body():
        out = torch.empty(8)
        if case == "copy":
            launch(_fn("k", 2), (1,), x.clone(), out, BLOCK=1)
        elif case == "foreign":
            launch(_fn("k", 2), (1,), foreign, out, BLOCK=1)
        elif case == "output_is_root":
            launch(_fn("k", 2), (1,), x, out, BLOCK=1)
            return [x[2:]]
        elif case == "fill":
            out.zero_()
            launch(_fn("k", 2), (1,), x, out, BLOCK=1)
        return [out]

    outputs, plan, reason = record(body, (x,))
    assert plan is None and expected in reason and outputs[0] is not None


def test_launch_through_tritons_dispatcher_is_refused(launcher, monkeypatch):
    """With a launch hook installed (a profiler), launches take Triton's own path and nothing is recorded;
    a plan recorded earlier is not replayed while the hook is there."""
    from mxattn.runtime import launch_plan, triton_launch
    x = torch.randn(8)
    calls = []

    class Jit:  # what Triton's dispatcher is called through: fn[grid](*args, **kwargs)
        __name__, arg_names = "k", ["a0", "a1", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(a)

    fn = Jit()

    def body():
        out = torch.empty(8)
        triton_launch.launch(fn, (1,), x, out, BLOCK=1)
        return [out]

    _, plan, _ = launch_plan.record(body, (x,))
    assert plan is not None
    monkeypatch.setattr(triton_launch, "fast_path_usable", lambda: False)
    assert plan.replay((x,)) is None
    monkeypatch.setattr(triton_launch, "FAST_PATH", False)
    _, plan, reason = launch_plan.record(body, (x,))
    assert plan is None and "dispatcher" in reason and len(calls) == 1


def test_plan_cache_records_on_the_second_call_and_remembers_refusals(launcher):
    from mxattn.runtime.plan_cache import PlanCache
    from mxattn.runtime.triton_launch import launch
    cache, runs = PlanCache(max_entries=3), []
    x = torch.randn(8)

    def body(copy=False):
        runs.append(copy)
        out = torch.empty(8)
        launch(_fn("k", 2), (1,), x.clone() if copy else x, out, BLOCK=1)
        return [out]

    for _ in range(4):
        cache.run(("f", "a"), body, (x,))
    assert runs == [False, False] and cache.plan(("f", "a")) is not None  # ran, recorded, replayed twice
    for _ in range(3):
        cache.run(("f", "b"), lambda: body(True), (x,))
    assert runs[2:] == [True] * 3 and cache.plan(("f", "b")) is None  # refused at the second call
    cache.run(("f", "c"), body, (x,))
    cache.run(("f", "d"), body, (x,))  # a fourth key clears the bounded cache first
    assert cache.plan(("f", "a")) is None
    cache.run(None, body, (x,))
    assert runs[-1] is False and len(runs) == 8


def test_plan_cache_stops_recording_a_family_whose_plans_are_not_replayed(launcher):
    """Decode steps of a few layers: every KV length is called twice (two layers) and never again; after
    `min_replays` recordings without replays the family records no more (each recording costs a few calls)."""
    from mxattn.runtime.plan_cache import PlanCache
    from mxattn.runtime.triton_launch import launch
    cache, recorded = PlanCache(min_replays=2), []
    x = torch.randn(8)

    def body():
        out = torch.empty(8)
        launch(_fn("k", 2), (1,), x, out, BLOCK=1)
        return [out]

    for step in range(6):
        for _layer in range(2):
            cache.run(("decode", step), body, (x,))
        recorded.append(cache.plan(("decode", step)) is not None)
    assert recorded == [True, True, False, False, False, False]
    for _ in range(8):  # another family (training shapes) still records and replays
        cache.run(("train", 0), body, (x,))
    assert cache.plan(("train", 0)) is not None


def _stub_backend(monkeypatch, request, ops_replay: bool = False):
    """The triton backend on CPU tensors: CUDA checks relaxed, fresh plan caches; the ops' bodies and the
    whole calls without a backward recorded (`mxattn.op_plans`) when ops_replay, else only the backend's own
    launches. Returns (the backend module, the
    plan cache that records: op_plans.PLANS or the backend's)."""
    from mxattn import attention, checks, op_plans
    from mxattn.backends import pick_backend, triton_backend as backend_module
    from mxattn.kernels import triton_quantize as tq
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.plan_cache import PlanCache
    real = checks.check_bhsd_tensor
    for module in (checks, backend_module, tq):
        monkeypatch.setattr(module, "check_bhsd_tensor", lambda x, n, d, dev=None: real(x, n, d))
    monkeypatch.setattr(backend_module.TritonBackend, "availability", classmethod(lambda cls, d: (True, "stub")))
    monkeypatch.setattr(backend_module, "_PLANS", PlanCache())
    monkeypatch.setattr(backend_module, "_AFFINE_PLANS", AffinePlanCache())
    monkeypatch.setattr(op_plans, "PLANS", PlanCache(min_replays=16))
    monkeypatch.setattr(op_plans, "CALLS", PlanCache(min_replays=16))
    monkeypatch.setattr(op_plans, "CALLS_AFFINE", AffinePlanCache())
    monkeypatch.setattr(op_plans, "_REPLAYS", {"triton": ops_replay})
    monkeypatch.setattr(attention, "_PLANS", {})  # call plans remember whether their calls replay
    request.addfinalizer(pick_backend.cache_clear)
    return backend_module, op_plans.PLANS if ops_replay else backend_module._PLANS


def _assert_rebased(log1, log2, pairs) -> None:
    """Two launch logs of one signature made the same launches (kernel, grid, every non-pointer argument), and
    each pointer that lay in an input of the first call lies at the same offset of the matching input of the
    second (pairs: (first call's tensor, second call's)). A recording or an ordinary launch logs ("ptr",
    address), a replay the address itself."""
    assert len(log1) == len(log2)
    for (n1, g1, a1), (n2, g2, a2) in zip(log1, log2):
        assert (n1, g1, len(a1)) == (n2, g2, len(a2))
        for x1, x2 in zip(a1, a2):
            if not isinstance(x1, tuple):
                assert x1 == x2
                continue
            x1, x2 = x1[1], x2[1] if isinstance(x2, tuple) else x2
            for t1, t2 in pairs:
                off = x1 - t1.data_ptr()
                if 0 <= off < t1.untyped_storage().nbytes() - t1.storage_offset() * t1.element_size():
                    assert x2 == t2.data_ptr() + off


@pytest.mark.parametrize("ops_replay", [False, True], ids=["backend_plans", "op_plans"])
@pytest.mark.parametrize("layout", ["bshd", "unbind", "sbhd", "bhsd_views"])
def test_triton_backend_replays_its_ordinary_launches(launcher, monkeypatch, request, layout, ops_replay):
    """A second call of one signature replays the first call's launches: the same kernels, grids and
    non-pointer arguments, every input pointer at the same offset of the new inputs, O written where the
    returned O lies; the backward likewise (forward with grad, GQA, causal, window). Recorded at the level of
    the ops' bodies (`mxattn.op_plans`, what calls use) and of the backend alone."""
    import mxattn
    _, plans = _stub_backend(monkeypatch, request, ops_replay)

    def inputs():
        if layout == "unbind":
            qkv = torch.randn(2, 96, 3, 4, 64, dtype=torch.bfloat16)
            q, k, v = (t.requires_grad_() for t in (qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, :2]))
            return q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()
        if layout == "bhsd_views":  # torch SDPA's usual inputs: bhsd views of projections laid out bshd
            return [torch.randn(2, 96, h, 64, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                    for h in (4, 2, 2)]
        shape = (96, 2) if layout == "sbhd" else (2, 96)
        return [torch.randn(*shape, h, 64, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2)]

    fmt = {"sbhd": "sbhd", "bhsd_views": "bhsd"}.get(layout, "bshd")
    runs = []
    for _ in range(3):
        q, k, v = inputs()
        launcher.clear()
        o = mxattn.mxfp8_attention(q, k, v, qkv_format=fmt, attn_mask_type="causal", window_size=(40, 0),
                                   backend="triton")
        fwd = list(launcher)
        launcher.clear()
        o.backward(torch.ones_like(o))
        runs.append((q, k, v, o, fwd, list(launcher)))
    assert plans.last_reason == "recorded"
    (q1, k1, v1, o1, fwd1, bwd1), _, (q2, k2, v2, o2, fwd2, bwd2) = runs  # ordinary, recorded, replayed
    assert [n for n, _, _ in fwd2] == ["_quantize_qkv_kernel", "_attn_fwd_kernel"]
    assert [n for n, _, _ in bwd2] == ["_bwd_prep_kernel", "_dkdv_kernel", "_bwd_prep_kernel", "_dq_kernel"]
    _assert_rebased(fwd1 + bwd1, fwd2 + bwd2, ((q1, q2), (k1, k2), (v1, v2)))
    # the forward kernel's `out` (after q, q scale, k, k scale, v, v scale) is the O returned
    assert fwd2[1][2][6] == o2.data_ptr() and fwd1[1][2][6] == ("ptr", o1.data_ptr())
    if layout == "bhsd_views":  # O in q's layout, as torch SDPA returns it (no copy into dense bhsd)
        assert o2.stride() == q2.stride()


@pytest.mark.parametrize("ops_replay", [False, True], ids=["backend_plans", "op_plans"])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_backend_replays_variable_length_calls(launcher, monkeypatch, request, packed, grad, ops_replay):
    """Padded and packed batches are planned too: their lengths are roots (re-based like q, k, v), the
    longest sequences part of the key; a packed batch's zero-filled segmented scales are zeroed per replay.
    With a gradient the call quantizes then attends; without one its 64 query rows fit one tile, so the
    attention kernel quantizes as it reads (one launch, planned alike; its first call is recorded for an
    affine plan, so the signature's plan replays from the fourth call)."""
    import mxattn
    _, plans = _stub_backend(monkeypatch, request, ops_replay)
    logs = []
    for _ in range(3 if grad else 4):
        if packed:
            q, k, v = (torch.randn(104, 2, 64, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
        else:
            q, k, v = (torch.randn(2, 64, 2, 64, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
        cu = torch.tensor([0, 40, 104], dtype=torch.int32)
        launcher.clear()
        mxattn.mxfp8_attention(q, k, v, qkv_format="thd" if packed else "bshd", attn_mask_type="padding_causal",
                               cu_seqlens_q=cu, backend="triton", max_seqlen_q=64, max_seqlen_kv=64)
        logs.append((cu, list(launcher)))
    assert plans.last_reason == "recorded"
    (cu1, first), *_, (cu3, third) = logs
    kernels = ["_quantize_qkv_kernel", "_attn_fwd_kernel"] if grad else ["_attn_fwd_kernel"]
    assert [n for n, _, _ in first] == [n for n, _, _ in third] == kernels
    attn1, attn3 = first[-1][2], third[-1][2]
    cu_arg = 8  # q, q scale, k, k scale, v, v scale, out, stats, then cu_seqlens_q
    assert attn1[cu_arg] == ("ptr", cu1.data_ptr()) and attn3[cu_arg] == cu3.data_ptr()


@pytest.mark.parametrize("case", ["bshd", "unbind", "sbhd_fp32_out", "off_by_one", "bhsd_views"])
def test_calls_without_a_backward_replay_their_whole_body(launcher, monkeypatch, request, case):
    """An eager dense call without a backward (a prefill, no grad) is recorded whole on its signature's second
    call (`op_plans.run_call`: the caller's own q, k, v as roots) and replayed from its third: the launches the
    body makes (kernels, grids, every non-pointer argument, each input pointer at the same offset of the new
    inputs, O written where the returned O lies), O in the caller's layout. A call whose body computes with
    torch (O cast to fp32) is refused and keeps its ordinary path."""
    import mxattn
    from mxattn import op_plans
    _stub_backend(monkeypatch, request, ops_replay=True)
    fmt = "sbhd" if case.startswith("sbhd") else "bhsd" if case == "bhsd_views" else "bshd"
    opts = dict(qkv_format=fmt, attn_mask_type="causal", backend="triton")
    if case == "sbhd_fp32_out":
        opts["out_dtype"] = torch.float32
    if case == "off_by_one":
        opts["softmax_type"] = "off-by-one"

    def inputs():
        if case == "unbind":
            qkv = torch.randn(2, 300, 3, 4, 64, dtype=torch.bfloat16)
            return qkv.unbind(2)
        if case == "bhsd_views":
            return [torch.randn(2, 300, 4, 64, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
        shape = (300, 2) if fmt == "sbhd" else (2, 300)
        return [torch.randn(*shape, 4, 64, dtype=torch.bfloat16) for _ in range(3)]

    runs = []
    with torch.no_grad():
        for _ in range(3):
            q, k, v = inputs()
            launcher.clear()
            o = mxattn.mxfp8_attention(q, k, v, **opts)
            runs.append((q, k, v, o, list(launcher)))
    expected = "refused" if case == "sbhd_fp32_out" else "recorded"
    assert op_plans.CALLS.last_reason.split(":")[0].startswith("the body ran") == (expected == "refused")
    (q1, k1, v1, o1, log1), _, (q2, k2, v2, o2, log2) = runs
    assert o2.shape == q2.shape and o2.stride() == o1.stride()
    assert o2.dtype == (torch.float32 if case == "sbhd_fp32_out" else torch.bfloat16)
    assert [n for n, _, _ in log1] == [n for n, _, _ in log2] == ["_quantize_qkv_kernel", "_attn_fwd_kernel"]
    replayed = all(not isinstance(a, tuple) for _, _, args in log2 for a in args)
    assert replayed == (expected == "recorded")  # (a replay passes addresses as ints, the ordinary path tensors)
    _assert_rebased(log1, log2, ((q1, q2), (k1, k2), (v1, v2)))
    if expected == "recorded":  # the attention kernel's `out` is the O returned
        assert log2[1][2][6] == o2.data_ptr() and log1[1][2][6] == ("ptr", o1.data_ptr())


@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "saved_tensor_hooks"])
def test_the_eager_backward_is_keyed_on_its_forwards_plan(launcher, monkeypatch, request, hooks):
    """An eager backward whose kept tensors are the forward's own (at the addresses its forward returned) finds
    its plan from the forward's plan and dO's layout alone; when a saved-tensor hook hands back copies (activation
    offloading), every root is keyed as before. Either way the replayed backward launches what the first made,
    each pointer into the tensors the backward was given."""
    import mxattn
    from mxattn import op_plans
    _stub_backend(monkeypatch, request, ops_replay=True)
    unpacked = []

    def unpack(t):
        unpacked.append(t)
        return t

    def call():
        q, k, v = (torch.randn(2, 96, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        if hooks:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), unpack):
                o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
        else:
            o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
        launcher.clear()
        unpacked.clear()
        o.backward(torch.ones_like(o))
        return list(launcher), list(unpacked)

    runs = [call() for _ in range(4)]
    kinds = {key[0][0] for key in op_plans.PLANS._plans}
    assert ("bwd after" in kinds) != hooks  # (the first call's backward, before the forward had a plan: "bwd")
    # the eager forward's stats and saved copies are carved from one allocation: O, that block, the workspace
    fwd_plans = [p for key, p in op_plans.PLANS._plans.items() if key[0][0] == "fwd" and hasattr(p, "replay")]
    assert [p.allocations_per_replay for p in fwd_plans] == [3]
    (first, _), (last, kept) = runs[0], runs[-1]
    assert [(n, g) for n, g, _ in first] == [(n, g) for n, g, _ in last]
    assert all(not isinstance(a, tuple) for _, _, args in last for a in args)  # replayed
    if hooks:  # the kernels read the copies the hook handed back
        starts = {t.data_ptr() for t in kept}
        read = {a for _, _, args in last for a in args if isinstance(a, int) and a in starts}
        assert len(read) >= 8


def test_a_packed_forwards_backward_reads_the_copies_its_forward_wrote(launcher, monkeypatch, request):
    """An eager forward that replays keeps stats and the saved copies packed in their one allocation (two saved
    tensors: O and that block); its backward, replayed from the block's address alone, launches what the
    ordinary backward of an unpacked forward launched, each pointer at the same offset of the matching saved
    tensor, and those lie where the forward's own launches wrote. Under saved-tensor hooks nothing is packed."""
    import mxattn
    from mxattn import op_plans
    _stub_backend(monkeypatch, request, ops_replay=True)
    runs = []
    for i in range(5):
        q, k, v = (torch.randn(2, 96, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        launcher.clear()
        if i == 4:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
        else:
            o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
        fwd_log, kept = list(launcher), o.grad_fn.saved_tensors  # (the attention's node: no layout nodes)
        do = torch.randn_like(o)
        launcher.clear()
        o.backward(do)
        runs.append((q, k, v, o, do, kept, fwd_log, list(launcher)))
    assert [len(r[5]) for r in runs] == [12, 12, 2, 2, 12]  # O and the block when packed, else O, stats, 10 copies
    plan = op_plans.PLANS.plan(next(key for key in op_plans.PLANS._plans if key[0][0] == "fwd"))
    (q2, k2, v2, o2, do2, kept2, _, bwd2), (q4, k4, v4, o4, do4, (_, block), fwd4, bwd4) = runs[1], runs[3]
    unpacked = plan.unpack(block)
    assert all(not isinstance(a, tuple) for _, _, args in bwd4 for a in args)  # replayed
    written = {a for _, _, args in fwd4 for a in args if isinstance(a, int)}
    assert {t.data_ptr() for t in unpacked} <= written
    _assert_rebased(bwd2, bwd4, list(zip((q2, k2, v2, o2, do2, *kept2[1:]), (q4, k4, v4, o4, do4, *unpacked))))
    assert [(n, g) for n, g, _ in runs[4][7]] == [(n, g) for n, g, _ in bwd2]


def test_checkpointed_layers_of_one_signature_recompute_what_they_saved(launcher, monkeypatch, request):
    """Non-reentrant activation checkpointing matches the tensors a recomputation saves to the first forward's:
    layers of one signature (the first unrecorded, the second recording, later ones replayed) run under it,
    their recomputations in the backward replayed, and every gradient arrives."""
    import torch.utils.checkpoint as cp

    import mxattn
    _stub_backend(monkeypatch, request, ops_replay=True)
    q, k, v = (torch.randn(2, 96, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    attend = lambda q, k, v: mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")  # noqa
    for _ in range(2):
        o = sum(cp.checkpoint(attend, q * (i + 1), k, v, use_reentrant=False) for i in range(4))
        o.backward(torch.ones_like(o))
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_aliasing_of_roots_is_part_of_the_key():
    from mxattn.runtime.launch_plan import alias_key
    qkv = torch.randn(2, 8, 3, 4)
    q, k, v = qkv.unbind(2)
    a, b = torch.randn(2, 8, 4), torch.randn(2, 8, 4)
    assert alias_key((q, k, v, None)) == (None, (0, 16), (0, 32), None)
    assert alias_key((a, b, b)) == (None, None, (1, 0))
    assert alias_key((a, b, a.clone())) == (None, None, None)


def test_plan_caches_inside_a_recorded_body_run_their_bodies(launcher):
    """A plan cache called inside a recorded body runs the body itself (a nested replay would launch past the
    recorder, and the outer plan would miss those launches): the outer plan then holds every launch."""
    from mxattn.runtime.launch_plan import LaunchPlan, record, recording_active
    from mxattn.runtime.plan_cache import PlanCache
    from mxattn.runtime.triton_launch import launch
    inner = PlanCache()
    x = torch.randn(4, 8)
    seen = []

    def inner_body():
        seen.append(recording_active())
        out = torch.empty_like(x)
        launch(_fn("inner", 2), (1,), x, out, BLOCK=8)
        return [out]

    for _ in range(3):  # the inner cache has a plan for this key now
        inner.run("key", inner_body, (x,))
    assert isinstance(inner.plan("key"), LaunchPlan)
    seen.clear()
    _, outer, reason = record(lambda: inner.run("key", inner_body, (x,)), (x,))
    assert reason == "recorded" and seen == [True] and outer.launch_count == 1
    assert not recording_active()


def test_op_bodies_are_recorded_only_for_backends_that_launch_through_triton_launch():
    """`op_plans` records the ops' bodies on the triton backend and on the cudnn backend (whose graph executions
    are reported to recordings as host calls, `mxattn.runtime.host_calls`), never on the reference backend:
    its torch arithmetic would not be in a replay."""
    from mxattn import op_plans
    assert op_plans.replays("triton") is True
    assert op_plans.replays("reference") is False
    assert op_plans.replays("cudnn") is True


def _fused_projection_args():
    """(q, k, v, the forward op's FwdArgs): bshd views of one fused projection (GPT-2's), causal, triton."""
    from mxattn.mask import MaskSpec
    from mxattn.op_args import FwdArgs
    x = torch.randn(2, 96, 3 * 4 * 64, dtype=torch.bfloat16)
    q, k, v = (t.view(2, 96, 4, 64).permute(0, 2, 1, 3) for t in x.split(4 * 64, dim=2))
    return q, k, v, FwdArgs.encode(q, k, v, softmax_scale=0.125, mask=MaskSpec(causal=True),
                                   out_dtype=torch.bfloat16, qkv_format="bshd", backend="triton", seq=None,
                                   sink=None)


def test_the_compiled_graphs_forward_op_replays_its_body(launcher, monkeypatch, request):
    """`mxattn::attention_fwd` (what a compiled graph calls) is recorded once per signature with its layout
    promise (`_as_faked`) inside and replayed after: the same launches, outputs laid out as the fake kernel
    promises."""
    from mxattn import ops
    _, plans = _stub_backend(monkeypatch, request, ops_replay=True)
    runs = []
    for _ in range(3):
        q, k, v, args = _fused_projection_args()
        launcher.clear()
        outputs = ops.attention_fwd(*args)
        fakes = ops._fwd_fake(*args)
        runs.append(([n for n, _, _ in launcher], outputs, fakes))
    assert plans.last_reason == "recorded"
    assert runs[0][0] == runs[2][0] == ["_quantize_qkv_kernel", "_attn_fwd_kernel"]
    for _, outputs, fakes in runs:
        assert [(t.shape, t.stride(), t.dtype) for t in outputs] == [(t.shape, t.stride(), t.dtype) for t in fakes]
        # a custom op's returns must not share storage (torch warns, and will refuse): no carving for ops
        assert len({t.untyped_storage().data_ptr() for t in outputs}) == len(outputs)
    o, stats, *saved = runs[2][1]
    grads = [ops.attention_bwd(*args.backward_args(torch.randn_like(o), o, stats, saved, list(k.shape), False))
             for _ in range(3)]
    assert all(len({t.untyped_storage().data_ptr() for t in g[:3]}) == 3 for g in grads)


def test_the_compiled_graphs_packed_ops_replay_and_hand_the_block_over(launcher, monkeypatch, request):
    """`mxattn::attention_fwd_packed` / `attention_bwd_packed` (what a compiled graph calls on the triton backend):
    from the third call the forward's replay leaves stats and the saved copies in the block as the op's layout
    says (no copy), and the backward replays onto the block's addresses: the same launches as the unpacked ops,
    every pointer into the kept tensors at its place in the block."""
    from mxattn import ops
    from mxattn.runtime import saved_block
    from mxattn.mask import MaskSpec
    from mxattn.op_args import FwdArgs
    _, plans = _stub_backend(monkeypatch, request, ops_replay=True)
    copies = []
    real_pack = saved_block.pack
    monkeypatch.setattr(saved_block, "pack", lambda tensors, layout: copies.append(1) or real_pack(tensors, layout))
    runs = []
    for _ in range(4):
        q, k, v, args = _fused_projection_args()
        launcher.clear()
        copies.clear()
        o, block = ops.attention_fwd_packed(*args)
        fwd = list(launcher)
        fake_o, fake_block = ops._fwd_packed_fake(*args)
        assert (o.shape, o.stride(), block.shape, block.dtype) == (fake_o.shape, fake_o.stride(), fake_block.shape,
                                                                  fake_block.dtype)
        _, layout = ops._block_layout(args)
        do = torch.randn_like(o)
        launcher.clear()
        grads = ops.attention_bwd_packed(*args.packed_backward_args(do, o, block, list(k.shape),
                                                                    q.dtype, False, (None, None), None))
        runs.append((q, k, v, o, block, layout, fwd, list(launcher), len(copies), grads))
    assert [r[8] for r in runs] == [1, 1, 0, 0]  # copied while unplanned or recording, then handed over
    assert [n for n, _, _ in runs[3][6]] == ["_quantize_qkv_kernel", "_attn_fwd_kernel"]
    assert [n for n, _, _ in runs[3][7]] == ["_bwd_prep_kernel", "_dkdv_kernel", "_bwd_prep_kernel", "_dq_kernel"]
    q1, k1, v1, o1, block1, layout, fwd1, bwd1 = runs[0][:8]
    q2, k2, v2, o2, block2, _, fwd2, bwd2 = runs[3][:8]
    # the first call's kept tensors were separate allocations copied into its block: compare their places there
    # through the unpacked views of both blocks
    kept1, kept2 = saved_block.unpack(block1, layout), saved_block.unpack(block2, layout)
    _assert_rebased(fwd1[:1], fwd2[:1], ((q1, q2), (k1, k2), (v1, v2)))
    pointers2 = [a for _, _, args in bwd2 for a in args if isinstance(a, int) and a > 4096]
    starts = {t.data_ptr() for t in kept2}
    assert starts <= set(pointers2) | {kept2[0].data_ptr()}  # every kept tensor is read by the backward
    # the fourth call's backward equals the unpacked op's on the same kept tensors
    launcher.clear()
    stats, *saved = kept2
    args2 = FwdArgs.encode(q2, k2, v2, softmax_scale=0.125, mask=MaskSpec(causal=True), out_dtype=torch.bfloat16,
                           qkv_format="bshd", backend="triton", seq=None, sink=None)
    ops.attention_bwd(*args2.backward_args(torch.randn_like(o2), o2, stats, saved, list(k2.shape), False))
    unpacked = [(n, g, [a[1] if isinstance(a, tuple) else a for a in args]) for n, g, args in launcher]
    kept_ptrs = lambda log: [a for _, _, args in log for a in args if any(  # noqa: E731
        t.data_ptr() <= a < t.data_ptr() + t.numel() * t.element_size() for t in kept2) and isinstance(a, int)]
    assert kept_ptrs(unpacked) == kept_ptrs(bwd2)
    from mxattn.runtime.launch_plan import LaunchPlan
    assert [type(p) for k, p in plans._plans.items() if k[0][0] in ("fwd", "bwd block")] == [LaunchPlan] * 2


@pytest.mark.parametrize("sink", [False, True])
def test_paged_cache_steps_replay_their_launches(launcher, paged_stubs, sink):
    """Decode steps of `mxattn.mxfp8_attention_with_kvcache` (triton) on three caches of one geometry (a model's
    layers): the first step of a signature runs the launchers, the second records, later ones replay
    (`mxattn.runtime.paged_step`): the same kernels (the append, the split passes, the combine), grids and
    non-pointer arguments, every pointer into the step's q, k, v, offsets and the cache's own storage rebased
    onto the replaying call's, O written where the returned O lies."""
    import mxattn
    from mxattn import kvcache
    from mxattn.runtime import paged_step
    hq, hkv, d, n = 8, 2, 64, 3
    caches = [mxattn.MXFP8KVCache(num_pages=24, page_size=64, kv_heads=hkv, head_dim=d, max_sequences=n)
              for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    for c in caches:
        c._append_kernel = True
        for i in range(n):      # 300 tokens each (the stubs write nothing: only the host's bookkeeping counts)
            c.append(c.new_sequence(), *(torch.randn(300, hkv, d, generator=g, dtype=torch.bfloat16)
                                         for _ in range(2)))
    extra = {}
    if sink:
        extra = dict(softmax_type="learnable", softmax_offset=torch.randn(hq, generator=g))
    runs = []
    for c in caches:
        q = torch.randn(n, hq, d, generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(n, hkv, d, generator=g, dtype=torch.bfloat16) for _ in range(2))
        launcher.clear()
        o = mxattn.mxfp8_attention_with_kvcache(q, c, [0, 1, 2], cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                                                k_new=k, v_new=v, backend="triton", **extra)
        meta = kvcache._DEVICE_INTS[((0, 1, 2, 3, 0, 1, 2, 300, 300, 300), torch.device("cpu"))]
        runs.append((c, q, k, v, meta, o, list(launcher)))
        assert [c.length(s) for s in range(n)] == [301] * n
    assert paged_step.STEPS.last_reason == "recorded"
    (c1, q1, k1, v1, m1, o1, log1), _, (c3, q3, k3, v3, m3, o3, log3) = runs
    assert [name for name, _, _ in log3] == ["_paged_append_kernel", "_paged_attn_kernel", "_paged_attn_kernel",
                                             "_combine_splits_kernel"]
    assert m1 is m3        # one copy of the step's offsets serves every layer
    _assert_rebased(log1, log3, [(q1, q3), (k1, k3), (v1, v3), (m1, m3)] + list(zip(c1.storage, c3.storage)))
    assert log3[-1][2][0] == o3.data_ptr() and log1[-1][2][0] == ("ptr", o1.data_ptr())


def test_one_paged_step_serves_every_cache_in_the_same_state(launcher, paged_stubs):
    """A decode step worked out on one layer's cache (`mxattn.kvcache_step.PagedStep`: checks, new pages, lengths,
    split count) runs on the other layers' caches, made and filled alike: the same launches as each cache's own
    public call (pointers rebased onto its q, k, v and storage), the same pages taken (here each sequence's next
    page), equal states after. A cache in another state is refused before anything changes."""
    import mxattn
    from mxattn import kvcache_step
    from mxattn.runtime import paged_step
    hq, hkv, d, n = 8, 2, 64, 3
    g = torch.Generator().manual_seed(1)

    def filled(tokens=320):   # 320 tokens: five full pages, the next token takes a new one
        c = mxattn.MXFP8KVCache(num_pages=24, page_size=64, kv_heads=hkv, head_dim=d, max_sequences=n)
        c._append_kernel = True
        for _ in range(n):
            c.append(c.new_sequence(), *(torch.randn(tokens, hkv, d, generator=g, dtype=torch.bfloat16)
                                         for _ in range(2)))
        return c

    caches = [filled() for _ in range(4)]
    assert len({c.state for c in caches}) == 1
    other = filled(319)
    assert other.state != caches[0].state
    cu = torch.arange(n + 1, dtype=torch.int32)

    def inputs():
        return (torch.randn(n, hq, d, generator=g, dtype=torch.bfloat16),
                *(torch.randn(n, hkv, d, generator=g, dtype=torch.bfloat16) for _ in range(2)))

    logs = []
    for c in caches[:3]:      # the public call on each cache records, then replays, the step's launches
        q, k, v = inputs()
        launcher.clear()
        mxattn.mxfp8_attention_with_kvcache(q, c, [0, 1, 2], cu_seqlens_q=cu, k_new=k, v_new=v, backend="triton")
        logs.append((list(launcher), [q, k, v] + list(c.storage)))
    assert paged_step.STEPS.last_reason == "recorded"
    twins = [filled() for _ in range(3)]
    q, k, v = inputs()
    o, step = mxattn.mxfp8_attention_with_kvcache(q, twins[0], [0, 1, 2], cu_seqlens_q=cu, k_new=k, v_new=v,
                                                  backend="triton", return_step=True)
    assert isinstance(step, kvcache_step.PagedStep) and step.before == twins[1].state != twins[0].state == caches[0].state
    for t in twins[1:]:
        q2, k2, v2 = inputs()
        launcher.clear()
        o2 = step.run(t, q2, k2, v2)
        recorded, tensors = logs[1]    # (a recording logs its pointers as ("ptr", address))
        _assert_rebased(recorded, list(launcher), list(zip(tensors, [q2, k2, v2] + list(t.storage))))
        assert o2.shape == (n, hq, d) and launcher[-1][2][0] == o2.data_ptr()
        assert t.state == twins[0].state == caches[0].state
        assert torch.equal(t.page_table, twins[0].page_table) and t._pages == twins[0]._pages
        assert [t.length(s) for s in range(n)] == [321] * n
    assert [len(p) for p in twins[0]._pages] == [6] * n
    before, lens = other.state, list(other._lens)
    with pytest.raises(RuntimeError, match="not in the state"):
        step.run(other, q, k, v)
    with pytest.raises(ValueError, match="q must be"):
        step.run(other, q[:2], k, v)
    with pytest.raises(ValueError, match="k_new and v_new"):
        step.run(other, q)
    with pytest.raises(ValueError, match="k_new and v_new"):
        step.run(other, q, k.float(), v)
    assert other.state == before and other._lens == lens


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padded"])
def test_hf_paged_cache_works_out_each_decode_step_once_for_all_layers(launcher, paged_stubs, hf_triton_steps,
                                                                      padded):
    """transformers' decode steps over `MXFP8PagedCache` (4 layers, two with a sliding window; no mask, or the
    left-padded masks generate builds: one per kind of layer and step): the first layer of each kind works the step
    out (`PagedStep`), the others run it; every layer's cache ends in the same state, with the same lengths, as
    when each layer works its own step out."""
    from mxattn.integrations.hf_cache import MXFP8PagedCache
    from transformers import AttentionInterface
    name, planned = hf_triton_steps
    fn = AttentionInterface._global_mapping[name]
    module = torch.nn.Module()
    module.is_causal = True
    module.config = SimpleNamespace(_attn_implementation=name)
    b, hq, hkv, d, layers = 3, 4, 2, 32, 4
    windows = [None, 40, None, 40]
    g = torch.Generator().manual_seed(3)

    first = torch.tensor([0, 10, 5] if padded else [0, 0, 0])     # each row's first real position

    def mask(positions: int, sq: int, window):   # transformers' boolean mask [B, 1, Sq, positions]
        kpos = torch.arange(positions).view(1, 1, -1)
        qpos = (positions - sq + torch.arange(sq)).view(1, sq, 1)
        m = (kpos <= qpos) & (kpos >= first.view(b, 1, 1)) & (qpos >= first.view(b, 1, 1))
        return (m if window is None else m & (qpos - kpos < window)).unsqueeze(1)

    def run(share: bool, steps: int = 6):
        planned.clear()
        cache = MXFP8PagedCache(max_cache_len=128, page_size=32)
        for step in range(steps):
            s = 30 if step == 0 else 1
            masks = {w: mask(30 + step, s, w) if padded else None for w in set(windows)}
            for layer in range(layers):
                q = torch.randn(b, hq, s, d, generator=g, dtype=torch.bfloat16)
                k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.bfloat16) for _ in range(2))
                k, v = cache.update(k, v, layer)
                cache.layers[layer].store._append_kernel = True
                if not share:
                    cache.layers[layer].steps = {}
                out, _ = fn(module, q, k, v, masks[windows[layer]], scaling=d ** -0.5,
                            sliding_window=windows[layer])
                assert out.shape == (b, s, hq, d)
        return cache, len(planned)

    shared, n_shared = run(True)
    alone, n_alone = run(False)
    assert n_alone == 6 * layers and n_shared == 6 * 2      # one per step and window
    for a, c in zip(alone.layers, shared.layers):
        assert c.store.state == a.store.state == shared.layers[0].store.state
        assert [c.store.length(s) for s in c.slots] == (35 - first).tolist()


@pytest.mark.slow
def test_generate_of_a_config_built_llama_plans_each_decode_step_once(launcher, paged_stubs, hf_triton_steps):
    """The user's road with the triton path's launches stubbed: a Llama built from a config, a left-padded batch,
    `generate` over `MXFP8PagedCache`, eager and under torch.compile(model): one `PagedStep` per step for all four
    layers, every layer's cache in one state holding each row's real tokens."""
    from mxattn.integrations.hf_cache import MXFP8PagedCache, cache_kwargs
    from transformers import LlamaConfig, LlamaForCausalLM
    name, planned = hf_triton_steps
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = name
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).bfloat16().eval()
    ids = torch.randint(3, 96, (3, 20))
    am = (torch.arange(20).unsqueeze(0) >= torch.tensor([[0], [7], [12]])).long()
    for m in (model, torch.compile(model)):
        planned.clear()
        cache = MXFP8PagedCache(max_cache_len=64, page_size=32)
        with torch.no_grad():
            out = m.generate(ids * am, attention_mask=am, **cache_kwargs(cache), max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.shape == (3, 26) and len(planned) == 6      # prefill + 5 decode steps, 4 layers each
        assert len({layer.store.state for layer in cache.layers}) == 1
        assert [cache.layers[3].store.length(s) for s in cache.layers[3].slots] == [25, 18, 13]


def _address(a):
    """The device address a logged launch argument names: a tensor's ("ptr", address), a replayed address, or a
    TMA descriptor's base (a tensor or a replay's re-based address)."""
    if isinstance(a, tuple):
        return a[1]
    if hasattr(a, "base"):
        return a.base.data_ptr()
    return a


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("ops_replay", [False, True], ids=["backend_plans", "op_plans"])
def test_a_body_that_runs_the_gluon_forward_replays_with_rebased_descriptors(launcher, monkeypatch, request,
                                                                             ops_replay, grad):
    """The Gluon forward launches through `triton_launch.launch` with host TMA descriptors of K's and V's FP8
    bytes; a recording keeps each descriptor's tensor place (the quantizer's outputs here) and shape, strides and
    padding, so replays launch the Gluon kernel with descriptors on the new call's bytes: in every call, the
    forward reads exactly the K and V bytes the quantizer launch of that call wrote, and Q's."""
    pytest.importorskip("triton.experimental.gluon")
    import mxattn
    from mxattn.kernels import gluon_attention_fwd, triton_attention_bwd as tb, triton_attention_fwd as tf
    from mxattn.runtime.launch_plan import ReplayedDescriptor
    backend_module, plans = _stub_backend(monkeypatch, request, ops_replay)
    monkeypatch.setattr(tf, "fwd_streams_bf16", lambda *a: False)  # the FP8 data path, plans left on
    monkeypatch.setattr(tb, "bwd_streams_bf16", lambda *a: False)
    monkeypatch.setattr(backend_module, "_gluon_forward", lambda device: gluon_attention_fwd)
    reasons, kinds = [], []
    for i in range(5):
        q = torch.randn(2, 96, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 96, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        launcher.clear()
        with torch.set_grad_enabled(grad):
            o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
        reasons.append(plans.last_reason)
        names = [n for n, _, _ in launcher]
        assert names == ["_quantize_qkv_kernel", "_gluon_attn_fwd_kernel"], names
        (_, _, qargs), (_, grid, gargs) = launcher
        written = {_address(a) for a in qargs}  # every address the quantizer launch read or wrote
        k_desc, v_desc = gargs[2], gargs[4]
        kinds.append(type(k_desc).__name__)
        for d in (k_desc, v_desc):
            assert _address(d) in written and list(d.strides)[-1] == 1
        assert _address(gargs[0]) in written  # Q's FP8 bytes
        assert _address(gargs[6]) == o.data_ptr()  # O
        assert list(k_desc.shape) == [2, 2, 96, 64] and grid[1] == 2 * 4
        if grad:
            o.backward(torch.ones_like(o))  # the backward's own plans are unaffected
    assert reasons[1] == "recorded" or not grad  # (no grad: the whole call's plan, `op_plans.CALLS`)
    assert kinds[:2] == ["TensorDescriptor"] * 2 and kinds[2:] == [ReplayedDescriptor.__name__] * 3


def _descriptor(t, block):
    from mxattn.kernels import gluon_attention_fwd as gf
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gf.tma_layouts(t.shape[3])[0]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def test_launch_keys_host_tma_descriptors_by_all_but_their_address():
    """`triton_launch._args_key` of a Gluon TensorDescriptor: hashable; equal for another tensor of the same
    shape, strides, dtype and alignment class; different for another shape or block."""
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.runtime.triton_launch import _args_key
    a, b = (torch.zeros(1, 2, 256, 128, dtype=torch.float8_e4m3fn) for _ in range(2))
    c = torch.zeros(1, 2, 384, 128, dtype=torch.float8_e4m3fn)
    ka, kb, kc = (_args_key([_descriptor(t, [1, 1, 128, 128]), 7]) for t in (a, b, c))
    assert hash(ka) == hash(kb) and ka == kb and ka != kc
    assert _args_key([_descriptor(a, [1, 1, 64, 128])]) != _args_key([_descriptor(a, [1, 1, 128, 128])])


def test_a_replay_rebases_host_tma_descriptors(launcher):
    """A descriptor argument is recorded as its tensor's place (a root or the body's allocation) with its shape,
    strides and padding, and replayed as a `ReplayedDescriptor` on the new address; an argument of any other
    object type is refused."""
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.runtime import launch_plan
    from mxattn.runtime.triton_launch import launch
    fn = _fn("_desc_kernel", 3)
    k = torch.zeros(1, 2, 256, 128, dtype=torch.float8_e4m3fn)

    def body(root, extra=None):
        out = torch.empty(4)
        scratch = torch.empty(1, 2, 128, 256, dtype=torch.float8_e4m3fn)
        launch(fn, (1,), _descriptor(root[:, :, 64:], [1, 1, 128, 128]), _descriptor(scratch, [1, 1, 128, 128]),
               out if extra is None else extra, BLOCK=1)
        return [out]

    _, plan, reason = launch_plan.record(lambda: body(k), [k])
    assert reason == "recorded"
    launcher.clear()
    k2 = torch.zeros(1, 2, 256, 128, dtype=torch.float8_e4m3fn)
    (out2,) = plan.replay([k2])
    (_, _, args), = launcher
    d_root, d_scratch, o_ptr = args[:3]
    assert isinstance(d_root, launch_plan.ReplayedDescriptor)
    assert d_root.base.data_ptr() == k2.data_ptr() + 64 * 128 and o_ptr == out2.data_ptr()
    assert d_root.shape == [1, 2, 192, 128] and d_root.strides == list(k2.stride()) and d_root.padding == "zero"
    assert d_scratch.shape == [1, 2, 128, 256]  # the body's scratch: a replay's workspace
    assert d_scratch.base.data_ptr() not in (k2.data_ptr(), out2.data_ptr(), d_root.base.data_ptr())

    _, plan, reason = launch_plan.record(lambda: body(k, extra=object()), [k])
    assert plan is None and "neither a tensor, a host TMA descriptor nor a plain value" in reason


def test_the_gluon_forward_launches_its_compiled_kernel_directly_after_the_first_call(launcher, monkeypatch):
    """`attention_fwd_gluon` goes through `triton_launch.launch`: Triton's dispatcher on a signature's first call,
    then the cached compiled kernel, called with new descriptors of the new call's K and V (the launcher encodes
    them per launch), the new Q/O/stats addresses, and the same constexprs."""
    pytest.importorskip("triton.experimental.gluon")
    from mxattn.kernels import gluon_attention_fwd as gf
    from mxattn.kernels.triton_quantize import SeqMajorColumns
    f8 = torch.float8_e4m3fn

    def call():
        q, k = (torch.zeros(1, 2, 256, 128, dtype=f8) for _ in range(2))
        s = torch.zeros(1, 2, 256, 4, dtype=torch.uint8)
        v = SeqMajorColumns(torch.zeros(1, 2, 128, 256, dtype=f8), torch.zeros(1, 2, 8, 128, dtype=torch.uint8))
        out = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
        st = torch.empty(1, 2, 256, 1)
        gf.attention_fwd_gluon(q, s, k, s, v, softmax_scale=0.1, offset=0, left_bound=None, right_bound=0,
                               out=out, stats=st)
        return q, k, v, out

    from mxattn.runtime import triton_launch
    dispatched, first_launch = [], triton_launch.first_launch
    monkeypatch.setattr(triton_launch, "first_launch", lambda *a: dispatched.append(1) or first_launch(*a))
    first, second = call(), call()
    assert len(dispatched) == 1  # the second call hit the launch cache (its key leaves the addresses out)
    assert len(launcher) == 2 and launcher[0][0] == launcher[1][0] == "_gluon_attn_fwd_kernel"
    (_, grid1, args1), (_, grid2, args2) = launcher
    assert grid1 == grid2 == (2, 2, 1)
    # the dispatcher's run (first call) and the direct launch (second) pass the descriptors as objects
    k_desc, v_desc = args2[2], args2[4]
    assert k_desc.base is second[1] and v_desc.base is second[2].data
    assert args2[0] == second[0].data_ptr() or args2[0] == ("ptr", second[0].data_ptr())
    assert args2[6] in (second[3].data_ptr(), ("ptr", second[3].data_ptr()))
    assert [a for a in args1 if not isinstance(a, tuple) and not hasattr(a, "block_shape")] == \
        [a for a in args2 if not isinstance(a, tuple) and not hasattr(a, "block_shape")]
