"""Which CUDA device kernels launch on: Triton (and cuDNN through torch's stream) use the current device's
current stream, so a call on tensors of another device makes that device current for its launches."""

import contextlib

import torch


def device_guard(device: torch.device):
    """A context making CUDA device `device` current while kernels for its tensors launch; a no-op when it
    already is, or for a device without an index (the CPU, or "cuda" meaning the current one)."""
    index = device.index
    if index is None or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


__all__ = ["device_guard"]
