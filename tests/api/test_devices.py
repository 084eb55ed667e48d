"""device_guard: kernels for tensors of a non-current CUDA device launch with that device made current (Triton
launches go to the current device's stream); nothing changes otherwise. CPU test with torch.cuda stubbed."""

import contextlib

import torch

from mxattn import devices


def test_device_guard_switches_only_to_another_index(monkeypatch):
    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index) or contextlib.nullcontext())
    assert isinstance(devices.device_guard(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(devices.device_guard(torch.device("cuda")), contextlib.nullcontext)
    assert isinstance(devices.device_guard(torch.device("cuda", 0)), contextlib.nullcontext)
    assert entered == []
    with devices.device_guard(torch.device("cuda", 1)):
        pass
    assert entered == [1]
