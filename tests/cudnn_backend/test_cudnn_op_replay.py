"""The cudnn backend's op bodies replayed by launch plans (`mxattn.op_plans`, `mxattn.runtime.host_calls`) on the
CPU: the graph executions are recorded as host calls, so a replay issues the quantizer's launches and then the
graph execution with a variant pack rebuilt on the new call's tensors. Checked against the ordinary path (op
replays off): the same uids in the same order, the same shapes, strides and dtypes, the same bytes in every input
slot, and the same aliasing (the backward reads the forward's saved copies and the caller's O and dO); a new
signature, an unrecordable body and a cleared graph cache run the ordinary (checked) path."""

import pytest
import torch

pytest.importorskip("cudnn")
pytest.importorskip("triton")

from mxattn import op_plans  # noqa: E402
from mxattn.backends.cudnn import backend as cb  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends.cudnn.config import BwdUid, FwdUid  # noqa: E402
from mxattn.runtime import host_calls, launch_plan  # noqa: E402

from cudnn_fixtures import captured_packs  # noqa: E402,F401
from test_cudnn_host_replay import _dense_inputs, _inputs, _same_pack, fused_on_cpu  # noqa: E402,F401

import mxattn  # noqa: E402


def _run(q, k, v, do, kw, packs):
    """(forward pack, backward pack, O, dO as passed) of one forward+backward through the public API."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    packs.clear()
    o = mxattn.mxfp8_attention(q, k, v, backend="cudnn", **kw)
    o.backward(do)
    assert [kind for kind, _, _ in packs] == ["forward", "backward"]
    return packs[0][2], packs[1][2], o, do


def _op_plans():
    return [(key[0][0], p) for key, p in op_plans.PLANS._plans.items() if isinstance(p, launch_plan.LaunchPlan)]


def _host_calls(plan) -> int:
    return len(plan._host_calls)


@pytest.mark.parametrize("kind", ["dense", "gqa"])
def test_replayed_op_bodies_send_the_ordinary_variant_pack(kind, fused_on_cpu, monkeypatch):
    """Calls 1 (plain), 2 (recorded) and 3-5 (replayed: no backend code runs) pass the graphs the pack of the
    ordinary path: same uids in the same order, geometry and input bytes; the backward's scale and data slots
    at the forward's saved copies, O and dO at the caller's tensors, O of the forward at the returned tensor."""
    packs, log = fused_on_cpu
    q, k, v, do, kw = _dense_inputs(kind)
    calls = [_run(q, k, v, do, kw, packs) for _ in range(5)]
    plans = dict(_op_plans())
    assert sorted(plans) == ["bwd after", "fwd"]
    assert [_host_calls(plans[k]) for k in ("fwd", "bwd after")] == [1, 1]
    assert [plans[k].launch_count for k in ("fwd", "bwd after")] == [3 + 1, 1 + 1]
    assert len(log) == 5 * 4  # Q, K, V and dO quantized once each per call
    forwards = []
    monkeypatch.setattr(cb.CudnnBackend, "forward", _counting(cb.CudnnBackend.forward, forwards))
    for fwd, bwd, o, d in calls[2:]:
        assert not forwards  # replays: the backend's Python did not run
    with monkeypatch.context() as m:
        m.setitem(op_plans._REPLAYS, "cudnn", False)
        plain = _run(q, k, v, do, kw, packs)
    assert len(forwards) == 1
    for fwd, bwd, o, d in calls:
        assert list(fwd) == list(plain[0]) and list(bwd) == list(plain[1])  # uids, in order
        _same_pack(fwd, plain[0])
        _same_pack(bwd, plain[1])
        for b_uid, f_uid in ((BwdUid.SF_Q, FwdUid.SF_Q), (BwdUid.SF_K, FwdUid.SF_K), (BwdUid.Q, FwdUid.Q),
                             (BwdUid.K, FwdUid.K)):
            assert bwd[b_uid].data_ptr() == fwd[f_uid].data_ptr(), b_uid
        assert fwd[FwdUid.O].data_ptr() == o.data_ptr() == bwd[BwdUid.O].data_ptr()
        assert bwd[BwdUid.DO_F16].data_ptr() == d.data_ptr()
        assert fwd[FwdUid.O].untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
    # the replays' slots sit at the recorded offsets from one another within each allocation
    for uid_a, uid_b in ((FwdUid.Q, FwdUid.SF_Q), (FwdUid.K, FwdUid.SF_K), (FwdUid.Q, FwdUid.STATS)):
        gaps = {f[uid_b].data_ptr() - f[uid_a].data_ptr() for f, *_ in calls[2:]}
        assert len(gaps) == 1, (uid_a, uid_b)


def _counting(fn, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return counted


def test_a_new_signature_runs_the_checked_body_before_its_own_replays(fused_on_cpu, monkeypatch):
    """After replays at one shape, a new shape runs the backend (its checks, graph config and validation) on
    its first two calls (the second recorded) and sends its own bytes; bad arguments at a replayed shape's
    neighbour get the ordinary path's error."""
    packs, _ = fused_on_cpu
    q, k, v, do, kw = _dense_inputs("dense")
    for _ in range(3):
        _run(q, k, v, do, kw, packs)
    forwards, configs = [], []
    monkeypatch.setattr(cb.CudnnBackend, "forward", _counting(cb.CudnnBackend.forward, forwards))
    real_config = cb.cudnn_forward.__globals__["forward_config"]
    monkeypatch.setitem(cb.cudnn_forward.__globals__, "forward_config", _counting(real_config, configs))
    short = [x[:, :96].contiguous() for x in (q, k, v, do)]
    got = [_run(*short, kw, packs) for _ in range(3)]
    assert len(forwards) == 2 and len(configs) == 1  # call 1 (plain, new graph config), call 2 (recorded)
    with monkeypatch.context() as m:
        m.setitem(op_plans._REPLAYS, "cudnn", False)
        plain = _run(*short, kw, packs)
    for fwd, bwd, *_ in got:
        _same_pack(fwd, plain[0])
        _same_pack(bwd, plain[1])
    bad = torch.randn(2, 96, 4, 48, dtype=torch.bfloat16)  # head dim 48 against k's 64
    with pytest.raises(Exception) as refused:
        mxattn.mxfp8_attention(bad, short[1], short[2], backend="cudnn", **kw)
    assert "48" in str(refused.value) or "head" in str(refused.value).lower()


@pytest.mark.parametrize("kind, replayed", [("padded", []), ("sink", ["fwd"])])
def test_bodies_that_compute_are_refused_and_keep_the_ordinary_path(kind, replayed, fused_on_cpu):
    """A padded batch (the outputs' padding rows masked) or a sink's backward (stats rewritten) computes with
    torch: the recorder refuses those bodies, whose calls run the backend, and every call sends the first call's
    pack (a sink's forward replays: its SINK slot is the caller's logits)."""
    packs, _ = fused_on_cpu
    q, k, v, do, kw = _dense_inputs(kind)
    first = _run(q, k, v, do, kw, packs)
    for _ in range(3):
        fwd, bwd, *_ = _run(q, k, v, do, kw, packs)
        _same_pack(fwd, first[0])
        _same_pack(bwd, first[1])
        if kind == "sink":
            assert fwd[FwdUid.SINK].data_ptr() == kw["softmax_offset"].data_ptr()
    assert [name for name, p in _op_plans() if _host_calls(p)] == replayed
    assert any(p is op_plans.PLANS._REFUSED for p in op_plans.PLANS._plans.values())


def test_a_cleared_graph_cache_refuses_the_replay_and_records_again(fused_on_cpu, monkeypatch):
    """`GRAPH_CACHE.clear()` (graphs dropped): the recorded host calls are no longer current, so the next call
    runs the backend (planning its graphs again), the one after records anew, and later calls replay."""
    packs, _ = fused_on_cpu
    q, k, v, do, kw = _dense_inputs("dense")
    for _ in range(3):
        _run(q, k, v, do, kw, packs)
    [fwd_plan] = [p for name, p in _op_plans() if name == "fwd"]
    assert not fwd_plan.stale()
    cudnn_graphs.GRAPH_CACHE.clear()
    assert fwd_plan.stale()
    forwards = []
    monkeypatch.setattr(cb.CudnnBackend, "forward", _counting(cb.CudnnBackend.forward, forwards))
    for _ in range(4):
        _run(q, k, v, do, kw, packs)
    assert len(forwards) == 2  # the stale replay's call, then the new recording
    [new_plan] = [p for name, p in _op_plans() if name == "fwd"]  # (the same key, recorded again)
    assert new_plan is not fwd_plan and not new_plan.stale()


def test_a_host_call_plan_replays_only_with_tensors_for_its_roots(fused_on_cpu):
    """A replay onto bare root addresses (no tensors to rebuild the variant pack from) is refused before it
    issues anything; with the holders it issues the launches and the graph execution."""
    packs, log = fused_on_cpu
    q, k, v, do, kw = _dense_inputs("dense")
    for _ in range(3):
        _run(q, k, v, do, kw, packs)
    [(key, plan)] = [(key, p) for key, p in op_plans.PLANS._plans.items() if key[0][0] == "fwd"]
    x = q.transpose(1, 2)
    kk, vv = k.transpose(1, 2), v.transpose(1, 2)
    roots = (x, kk, vv, None, None, None)
    bases = [0 if r is None else r.data_ptr() for r in roots]
    before = (len(log), len(packs))
    assert plan.replay(None, bases=list(bases)) is None
    assert (len(log), len(packs)) == before
    out = plan.replay(None, bases=list(bases), holders=list(roots))
    assert out is not None and len(packs) == before[1] + 1 and len(log) == before[0] + 3


def test_host_call_views_rebuild_the_recorded_geometry():
    """`HostCall.replay` hands its function each tensor at the re-based address, with the recorded shape,
    strides and dtype, over the memory of the tensor holding it (a root itself when it is exactly the root)."""
    got = []
    raw = torch.zeros(4096, dtype=torch.uint8)
    root = torch.randn(4, 8)
    slots = ((0, 0, 256, ((2, 3), (1, 2), torch.float32)), (1, 1, 0, ((4, 8), (8, 1), torch.float32)),
             (2, 0, 1024, ((16,), (1,), torch.float8_e4m3fn)))
    call = host_calls.HostCall(lambda static, t: got.append((static, t)), "static", ("a", "b", "c"), lambda: True)
    call.replay(slots, [raw.data_ptr(), root.data_ptr()], [raw, root])
    [(static, tensors)] = got
    assert static == "static" and list(tensors) == ["a", "b", "c"]
    a, b, c = tensors.values()
    assert (a.shape, a.stride(), a.dtype, a.data_ptr()) == ((2, 3), (1, 2), torch.float32, raw.data_ptr() + 256)
    assert b is root
    assert (c.dtype, c.data_ptr(), c.untyped_storage().data_ptr()) == (torch.float8_e4m3fn, raw.data_ptr() + 1024,
                                                                       raw.untyped_storage().data_ptr())
