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


def test_host_to_device_on_the_cpu_keeps_the_values_and_dtype():
    from mxattn.devices import host_to_device
    t = host_to_device([[1, 2], [3, 4]], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, 4]]
    u = host_to_device(torch.tensor([5, 6]), torch.int64, torch.device("cpu"))
    assert u.dtype == torch.int64 and u.tolist() == [5, 6]
