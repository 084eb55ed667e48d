"""Independent reference (yardstick) emulator of cuDNN's MXFP8 SDPA numerics.

Never imports ``mxattn``: it is the yardstick the library is measured against.
"""

from .mxfp8_ref import (
    dequantize,
    keep_mask,
    quantize,
    quantize_per_tensor,
    sdpa_bwd,
    sdpa_bwd_quantized,
    sdpa_bwd_varlen,
    sdpa_fwd,
    sdpa_fwd_quantized,
    sdpa_fwd_varlen,
)

__all__ = [
    "quantize",
    "quantize_per_tensor",
    "dequantize",
    "keep_mask",
    "sdpa_fwd",
    "sdpa_bwd",
    "sdpa_fwd_quantized",
    "sdpa_bwd_quantized",
    "sdpa_fwd_varlen",
    "sdpa_bwd_varlen",
]
