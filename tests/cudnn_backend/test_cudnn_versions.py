"""cuDNN versions the cudnn backend refuses, on the CPU with the version and a Blackwell GPU faked: 9.23.0 and
9.23.1 give Inf/NaN in MXFP8 attention (fixed in 9.23.2; Transformer Engine disables FusedAttention for MXFP8 with
them too), so `cudnn_support` says why and `auto` moves on to the next backend."""

import warnings

import pytest
import torch

import mxattn
from mxattn import backends
from mxattn.backends.base import Problem
from mxattn.backends.cudnn import support
from mxattn.mask import MaskSpec


@pytest.fixture
def fake_blackwell(monkeypatch):
    """cudnn_support on a faked B200 with the cuDNN version the test sets (`set_version(92301)`)."""
    monkeypatch.setattr(support, "_device_facts", lambda device, problems: "cuda:0 NVIDIA B200 (SM 10.0)")

    def set_version(version):
        text = f"cuDNN {support.version_text(version)} loaded from /fake/libcudnn.so.9 (nvidia-cudnn-cu13)"
        monkeypatch.setattr(support, "backend_facts", lambda: (version, text))

    return set_version


@pytest.mark.parametrize("version, ok", [(92100, True), (92200, True), (92300, False), (92301, False),
                                         (92302, True), (92801, True), (92001, False)])
def test_cudnn_support_refuses_the_versions_with_broken_mxfp8_attention(fake_blackwell, version, ok):
    fake_blackwell(version)
    got, reason = mxattn.cudnn_support()
    assert got is ok, reason
    assert support.version_text(version) in reason
    if version in (92300, 92301):
        assert "Inf/NaN" in reason and "9.23.2" in reason and "nvidia-cudnn-cu13>=9.23.2" in reason


def test_auto_moves_on_from_a_refused_cudnn_version(fake_blackwell):
    """With cuDNN 9.23.1 on a (faked) Blackwell GPU, `auto` passes over cudnn with the reason in its one-time
    warning and runs the next backend that takes the call (here, on the CPU, reference)."""
    fake_blackwell(92301)
    backends._WARNED.clear()
    backends.pick_backend.cache_clear()
    problem = Problem(device=torch.device("cpu"), dtype=torch.bfloat16, batch=1, heads_q=2, heads_kv=2, seqlen_q=64,
                      seqlen_kv=64, head_dim=64, mask=MaskSpec())
    ok, reason = backends.supports("cudnn", problem)
    assert not ok and "9.23.1" in reason and "Inf/NaN" in reason
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.pick_backend("auto", problem) == "reference"
    notes = [str(w.message) for w in caught if "backend='auto'" in str(w.message)]
    assert len(notes) == 1 and "cudnn: " in notes[0] and "9.23.1" in notes[0]
    with pytest.raises(mxattn.MXFP8NotSupportedError, match="9.23.1"):
        backends.pick_backend("cudnn", problem)
    backends.pick_backend.cache_clear()
