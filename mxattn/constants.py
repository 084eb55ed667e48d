"""Constants shared across mxattn, one name per concept: the MXFP8 block, the F8_128x4 scale tile, the dtype sets,
Transformer Engine's softmax types and ceil-division. The Triton kernels wrap the numbers in `tl.constexpr`
(`mxattn.kernels.triton_quantize`)."""

from __future__ import annotations

import torch

#: elements per MXFP8 block (one E8M0 scale each), along D (row-wise) or along S (column-wise)
MX_BLOCK = 32
#: rows of one F8_128x4 scale tile (128 rows x 4 scale columns = 512 bytes); cuDNN's per-sequence SF tile too
SF_TILE = 128
#: high-precision dtypes mxattn takes in and quantizes (q, k, v; the quantizers' inputs)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: element dtype of the MXFP8 operands attention takes, already quantized (E4M3; E5M2 is a gradient format)
ATTENTION_FP8_DTYPE = torch.float8_e4m3fn
#: dtypes the kernels write O and the gradients in; fp32 callers get a cast at the end
KERNEL_OUT_DTYPES = (torch.bfloat16, torch.float16)
#: Transformer Engine's softmax_type values: plain softmax, a zero sink logit, a learned sink logit per head
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) of host ints (the same expression serves SymInts and integer tensors)."""
    return -(-a // b)

# most programs sharing one sequence's keys in the paged KV-cache kernel (split KV)
MAX_KV_SPLITS = 64
