"""Attention on inputs that arrive already quantized (`MXFP8Tensor` Q, K, V): `mxfp8_attention_quantized`, an
inference path (no autograd) over `AttentionBackend.forward_quantized`, the seam a KV cache or a Transformer
Engine-style "FP8 in from the previous GEMM" path plugs into; and `quantize_attention_inputs`, which makes those
inputs the way `mxfp8_attention` quantizes its own, so that

    mxfp8_attention_quantized(*quantize_attention_inputs(q, k, v, **kw), **kw, ...) == mxfp8_attention(q, k, v, ...)

bit for bit (reference and triton backends). The options, their checks and the backend choice are
`mxfp8_attention`'s (`encode_call`).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .attention import encode_call, is_empty, validate_inputs
from .attention_lse import empty_lse, lse_layout
from .backends import choose_backend, get_backend
from .backends.recipe_operands import forward_operands
from .checks import check_no_grad, check_quantized_inputs, check_quantized_segments
from .formats import MXFP8Tensor
from .layouts import from_bhsd, mx_from_bhsd, mx_to_bhsd, to_bhsd
from .recipe import Recipe, resolve_recipe
from .seqinfo import make_seqinfo

#: what V is: MXFP8 blocked along S, or (the bf16-V recipe) a bfloat16 tensor
VOperand = Union[MXFP8Tensor, torch.Tensor]


@torch.compiler.disable  # eager only: the MXFP8Tensor arguments do not cross the custom ops
def mxfp8_attention_quantized(q: MXFP8Tensor, k: MXFP8Tensor, v: VOperand, *, qkv_format: str = "bshd",
                              attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None,
                              softmax_scale: Optional[float] = None, backend: str = "auto",
                              out_dtype: Optional[torch.dtype] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                              cu_seqlens_kv: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                              max_seqlen_kv: Optional[int] = None, softmax_type: str = "vanilla",
                              softmax_offset: Optional[torch.Tensor] = None, recipe: Optional[Recipe] = None,
                              bottom_right_diagonal: Optional[bool] = None, return_lse: bool = False):
    """Scaled-dot-product attention on already-quantized MXFP8 inputs; forward only (no autograd).

    q: `mxattn.MXFP8Tensor` whose data is [B, Sq, Hq, D] (bshd), [Sq, B, Hq, D] (sbhd), [B, Hq, Sq, D] (bhsd)
    or [T_q, Hq, D] (thd, packed sequences), torch.float8_e4m3fn, with float8_e8m0fnu scales blocked along D
    (the last axis: `quantize_mxfp8(x, axis=-1)`); k: the same with Hkv heads (Hq % Hkv == 0) and Skv positions /
    T_kv tokens. v: k's shape with its own head dim Dv (D or, MLA, another), blocked along the sequence axis
    (axis 1 of bshd, 0 of sbhd, 2 of bhsd, 0 of thd: the blocks of 32 positions the P V product reads); for thd
    its blocks restart at every sequence (`MXFP8Tensor.segments` equal to cu_seqlens_kv); under
    ``Recipe(v_operand="bf16")`` v is instead a torch.bfloat16 tensor of that shape (V is never quantized there).
    `quantize_attention_inputs` makes all three from high-precision tensors exactly as `mxfp8_attention`
    quantizes them.
    Returns O in q's layout and shape with v's head dim Dv, dtype out_dtype (default torch.bfloat16; float16 and
    float32 also); with return_lse=True (O, lse), lse as `mxfp8_attention` returns it (fp32 log-sum-exp per query
    row and head, [B, Hq, Sq], [Hq, T_q] for thd; no gradient here).

    Every other argument is `mxfp8_attention`'s, with its meaning and checks: qkv_format, attn_mask_type,
    window_size, bottom_right_diagonal, softmax_scale (default 1/sqrt(D)), backend ("auto" picks the first of
    cudnn, triton, reference that has this entry point and runs the call), cu_seqlens_q/kv and max_seqlen_q/kv
    (padded and packed batches), softmax_type / softmax_offset (attention sinks; the offset may not require
    grad), recipe (MXFP8 recipes only: the inputs are MXFP8; its scale_rounding and ds_quant play no part here,
    p_quant does, and v_operand says what v is). A padded batch's rows past each length are not read, but V's
    last block scale of a sequence is used as given: quantize those rows as zeros (`quantize_attention_inputs`
    does) for the numbers of `mxfp8_attention`.

    Errors (TypeError/ValueError naming the argument, before any kernel): an input that is not an MXFP8Tensor
    (or, for the bf16-V recipe, v not bfloat16), elements other than E4M3, scales not float8_e8m0fnu or not
    shaped for the data, blocks on the wrong axis, q/k/v shapes or devices that disagree, v's segments not
    cu_seqlens_kv (thd) or present (other layouts), a tensor requiring grad under grad mode, per-tensor
    scaling; MXFP8NotSupportedError when the named backend cannot run the call. Eager only: under
    torch.compile the call runs outside the graph.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    recipe = resolve_recipe(recipe)
    check_quantized_inputs(q, k, v, qkv_format, recipe)
    if isinstance(softmax_offset, torch.Tensor):
        check_no_grad("softmax_offset", softmax_offset)
    qb, kb = mx_to_bhsd(q, qkv_format), mx_to_bhsd(k, qkv_format)
    vb = mx_to_bhsd(v, qkv_format) if isinstance(v, MXFP8Tensor) else to_bhsd(v, qkv_format)
    args, out_dtype = encode_call(qb.data, kb.data, vb.data if isinstance(vb, MXFP8Tensor) else vb,
                                  qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
                                  softmax_scale=softmax_scale, backend=backend,
                                  out_dtype=torch.bfloat16 if out_dtype is None else out_dtype,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_kv=max_seqlen_kv, softmax_type=softmax_type,
                                  softmax_offset=softmax_offset, recipe=recipe,
                                  bottom_right_diagonal=bottom_right_diagonal)
    check_quantized_segments(v, args.cu_seqlens_kv if args.packed else None)
    if is_empty(qb, kb, qkv_format):  # what mxfp8_attention returns: an empty O, or zeros without keys
        o = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=out_dtype, device=q.device)
        return (o, empty_lse(qb.data, args.sink, qkv_format)) if return_lse else o
    name = choose_backend(backend, args.problem(softmax_type, needs_backward=False, quantized=True))
    o, stats = get_backend(name).forward_quantized(qb, kb, vb, args.params(needs_backward=False))
    o = from_bhsd(o, qkv_format)
    o = o if o.dtype == out_dtype else o.to(out_dtype)
    return (o, lse_layout(stats, args.packed)) if return_lse else o


def quantize_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qkv_format: str = "bshd",
                              cu_seqlens_q: Optional[torch.Tensor] = None,
                              cu_seqlens_kv: Optional[torch.Tensor] = None, recipe: Optional[Recipe] = None
                              ) -> Tuple[MXFP8Tensor, MXFP8Tensor, VOperand]:
    """(q, k, v) quantized as `mxfp8_attention` quantizes them for its forward, in their layout, ready for
    `mxfp8_attention_quantized`: q and k row-wise (blocks of 32 along D), v column-wise (blocks of 32 along
    the sequence axis, restarting at every sequence of a thd batch) or, under ``Recipe(v_operand="bf16")``, v
    rounded to bfloat16. E4M3 elements, E8M0 scales with the recipe's scale_rounding.

    q, k, v: bf16/fp16/fp32 tensors as `mxfp8_attention` takes them (qkv_format bshd, sbhd, bhsd or thd).
    cu_seqlens_q / cu_seqlens_kv (int32 [B+1]; kv defaults to q): required for thd (v's segments are
    cu_seqlens_kv); with bshd/sbhd/bhsd they make a padded batch, whose rows past each length are quantized as
    zeros (as `mxfp8_attention` does with a padding mask). Returns MXFP8Tensors whose data and scales are views
    in qkv_format order (data in the inputs' memory order when they are dense). Raises TypeError/ValueError
    naming the argument."""
    validate_inputs(q, k, v, qkv_format)
    recipe = resolve_recipe(recipe)
    if recipe.scaling != "mxfp8":
        raise ValueError(f"recipe: scaling={recipe.scaling!r} has no MXFP8 inputs; quantize_attention_inputs "
                         "makes MXFP8 (scaling='mxfp8')")
    packed = qkv_format == "thd"
    qb, kb, vb = (to_bhsd(x, qkv_format) for x in (q, k, v))
    seq = None
    if packed or cu_seqlens_q is not None or cu_seqlens_kv is not None:
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_q is required with qkv_format='thd' or with cu_seqlens_kv")
        seq = make_seqinfo(packed=packed, batch=None if packed else qb.shape[0], rows_q=qb.shape[2],
                           rows_kv=kb.shape[2], device=q.device, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None)
    q_row, k_row, v_op = forward_operands(qb, kb, vb, seq, recipe)
    v_out = mx_from_bhsd(v_op, qkv_format) if isinstance(v_op, MXFP8Tensor) else from_bhsd(v_op, qkv_format)
    return mx_from_bhsd(q_row, qkv_format), mx_from_bhsd(k_row, qkv_format), v_out


__all__ = ["mxfp8_attention_quantized", "quantize_attention_inputs"]
