"""MXFP8 number formats: block quantization and the F8_128x4 scale layout.

MXFP8 stores a tensor as FP8 elements plus one power-of-two scale per block of
32 consecutive elements along one axis.  The scale is an E8M0 byte ``e``
(``torch.float8_e8m0fnu``) meaning ``2**(e - 127)``; ``e == 255`` is NaN.

Quantization rule (spec section 2, "round-up" / RCEIL, the default)
-------------------------------------------------------------------
For each block, ``amax = max |x|`` (exact, in FP32) and ``descale = amax / fmax``
rounded to FP32, with ``fmax`` = 448 for E4M3 and 57344 for E5M2.

* ``e`` = the FP32 biased exponent field of ``descale``, plus 1 if any mantissa
  bit is set (round up to a power of two), clamped to ``[0, 254]``.  This is
  computed with integer bit operations, so it is exact.  ``descale <= 2**-127``
  (including an all-zero block) gives ``e = 0``.
* A NaN anywhere in the block gives ``e = 255`` and every element of the block
  becomes the canonical FP8 NaN (byte ``0x7F``).
* Infinity: ``amax = inf`` gives ``descale = inf`` whose exponent field 255 is
  clamped to ``e = 254``; the elements are then scaled like any other block, so
  ``+-inf`` saturates to ``+-fmax`` and finite neighbours are multiplied by
  ``2**-127`` (which rounds them to +-0 unless they are huge).  This is exactly
  what torchao 0.18's ``ScaleCalculationMode.RCEIL`` produces (its eager path
  special-cases inf to byte 254 and multiplies by ``2**-127``; its Blackwell
  path uses ``cvt.rp.satfinite.ue8m0x2.f32``, which also maps inf to 254).
* Elements: ``q = RNE_saturate(x * 2**(127 - e))``; the power-of-two
  multiplication is exact (multiplier built from bits), values are clamped to
  ``+-fmax`` before the round-to-nearest-even cast.  This holds for ``e == 0``
  too (multiplier ``2**127``): an all-zero block gets zero data, a block of tiny
  values (``0 < amax <= fmax * 2**-127``, about 1.3e-36 for E4M3) keeps them
  as ``x * 2**127``.  torchao and Transformer Engine use the multiplier 1.0 for
  ``e == 0`` instead, which flushes such tiny blocks to +-0; only those
  denormal-range blocks differ (the ``ref`` package follows the spec as here).
* Dequantized value: ``float(q) * 2**(e - 127)``.

Known difference from torchao's *eager* RCEIL emulation: it takes
``ceil(torch.log2(descale))`` in floating point, which returns ``k`` instead of
``k + 1`` when ``descale`` lies a few ULPs above ``2**k`` (FP32 inputs only;
BF16/FP16 amax values can never get that close).  Here the bit rule of the spec
(= the hardware instruction) is followed; torchao then saturates the block max.

``scale_rounding="floor"`` is the OCP MX rule, an opt-in for numerics studies:
``e = clamp(exponent_field(amax) - emax_elem, 0, 254)`` (``emax_elem`` = 8 for
E4M3, 15 for E5M2; NaN -> 255, inf -> exponent field 255), matching torchao's
``ScaleCalculationMode.FLOOR``.  Its block maximum may exceed ``fmax`` and then
saturates.  Differences from torchao FLOOR, both outside normal-range data:
``e == 0`` blocks (amax < 2**-118 for E4M3) are multiplied by ``2**127`` here as
the rule says (torchao divides by its clamped scale 2**-126, so its data
dequantize to half the value), and NaN blocks are all NaN here (torchao keeps
only the NaN elements NaN and zeros the others; the scale byte 255 makes the
whole block NaN on dequantization either way).

Blocks run along ``axis``; a length not divisible by 32 pads the last block with
zeros (its scale comes from the real values only).

Segmented tensors (packed variable-length batches, TE's ``thd``): with ``segments`` (int32 cumulative offsets
``[B+1]`` along ``axis``, starting at 0 and ending at n) blocks restart at every segment start, each segment's
last block padded with zeros as above. The scale axis then has ``n // 32 + B`` block rows, segment b's
blocks starting at row ``segments[b] // 32 + b`` (`segment_block_start`; never overlapping, since
``floor((a + l) / 32) - floor(a / 32) + 1 >= ceil(l / 32)``); rows no segment uses hold byte 0.

F8_128x4 layout (spec section 4): for one slab of compact scales ``[M, K]`` (M the
non-contracting axis, K the scale blocks of the contracting axis), pad to
``Mp = ceil(M/128)*128``, ``Kp = ceil(K/4)*4`` with zero bytes; byte (m, k) goes
to offset ``((m//128)*(Kp//4) + k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch

from .constants import INPUT_DTYPES, MX_BLOCK, ceil_div

__all__ = [
    "cat_bytes",
    "BLOCK_SIZE",
    "MXFP8Tensor",
    "quantize_mxfp8",
    "e8m0_to_float",
    "scale_exponent_bytes",
    "swizzle_128x4",
    "unswizzle_128x4",
    "swizzled_scale_shape",
    "scale_shape",
    "segment_block_start",
    "segment_rows",
    "segmented_scale_rows",
]

BLOCK_SIZE = MX_BLOCK  # the MXFP8 block size under this module's public name

# fp8 element dtype -> (largest finite value, exponent of its largest power of two)
_FP8_FORMATS = {
    torch.float8_e4m3fn: (448.0, 8),
    torch.float8_e5m2: (57344.0, 15),
}
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
_ROUNDINGS = ("ceil", "floor")
_FP32_2POW_M127_BITS = 0x00400000  # bit pattern of 2**-127 (an FP32 subnormal)
_FP32_QNAN_BITS = 0x7FC00000
_FP8_NAN_BYTE = 0x7F  # canonical NaN for both E4M3FN and E5M2


def cat_bytes(tensors, dim: int) -> torch.Tensor:
    """torch.cat of tensors of one 1-byte dtype (E4M3 data, E8M0 scales) through uint8 views: CUDA's cat has no
    kernel for float8_e8m0fnu in every case (strided slices), and a byte copy is what it would do."""
    dtype = tensors[0].dtype
    return torch.cat([t.view(torch.uint8) for t in tensors], dim=dim).view(dtype)


def _normalize_axis(axis, ndim: int, arg: str = "axis") -> int:
    if isinstance(axis, bool) or not hasattr(type(axis), "__index__"):
        raise TypeError(f"{arg} must be an int, got {type(axis).__name__}")
    axis = operator.index(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{arg}={axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def segment_block_start(offset: int, index: int) -> int:
    """First scale row of the segment `index` that starts at element `offset` of a segmented axis."""
    return offset // BLOCK_SIZE + index


def segmented_scale_rows(n: int, n_segments: int) -> int:
    """Scale rows of a segmented axis of length n split into n_segments segments."""
    return n // BLOCK_SIZE + n_segments


def scale_shape(shape, axis: int, segments: Optional[torch.Tensor] = None) -> tuple:
    """The compact scale shape of data of `shape` blocked along `axis` (non-negative): the axis's length n
    replaced by ceil(n / 32), or by `segmented_scale_rows` with `segments`."""
    out = list(shape)
    out[axis] = segmented_scale_rows(out[axis], segments.numel() - 1) if segments is not None else \
        ceil_div(out[axis], BLOCK_SIZE)
    return tuple(out)


def segment_rows(segments: torch.Tensor, n: int):
    """(segment, the segment's first block row, position in the segment) of each of the n elements of an axis
    split by `segments` (int32 [B+1], 0 .. n), as int64 tensors [n] on the segments' device: element i lies in
    segment b (segments[b] <= i < segments[b+1]), whose blocks start at scale row
    `segment_block_start(segments[b], b)`; its own block is that row + (i - segments[b]) // 32. No host copy."""
    cu = segments.to(torch.int64)
    rows = torch.arange(n, device=cu.device)
    seg = torch.searchsorted(cu, rows, right=True) - 1
    start = cu[seg]
    return seg, segment_block_start(start, seg), rows - start


def _is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """True when t's elements occupy exactly numel() slots without gaps or overlap."""
    if t.numel() == 0:
        return False
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:  # loop over dimensions, not elements
        if st != expected:
            return False
        expected *= sz
    return True


def _bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (float8_e8m0fnu or uint8, any shape) -> float32 2**(e-127), same shape.

    Byte 0 gives 2**-127 (an FP32 subnormal), byte 255 gives NaN; exact.
    """
    e = scale_exponent_bytes(scale).to(torch.int32)
    bits = torch.where(e == 0, _FP32_2POW_M127_BITS, e << 23)
    bits = torch.where(e == 255, _FP32_QNAN_BITS, bits)
    return _bits_to_float(bits)


def scale_exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or uint8) scale tensor -> its uint8 view (the biased exponents), same shape."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype not in _SCALE_DTYPES:
        raise TypeError(f"scale must have dtype torch.float8_e8m0fnu or torch.uint8, got {scale.dtype}")
    return scale.view(torch.uint8)


@dataclass
class MXFP8Tensor:
    """An MXFP8-quantized tensor.

    data:  fp8 (float8_e4m3fn or float8_e5m2), the original tensor's shape.
    scale: float8_e8m0fnu, the shape of data with ``axis`` replaced by ceil(n/32), contiguous.
    axis:  non-negative int, the axis the blocks of 32 run along.
    segments: None, or int32 [B+1] cumulative segment offsets along ``axis`` (packed variable-length
           batches): blocks restart at every segment start and scale has ``n // 32 + B`` rows along ``axis``
           (module docstring).
    scale_f8_128x4: None, or the same scales already in the F8_128x4 byte order the cuDNN graph reads, as
           `mxattn.backends.cudnn.buffers` makes it from ``scale`` (``row_scale_buffer`` for blocks along D,
           ``col_scale_bytes`` along S); the fused Triton quantizer writes both.
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    segments: Optional[torch.Tensor] = None
    scale_f8_128x4: Optional[torch.Tensor] = None

    def __post_init__(self):
        if not isinstance(self.data, torch.Tensor) or self.data.dtype not in _FP8_FORMATS:
            got = self.data.dtype if isinstance(self.data, torch.Tensor) else type(self.data).__name__
            raise TypeError(f"data must be a float8_e4m3fn or float8_e5m2 tensor, got {got}")
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float8_e8m0fnu:
            got = self.scale.dtype if isinstance(self.scale, torch.Tensor) else type(self.scale).__name__
            raise TypeError(f"scale must be a float8_e8m0fnu tensor, got {got}")
        if self.data.dim() == 0:
            raise ValueError("data must have rank >= 1")
        self.axis = _normalize_axis(self.axis, self.data.dim())
        expected = scale_shape(self.data.shape, self.axis, self.segments)
        if tuple(self.scale.shape) != expected:
            raise ValueError(
                f"scale shape {tuple(self.scale.shape)} does not match data shape "
                f"{tuple(self.data.shape)} blocked along axis {self.axis}: expected {tuple(expected)}"
            )

    @classmethod
    def unchecked(cls, data: torch.Tensor, scale: torch.Tensor, axis: int,
                  segments: Optional[torch.Tensor] = None,
                  scale_f8_128x4: Optional[torch.Tensor] = None) -> "MXFP8Tensor":
        """The same object without `__post_init__`'s checks, for parts this package's quantizers just made
        (axis non-negative, shapes and dtypes consistent by construction): the checks cost host time on every
        attention call."""
        t = cls.__new__(cls)
        t.data, t.scale, t.axis, t.segments, t.scale_f8_128x4 = data, scale, axis, segments, scale_f8_128x4
        return t

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.data.dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * 2**(scale - 127) as ``dtype`` (computed exactly in FP32, then cast), data's shape."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype}")
        if self.segments is not None:  # each element's scale row gathered (no host copy of the segments)
            ax, n = self.axis, self.data.shape[self.axis]
            _, block0, within = segment_rows(self.segments.to(self.data.device), n)
            s = e8m0_to_float(self.scale).index_select(ax, block0 + within // BLOCK_SIZE)
            return (self.data.float() * s).to(dtype)
        ax, n = self.axis, self.data.shape[self.axis]
        s = e8m0_to_float(self.scale)
        if n % BLOCK_SIZE == 0:
            nb = n // BLOCK_SIZE
            out = self.data.unflatten(ax, (nb, BLOCK_SIZE)).float() * s.unsqueeze(ax + 1)
            out = out.flatten(ax, ax + 1)
        else:
            s = s.repeat_interleave(BLOCK_SIZE, dim=ax).narrow(ax, 0, n)
            out = self.data.float() * s
        return out.to(dtype)


    def segment(self, index: int, offsets=None) -> "MXFP8Tensor":
        """Segment `index` of a segmented tensor as an ordinary MXFP8Tensor (views, no copy).
        offsets: the segments as a Python list (saves a device-to-host copy per call)."""
        if self.segments is None:
            raise ValueError("segment() needs a segmented MXFP8Tensor (segments is None)")
        offsets = self.segments.tolist() if offsets is None else offsets
        start, stop = offsets[index], offsets[index + 1]
        rows = ceil_div(stop - start, BLOCK_SIZE)
        return MXFP8Tensor(self.data.narrow(self.axis, start, stop - start),
                           self.scale.narrow(self.axis, segment_block_start(start, index), rows), self.axis)


def _block_exponent(amax: torch.Tensor, fmax: float, emax: int, rounding: str) -> torch.Tensor:
    """Per-block amax (float32, >= 0 or NaN) -> biased E8M0 exponent as int32."""
    if rounding == "ceil":
        descale = amax / fmax  # FP32, round to nearest even
        bits = descale.view(torch.int32)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        e = torch.where(bits <= _FP32_2POW_M127_BITS, 0, e).clamp_(max=254)
        return torch.where(torch.isnan(descale), 255, e)
    bits = amax.view(torch.int32)
    e = (((bits >> 23) & 0xFF) - emax).clamp_(min=0, max=254)
    return torch.where(torch.isnan(amax), 255, e)


def _element_multiplier(e: torch.Tensor) -> torch.Tensor:
    """Biased exponent (int32, 0..255) -> float32 2**(127-e), exact (e == 254: the subnormal 2**-127).

    e == 255 (NaN block) gives 0; those blocks are overwritten with NaN afterwards.
    """
    bits = torch.where(e >= 254, _FP32_2POW_M127_BITS, (254 - e) << 23)
    bits = torch.where(e == 255, 0, bits)
    return _bits_to_float(bits)


@torch.no_grad()
def quantize_mxfp8(
    x: torch.Tensor,
    axis: int = -1,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_rounding: str = "ceil",
    segments: Optional[torch.Tensor] = None,
) -> MXFP8Tensor:
    """Quantize x to MXFP8 with blocks of 32 along ``axis`` (rule: module docstring).

    x: bfloat16/float16/float32, rank >= 1, any strides, CPU or CUDA.
    Returns MXFP8Tensor with data ``fp8_dtype`` of x's shape (x's strides when x is
    non-overlapping and dense, else contiguous) and scale float8_e8m0fnu of x's shape
    with ``axis`` replaced by ceil(n/32) (contiguous).
    ``scale_rounding``: "ceil" (spec / RCEIL, default) or "floor" (OCP MX).
    ``segments``: None, or int32 [B+1] cumulative offsets along ``axis`` (0 .. n): blocks restart at every
    segment start (packed variable-length batches); the scale then has ``n // 32 + B`` rows along ``axis``
    (module docstring). Costs one small device-to-host copy of the offsets.
    """
    if segments is not None:
        return _quantize_segmented(x, axis, segments, fp8_dtype=fp8_dtype, scale_rounding=scale_rounding)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must have dtype bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have rank >= 1, got a 0-d tensor")
    ax = _normalize_axis(axis, x.dim())
    if fp8_dtype not in _FP8_FORMATS:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if scale_rounding not in _ROUNDINGS:
        raise ValueError(f"scale_rounding must be 'ceil' or 'floor', got {scale_rounding!r}")
    fmax, emax = _FP8_FORMATS[fp8_dtype]

    n = x.shape[ax]
    nb = ceil_div(n, BLOCK_SIZE)
    pad = nb * BLOCK_SIZE - n
    xp = x
    if pad:
        zshape = list(x.shape)
        zshape[ax] = pad
        xp = torch.cat([x, x.new_zeros(zshape)], dim=ax)
    xu = xp.unflatten(ax, (nb, BLOCK_SIZE))  # always a view

    amax = torch.linalg.vector_norm(xu, ord=float("inf"), dim=ax + 1).float()  # exact; NaN propagates
    e = _block_exponent(amax, fmax, emax, scale_rounding)
    nan_block = (e == 255).unsqueeze(ax + 1)
    scaled = torch.mul(xu, _element_multiplier(e).unsqueeze(ax + 1))  # float32, exact
    scaled.clamp_(-fmax, fmax)  # saturate (NaN stays NaN); the cast below rounds to nearest even

    if _is_non_overlapping_and_dense(x):
        data = torch.empty_strided(x.shape, x.stride(), dtype=fp8_dtype, device=x.device)
    else:
        data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    if pad:
        qu = scaled.to(fp8_dtype)
        qu.view(torch.uint8).masked_fill_(nan_block, _FP8_NAN_BYTE)
        data.copy_(qu.flatten(ax, ax + 1).narrow(ax, 0, n))
    else:
        qu = data.unflatten(ax, (nb, BLOCK_SIZE))
        qu.copy_(scaled)
        qu.view(torch.uint8).masked_fill_(nan_block, _FP8_NAN_BYTE)

    scale = e.to(torch.uint8).contiguous().view(torch.float8_e8m0fnu)
    return MXFP8Tensor(data=data, scale=scale, axis=ax)


def _quantize_segmented(x, axis, segments, **kw) -> MXFP8Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise TypeError("x must be a torch.Tensor of rank >= 1")
    ax = _normalize_axis(axis, x.dim())
    if not isinstance(segments, torch.Tensor) or segments.dim() != 1 or segments.numel() < 2 \
            or segments.dtype not in (torch.int32, torch.int64):
        raise ValueError("segments must be a 1-D int32 tensor of B + 1 >= 2 cumulative offsets")
    offsets = segments.tolist()
    if offsets[0] != 0 or offsets[-1] != x.shape[ax] or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"segments must rise from 0 to the length {x.shape[ax]} of axis {ax}, got {offsets}")
    n_seg = len(offsets) - 1
    sshape = list(x.shape)
    sshape[ax] = segmented_scale_rows(x.shape[ax], n_seg)
    scale = torch.zeros(sshape, dtype=torch.uint8, device=x.device)
    if _is_non_overlapping_and_dense(x):
        data = torch.empty_strided(x.shape, x.stride(), dtype=kw["fp8_dtype"], device=x.device)
    else:
        data = torch.empty(x.shape, dtype=kw["fp8_dtype"], device=x.device)
    for b in range(n_seg):
        start, stop = offsets[b], offsets[b + 1]
        if stop == start:
            continue
        part = quantize_mxfp8(x.narrow(ax, start, stop - start), ax, **kw)
        data.narrow(ax, start, stop - start).copy_(part.data)
        scale.narrow(ax, segment_block_start(start, b), part.scale.shape[ax]).copy_(part.scale.view(torch.uint8))
    return MXFP8Tensor(data=data, scale=scale.view(torch.float8_e8m0fnu), axis=ax,
                       segments=segments.to(torch.int32))


def swizzled_scale_shape(M: int, K: int) -> tuple[int, int]:
    """(M, K) compact scale dims -> padded (Mp, Kp) = (ceil(M/128)*128, ceil(K/4)*4)."""
    return ceil_div(M, 128) * 128, ceil_div(K, 4) * 4


def _check_scale_buffer(t, arg: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SCALE_DTYPES:
        raise TypeError(f"{arg} must have dtype torch.float8_e8m0fnu or torch.uint8, got {t.dtype}")
    if t.dim() < 2:
        raise ValueError(f"{arg} must have rank >= 2 ([..., M, K]), got rank {t.dim()}")


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Compact scales [..., M, K] -> contiguous [..., Mp, Kp] in F8_128x4 byte order, same dtype.

    M: non-contracting axis; K: scale blocks of the contracting axis. Zero padding
    to Mp = ceil(M/128)*128, Kp = ceil(K/4)*4. Each [Mp, Kp] slab's flat bytes follow
    the spec's offset formula (see module docstring); slabs follow in leading-dim order.
    Accepts float8_e8m0fnu or uint8.
    """
    _check_scale_buffer(scale, "scale")
    *lead, M, K = scale.shape
    Mp, Kp = swizzled_scale_shape(M, K)
    src = scale.view(torch.uint8)
    padded = src.new_zeros(*lead, Mp, Kp)
    padded[..., :M, :K] = src
    r = len(lead)
    # m = mt*128 + r4*32 + r32 ; k = kt*4 + c  ->  order (mt, kt, r32, r4, c)
    t = padded.view(*lead, Mp // 128, 4, 32, Kp // 4, 4)
    t = t.permute(*range(r), r, r + 3, r + 2, r + 1, r + 4)
    return t.reshape(*lead, Mp, Kp).view(scale.dtype)


def unswizzle_128x4(buf: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """Inverse of swizzle_128x4: [..., Mp, Kp] F8_128x4 bytes -> contiguous compact [..., M, K], same dtype."""
    _check_scale_buffer(buf, "buf")
    for name, v in (("M", M), ("K", K)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    Mp, Kp = swizzled_scale_shape(M, K)
    *lead, bm, bk = buf.shape
    if (bm, bk) != (Mp, Kp):
        raise ValueError(
            f"buf's last two dims {(bm, bk)} do not match M={M}, K={K}: expected padded {(Mp, Kp)}"
        )
    r = len(lead)
    t = buf.view(torch.uint8).reshape(*lead, Mp // 128, Kp // 4, 32, 4, 4)  # (mt, kt, r32, r4, c)
    t = t.permute(*range(r), r, r + 3, r + 2, r + 1, r + 4)  # (mt, r4, r32, kt, c)
    t = t.reshape(*lead, Mp, Kp)[..., :M, :K]
    return t.contiguous().view(buf.dtype)
