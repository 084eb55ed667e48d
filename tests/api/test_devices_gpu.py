"""Calls on a CUDA device that is not the current one (a layer that transformers' device_map="auto" placed on
another GPU): every launch, replays of recorded plans included (`mxattn.op_plans`), goes to the tensors' device.
Needs two GPUs (skipped otherwise)."""

import pytest
import torch

import mxattn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


def _calls(device, seed):
    """O and the gradients of three calls of one signature (ordinary, recorded, replayed) on `device`."""
    out = []
    for i in range(3):
        g = torch.Generator(device=device).manual_seed(seed + i)
        q, k, v = (torch.randn(2, 160, h, 64, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
                   for h in (8, 2, 2))
        o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
        o.backward(torch.randn(o.shape, device=device, dtype=o.dtype, generator=g))
        out.append([o.detach(), q.grad, k.grad, v.grad])
    return out


def test_calls_on_a_non_current_device_equal_calls_with_it_current():
    torch.cuda.set_device(0)
    elsewhere = _calls("cuda:1", 7)            # cuda:0 current, tensors on cuda:1
    with torch.cuda.device(1):
        current = _calls("cuda:1", 7)
    for a, b in zip(elsewhere, current):
        for x, y in zip(a, b):
            assert x.device == torch.device("cuda:1") and torch.equal(x, y)
