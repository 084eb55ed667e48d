"""Run the triton backend's forward on already-quantized inputs (`mxfp8_attention_quantized`) and on the
high-precision inputs (`mxfp8_attention`) under Triton's interpreter on the CPU: the quantizer and the forward
kernel (two-launch path, bf16-scratch or FP8 data path; the one-launch quantizing kernel for a decode step)
compute, so the two calls must give the same bytes, which checks what the quantized host path hands the kernel
(Q's bytes and scales, K and V dequantized or laid out seq-major). The reference backend's O is printed beside
it (the interpreter's arithmetic is not the GPU's: one bf16 ulp apart).

Run as a script with TRITON_INTERPRET=1; prints one JSON line per case: {"case", "path", "equal", "nan",
"nonzero", "max_abs_vs_reference"}; "fp8" as the first argument forces the FP8 data path. Besides what
tests/interpret_paged_decode.py stands in for (its `_patch_interpreter`), the interpreter (Triton 3.6) keeps
bfloat16 as uint16 bit patterns and computes on those: the tiles' dequantization (`dequant_rows` /
`dequant_cols`, bf16 products) runs in fp32 here, exactly as on the GPU (one rounding to bf16 of an exact
product), and bf16 dot products take their operands as fp32; the inline-assembly conversions are written with
`.to`.
"""

import json
import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

from interpret_paged_decode import _patch_interpreter  # noqa: E402


def _patch_bf16_dot():
    import triton.runtime.interpreter as ti
    dot = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:  # uint16 patterns -> fp32 values
            def as_fp32(h):
                return (h.data.astype(np.uint32) << 16).view(np.float32)
            return ti.TensorHandle(np.matmul(as_fp32(a), as_fp32(b), dtype=np.float32) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    ti.InterpreterBuilder.create_dot = create_dot


@triton.jit
def _e4m3_to_bf16_biased(x):
    return (x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 7.52316384526264e-37).to(tl.bfloat16)  # * 2^-120


@triton.jit
def _round_p_to_bf16(p):
    return p.to(tl.float8e4nv).to(tl.float32).to(tl.bfloat16)


@triton.jit
def _pow2_factors(s):
    e = s.to(tl.int32)
    return tl.where(e == 255, float("nan"), tl.exp2((e - 127).to(tl.float32)))


@triton.jit
def _dequant_rows(x, s, R: tl.constexpr, C: tl.constexpr):
    y = tl.reshape(x.to(tl.float8e4nv, bitcast=True).to(tl.float32), (R, C // 32, 32)) * _pow2_factors(s)[:, :, None]
    return tl.reshape(y, (R, C)).to(tl.bfloat16)


@triton.jit
def _dequant_cols(x, s, R: tl.constexpr, C: tl.constexpr):
    y = tl.reshape(x.to(tl.float8e4nv, bitcast=True).to(tl.float32), (R // 32, 32, C)) * _pow2_factors(s)[:, None, :]
    return tl.reshape(y, (R, C)).to(tl.bfloat16)


def _stand_ins(fp8: bool):
    """The interpreter's stand-ins, the CUDA checks relaxed, launch plans off (`fp8`: the FP8 data path)."""
    _patch_interpreter()
    _patch_bf16_dot()
    from mxattn import checks
    from mxattn.backends import triton_backend as backend
    from mxattn.kernels import triton_attention_fwd as tf, triton_common as tc, triton_quantize as tq
    from mxattn.runtime import triton_launch
    for module in (tc, tf, tq):
        for name, fn in (("e4m3_to_bf16_biased", _e4m3_to_bf16_biased), ("round_p_to_bf16", _round_p_to_bf16),
                         ("dequant_rows", _dequant_rows), ("dequant_cols", _dequant_cols)):
            if hasattr(module, name):
                setattr(module, name, fn)
    triton_launch.FAST_PATH = False  # Triton's own launcher (the interpreter's)
    real = checks.check_bhsd_tensor
    for module in (checks, backend, tq):
        module.check_bhsd_tensor = lambda x, n, d, dev=None: real(x, n, d)
    backend.TritonBackend.availability = classmethod(lambda cls, device: (True, "interpreted"))
    backend._forward_key = lambda roots, params: None
    if fp8:
        tf.fwd_streams_bf16 = lambda *a: False


def _cu(lengths):
    return torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def cases():
    """(name, q, k, v, mxfp8_attention keywords, whether the unquantized call has a backward)."""
    import mxattn
    out = [("dense_causal", _randn(1, 70, 2, 64, seed=1), _randn(1, 150, 1, 64, seed=2) * 3,
            _randn(1, 150, 1, 64, seed=3), dict(attn_mask_type="causal"), True)]
    q, k, v = _randn(2, 40, 2, 64, seed=4), _randn(2, 70, 2, 64, seed=5), _randn(2, 70, 2, 64, seed=6)
    q[1, 9:], k[1, 33:], v[1, 33:] = 3e4, -3e4, float("nan")  # padding: read as zeros by both calls
    out.append(("padded", q, k, v, dict(attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=_cu([40, 9]),
                                        cu_seqlens_kv=_cu([70, 33])), True))
    len_q, len_kv = [20, 0, 45, 1], [40, 7, 70, 0]
    out.append(("packed_sink", _randn(sum(len_q), 2, 64, seed=7), _randn(sum(len_kv), 1, 64, seed=8),
                _randn(sum(len_kv), 1, 64, seed=9),
                dict(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=_cu(len_q),
                     cu_seqlens_kv=_cu(len_kv), softmax_type="learnable", softmax_offset=torch.tensor([0.5, -1.0])),
                True))
    out.append(("bf16_v_lazy16", *out[0][1:4], dict(attn_mask_type="causal",
                                                    recipe=mxattn.Recipe(v_operand="bf16", p_quant="lazy16")), True))
    out.append(("d256_sink", _randn(1, 40, 2, 256, seed=10), _randn(1, 70, 1, 256, seed=11),
                _randn(1, 70, 1, 256, seed=12), dict(attn_mask_type="causal", softmax_type="off-by-one"), True))
    out.append(("decode_one_launch", _randn(2, 1, 4, 64, seed=13), _randn(2, 150, 2, 64, seed=14),
                _randn(2, 150, 2, 64, seed=15), dict(attn_mask_type="causal_bottom_right"), False))
    return out


def run_case(name, q, k, v, kw, backward, fp8) -> dict:
    import mxattn
    quantized_kw = {n: kw[n] for n in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "recipe") if n in kw}
    leaves = [x.clone().requires_grad_(backward) for x in (q, k, v)]
    want = mxattn.mxfp8_attention(*leaves, backend="triton", **kw).detach()
    with torch.no_grad():
        got = mxattn.mxfp8_attention_quantized(*mxattn.quantize_attention_inputs(q, k, v, **quantized_kw),
                                               backend="triton", **kw)
        ref = mxattn.mxfp8_attention(q, k, v, backend="reference", **kw)
    return dict(case=name, path="fp8" if fp8 else "auto", equal=torch.equal(got, want),
                nan=bool(got.isnan().any()), nonzero=bool(got.abs().sum() > 0),
                max_abs_vs_reference=(got.float() - ref.float()).abs().max().item())


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    fp8 = sys.argv[1:] == ["fp8"]
    _stand_ins(fp8)
    for case in cases():
        print(json.dumps(run_case(*case, fp8)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
