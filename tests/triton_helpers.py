"""Shared by the Triton GPU tests."""

import pytest
import torch


def triton_backend():
    """A TritonBackend on this CUDA device, or skip the test with the reason."""
    from mxattn.backends.triton_backend import TritonBackend
    ok, why = TritonBackend.availability(torch.device("cuda"))
    if not ok:
        pytest.skip(f"triton backend unavailable: {why}")
    return TritonBackend()


def as_bytes(t):
    return t.view(torch.uint8)


def same_values(a, b):
    """Equal values, NaN where the other has NaN (NaN bit patterns may differ)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
