"""Shared by the cuDNN varlen and sink graph tests: the skip rule for graph validation, the mask set, and a
fixture that makes CudnnBackend believe it is on a Blackwell GPU."""

import pytest

cudnn = pytest.importorskip("cudnn")

from mxattn.backends.cudnn import backend as cb  # noqa: E402
from mxattn.backends.cudnn import run as cudnn_run  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402

needs_mxfp8_cudnn = pytest.mark.skipif(cudnn.backend_version() < 92100,
                                       reason=f"cuDNN {cudnn.backend_version()} < 9.21 cannot validate MXFP8 graphs")
MASKS = {"none": MaskSpec(), "causal_tl": MaskSpec(causal=True),
         "causal_br": MaskSpec(causal=True, diagonal_alignment="bottom_right"),
         "band_br": MaskSpec(left_bound=64, right_bound=32, diagonal_alignment="bottom_right"),
         "swa_tl": MaskSpec(left_bound=100, right_bound=0)}


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
    yield packs
