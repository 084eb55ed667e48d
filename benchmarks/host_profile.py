"""Where the host time of one public-API forward call goes (triton backend, B2 H16 S4096 D128 bshd causal,
no grad): CPU thread time per call of each layer, from the public function down to one bare launch, so the
differences show what each layer costs; then the same for the backward (TritonBackend.backward and its parts).
Usage (CUDA machine): python benchmarks/host_profile.py"""

import torch

import mxattn
from mxattn import ops
from mxattn.backends.base import AttentionParams
from mxattn.bench import host_time_us
from mxattn.backends.triton_backend import TritonBackend
from mxattn.kernels import triton_attention_fwd as tf
from mxattn.kernels.triton_quantize import quantize_qkv, quantize_rowcol
from mxattn.mask import MaskSpec


dev = torch.device("cuda")
q, k, v = (torch.randn(2, 4096, 16, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
be = TritonBackend()
params = AttentionParams(softmax_scale=128 ** -0.5, mask=MaskSpec(causal=True), out_dtype=torch.bfloat16)
qq, kq, vq = quantize_rowcol(qb), quantize_rowcol(kb), quantize_rowcol(vb, col_seq_major=True)
o = torch.empty_like(qb)
st = torch.empty(2, 16, 4096, 1, device=dev)
rows = {
    "mxfp8_attention (public API)": lambda: mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal",
                                                                   backend="triton"),
    "TritonBackend.forward": lambda: be.forward(qb, kb, vb, params),
    "quantize_rowcol(q) row+col": lambda: quantize_rowcol(qb),
    "quantize_qkv (as the forward)": lambda: quantize_qkv(qb, kb, vb, {}, dict(row_dequant=True),
                                                          dict(col_dequant=True)),
    "attention_fwd (kernel launch)": lambda: tf.attention_fwd(qq.row.data, qq.row.scale, kq.row.data,
                                                              kq.row.scale, vq.col_seq_major, out=o, stats=st,
                                                              softmax_scale=0.088, offset=0, left_bound=None,
                                                              right_bound=0),
    "torch.empty_like(q)": lambda: torch.empty_like(qb),
}
with torch.no_grad():
    for name, fn in rows.items():
        print(f"{name:40s} {host_time_us(fn, 300, 10):8.1f} us", flush=True)
    print("custom op registered:", hasattr(ops, "attention_fwd"))

from mxattn.kernels import triton_attention_bwd as tb  # noqa: E402
from mxattn.kernels import triton_bwd_prep as tp  # noqa: E402
from mxattn.kernels.triton_attention_fwd import check_seq  # noqa: E402
from mxattn.seqinfo import kernel_cu_seqlens  # noqa: E402

o, st, saved = be.forward(qb, kb, vb, params)
do = torch.randn_like(qb)
delta = torch.empty(2, 16, 4096, device=dev)
grads = (torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb))
bwd_rows = {
    "TritonBackend.backward": lambda: be.backward(saved, o, st, do, params),
    "attention_bwd (pre)": lambda: tb.attention_bwd(saved.q_row, saved.q_col, saved.k_row, saved.k_col,
                                                    saved.v_row, None, None, o, do, st, dq=grads[0],
                                                    dk=grads[1], dv=grads[2], softmax_scale=0.088, offset=0,
                                                    left_bound=None, right_bound=0, mode="pre"),
    "bwd_prep (heads 0-12)": lambda: tp.bwd_prep(o, do, saved.q_row, saved.q_col, delta, 0, 12,
                                                 check_seq(None, saved.q_row.data, saved.k_row.data),
                                                 kernel_cu_seqlens(None, st)),
    "kv_prep (KV heads 0-12)": lambda: tp.kv_prep(saved.k_row, saved.k_col, saved.v_row, 0, 12,
                                                  check_seq(None, saved.q_row.data, saved.k_row.data),
                                                  kernel_cu_seqlens(None, st)),
    "torch.cuda.get_device_properties": lambda: torch.cuda.get_device_properties(o.device),
}
for name, fn in bwd_rows.items():
    print(f"{name:40s} {host_time_us(fn, 100, 5):8.1f} us", flush=True)
