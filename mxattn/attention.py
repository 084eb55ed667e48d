"""`mxfp8_attention`: the differentiable functional API (validation, layout, lengths, backend choice)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from . import op_plans, ops
from .backends import choice_reads_sizes, choose_backend, v_padding
from .checks import resolved_softmax_scale
from .constants import INPUT_DTYPES, KERNEL_OUT_DTYPES
from .errors import MXFP8NotSupportedError
from .layouts import bhsd_shape, check_format, check_qkv_shapes, from_bhsd, narrow_o, to_bhsd, widen_v
from .mask import resolve_mask
from .op_args import FwdArgs
from .recipe import Recipe, check_recipe_varlen, recipe_key
from .seqinfo import SeqInfo, make_seqinfo
from .sinks import sink_logits

OUTPUT_DTYPES = KERNEL_OUT_DTYPES + (torch.float32,)


def _check_tensor(name: str, x, ndim: int, qkv_format: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; mxattn accepts {', '.join(map(str, INPUT_DTYPES))} "
                        "(it quantizes them to MXFP8 itself)")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D for qkv_format={qkv_format!r}, got shape {tuple(x.shape)}")


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str) -> None:
    """Check q, k, v given in `qkv_format` (4-D bshd/sbhd/bhsd, 3-D thd); raise TypeError/ValueError naming
    the argument."""
    check_format(qkv_format)
    ndim = 3 if qkv_format == "thd" else 4
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, ndim, qkv_format)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    check_qkv_shapes(q, k, v, qkv_format)


def mxfp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qkv_format: str = "bshd",
                    attn_mask_type: str = "no_mask", window_size: Optional[Tuple[int, int]] = None,
                    softmax_scale: Optional[float] = None, backend: str = "auto",
                    out_dtype: Optional[torch.dtype] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                    cu_seqlens_kv: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                    max_seqlen_kv: Optional[int] = None, softmax_type: str = "vanilla",
                    softmax_offset: Optional[torch.Tensor] = None, recipe: Optional[Recipe] = None,
                    bottom_right_diagonal: Optional[bool] = None, return_lse: bool = False):
    """Scaled-dot-product attention with Q, K, V (and dO in backward) in MXFP8, differentiable.

    q: [B, Sq, Hq, D] (bshd), [Sq, B, Hq, D] (sbhd), [B, Hq, Sq, D] (bhsd) or [T_q, Hq, D] (thd, packed
    sequences); k, v: the same with Hkv heads (Hq % Hkv == 0) and Skv positions / T_kv tokens. v's head dim Dv
    may differ from q's and k's D (MLA, e.g. DeepSeek-V3's D = 192, Dv = 128; the cuDNN graphs take the pair,
    the Triton kernels run V zero-padded to D). dtypes bf16, fp16 or fp32 (one for all three). Returns O in q's layout with Dv:
    [B, Sq, Hq, Dv] for bshd, and so on.
    out_dtype: default q's dtype, like torch SDPA. The kernels write O (and dQ, dK, dV) in bf16/fp16; for fp32
    inputs they compute in bf16 and the result is cast to fp32 at the end (gradients likewise).
    attn_mask_type (Transformer Engine's words): "no_mask", "causal" (top-left diagonal),
    "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"; window_size=(left,
    right) as in TE (-1 = unbounded): query i attends keys [i + o - left, i + o + right], o = S_kv - S_q (each
    sequence's own lengths) where the diagonal is bottom-right, 0 where top-left. bottom_right_diagonal (TE's):
    the diagonal of a "no_mask"/"padding" window, True = bottom-right, False = top-left, None (default) =
    bottom-right; "causal" and "padding_causal" are always top-left, the *_bottom_right types bottom-right,
    whatever it says. TE's checks of the window: a causal type takes (-1, 0) or (>=0, 0), and (-1, -1) or
    (>=0, != 0) warns and runs with right 0; "no_mask"/"padding" take (-1, -1) or (>=0, >=0), and (-1, 0)
    warns and runs as (-1, -1); other windows raise ValueError. softmax_scale defaults to 1/sqrt(D) (q's and k's
    head dim, as torch SDPA and Transformer Engine).
    cu_seqlens_q, cu_seqlens_kv: int32 [B+1] cumulative sequence lengths on q's device (TE's names): required
    for thd and the padding mask types, and only used with those (ValueError otherwise); with bshd/sbhd/bhsd
    they are the valid lengths of the padded sequences (rows past a length give O = 0 and zero gradients).
    cu_seqlens_kv defaults to cu_seqlens_q. Empty inputs (B = 0, S_q = 0, S_kv = 0 or no query heads) return
    what torch SDPA returns (an empty O, or zeros when there is no key) with zero gradients.
    max_seqlen_q/kv: the longest sequences (computed from cu_seqlens when None, needed under torch.compile).
    Masks apply per sequence (bottom-right uses each sequence's own lengths). A query row with no key gives
    O = 0 and stats -inf.
    softmax_type (TE's): "vanilla"; "off-by-one" adds a sink logit 0 to every row's softmax denominator;
    "learnable" adds the per-head sink logit softmax_offset (fp32 [Hq] on q's device, differentiable: its
    gradient is summed over batch and query rows). The sink is not quantized and adds nothing to O.
    backend: "auto" (the first of cudnn, triton, reference that supports the call), or one of them by name.
    recipe: None (the default, cuDNN's recipe) or an `mxattn.Recipe` variant (P, V and dS rounding, scale
    rounding, per-tensor FP8); cudnn runs only the default, triton every MXFP8 recipe (not per-tensor scaling),
    reference every recipe; "auto" picks a backend that runs the one asked for. scaling="per_tensor" takes dense batches only (ValueError).
    NaN in an input gives NaN in the outputs that depend on it (the MXFP8 block holding it has a NaN scale);
    NaN in padding rows reaches no output. Infinities propagate as in torch SDPA: an infinity in Q or K gives
    an infinite logit and NaN in the query rows where it is the softmax's maximum (+inf - +inf); an infinity in
    V gives infinite O elements where its weight is non-zero.
    return_lse: True returns (O, lse), lse the softmax statistics: float32 natural-log log-sum-exp of the
    scaled scores (Q_dq K_dq^T * softmax_scale, masked) per query row and query head, the sink logit counted
    ("off-by-one", "learnable"); laid out as FlashAttention's softmax_lse, [B, Hq, Sq] for bshd/sbhd/bhsd and
    [Hq, T_q] for thd; -inf in rows with no key (the sink logit with a sink) and in padding rows. lse is
    differentiable (its gradient enters the backward as delta - dLSE; backend "auto" then picks a backend whose
    backward takes it, the reference backend where no other does), so partial attention over disjoint key sets
    can be merged exactly: O = sum_i exp(lse_i - lse) O_i, lse = logsumexp_i lse_i. It runs eagerly (a graph
    break under torch.compile).
    """
    if return_lse is not False:
        return _with_lse(q, k, v, return_lse, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                         window_size=window_size, softmax_scale=softmax_scale, backend=backend, out_dtype=out_dtype,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                         max_seqlen_kv=max_seqlen_kv, softmax_type=softmax_type, softmax_offset=softmax_offset,
                         recipe=recipe, bottom_right_diagonal=bottom_right_diagonal)
    if cu_seqlens_q is None and cu_seqlens_kv is None and not torch.compiler.is_compiling():
        key = _signature(q, k, v, qkv_format, attn_mask_type, window_size, softmax_scale, backend, out_dtype,
                         max_seqlen_q, max_seqlen_kv, softmax_type, softmax_offset, recipe, bottom_right_diagonal)
        plan = None if key is None else _PLANS.get(key)
        if plan is not None and (plan.kv_len is None or plan.kv_len == _kv_len(k, qkv_format)):
            return _run_dense(plan, q, k, v, _sink_of(plan, softmax_offset))
    validate_inputs(q, k, v, qkv_format)
    qb, kb, vb = to_bhsd(q, qkv_format), to_bhsd(k, qkv_format), to_bhsd(v, qkv_format)
    args, out_dtype = encode_call(qb, kb, vb, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
                                  window_size=window_size, softmax_scale=softmax_scale, backend=backend,
                                  out_dtype=q.dtype if out_dtype is None else out_dtype, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                                  max_seqlen_kv=max_seqlen_kv, softmax_type=softmax_type,
                                  softmax_offset=softmax_offset, recipe=recipe,
                                  bottom_right_diagonal=bottom_right_diagonal)
    if is_empty(qb, kb, qkv_format):
        return _empty_attention(q, k, v, out_dtype, softmax_offset)
    problem = args.problem(softmax_type, ops.needs_backward(q, k, v, softmax_offset))
    name = choose_backend(backend, problem)
    v_pad = v_padding(name, problem)
    args = args._replace(backend=name)
    if v_pad:
        args = args._replace(v=to_bhsd(widen_v(v, v_pad), qkv_format))
    if args.cu_seqlens_q is None and not torch.compiler.is_compiling():
        # the plan serves every KV length unless the backend choice read it
        kv_len = kb.shape[2] if choice_reads_sizes(backend, name, problem) else None
        plan = _DensePlan(args._replace(q=None, k=None, v=None, sink=None), out_dtype, softmax_type, kv_len,
                          None if v_pad else op_plans.call_replay(args, problem.needs_backward),
                          op_plans.new_call_id(), v_pad)  # (a recorded replay would skip V's padding)
        _remember(key, plan)
        return _run_dense(plan, q, k, v, _sink_of(plan, softmax_offset))  # (as the plan's later calls pass it)
    o = narrow_o(from_bhsd(ops.attention(args), qkv_format), v_pad)
    return o if o.dtype == out_dtype else o.to(out_dtype)


def _with_lse(q, k, v, return_lse, *, qkv_format: str, out_dtype, softmax_type: str, softmax_offset, **options):
    """`mxfp8_attention` with return_lse=True: (O, lse). The checks and encoding are the plain call's; the
    backend runs in `mxattn.attention_lse` (imported on first use: it loads torch.compile's machinery for its
    graph break)."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    validate_inputs(q, k, v, qkv_format)
    qb, kb, vb = to_bhsd(q, qkv_format), to_bhsd(k, qkv_format), to_bhsd(v, qkv_format)
    args, out_dtype = encode_call(qb, kb, vb, qkv_format=qkv_format, out_dtype=q.dtype if out_dtype is None
                                  else out_dtype, softmax_type=softmax_type, softmax_offset=softmax_offset, **options)
    from . import attention_lse
    if is_empty(qb, kb, qkv_format):
        return _empty_attention(q, k, v, out_dtype, softmax_offset), attention_lse.empty_lse(qb, args.sink,
                                                                                              qkv_format)
    o, lse = attention_lse.attention_with_lse(args, softmax_type)
    o = from_bhsd(o, qkv_format)
    return (o if o.dtype == out_dtype else o.to(out_dtype)), lse


def encode_call(qb, kb, vb, *, qkv_format: str, attn_mask_type: str, window_size, softmax_scale, backend: str,
                out_dtype, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_type: str,
                softmax_offset, recipe, bottom_right_diagonal=None) -> Tuple[FwdArgs, torch.dtype]:
    """The checks and defaults of `mxfp8_attention`'s options (its docstring) for a call on qb, kb, vb, its
    [B, H, S, D] views (a packed batch [1, H, T, D]) whose shapes were checked: (the forward op's arguments on
    them, with the kernels' output dtype, and the dtype the caller gets). out_dtype: the caller's, or its
    default. Raises TypeError/ValueError naming the argument."""
    recipe = recipe_key(recipe)
    band, padding_type = resolve_mask(attn_mask_type, window_size, bottom_right_diagonal)
    if not padding_type and (cu_seqlens_q is not None or cu_seqlens_kv is not None) and qkv_format != "thd":
        raise ValueError(f"cu_seqlens_q/cu_seqlens_kv are sequence lengths of a padded batch: use a padding "
                         f"attn_mask_type ('padding', 'padding_causal', 'padding_causal_bottom_right') with them, "
                         f"got attn_mask_type={attn_mask_type!r}")
    packed = qkv_format == "thd"
    seq: Optional[SeqInfo] = None
    if packed or padding_type or cu_seqlens_q is not None or cu_seqlens_kv is not None:
        if cu_seqlens_q is None:
            why = "qkv_format='thd'" if packed else f"attn_mask_type={attn_mask_type!r}"
            raise ValueError(f"{why} needs cu_seqlens_q (int32 [batch + 1] cumulative sequence lengths)")
        seq = make_seqinfo(packed=packed, batch=None if packed else qb.shape[0], rows_q=qb.shape[2],
                           rows_kv=kb.shape[2], device=qb.device, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
        check_recipe_varlen(recipe, "packed" if packed else "padded")
    if band.bottom_right and (seq.cu_seqlens_kv is seq.cu_seqlens_q if seq is not None
                              else qb.shape[2] == kb.shape[2]):
        # every sequence has as many queries as keys: a no_mask/padding window is the same band top-left, which
        # cuDNN takes in more shapes (the *_bottom_right types keep their alignment)
        band = resolve_mask(attn_mask_type, window_size, bottom_right_diagonal, equal_lengths=True).band
    sink = sink_logits(softmax_type, softmax_offset, qb.shape[1], qb.device)
    softmax_scale = resolved_softmax_scale(softmax_scale, qb.shape[3])
    if out_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    kernel_dtype = out_dtype if out_dtype in KERNEL_OUT_DTYPES else (
        qb.dtype if qb.dtype in KERNEL_OUT_DTYPES else torch.bfloat16)
    args = FwdArgs.encode(qb, kb, vb, softmax_scale=softmax_scale, mask=band, out_dtype=kernel_dtype,
                          qkv_format="bshd" if packed else qkv_format, backend=backend, seq=seq, sink=sink,
                          recipe=recipe)
    return args, out_dtype


def is_empty(qb, kb, qkv_format: str) -> bool:
    """Whether a call on [B, H, S, D] views has nothing to compute: no query heads, or (dense and padded)
    B = 0, S_q = 0 or S_kv = 0 (a packed batch's empty sequences are the kernels' business)."""
    return qb.shape[1] == 0 or (qkv_format != "thd" and 0 in (qb.shape[0], qb.shape[2], kb.shape[2]))


# --------------------------------------------------------------------------- per-signature plans (eager, dense)

class _DensePlan(NamedTuple):
    """What a dense eager call needs once its signature was validated and its backend chosen."""

    #: the op's arguments without the tensors (q, k, v, sink filled per call)
    args: FwdArgs
    out_dtype: torch.dtype
    softmax_type: str
    #: the KV length the plan is for, None for any (the backend choice did not read it)
    kv_len: Optional[int]
    #: how the whole call replays (`op_plans.call_replay`: None, or per signature, or over every KV length)
    replay: Optional[str]
    #: the plan's identity in the replays' keys
    ident: int
    #: zero channels appended to V for the chosen backend (`mxattn.backends.v_padding`), sliced off O
    v_pad: int = 0


#: plans of dense eager calls by signature (`_signature`); bounded, cleared when full. Reads and writes of a
#: dict are atomic in CPython, and a plan is immutable, so threads share it without a lock
_PLANS: dict = {}
_MAX_PLANS = 512


#: the sequence axis of each dense layout
_SEQ_AXIS = {"bshd": 1, "sbhd": 0, "bhsd": 2}


def _tensor_key(x):
    """What the checks and the backend choice read of a tensor (not its strides: `to_bhsd` takes any)."""
    return (x.__class__, x.shape, x.dtype, x.device, x.requires_grad)


def _kv_key(x, axis: Optional[int]):
    """`_tensor_key` of k or v with the sequence length left out (decode steps share a plan across lengths)."""
    shape = x.shape if axis is None else (*x.shape[:axis], -1, *x.shape[axis + 1:])
    return (x.__class__, shape, x.dtype, x.device, x.requires_grad)


def _kv_len(k, qkv_format: str) -> int:
    return k.shape[_SEQ_AXIS[qkv_format]]


def _signature(q, k, v, qkv_format, attn_mask_type, window_size, softmax_scale, backend, out_dtype,
               max_seqlen_q, max_seqlen_kv, softmax_type, softmax_offset, recipe=None,
               bottom_right_diagonal=None) -> Optional[tuple]:
    """Everything the checks and the backend choice of a dense call read (types, shapes, dtypes, devices, grad
    mode, the options) with the KV length reduced to what the checks and the mask read of it (k's equals v's,
    non-zero, equals q's), or None when an argument is not what a plan can key (the full path then runs and
    raises the clear error).
    A plan whose backend choice read the KV length keeps it (`_DensePlan.kv_len`)."""
    try:
        axis = _SEQ_AXIS.get(qkv_format) if k.dim() == v.dim() == 4 else None
        # (S_q == S_kv too: a no_mask window is then encoded top-left, `encode_call`)
        lengths = None if axis is None or q.dim() != 4 else (k.shape[axis] == v.shape[axis], k.shape[axis] > 0,
                                                             k.shape[axis] == q.shape[axis])
        offset = None if softmax_offset is None else _tensor_key(softmax_offset)
        window = None if window_size is None else tuple(window_size)
        key = (_tensor_key(q), _kv_key(k, axis), _kv_key(v, axis), lengths, qkv_format, attn_mask_type, window,
               softmax_scale, softmax_scale.__class__, backend, out_dtype, max_seqlen_q, max_seqlen_kv,
               softmax_type, offset, recipe, bottom_right_diagonal, bottom_right_diagonal.__class__,
               torch.is_grad_enabled())
        hash(key)
        return key
    except (AttributeError, TypeError):
        return None


def _remember(key, plan: _DensePlan) -> None:
    if key is None:
        return
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def _sink_of(plan: _DensePlan, softmax_offset):
    """The sink of a planned call: the (already checked) offset, None for vanilla and off-by-one (whose zeros
    `_run_dense` makes on q's device)."""
    return softmax_offset if plan.softmax_type == "learnable" else None


def _run_dense(plan: _DensePlan, q, k, v, sink):
    """O of a planned dense call, in q's layout and plan.out_dtype: a call without a backward replays its whole
    body where the backend allows it (`op_plans.run_call`)."""
    if plan.replay is None:
        return _dense_body(plan, q, k, v, sink)
    return op_plans.run_call(plan.ident, plan.replay, _SEQ_AXIS[plan.args.qkv_format], (q, k, v, sink),
                             lambda: _dense_body(plan, q, k, v, sink))


def _dense_body(plan: _DensePlan, q, k, v, sink):
    """`_run_dense`'s work: the forward op on bhsd views, O back in q's layout."""
    fmt = plan.args.qkv_format
    if plan.softmax_type == "off-by-one":
        sink = torch.zeros(bhsd_shape(q, fmt)[1], dtype=torch.float32, device=q.device)
    if plan.v_pad:
        v = widen_v(v, plan.v_pad)
    if ops.needs_backward(q, k, v, sink):  # the layout views inside the autograd node (eager: plans are)
        o = ops.attention(plan.args.with_tensors(q, k, v, sink), fmt)
    else:
        o = from_bhsd(ops.attention(plan.args.with_tensors(to_bhsd(q, fmt), to_bhsd(k, fmt), to_bhsd(v, fmt),
                                                           sink)), fmt)
    o = narrow_o(o, plan.v_pad)
    return o if o.dtype == plan.out_dtype else o.to(plan.out_dtype)


class _NoKeys(torch.autograd.Function):
    """O = 0 of a call with nothing to attend (no batch, no query or no key), with zero gradients."""

    @staticmethod
    def forward(ctx, q, k, v, offset, out_dtype):
        ctx.shapes = [(t.shape, t.dtype) if t is not None else None for t in (q, k, v, offset)]
        return q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=out_dtype)  # (O has V's head dim)

    @staticmethod
    def backward(ctx, grad_o):
        grads = [None if s is None else grad_o.new_zeros(s[0], dtype=s[1]) for s in ctx.shapes]
        return (*grads, None)


def _empty_attention(q, k, v, out_dtype, softmax_offset):
    """torch SDPA's answer to an empty call: an empty O for B = 0 or S_q = 0, zeros for S_kv = 0 (no key:
    nothing to average, as a query row with no key gets everywhere in mxattn); no kernel runs."""
    return _NoKeys.apply(q, k, v, softmax_offset, out_dtype)


__all__ = ["mxfp8_attention", "validate_inputs", "MXFP8NotSupportedError"]
