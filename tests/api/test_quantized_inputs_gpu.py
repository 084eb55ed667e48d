"""Attention on already-quantized inputs on a CUDA GPU: the triton backend's `forward_quantized` (through
`mxfp8_attention_quantized` on `quantize_attention_inputs`' bytes) equals the unquantized `mxfp8_attention`
bit for bit at head dims 64, 128 and 256 (bf16-scratch and FP8 data paths), dense, padded and packed with a
sink, under recipe variants and for decode steps (whose unquantized call is the one-launch quantizing kernel);
its K/V operands hold the bytes the fused quantizer writes for them."""

import warnings

import pytest
import torch

import mxattn
from mxattn import Recipe, quantize_attention_inputs, quantize_mxfp8
from mxattn.seqinfo import SeqInfo
from triton_helpers import force_fp8_data_paths, triton_backend

pytestmark = pytest.mark.gpu
warnings.filterwarnings("ignore", message="mxattn: backend='auto'")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()


def _quantized_kw(kw):
    return {n: kw[n] for n in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "recipe") if n in kw}


def _check(q, k, v, **kw):
    """The quantized call's O equals the unquantized call's, bit for bit (and is not trivially zero)."""
    triton_backend()
    with torch.no_grad():
        want = mxattn.mxfp8_attention(q, k, v, backend="triton", **kw)
        got = mxattn.mxfp8_attention_quantized(*quantize_attention_inputs(q, k, v, **_quantized_kw(kw)),
                                               backend="triton", **kw)
    torch.cuda.synchronize()
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all() and got.abs().sum() > 0
    assert torch.equal(got, want)


def _dense(b, sq, skv, hq, hkv, d):
    return _randn(b, sq, hq, d, seed=1), _randn(b, skv, hkv, d, seed=2) * 3, _randn(b, skv, hkv, d, seed=3)


def _packed(len_q, len_kv, hq, hkv, d):
    q = _randn(sum(len_q), hq, d, seed=4)
    k, v = _randn(sum(len_kv), hkv, d, seed=5), _randn(sum(len_kv), hkv, d, seed=6)
    return q, k, v, dict(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=_cu(len_q),
                         cu_seqlens_kv=_cu(len_kv))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_dense_bit_for_bit(d, mask):
    _check(*_dense(2, 300, 333, 8, 2, d), attn_mask_type=mask)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_packed_with_a_sink_bit_for_bit(d):
    q, k, v, kw = _packed([130, 0, 77, 1, 300], [200, 40, 77, 0, 333], 4, 2, d)
    offset = torch.tensor([0.5, -1.0, 2.0, 0.0], device="cuda")
    _check(q, k, v, softmax_type="learnable", softmax_offset=offset, **kw)
    _check(q, k, v, softmax_type="off-by-one", **kw)


@pytest.mark.parametrize("d", [64, 256])
def test_padded_bit_for_bit(d):
    q, k, v = _dense(3, 150, 170, 4, 4, d)
    len_q, len_kv = [150, 20, 0], [170, 33, 5]
    for b, (lq, lk) in enumerate(zip(len_q, len_kv)):  # padding that would change V's scales if read
        q[b, lq:], k[b, lk:], v[b, lk:] = 3e4, -3e4, float("nan")
    _check(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=_cu(len_q), cu_seqlens_kv=_cu(len_kv))


def test_fp8_data_path_at_head_dim_64(monkeypatch):
    """The FP8 path (K's bytes as they are, V laid out seq-major) where the unquantized call takes it too."""
    force_fp8_data_paths(monkeypatch)
    _check(*_dense(2, 300, 333, 8, 2, 64), attn_mask_type="causal")
    q, k, v, kw = _packed([130, 0, 77], [200, 40, 77], 4, 2, 64)
    _check(q, k, v, softmax_type="off-by-one", **kw)


@pytest.mark.parametrize("recipe", [Recipe(p_quant="lazy16"), Recipe(v_operand="bf16"), Recipe(p_quant="none"),
                                    Recipe(scale_rounding="floor", v_operand="bf16")],
                         ids=["lazy16", "bf16_v", "p_bf16", "floor_bf16_v"])
@pytest.mark.parametrize("d", [64, 256])
def test_recipe_variants_bit_for_bit(recipe, d):
    _check(*_dense(2, 300, 333, 4, 2, d), attn_mask_type="causal", recipe=recipe)


@pytest.mark.parametrize("d", [64, 128])
def test_decode_steps_bit_for_bit(d):
    """The unquantized call of one query row is the one-launch kernel that quantizes as it reads; the quantized
    call runs the two-launch path's kernel on the given bytes: the same numbers."""
    _check(*_dense(4, 1, 777, 8, 2, d), attn_mask_type="causal_bottom_right")
    q, k, v, kw = _packed([1, 1, 1], [300, 1, 64], 8, 2, d)
    _check(q, k, v, **kw)


@pytest.mark.parametrize("kind", ["dense", "padded", "packed"])
def test_kv_operands_hold_the_fused_quantizers_bytes(kind):
    """`seq_major_columns` and the bf16 dequantizations are the fused quantizer's col_seq_major, row_dequant and
    col_dequant of the same tensor, byte for byte."""
    triton_backend()
    from mxattn.backends.triton_backend import _bf16_scratch, seq_major_columns
    from mxattn.kernels.triton_quantize import quantize_rowcol
    if kind == "packed":
        lengths = [130, 0, 77, 1, 33]
        cu = _cu(lengths)
        x = _randn(1, 2, sum(lengths), 64, seed=7)
        seq = SeqInfo(cu, cu, 130, 130, True)
        qkw = dict(cu_seqlens=cu, max_seqlen=130, packed=True)
        col = quantize_mxfp8(x, axis=2, segments=cu)
    else:
        x = _randn(3, 2, 170, 64, seed=8)
        seq = SeqInfo(_cu([170, 33, 0]), _cu([170, 33, 0]), 170, 170, False) if kind == "padded" else None
        qkw = {} if seq is None else dict(cu_seqlens=seq.cu_seqlens_q, max_seqlen=170)
        zeroed = x if seq is None else x.masked_fill(~seq.valid_rows("q", 170), 0)
        col = quantize_mxfp8(zeroed, axis=2)
    row = quantize_mxfp8(x if seq is None or seq.packed else zeroed, axis=3)
    seq_major = quantize_rowcol(x, row=False, col_seq_major=True, **qkw).col_seq_major
    dequant = quantize_rowcol(x, row_dequant=True, col_dequant=True, **qkw)
    mine = seq_major_columns(col, seq)
    torch.cuda.synchronize()
    valid = torch.ones(mine.data.shape[-1], dtype=torch.bool, device="cuda")
    if kind == "packed":  # columns between sequences are written by neither (never read)
        valid[:] = False
        for b, n in enumerate(lengths):
            start = int(cu[b]) // 32 + b
            valid[32 * start:32 * start + -(-n // 32) * 32] = True
    assert torch.equal(mine.data.view(torch.uint8)[..., valid], seq_major.data.view(torch.uint8)[..., valid])
    assert torch.equal(mine.scale.view(torch.uint8), seq_major.scale.view(torch.uint8))
    for got, want in ((_bf16_scratch(row), dequant.row_dequant), (_bf16_scratch(col), dequant.col_dequant)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_reference_on_cuda_equals_its_unquantized_call():
    q, k, v, kw = _packed([130, 0, 77], [200, 40, 77], 4, 2, 64)
    with torch.no_grad():
        want = mxattn.mxfp8_attention(q, k, v, backend="reference", softmax_type="off-by-one", **kw)
        got = mxattn.mxfp8_attention_quantized(*quantize_attention_inputs(q, k, v, **_quantized_kw(kw)),
                                               backend="reference", softmax_type="off-by-one", **kw)
    assert torch.equal(got, want)
