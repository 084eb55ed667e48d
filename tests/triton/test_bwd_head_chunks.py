"""The "pre" backward's chunks of KV heads (`triton_attention_bwd.head_chunks`) and the scratch budget they aim at,
MXATTN_BWD_SCRATCH_MIB (read when the module is imported)."""
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _chunks_are_balanced(chunks, hkv):
    assert chunks[0][0] == 0 and chunks[-1][1] == hkv
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    sizes = [h1 - h0 for h0, h1 in chunks]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("budget_mib, per_head_mib, want, hkv, expected", [
    (128, 10, 4, 16, 2),    # the budget holds 12 heads: two chunks of 8
    (128, 10, 16, 16, 1),   # two waves want every head
    (0, 10, 4, 16, 4),      # no budget: the heads for two waves alone
    (0, 10, 1, 16, 16),     # ... one head per chunk
    (128, 600, 8, 16, 16),  # a head past SCRATCH_BUDGET_BYTES (512 MiB) alone: one per chunk
    (128, 100, 8, 16, 4),   # 8 wanted, but 5 heads fill SCRATCH_BUDGET_BYTES: chunks of 4
    (128, 1, 1, 3, 1),      # fewer heads than the budget holds
])
def test_head_chunks_follow_the_budget(monkeypatch, budget_mib, per_head_mib, want, hkv, expected):
    from mxattn.kernels import triton_attention_bwd as bwd
    monkeypatch.setattr(bwd, "PRE_BUDGET_BYTES", budget_mib * MIB)
    chunks = bwd.head_chunks(hkv, per_head_mib * MIB, want)
    assert len(chunks) == expected, chunks
    _chunks_are_balanced(chunks, hkv)
    if len(chunks) > 1:  # no chunk past the hard limit unless it is one head
        assert all((h1 - h0) * per_head_mib * MIB <= bwd.SCRATCH_BUDGET_BYTES or h1 - h0 == 1 for h0, h1 in chunks)


def _import_with(value):
    env = dict(os.environ, PYTHONPATH=ROOT, MXATTN_BWD_SCRATCH_MIB=value)
    code = "from mxattn.kernels import triton_attention_bwd as b; print(b.PRE_BUDGET_BYTES)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value, want", [(None, 7), ("", 7), ("0", 0), ("64", 64 * MIB), (" 32 ", 32 * MIB)])
def test_scratch_budget_parsing(monkeypatch, value, want):
    from mxattn.kernels import triton_attention_bwd as bwd
    if value is None:
        monkeypatch.delenv("MXATTN_BWD_SCRATCH_MIB", raising=False)
    else:
        monkeypatch.setenv("MXATTN_BWD_SCRATCH_MIB", value)
    assert bwd._pre_budget_from_environment(7) == want


@pytest.mark.parametrize("value", ["-1", "1.5", "lots"])
def test_a_bad_scratch_budget_names_the_variable(monkeypatch, value):
    from mxattn.kernels import triton_attention_bwd as bwd
    monkeypatch.setenv("MXATTN_BWD_SCRATCH_MIB", value)
    with pytest.raises(ValueError, match="MXATTN_BWD_SCRATCH_MIB must be a whole number of MiB") as err:
        bwd._pre_budget_from_environment(7)
    assert repr(value) in str(err.value)


def test_the_import_reads_the_scratch_budget_and_stops_on_a_bad_one():
    run = _import_with("64")
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[-1]) == 64 * MIB
    run = _import_with("lots")
    assert run.returncode != 0
    assert "MXATTN_BWD_SCRATCH_MIB must be a whole number of MiB" in run.stderr and "'lots'" in run.stderr
