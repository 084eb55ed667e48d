"""Shared by the cuDNN graph and host-path tests: the skip rule for graph validation, the mask set, and fixtures
that make CudnnBackend believe it is on a Blackwell GPU, capture its variant packs, or run it on CPU tensors with
the plan and launch faked."""

from types import SimpleNamespace

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn import op_plans  # noqa: E402
from mxattn.runtime.plan_cache import PlanCache  # noqa: E402
from mxattn.backends.cudnn import backend as cb  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends.cudnn import run as cudnn_run  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402

needs_mxfp8_cudnn = pytest.mark.skipif(cudnn.backend_version() < 92100,
                                       reason=f"cuDNN {cudnn.backend_version()} < 9.21 cannot validate MXFP8 graphs")
MASKS = {"none": MaskSpec(), "causal_tl": MaskSpec(causal=True),
         "causal_br": MaskSpec(causal=True, diagonal_alignment="bottom_right"),
         "band_br": MaskSpec(left_bound=64, right_bound=32, diagonal_alignment="bottom_right"),
         "swa_tl": MaskSpec(left_bound=100, right_bound=0)}


TORCH_OF = {"FP8_E4M3": torch.float8_e4m3fn, "FP8_E5M2": torch.float8_e5m2, "FP8_E8M0": torch.float8_e8m0fnu,
            "BFLOAT16": torch.bfloat16, "HALF": torch.float16, "FLOAT": torch.float32, "INT32": torch.int32,
            "INT64": torch.int64}


def check_pack_against_graph(pack, graph_tensors, packed: bool) -> None:
    """Every slot of a variant pack (uid -> tensor) against the graph's non-virtual JSON tensors: the same uids,
    and each tensor's dims, strides and dtype; a packed graph's token slots (those with a ragged offset) are
    [1, H, T, D] views with the graph's H, D and strides past the batch axis (size-1 axes aside)."""
    assert sorted(pack) == sorted(graph_tensors) and all(type(uid) is int for uid in pack)
    for uid, t in graph_tensors.items():
        got = pack[uid]
        assert got.dtype == TORCH_OF[t["data_type"]], t["name"]
        if packed and t.get("ragged_offset_uid") is not None:
            assert got.shape[0] == 1 and (got.shape[1], got.shape[3]) == (t["dim"][1], t["dim"][3]), t["name"]
            assert [st for st, n in zip(got.stride()[1:], got.shape[1:]) if n > 1] == \
                [st for st, n in zip(t["stride"][1:], got.shape[1:]) if n > 1], t["name"]
        else:
            assert (list(got.shape), list(got.stride())) == (t["dim"], t["stride"]), t["name"]


def fresh_op_plans(monkeypatch) -> None:
    """Empty recordings of the ops' bodies and calls for this test (`mxattn.op_plans`): a replay recorded by
    another test would carry that test's stand-ins (compiled kernels, planned graphs)."""
    monkeypatch.setattr(op_plans, "PLANS", PlanCache(max_entries=512, min_replays=16))
    monkeypatch.setattr(op_plans, "CALLS", PlanCache(max_entries=512, min_replays=16))


@pytest.fixture
def pretend_blackwell(monkeypatch):
    """CudnnBackend believes it runs on a Blackwell GPU; the graphs are checked by cuDNN's deviceless
    validation (handle None) instead of being planned. Yields the list of checked problems."""
    calls = []
    real = cb.check_problem

    def counting(p, handle=None, device_index=0, sm_version=100):
        calls.append(p)
        return real(p, handle, device_index, sm_version)

    monkeypatch.setattr(cb.CudnnBackend, "availability", classmethod(lambda cls, device: (True, "pretend SM 10.0")))
    monkeypatch.setattr(cb, "_support_handle", lambda device: (None, 0))
    monkeypatch.setattr(cb, "check_problem", counting)
    cb.clear_support_cache()
    yield calls
    cb.clear_support_cache()


@pytest.fixture
def captured_packs(monkeypatch):
    """CudnnBackend runs its whole host path (quantization, configs, buffers, variant packs) on any device with
    the graph neither planned nor executed: yields the list of (kind, cfg, variant pack) that would have reached
    cuDNN, in call order (the outputs stay as allocated)."""
    packs = []
    plans = {}

    def planned(key, kind, device, make_config):
        if key not in plans:
            plans[key] = cudnn_run.PlannedGraph(kind, make_config(), None, 0)
        return plans[key]

    monkeypatch.setattr(cb.CudnnBackend, "availability", classmethod(lambda cls, device: (True, "pretend SM 10.0")))
    monkeypatch.setattr(cb.CudnnBackend, "supports", classmethod(lambda cls, problem: (True, "pretend")))
    monkeypatch.setattr(cb, "_supported_state", lambda device: None)
    monkeypatch.setattr(cudnn_run, "planned", planned)
    monkeypatch.setattr(cudnn_run, "execute",
                        lambda plan, pack, device: packs.append((plan.kind, plan.cfg, dict(pack))))
    fresh_op_plans(monkeypatch)
    yield packs


@pytest.fixture
def fake_device(monkeypatch):
    """CudnnBackend / cudnn_forward / cudnn_backward on CPU tensors with cuDNN's plan and launch faked. Yields a
    namespace: `built`, the (kind, cfg) of every plan built; `launches`, the (cfg, variant pack) of every launch,
    in call order. A backward launch with a dSink output writes 0, 1, .. per query head into it (recognisable)."""
    state = SimpleNamespace(built=[], launches=[])

    class State:
        index = 0

        def get_handle(self):
            return None

    def fake_build(kind, cfg, handle):
        state.built.append((kind, cfg))
        return cudnn_graphs.PlannedGraph(kind, cfg, None, 0)

    def fake_execute(plan, pack, device):
        state.launches.append((plan.cfg, pack))
        if plan.cfg.dsink:
            pack[int(cudnn_config.BwdUid.DSINK)].copy_(torch.arange(plan.cfg.h_q, dtype=torch.float32).view(1, -1, 1, 1))

    monkeypatch.setattr(cb, "_supported_state", lambda device: State())
    monkeypatch.setattr(cudnn_run, "_supported_state", lambda device: State())
    monkeypatch.setattr(cudnn_run, "execute", fake_execute)
    monkeypatch.setattr(cudnn_graphs, "build_and_plan", fake_build)
    fresh_op_plans(monkeypatch)
    cudnn_graphs.GRAPH_CACHE.clear()
    yield state
    cudnn_graphs.GRAPH_CACHE.clear()
