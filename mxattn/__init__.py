"""mxattn: fused scaled-dot-product attention in MXFP8 for PyTorch.

Q, K, V (and dO in backward) are FP8 E4M3 with one E8M0 power-of-two scale per 32 values, following the
cuDNN / Transformer Engine MXFP8 recipe. Backends: `cudnn` (Blackwell), `triton` (other CUDA GPUs, exact
emulation), `reference` (pure PyTorch, any device). Variable lengths (padded and packed `thd` batches) and
attention sinks follow Transformer Engine's arguments; `mxattn.integrations.transformers` plugs into Hugging Face;
`MXFP8KVCache` with `mxfp8_attention_with_kvcache` serves decode steps from a paged MXFP8 cache;
`mxfp8_attention_quantized` runs the forward on inputs that arrive already quantized (`MXFP8Tensor`). `Recipe` selects
numerics variants (P, V and dS rounding, scale rounding, per-tensor FP8) for studies; `reference` runs them all.
"""

from .attention import mxfp8_attention
from .attention_quantized import mxfp8_attention_quantized, quantize_attention_inputs
from .backends import BACKEND_NAMES, availability as backend_availability
from .backends.cudnn.support import cudnn_support
from .errors import MXFP8NotSupportedError
from .formats import MXFP8Tensor, quantize_mxfp8, swizzle_128x4, unswizzle_128x4
from .kvcache import MXFP8KVCache
from .kvcache_call import PagedStep, mxfp8_attention_with_kvcache
from .mask import MaskSpec
from .module import DotProductAttention
from .recipe import Recipe
from .seqinfo import SeqInfo, cu_seqlens_from_padding_mask

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAMES",
    "DotProductAttention",
    "MXFP8NotSupportedError",
    "MXFP8KVCache",
    "PagedStep",
    "MXFP8Tensor",
    "MaskSpec",
    "Recipe",
    "SeqInfo",
    "backend_availability",
    "cu_seqlens_from_padding_mask",
    "cudnn_support",
    "mxfp8_attention",
    "mxfp8_attention_quantized",
    "mxfp8_attention_with_kvcache",
    "quantize_attention_inputs",
    "quantize_mxfp8",
    "swizzle_128x4",
    "unswizzle_128x4",
]
