"""The package's shape: public names survive imports of its submodules (a submodule import binds its name on the
package; a public name equal to a submodule's must be bound after it), no import cycle, kernels apart from the
layers above them, short modules. Fresh interpreters: what an earlier test imported must not hide the problem."""

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


def _import_graph():
    """{module: the package modules it imports} of mxattn, read from the source (every import, lazy ones too)."""
    import ast
    from repo_paths import ROOT
    files = {}
    for path in (ROOT / "mxattn").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:  # a submodule imported by name is the edge, else the module itself
                    targets.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph, files


def _cycles(graph) -> list:
    """Every import cycle met by a depth-first walk of graph, each as the list of modules around it."""
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph, _ = _import_graph()
    assert len(graph) > 50, "the import graph read too few modules"
    cycles = _cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernels_hold_kernels_and_no_module_is_too_long():
    """`kernels/` holds device code and its launch wrappers: they may use the runtime's launcher, never a
    backend or the op layer; every module stays short enough to read in one sitting."""
    graph, files = _import_graph()
    for name, targets in graph.items():
        if name.startswith("mxattn.kernels."):
            bad = {t for t in targets if t.startswith(("mxattn.backends", "mxattn.ops", "mxattn.op_", "mxattn.attention",
                                                      "mxattn.integrations", "mxattn.kvcache"))}
            assert not bad, f"{name} imports {sorted(bad)}"
        if name.startswith("mxattn.runtime."):
            assert not {t for t in targets if t.startswith("mxattn.backends")}, name
    long = {name: n for name, path in files.items() if (n := len(path.read_text().splitlines())) > 700}
    assert not long, f"modules over 700 lines: {long}"


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
