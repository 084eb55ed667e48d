"""Every name a Python file of the project reads is bound somewhere in that file (an import, a definition, an
assignment, a parameter) or is a builtin. Code that runs only on a GPU (the benchmark's timing, kernels' hosts)
is never executed by the CPU suite, so a name lost in a refactor (a NameError in `python -m mxattn bench` after
a helper moved out of the package, say) would otherwise reach users first. File-level, not scope-exact: it catches names bound nowhere, not names bound in the wrong scope."""

import ast
import builtins

import pytest

from repo_paths import ROOT

_MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__path__", "__package__",
                 "__loader__"}


def unbound_names(source: str):
    """[(name, line)] of the names `source` loads that it binds nowhere and builtins lack."""
    tree = ast.parse(source)
    bound = set(dir(builtins)) | _MODULE_NAMES
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound |= set(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
    return sorted({(n.id, n.lineno) for n in ast.walk(tree)
                   if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound},
                  key=lambda t: t[1])


def test_the_check_finds_an_unbound_name():
    assert unbound_names("import os\ndef f(x):\n    return os.sep + helper(x)\n") == [("helper", 3)]
    assert unbound_names("from a import helper\ndef f(x):\n    return helper(x)\n") == []


FILES = sorted(p for top in ("mxattn", "ref", "samples", "benchmarks", "tests") for p in (ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_loaded_name_is_bound(path):
    assert unbound_names(path.read_text()) == [], f"{path.relative_to(ROOT)} reads names it never binds"
