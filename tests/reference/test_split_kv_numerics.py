"""benchmarks/split_kv_numerics.py's claim on a small case: a split-KV decode whose splits start from the running
maximum of the earlier splits gives the recipe's sequential result to fp32 rounding; splits starting from -inf
round P differently (a visible change, of the size of the recipe's own error)."""

import math
import os
import sys

import torch
from repo_paths import ROOT

sys.path.insert(0, os.path.join(str(ROOT), "benchmarks"))

import split_kv_numerics as skv  # noqa: E402


def test_prefix_max_splits_reproduce_the_sequential_recipe():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 1000, 64), torch.randn(1, 2, 1000, 64)
    qm, km, vm = skv.mx(q, -1), skv.mx(k, -1), skv.mx(v, -2)
    seq, local, prefix = skv.variants(qm, km, vm, 1 / math.sqrt(64), 4)
    rel = lambda x: ((x - seq).norm() / seq.norm()).item()  # noqa: E731
    assert rel(prefix) < 1e-5
    assert torch.equal(prefix.bfloat16(), seq.bfloat16())
    assert rel(local) > 1e-3
