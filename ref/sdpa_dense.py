"""Dense entry points: sdpa_fwd / sdpa_bwd and their pre-quantized forms.

The recipe (quantization, masks, forward, backward, variants) is documented in the docstring of
``ref/mxfp8_ref.py``, the public module; "module docstring" below means that one. Never imports ``mxattn``.
"""

from __future__ import annotations

import torch

from .checks import (_attn_scale, _check_choice, _check_device, _check_float_tensor, _check_out_dtype,
                     _check_p_scale, _check_rescale_threshold, _check_scaling, _check_shapes, _check_sink)
from .cores import _DsRounding, _bwd_core, _fwd_core
from .masks import _resolve_mask
from .quantizers import dequantize, quantize, quantize_per_tensor


# --------------------------------------------------------------------------- public API


def _check_pair(pair, name: str, shape, axis: int, device: torch.device, bf16_ok: bool = False) -> torch.Tensor:
    """Validate a (data, scale) pair of shape ``shape`` on ``device``: MXFP8 (E8M0 scale along ``axis``) or
    per-tensor (a float32 scale_inv of one element). With bf16_ok, a (bfloat16 tensor, None) pair is also
    taken (the bf16-V variant). Returns its FP32 value."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{name}: expected a (data, scale) pair, got {type(pair).__name__}")
    data, sc = pair
    if bf16_ok and isinstance(data, torch.Tensor) and data.dtype == torch.bfloat16:
        if sc is not None:
            raise ValueError(f"{name}: a bfloat16 operand (the bf16-V variant) takes scale None, got a "
                             f"{type(sc).__name__}")
        if tuple(data.shape) != tuple(shape):
            raise ValueError(f"{name} data: expected shape {tuple(shape)}, got {tuple(data.shape)}")
        _check_device(data, f"{name} data", device, "the query operand")
        return data.to(torch.float32)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
        want = "a float8_e4m3fn (or, here, bfloat16)" if bf16_ok else "a float8_e4m3fn"
        raise TypeError(f"{name} data: expected {want} tensor, got {getattr(data, 'dtype', type(data))}")
    if tuple(data.shape) != tuple(shape):
        raise ValueError(f"{name} data: expected shape {tuple(shape)}, got {tuple(data.shape)}")
    _check_device(data, f"{name} data", device, "the query operand")
    if isinstance(sc, torch.Tensor):
        _check_device(sc, f"{name} scale", device, "the query operand")
        if sc.dtype == torch.float32:  # per-tensor scale_inv
            if sc.numel() != 1:
                raise ValueError(f"{name} scale: a float32 (per-tensor) scale_inv has one element, got shape "
                                 f"{tuple(sc.shape)}")
            return data.to(torch.float32) * sc.reshape(())
    try:
        return dequantize(data, sc, axis)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _quantize_operand(x: torch.Tensor, axis: int, scaling: str, scale_rounding: str):
    """(data, scale) of x as ``scaling`` says: MXFP8 along ``axis`` or per-tensor (axis unused)."""
    if scaling == "per_tensor":
        return quantize_per_tensor(x)
    return quantize(x, axis, scale_rounding=scale_rounding)


def sdpa_fwd_quantized(q_data, q_scale, k_data, k_scale, v_data, v_scale_col, *, attn_scale=None, causal=False,
                       diagonal_alignment="top_left", window=(None, None), out_dtype=torch.bfloat16,
                       p_scale=256.0, rescale_threshold=None, sink=None, p_format="e4m3"):
    """MXFP8 forward from pre-quantized operands (sink: None or the [Hq] sink logits, module docstring).

    q_data [B,Hq,Sq,D], k_data [B,Hkv,Skv,D] float8_e4m3fn with row-wise scales [B,H,S,ceil(D/32)];
    v_data [B,Hkv,Skv,Dv] with column-wise scale [B,Hkv,ceil(Skv/32),Dv] (float8_e8m0fnu). Recipe variants
    (module docstring): per-tensor operands come with a float32 scale_inv of one element instead; V may be a
    bfloat16 tensor with v_scale_col None (the bf16-V variant); p_format "e4m3" or "bf16".
    Returns (o [B,Hq,Sq,Dv] out_dtype, stats [B,Hq,Sq,1] float32 = max + log(sum exp)).
    """
    for t, n in ((q_data, "q_data"), (k_data, "k_data"), (v_data, "v_data")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q_data, k_data, v_data, ("q_data", "k_data", "v_data"))
    _check_out_dtype(out_dtype)
    _check_rescale_threshold(rescale_threshold)
    _check_choice(p_format, "p_format")
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    dev = q_data.device
    qd = _check_pair((q_data, q_scale), "q", q_data.shape, -1, dev)
    kd = _check_pair((k_data, k_scale), "k", k_data.shape, -1, dev)
    vd = _check_pair((v_data, v_scale_col), "v", v_data.shape, -2, dev, bf16_ok=True)
    return _fwd_core(qd, kd, vd, scale=_attn_scale(attn_scale, D), mask=mask, quant_p=True,
                     p_scale=_check_p_scale(p_scale), rescale_threshold=rescale_threshold,
                     out_dtype=out_dtype, cdt=torch.float32, sink=_check_sink(sink, Hq, dev), p_format=p_format)


def sdpa_fwd(q, k, v, *, attn_scale=None, causal=False, diagonal_alignment="top_left", window=(None, None),
             out_dtype=torch.bfloat16, p_scale=256.0, quantize_inputs=True, rescale_threshold=None, sink=None,
             p_format="e4m3", v_format="fp8", scaling="mxfp8", scale_rounding="ceil"):
    """Reference forward from high-precision q [B,Hq,Sq,D], k [B,Hkv,Skv,D], v [B,Hkv,Skv,Dv] (sink: None
    or the [Hq] sink logits).

    quantize_inputs=True: Q, K row-wise and V column-wise MXFP8, then ``sdpa_fwd_quantized``; the recipe
    options p_format, v_format, scaling, scale_rounding (module docstring) change what is quantized and how.
    quantize_inputs=False: no quantization at all (float64 math if all inputs are float64).
    Returns (o [B,Hq,Sq,Dv] out_dtype, stats [B,Hq,Sq,1] float32, float64 in the float64 identity case).
    """
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float_tensor(t, n, 4)
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q, k, v)
    _check_sink(sink, Hq, q.device)
    _check_choice(p_format, "p_format")
    _check_choice(v_format, "v_format")
    _check_scaling(scaling, scale_rounding)
    if quantize_inputs:
        _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)  # validate before quantizing
        vq = (v.to(torch.bfloat16), None) if v_format == "bf16" else _quantize_operand(v, -2, scaling, scale_rounding)
        return sdpa_fwd_quantized(*_quantize_operand(q, -1, scaling, scale_rounding),
                                  *_quantize_operand(k, -1, scaling, scale_rounding), *vq, attn_scale=attn_scale,
                                  causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                                  out_dtype=out_dtype, p_scale=p_scale, rescale_threshold=rescale_threshold,
                                  sink=sink, p_format=p_format)
    _check_out_dtype(out_dtype)
    _check_rescale_threshold(rescale_threshold)
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    cdt = torch.float64 if all(t.dtype == torch.float64 for t in (q, k, v)) else torch.float32
    return _fwd_core(q.to(cdt), k.to(cdt), v.to(cdt), scale=_attn_scale(attn_scale, D), mask=mask, quant_p=False,
                     p_scale=_check_p_scale(p_scale), rescale_threshold=rescale_threshold,
                     out_dtype=out_dtype, cdt=cdt, sink=sink)


def _check_o_do_stats(o, do, stats, B, Hq, Sq, Dv, device, like):
    for t, n in ((o, "o"), (do, "do")):
        _check_float_tensor(t, n, 4)
        if tuple(t.shape) != (B, Hq, Sq, Dv):
            raise ValueError(f"{n}: expected shape {(B, Hq, Sq, Dv)}, got {tuple(t.shape)}")
        _check_device(t, n, device, like)
    if stats is not None:
        _check_float_tensor(stats, "stats")
        if tuple(stats.shape) != (B, Hq, Sq, 1):
            raise ValueError(f"stats: expected shape {(B, Hq, Sq, 1)}, got {tuple(stats.shape)}")
        _check_device(stats, "stats", device, like)


def _check_dstats(dstats, B, Hq, Sq, device, like):
    """dstats, the gradient of the forward's stats: None or a float tensor [B,Hq,Sq,1] on ``device``."""
    if dstats is None:
        return
    _check_float_tensor(dstats, "dstats")
    if tuple(dstats.shape) != (B, Hq, Sq, 1):
        raise ValueError(f"dstats: expected shape {(B, Hq, Sq, 1)} (like stats), got {tuple(dstats.shape)}")
    _check_device(dstats, "dstats", device, like)


def sdpa_bwd_quantized(q_row, q_col, k_row, k_col, v_row, o, do, do_row, do_col, stats=None, *, attn_scale=None,
                       causal=False, diagonal_alignment="top_left", window=(None, None),
                       out_dtype=torch.bfloat16, p_scale=256.0, sink=None, p_format="e4m3", ds_format="fp8",
                       scaling="mxfp8", scale_rounding="ceil", dstats=None):
    """MXFP8 backward from pre-quantized operands (each a (data float8_e4m3fn, scale float8_e8m0fnu) pair).
    With sink [Hq] (the forward's sink logits) a fourth result dsink [Hq] float32 follows. dstats: None or the
    gradient of the forward's stats (the log-sum-exp), float [B,Hq,Sq,1]: the backward's delta becomes
    rowsum(O * dO) - dstats (module docstring).

    q_row/k_row/v_row/do_row: scales along D [B,H,S,ceil(D/32)]; q_col/k_col/do_col: scales along S
    [B,H,ceil(S/32),D]. o, do: high-precision [B,Hq,Sq,Dv] (for delta). stats [B,Hq,Sq,1] or None
    (then P is recomputed). Returns (dq [B,Hq,Sq,D], dk [B,Hkv,Skv,D], dv [B,Hkv,Skv,Dv]) in out_dtype.
    Recipe variants (module docstring): per-tensor pairs carry a float32 scale_inv of one element; v_row may
    be (bfloat16 tensor, None) (the bf16-V variant); p_format "e4m3" | "bf16"; ds_format "fp8" | "bf16", and
    scaling / scale_rounding say how an "fp8" dS is quantized.
    """
    for pair, n in ((q_row, "q_row"), (k_row, "k_row"), (v_row, "v_row")):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], torch.Tensor):
            raise TypeError(f"{n}: expected a (data, scale) pair of tensors")
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q_row[0], k_row[0], v_row[0], ("q_row", "k_row", "v_row"))
    dev = q_row[0].device
    _check_o_do_stats(o, do, stats, B, Hq, Sq, Dv, dev, "q_row")
    _check_dstats(dstats, B, Hq, Sq, dev, "q_row")
    _check_out_dtype(out_dtype)
    _check_choice(p_format, "p_format")
    _check_choice(ds_format, "ds_format")
    _check_scaling(scaling, scale_rounding)
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    qr = _check_pair(q_row, "q_row", (B, Hq, Sq, D), -1, dev)
    qc = _check_pair(q_col, "q_col", (B, Hq, Sq, D), -2, dev)
    kr = _check_pair(k_row, "k_row", (B, Hkv, Skv, D), -1, dev)
    kc = _check_pair(k_col, "k_col", (B, Hkv, Skv, D), -2, dev)
    vr = _check_pair(v_row, "v_row", (B, Hkv, Skv, Dv), -1, dev, bf16_ok=True)
    dor = _check_pair(do_row, "do_row", (B, Hq, Sq, Dv), -1, dev)
    doc = _check_pair(do_col, "do_col", (B, Hq, Sq, Dv), -2, dev)
    return _bwd_core(qr, kr, vr, qc, kc, dor, doc, o, do, stats, scale=_attn_scale(attn_scale, D), mask=mask,
                     quant=True, p_scale=_check_p_scale(p_scale), out_dtype=out_dtype, cdt=torch.float32,
                     sink=_check_sink(sink, Hq, dev), p_format=p_format,
                     ds_rounding=_DsRounding(ds_format, scaling, scale_rounding), dstats=dstats)


def sdpa_bwd(q, k, v, o, do, stats=None, *, attn_scale=None, causal=False, diagonal_alignment="top_left",
             window=(None, None), out_dtype=torch.bfloat16, p_scale=256.0, quantize_inputs=True, sink=None,
             p_format="e4m3", v_format="fp8", ds_format="fp8", scaling="mxfp8", scale_rounding="ceil",
             dstats=None):
    """Reference backward from high-precision q, k, v, o, do (shapes as in ``sdpa_fwd``); with sink [Hq] a
    fourth result dsink [Hq] follows. dstats: None or the gradient of the forward's stats [B,Hq,Sq,1]
    (``sdpa_bwd_quantized``).

    quantize_inputs=True: Q, K row+column, V row, dO row+column MXFP8, then ``sdpa_bwd_quantized``; the
    recipe options p_format, v_format, ds_format, scaling, scale_rounding (module docstring) change what is
    quantized and how.
    quantize_inputs=False: no quantization at all (float64 math if q, k, v, o, do are all float64).
    stats [B,Hq,Sq,1] or None (recomputed). Returns (dq, dk, dv) in out_dtype; dk, dv have Hkv heads.
    """
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _check_float_tensor(t, n, 4)
    B, Hq, Hkv, Sq, Skv, D, Dv = _check_shapes(q, k, v)
    _check_o_do_stats(o, do, stats, B, Hq, Sq, Dv, q.device, "q")
    _check_dstats(dstats, B, Hq, Sq, q.device, "q")
    _check_out_dtype(out_dtype)
    _check_choice(v_format, "v_format")
    _check_scaling(scaling, scale_rounding)
    mask = _resolve_mask(causal, diagonal_alignment, window, Sq, Skv)
    _check_sink(sink, Hq, q.device)
    opts = dict(attn_scale=attn_scale, causal=causal, diagonal_alignment=diagonal_alignment, window=window,
                out_dtype=out_dtype, p_scale=p_scale, sink=sink, dstats=dstats)
    if quantize_inputs:
        quant = lambda x, axis: _quantize_operand(x, axis, scaling, scale_rounding)  # noqa: E731
        v_row = (v.to(torch.bfloat16), None) if v_format == "bf16" else quant(v, -1)
        return sdpa_bwd_quantized(quant(q, -1), quant(q, -2), quant(k, -1), quant(k, -2), v_row, o, do,
                                  quant(do, -1), quant(do, -2), stats, p_format=p_format, ds_format=ds_format,
                                  scaling=scaling, scale_rounding=scale_rounding, **opts)
    cdt = torch.float64 if all(t.dtype == torch.float64 for t in (q, k, v, o, do)) else torch.float32
    qd, kd, vd, dod = q.to(cdt), k.to(cdt), v.to(cdt), do.to(cdt)
    return _bwd_core(qd, kd, vd, qd, kd, dod, dod, o, do, stats, scale=_attn_scale(attn_scale, D), mask=mask,
                     quant=False, p_scale=_check_p_scale(p_scale), out_dtype=out_dtype, cdt=cdt, sink=sink,
                     dstats=dstats)
