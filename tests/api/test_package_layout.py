"""The package's public names survive imports of its submodules (a submodule import binds its name on the
package; a public name equal to a submodule's must be bound after it), and the old module paths of moved code
re-export the same objects. Fresh interpreters: what an earlier test imported must not hide the problem."""

import subprocess
import sys

_CHECK = r"""
import importlib, pkgutil, sys
import mxattn
public = {name: getattr(mxattn, name) for name in mxattn.__all__}
for info in pkgutil.walk_packages(mxattn.__path__, "mxattn."):
    if info.name.startswith("mxattn.__main__"):
        continue
    importlib.import_module(info.name)
changed = [n for n, obj in public.items() if getattr(mxattn, n) is not obj]
print("rebound:", ",".join(changed), "| names:", len(public), "| cudnn_support callable:",
      callable(mxattn.cudnn_support))
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_importing_every_submodule_keeps_the_public_names():
    line = _run(_CHECK).strip().splitlines()[-1]
    rebound, names, callable_ = (part.split(":", 1)[1].strip() for part in line.split("|"))
    assert rebound == "", f"importing submodules rebound mxattn.{rebound}"
    assert int(names) >= 15 and callable_ == "True", line


def test_old_module_paths_reexport_the_moved_objects():
    _run("""
import importlib
# (`import mxattn.cudnn_support as x` would give the function of that name: the package attribute wins)
old_support = importlib.import_module("mxattn.cudnn_support")
old_graphs = importlib.import_module("mxattn.cudnn_graphs")
old_backend = importlib.import_module("mxattn.backends.cudnn_backend")
from mxattn.backends.cudnn import support, buffers, config, backend
assert old_support.cudnn_support is support.cudnn_support
assert old_graphs.col_scale_buffer is buffers.col_scale_buffer and old_graphs.GraphConfig is config.GraphConfig
assert old_backend.CudnnBackend is backend.CudnnBackend
import mxattn
assert callable(mxattn.cudnn_support) and mxattn.cudnn_support is support.cudnn_support
""")


def test_a_cudnn_module_that_is_not_the_frontend_makes_the_backend_unavailable_with_the_reason(tmp_path):
    """A package named `cudnn` without the frontend's graph API (some images ship one) makes the cudnn backend
    unavailable with a reason saying what was found, instead of an error at the first call: `backend="auto"`
    moves on to the reference backend (with its one warning; the choice's cache asks every backend before it
    whether sizes matter), naming the backend raises MXFP8NotSupportedError with the reason."""
    import os
    import textwrap
    from repo_paths import ROOT
    (tmp_path / "cudnn").mkdir()
    (tmp_path / "cudnn" / "__init__.py").write_text("version = 'not the frontend'\n")
    script = textwrap.dedent("""
        import warnings
        import torch
        import mxattn
        from mxattn.backends import availability
        ok, reason = availability("cudnn", torch.device("cpu"))
        assert not ok and "is not the cuDNN frontend" in reason and "pip install nvidia-cudnn-frontend" in reason
        q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o = mxattn.mxfp8_attention(q, q, q, attn_mask_type="causal")
        assert o.shape == q.shape and any("'reference'" in str(w.message) for w in caught)
        try:
            mxattn.mxfp8_attention(q, q, q, backend="cudnn")
        except mxattn.MXFP8NotSupportedError as exc:
            assert "is not the cuDNN frontend" in str(exc), exc
        else:
            raise AssertionError("the backend ran")
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
