"""qkv_format handling: every layout becomes a [B, H, S, D] *view* (never a copy), and back (a packed thd
tensor [T, H, D] as [1, H, T, D]); MXFP8 tensors likewise (data and scales viewed alike)."""

from __future__ import annotations

from typing import Tuple

import torch

from .formats import MXFP8Tensor

QKV_FORMATS = ("bshd", "sbhd", "bhsd", "thd")
# permutation taking a tensor in `format` order to [B, H, S, D]
_TO_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}
# permutation taking [B, H, S, D] back to `format` order
_FROM_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}


def check_format(qkv_format: str) -> None:
    """Raise ValueError unless qkv_format is one of bshd, sbhd, bhsd."""
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")


def to_bhsd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """View a 4-D tensor given in `qkv_format` as [B, H, S, D] (a thd tensor [T, H, D] as [1, H, T, D])."""
    if qkv_format == "thd":
        return x.permute(1, 0, 2).unsqueeze(0)
    if qkv_format == "bhsd":  # already in order: no view (a view is an autograd node per input, each call)
        return x
    return x.permute(_TO_BHSD[qkv_format])


def mx_to_bhsd(x: MXFP8Tensor, qkv_format: str) -> MXFP8Tensor:
    """`to_bhsd` of an MXFP8Tensor: its data and scales viewed alike, its block axis renumbered (segments kept)."""
    axis = (2, 1, 3)[x.axis] if qkv_format == "thd" else _TO_BHSD[qkv_format].index(x.axis)
    return MXFP8Tensor.unchecked(to_bhsd(x.data, qkv_format), to_bhsd(x.scale, qkv_format), axis, x.segments)


def mx_from_bhsd(x: MXFP8Tensor, qkv_format: str) -> MXFP8Tensor:
    """The inverse of `mx_to_bhsd`."""
    axis = (None, 1, 0, 2)[x.axis] if qkv_format == "thd" else _FROM_BHSD[qkv_format].index(x.axis)
    return MXFP8Tensor.unchecked(from_bhsd(x.data, qkv_format), from_bhsd(x.scale, qkv_format), axis, x.segments)


def bhsd_shape(x: torch.Tensor, qkv_format: str) -> Tuple[int, ...]:
    """The [B, H, S, D] shape of a tensor given in `qkv_format` ([T, H, D] for thd reads as [1, H, T, D]),
    without making a view."""
    shape = x.shape
    if qkv_format == "thd":
        return (1, shape[1], shape[0], shape[2])
    return tuple([shape[i] for i in _TO_BHSD[qkv_format]])


def from_bhsd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """View a [B, H, S, D] tensor in `qkv_format` order (thd: [1, H, T, D] as [T, H, D])."""
    if qkv_format == "thd":
        return x[0].transpose(0, 1)
    if qkv_format == "bhsd":
        return x
    return x.permute(_FROM_BHSD[qkv_format])


def seq_axis(qkv_format: str) -> int:
    """The sequence (S or T) axis of a tensor given in `qkv_format`."""
    return 0 if qkv_format == "thd" else _TO_BHSD[qkv_format][2]


def check_qkv_shapes(q, k, v, qkv_format: str) -> None:
    """Check that q, k, v given in `qkv_format` agree (one device; batch; q and k: head dim d_qk; k and v: heads
    and length; query heads a multiple of key heads, none without key heads; non-zero head dims); raise
    ValueError naming them. V's head dim d_v (O's and dO's too) may differ from d_qk (MLA: 192 and 128). No heads
    at all (Hq = 0) passes: such a call returns an empty O, as torch SDPA does. q, k, v: anything with `shape`
    and `device` (tensors, `MXFP8Tensor`s), of the layout's rank."""
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    (b, hq, sq, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = (bhsd_shape(x, qkv_format) for x in (q, k, v))
    where = ("(shapes read as [T, H, D] for qkv_format='thd')" if qkv_format == "thd"
             else f"(shapes read as [B, H, S, D] from qkv_format={qkv_format!r})")
    if not (b == bk == bv):
        raise ValueError(f"batch size mismatch: q {b}, k {bk}, v {bv} {where}")
    if sk != sv:
        raise ValueError(f"sequence length mismatch: k {sk}, v {sv} {where}")
    if d != dk:
        raise ValueError(f"head_dim mismatch: q {d}, k {dk} {where}: k's head dim must equal q's (v's, head_dim_v "
                         f"{dv}, may differ)")
    if hk != hv:
        raise ValueError(f"k and v must have the same number of heads, got k {hk}, v {hv} {where}")
    if hk == 0 and hq:
        raise ValueError(f"k and v have no heads but q has {hq}: every query head needs a key/value head "
                         f"(Hq must be a multiple of Hkv >= 1) {where}")
    if hk and hq % hk:
        raise ValueError(f"query heads ({hq}) must be divisible by key/value heads ({hk}) {where}")
    if d == 0 or dv == 0:
        raise ValueError(f"empty input: head_dim {d}, head_dim_v {dv} {where}")


def dense_strides_bhsd(shape_bhsd: Tuple[int, int, int, int], qkv_format: str) -> Tuple[int, ...]:
    """Strides of a [B, H, S, D] view whose memory is dense in `qkv_format` order (no allocation)."""
    physical = [shape_bhsd[i] for i in _FROM_BHSD[qkv_format]]
    strides, step = [0] * 4, 1
    for axis in reversed(range(4)):
        strides[axis] = step
        step *= max(physical[axis], 1)
    return tuple(strides[i] for i in _TO_BHSD[qkv_format])


def empty_bhsd(shape_bhsd: Tuple[int, int, int, int], qkv_format: str, dtype, device) -> torch.Tensor:
    """An uninitialised [B, H, S, D] view whose memory is dense in `qkv_format` order."""
    physical = [shape_bhsd[i] for i in _FROM_BHSD[qkv_format]]
    return to_bhsd(torch.empty(physical, dtype=dtype, device=device), qkv_format)


def widen_v(v: torch.Tensor, channels: int) -> torch.Tensor:
    """v with `channels` zero channels appended to its head dim (the last axis in every layout), for a backend
    that runs one head dim for Q, K and V (`mxattn.backends.v_padding`)."""
    return torch.nn.functional.pad(v, (0, channels))


def narrow_o(o: torch.Tensor, channels: int) -> torch.Tensor:
    """O of a call on V widened by `channels` (`widen_v`) back to V's own head dim (a dense tensor)."""
    return o if not channels else o[..., :o.shape[-1] - channels].contiguous()
