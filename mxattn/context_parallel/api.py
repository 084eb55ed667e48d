"""`context_parallel_attention`: MXFP8 attention over a sequence split across the ranks of a process group."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..attention import mxfp8_attention
from ..errors import MXFP8NotSupportedError
from ..layouts import from_bhsd, to_bhsd
from . import a2a, all_gather, p2p
from .checks import agree, check_group, local_checks


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_group,
                               cp_global_ranks: Sequence[int], cp_comm_type: str = "p2p", cp_stream=None,
                               qkv_format: str = "bshd", attn_mask_type: str = "causal",
                               window_size: Optional[Tuple[int, int]] = None, softmax_scale: Optional[float] = None,
                               softmax_type: str = "vanilla", softmax_offset: Optional[torch.Tensor] = None,
                               cu_seqlens_q: Optional[torch.Tensor] = None,
                               cu_seqlens_kv: Optional[torch.Tensor] = None,
                               cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                               cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                               backend: str = "auto") -> torch.Tensor:
    """MXFP8 self-attention with the sequence split over the ranks of cp_group (Transformer Engine's context
    parallelism), differentiable w.r.t. q, k, v and a learnable softmax_offset.

    q [B, S/cp, Hq, D] (bshd), [S/cp, B, Hq, D] (sbhd) or [T/cp, Hq, D] (thd), k, v likewise with Hkv heads
    (Hq % Hkv == 0), bf16, fp16 or fp32: this rank's shard in TE's load-balanced layout (each sequence cut into
    2*cp chunks, rank r holding chunks r and 2*cp-1-r concatenated; `shard_sequence` makes it). Each chunk must
    be a multiple of 32 tokens, so every rank quantizes the MXFP8 blocks the single-device call does. Returns
    this rank's O shard in q's layout and dtype.
    cp_group: the torch.distributed group over which the sequence is split; cp_global_ranks: its members'
    global ranks in group-rank order (what the ring's P2P ops address); cp_stream: a CUDA stream for the ring's
    communication (None: a side stream of the library's).
    cp_comm_type: "p2p" (a ring of K/V blocks; partial results merged by their log-sum-exp in fp32),
    "all_gather" (K/V gathered, each query chunk attends its key prefix: O and dQ equal the single-device call
    bit for bit, dK/dV summed in fp32) or "a2a" (heads scattered, whole sequences per rank: bit for bit; Hq and
    Hkv divisible by cp). "p2p" and "all_gather" need a backend that writes float32 partial results (triton,
    reference; "auto" picks one).
    attn_mask_type "no_mask", "causal", "causal_bottom_right" (the same band here) or their padding types
    "padding", "padding_causal", "padding_causal_bottom_right"; window_size (TE's) under "a2a", and (left, 0)
    with a causal mask under "all_gather"; "p2p" takes no window.
    cu_seqlens_q, cu_seqlens_kv (TE's): int32 [B+1] on q's device, the whole sequences' cumulative valid lengths,
    the same on every rank; cu_seqlens_kv None or equal to cu_seqlens_q (self-attention). With bshd/sbhd they
    go with a padding mask type, each sequence's padding at its end: rows past a length give O = 0 and zero
    gradients, as `mxfp8_attention` with the same arguments on the whole batch.
    qkv_format "thd" (TE's): cu_seqlens_q the sequences' valid lengths, cu_seqlens_q_padded (None: cu_seqlens_q)
    their padded lengths, each a multiple of 2*cp*32 (each chunk whole 32-token blocks); q holds, sequence
    after sequence, chunks r and 2*cp-1-r of each padded sequence (`shard_sequence` with cu_seqlens_padded).
    The result's valid rows are those of `mxfp8_attention(qkv_format="thd", cu_seqlens_q=cu_seqlens_q)` on the
    valid tokens alone, packed without padding (the same MXFP8 blocks, restarting at each sequence); padding
    rows give O = 0 and zero gradients. A causal or no_mask type means its padding type here.
    softmax_type / softmax_offset (fp32 [Hq]) as in `mxfp8_attention`; softmax_offset is replicated like a
    weight: each rank's gradient is its share, and their sum over cp_group is the whole gradient (reduce it with
    the other parameters' gradients over the context-parallel ranks). A rank's bad argument, or ranks that
    disagree on shapes, dtypes, options or lengths, raise the same error (TypeError, ValueError or
    MXFP8NotSupportedError) on every rank, after one small collective and before any attention work. A group
    of one rank runs `mxfp8_attention` itself.
    """
    return attend_or_refuse(q, k, v, None, cp_group=cp_group, cp_global_ranks=cp_global_ranks,
                            cp_comm_type=cp_comm_type, cp_stream=cp_stream, qkv_format=qkv_format,
                            attn_mask_type=attn_mask_type, window_size=window_size, softmax_scale=softmax_scale,
                            softmax_type=softmax_type, softmax_offset=softmax_offset, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
                            cu_seqlens_kv_padded=cu_seqlens_kv_padded, backend=backend)


def attend_or_refuse(q, k, v, refusal: Optional[str], *, cp_group, cp_global_ranks, cp_comm_type, cp_stream,
                     qkv_format, attn_mask_type, window_size, softmax_scale, softmax_type, softmax_offset, backend,
                     cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                     cu_seqlens_kv_padded=None) -> torch.Tensor:
    """`context_parallel_attention` (the same arguments), or, where refusal is not None, a ValueError with that
    reason on every rank alike, raised by the call's own agreement over cp_group: a caller's check of its own
    arguments (the transformers integration's) costs no collective of its own."""
    cp_size, rank = check_group(cp_group)
    if refusal is not None and cp_size == 1:
        raise ValueError(refusal)
    options = dict(qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
                   softmax_scale=softmax_scale, softmax_type=softmax_type, softmax_offset=softmax_offset,
                   backend=backend)
    lengths = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
                   cu_seqlens_kv_padded=cu_seqlens_kv_padded)
    if cp_size == 1:  # one rank: its two chunks are the whole sequence, in order
        call = local_checks(q, k, v, cp_group=cp_group, cp_global_ranks=cp_global_ranks, cp_comm_type=cp_comm_type,
                            cp_stream=cp_stream, cp_size=1, rank=0, **options, **lengths)
        if qkv_format == "thd":
            return from_bhsd(a2a.attend_whole(call, *(to_bhsd(x, "thd") for x in (q, k, v)), softmax_offset), "thd")
        return mxfp8_attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, **options)
    call, error, plan = None, None, None
    try:
        if refusal is not None:
            raise ValueError(refusal)
        call = local_checks(q, k, v, cp_group=cp_group, cp_global_ranks=cp_global_ranks, cp_comm_type=cp_comm_type,
                            cp_stream=cp_stream, cp_size=cp_size, rank=rank, **options, **lengths)
        qb, kb = to_bhsd(q, qkv_format), to_bhsd(k, qkv_format)
        plan = {"a2a": a2a.check_backend, "all_gather": all_gather.plan, "p2p": p2p.plan}[call.comm_type](call, qb, kb)
    except (TypeError, ValueError, MXFP8NotSupportedError) as exc:
        error = exc
    call = agree(call, error, q, k, v, softmax_offset, cp_group)
    qb, kb, vb = (to_bhsd(x, qkv_format) for x in (q, k, v))
    if call.comm_type == "a2a":
        return from_bhsd(a2a.run(call, qb, kb, vb, softmax_offset), qkv_format)
    function = all_gather.AllGatherAttention if call.comm_type == "all_gather" else p2p.RingAttention
    o = function.apply(call, plan, qb, kb, vb, call.sink)
    o = from_bhsd(o, qkv_format)
    return o if o.dtype == q.dtype else o.to(q.dtype)
