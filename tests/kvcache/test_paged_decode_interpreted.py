"""The paged decode path's logic on the CPU: tests/interpret_paged_decode.py runs `_paged_attn_kernel` with DECODE
under Triton's interpreter (page tables of 32-256 tokens, GQA up to 16:1, sliding windows, learnable and off-by-one
sinks, the open V block, multi-token queries, the single pass and 2-5 splits with their combine) and compares O
with the reference backend on the same cache. The interpreter's exponentials are exact where the GPU's are
approximate, so outputs may differ by one bf16 ulp, not more; a wrong page, mask, scale or split start moves
them by far more (the kernel's arithmetic on the GPU: tests/kvcache/test_kvcache_gpu.py). The split cases also
check the logits workspace (STORE_S): O bit-equal to the recomputing split pass, and NaN when the workspace is
poisoned between the passes."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from repo_paths import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")]


def test_decode_kernel_under_the_interpreter_matches_the_reference_backend():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, os.path.join(str(ROOT), "tests", "interpret_paged_decode.py")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    rows = [row for row in lines if "case" in row]
    assert len(rows) == 4, res.stdout
    for row in rows:
        assert not row["nan"], row
        assert row["within_one_ulp"] >= 0.999 and row["equal"] >= 0.3, row
    # the split passes' logits workspace: O bit-equal to recomputing S, and pass 2 reads S from the workspace
    checks = [row for row in lines if "store_s_case" in row]
    assert len(checks) == 3, res.stdout
    for row in checks:
        assert row["bit_equal"] and row["poison_nan"], row
