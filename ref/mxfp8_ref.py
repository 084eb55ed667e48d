"""Reference emulator of cuDNN's MXFP8 scaled-dot-product attention numerics (torch only, any device).

This module is the project's yardstick: it is written from the spec
(shared/spec/MXFP8_ATTENTION.md sections 1-2, 6, 7, 10), never imports ``mxattn``,
and favours clarity over speed (vectorised torch, Python loops only over
128-wide KV blocks, over memory chunks of heads / query rows and over the
sequences of a variable-length batch).

Devices
-------
Every tensor the functions make lives on their inputs' device (all tensor
arguments of one call must share it; a mismatch raises ValueError naming the
argument; cu_seqlens may live anywhere). The results are the same bits on CPU
and CUDA: quantization, masks, divisions and casts are exact or correctly
rounded IEEE operations on both, and the matrix products, sums, exp, exp2 and
log of the attention cores are taken in FP64 and rounded once to FP32 (see
"device-independent math" below), which also makes them independent of the
summation order. Checked bit for bit on an H100 (tests marked ``gpu``).

Quantization (spec section 2, "round-up" / RCEIL scale)
-------------------------------------------------------
For each block of 32 consecutive elements along ``axis`` (the last block of a
length that is not a multiple of 32 is padded with zeros):
  amax = max|x| in FP32; descale = amax / 448 in FP32;
  e = biased FP32 exponent field of descale, +1 if any mantissa bit is set,
      clamped to [0, 254]; descale <= 2^-127 (amax = 0 included) gives e = 0;
      NaN amax gives e = 255;
  element = RNE_saturate_E4M3(x * 2^(127 - e)), computed as an FP32 product
  with the FP32 value 2^(127-e) and clamped to +-448 before the cast.
Infinities follow torchao 0.18 ``to_mx(..., ScaleCalculationMode.RCEIL)``
(checked on this machine, see tests/test_ref.py): a block whose amax is +inf
gets e = 254 (descale = inf has exponent field 255 and no mantissa bits, the
clamp gives 254); its elements are x * 2^-127, so +-inf saturates to +-448 and
finite neighbours become tiny (mostly 0). A NaN block gets e = 255 and every
element of that block becomes NaN (torchao multiplies by the NaN reciprocal).
Inputs are cast to FP32 first (FP64 inputs are therefore rounded to FP32).
Random data at magnitudes 1e-6..1e6 (bf16 and fp32) is bit-identical to
torchao's RCEIL. Known differences from torchao's eager (CPU) RCEIL, where
this module follows the spec (and TransformerEngine's ``float_to_e8m0`` /
``exp2f_rcp`` as described in cudnn-frontend ``test/python/sdpa/mxfp8_quant.py``):
(a) torchao takes ceil(log2(descale)) in FP32, which misses the round-up when
descale is within ~1e-7 relative above a power of two (e.g. amax =
nextafter(448 * 2^k), |k| >= 2): torchao gives 127+k, the bit rule 128+k;
(b) for 0 < descale <= 2^-127 (amax <= ~2.6e-36) torchao multiplies by 1.0
instead of 2^127, so its elements flush to 0; here they are x * 2^127.
Note also that TE / the cuDNN frontend test helpers form descale as
amax * fp32(1/448) (one FP32 multiply) rather than amax / 448; the two can
differ by one ulp, which changes e only when amax is within an ulp of
448 * 2^k. This module divides, as the spec and torchao do.

Mask rule (verified, cuDNN frontend meaning)
--------------------------------------------
offset = 0 for diagonal_alignment "top_left", s_kv - s_q for "bottom_right".
Query row i keeps key column j iff
    (right_bound is None or j - i <= offset + right_bound) and
    (left_bound  is None or j - i >  offset - left_bound).
causal=True is right_bound = 0. left_bound >= 1 (a sliding-window length:
the row keeps at most left_bound keys at or left of its diagonal), right_bound >= 0.
Sources: NVIDIA/cudnn-frontend ``test/python/sdpa/fp16_ref.py`` class
``_ScoreMask`` (masks ``rel > diag_offset + right_bound`` and
``rel <= diag_offset - left_bound`` with rel = col - row and diag_offset =
s_kv - s_q for BOTTOM_RIGHT); the installed frontend 1.32
``cudnn/sdpa/graph_analyzer.py`` (``window_left = left_bound - 1``,
``diagonal_band_left_bound`` / ``sliding_window_length`` are the same knob,
use_causal_mask pins right_bound to 0, left_bound < 1 is invalid) and
``cudnn/sdpa/fwd/config_sm100.py`` ("row q attends kv in [q - window_left,
q + window_right], shifted by S_kv - S_q when bottom_right"). This equals the
tentative rule in CONTRACT.md. Rows that keep nothing give O = 0,
stats = -inf and zero gradients.

Forward (spec section 6) walks KV in blocks of 128 with an online softmax
(l from the unquantized P), Pq = E4M3(P * p_scale) / p_scale, O += Pq V_dq.
Backward (spec section 7) recomputes S from row-wise Q, K; P is the
normalized FP32 softmax (from ``stats`` when given, in the kernel's log2
form 2^(S_raw * attn_scale * log2 e - stats * log2 e)); delta = rowsum(O * dO)
in FP32 from the high-precision O and dO; dS is MXFP8-quantized along s_kv
(for dQ) and along s_q (for dK); GQA dK/dV are summed over the group in FP32.

Variable lengths (spec section 10): ``sdpa_fwd_varlen`` / ``sdpa_bwd_varlen``
take packed "thd" tensors or padded "bhsd_padded" ones with ``cu_seqlens_q`` /
``cu_seqlens_kv`` and run the dense functions on each sequence alone, so MXFP8
blocks restart at each sequence, masks use each sequence's own lengths, and
padding never reaches a result (see that section below).

Identity switch ``quantize_inputs=False``: every quantization (Q, K, V, P,
dO, dS) is the identity; the math runs in float64 when all inputs are float64
(stats are then float64 too), else in float32.

Attention sinks (``sink``, TE's ``softmax_type`` "off-by-one" = zeros, "learnable" = softmax_offset):
an fp32 [Hq] logit per query head that joins every row's softmax denominator, in the space of the scaled
scores S * attn_scale, and adds nothing to O. It is not quantized. The online softmax starts from it
(max = sink, sum = 1), so P = exp(S - m) uses a running max m >= sink before its E4M3 rounding, and stats =
log(exp(sink) + sum_j exp(S_j)) include it; a row that keeps no key gives O = 0 and stats = sink. The
backward is unchanged given those stats (P = exp(S - stats)); the sink's gradient is
dsink[h] = -sum over batch and rows of exp(sink[h] - stats) * delta, delta = rowsum(O * dO).

Optional ``rescale_threshold`` (forward only, default None = spec literal,
the running max is always updated): when a float t is given, the running max
is only replaced when a block max exceeds it by more than t * ln 2 (lazy
rescaling, P then reaches up to 2^t). cuDNN frontend's own reference
``test/python/sdpa/mxfp8_ref.py`` and the frontend 1.32 OSS MXFP8 prefill
kernels use t = 4 together with p_scale = 16 in the forward (the backward
keeps 256); pass ``p_scale=16.0, rescale_threshold=4.0`` to emulate that.

Recipe variants (spec section 13; the defaults are the recipe above). Keyword
options of ``sdpa_fwd`` / ``sdpa_bwd`` (and their varlen forms):
  p_format="e4m3" (P = E4M3(P * p_scale) / p_scale) | "bf16" (P rounded to
      bfloat16, p_scale unused), in the forward's P V and the backward's P^T dO;
  v_format="fp8" (V quantized like Q and K) | "bf16" (V rounded to bfloat16 and
      never quantized: the forward's P V and the backward's dO V^T use it);
  ds_format="fp8" (dS quantized along s_kv for dQ and along s_q for dK) |
      "bf16" (dS rounded to bfloat16 for both), backward only;
  scale_rounding="ceil" (section 2) | "floor" (the OCP rule: e = biased FP32
      exponent field of amax minus 8, clamped to [0, 254], NaN -> 255; the
      elements are then x * 2^(127 - e) saturated as above), for every MXFP8
      scale (Q, K, V, dO, dS);
  scaling="mxfp8" (blocks of 32) | "per_tensor": one FP32 scale for a whole
      tensor (Transformer Engine's current scaling): amax = max |x| in FP32,
      scale = 448 / amax in FP32 (1 when amax is 0 or +inf, the largest FP32
      number when the quotient overflows, NaN when amax is NaN), elements
      E4M3(saturate(x * scale)), value = element * scale_inv with scale_inv =
      1 / scale in FP32 (``quantize_per_tensor``). Q, K, V, dO and dS (over the
      whole [B, Hq, Sq, Skv] tensor, found in a first pass) are quantized so;
      it cannot be combined with scale_rounding="floor" and has no varlen form.
The ``*_quantized`` functions take what the quantizers return: (data, E8M0
scale) pairs, (data, FP32 scale_inv of one element) pairs from
``quantize_per_tensor``, and for V a bfloat16 tensor with scale None (the
bf16-V variant); their ``scaling`` / ``scale_rounding`` options then only
concern dS.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

BLOCK_SIZE = 32
E4M3_MAX = 448.0
KV_BLOCK = 128
# Upper bound on the elements of one [rows, s_kv] score slab in the backward
# (several such slabs are alive at once): 2^24 fp32 = 64 MiB each, FP64 temporaries twice that.
CHUNK_ELEMS = 1 << 24
_LOG2E = math.log2(math.e)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------- validation


def _check_float_tensor(x, name: str, ndim: Optional[int] = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float16/bfloat16/float32/float64, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(x.shape)}")


def _norm_axis(axis, ndim: int) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis: expected an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis: expected a value in [{-ndim}, {ndim - 1}], got {axis}")
    return axis % ndim


def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected float16/bfloat16/float32/float64, got {out_dtype!r}")


def _check_p_scale(p_scale) -> float:
    if isinstance(p_scale, bool) or not isinstance(p_scale, (int, float)) or not p_scale > 0 or math.isinf(p_scale):
        raise ValueError(f"p_scale: expected a finite positive number, got {p_scale!r}")
    return float(p_scale)


def _check_device(t: torch.Tensor, name: str, device: torch.device, like: str) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {like}'s device {device}, got one on {t.device}")


def _check_rescale_threshold(rescale_threshold) -> None:
    if rescale_threshold is not None and not (isinstance(rescale_threshold, (int, float)) and rescale_threshold >= 0):
        raise ValueError(f"rescale_threshold: expected None or a number >= 0, got {rescale_threshold!r}")


_CHOICES = {
    "p_format": ("e4m3", "bf16"),
    "v_format": ("fp8", "bf16"),
    "ds_format": ("fp8", "bf16"),
    "scale_rounding": ("ceil", "floor"),
    "scaling": ("mxfp8", "per_tensor"),
}


def _check_choice(value, name: str) -> str:
    """One of the recipe options (module docstring); raises naming the option."""
    allowed = _CHOICES[name]
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
    return value


def _check_scaling(scaling, scale_rounding) -> None:
    _check_choice(scaling, "scaling")
    _check_choice(scale_rounding, "scale_rounding")
    if scaling == "per_tensor" and scale_rounding != "ceil":
        raise ValueError(f"scale_rounding: {scale_rounding!r} rounds MXFP8 block scales; scaling='per_tensor' "
                         "has FP32 scales (use 'ceil')")


def _check_shapes(q, k, v, names=("q", "k", "v")) -> Tuple[int, int, int, int, int, int, int]:
    """Shapes (and one device) of q [B,Hq,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv]; returns (B,Hq,Hkv,Sq,Skv,D,Dv)."""
    nq, nk, nv = names
    for t, n in ((q, nq), (k, nk), (v, nv)):
        if t.dim() != 4:
            raise ValueError(f"{n}: expected a 4-D [B, H, S, D] tensor, got shape {tuple(t.shape)}")
        _check_device(t, n, q.device, nq)
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Skv, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{nk}: expected [B={B}, Hkv, Skv, D={D}], got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, Hkv, Skv):
        raise ValueError(f"{nv}: expected [B={B}, Hkv={Hkv}, Skv={Skv}, Dv], got {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{nk}: number of heads {Hkv} must divide the query heads {Hq} (GQA/MQA)")
    if min(B, Hq, Sq, Skv, D, v.shape[3]) == 0:
        raise ValueError(f"{nq}/{nk}/{nv}: empty dimensions are not supported: {tuple(q.shape)}, {tuple(k.shape)}")
    return B, Hq, Hkv, Sq, Skv, D, v.shape[3]


def _check_sink(sink, hq: int, device: torch.device):
    """None, or a float32/float64 [Hq] tensor on ``device`` (the sink logits)."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or sink.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"sink: expected a float32/float64 tensor of shape [{hq}], got "
                        f"{getattr(sink, 'dtype', type(sink).__name__)}")
    if tuple(sink.shape) != (hq,):
        raise ValueError(f"sink: expected shape ({hq},) (one logit per query head), got {tuple(sink.shape)}")
    _check_device(sink, "sink", device, "q")
    return sink


def _attn_scale(attn_scale, d: int) -> float:
    if attn_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(attn_scale, bool) or not isinstance(attn_scale, (int, float)) or not math.isfinite(attn_scale):
        raise ValueError(f"attn_scale: expected a finite number or None, got {attn_scale!r}")
    return float(attn_scale)


# --------------------------------------------------------------------------- MXFP8 quantization


def _exp2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact FP32 2^k for an integer tensor k, on k's device.

    Built from the IEEE bit pattern (no exp2 call, so every device gives the same bits):
    normal for -126 <= k <= 127, subnormal for -149 <= k <= -127, 0 below -149, +inf above 127.
    """
    k = k.to(torch.int32)
    normal = ((k.clamp(-126, 127) + 127) << 23).view(torch.float32)
    subnormal = (torch.ones_like(k) << (k.clamp(-149, -127) + 149)).view(torch.float32)
    out = torch.where(k >= -126, normal, subnormal)
    out = torch.where(k < -149, 0.0, out)
    return torch.where(k > 127, float("inf"), out)


def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Round-up E8M0 biased exponent (int32) of FP32 ``amax`` / 448 (spec section 2)."""
    descale = amax.to(torch.float32) / E4M3_MAX
    bits = descale.view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    e = e.clamp(0, 254)
    e = torch.where(descale <= 2.0**-127, 0, e)
    return torch.where(torch.isnan(descale), 255, e).to(torch.int32)


def _scale_exponent_floor(amax: torch.Tensor) -> torch.Tensor:
    """OCP ("floor") E8M0 biased exponent (int32) of FP32 ``amax``: its exponent field minus 8 (E4M3's largest
    power of two is 2^8), clamped to [0, 254]; NaN gives 255 (+inf has field 255, so 247)."""
    a = amax.to(torch.float32)
    e = (((a.view(torch.int32) >> 23) & 0xFF) - 8).clamp(0, 254)
    return torch.where(torch.isnan(a), 255, e).to(torch.int32)


def _quantize_blocks(x32: torch.Tensor, scale_rounding: str = "ceil") -> Tuple[torch.Tensor, torch.Tensor]:
    """x32 fp32 [..., n] with n % 32 == 0 -> (fp8 e4m3 data [..., n], int32 exponents [..., n/32])."""
    blocks = x32.unflatten(-1, (-1, BLOCK_SIZE))
    amax = blocks.abs().amax(dim=-1)
    e = _scale_exponent(amax) if scale_rounding == "ceil" else _scale_exponent_floor(amax)
    rcp = torch.where(e == 255, float("nan"), _exp2_f32(127 - e))
    y = (blocks * rcp.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).flatten(-2), e


def quantize(x: torch.Tensor, axis: int = -1, *, scale_rounding: str = "ceil") -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (E4M3 elements, E8M0 scales) quantization along ``axis``.

    x: float16/bfloat16/float32/float64 tensor of any shape (cast to FP32 first).
    scale_rounding: "ceil" (round-up, spec section 2) or "floor" (OCP, module docstring).
    Returns (data, scale): data torch.float8_e4m3fn with x's shape (contiguous);
    scale torch.float8_e8m0fnu with x's shape except ceil(n/32) at ``axis``
    (contiguous). A length n that is not a multiple of 32 pads the last block with zeros.
    """
    _check_choice(scale_rounding, "scale_rounding")
    _check_float_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError("x: expected at least a 1-D tensor, got a scalar")
    ax = _norm_axis(axis, x.dim())
    n = x.shape[ax]
    if n == 0:
        raise ValueError(f"x: axis {ax} has length 0")
    xl = x.movedim(ax, -1).to(torch.float32)
    pad = (-n) % BLOCK_SIZE
    if pad:
        xl = F.pad(xl, (0, pad))
    data, e = _quantize_blocks(xl, scale_rounding)
    data = data[..., :n].movedim(-1, ax).contiguous()
    scale = e.to(torch.uint8).view(torch.float8_e8m0fnu).movedim(-1, ax).contiguous()
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """FP32 value of MXFP8 ``data`` (fp8, any shape) with compact ``scale`` along ``axis``.

    scale: torch.float8_e8m0fnu (or uint8 holding the exponent bytes) with data's
    shape except ceil(n/32) at ``axis``. Returns float32 data * 2^(e-127) (e = 255 -> NaN).
    """
    if not isinstance(data, torch.Tensor) or data.dtype not in _FP8_DTYPES:
        raise TypeError(f"data: expected a float8_e4m3fn/float8_e5m2 tensor, got {getattr(data, 'dtype', type(data))}")
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scale: expected a float8_e8m0fnu (or uint8) tensor, got {getattr(scale, 'dtype', type(scale))}")
    if data.dim() == 0:
        raise ValueError("data: expected at least a 1-D tensor, got a scalar")
    ax = _norm_axis(axis, data.dim())
    n = data.shape[ax]
    want = list(data.shape)
    want[ax] = -(-n // BLOCK_SIZE)
    if list(scale.shape) != want:
        raise ValueError(f"scale: expected shape {tuple(want)} for data {tuple(data.shape)} along axis {ax}, got {tuple(scale.shape)}")
    e = scale.view(torch.uint8).to(torch.int32)
    s = torch.where(e == 255, float("nan"), _exp2_f32(e - 127))
    s = s.repeat_interleave(BLOCK_SIZE, dim=ax).narrow(ax, 0, n)
    return data.to(torch.float32) * s


def _qdq(x: torch.Tensor, axis: int, scale_rounding: str = "ceil") -> torch.Tensor:
    """Quantize-dequantize round trip in FP32 (used for dS)."""
    return dequantize(*quantize(x, axis, scale_rounding=scale_rounding), axis)


def _quant_p(p: torch.Tensor, p_scale: float) -> torch.Tensor:
    """Fixed-scale E4M3 rounding of probabilities: E4M3(P * p_scale) / p_scale, saturating."""
    return (p * p_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(p.dtype) / p_scale


def _round_p(p: torch.Tensor, p_format: str, p_scale: float) -> torch.Tensor:
    """P as the P V / P^T dO products take it: fixed-scale E4M3 ("e4m3") or rounded to bfloat16 ("bf16")."""
    if p_format == "bf16":
        return p.to(torch.bfloat16).to(p.dtype)
    return _quant_p(p, p_scale)


# --------------------------------------------------------------------------- per-tensor FP8 (the baseline)

_FP32_MAX = torch.finfo(torch.float32).max


def _per_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 0-d scale 448 / amax of an FP32 0-d amax (1 for amax 0 or +inf, FP32 max on overflow, NaN stays)."""
    scale = torch.tensor(E4M3_MAX, dtype=torch.float32, device=amax.device) / amax
    scale = torch.where(torch.isinf(scale), _FP32_MAX, scale)
    return torch.where((amax == 0) | torch.isinf(amax), 1.0, scale)


def _per_tensor_from_amax(x32: torch.Tensor, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 data of FP32 x32, FP32 0-d scale_inv) with the scale of ``amax``."""
    scale = _per_tensor_scale(amax)
    data = (x32 * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, torch.ones((), dtype=torch.float32, device=x32.device) / scale


def quantize_per_tensor(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 (Transformer Engine's current scaling, module docstring) of x (any shape, cast to FP32).

    Returns (data torch.float8_e4m3fn with x's shape (contiguous), scale_inv float32 0-d): the value of an
    element is float(data) * scale_inv (an FP32 product)."""
    _check_float_tensor(x, "x")
    if x.numel() == 0:
        raise ValueError("x: expected a non-empty tensor")
    x32 = x.to(torch.float32).contiguous()
    return _per_tensor_from_amax(x32, x32.abs().amax())


def _qdq_per_tensor(x32: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor quantize-dequantize of FP32 x32 with the scale of ``amax`` (dS over all its chunks)."""
    data, scale_inv = _per_tensor_from_amax(x32, amax)
    return data.to(torch.float32) * scale_inv


# --------------------------------------------------------------------------- device-independent math
#
# torch's float32 exp / exp2 / log, its sums and its matrix products are not the same bits on CPU and
# CUDA (measured on an H100, torch 2.11 against torch 2.13 CPU: float32 exp differed in 30% of elements,
# log in 7%, 128-wide row sums in 20% of rows; products contracting over 64-300 elements agreed, but dQ
# contracting over 1000 keys differed in 3 of 358400 elements: cuBLAS and the CPU BLAS add in different
# orders). So the attention cores take all of these through float64 and round once to the working dtype:
# products of FP32 (dequantized MXFP8) values are exact in FP64, FP64 sums barely depend on the order and
# FP64 exp/log are within an FP64 ulp on both devices, so the rounded results agree except when a value
# lies within ~2^-29 of an FP32 rounding boundary (never seen). The result is then also (nearly always)
# the correctly rounded FP32 value, independent of any kernel's summation order. In the float64 identity
# mode these are plain float64 ops (not bit-identical across devices; that mode is an oracle).


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).to(x.dtype)


def _exp2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x.double()).to(x.dtype)


def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).to(x.dtype)


def _sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return x.double().sum(dim=dim, keepdim=keepdim).to(x.dtype)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.double(), b.double()).to(a.dtype)


# --------------------------------------------------------------------------- masks


class _Mask(NamedTuple):
    offset: int
    left: Optional[int]
    right: Optional[int]


def _resolve_mask(causal, diagonal_alignment, window, s_q: int, s_kv: int) -> Optional[_Mask]:
    """Normalise the mask options (see module docstring); None when nothing is masked."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(diagonal_alignment, str) or diagonal_alignment.lower() not in ("top_left", "bottom_right"):
        raise ValueError(f"diagonal_alignment: expected 'top_left' or 'bottom_right', got {diagonal_alignment!r}")
    if not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2:
        raise ValueError(f"window: expected a pair (left_bound, right_bound), got {window!r}")
    left, right = window
    for val, name, low in ((left, "left_bound", 1), (right, "right_bound", 0)):
        if val is None:
            continue
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"window {name}: expected an int or None, got {type(val).__name__}")
        if val < low:
            raise ValueError(f"window {name}: expected >= {low}, got {val}")
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True means right_bound 0; got window right_bound {right}")
        right = 0
    if left is None and right is None:
        return None
    offset = s_kv - s_q if diagonal_alignment.lower() == "bottom_right" else 0
    return _Mask(offset, left, right)


def _keep(mask: Optional[_Mask], r0: int, r1: int, c0: int, c1: int,
          device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """Bool [r1-r0, c1-c0] on ``device``: True where query row i keeps key column j; None when no mask."""
    if mask is None:
        return None
    rel = torch.arange(c0, c1, device=device).view(1, -1) - torch.arange(r0, r1, device=device).view(-1, 1)
    keep = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
    if mask.right is not None:
        keep &= rel <= mask.offset + mask.right
    if mask.left is not None:
        keep &= rel > mask.offset - mask.left
    return keep


def keep_mask(s_q: int, s_kv: int, *, causal: bool = False, diagonal_alignment: str = "top_left",
              window=(None, None)) -> torch.Tensor:
    """Dense bool [s_q, s_kv] keep-matrix of the cuDNN mask rule (True = attended)."""
    m = _resolve_mask(causal, diagonal_alignment, window, s_q, s_kv)
    keep = _keep(m, 0, s_q, 0, s_kv)
    return torch.ones(s_q, s_kv, dtype=torch.bool) if keep is None else keep


# --------------------------------------------------------------------------- cores


def _group_chunks(B: int, Hkv: int, G: int, per_head_elems: int):
    """Yield (kv_head j, q-head slice h0:h1 of j's group) with B*(h1-h0)*per_head_elems <= CHUNK_ELEMS (>= 1 head)."""
    gc = max(1, min(G, CHUNK_ELEMS // max(1, B * per_head_elems)))
    for j in range(Hkv):
        for h0 in range(j * G, (j + 1) * G, gc):
            yield j, h0, min(h0 + gc, (j + 1) * G)


def _fwd_core(qd, kd, vd, *, scale, mask, quant_p, p_scale, rescale_threshold, out_dtype, cdt, sink=None,
              p_format="e4m3"):
    """Blocked online-softmax forward on dequantized q [B,Hq,Sq,D], k/v [B,Hkv,Skv,*] in dtype cdt; sink None
    or [Hq] (the softmax starts from it: max = sink, sum = 1). quant_p: P rounded as p_format says."""
    B, Hq, Sq, _ = qd.shape
    Hkv, Skv, Dv = kd.shape[1], kd.shape[2], vd.shape[3]
    G = Hq // Hkv
    dev = qd.device  # every tensor made here lives on the inputs' device
    o_out = torch.empty(B, Hq, Sq, Dv, dtype=out_dtype, device=dev)
    stats = torch.empty(B, Hq, Sq, 1, dtype=torch.float64 if cdt == torch.float64 else torch.float32, device=dev)
    thr = None if rescale_threshold is None else rescale_threshold * math.log(2.0)
    for j, h0, h1 in _group_chunks(B, Hkv, G, Sq * (KV_BLOCK + Dv) * 4):
        q = qd[:, h0:h1]
        k, v = kd[:, j:j + 1], vd[:, j:j + 1]
        if sink is None:
            m = torch.full((B, h1 - h0, Sq, 1), float("-inf"), dtype=cdt, device=dev)
            l = torch.zeros(B, h1 - h0, Sq, 1, dtype=cdt, device=dev)
        else:
            m = sink[h0:h1].to(cdt).view(1, -1, 1, 1).expand(B, h1 - h0, Sq, 1).clone()
            l = torch.ones(B, h1 - h0, Sq, 1, dtype=cdt, device=dev)
        acc = torch.zeros(B, h1 - h0, Sq, Dv, dtype=cdt, device=dev)
        for c0 in range(0, Skv, KV_BLOCK):
            c1 = min(c0 + KV_BLOCK, Skv)
            s = _mm(q, k[:, :, c0:c1].transpose(-1, -2)) * scale
            keep = _keep(mask, 0, Sq, c0, c1, dev)
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            m_blk = s.amax(dim=-1, keepdim=True)
            if thr is None:
                m_new = torch.maximum(m, m_blk)
            else:
                m_new = torch.where((m == float("-inf")) | (m_blk - m > thr), m_blk, m)
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = _exp(m - m_safe)
            p = _exp(s - m_safe)
            l = l * alpha + _sum(p, -1, keepdim=True)
            pq = _round_p(p, p_format, p_scale) if quant_p else p
            acc = acc * alpha + _mm(pq, v[:, :, c0:c1])
            m = m_new
        o = torch.where(l == 0, 0.0, acc / l)  # fully masked rows give 0; NaN rows stay NaN
        o_out[:, h0:h1] = o.to(out_dtype)
        stats[:, h0:h1] = (m + _log(l)).to(stats.dtype)
    return o_out, stats


class _DsRounding(NamedTuple):
    """How the backward rounds dS: ds_format "fp8" quantizes it with ``scaling`` / ``scale_rounding``."""
    ds_format: str = "fp8"
    scaling: str = "mxfp8"
    scale_rounding: str = "ceil"


def _bwd_chunks(qr, kr, vr, dor, stats, delta, *, scale, mask, cdt, sink):
    """The backward's dS, chunk by chunk: yields (j, h0, h1, r0, r1, p, lse, ds) for KV head j, its query heads
    h0:h1 and query rows r0:r1 (r0 a multiple of 32, so s_q blocks of dS stay intact): p the normalized FP32
    softmax with masked entries 0, lse its log-sum-exp [.., rows, 1] (sink included), ds = P (dP - delta)
    * scale with dP = dO V^T."""
    B, Hq, Sq, _ = qr.shape
    Hkv, Skv = kr.shape[1], kr.shape[2]
    dev = qr.device
    rows = Sq if B * Sq * Skv <= CHUNK_ELEMS else max(BLOCK_SIZE, CHUNK_ELEMS // (B * Skv) // BLOCK_SIZE * BLOCK_SIZE)
    for j, h0, h1 in _group_chunks(B, Hkv, Hq // Hkv, rows * Skv):
        kr_j, vr_j = kr[:, j:j + 1], vr[:, j:j + 1]
        for r0 in range(0, Sq, rows):
            r1 = min(r0 + rows, Sq)
            s_raw = _mm(qr[:, h0:h1, r0:r1], kr_j.transpose(-1, -2))
            keep = _keep(mask, r0, r1, 0, Skv, dev)
            sink_j = None if sink is None else sink[h0:h1].to(cdt).view(1, -1, 1, 1)
            if stats is not None:
                lse = stats[:, h0:h1, r0:r1].to(cdt)
                p = _exp2(s_raw * (scale * _LOG2E) - lse * _LOG2E)
            else:
                s = s_raw * scale
                if keep is not None:
                    s = s.masked_fill(~keep, float("-inf"))
                mx = s.amax(dim=-1, keepdim=True)
                if sink_j is not None:
                    mx = torch.maximum(mx, sink_j)
                mx_safe = torch.where(mx == float("-inf"), 0.0, mx)
                e = _exp(s - mx_safe)
                den = _sum(e, -1, keepdim=True)
                if sink_j is not None:
                    den = den + _exp(sink_j - mx_safe)
                p = torch.where(den == 0, 0.0, e / den)
                lse = mx_safe + _log(den)
            if keep is not None:
                p = torch.where(keep, p, 0.0)
            dp = _mm(dor[:, h0:h1, r0:r1], vr_j.transpose(-1, -2))
            ds = p * (dp - delta[:, h0:h1, r0:r1]) * scale
            yield j, h0, h1, r0, r1, p, lse, ds


def _bwd_core(qr, kr, vr, qc, kc, dor, doc, o, do, stats, *, scale, mask, quant, p_scale, out_dtype, cdt,
              sink=None, p_format="e4m3", ds_rounding=_DsRounding()):
    """Backward on dequantized operands (dtype cdt); returns (dq, dk, dv) in out_dtype, and dsink [Hq]
    (float32, float64 in the float64 case) after them when sink [Hq] is given. quant: P and dS rounded as
    p_format and ds_rounding say (else not at all)."""
    B, Hq, Sq, D = qr.shape
    Hkv, Skv, Dv = kr.shape[1], kr.shape[2], vr.shape[3]
    dev = qr.device  # every tensor made here lives on the inputs' device
    delta = _sum(o.to(cdt) * do.to(cdt), -1, keepdim=True)
    dq = torch.empty(B, Hq, Sq, D, dtype=cdt, device=dev)
    dk = torch.zeros(B, Hkv, Skv, D, dtype=cdt, device=dev)
    dv = torch.zeros(B, Hkv, Skv, Dv, dtype=cdt, device=dev)
    dsink = None if sink is None else torch.zeros(Hq, dtype=cdt, device=dev)
    chunks = lambda: _bwd_chunks(qr, kr, vr, dor, stats, delta, scale=scale, mask=mask, cdt=cdt,  # noqa: E731
                                 sink=sink)
    ds_amax = None  # per-tensor dS: its amax over the whole [B, Hq, Sq, Skv] tensor, in a first pass
    if quant and ds_rounding.ds_format == "fp8" and ds_rounding.scaling == "per_tensor":
        ds_amax = torch.zeros((), dtype=torch.float32, device=dev)
        for *_, ds in chunks():
            ds_amax = torch.maximum(ds_amax, ds.to(torch.float32).abs().amax())
    for j, h0, h1, r0, r1, p, lse, ds in chunks():
        if sink is not None:  # the sink's probability per row, times delta
            p_sink = _exp(sink[h0:h1].to(cdt).view(1, -1, 1, 1) - lse)
            dsink[h0:h1] -= _sum(_sum(p_sink * delta[:, h0:h1, r0:r1], 3), 2).sum(dim=0)
        pq = _round_p(p, p_format, p_scale) if quant else p
        if not quant:
            ds_r = ds_c = ds
        elif ds_rounding.ds_format == "bf16":
            ds_r = ds_c = ds.to(torch.bfloat16).to(ds.dtype)
        elif ds_amax is not None:
            ds_r = ds_c = _qdq_per_tensor(ds, ds_amax)
        else:
            ds_r = _qdq(ds, -1, ds_rounding.scale_rounding)  # blocks along s_kv, for dQ
            ds_c = _qdq(ds, -2, ds_rounding.scale_rounding)  # blocks along s_q, for dK
        kc_j = kc[:, j:j + 1]
        dq[:, h0:h1, r0:r1] = _mm(ds_r, kc_j)
        dk[:, j] += _sum(_mm(ds_c.transpose(-1, -2), qc[:, h0:h1, r0:r1]), 1)
        dv[:, j] += _sum(_mm(pq.transpose(-1, -2), doc[:, h0:h1, r0:r1]), 1)
    grads = (dq.to(out_dtype), dk.to(out_dtype), dv.to(out_dtype))
    if dsink is None:
        return grads
    return grads + (dsink.to(torch.float64 if cdt == torch.float64 else torch.float32),)


# --------------------------------------------------------------------------- public API


def _check_pair(pair, name: str, shape, axis: int, device: torch.device, bf16_ok: bool = False) -> torch.Tensor:
    """Validate a (data, scale) pair of shape ``shape`` on ``device``: MXFP8 (E8M0 scale along ``axis``) or
    per-tensor (a float32 scale_inv of one element). With bf16_ok, a (bfloat16 tensor, None) pair is also
    taken (the bf16-V variant). Returns its FP32 value."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name}: expected a (data, scale) pair, got {type(pair).__name__}")
    data, sc = pair
    if bf16_ok and isinstance(data, torch.Tensor) and data.dtype == torch.bfloat16:
        if sc is not None:
            raise ValueError(f"{name}: a bfloat16 operand (the bf16-V variant) takes scale None, got a "
                             f"{type(sc).__name__}")
        if tuple(data.shape) != tuple(shape):
            raise ValueError(f"{name} data: expected shape {tuple(shape)}, got {tuple(data.shape)}")
        _check_device(data, f"{name} data", device, "the query operand")
        return data.to(torch.float32)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
        want = "a float8_e4m3fn (or, here, bfloat16)" if bf16_ok else "a float8_e4m3fn"
        raise TypeError(f"{name} data: expected {want} tensor, got {getattr(data, 'dtype', type(data))}")
    if tuple(data.shape) != tuple(shape):
        raise ValueError(f"{name} data: expected shape {tuple(shape)}, got {tuple(data.shape)}")
    _check_device(data, f"{name} data", device, "the query operand")
    if isinstance(sc, torch.Tensor):
        _check_device(sc, f"{name} scale", device, "the query operand")
        if sc.dtype == torch.float32:  # per-tensor scale_inv
            if sc.numel() != 1:
                raise ValueError(f"{name} scale: a float32 (per-tensor) scale_inv has one element, got shape "
                                 f"{tuple(sc.shape)}")
            return data.to(torch.float32) * sc.reshape(())
    try:
        return dequantize(data, sc, axis)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _quantize_operand(x: torch.Tensor, axis: int, scaling: str, scale_rounding: str):
    """(data, scale) of x as ``scaling`` says: MXFP8 along ``axis`` or per-tensor (axis unused)."""
    if scaling == "per_tensor":
        return quantize_per_tensor(x)
    return quantize(x, axis, scale_rounding=scale_rounding)


def sdpa_fwd_quantized(q_data, q_scale, k_data, k_scale, v_data, v_scale_col, *, attn_scale=None, causal=False,
                       diagonal_alignment="top_left", window=(None, None), out_dtype=torch.bfloat16,
                       p_scale=256.0, rescale_threshold=None, sink=None, p_format="e4m3"):
    """MXFP8 forward from pre-quantized operands (sink: None or the [Hq] sink logits, module docstring).

    q_data [B,Hq,Sq,D], k_data [B,Hkv,Skv,D] float8_e4m3fn with row-wise scales [B,H,S,ceil(D/32)];
    v_data [B,Hkv,Skv,Dv] with column-wise scale [B,Hkv,ceil(Skv/32),Dv] (float8_e8m0fnu). Recipe variants
    (module docstring): per-tensor operands come with a float32 scale_inv of one element instead; V may be a
    bfloat16 tensor with v_scale_col None (the bf16-V variant); p_format "e4m3" or "bf16".
    Returns (o [B,Hq,Sq,Dv] out_dtype, stats [B,Hq,Sq,1] float32 = max + log(sum exp)).
    """
    for t, n in ((q_data, "q_data"), (k_data, "k_data"), (v_data, "v_data")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q_data, k_data, v_data, ("q_data", "k_data", "v_data"))
    _check_out_dtype(out_dtype)
    _check_rescale_threshold(rescale_threshold)
    _check_choice(p_format, "p_format")
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    dev = q_data.device
    qd = _check_pair((q_data, q_scale), "q", q_data.shape, -1, dev)
    kd = _check_pair((k_data, k_scale), "k", k_data.shape, -1, dev)
    vd = _check_pair((v_data, v_scale_col), "v", v_data.shape, -2, dev, bf16_ok=True)
    return _fwd_core(qd, kd, vd, scale=_attn_scale(attn_scale, D), mask=mask, quant_p=True,
                     p_scale=_check_p_scale(p_scale), rescale_threshold=rescale_threshold,
                     out_dtype=out_dtype, cdt=torch.float32, sink=_check_sink(sink, Hq, dev), p_format=p_format)


def sdpa_fwd(q, k, v, *, attn_scale=None, causal=False, diagonal_alignment="top_left", window=(None, None),
             out_dtype=torch.bfloat16, p_scale=256.0, quantize_inputs=True, rescale_threshold=None, sink=None,
             p_format="e4m3", v_format="fp8", scaling="mxfp8", scale_rounding="ceil"):
    """Reference forward from high-precision q [B,Hq,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv] (sink: None
    or the [Hq] sink logits).

    quantize_inputs=True: Q, K row-wise and V column-wise MXFP8, then ``sdpa_fwd_quantized``; the recipe
    options p_format, v_format, scaling, scale_rounding (module docstring) change what is quantized and how.
    quantize_inputs=False: no quantization at all (float64 math if all inputs are float64).
    Returns (o [B,Hq,Sq,Dv] out_dtype, stats [B,Hq,Sq,1] float32, float64 in the float64 identity case).
    """
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float_tensor(t, n, 4)
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q, k, v)
    _check_sink(sink, Hq, q.device)
    _check_choice(p_format, "p_format")
    _check_choice(v_format, "v_format")
    _check_scaling(scaling, scale_rounding)
    if quantize_inputs:
        _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)  # validate before quantizing
        vq = (v.to(torch.bfloat16), None) if v_format == "bf16" else _quantize_operand(v, -2, scaling, scale_rounding)
        return sdpa_fwd_quantized(*_quantize_operand(q, -1, scaling, scale_rounding),
                                  *_quantize_operand(k, -1, scaling, scale_rounding), *vq, attn_scale=attn_scale,
                                  causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                                  out_dtype=out_dtype, p_scale=p_scale, rescale_threshold=rescale_threshold,
                                  sink=sink, p_format=p_format)
    _check_out_dtype(out_dtype)
    _check_rescale_threshold(rescale_threshold)
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    cdt = torch.float64 if all(t.dtype == torch.float64 for t in (q, k, v)) else torch.float32
    return _fwd_core(q.to(cdt), k.to(cdt), v.to(cdt), scale=_attn_scale(attn_scale, D), mask=mask, quant_p=False,
                     p_scale=_check_p_scale(p_scale), rescale_threshold=rescale_threshold,
                     out_dtype=out_dtype, cdt=cdt, sink=sink)


def _check_o_do_stats(o, do, stats, B, Hq, Sq, Dv, device, like):
    for t, n in ((o, "o"), (do, "do")):
        _check_float_tensor(t, n, 4)
        if tuple(t.shape) != (B, Hq, Sq, Dv):
            raise ValueError(f"{n}: expected shape {(B, Hq, Sq, Dv)}, got {tuple(t.shape)}")
        _check_device(t, n, device, like)
    if stats is not None:
        _check_float_tensor(stats, "stats")
        if tuple(stats.shape) != (B, Hq, Sq, 1):
            raise ValueError(f"stats: expected shape {(B, Hq, Sq, 1)}, got {tuple(stats.shape)}")
        _check_device(stats, "stats", device, like)


def sdpa_bwd_quantized(q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats=None, *, attn_scale=None,
                       causal=False, diagonal_alignment="top_left", window=(None, None),
                       out_dtype=torch.bfloat16, p_scale=256.0, sink=None, p_format="e4m3", ds_format="fp8",
                       scaling="mxfp8", scale_rounding="ceil"):
    """MXFP8 backward from pre-quantized operands (each a (data float8_e4m3fn, scale float8_e8m0fnu) pair).
    With sink [Hq] (the forward's sink logits) a fourth result dsink [Hq] float32 follows.

    q_row/k_row/v_row/do_row: scales along D [B,H,S,ceil(D/32)]; q_col/k_col/do_col: scales along S
    [B,H,ceil(S/32),D]. o, do: high-precision [B,Hq,Sq,Dv] (for delta). stats [B,Hq,Sq,1] or None
    (then P is recomputed). Returns (dq [B,Hq,Sq,D], dk [B,Hkv,Skv,D], dv [B,Hkv,Skv,Dv]) in out_dtype.
    Recipe variants (module docstring): per-tensor pairs carry a float32 scale_inv of one element; v_row may
    be (bfloat16 tensor, None) (the bf16-V variant); p_format "e4m3" | "bf16"; ds_format "fp8" | "bf16", and
    scaling / scale_rounding say how an "fp8" dS is quantized.
    """
    for pair, n in ((q_row, "q_row"), (k_row, "k_row"), (v_row, "v_row")):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], torch.Tensor):
            raise TypeError(f"{n}: expected a (data, scale) pair of tensors")
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q_row[0], k_row[0], v_row[0], ("q_row", "k_row", "v_row"))
    dev = q_row[0].device
    _check_o_do_stats(o, do, stats, B, Hq, Sq, Dv, dev, "q_row")
    _check_out_dtype(out_dtype)
    _check_choice(p_format, "p_format")
    _check_choice(ds_format, "ds_format")
    _check_scaling(scaling, scale_rounding)
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    qr = _check_pair(q_row, "q_row", (B, Hq, Sq, D), -1, dev)
    qc = _check_pair(q_col, "q_col", (B, Hq, Sq, D), -2, dev)
    kr = _check_pair(k_row, "k_row", (B, Hkv, Skv, D), -1, dev)
    kc = _check_pair(k_col, "k_col", (B, Hkv, Skv, D), -2, dev)
    vr = _check_pair(v_row, "v_row", (B, Hkv, Skv, Dv), -1, dev, bf16_ok=True)
    dor = _check_pair(do_row, "do_row", (B, Hq, Sq, Dv), -1, dev)
    doc = _check_pair(do_col, "do_col", (B, Hq, Sq, Dv), -2, dev)
    return _bwd_core(qr, kr, vr, qc, kc, dor, doc, o, do, stats, scale=_attn_scale(attn_scale, D), mask=mask,
                     quant=True, p_scale=_check_p_scale(p_scale), out_dtype=out_dtype, cdt=torch.float32,
                     sink=_check_sink(sink, Hq, dev), p_format=p_format,
                     ds_rounding=_DsRounding(ds_format, scaling, scale_rounding))


def sdpa_bwd(q, k, v, o, do, stats=None, *, attn_scale=None, causal=False, diagonal_alignment="top_left",
             window=(None, None), out_dtype=torch.bfloat16, p_scale=256.0, quantize_inputs=True, sink=None,
             p_format="e4m3", v_format="fp8", ds_format="fp8", scaling="mxfp8", scale_rounding="ceil"):
    """Reference backward from high-precision q, k, v, o, do (shapes as in ``sdpa_fwd``); with sink [Hq] a
    fourth result dsink [Hq] follows.

    quantize_inputs=True: Q, K row+column, V row, dO row+column MXFP8, then ``sdpa_bwd_quantized``; the
    recipe options p_format, v_format, ds_format, scaling, scale_rounding (module docstring) change what is
    quantized and how.
    quantize_inputs=False: no quantization at all (float64 math if q, k, v, o, do are all float64).
    stats [B,Hq,Sq,1] or None (recomputed). Returns (dq, dk, dv) in out_dtype; dk, dv have Hkv heads.
    """
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float_tensor(t, n, 4)
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q, k, v)
    _check_o_do_stats(o, do, stats, B, Hq, Sq, Dv, q.device, "q")
    _check_out_dtype(out_dtype)
    _check_choice(v_format, "v_format")
    _check_scaling(scaling, scale_rounding)
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    _check_sink(sink, Hq, q.device)
    opts = dict(attn_scale=attn_scale, causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                out_dtype=out_dtype, p_scale=p_scale, sink=sink)
    if quantize_inputs:
        quant = lambda x, axis: _quantize_operand(x, axis, scaling, scale_rounding)  # noqa: E731
        v_row = (v.to(torch.bfloat16), None) if v_format == "bf16" else quant(v, -1)
        return sdpa_bwd_quantized(quant(q, -1), quant(q, -2), quant(k, -1), quant(k, -2), v_row, o, do,
                                  quant(do, -1), quant(do, -2), stats, p_format=p_format, ds_format=ds_format,
                                  scaling=scaling, scale_rounding=scale_rounding, **opts)
    cdt = torch.float64 if all(t.dtype == torch.float64 for t in (q, k, v, o, do)) else torch.float32
    qd, kd, vd, dod = q.to(cdt), k.to(cdt), v.to(cdt), do.to(cdt)
    return _bwd_core(qd, kd, vd, qd, kd, dod, dod, o, do, stats, scale=_attn_scale(attn_scale, D), mask=mask,
                     quant=False, p_scale=_check_p_scale(p_scale), out_dtype=out_dtype, cdt=cdt, sink=sink)


# --------------------------------------------------------------------------- variable lengths
#
# Each sequence of a varlen batch is computed by the dense functions above on that sequence alone
# (a contiguous copy of its rows), so MXFP8 blocks along S start at the sequence's own first row, the
# masks use the sequence's own s_q and s_kv, and nothing outside the sequence (neighbours in a pack,
# padding rows, even NaN there) can reach its result. Outputs start as O = 0, stats = -inf and zero
# gradients; a sequence with no query rows or no keys is skipped and keeps them.
#
# layout "thd":          q [T_q, Hq, D], k [T_kv, Hkv, D], v [T_kv, Hkv, Dv]; sequence b is rows
#                        cu[b]:cu[b+1]; cu[-1] must equal T. stats [T_q, Hq].
# layout "bhsd_padded":  q [B, Hq, Sq_max, D], k [B, Hkv, Skv_max, D], v [B, Hkv, Skv_max, Dv]; sequence b
#                        is rows 0:len_b of batch b with len_b = cu[b+1] - cu[b] <= S_max. stats [B, Hq, Sq_max, 1].
#
# Internally every tensor is seen as a [B', H, S', *] view: thd [T, H, D] as [1, H, T, D] (stats [T, H] as
# [1, H, T, 1]), padded tensors as they are. Sequence b is then view[batch:batch+1, :, start:start+length].

_LAYOUTS = ("thd", "bhsd_padded")


class _Seq(NamedTuple):
    """Where sequence b lives in the [B', H, S', *] views."""
    batch: int  # index along B' (always 0 for thd)
    q0: int  # first query row
    len_q: int
    kv0: int  # first key row
    len_kv: int


def _check_layout(layout) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'thd' or 'bhsd_padded', got {layout!r}")


def _bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The [B', H, S', *] view of a varlen tensor (no copy)."""
    if layout == "bhsd_padded":
        return x
    if x.dim() == 2:  # thd stats [T, H]
        return x.transpose(0, 1).unsqueeze(0).unsqueeze(-1)
    return x.transpose(0, 1).unsqueeze(0)  # thd [T, H, D]


def _rows(x4: torch.Tensor, seq: _Seq, which: str) -> torch.Tensor:
    """View [1, H, len, *] of sequence ``seq``'s query ("q") or key ("kv") rows of a [B', H, S', *] view."""
    start, length = (seq.q0, seq.len_q) if which == "q" else (seq.kv0, seq.len_kv)
    return x4[seq.batch:seq.batch + 1, :, start:start + length]


def _check_cu_seqlens(cu, name: str) -> list:
    """Host list of a cumulative-lengths tensor [B+1] (int32/int64, starts at 0, non-decreasing)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected an int32/int64 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name}: expected a 1-D tensor [B+1] with B >= 1, got shape {tuple(cu.shape)}")
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {vals[0]}")
    for b in range(len(vals) - 1):
        if vals[b + 1] < vals[b]:
            raise ValueError(f"{name}: must be non-decreasing, got entry {b + 1} = {vals[b + 1]} "
                             f"after entry {b} = {vals[b]}")
    return vals


def _varlen_operands(layout: str, q, k, v):
    """Validate q, k, v of a varlen call; return their [B', H, S', D] views and the head dim D."""
    _check_layout(layout)
    ndim, form = (3, "[T, H, D]") if layout == "thd" else (4, "[B, H, S_max, D]")
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float_tensor(t, n)
        if t.dim() != ndim:
            raise ValueError(f"{n}: layout {layout!r} expects a {ndim}-D {form} tensor, got shape {tuple(t.shape)}")
        _check_device(t, n, q.device, "q")
    q4, k4, v4 = _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout)
    B, Hq, _, D = q4.shape
    Bk, Hkv, Skv, Dk = k4.shape
    if Bk != B:
        raise ValueError(f"k: batch {Bk} differs from q's batch {B}")
    if Dk != D:
        raise ValueError(f"k: head dim {Dk} differs from q's head dim {D}")
    if tuple(v4.shape[:3]) != (B, Hkv, Skv):
        raise ValueError(f"v: expected the sequence and head dims of k {tuple(k.shape)[:-1]}, got {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"k: number of heads {Hkv} must divide the query heads {Hq} (GQA/MQA)")
    if min(Hq, D, v4.shape[3]) == 0:
        raise ValueError(f"q/k/v: empty head or head dimensions are not supported: {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    return q4, k4, v4, D


def _varlen_sequences(layout: str, cu_seqlens_q, cu_seqlens_kv, q4, k4) -> list:
    """Validate the cumulative lengths against the [B', H, S', D] views of q and k; one _Seq per sequence."""
    cq = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    ck = _check_cu_seqlens(cu_seqlens_kv, "cu_seqlens_kv")
    if len(ck) != len(cq):
        raise ValueError(f"cu_seqlens_kv: expected {len(cq)} entries (B = {len(cq) - 1} sequences, as in "
                         f"cu_seqlens_q), got {len(ck)}")
    batch = len(cq) - 1
    if layout == "thd":
        for cu, name, total, t in ((cq, "cu_seqlens_q", q4.shape[2], "q"), (ck, "cu_seqlens_kv", k4.shape[2], "k")):
            if cu[-1] != total:
                raise ValueError(f"{name}: last entry {cu[-1]} must equal the total length T = {total} of {t}")
        return [_Seq(0, cq[b], cq[b + 1] - cq[b], ck[b], ck[b + 1] - ck[b]) for b in range(batch)]
    if batch != q4.shape[0]:
        raise ValueError(f"cu_seqlens_q: expected B+1 = {q4.shape[0] + 1} entries for q's batch B = {q4.shape[0]}, "
                         f"got {len(cq)}")
    for cu, name, s_max, t in ((cq, "cu_seqlens_q", q4.shape[2], "q"), (ck, "cu_seqlens_kv", k4.shape[2], "k")):
        for b in range(batch):
            if cu[b + 1] - cu[b] > s_max:
                raise ValueError(f"{name}: sequence {b} has length {cu[b + 1] - cu[b]} > S_max = {s_max} of {t}")
    return [_Seq(b, 0, cq[b + 1] - cq[b], 0, ck[b + 1] - ck[b]) for b in range(batch)]


def _check_common_options(attn_scale, causal, diagonal_alignment, window, out_dtype, p_scale, recipe) -> None:
    """Validate the options up front: a batch of empty sequences never reaches the dense checks. recipe: the
    variant options (p_format, v_format, ds_format, scaling, scale_rounding) given."""
    _resolve_mask(causal, diagonal_alignment, window, 1, 1)
    _check_out_dtype(out_dtype)
    _check_p_scale(p_scale)
    _attn_scale(attn_scale, 1)
    for name, value in recipe.items():
        if name not in ("scaling", "scale_rounding"):
            _check_choice(value, name)
    _check_scaling(recipe["scaling"], recipe["scale_rounding"])
    if recipe["scaling"] == "per_tensor":
        raise ValueError("scaling: 'per_tensor' has no variable-length form (one scale per tensor would couple "
                         "the sequences); use the dense functions")


def sdpa_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, *, layout="thd", attn_scale=None, causal=False,
                    diagonal_alignment="top_left", window=(None, None), out_dtype=torch.bfloat16, p_scale=256.0,
                    quantize_inputs=True, rescale_threshold=None, sink=None, p_format="e4m3", v_format="fp8",
                    scaling="mxfp8", scale_rounding="ceil"):
    """Variable-length forward: ``sdpa_fwd`` on each sequence alone (see the section comment above).
    sink: None or the [Hq] sink logits; a sequence with queries but no keys then gets stats = sink.
    p_format, v_format, scaling, scale_rounding: the recipe variants of ``sdpa_fwd`` (scaling "mxfp8" only).

    layout "thd": q [T_q, Hq, D], k [T_kv, Hkv, D], v [T_kv, Hkv, Dv]; returns (o [T_q, Hq, Dv], stats [T_q, Hq]).
    layout "bhsd_padded": q [B, Hq, Sq_max, D], k/v [B, Hkv, Skv_max, *]; returns (o [B, Hq, Sq_max, Dv],
    stats [B, Hq, Sq_max, 1]); rows past a sequence's length are O = 0, stats = -inf.
    cu_seqlens_q / cu_seqlens_kv: int32/int64 [B+1], cumulative lengths from 0. Masks apply per sequence
    (bottom_right offset len_kv[b] - len_q[b]). Rows with no key to attend give O = 0 and stats = -inf.
    o is out_dtype; stats float32 (float64 for quantize_inputs=False with float64 q, k, v, as in ``sdpa_fwd``).
    """
    q4, k4, v4, _ = _varlen_operands(layout, q, k, v)
    seqs = _varlen_sequences(layout, cu_seqlens_q, cu_seqlens_kv, q4, k4)
    recipe = dict(p_format=p_format, v_format=v_format, scaling=scaling, scale_rounding=scale_rounding)
    _check_common_options(attn_scale, causal, diagonal_alignment, window, out_dtype, p_scale, recipe)
    _check_rescale_threshold(rescale_threshold)
    all64 = all(t.dtype == torch.float64 for t in (q, k, v))
    stats_dtype = torch.float64 if not quantize_inputs and all64 else torch.float32
    lead = q.shape[:-1]  # [T_q, Hq] or [B, Hq, Sq_max]
    o = torch.zeros(*lead, v.shape[-1], dtype=out_dtype, device=q.device)
    stats = torch.full(lead if layout == "thd" else (*lead, 1), float("-inf"), dtype=stats_dtype, device=q.device)
    o4, stats4 = _bhsd(o, layout), _bhsd(stats, layout)
    opts = dict(attn_scale=attn_scale, causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                out_dtype=out_dtype, p_scale=p_scale, quantize_inputs=quantize_inputs,
                rescale_threshold=rescale_threshold, sink=_check_sink(sink, q4.shape[1], q.device), **recipe)
    for seq in seqs:
        if seq.len_q > 0 and seq.len_kv == 0 and sink is not None:  # only the sink in the softmax
            _rows(stats4, seq, "q").copy_(sink.view(1, -1, 1, 1).expand_as(_rows(stats4, seq, "q")))
        if seq.len_q == 0 or seq.len_kv == 0:
            continue  # no query rows, or nothing to attend: O = 0, stats = -inf (or the sink)
        o_b, stats_b = sdpa_fwd(_rows(q4, seq, "q").contiguous(), _rows(k4, seq, "kv").contiguous(),
                                _rows(v4, seq, "kv").contiguous(), **opts)
        _rows(o4, seq, "q").copy_(o_b)
        _rows(stats4, seq, "q").copy_(stats_b)
    return o, stats


def sdpa_bwd_varlen(q, k, v, o, do, stats, cu_seqlens_q, cu_seqlens_kv, *, layout="thd", attn_scale=None,
                    causal=False, diagonal_alignment="top_left", window=(None, None), out_dtype=torch.bfloat16,
                    p_scale=256.0, quantize_inputs=True, sink=None, p_format="e4m3", v_format="fp8",
                    ds_format="fp8", scaling="mxfp8", scale_rounding="ceil"):
    """Variable-length backward: ``sdpa_bwd`` on each sequence alone (see the section comment above).
    With sink [Hq] a fourth result dsink [Hq] (summed over the sequences) follows.
    p_format, v_format, ds_format, scaling, scale_rounding: the recipe variants of ``sdpa_bwd`` ("mxfp8" only).

    q, k, v, cu_seqlens_*, layout as in ``sdpa_fwd_varlen``; o, do shaped like q with v's head dim;
    stats as returned by ``sdpa_fwd_varlen`` (thd [T_q, Hq], padded [B, Hq, Sq_max, 1]) or None (recomputed).
    Returns (dq, dk, dv) shaped like q, k, v in out_dtype; padding rows and sequences with no query rows or
    no keys get zero gradients.
    """
    q4, k4, v4, _ = _varlen_operands(layout, q, k, v)
    want = (*q.shape[:-1], v.shape[-1])
    for t, n in ((o, "o"), (do, "do")):
        _check_float_tensor(t, n)
        if tuple(t.shape) != want:
            raise ValueError(f"{n}: expected shape {want} (q's rows and heads, v's head dim), got {tuple(t.shape)}")
        _check_device(t, n, q.device, "q")
    if stats is not None:
        want_stats = tuple(q.shape[:-1]) if layout == "thd" else (*q.shape[:-1], 1)
        _check_float_tensor(stats, "stats")
        if tuple(stats.shape) != want_stats:
            raise ValueError(f"stats: expected shape {want_stats}, got {tuple(stats.shape)}")
        _check_device(stats, "stats", q.device, "q")
    seqs = _varlen_sequences(layout, cu_seqlens_q, cu_seqlens_kv, q4, k4)
    recipe = dict(p_format=p_format, v_format=v_format, ds_format=ds_format, scaling=scaling,
                  scale_rounding=scale_rounding)
    _check_common_options(attn_scale, causal, diagonal_alignment, window, out_dtype, p_scale, recipe)
    dq, dk, dv = (torch.zeros(t.shape, dtype=out_dtype, device=q.device) for t in (q, k, v))
    o4, do4, dq4, dk4, dv4 = (_bhsd(t, layout) for t in (o, do, dq, dk, dv))
    stats4 = None if stats is None else _bhsd(stats, layout)
    opts = dict(attn_scale=attn_scale, causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                out_dtype=out_dtype, p_scale=p_scale, quantize_inputs=quantize_inputs,
                sink=_check_sink(sink, q4.shape[1], q.device), **recipe)
    dsink = None if sink is None else torch.zeros(sink.shape, dtype=sink.dtype, device=q.device)
    for seq in seqs:
        if seq.len_q == 0 or seq.len_kv == 0:
            continue  # no query rows, or nothing to attend (O = 0, so delta = 0): zero gradients
        stats_b = None if stats4 is None else _rows(stats4, seq, "q").contiguous()
        dq_b, dk_b, dv_b, *dsink_b = sdpa_bwd(_rows(q4, seq, "q").contiguous(), _rows(k4, seq, "kv").contiguous(),
                                    _rows(v4, seq, "kv").contiguous(), _rows(o4, seq, "q").contiguous(),
                                    _rows(do4, seq, "q").contiguous(), stats_b, **opts)
        _rows(dq4, seq, "q").copy_(dq_b)
        _rows(dk4, seq, "kv").copy_(dk_b)
        _rows(dv4, seq, "kv").copy_(dv_b)
        if dsink is not None:
            dsink += dsink_b[0].to(dsink.dtype)
    return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)
