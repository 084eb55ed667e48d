import sys, os, traceback
sys.path[:0] = [".", "benchmarks"]
import torch, mxattn
from mxattn.backends import triton_backend as be
from mxattn.kernels import gluon_attention_bwd as gb
from packed_bwd_bench import doc_lengths
mode, total, hq, hkv, d, causal, lo, hi = sys.argv[1], *map(int, sys.argv[2:9])
if "st4" in mode:
    gb.STATS_LOADS[d] = 4
lens = doc_lengths(total, lo, hi)
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
g = torch.Generator(device="cuda").manual_seed(1)
qkv = torch.randn(total, hq + 2 * hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
do = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
kw = dict(qkv_format="thd", backend="triton", cu_seqlens_q=cu, cu_seqlens_kv=cu,
          attn_mask_type="padding_causal" if causal else "padding")
be.GLUON_BACKWARD = "gluon" in mode
x = qkv.clone().requires_grad_("fwd" not in mode)
q, k, v = x.split([hq, hkv, hkv], dim=1)
try:
    o = mxattn.mxfp8_attention(q, k, v, **kw)
    torch.cuda.synchronize()
    if "fwd" not in mode:
        o.backward(do)
        torch.cuda.synchronize()
    print(mode, sys.argv[2:], len(lens), "OK", flush=True)
except Exception as e:
    tb = traceback.extract_tb(e.__traceback__)
    print(mode, sys.argv[2:], len(lens), "FAIL", str(e)[:100], [f"{f.name}:{os.path.basename(f.filename)}:{f.lineno}" for f in tb[-8:]], flush=True)
