"""The checks of a context-parallel call, and the one collective that makes every rank raise the same error.

Each rank checks its own arguments without raising, then the ranks exchange a small int64 tensor describing
the call (`all_gather`): a rank whose checks failed has its error re-raised on every rank (its message fetched
with a second, object collective that only this error path runs), and ranks that disagree on a shape, dtype,
option or the lengths (a digest of cu_seqlens travels, the values only when they differ) get one error naming
the field and each rank's value. No rank raises alone, so none is left waiting in a collective, and no kernel
runs before the ranks agree.
"""

from __future__ import annotations

import struct
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..attention import validate_inputs
from ..backends import BACKEND_NAMES, check_backend_name
from ..checks import resolved_softmax_scale
from ..constants import KERNEL_OUT_DTYPES
from ..errors import MXFP8NotSupportedError
from ..layouts import seq_axis
from ..mask import MaskSpec, resolve_mask
from ..sinks import sink_logits
from . import comm
from .seqs import Seqs, sequences

COMM_TYPES = ("p2p", "all_gather", "a2a")
#: the layouts context parallelism takes (Transformer Engine's)
CP_FORMATS = ("bshd", "sbhd", "thd")
#: the mask types it takes: self-attention, so a bottom-right causal mask is the top-left one
CP_MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                 "padding_causal_bottom_right")
_SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ERRORS = {cls.__name__: cls for cls in (TypeError, ValueError, MXFP8NotSupportedError)}


class CPCall(NamedTuple):
    """A checked context-parallel call (every rank agrees on it)."""

    comm_type: str
    group: object
    global_ranks: Tuple[int, ...]
    cp_size: int
    rank: int
    cp_stream: object
    qkv_format: str
    attn_mask_type: str
    #: TE's (left, right) window as it runs (`mxattn.mask.te_window`)
    window: Tuple[int, int]
    #: the band over the whole sequence (self-attention, equal lengths)
    band: MaskSpec
    softmax_scale: float
    softmax_type: str
    #: fp32 [Hq] sink logits, or None
    sink: Optional[torch.Tensor]
    backend: str
    #: the dtype the kernels write O and the gradients in (bf16 or fp16)
    kernel_dtype: torch.dtype
    #: the sequences: chunk sizes and valid lengths
    seqs: Seqs
    #: the whole sequences' cu_seqlens_q as given (int32 [B+1]), or None
    cu_seqlens: Optional[torch.Tensor]
    needs_backward: bool
    #: V's head dim (q's and k's may differ: MLA)
    head_dim_v: int

    @property
    def causal(self) -> bool:
        return self.band.right_bound == 0


def check_group(cp_group) -> Tuple[int, int]:
    """(cp_size, rank) of cp_group; raises TypeError at once when it is no process group (there is then no one
    to agree with)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel_attention needs torch.distributed initialized "
                           "(torch.distributed.init_process_group)")
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"cp_group must be a torch.distributed ProcessGroup, got {type(cp_group).__name__}")
    return dist.get_world_size(cp_group), dist.get_rank(cp_group)


def local_checks(q, k, v, *, cp_group, cp_global_ranks, cp_comm_type, cp_stream, qkv_format, attn_mask_type,
                 window_size, softmax_scale, softmax_type, softmax_offset, cu_seqlens_q, cu_seqlens_kv,
                 cu_seqlens_q_padded, cu_seqlens_kv_padded, backend, cp_size: int, rank: int) -> CPCall:
    """This rank's view of the call, checked (TypeError/ValueError/MXFP8NotSupportedError naming the argument)."""
    if cp_comm_type not in COMM_TYPES:
        extra = (" ('a2a+p2p' needs two groups and is not implemented here)" if cp_comm_type == "a2a+p2p" else "")
        raise ValueError(f"cp_comm_type must be one of {COMM_TYPES}, got {cp_comm_type!r}{extra}")
    ranks = check_global_ranks(cp_group, cp_global_ranks)
    if cp_stream is not None and not isinstance(cp_stream, torch.cuda.Stream):
        raise TypeError(f"cp_stream must be None or a torch.cuda.Stream, got {type(cp_stream).__name__}")
    if qkv_format not in CP_FORMATS:
        raise ValueError(f"qkv_format must be one of {CP_FORMATS} under context parallelism, got {qkv_format!r}")
    validate_inputs(q, k, v, qkv_format)
    s_q, s_kv = q.shape[seq_axis(qkv_format)], k.shape[seq_axis(qkv_format)]
    if s_q != s_kv:
        raise ValueError(f"context parallelism runs self-attention: q has {s_q} tokens on this rank and k, v "
                         f"have {s_kv}")
    if attn_mask_type not in CP_MASK_TYPES:
        raise ValueError(f"attn_mask_type must be one of {CP_MASK_TYPES} under context parallelism, got "
                         f"{attn_mask_type!r}")
    band, padding = resolve_mask(attn_mask_type, window_size, equal_lengths=True)
    seqs = sequences(q, qkv_format, cp_size, padding, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                     cu_seqlens_kv_padded)
    window = (-1 if band.left_bound is None else band.left_bound - 1,
              -1 if band.right_bound is None else band.right_bound)
    _check_window(cp_comm_type, attn_mask_type, window_size, band)
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if cp_comm_type == "a2a" and (heads_q % cp_size or heads_kv % cp_size):
        raise ValueError(f"cp_comm_type='a2a' scatters the heads over the {cp_size} ranks: the query heads "
                         f"({heads_q}) and key/value heads ({heads_kv}) must both be divisible by cp_size")
    sink = sink_logits(softmax_type, softmax_offset, heads_q, q.device)
    softmax_scale = resolved_softmax_scale(softmax_scale, q.shape[-1])
    check_backend_name(backend)
    needs_backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, softmax_offset))
    return CPCall(cp_comm_type, cp_group, ranks, cp_size, rank, cp_stream, qkv_format, attn_mask_type, window,
                  band, float(softmax_scale), softmax_type, sink, backend,
                  q.dtype if q.dtype in KERNEL_OUT_DTYPES else torch.bfloat16, seqs, cu_seqlens_q, needs_backward,
                  v.shape[-1])


def check_global_ranks(cp_group, cp_global_ranks) -> Tuple[int, ...]:
    """cp_global_ranks as a tuple, checked against cp_group's members (ValueError/TypeError naming it)."""
    expected = list(dist.get_process_group_ranks(cp_group))
    try:
        given = [int(r) for r in cp_global_ranks]
    except (TypeError, ValueError):
        raise TypeError(f"cp_global_ranks must be a sequence of ints (the global ranks of cp_group's members), "
                        f"got {cp_global_ranks!r}") from None
    if given != expected:
        raise ValueError(f"cp_global_ranks={given} does not match cp_group, whose members are the global ranks "
                         f"{expected} (in group-rank order)")
    return tuple(given)


def _check_window(comm_type: str, attn_mask_type: str, window_size, band: MaskSpec) -> None:
    """Refuse the windows a comm type cannot carry (Transformer Engine's rule: none under p2p)."""
    if band.is_unmasked or (band.causal and band.left_bound is None):
        return
    if comm_type == "p2p":
        raise ValueError(f"window_size={window_size!r} is a sliding window, which cp_comm_type='p2p' cannot carry "
                         f"(as in Transformer Engine); use cp_comm_type='all_gather' or 'a2a'")
    if comm_type == "all_gather" and not band.causal:
        raise ValueError(f"window_size={window_size!r} with attn_mask_type={attn_mask_type!r} reaches keys right "
                         f"of the diagonal, which cp_comm_type='all_gather' cannot carry (it attends key prefixes); "
                         f"use cp_comm_type='a2a', or a causal mask with window_size=(left, 0)")


# --------------------------------------------------------------------------- the one collective


#: the descriptor's fields: (name, number of ints); `_describe` fills them in this order
_FIELDS = (("cp_comm_type", 1), ("qkv_format", 1), ("attn_mask_type", 1), ("window_size", 2),
           ("softmax_type", 1), ("softmax_scale", 1), ("backend", 1), ("dtype", 1), ("device type", 1),
           ("q shape", 4), ("k shape", 4), ("v shape", 4), ("whether gradients are needed", 1),
           ("softmax_offset requires_grad", 1), ("cu_seqlens", 1))
_NAMES = {"cp_comm_type": COMM_TYPES, "qkv_format": CP_FORMATS, "attn_mask_type": CP_MASK_TYPES,
          "softmax_type": _SOFTMAX_TYPES, "backend": ("auto",) + BACKEND_NAMES, "dtype": _DTYPES,
          "device type": ("cpu", "cuda")}
_LENGTH = 1 + sum(n for _, n in _FIELDS)


def _describe(call: CPCall, q, k, v, softmax_offset) -> List[int]:
    scale_bits = struct.unpack("<q", struct.pack("<d", call.softmax_scale))[0]
    device = q.device.type if q.device.type in ("cpu", "cuda") else "cuda"
    values = [COMM_TYPES.index(call.comm_type), CP_FORMATS.index(call.qkv_format),
              CP_MASK_TYPES.index(call.attn_mask_type), *call.window, _SOFTMAX_TYPES.index(call.softmax_type),
              scale_bits, _NAMES["backend"].index(call.backend), _DTYPES.index(q.dtype),
              _NAMES["device type"].index(device), *_shape(q), *_shape(k), *_shape(v), int(call.needs_backward),
              int(softmax_offset is not None and softmax_offset.requires_grad), call.seqs.digest()]
    return [0] + values


def _shape(t) -> List[int]:
    """t's shape as 4 ints (a 3-D thd shape padded with -1)."""
    return list(t.shape) + [-1] * (4 - t.dim())


def _shown(name: str, values: Sequence[int]):
    if name in _NAMES:
        return _NAMES[name][values[0]]
    if name == "softmax_scale":
        return struct.unpack("<d", struct.pack("<q", values[0]))[0]
    if name.startswith("whether") or name.endswith("requires_grad"):
        return bool(values[0])
    if name.endswith("shape"):
        return tuple(v for v in values if v != -1)
    return tuple(values)


def _exchange_device(q, group) -> torch.device:
    """Where the agreement's small tensor goes: the device the group's backend takes (NCCL: the current CUDA
    device; gloo: the CPU), whatever device a rank's (possibly wrong) q is on; q's device for a group of several
    backends."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" or not isinstance(q, torch.Tensor):
        return torch.device("cpu")
    return q.device


def agree(call: Optional[CPCall], error: Optional[BaseException], q, k, v, softmax_offset, group) -> CPCall:
    """Exchange the call's description with every rank of group and raise on every rank alike when a rank's
    checks failed (that rank's error, the lowest such rank) or the ranks disagree (ValueError naming the
    fields). Returns call when all is well."""
    row = [1] + [0] * (_LENGTH - 1) if error is not None else _describe(call, q, k, v, softmax_offset)
    rows = torch.stack(comm.all_gather(torch.tensor(row, dtype=torch.int64, device=_exchange_device(q, group)),
                                       group)).cpu().tolist()
    if any(r[0] for r in rows):
        sent = None if error is None else (type(error).__name__, str(error))
        messages = [None] * len(rows)
        dist.all_gather_object(messages, sent, group=group)
        failed = next(i for i, r in enumerate(rows) if r[0])
        kind, text = messages[failed]
        raise _ERRORS.get(kind, ValueError)(f"context_parallel_attention (rank {failed} of cp_group): {text}")
    disagreements, at = [], 1
    for name, width in _FIELDS:
        values = [tuple(r[at:at + width]) for r in rows]
        if len(set(values)) > 1:
            if name == "cu_seqlens":  # (only a digest travelled: every rank fetches the values alike)
                values = [None] * len(rows)
                dist.all_gather_object(values, call.seqs.cu_text(), group=group)
            else:
                values = [_shown(name, val) for val in values]
            disagreements.append(f"{name} ({', '.join(f'rank {i}: {val}' for i, val in enumerate(values))})")
        at += width
    if disagreements:
        raise ValueError("context_parallel_attention: the ranks of cp_group disagree on " + "; ".join(disagreements)
                         + ". Every rank must pass the same options and lengths, and shards of one shape and dtype")
    return call


class ContextParallelGroup(NamedTuple):
    """A context-parallel group as a module records it (`set_context_parallel_group`: the arguments of
    `context_parallel_attention`)."""

    group: object
    global_ranks: Tuple[int, ...]
    stream: object
    comm_type: str
    size: int

    def __deepcopy__(self, memo):  # a copied model (an EMA copy, ...) runs over the same group: groups do not copy
        return self


def resolve_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type: str) -> Optional[ContextParallelGroup]:
    """`set_context_parallel_group`'s arguments checked (TypeError/ValueError naming the argument): the record to
    keep, or None for no group or a group of one rank (the ordinary path)."""
    if cp_group is None:
        return None
    cp_size, _ = check_group(cp_group)
    ranks = check_global_ranks(cp_group, cp_global_ranks)
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {COMM_TYPES}, got {cp_comm_type!r}")
    return None if cp_size == 1 else ContextParallelGroup(cp_group, ranks, cp_stream, cp_comm_type, cp_size)

