"""Triton kernels for MXFP8 attention on GPUs without MXFP8 tensor cores.

Modules (each imports triton; import them only where triton is installed):
  triton_quantize       fused row-wise + column-wise MXFP8 quantizer and the shared device helpers
  triton_attention_fwd  forward kernel (spec section 6)
  triton_attention_bwd  dK/dV and dQ kernels and the backward's launches (spec section 7)
  triton_bwd_prep       the backward's prep pass (delta, bf16 scratch)
  triton_bwd_tiles      the backward's tile loads and stores (prep pass, dK/dV and dQ kernels)
  triton_paged_attention  attention over the paged MXFP8 KV cache (decode steps, short chunks)
  triton_common         the @triton.jit helpers they share (E8M0 arithmetic, (de)quantization, softmax step)
This package's __init__ imports nothing, so `import mxattn.kernels` works without triton or a GPU.
"""
