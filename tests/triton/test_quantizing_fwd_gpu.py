"""The one-launch forward (`attention_fwd_quantizing`: Q, K, V quantized inside the attention kernel), on a CUDA GPU.

The triton backend takes it for calls without a backward whose queries fit one tile (decode steps, short chunks).
It must give the two-launch path's numbers (fused quantizer, then the kernel on the quantizer's bf16
dequantizations) bit for bit: O and stats equal, for every mask, sink, GQA, head dim, input dtype, strided views
and padded or packed batches. The two-launch path is itself checked against `ref` (test_triton_gpu.py,
test_varlen_triton_gpu.py), so equality here carries that check over.
"""

import dataclasses
import math

import pytest
import torch

from mxattn.backends.base import AttentionParams
from mxattn.mask import MaskSpec
from test_varlen_triton_gpu import Batch
from triton_helpers import same_values, triton_backend

pytestmark = pytest.mark.gpu

MASKS = {
    "none": MaskSpec(),
    "causal_bottom_right": MaskSpec(causal=True, diagonal_alignment="bottom_right"),
    "causal_top_left": MaskSpec(causal=True),
    "window_bottom_right": MaskSpec(causal=True, diagonal_alignment="bottom_right", left_bound=100),
}


def _both_paths(q, k, v, params):
    """(o, stats) of the one-launch path (no backward) and of the two-launch path (a forward that keeps the
    copies for backward), checking that the first call took the one-launch path."""
    from mxattn.kernels import triton_attention_fwd as tf
    be = triton_backend()
    calls = []
    real = tf.attention_fwd_quantizing

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    tf.attention_fwd_quantizing = spy
    try:
        o1, s1, saved = be.forward(q, k, v, dataclasses.replace(params, needs_backward=False))
    finally:
        tf.attention_fwd_quantizing = real
    assert calls and saved is None
    o2, s2, _ = be.forward(q, k, v, params)
    torch.cuda.synchronize()
    return o1, s1, o2, s2


def _assert_same(o1, s1, o2, s2):
    assert same_values(o1, o2), f"O differs: max abs diff {(o1.float() - o2.float()).abs().nan_to_num(0).max()}"
    assert same_values(s1, s2), "stats differ"


def _rand(shape, dtype, g):
    return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)


def _case(hq, hkv, sq, skv, d, dtype=torch.bfloat16, mask="causal_bottom_right"):
    """A CASES row (hq, hkv, sq, skv, d, dtype, mask): bfloat16 inputs under a bottom-right causal mask unless
    told otherwise."""
    return hq, hkv, sq, skv, d, dtype, mask


CASES = [
    _case(8, 2, 1, 1, 64),
    _case(8, 2, 1, 33, 64),
    _case(8, 2, 1, 700, 64),
    _case(4, 4, 1, 129, 128, mask="none"),
    _case(4, 1, 1, 300, 32, torch.float16),
    _case(4, 2, 1, 257, 96, mask="window_bottom_right"),
    _case(4, 2, 1, 200, 64, torch.float32),
    _case(4, 2, 5, 131, 64),
    _case(4, 2, 16, 128, 128, mask="causal_top_left"),
    _case(4, 2, 17, 640, 64, torch.float16, "window_bottom_right"),
    _case(2, 2, 64, 64, 64, mask="causal_top_left"),
    _case(2, 1, 100, 400, 128),
    _case(2, 2, 128, 128, 32, mask="none"),
]


@pytest.mark.parametrize("hq,hkv,sq,skv,d,dtype,mask", CASES)
def test_one_launch_forward_equals_two_launch_path(hq, hkv, sq, skv, d, dtype, mask):
    g = torch.Generator(device="cuda").manual_seed(sq * 1000 + skv)
    B = 3
    q = _rand((B, sq, hq, d), dtype, g).transpose(1, 2)  # bshd views, as the public API hands them over
    k = _rand((B, skv, hkv, d), dtype, g).transpose(1, 2)
    v = _rand((B, skv, hkv, d), dtype, g).transpose(1, 2) * 4
    out_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    params = AttentionParams(softmax_scale=1.0 / math.sqrt(d), mask=MASKS[mask], out_dtype=out_dtype)
    _assert_same(*_both_paths(q, k, v, params))


def test_one_launch_forward_with_a_sink_and_unbound_views():
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = _rand((2, 1 + 2 * 300, 4, 64), torch.bfloat16, g)  # q then k then v along S of one tensor
    q, k, v = qkv[:, :1].transpose(1, 2), qkv[:, 1:301].transpose(1, 2), qkv[:, 301:].transpose(1, 2)
    sink = torch.randn(4, device="cuda", generator=g)
    params = AttentionParams(softmax_scale=0.125, mask=MASKS["causal_bottom_right"], sink=sink)
    _assert_same(*_both_paths(q, k, v, params))


def test_one_launch_forward_carries_nan_blocks():
    """A NaN in K or V makes its MXFP8 block NaN, in both paths alike."""
    g = torch.Generator(device="cuda").manual_seed(4)
    q = _rand((2, 4, 1, 64), torch.bfloat16, g)
    k = _rand((2, 2, 200, 64), torch.bfloat16, g)
    v = _rand((2, 2, 200, 64), torch.bfloat16, g)
    k[0, 1, 40, 7] = float("nan")
    v[1, 0, 150, 3] = float("nan")
    params = AttentionParams(softmax_scale=0.125, mask=MASKS["causal_bottom_right"])
    o1, s1, o2, s2 = _both_paths(q, k, v, params)
    _assert_same(o1, s1, o2, s2)
    assert torch.isnan(o1[0, 2:4]).all() and torch.isnan(o1[1, 0:2, :, 3]).all()


@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("lens_q,lens_kv", [([1, 1, 0, 1, 1], [1, 33, 5, 129, 700]),
                                            ([3, 17, 1, 0, 50], [3, 300, 31, 0, 640])])
@pytest.mark.parametrize("mask", ["causal_bottom_right", "window_bottom_right", "none"])
def test_one_launch_forward_variable_lengths(kind, lens_q, lens_kv, mask):
    """Padded batches (NaN in the padding rows, which must reach nothing) and packed ones; one empty sequence."""
    bt = Batch(kind, lens_q, lens_kv, 8, 2, 64, torch.bfloat16, seed=len(lens_q) + len(mask))
    params = AttentionParams(softmax_scale=0.125, mask=MASKS[mask], seq=bt.seq)
    o1, s1, o2, s2 = _both_paths(bt.q, bt.k, bt.v, params)
    _assert_same(o1, s1, o2, s2)
    assert not torch.isnan(o1).any()
