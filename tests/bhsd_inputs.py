"""Random attention inputs shared by the API and recipe tests."""

import torch


def bhsd_inputs(b=2, hq=4, hkv=2, sq=96, skv=80, d=64, dtype=torch.bfloat16, seed=0):
    """q [b, hq, sq, d], k and v [b, hkv, skv, d], do [b, hq, sq, d]: standard normal in `dtype` (CPU)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, skv, d, generator=gen).to(dtype)
    do = torch.randn(b, hq, sq, d, generator=gen).to(dtype)
    return q, k, v, do
