"""The error measures the samples, benchmarks and tests share (mxattn.metrics)."""

import torch

from mxattn.metrics import bf16_ulp, bf16_ulps


def test_bf16_ulp_is_the_gap_to_the_next_bf16_value():
    r = torch.tensor([1.0, 1.5, -3.0, 448.0, 2.0 ** -126, 0.0, 1e-40]).bfloat16()
    ulp = bf16_ulp(r)
    nxt = (r.float() + ulp).bfloat16().float()
    normal = r.float().abs() >= 2.0 ** -126
    assert torch.equal((nxt - r.float())[normal].abs(), ulp[normal])   # one ulp up is the next bf16 value
    nonzero = r.float() != 0
    assert torch.equal((r.float() + ulp / 4).bfloat16().float()[nonzero], r.float()[nonzero])  # rounds back
    assert ulp[0].item() == 2.0 ** -7 and ulp[6].item() == 2.0 ** -133 and ulp[5].item() == 2.0 ** -8


def test_bf16_ulps_counts_neighbouring_values():
    ref = torch.tensor([1.0, 3.0, -0.75, 100.0]).bfloat16()
    one_up = (ref.float() + bf16_ulp(ref)).bfloat16()
    assert torch.equal(bf16_ulps(ref, ref), torch.zeros(4))
    assert torch.equal(bf16_ulps(one_up, ref), torch.ones(4))
    assert bf16_ulps(ref.float() * 1.02, ref).min().item() > 1.0
