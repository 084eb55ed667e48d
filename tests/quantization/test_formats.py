"""mxattn.formats: MXFP8 quantization (spec section 2) and the F8_128x4 scale layout (section 4).

Oracles: torchao 0.18 ``to_mx`` (RCEIL / FLOOR) and ``to_blocked``, the project's
``ref.mxfp8_ref.quantize``, and the spec formulas written out directly.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxattn.formats import (
    BLOCK_SIZE,
    MXFP8Tensor,
    e8m0_to_float,
    quantize_mxfp8,
    scale_exponent_bytes,
    swizzle_128x4,
    swizzled_scale_shape,
    unswizzle_128x4,
)
from ref.mxfp8_ref import dequantize as ref_dequantize
from ref.mxfp8_ref import quantize as ref_quantize
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.prototype.mx_formats.utils import to_blocked

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# fp8 dtype -> (max finite, emax of the largest power of two, mantissa bits, min normal exponent)
FMT = {E4M3: (448.0, 8, 3, -6), E5M2: (57344.0, 15, 2, -14)}
TORCHAO_MODE = {"ceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}


def u8(t):
    return t.view(torch.uint8)


def wide_random(shape, dtype, seed):
    """Random data at magnitudes 1e-6..1e6: each 32x32 tile of the last two dims gets a log-uniform
    magnitude (so blocks along either axis see many binades), elements spread within 100x of it."""
    g = torch.Generator().manual_seed(seed)
    tiles = [-(-n // 32) for n in shape[-2:]]
    mag = 10.0 ** torch.empty(*shape[:-2], *tiles).uniform_(-6, 6, generator=g)
    for d in (-2, -1)[2 - len(tiles):]:
        mag = mag.repeat_interleave(32, dim=d).narrow(d, 0, shape[d])
    elem_mag = 10.0 ** torch.empty(shape).uniform_(-2, 0, generator=g)
    return (torch.randn(shape, generator=g) * mag * elem_mag).to(dtype)


def expand_blocks(t, axis, n):
    """Per-block tensor -> per-element (repeat each block 32 times along axis, cut to n)."""
    return t.repeat_interleave(BLOCK_SIZE, dim=axis).narrow(axis, 0, n)


def block_amax(x, axis):
    n = x.shape[axis]
    pad = (-n) % BLOCK_SIZE
    xm = x.float().movedim(axis, -1)
    if pad:
        xm = torch.nn.functional.pad(xm, (0, pad))
    return xm.abs().unflatten(-1, (-1, BLOCK_SIZE)).amax(-1).movedim(-1, axis)


def torchao_quantize(x, axis, fp8_dtype, rounding):
    """torchao to_mx along `axis` (it only blocks the last dim of a contiguous tensor; returns scale, data)."""
    scale, data = to_mx(x.movedim(axis, -1).contiguous(), fp8_dtype, BLOCK_SIZE, TORCHAO_MODE[rounding])
    return data.movedim(-1, axis), scale.movedim(-1, axis)


def torchao_log2_divergence(amax, fmax):
    """Blocks where torchao's eager RCEIL (ceil of a floating-point log2) must differ from the exact rule:
    descale is not a power of two but torch.log2(descale) rounds to an integer."""
    d = amax.float() / fmax
    lg = torch.log2(d)
    not_pow2 = (d.view(torch.int32) & 0x7FFFFF) != 0
    return not_pow2 & (lg == torch.round(lg)) & torch.isfinite(lg)


# --------------------------------------------------------------------------- torchao agreement


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("axis", [3, 2])
def test_matches_torchao_bit_for_bit(dtype, rounding, fp8_dtype, axis):
    seed = 1000 * axis + 100 * (dtype == torch.float32) + 10 * (rounding == "ceil") + (fp8_dtype == E4M3)
    x = wide_random((2, 3, 96, 64), dtype, seed=seed)
    q = quantize_mxfp8(x, axis, fp8_dtype=fp8_dtype, scale_rounding=rounding)
    t_data, t_scale = torchao_quantize(x, axis, fp8_dtype, rounding)
    assert q.scale.dtype == torch.float8_e8m0fnu and q.data.dtype == fp8_dtype
    assert q.scale.shape == t_scale.shape and q.data.shape == t_data.shape
    # all scales used: magnitudes really span many binades
    assert u8(q.scale).unique().numel() > 30

    if rounding == "ceil":
        amax = block_amax(x, axis)
        known = torchao_log2_divergence(amax, FMT[fp8_dtype][0])
        diff = u8(q.scale) != u8(t_scale)
        assert not (diff & ~known).any()
        assert torch.equal(u8(q.scale)[diff].int(), u8(t_scale)[diff].int() + 1)
        keep = ~expand_blocks(known, axis, x.shape[axis])
        assert torch.equal(u8(q.data)[keep], u8(t_data)[keep])
    else:
        assert torch.equal(u8(q.scale), u8(t_scale))
        assert torch.equal(u8(q.data), u8(t_data))


def test_torchao_eager_rceil_log2_corner_follows_spec():
    """descale = 2^20 * (1 + 2^-23): the spec (and cvt.rp.satfinite) rounds up to 2^21; torchao's eager
    ceil(log2()) gets 2^20 and saturates. We follow the spec; the test helper recognises the case."""
    amax = torch.nextafter(torch.tensor(448.0 * 2.0**20), torch.tensor(math.inf))
    x = torch.zeros(32)
    x[0] = amax
    q = quantize_mxfp8(x)
    assert u8(q.scale).item() == 127 + 21
    assert q.data[0].float().item() == 224.0  # 448 * (1 + 2^-23) / 2 rounds to 224
    assert torchao_log2_divergence(amax.reshape(1), 448.0).item()
    assert not torchao_log2_divergence(torch.tensor([448.0 * 2.0**20, 1.0, 0.0]), 448.0).any()


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_matches_torchao_on_inf_and_nan(rounding):
    x = wide_random((6, 64), torch.float32, seed=3)
    x[0, 5] = math.inf
    x[1, 40] = -math.inf
    x[2, 0] = 1e38
    x[2, 1] = -math.inf
    x[3, 7] = math.nan
    x[4, 33] = math.nan
    x[4, 34] = math.inf
    q = quantize_mxfp8(x, scale_rounding=rounding)
    t_data, t_scale = torchao_quantize(x, -1, E4M3, rounding)
    assert torch.equal(u8(q.scale), u8(t_scale))
    nan_blk = u8(q.scale) == 255
    assert nan_blk.sum().item() == 2
    # NaN blocks: every element is NaN here (canonical 0x7F); torchao RCEIL agrees, FLOOR NaNs only the NaN.
    assert (u8(q.data)[expand_blocks(nan_blk, 1, 64)] == 0x7F).all()
    other = ~expand_blocks(nan_blk, 1, 64)
    assert torch.equal(u8(q.data)[other], u8(t_data)[other])
    if rounding == "ceil":
        assert torch.equal(u8(q.data), u8(t_data))
        assert u8(q.scale)[0, 0].item() == 254 and u8(q.scale)[1, 1].item() == 254
        assert u8(q.data)[0, 5].item() == 0x7E and u8(q.data)[1, 40].item() == 0xFE  # +-inf -> +-448
        assert q.data[2, 0].float().item() == torch.tensor(x[2, 0].item() * 2.0**-127).to(E4M3).float().item() > 0
    else:
        assert u8(q.scale)[0, 0].item() == 255 - 8  # inf has exponent field 255


# --------------------------------------------------------------------------- ref agreement


def _ref_case(seed, shape, dtype):
    x = wide_random(shape, torch.float32, seed).clamp(-6e4, 6e4).to(dtype)  # fp16-safe range
    flat = x.view(-1)
    flat[:40] = 0.0  # a zero block where rows are >= 32 long along the blocked axis
    flat[100] = math.inf
    flat[200] = -math.inf
    flat[220] = math.nan  # positive NaN: ref's x * NaN keeps the NaN operand's sign
    return x


@pytest.mark.parametrize("shape,axis", [((2, 3, 70, 64), 3), ((2, 3, 70, 64), 2), ((5, 45), 1), ((45, 5), 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_ref_quantizer(shape, axis, dtype):
    x = _ref_case(sum(shape) + axis, shape, dtype)
    q = quantize_mxfp8(x, axis)
    r_data, r_scale = ref_quantize(x, axis)
    assert torch.equal(u8(q.scale), u8(r_scale))
    assert torch.equal(u8(q.data), u8(r_data))
    deq = q.dequantize()
    assert torch.equal(deq.isnan(), ref_dequantize(r_data, r_scale, axis).isnan())
    ok = ~deq.isnan()
    assert torch.equal(deq[ok], ref_dequantize(r_data, r_scale, axis)[ok])


def test_matches_ref_on_tiny_blocks():
    """Blocks with 0 < amax <= 448 * 2^-127 get e = 0 and data x * 2^127 (spec formula) in both."""
    x = torch.tensor([1e-37, -3e-38, 1e-40, 0.0] * 8 + [2e-39] * 32 + [1e-44] * 32)
    q = quantize_mxfp8(x)
    r_data, r_scale = ref_quantize(x)
    assert u8(q.scale).tolist() == [0, 0, 0]
    assert torch.equal(u8(q.scale), u8(r_scale)) and torch.equal(u8(q.data), u8(r_data))
    assert q.data[0].float().item() == torch.tensor(1e-37 * 2.0**127).to(E4M3).float().item() != 0


# --------------------------------------------------------------------------- rule details


def test_zero_block():
    q = quantize_mxfp8(torch.zeros(3, 64, dtype=torch.bfloat16))
    assert (u8(q.scale) == 0).all() and (u8(q.data) == 0).all()
    q = quantize_mxfp8(-torch.zeros(40))
    assert (u8(q.data) == 0x80).all()  # signed zeros are kept
    assert (q.dequantize() == 0).all()


def test_scale_boundaries_ceil():
    # amax exactly 448 * 2^k -> e = 127 + k, max element 448; one ulp above -> e + 1, 224.
    for k in (-126, -20, 0, 7, 100, 127):
        amax = torch.tensor(448.0 * 2.0**k, dtype=torch.float32)
        for a, e_exp, top in ((amax, 127 + k, 448.0),
                              (torch.nextafter(amax, torch.tensor(math.inf)), 128 + k, 224.0)):
            if not math.isfinite(a.item()):
                continue
            x = torch.zeros(32)
            x[3] = -a
            q = quantize_mxfp8(x)
            assert u8(q.scale).item() == min(e_exp, 254), (k, a)
            assert q.data[3].float().item() == -top
    # descale between 2^-127 and 2^-126 (FP32 subnormal): e = 1, elements x * 2^126 exactly.
    x = torch.tensor([320.0 * 2.0**-126] + [2.0**-130] * 31)
    q = quantize_mxfp8(x)
    assert u8(q.scale).item() == 1
    assert q.data[0].float().item() == 320.0 and q.data[1].float().item() == 2.0**-4
    # descale exactly 2^-127 -> e = 0, elements x * 2^127
    q = quantize_mxfp8(torch.tensor([448.0 * 2.0**-127, 2.0**-130]))
    assert u8(q.scale).item() == 0
    assert q.data.float().tolist() == [448.0, 0.125]


def test_floor_rule_and_saturation():
    x = torch.tensor([500.0, 1.0, -3.0] + [0.0] * 29 + [200.0, 1.0])
    q = quantize_mxfp8(x, scale_rounding="floor")
    # floor: e = exponent(amax) - 8; 500 = 1.95 * 2^8 -> e = 127, 500 saturates to 448
    assert u8(q.scale).tolist() == [127, 126]
    assert q.data[0].float().item() == 448.0 and q.data[2].float().item() == -3.0
    assert q.data[32].float().item() == 384.0  # 200 * 2 = 400: tie of 384 / 416 -> even 384
    c = quantize_mxfp8(x)  # ceil: 500/448 -> e = 128, 250 -> 256 (spacing 16)
    assert u8(c.scale).tolist() == [128, 126]
    assert c.data[0].float().item() == 256.0 and c.data[32].float().item() == 384.0
    e5 = quantize_mxfp8(torch.tensor([1e5, math.inf, 1.0]), fp8_dtype=E5M2, scale_rounding="floor")
    assert u8(e5.scale).item() == 255 - 15
    assert e5.data[1].float().item() == 57344.0  # saturating, not inf


def test_e5m2():
    x = torch.tensor([57344.0 * 4, -1.0, math.inf, 3.0])
    q = quantize_mxfp8(x, fp8_dtype=E5M2)
    assert q.data.dtype == E5M2 and u8(q.scale).item() == 254
    assert q.data[2].float().item() == 57344.0  # inf saturates to the finite max
    q = quantize_mxfp8(x[:2], fp8_dtype=E5M2)
    assert u8(q.scale).item() == 129 and q.data.float().tolist() == [57344.0, -0.25]
    q = quantize_mxfp8(torch.tensor([math.nan, 1.0]), fp8_dtype=E5M2)
    assert u8(q.scale).item() == 255 and q.dequantize().isnan().all()


def test_nan_block_isolated_and_canonical():
    x = torch.randn(4, 96)
    x[1, 40] = -math.nan
    x[2, 0] = math.nan
    x[2, 1] = math.inf
    q = quantize_mxfp8(x)
    s = u8(q.scale)
    assert s[1, 1].item() == 255 and s[2, 0].item() == 255 and (s == 255).sum().item() == 2
    assert (u8(q.data)[1, 32:64] == 0x7F).all() and (u8(q.data)[2, :32] == 0x7F).all()
    deq = q.dequantize()
    assert deq.isnan().sum().item() == 64
    clean = quantize_mxfp8(x[0:1])
    assert torch.equal(u8(q.data[0:1]), u8(clean.data))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_subnormal_inputs(dtype):
    tiny = torch.finfo(dtype).smallest_normal
    x = torch.tensor([tiny / 4, -tiny / 2, tiny / 8] * 11, dtype=dtype)  # 33 elements, all subnormal
    q = quantize_mxfp8(x)
    assert q.scale.shape == (2,)
    amax = block_amax(x, 0)
    for b in range(2):
        expected = quantize_mxfp8(torch.tensor([amax[b].item()]))  # scale depends on amax only
        assert u8(q.scale)[b].item() == u8(expected.scale).item()
    # the error bound holds there too
    assert ((q.dequantize() - x.float()).abs() <= x.float().abs() * 2.0**-4 + 2.0**-149).all()


@pytest.mark.parametrize("n", [1, 31, 32, 33, 95, 100])
@pytest.mark.parametrize("axis", [0, 1])
def test_lengths_pad_with_zeros(n, axis):
    shape = [5, 5]
    shape[axis] = n
    x = wide_random(tuple(shape), torch.float32, seed=n)
    q = quantize_mxfp8(x, axis)
    nb = -(-n // 32)
    assert q.scale.shape[axis] == nb and q.scale.is_contiguous()
    pad = [0, 0, 0, 0]
    pad[3 - 2 * axis] = nb * 32 - n
    qp = quantize_mxfp8(torch.nn.functional.pad(x, pad), axis)
    assert torch.equal(u8(q.scale), u8(qp.scale))
    assert torch.equal(u8(q.data), u8(qp.data.narrow(axis, 0, n)))


def test_empty_axis_and_empty_batch():
    q = quantize_mxfp8(torch.zeros(3, 0))
    assert q.data.shape == (3, 0) and q.scale.shape == (3, 0)
    q = quantize_mxfp8(torch.zeros(0, 64))
    assert q.data.shape == (0, 64) and q.scale.shape == (0, 2)
    assert q.dequantize().shape == (0, 64)


def test_fp16_input_equals_fp32_of_same_values():
    x = wide_random((4, 8, 96), torch.float32, seed=7).clamp(-60000, 60000).half()
    for axis in (1, 2):
        a, b = quantize_mxfp8(x, axis), quantize_mxfp8(x.float(), axis)
        assert torch.equal(u8(a.scale), u8(b.scale)) and torch.equal(u8(a.data), u8(b.data))


# --------------------------------------------------------------------------- layout / API


def test_data_keeps_dense_strides_and_axis_normalised():
    base = wide_random((2, 70, 3, 64), torch.bfloat16, seed=11)  # BSHD storage
    x = base.permute(0, 2, 1, 3)  # [B,H,S,D] view
    for axis in (-1, -2, 3, 2):
        q = quantize_mxfp8(x, axis)
        assert q.axis == axis % 4
        assert q.data.stride() == x.stride()
        assert q.scale.is_contiguous()
        ref = quantize_mxfp8(x.contiguous(), axis)
        assert torch.equal(u8(q.data), u8(ref.data)) and torch.equal(u8(q.scale), u8(ref.scale))
    assert q.shape == x.shape and q.device == x.device and q.fp8_dtype == E4M3


def test_non_dense_input_gives_contiguous_data():
    big = wide_random((8, 128), torch.float32, seed=5)
    for x in (big[::2, :96], big[:, ::2], big[:1].expand(4, 128)):
        q = quantize_mxfp8(x)
        assert q.data.is_contiguous()
        ref = quantize_mxfp8(x.contiguous())
        assert torch.equal(u8(q.data), u8(ref.data)) and torch.equal(u8(q.scale), u8(ref.scale))


def test_rank1_and_rank5():
    x = wide_random((3, 2, 40, 2, 33), torch.float32, seed=9)
    for axis in range(5):
        q = quantize_mxfp8(x, axis)
        ref = quantize_mxfp8(x.movedim(axis, -1).contiguous(), -1)
        assert torch.equal(u8(q.scale), u8(ref.scale).movedim(-1, axis))
        assert torch.equal(u8(q.data), u8(ref.data).movedim(-1, axis))
    assert quantize_mxfp8(x.reshape(-1)).scale.shape == (-(-x.numel() // 32),)


@pytest.mark.parametrize("n", [32, 45])
def test_dequantize_matches_formula(n):
    x = wide_random((3, n), torch.float32, seed=n)
    q = quantize_mxfp8(x)
    e = expand_blocks(u8(q.scale).double(), 1, n)
    expected = q.data.double() * torch.exp2(e - 127)
    assert torch.equal(q.dequantize(torch.float64), expected)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(q.dequantize(torch.bfloat16), expected.float().bfloat16())


def test_e8m0_helpers_all_bytes():
    b = torch.arange(256, dtype=torch.uint8)
    f = e8m0_to_float(b)
    assert f[255].isnan()
    assert torch.equal(f[:255].double(), torch.exp2(torch.arange(255, dtype=torch.float64) - 127))
    assert torch.equal(f[:255], b.view(torch.float8_e8m0fnu).float()[:255])
    assert torch.equal(scale_exponent_bytes(b.view(torch.float8_e8m0fnu)), b)


def test_mxfp8tensor_validation():
    q = quantize_mxfp8(torch.randn(4, 64))
    MXFP8Tensor(q.data, q.scale, -1)  # fine; axis normalised
    assert MXFP8Tensor(q.data, q.scale, -1).axis == 1
    with pytest.raises(TypeError, match="scale"):
        MXFP8Tensor(q.data, u8(q.scale), 1)
    with pytest.raises(TypeError, match="data"):
        MXFP8Tensor(q.data.float(), q.scale, 1)
    with pytest.raises(ValueError, match="scale shape"):
        MXFP8Tensor(q.data, q.scale, 0)
    with pytest.raises(ValueError, match="axis"):
        MXFP8Tensor(q.data, q.scale, 2)
    with pytest.raises(TypeError, match="dtype"):
        q.dequantize(torch.int32)


def test_bad_inputs():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_mxfp8(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_mxfp8(x.to(E4M3))
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_mxfp8(torch.zeros(4, 64, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_mxfp8(x.double())
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_mxfp8([1.0, 2.0])
    with pytest.raises(ValueError, match="x must have rank >= 1"):
        quantize_mxfp8(torch.tensor(1.0))
    with pytest.raises(ValueError, match="axis"):
        quantize_mxfp8(x, 2)
    with pytest.raises(ValueError, match="axis"):
        quantize_mxfp8(x, -3)
    with pytest.raises(TypeError, match="axis"):
        quantize_mxfp8(x, 1.0)
    with pytest.raises(ValueError, match="scale_rounding"):
        quantize_mxfp8(x, scale_rounding="rceil")
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize_mxfp8(x, fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize_mxfp8(x, fp8_dtype=torch.float8_e4m3fnuz)


# --------------------------------------------------------------------------- F8_128x4 swizzle


def spec_offsets(M, K):
    """Byte offset of every (m, k) inside a slab, straight from spec section 4."""
    Mp, Kp = swizzled_scale_shape(M, K)
    m = torch.arange(M).unsqueeze(1)
    k = torch.arange(K).unsqueeze(0)
    return ((m // 128) * (Kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


@pytest.mark.parametrize("M", [1, 127, 128, 129, 500])
@pytest.mark.parametrize("K", [1, 3, 4, 5, 6])
def test_swizzle_matches_to_blocked_and_spec(M, K):
    g = torch.Generator().manual_seed(M * 10 + K)
    s = torch.randint(1, 255, (2, 3, M, K), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    buf = swizzle_128x4(s)
    Mp, Kp = swizzled_scale_shape(M, K)
    assert buf.shape == (2, 3, Mp, Kp) and buf.dtype == torch.float8_e8m0fnu and buf.is_contiguous()
    off = spec_offsets(M, K).reshape(-1)
    for b in range(2):
        for h in range(3):
            slab = u8(buf[b, h]).reshape(-1)
            assert torch.equal(slab, to_blocked(u8(s[b, h])))
            assert torch.equal(slab[off], u8(s[b, h]).reshape(-1))
            pad = torch.ones(Mp * Kp, dtype=torch.bool)
            pad[off] = False
            assert (slab[pad] == 0).all()
    # slabs follow each other in (b, h) order
    flat = u8(buf).reshape(-1)
    assert torch.equal(flat[Mp * Kp * 4 + off], u8(s[1, 1]).reshape(-1))
    back = unswizzle_128x4(buf, M, K)
    assert back.dtype == s.dtype and back.is_contiguous() and torch.equal(u8(back), u8(s))


def test_swizzle_seed_example_and_uint8_and_views():
    q = quantize_mxfp8(wide_random((2, 2, 500, 192), torch.bfloat16, seed=1))
    assert q.scale.shape == (2, 2, 500, 6)
    buf = swizzle_128x4(q.scale)
    assert buf.shape == (2, 2, 512, 8)
    assert torch.equal(swizzle_128x4(u8(q.scale)), u8(buf))  # uint8 in -> uint8 out, same bytes
    assert swizzle_128x4(u8(q.scale)).dtype == torch.uint8
    # column-wise (V) scales: M = D, K = ceil(S/32): the transpose of the compact scale, a view
    v = quantize_mxfp8(wide_random((2, 2, 300, 64), torch.bfloat16, seed=2), 2)
    vt = v.scale.transpose(-1, -2)
    assert vt.shape == (2, 2, 64, 10)
    assert torch.equal(u8(swizzle_128x4(vt)), u8(swizzle_128x4(vt.contiguous())))
    assert torch.equal(u8(unswizzle_128x4(swizzle_128x4(vt), 64, 10)), u8(vt))


def test_swizzle_bad_inputs():
    with pytest.raises(ValueError, match="scale must have rank >= 2"):
        swizzle_128x4(torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="scale must have dtype"):
        swizzle_128x4(torch.zeros(5, 4))
    with pytest.raises(TypeError, match="scale must be a torch.Tensor"):
        swizzle_128x4([[1]])
    buf = swizzle_128x4(torch.zeros(2, 130, 5, dtype=torch.uint8))
    assert buf.shape == (2, 256, 8)
    with pytest.raises(ValueError, match="M=100"):
        unswizzle_128x4(buf, 100, 5)
    with pytest.raises(ValueError, match="K=9"):
        unswizzle_128x4(buf, 130, 9)
    with pytest.raises(ValueError, match="K must be"):
        unswizzle_128x4(buf, 130, -1)
    with pytest.raises(ValueError, match="buf must have rank >= 2"):
        unswizzle_128x4(buf.reshape(-1), 130, 5)
    with pytest.raises(TypeError, match="buf must have dtype"):
        unswizzle_128x4(buf.float(), 130, 5)


# --------------------------------------------------------------------------- properties (hypothesis)

finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
PROP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def blocks(draw):
    vals = draw(st.lists(finite_f32, min_size=1, max_size=80))
    shift = draw(st.integers(-40, 40))  # move whole tensors across binades
    x = torch.tensor(vals, dtype=torch.float64) * 2.0**shift
    x = x.clamp(-3.0e38, 3.0e38).float()
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    if dtype == torch.bfloat16:
        x = x.clamp(-3.0e38, 3.0e38).bfloat16()
        x = torch.where(x.isinf(), torch.zeros_like(x), x)
    return x


def _per_element(q):
    return expand_blocks(u8(q.scale).long(), 0, q.shape[0])


@PROP
@given(x=blocks(), fp8=st.sampled_from([E4M3, E5M2]), rounding=st.sampled_from(["ceil", "floor"]))
def test_property_error_bound(x, fp8, rounding):
    fmax, emax, mbits, emin = FMT[fp8]
    q = quantize_mxfp8(x, fp8_dtype=fp8, scale_rounding=rounding)
    e = _per_element(q)
    assert (e <= 254).all()
    x64 = x.double()
    v = x64 * torch.exp2((127 - e).double())  # exact scaled value
    av = v.abs()
    expo = (torch.frexp(av).exponent - 1).double()  # exact floor(log2(av)) for av > 0
    expo = torch.where(av == 0, float(emin), expo).clamp(min=emin)
    half_ulp = torch.exp2(expo - mbits - 1)
    bound_scaled = torch.where(av > fmax, av - fmax, half_ulp)  # saturation error beyond fmax
    err = (q.dequantize(torch.float64) - x64).abs()
    assert (err <= bound_scaled * torch.exp2((e - 127).double())).all()
    if rounding == "ceil":
        assert (av <= fmax).all()  # round-up scale never saturates finite data


@PROP
@given(x=blocks(), fp8=st.sampled_from([E4M3, E5M2]), rounding=st.sampled_from(["ceil", "floor"]))
def test_property_scale_is_the_power_of_two_the_rule_asks(x, fp8, rounding):
    fmax, emax, _, _ = FMT[fp8]
    q = quantize_mxfp8(x, fp8_dtype=fp8, scale_rounding=rounding)
    e = u8(q.scale).long()
    s = e8m0_to_float(q.scale).double()
    assert torch.equal(s, torch.exp2((e - 127).double()))  # exact powers of two
    amax = block_amax(x, 0).double()
    if rounding == "ceil":
        # smallest power of two >= amax / fmax (amax / fmax rounded to FP32 first), at least 2^-127
        d = (amax.float() / fmax).double()
        assert (d <= s).all()
        assert ((e == 0) | (d > s / 2)).all()
    else:
        normal = amax >= 2.0**-126
        lo = torch.exp2((e - 127 + emax).double())
        assert (~normal | (e == 0) | ((lo <= amax) & (amax < 2 * lo))).all()
        assert (normal | (e == 0)).all()


@PROP
@given(x=blocks(), fp8=st.sampled_from([E4M3, E5M2]), rounding=st.sampled_from(["ceil", "floor"]))
def test_property_requantize_is_identity(x, fp8, rounding):
    fmax = FMT[fp8][0]
    q = quantize_mxfp8(x, fp8_dtype=fp8, scale_rounding=rounding)
    deq = q.dequantize()
    q2 = quantize_mxfp8(deq, fp8_dtype=fp8, scale_rounding=rounding)
    assert torch.equal(q2.dequantize(), deq)  # values always survive
    # bits too, except (ceil) a block whose max |q| is exactly fmax/2: it moves down one binade
    qmax = block_amax(q.data.float(), 0)
    e1, e2 = u8(q.scale).long(), u8(q2.scale).long()
    half = (qmax == fmax / 2) & (e1 > 0) & (rounding == "ceil")
    assert torch.equal(e2[~half], e1[~half])
    assert torch.equal(e2[half], e1[half] - 1)
    same = ~expand_blocks(half, 0, x.shape[0])
    assert torch.equal(u8(q2.data)[same], u8(q.data)[same])
    assert torch.equal(q2.data.float()[~same], 2 * q.data.float()[~same])


@pytest.mark.parametrize("axis", [0, 2])
def test_segmented_tensors_restart_blocks_at_every_segment(axis):
    """Blocks of a segmented axis restart at each segment start (empty segments included): every segment's data,
    scales (from row `segment_block_start`) and dequantization are those of the segment quantized alone, the
    scale rows no segment uses hold byte 0, and `dequantize` (which gathers each element's scale row on the
    device, `segment_rows`) equals the segments' dequantizations side by side."""
    from mxattn.formats import segment_block_start, segment_rows
    lengths = [0, 5, 40, 0, 33, 1, 64]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t = int(cu[-1])
    shape = (t, 3, 64) if axis == 0 else (1, 3, t, 64)
    x = wide_random(shape, torch.float32, seed=11)
    q = quantize_mxfp8(x, axis=axis, segments=cu)
    assert q.scale.shape[axis] == t // 32 + len(lengths) and q.segments.dtype == torch.int32
    used = torch.zeros(q.scale.shape[axis], dtype=torch.bool)
    pieces = []
    for b, n in enumerate(lengths):
        start = int(cu[b])
        alone = quantize_mxfp8(x.narrow(axis, start, n), axis=axis) if n else None
        part = q.segment(b)
        if alone is not None:
            assert torch.equal(u8(part.data), u8(alone.data)) and torch.equal(u8(part.scale), u8(alone.scale))
            pieces.append(alone.dequantize())
            used[segment_block_start(start, b):segment_block_start(start, b) + alone.scale.shape[axis]] = True
    assert (u8(q.scale).movedim(axis, 0)[~used] == 0).all()
    assert torch.equal(q.dequantize(), torch.cat(pieces, dim=axis))
    seg, block0, within = segment_rows(cu, t)
    assert seg.tolist() == [b for b, n in enumerate(lengths) for _ in range(n)]
    assert torch.equal(cu.long()[seg] + within, torch.arange(t)) and torch.equal(block0, cu.long()[seg] // 32 + seg)
