"""Triton and Gluon kernels for MXFP8 attention on GPUs without MXFP8 tensor cores, with their launch wrappers.

Modules (each imports triton; import them only where triton is installed):
  triton_quantize         fused row-wise + column-wise MXFP8 quantizer and the shared device helpers
  triton_attention_fwd    forward kernel (spec section 6)
  triton_attention_bwd    dK/dV and dQ kernels and the backward's launches (spec section 7)
  triton_bwd_prep         the backward's prep pass (delta, bf16 scratch)
  triton_bwd_tiles        the backward's tile loads and stores (prep pass, dK/dV and dQ kernels)
  triton_paged_attention  attention over the paged MXFP8 KV cache (decode steps, short chunks)
  triton_paged_decode     the paged kernel's decode data path (FP8 bytes straight to the tensor cores)
  triton_paged_append     writes of new tokens into the paged MXFP8 KV cache
  triton_common           the @triton.jit helpers they share (E8M0 arithmetic, (de)quantization, softmax step)
Gluon Hopper (sm_90a) kernels, warp-specialised (each kernel's device code apart from its host side):
  gluon_attention_fwd     forward, host side: which calls it takes, schedule, launch, offline build
  gluon_fwd_kernel        forward, device code (producer and consumer partitions)
  gluon_attention_bwd     dK/dV kernel, host side, and the call checks the dQ launcher shares
  gluon_dkdv_kernel       dK/dV kernel, device code
  gluon_attention_dq      dQ kernel, host side
  gluon_dq_kernel         dQ kernel, device code
  gluon_bwd_common        device helpers and RECIPE bits the dK/dV and dQ kernels share
  gluon_common            device helpers all three share (E4M3 conversions, dequantization, sequence geometry)
This package's __init__ imports nothing, so `import mxattn.kernels` works without triton or a GPU.
"""
