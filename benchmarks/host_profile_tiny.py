"""cProfile of the tiny call's forward+backward on a CUDA machine (host time by function): where the per-call
host cost goes. Usage: python benchmarks/host_profile_tiny.py [backend]"""
import os
import sys
import warnings

import torch

import mxattn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profiling import cprofile_steps  # noqa: E402

warnings.simplefilter("ignore")
backend = sys.argv[1] if len(sys.argv) > 1 else "triton"
q, k, v = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)


def call():
    mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend=backend).backward(do)


for _ in range(50):
    call()
torch.cuda.synchronize()
cprofile_steps(call, 500, 35)
