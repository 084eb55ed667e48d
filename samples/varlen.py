"""Variable lengths: a packed (thd) token stream of documents, and the same documents as a padded batch.

Shows that each document's output is its own (the pack equals one call per document, bit for bit), that
padding does not matter (NaN in the padding rows reaches nothing), and the MXFP8 error against FP64 attention
with a block-diagonal causal mask. Runs on the best backend this machine has.
"""

import warnings

import torch
import torch.nn.functional as F

import mxattn

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
lengths = [300, 17, 128, 455]                      # four documents of different lengths
heads, kv_heads, head_dim = 8, 2, 64
cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
total = int(cu[-1])

# packed: [T, H, D], TE's thd layout, with causal attention inside each document
q = torch.randn(total, heads, head_dim, device=device, dtype=torch.bfloat16)
k = torch.randn(total, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
v = torch.randn(total, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
out = mxattn.mxfp8_attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal",
                             cu_seqlens_q=cu, cu_seqlens_kv=cu)
print(f"packed: {len(lengths)} documents, {total} tokens -> output {tuple(out.shape)} {out.dtype} on {device}")

same = all(torch.equal(out[a:b], mxattn.mxfp8_attention(q[a:b][None], k[a:b][None], v[a:b][None],
                                                        attn_mask_type="causal")[0])
           for a, b in zip(cu.tolist(), cu.tolist()[1:]))
print(f"each document equals its own call, bit for bit: {same}")

# padded: [B, S_max, H, D] with NaN in the padding; the lengths say which rows are real
batch, s_max = len(lengths), max(lengths)
qp, kp, vp = (torch.full((batch, s_max) + t.shape[1:], float("nan"), device=device, dtype=t.dtype) for t in (q, k, v))
for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
    qp[i, :b - a], kp[i, :b - a], vp[i, :b - a] = q[a:b], k[a:b], v[a:b]
out_padded = mxattn.mxfp8_attention(qp, kp, vp, qkv_format="bshd", attn_mask_type="padding_causal",
                                    cu_seqlens_q=cu, cu_seqlens_kv=cu)
real = torch.cat([out_padded[i, :n] for i, n in enumerate(lengths)])
print(f"padded batch {tuple(qp.shape)} with NaN padding: no NaN in the output: {not out_padded.isnan().any().item()},"
      f" real rows equal the packed output: {torch.equal(real, out)}")

# FP64 attention with a block-diagonal causal mask, for the MXFP8 error
doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
pos = torch.arange(total, device=device) - cu[:-1].long()[doc]
keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
q64, k64, v64 = (t.double().transpose(0, 1) for t in (q, k, v))
exact = F.scaled_dot_product_attention(q64, k64.repeat_interleave(4, 0), v64.repeat_interleave(4, 0),
                                       attn_mask=keep).transpose(0, 1)
err = ((out.double() - exact).norm() / exact.norm()).item()
print(f"relative RMS error against FP64 attention: {err:.3e}")
