"""Kernel variants the backends launch compile for Hopper (sm_90) on a machine without a GPU: Triton's compiler
and the ptxas it ships run on the CPU, so CI catches a kernel that would not build before a GPU run does. (What
the kernels compute is checked on the GPU: test_quantizing_fwd_gpu.py, test_kvcache_gpu.py.)"""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")

PAGED_TYPES = dict(Q="*bf16", O="*bf16", CU_Q="*i32", SLOTS="*i32", SEQ_LENS="*i32", SINK="*fp32", PT="*i32",
                   KD="*fp8e4nv", KS="*u8", VD="*fp8e4nv", VS="*u8", VT="*bf16", qk_scale="fp32")


@pytest.mark.parametrize("dp,window_sink,dtype", [(64, False, "bf16"), (128, True, "fp32")])
def test_paged_attention_kernel_builds_for_sm90(dp, window_sink, dtype):
    from triton_compile import compile_for
    from mxattn.kernels import triton_paged_attention as tp
    bm, warps, stages = tp.paged_config(dp)
    types = dict(PAGED_TYPES, Q=f"*{dtype}", VT=f"*{dtype}")
    kernel = compile_for(tp._paged_attn_kernel, types, dict(HAS_LB=window_sink, HAS_SINK=window_sink, BM=bm,
                                                            BN=tp.BLOCK_N, DP=dp),
                         num_warps=warps, num_stages=stages)
    assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024


def test_one_launch_forward_builds_for_sm90():
    """The forward kernel with Q, K, V quantized on load (QDQ), a padded variable-length batch, GQA, a window."""
    import torch
    from triton_compile import compile_for
    from mxattn.kernels import triton_attention_fwd as tf
    bm, warps, stages = tf.quantizing_fwd_config(1, 64, torch.bfloat16)
    types = dict(Q="*bf16", QS="*bf16", K="*bf16", KS="*bf16", V="*bf16", VS="*bf16", O="*bf16", LSE="*fp32",
                 CU_Q="*i32", CU_KV="*i32", SINK="*fp32", qk_scale="fp32")
    kernel = compile_for(tf._attn_fwd_kernel, types,
                         dict(HAS_LB=True, HAS_RB=True, BM=bm, BN=tf.BLOCK_N, DP=64, EVEN_D=True, VARLEN=True,
                              PACKED=False, BOTTOM_RIGHT=True, HAS_SINK=False, KV_BF16=False, QDQ=True),
                         num_warps=warps, num_stages=stages)
    assert "cubin" in kernel.asm
