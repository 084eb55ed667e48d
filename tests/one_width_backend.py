"""A stand-in for a GPU backend that runs one head dim for Q, K and V (the triton backend) on the CPU: it believes
it is usable, refuses (as its kernels would fail) a V narrower than Q, and computes with the reference backend's
arithmetic, recording the V widths it was given. For tests of the zero-padding of MLA's V
(`mxattn.backends.v_padding`) where no GPU is."""

import pytest

from mxattn import backends
from mxattn.errors import MXFP8NotSupportedError


def pretend_usable(monkeypatch, name: str):
    """Backend `name`'s class, made to believe it is usable on every device (skips when it cannot be imported)."""
    try:
        cls = backends.backend_class(name)
    except MXFP8NotSupportedError:
        pytest.skip(f"the {name} backend cannot be imported here")
    monkeypatch.setattr(cls, "availability", classmethod(lambda c, device: (True, "pretend")))
    return cls


def one_width_triton(monkeypatch):
    """(the triton backend's class as the stand-in, the list of V widths its forward received)."""
    from mxattn.backends.reference import ReferenceBackend
    cls = pretend_usable(monkeypatch, "triton")
    widths, reference = [], ReferenceBackend()

    def forward(self, q, k, v, params):
        assert v.shape[3] == q.shape[3], "V reached the backend narrower than Q"
        widths.append(v.shape[3])
        return reference.forward(q, k, v, params)

    def backward(self, saved, o, stats, do, params, dstats=None):
        assert do.shape[3] == saved.q_row.shape[3], "dO reached the backend narrower than Q"
        return reference.backward(saved, o, stats, do, params, dstats)

    def saved_for_backward(self, q, k, v, params):
        assert v.shape[3] == q.shape[3], "V reached the backend narrower than Q"
        return reference.saved_for_backward(q, k, v, params)

    monkeypatch.setattr(cls, "forward", forward)
    monkeypatch.setattr(cls, "backward", backward)
    monkeypatch.setattr(cls, "saved_for_backward", saved_for_backward)
    monkeypatch.setattr(cls, "_one_launch_config", staticmethod(lambda *args: None))
    backends.clear_choices()
    return cls, widths
