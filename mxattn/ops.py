"""The `torch.library` custom ops (forward, backward) and their autograd wiring.

`mxattn::attention_fwd` returns O, stats and the FP8 copies that backward needs; `mxattn::attention_bwd`
turns them and dO into dQ, dK, dV. Both have fake (meta) implementations, so `torch.compile(fullgraph=True)`
traces models that use them without graph breaks. Tensors are [B, H, S, D] views; the concrete backend is
chosen by the caller (`mxattn.attention`) and passed by name.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .backends import AttentionParams, SavedForBackward, get_backend
from .formats import quantize_mxfp8  # noqa: F401  (the quantizer backends use; imported for early errors)
from .layouts import dense_strides_bhsd, empty_bhsd
from .mask import MaskSpec

_FP8 = torch.float8_e4m3fn
_E8M0 = torch.float8_e8m0fnu


def _params(softmax_scale, causal, bottom_right, left_bound, right_bound, out_dtype) -> AttentionParams:
    mask = MaskSpec(causal=causal, diagonal_alignment="bottom_right" if bottom_right else "top_left",
                    left_bound=left_bound, right_bound=right_bound)
    return AttentionParams(softmax_scale=softmax_scale, mask=mask, out_dtype=out_dtype)


def _ceil32(n: int) -> int:
    return (n + 31) // 32


def _fake_saved(x: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row-wise data/scale then column-wise data/scale, shaped as `quantize_mxfp8` makes them."""
    b, h, s, d = x.shape
    data_row = torch.empty_like(x, dtype=_FP8)
    data_col = torch.empty_like(x, dtype=_FP8)
    return (data_row, x.new_empty((b, h, s, _ceil32(d)), dtype=_E8M0),
            data_col, x.new_empty((b, h, _ceil32(s), d), dtype=_E8M0))


FwdOut = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("mxattn::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, bottom_right: bool,
                  left_bound: Optional[int], right_bound: Optional[int], out_dtype: torch.dtype,
                  qkv_format: str, backend: str) -> FwdOut:
    """q [B,Hq,Sq,D], k/v [B,Hkv,Skv,D] -> (o [B,Hq,Sq,D] dense in qkv_format order, stats [B,Hq,Sq,1] fp32,
    then data/scale of q_row, q_col, k_row, k_col, v_row)."""
    params = _params(softmax_scale, causal, bottom_right, left_bound, right_bound, out_dtype)
    o, stats, saved = get_backend(backend).forward(q, k, v, params)
    if o.stride() != dense_strides_bhsd(tuple(o.shape), qkv_format):  # backends that ignore q's layout
        o = empty_bhsd(tuple(o.shape), qkv_format, out_dtype, o.device).copy_(o)
    return (o, stats.contiguous()) + saved.tensors()


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, softmax_scale, causal, bottom_right, left_bound, right_bound, out_dtype,
                        qkv_format, backend):
    b, h, s, _ = q.shape
    o = empty_bhsd(tuple(q.shape), qkv_format, out_dtype, q.device)
    stats = q.new_empty((b, h, s, 1), dtype=torch.float32)
    q_row, q_row_s, q_col, q_col_s = _fake_saved(q)
    k_row, k_row_s, k_col, k_col_s = _fake_saved(k)
    v_row, v_row_s, _, _ = _fake_saved(v)
    return o, stats, q_row, q_row_s, q_col, q_col_s, k_row, k_row_s, k_col, k_col_s, v_row, v_row_s


@torch.library.custom_op("mxattn::attention_bwd", mutates_args=())
def attention_bwd(do: Tensor, o: Tensor, stats: Tensor, q_row: Tensor, q_row_scale: Tensor, q_col: Tensor,
                  q_col_scale: Tensor, k_row: Tensor, k_row_scale: Tensor, k_col: Tensor, k_col_scale: Tensor,
                  v_row: Tensor, v_row_scale: Tensor, softmax_scale: float, causal: bool, bottom_right: bool,
                  left_bound: Optional[int], right_bound: Optional[int], out_dtype: torch.dtype,
                  backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    """dO, O [B,Hq,Sq,D], stats [B,Hq,Sq,1] and the saved FP8 copies -> contiguous (dq, dk, dv) in out_dtype."""
    params = _params(softmax_scale, causal, bottom_right, left_bound, right_bound, out_dtype)
    saved = SavedForBackward.from_tensors((q_row, q_row_scale, q_col, q_col_scale, k_row, k_row_scale,
                                           k_col, k_col_scale, v_row, v_row_scale))
    dq, dk, dv = get_backend(backend).backward(saved, o, stats, do, params)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@attention_bwd.register_fake
def _attention_bwd_fake(do, o, stats, q_row, q_row_scale, q_col, q_col_scale, k_row, k_row_scale, k_col,
                        k_col_scale, v_row, v_row_scale, softmax_scale, causal, bottom_right, left_bound,
                        right_bound, out_dtype, backend):
    dq = q_row.new_empty(q_row.shape, dtype=out_dtype)
    return dq, k_row.new_empty(k_row.shape, dtype=out_dtype), v_row.new_empty(v_row.shape, dtype=out_dtype)


_N_FWD_ARGS = 11


def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    ctx.options = inputs[3:]  # softmax_scale .. backend
    ctx.input_dtypes = (q.dtype, k.dtype, v.dtype)
    o, stats, *saved = output
    ctx.save_for_backward(o, stats, *saved)
    ctx.mark_non_differentiable(stats, *saved)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the FP8 side outputs


def _backward(ctx, grad_o, *unused_grads):
    if grad_o is None:
        return (None,) * _N_FWD_ARGS
    o, stats, *saved = ctx.saved_tensors
    softmax_scale, causal, bottom_right, left_bound, right_bound, out_dtype, _fmt, backend = ctx.options
    dq, dk, dv = attention_bwd(grad_o, o, stats, *saved, softmax_scale, causal, bottom_right, left_bound,
                               right_bound, out_dtype, backend)
    grads = tuple(g.to(dt) for g, dt in zip((dq, dk, dv), ctx.input_dtypes))
    return grads + (None,) * (_N_FWD_ARGS - 3)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
