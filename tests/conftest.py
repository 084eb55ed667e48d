"""Shared fixtures and skip rules: `gpu` tests need CUDA, `blackwell` tests need SM 10.x."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_backend_choice():
    """Tests monkeypatch backends' support checks: forget the choices cached by earlier tests."""
    from mxattn import backends
    backends.clear_choices()
    yield
    backends.clear_choices()


def _is_blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    not_blackwell = pytest.mark.skip(reason="needs a Blackwell (SM 10.x) GPU")
    for item in items:
        if "blackwell" in item.keywords and not _is_blackwell():
            item.add_marker(not_blackwell)
        elif "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
