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
The stats (log-sum-exp) may be an output that is differentiated too: the
backward functions take its gradient as ``dstats`` (shaped like stats), and
since d stats / d S = P it enters as delta = rowsum(O * dO) - dstats (the
sink's gradient below then uses that delta).

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
dsink[h] = -sum over batch and rows of exp(sink[h] - stats) * delta, delta = rowsum(O * dO) (minus dstats
when given).

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

Modules
-------
This module is the public face of the emulator: it keeps this docstring and re-exports every name the
emulator defines. The code lives in small modules beside it, each importing only those before it:
``checks`` (argument validation), ``quantizers`` (MXFP8 E8M0/E4M3 blocks, P rounding, per-tensor FP8),
``masks`` (the mask rule), ``cores`` (FP64-rounded math and the blocked forward / backward cores),
``sdpa_dense`` (``sdpa_fwd`` / ``sdpa_bwd`` and their ``*_quantized`` forms) and ``sdpa_varlen``
(``sdpa_fwd_varlen`` / ``sdpa_bwd_varlen``). Tests that patch a module global (``CHUNK_ELEMS``,
``_group_chunks``) patch it in ``ref.cores``, where the cores look it up.
"""

from __future__ import annotations

# The public API (what ``ref/__init__.py`` exports).
from .masks import keep_mask  # noqa: F401
from .quantizers import dequantize, quantize, quantize_per_tensor  # noqa: F401
from .sdpa_dense import sdpa_bwd, sdpa_bwd_quantized, sdpa_fwd, sdpa_fwd_quantized  # noqa: F401
from .sdpa_varlen import sdpa_bwd_varlen, sdpa_fwd_varlen  # noqa: F401

# Every other name this module defined before it was split into the modules above, so that callers reaching
# in (tests use R._keep, R._Mask, R._exp2_f32, R._group_chunks) keep working. Rebinding one of these here
# changes nothing inside the modules: patch the module that defines it (e.g. ref.cores.CHUNK_ELEMS).
from .checks import (  # noqa: F401
    _attn_scale, _check_choice, _check_device, _check_float_tensor, _check_out_dtype, _check_p_scale,
    _check_rescale_threshold, _check_scaling, _check_shapes, _check_sink, _CHOICES, _FLOAT_DTYPES, _norm_axis,
)
from .quantizers import (  # noqa: F401
    BLOCK_SIZE, E4M3_MAX, _exp2_f32, _FP32_MAX, _FP8_DTYPES, _per_tensor_from_amax, _per_tensor_scale, _qdq,
    _qdq_per_tensor, _quant_p, _quantize_blocks, _round_p, _scale_exponent, _scale_exponent_floor,
)
from .masks import _keep, _Mask, _resolve_mask  # noqa: F401
from .cores import (  # noqa: F401
    _bwd_chunks, _bwd_core, CHUNK_ELEMS, _DsRounding, _exp, _exp2, _fwd_core, _group_chunks, KV_BLOCK, _log,
    _LOG2E, _mm, _sum,
)
from .sdpa_dense import _check_o_do_stats, _check_pair, _quantize_operand  # noqa: F401
from .sdpa_varlen import (  # noqa: F401
    _bhsd, _check_common_options, _check_cu_seqlens, _check_layout, _LAYOUTS, _rows, _Seq, _varlen_operands,
    _varlen_sequences,
)
