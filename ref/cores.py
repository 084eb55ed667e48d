"""Blocked forward / backward attention cores on dequantized operands, and the device-independent
(FP64, rounded once) math they use.

The recipe (quantization, masks, forward, backward, variants) is documented in the docstring of
``ref/mxfp8_ref.py``, the public module; "module docstring" below means that one. Never imports ``mxattn``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .masks import _keep
from .quantizers import BLOCK_SIZE, _qdq, _qdq_per_tensor, _round_p


KV_BLOCK = 128
# Upper bound on the elements of one [rows, s_kv] score slab in the backward
# (several such slabs are alive at once): 2^24 fp32 = 64 MiB each, FP64 temporaries twice that.
CHUNK_ELEMS = 1 << 24
_LOG2E = math.log2(math.e)


# --------------------------------------------------------------------------- device-independent math
#
# torch's float32 exp / exp2 / log, its sums and its matrix products are not the same bits on CPU and
# CUDA (float32 exp and log, row sums and long contractions differ in a fraction of elements: the libraries
# evaluate and add in different orders). So the attention cores take all of these through float64 and round once to the working dtype:
# products of FP32 (dequantized MXFP8) values are exact in FP64, FP64 sums barely depend on the order and
# FP64 exp/log are within an FP64 ulp on both devices, so the rounded results agree except when a value
# lies within ~2^-29 of an FP32 rounding boundary (never seen). The result is then also (nearly always)
# the correctly rounded FP32 value, independent of any kernel's summation order. In the float64 identity
# mode these are plain float64 ops (not bit-identical across devices; that mode is an oracle).


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).to(x.dtype)


def _exp2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x.double()).to(x.dtype)


def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double()).to(x.dtype)


def _sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return x.double().sum(dim=dim, keepdim=keepdim).to(x.dtype)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.double(), b.double()).to(a.dtype)


# --------------------------------------------------------------------------- cores


def _group_chunks(B: int, Hkv: int, G: int, per_head_elems: int):
    """Yield (kv_head j, q-head slice h0:h1 of j's group) with B*(h1-h0)*per_head_elems <= CHUNK_ELEMS (>= 1 head)."""
    gc = max(1, min(G, CHUNK_ELEMS // max(1, B * per_head_elems)))
    for j in range(Hkv):
        for h0 in range(j * G, (j + 1) * G, gc):
            yield j, h0, min(h0 + gc, (j + 1) * G)


def _fwd_core(qd, kd, vd, *, scale, mask, quant_p, p_scale, rescale_threshold, out_dtype, cdt, sink=None,
              p_format="e4m3"):
    """Blocked online-softmax forward on dequantized q [B,Hq,Sq,D], k/v [B,Hkv,Skv,*] in dtype cdt; sink None
    or [Hq] (the softmax starts from it: max = sink, sum = 1). quant_p: P rounded as p_format says."""
    B, Hq, Sq, _ = qd.shape
    Hkv, Skv, Dv = kd.shape[1], kd.shape[2], vd.shape[3]
    G = Hq // Hkv
    dev = qd.device  # every tensor made here lives on the inputs' device
    o_out = torch.empty(B, Hq, Sq, Dv, dtype=out_dtype, device=dev)
    stats = torch.empty(B, Hq, Sq, 1, dtype=torch.float64 if cdt == torch.float64 else torch.float32, device=dev)
    thr = None if rescale_threshold is None else rescale_threshold * math.log(2.0)
    for j, h0, h1 in _group_chunks(B, Hkv, G, Sq * (KV_BLOCK + Dv) * 4):
        q = qd[:, h0:h1]
        k, v = kd[:, j:j + 1], vd[:, j:j + 1]
        if sink is None:
            m = torch.full((B, h1 - h0, Sq, 1), float("-inf"), dtype=cdt, device=dev)
            l = torch.zeros(B, h1 - h0, Sq, 1, dtype=cdt, device=dev)
        else:
            m = sink[h0:h1].to(cdt).view(1, -1, 1, 1).expand(B, h1 - h0, Sq, 1).clone()
            l = torch.ones(B, h1 - h0, Sq, 1, dtype=cdt, device=dev)
        acc = torch.zeros(B, h1 - h0, Sq, Dv, dtype=cdt, device=dev)
        for c0 in range(0, Skv, KV_BLOCK):
            c1 = min(c0 + KV_BLOCK, Skv)
            s = _mm(q, k[:, :, c0:c1].transpose(-1, -2)) * scale
            keep = _keep(mask, 0, Sq, c0, c1, dev)
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            m_blk = s.amax(dim=-1, keepdim=True)
            if thr is None:
                m_new = torch.maximum(m, m_blk)
            else:
                m_new = torch.where((m == float("-inf")) | (m_blk - m > thr), m_blk, m)
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = _exp(m - m_safe)
            p = _exp(s - m_safe)
            l = l * alpha + _sum(p, -1, keepdim=True)
            pq = _round_p(p, p_format, p_scale) if quant_p else p
            acc = acc * alpha + _mm(pq, v[:, :, c0:c1])
            m = m_new
        o = torch.where(l == 0, 0.0, acc / l)  # fully masked rows give 0; NaN rows stay NaN
        o_out[:, h0:h1] = o.to(out_dtype)
        stats[:, h0:h1] = (m + _log(l)).to(stats.dtype)
    return o_out, stats


class _DsRounding(NamedTuple):
    """How the backward rounds dS: ds_format "fp8" quantizes it with ``scaling`` / ``scale_rounding``."""
    ds_format: str = "fp8"
    scaling: str = "mxfp8"
    scale_rounding: str = "ceil"


def _bwd_chunks(qr, kr, vr, dor, stats, delta, *, scale, mask, cdt, sink):
    """The backward's dS, chunk by chunk: yields (j, h0, h1, r0, r1, p, lse, ds) for KV head j, its query heads
    h0:h1 and query rows r0:r1 (r0 a multiple of 32, so s_q blocks of dS stay intact): p the normalized FP32
    softmax with masked entries 0, lse its log-sum-exp [.., rows, 1] (sink included), ds = P (dP - delta)
    * scale with dP = dO V^T."""
    B, Hq, Sq, _ = qr.shape
    Hkv, Skv = kr.shape[1], kr.shape[2]
    dev = qr.device
    rows = Sq if B * Sq * Skv <= CHUNK_ELEMS else max(BLOCK_SIZE, CHUNK_ELEMS // (B * Skv) // BLOCK_SIZE * BLOCK_SIZE)
    for j, h0, h1 in _group_chunks(B, Hkv, Hq // Hkv, rows * Skv):
        kr_j, vr_j = kr[:, j:j + 1], vr[:, j:j + 1]
        for r0 in range(0, Sq, rows):
            r1 = min(r0 + rows, Sq)
            s_raw = _mm(qr[:, h0:h1, r0:r1], kr_j.transpose(-1, -2))
            keep = _keep(mask, r0, r1, 0, Skv, dev)
            sink_j = None if sink is None else sink[h0:h1].to(cdt).view(1, -1, 1, 1)
            if stats is not None:
                lse = stats[:, h0:h1, r0:r1].to(cdt)
                p = _exp2(s_raw * (scale * _LOG2E) - lse * _LOG2E)
            else:
                s = s_raw * scale
                if keep is not None:
                    s = s.masked_fill(~keep, float("-inf"))
                mx = s.amax(dim=-1, keepdim=True)
                if sink_j is not None:
                    mx = torch.maximum(mx, sink_j)
                mx_safe = torch.where(mx == float("-inf"), 0.0, mx)
                e = _exp(s - mx_safe)
                den = _sum(e, -1, keepdim=True)
                if sink_j is not None:
                    den = den + _exp(sink_j - mx_safe)
                p = torch.where(den == 0, 0.0, e / den)
                lse = mx_safe + _log(den)
            if keep is not None:
                p = torch.where(keep, p, 0.0)
            dp = _mm(dor[:, h0:h1, r0:r1], vr_j.transpose(-1, -2))
            ds = p * (dp - delta[:, h0:h1, r0:r1]) * scale
            yield j, h0, h1, r0, r1, p, lse, ds


def _bwd_core(qr, kr, vr, qc, kc, dor, doc, o, do, stats, *, scale, mask, quant, p_scale, out_dtype, cdt,
              sink=None, p_format="e4m3", ds_rounding=_DsRounding(), dstats=None):
    """Backward on dequantized operands (dtype cdt); returns (dq, dk, dv) in out_dtype, and dsink [Hq]
    (float32, float64 in the float64 case) after them when sink [Hq] is given. quant: P and dS rounded as
    p_format and ds_rounding say (else not at all). dstats: None or the gradient of stats [B,Hq,Sq,1]; since
    d stats / d S = P, it enters as delta - dstats (the sink's gradient follows from that delta)."""
    B, Hq, Sq, D = qr.shape
    Hkv, Skv, Dv = kr.shape[1], kr.shape[2], vr.shape[3]
    dev = qr.device  # every tensor made here lives on the inputs' device
    delta = _sum(o.to(cdt) * do.to(cdt), -1, keepdim=True)
    if dstats is not None:
        delta = delta - dstats.to(cdt)
    dq = torch.empty(B, Hq, Sq, D, dtype=cdt, device=dev)
    dk = torch.zeros(B, Hkv, Skv, D, dtype=cdt, device=dev)
    dv = torch.zeros(B, Hkv, Skv, Dv, dtype=cdt, device=dev)
    dsink = None if sink is None else torch.zeros(Hq, dtype=cdt, device=dev)
    chunks = lambda: _bwd_chunks(qr, kr, vr, dor, stats, delta, scale=scale, mask=mask, cdt=cdt,  # noqa: E731
                                 sink=sink)
    ds_amax = None  # per-tensor dS: its amax over the whole [B, Hq, Sq, Skv] tensor, in a first pass
    if quant and ds_rounding.ds_format == "fp8" and ds_rounding.scaling == "per_tensor":
        ds_amax = torch.zeros((), dtype=torch.float32, device=dev)
        for *_, ds in chunks():
            ds_amax = torch.maximum(ds_amax, ds.to(torch.float32).abs().amax())
    for j, h0, h1, r0, r1, p, lse, ds in chunks():
        if sink is not None:  # the sink's probability per row, times delta
            p_sink = _exp(sink[h0:h1].to(cdt).view(1, -1, 1, 1) - lse)
            dsink[h0:h1] -= _sum(_sum(p_sink * delta[:, h0:h1, r0:r1], 3), 2).sum(dim=0)
        pq = _round_p(p, p_format, p_scale) if quant else p
        if not quant:
            ds_r = ds_c = ds
        elif ds_rounding.ds_format == "bf16":
            ds_r = ds_c = ds.to(torch.bfloat16).to(ds.dtype)
        elif ds_amax is not None:
            ds_r = ds_c = _qdq_per_tensor(ds, ds_amax)
        else:
            ds_r = _qdq(ds, -1, ds_rounding.scale_rounding)  # blocks along s_kv, for dQ
            ds_c = _qdq(ds, -2, ds_rounding.scale_rounding)  # blocks along s_q, for dK
        kc_j = kc[:, j:j + 1]
        dq[:, h0:h1, r0:r1] = _mm(ds_r, kc_j)
        dk[:, j] += _sum(_mm(ds_c.transpose(-1, -2), qc[:, h0:h1, r0:r1]), 1)
        dv[:, j] += _sum(_mm(pq.transpose(-1, -2), doc[:, h0:h1, r0:r1]), 1)
    grads = (dq.to(out_dtype), dk.to(out_dtype), dv.to(out_dtype))
    if dsink is None:
        return grads
    return grads + (dsink.to(torch.float64 if cdt == torch.float64 else torch.float32),)
