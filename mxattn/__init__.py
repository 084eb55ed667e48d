"""mxattn: fused scaled-dot-product attention in MXFP8 for PyTorch.

Q, K, V (and dO in backward) are FP8 E4M3 with one E8M0 power-of-two scale per 32 values, following the
cuDNN / Transformer Engine MXFP8 recipe. Backends: `cudnn` (Blackwell), `triton` (other CUDA GPUs, exact
emulation), `reference` (pure PyTorch, any device). Variable lengths (padded and packed `thd` batches) and
attention sinks follow Transformer Engine's arguments; `mxattn.integrations.transformers` plugs into Hugging Face;
`MXFP8KVCache` with `mxfp8_attention_with_kvcache` serves decode steps from a paged MXFP8 cache;
`mxfp8_attention_quantized` runs the forward on inputs that arrive already quantized (`MXFP8Tensor`);
`context_parallel_attention` (and `DotProductAttention.set_context_parallel_group`) splits the sequence over the ranks
of a torch.distributed group. `Recipe` selects numerics variants (P, V and dS rounding, scale rounding, per-tensor FP8)
for studies; `reference` runs them all.
"""

from .attention import mxfp8_attention
from .backends import BACKEND_NAMES, availability as backend_availability
from .backends.cudnn.support import cudnn_support
from .context_parallel import context_parallel_attention
from .errors import MXFP8NotSupportedError
from .formats import MXFP8Tensor, quantize_mxfp8, swizzle_128x4, unswizzle_128x4
from .kvcache import MXFP8KVCache
from .kvcache_call import mxfp8_attention_with_kvcache
from .kvcache_step import PagedStep
from .mask import MaskSpec
from .module import DotProductAttention
from .recipe import Recipe
from .seqinfo import SeqInfo, cu_seqlens_from_padding_mask

__version__ = "0.1.0"

#: public names loaded on first use: `attention_quantized` is eager-only (torch.compiler.disable), and that
#: decorator imports torch._dynamo, which a plain `import mxattn` should not pay for
_LAZY = {"mxfp8_attention_quantized": ".attention_quantized", "quantize_attention_inputs": ".attention_quantized"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

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
    "context_parallel_attention",
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
