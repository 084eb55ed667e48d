"""A backend class made usable on the CPU for tests of the backend choice: its availability faked, its forward a
guard that fails the test if any kernel would run."""

import pytest

import mxattn
from mxattn import backends


def pretend_usable(monkeypatch, name: str):
    """The backend class `name` (the test skips when it cannot be imported here), usable on any device; its
    forward raises AssertionError if it is ever called."""
    try:
        cls = backends.backend_class(name)
    except mxattn.MXFP8NotSupportedError:
        pytest.skip(f"the {name} backend cannot be imported here")
    monkeypatch.setattr(cls, "availability", classmethod(lambda c, device: (True, "pretend")))

    def no_kernel(*args, **kwargs):
        raise AssertionError(f"a kernel ran: a {name} kernel ran where none should")

    monkeypatch.setattr(cls, "forward", no_kernel)
    return cls
