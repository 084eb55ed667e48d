"""Calls without heads, as torch SDPA answers them: no query heads give an empty O and zero gradients (whatever the
key/value heads, each entry point), query heads without key/value heads a ValueError naming them."""

import pytest
import torch
import torch.nn.functional as F

import mxattn


@pytest.mark.parametrize("hq, hkv", [(0, 0), (0, 2)])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_no_query_heads_give_sdpas_empty_output(hq, hkv, mask):
    q = torch.randn(2, 64, hq, 64, requires_grad=True)
    k, v = (torch.randn(2, 48, hkv, 64, requires_grad=True) for _ in range(2))
    o = mxattn.mxfp8_attention(q, k, v, attn_mask_type=mask, backend="reference")
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          enable_gqa=True).transpose(1, 2)
    assert o.shape == sdpa.shape == (2, 64, 0, 64) and o.dtype == q.dtype
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert not k.grad.any() and not v.grad.any()
    cu = torch.tensor([0, 30, 64], dtype=torch.int32), torch.tensor([0, 20, 48], dtype=torch.int32)
    packed = mxattn.mxfp8_attention(q[0], k[0], v[0], qkv_format="thd", attn_mask_type="padding",
                                    cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1], backend="reference")
    assert packed.shape == (64, 0, 64)
    inputs = mxattn.quantize_attention_inputs(q.detach(), k.detach(), v.detach())
    assert mxattn.mxfp8_attention_quantized(*inputs, backend="reference").shape == (2, 64, 0, 64)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_query_heads_without_key_heads_raise_naming_them(fmt):
    shape_q, shape_kv = ((2, 64, 4, 64), (2, 48, 0, 64)) if fmt == "bshd" else ((64, 4, 64), (48, 0, 64))
    q, k, v = torch.randn(shape_q), torch.randn(shape_kv), torch.randn(shape_kv)
    kw = {} if fmt == "bshd" else dict(attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 64], dtype=torch.int32),
                                       cu_seqlens_kv=torch.tensor([0, 48], dtype=torch.int32))
    with pytest.raises(ValueError, match="k and v have no heads but q has 4"):
        mxattn.mxfp8_attention(q, k, v, qkv_format=fmt, backend="reference", **kw)
