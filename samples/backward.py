"""The smallest complete training-style use: forward, loss, backward through MXFP8 attention.

Q, K, V and dO are quantized to MXFP8 inside; gradients come back in the inputs' dtype.
"""

import torch

import mxattn

device = "cuda" if torch.cuda.is_available() else "cpu"
batch, seq, heads, kv_heads, head_dim = 2, 256, 8, 2, 64  # grouped-query attention, 4 query heads per KV head

q = torch.randn(batch, seq, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(batch, seq, kv_heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(batch, seq, kv_heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)

out = mxattn.mxfp8_attention(q, k, v, qkv_format="bshd", attn_mask_type="causal")
loss = out.float().square().mean()
loss.backward()

print(f"loss {loss.item():.5f}")
for name, t in (("q", q), ("k", k), ("v", v)):
    print(f"d{name}: shape {tuple(t.grad.shape)}, dtype {t.grad.dtype}, norm {t.grad.float().norm():.4f}")
