"""Affine launch plans (mxattn.runtime.affine_plan) on the CPU: one plan replays a body at every length n once
three recordings agree with an affine fit; a replay launches what the body would have launched at that n; a
body that is not affine, or roots that are not the predicted ones, never replay. Triton's dispatcher and the
compiled kernels' launcher are stubbed as in test_launch_plan (no GPU)."""

import importlib.util

import pytest
import torch

from test_launch_plan import _fn, _stub_backend, launcher  # noqa: F401 -- the fixture

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")


def _affine_body(x, grid_of=lambda n: (4,)):
    """A body whose launch reads x [n, 64] (its length, a stride-derived size, a diagonal offset n - 1)."""
    from mxattn.runtime.triton_launch import launch

    def body():
        n = x.shape[0]
        out = torch.empty(n, 64)
        stats = torch.empty(3)
        launch(_fn("k", 7), grid_of(n), x, out, stats, n, n * 64, n - 1, 0.25, BLOCK=32)
        return [out, stats]
    return body


def _run(cache, n, grid_of=lambda n: (4,), base=None):
    base = torch.randn(n, 64) if base is None else base
    x = base[:n]
    out = cache.run(("f",), n, _affine_body(x, grid_of), (x,))
    return x, out


def test_trusted_after_three_lengths_then_replays_what_the_body_launches(launcher):
    from mxattn.runtime.affine_plan import AffinePlanCache
    cache = AffinePlanCache()
    base = torch.randn(200, 64)
    for i, n in enumerate((40, 41, 42)):
        _run(cache, n, base=base)
        assert cache.last_reason == ("trusted" if i == 2 else f"observing ({i + 1} of 3 lengths)")
    for n in (43, 57, 100, 113):   # 100 is no multiple of 16 but 64 * 100 and 99 change no class; 113 - 1 = 112 does
        launcher.clear()
        x, (out, stats) = _run(cache, n, base=base)
        replayed = list(launcher)
        launcher.clear()
        _affine_body(x)()
        ordinary = list(launcher)
        assert len(replayed) == len(ordinary) == 1
        (name, grid, args), (_, grid0, args0) = replayed[0], ordinary[0]
        assert grid == grid0 == (4, 1, 1) and out.shape == (n, 64) and stats.shape == (3,)
        addresses = [a[1] if isinstance(a, tuple) else a for a in args[:3]]  # a recording's launch logs tensors
        assert addresses == [x.data_ptr(), out.data_ptr(), stats.data_ptr()]
        assert args[3:] == args0[3:] == [n, n * 64, n - 1, 0.25, 32]
    # 113 - 1 = 112 is a multiple of 16: Triton compiles another kernel, so that length was recorded once more
    # (and checked against the prediction); the plan stays trusted
    assert cache.last_reason == "trusted"


def test_a_new_specialization_class_is_recorded_then_replayed(launcher):
    from mxattn.runtime import affine_plan
    from mxattn.runtime.affine_plan import AffinePlanCache
    cache = AffinePlanCache()
    base = torch.randn(200, 64)
    for n in (40, 41, 42):
        _run(cache, n, base=base)
    plan = next(iter(cache._plans.values()))
    recordings = len(plan.recordings)
    _run(cache, 49, base=base)          # 48 = 49 - 1 is a multiple of 16: not yet compiled for it
    assert len(plan.recordings) == recordings + 1 and plan.trusted
    _run(cache, 65, base=base)          # the same classes as 49: a replay, no recording
    assert len(plan.recordings) == recordings + 1
    assert affine_plan.TRUST_AFTER == 3


def test_a_body_that_is_not_affine_is_retired_and_runs_itself(launcher):
    """The grid steps at n = 100: recordings at 40 and 60 fit it as constant, the third (150) disagrees."""
    from mxattn.runtime.affine_plan import AffinePlanCache
    cache = AffinePlanCache()
    steps = lambda n: (1 + n // 100,)  # noqa: E731
    for n in (40, 60, 150):
        _run(cache, n, grid_of=steps)
    assert cache.last_reason.startswith("retired: the recording at length 150 differs")
    launcher.clear()
    _run(cache, 250, grid_of=steps)
    assert [g for _, g, _ in launcher] == [(3, 1, 1)]  # the body's own launch


def test_a_slope_that_is_not_an_integer_retires_the_plan(launcher):
    from mxattn.runtime.affine_plan import AffinePlanCache
    cache = AffinePlanCache()
    for n in (40, 42):
        _run(cache, n, grid_of=lambda n: (n // 2 + n % 2,))  # fits, slope 1/2 between even lengths
    assert cache.last_reason.startswith("retired: an integer of the recordings is not affine")


def test_roots_other_than_predicted_run_the_body(launcher):
    """A trusted plan fitted on views of a [200, 64] buffer meets a contiguous x (other strides): no replay."""
    from mxattn.runtime.affine_plan import AffinePlanCache
    cache = AffinePlanCache()
    base = torch.randn(200, 128)[:, :64]  # row stride 128
    for n in (40, 41, 42):
        _run(cache, n, base=base)
    plan = next(iter(cache._plans.values()))
    x = torch.randn(50, 64)  # row stride 64
    calls = []
    out = cache.run(("f",), 50, _affine_body(x), (x,), lambda: calls.append(1) or _affine_body(x)())
    assert calls == [1] and out[0].shape == (50, 64) and plan.trusted


def test_refused_recording_retires(launcher):
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.triton_launch import launch
    cache = AffinePlanCache()
    x = torch.randn(8, 64)

    def body():  # a copy is computation: the recording refuses
        out = torch.empty(8)
        launch(_fn("k", 2), (1,), x.clone(), out, BLOCK=1)
        return [out]

    cache.run(("g",), 8, body, (x,))
    assert cache.last_reason.startswith("retired: a recording was refused")


def _symbolic(args, tensors):
    """Launch arguments with every address replaced by (name, byte offset) of the tensor holding it, or
    "internal" (the stats, which the API does not return)."""
    out = []
    for a in args:
        addr = a[1] if isinstance(a, tuple) else a
        name = a
        if isinstance(addr, int) and not isinstance(addr, bool) and addr > 1 << 24:
            name = "internal"
            for n, t in tensors.items():
                start = t.untyped_storage().data_ptr()
                if start <= addr < start + t.untyped_storage().nbytes():
                    name = (n, addr - t.data_ptr())
                    break
        out.append(name)
    return out


#: KV lengths of decode-like calls: a new one each call; or each repeated (a fixed-length loop) before new ones
_SCHEDULES = {"new": list(range(100, 140)),
              "repeats": [100] * 5 + [101] * 4 + list(range(102, 120)) + [120] * 5 + [121, 100, 100, 122]}


@pytest.mark.parametrize("schedule", _SCHEDULES)
@pytest.mark.parametrize("ops_replay", [False, True], ids=["backend_plans", "call_plans"])
@pytest.mark.parametrize("case", ["hf_cache", "bshd_views", "gqa_window_sink"])
def test_triton_backend_decode_steps_replay_the_ordinary_launch(launcher, monkeypatch, request, case, ops_replay,
                                                                schedule):
    """Decode steps (one query, a new KV length each) through the public API: once the affine plan is trusted
    every step replays, and its launch equals the ordinary path's at that length (kernel, grid, every integer,
    float and flag, each address at the same offset of the same tensor). Layouts: transformers' cache
    ([B, H, S, D] contiguous, strides that grow with S), bshd views of a preallocated buffer, GQA with a
    sliding window and a learnable sink. With whole calls recorded (`mxattn.op_plans.run_call`, as calls run),
    the affine plan serves the public call's whole body; else the backend's forward. Lengths repeated before
    the affine plan is trusted replay their per-signature plans (a whole call's: tried first while its calls
    repeat), and new lengths after them the affine plan."""
    import mxattn
    from mxattn import op_plans
    from mxattn.runtime.affine_plan import AffinePlanCache
    from mxattn.runtime.plan_cache import PlanCache
    backend_module, _ = _stub_backend(monkeypatch, request, ops_replay)
    planned = (backend_module._AFFINE_PLANS, backend_module._PLANS, op_plans.CALLS_AFFINE, op_plans.CALLS, set())
    hq, hkv = (8, 2) if case == "gqa_window_sink" else (4, 4)
    buffer = torch.randn(2, 300, 2 * hkv, 64, dtype=torch.bfloat16)
    sink = torch.randn(hq) if case == "gqa_window_sink" else None
    opts = dict(attn_mask_type="causal_bottom_right", backend="triton")
    if case == "gqa_window_sink":
        opts.update(window_size=(50, 0), softmax_type="learnable", softmax_offset=sink)

    def step(n, caches):
        monkeypatch.setattr(backend_module, "_AFFINE_PLANS", caches[0])
        monkeypatch.setattr(backend_module, "_PLANS", caches[1])
        monkeypatch.setattr(op_plans, "CALLS_AFFINE", caches[2])
        monkeypatch.setattr(op_plans, "CALLS", caches[3])
        monkeypatch.setattr(op_plans, "_REPEATING", caches[4])
        q = torch.randn(2, 1, hq, 64, dtype=torch.bfloat16)
        if case == "hf_cache":
            k = buffer[:, :n, :hkv].transpose(1, 2).contiguous().transpose(1, 2)
            v = buffer[:, :n, hkv:].transpose(1, 2).contiguous().transpose(1, 2)
        else:
            k, v = buffer[:, :n, :hkv], buffer[:, :n, hkv:]
        launcher.clear()
        with torch.no_grad():
            o = mxattn.mxfp8_attention(q, k, v, **opts)
        names = dict(q=q, k=k, v=v, o=o)
        if sink is not None:
            names["sink"] = sink
        return [(name, grid, _symbolic(args, names)) for name, grid, args in launcher]

    hinted = 0
    for n in _SCHEDULES[schedule]:
        hinted += bool(planned[4])
        replayed = step(n, planned)
        ordinary = step(n, (AffinePlanCache(), PlanCache(), AffinePlanCache(), PlanCache(), set()))  # the body
        assert replayed == ordinary, n
        assert [name for name, _, _ in replayed] == ["_attn_fwd_kernel"]
    # one trusted plan (3 recordings, then one per new specialization class) at the level that serves the calls;
    # a length dividing a buffer view's stride (128 here) is keyed apart and runs the signature's own path
    serving, idle = (planned[2], planned[0]) if ops_replay else (planned[0], planned[2])
    if schedule == "new":  # (the backend's plan caches run their bodies inside the call's recording; a repeated
        # length's first call at the call level runs its body unrecorded)
        assert not idle._plans
    elif ops_replay:  # the repeats of a length replayed its call plan, tried first
        assert hinted >= 4
    plans = list(serving._plans.values())
    trusted = [p for p in plans if p.trusted]
    assert len(trusted) == 1 and len(trusted[0].recordings) < 8
    assert all(len(p.recordings) == 1 for p in plans if not p.trusted)


def test_describe_roots_is_roots_key_alias_key_and_root_facts_in_one_pass():
    """`describe_roots` (the call plans' one pass) answers what `roots_key`, `alias_key` and `root_facts` do."""
    from mxattn.runtime.affine_plan import describe_roots, root_facts, roots_key
    from mxattn.runtime.launch_plan import alias_key
    buffer = torch.randn(2, 300, 8, 64)
    kv = buffer[:, :120]
    q = torch.randn(2, 1, 8, 64)
    cases = [(q, kv[:, :, :4], kv[:, :, 4:], None), (q, kv, kv, torch.randn(8)),
             (buffer[:, :1], kv[:, :, 2:4], buffer[:, :120, 4:6], None)]
    for roots in cases:
        aliases = alias_key(roots)
        assert describe_roots(roots, 1, 120) == (roots_key(roots, 1, 120),
                                                 tuple([None if a is None else a[0] for a in aliases]),
                                                 root_facts(roots, aliases))

