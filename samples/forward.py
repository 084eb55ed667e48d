"""The smallest complete use of mxattn: one MXFP8 attention forward pass.

Runs on the best backend this machine has (cudnn on Blackwell, triton on other CUDA GPUs, reference on CPU).
"""

import torch

import mxattn

device = "cuda" if torch.cuda.is_available() else "cpu"
batch, seq, heads, head_dim = 2, 512, 8, 128

# bshd layout, as Transformer Engine and most models keep activations: [batch, seq, heads, head_dim]
q = torch.randn(batch, seq, heads, head_dim, device=device, dtype=torch.bfloat16)
k = torch.randn(batch, seq, heads, head_dim, device=device, dtype=torch.bfloat16)
v = torch.randn(batch, seq, heads, head_dim, device=device, dtype=torch.bfloat16)

out = mxattn.mxfp8_attention(q, k, v, qkv_format="bshd", attn_mask_type="causal")
print("output", tuple(out.shape), out.dtype, "on", out.device)

# the same attention in BF16, for a feel of the MXFP8 error
ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
err = (out.float() - ref.float()).norm() / ref.float().norm()
print(f"relative RMS difference to BF16 SDPA: {err:.3e}")
