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


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host values (a list, nested lists, or a CPU tensor) on `device`, without waiting for the
    device: a CUDA copy goes from pinned memory, asynchronously on the current stream (a copy from pageable memory
    would synchronise the stream: every kernel queued before it would have to finish first). Torch's pinned-memory
    allocator keeps the staging buffer until the copy has run."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


__all__ = ["device_guard", "host_to_device"]
