"""Context-parallel MXFP8 attention (`mxattn.context_parallel_attention`) over CPU process groups (gloo, the
reference backend), against the single-process call on the whole sequence.

Cases cover dense batches, padded ones (bshd/sbhd with a padding mask and cu_seqlens: a length ending inside a
chunk and one filling the sequence) and packed ones (thd: sequences of different lengths, each padded to a
multiple of 2 * cp * 32 as TE's cu_seqlens_q_padded says, compared with the single call on the valid tokens
alone, packed without padding), a few with V of another head dim than Q and K (MLA). Padding rows hold NaN, and
must give O = 0 and zero gradients.
One spawn per world size (2 and 4 processes) runs every case; rank 0 gathers the ranks' output shards and input
gradients, unshards them and records how they compare, and the tests below read those records:
- "a2a" equals the single-device call bit for bit (O and every gradient; the learnable sink's gradient, each
  rank's share summed over the ranks, too);
- "all_gather": O and dQ bit for bit, dK/dV (summed over the ranks in float32) and dsink to rel-RMS 5e-4;
- "p2p": the ring's partial attentions merged by their log-sum-exp. The recipe rounds P to E4M3 against each
  call's running row maximum (spec section 6), which a partial call over some of the keys does not share with
  the single call, so O moves by about 1-3% rel-RMS: less than MXFP8 itself moves it from exact attention, which
  is the bound used here. Sharp checks instead: O against the ring's definition (`ref.mxfp8_ref.sdpa_fwd` on each
  partial key set, its valid tokens, merged in float64) and the gradients against `ref.mxfp8_ref.sdpa_bwd` on each
  whole sequence given the ring's O and log-sum-exp, both to rel-RMS 5e-4;
- bad arguments raise the same clear error on every rank, without a hang (the join has a timeout);
- a group of one rank is the plain call, and `DotProductAttention.set_context_parallel_group` runs the same
  (bshd, and thd with TE's length arguments).
"""

import itertools
import warnings
from typing import NamedTuple

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

from rank_jobs import record_of, run_jobs  # noqa: E402

pytestmark = pytest.mark.slow

B, D, TOL = 1, 64, 5e-4  # (B: the error cases' and the module's batch; a case may set its own)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


class Case(NamedTuple):
    """A case's whole-batch inputs, the same on every rank: q, k, v, dO (bf16, in fmt; thd: the packed padded
    sequences), the sink logits [hq] fp32, the length arguments of both calls (cu_seqlens_q, and
    cu_seqlens_q_padded for thd) and each sequence as (batch entry or padded offset, valid tokens, padded
    tokens). Padding rows hold NaN: they must reach no output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    sink: torch.Tensor
    fmt: str
    lengths: dict
    seqs: list


def _inputs(world, hq, hkv, qkv_format, blocks=1, batch=B, seed=0, lengths=None, dv=D):
    """The Case of S = 64 * world * blocks tokens per sequence (bshd/sbhd; `lengths` its valid lengths, or None
    for a dense batch), or (thd) of sequences of `lengths` valid tokens, each padded to a multiple of 64 * world;
    q, k of head dim D, v and dO of dv (MLA where it differs)."""
    g = torch.Generator().manual_seed(seed)
    if qkv_format == "thd":
        quantum = 64 * world
        padded = [-(-n // quantum) * quantum for n in lengths]
        offsets = [0, *itertools.accumulate(padded)]
        seqs = [(offsets[i], n, p) for i, (n, p) in enumerate(zip(lengths, padded))]
        shape = (lambda h, d: (offsets[-1], h, d))
        cu = dict(cu_seqlens_q=_cu(lengths), cu_seqlens_q_padded=_cu(padded))
    else:
        S = 2 * world * 32 * blocks
        seqs = [(b, S if lengths is None else lengths[b], S) for b in range(batch)]
        shape = (lambda h, d: (batch, S, h, d)) if qkv_format == "bshd" else (lambda h, d: (S, batch, h, d))
        cu = {} if lengths is None else dict(cu_seqlens_q=_cu(lengths))
    q, k, v, do = (torch.randn(shape(h, d), generator=g).bfloat16()
                   for h, d in ((hq, D), (hkv, D), (hkv, dv), (hq, dv)))
    case = Case(q, k, v, do, torch.randn(hq, generator=g), qkv_format, cu, seqs)
    for x in (q, k, v, do):
        for i, (_, n, p) in enumerate(seqs):
            _seq(x, case, i)[:, :, n:] = float("nan")
    return case


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _seq(x, case, i):
    """The [1, H, P, D] view of sequence i of x (a whole-batch tensor in case.fmt), padding included."""
    where, _, p = case.seqs[i]
    if case.fmt == "thd":
        return x[where:where + p].permute(1, 0, 2).unsqueeze(0)
    return _bhsd(x, case.fmt)[where:where + 1]


def _whole(parts, like, case):
    """Per-sequence [1, H, n, D] valid rows -> a whole-batch tensor like `like` (zeros in the padding)."""
    out = torch.zeros(like.shape[:-1] + parts[0].shape[-1:], dtype=parts[0].dtype, device=parts[0].device)
    for i, part in enumerate(parts):
        _seq(out, case, i)[:, :, :part.shape[2]] = part
    return out


def _valid(x, case):
    """Each sequence's valid rows of x, [1, H, n, D]."""
    return [_seq(x, case, i)[:, :, :n] for i, (_, n, _) in enumerate(case.seqs)]


def _unpadded(x, case):
    """A thd whole batch's valid tokens, packed without padding [T, H, D]."""
    return torch.cat(_valid(x, case), dim=2)[0].transpose(0, 1)


def _seq_dim(fmt):
    return {"bshd": 1, "sbhd": 0, "thd": 0}[fmt]


def _gather_full(t, group, case):
    from mxattn.context_parallel import unshard_sequence
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return unshard_sequence(parts, _seq_dim(case.fmt), cu_seqlens_padded=case.lengths.get("cu_seqlens_q_padded"))


def _single(case, backend="reference", **options):
    """(O, dq, dk, dv, dsink) of the single-process call on the whole batch (thd: on the valid tokens alone,
    packed without padding; the results put back in the padded layout)."""
    import mxattn
    ins, do = [case.q, case.k, case.v], case.do
    if case.fmt == "thd":  # the valid tokens alone, packed without padding: [T, H, D]
        ins, do = [_unpadded(x, case) for x in ins], _unpadded(do, case)
    ins = [x.clone().requires_grad_() for x in ins]
    offset = case.sink.clone().requires_grad_() if options.get("softmax_type") == "learnable" else None
    o = mxattn.mxfp8_attention(*ins, backend=backend, softmax_offset=offset, qkv_format=case.fmt,
                               cu_seqlens_q=case.lengths.get("cu_seqlens_q"), **options)
    o.backward(do)
    out = [o.detach(), *(x.grad for x in ins)]
    if case.fmt == "thd":  # back to the padded layout, sequence by sequence
        cu = case.lengths["cu_seqlens_q"].tolist()
        out = [_whole([t[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(cu, cu[1:])], like, case)
               for t, like in zip(out, (case.q, case.q, case.k, case.v))]
    return out + [None if offset is None else offset.grad]


def _sharded(case, rank, world, group, comm_type, backend="reference", **options):
    """The same outputs from the context-parallel call, unsharded, the sink's gradient summed over the ranks
    (each holds its share, as of any replicated parameter); every rank returns them."""
    from mxattn import context_parallel_attention
    from mxattn.context_parallel import shard_sequence
    padded = case.lengths.get("cu_seqlens_q_padded")
    ins = [shard_sequence(x, world, rank, _seq_dim(case.fmt), cu_seqlens_padded=padded).requires_grad_()
           for x in (case.q, case.k, case.v)]
    offset = case.sink.clone().requires_grad_() if options.get("softmax_type") == "learnable" else None
    o = context_parallel_attention(*ins, cp_group=group, cp_global_ranks=dist.get_process_group_ranks(group),
                                   cp_comm_type=comm_type, backend=backend, softmax_offset=offset,
                                   qkv_format=case.fmt, **case.lengths, **options)
    o.backward(shard_sequence(case.do, world, rank, _seq_dim(case.fmt), cu_seqlens_padded=padded))
    out = [_gather_full(t, group, case) for t in (o.detach(), *(x.grad for x in ins))]
    if offset is not None:
        dist.all_reduce(offset.grad, group=group)
    return out + [None if offset is None else offset.grad]


NAMES = ("o", "dq", "dk", "dv", "dsink")


def _compare(got, want):
    return {n: {"equal": bool(torch.equal(g, w)), "rel": _rel(g, w)}
            for n, g, w in zip(NAMES, got, want) if w is not None}


def _padding_is_zero(got, case) -> bool:
    """Whether O and the input gradients are exactly zero on every padding row."""
    return all(bool((_seq(t, case, i)[:, :, n:] == 0).all()) for t in got[:4] for i, (_, n, _) in enumerate(case.seqs))


# --------------------------------------------------------------------------- the ring's own definition (p2p)


def _bhsd(x, qkv_format):
    return x.permute(0, 2, 1, 3) if qkv_format == "bshd" else x.permute(1, 2, 0, 3)


def _ring_definition(case, sink, world, causal):
    """Per sequence, (O, lse) float64 [1, H, n, *] of its n valid rows under ring attention as Transformer Engine's
    p2p scheme defines it: each rank's queries attend each rank's K/V block in one `ref.mxfp8_ref.sdpa_fwd` call
    (own block: causal on the local concatenation; an earlier rank's: its first chunk, all local queries; a later
    rank's: the whole block, the second local chunk), each call on the valid tokens of its rows and keys (a
    sequence's valid tokens are a prefix of it), the partial results merged by their log-sum-exp, the sink
    joining once."""
    from ref import mxfp8_ref
    from mxattn.context_parallel.layout import local_chunks
    out = []
    for i, (_, n, p) in enumerate(case.seqs):
        qb, kb, vb = (_seq(x, case, i) for x in (case.q, case.k, case.v))
        L = p // (2 * world)
        idx = [torch.cat([torch.arange(c * L, (c + 1) * L) for c in local_chunks(world, r)]) for r in range(world)]
        parts = []  # (rows, o, lse) of every partial call, rows of the whole sequence
        for r in range(world):
            for s in range(world):
                rows, keys, mask = idx[r], idx[s], s == r and causal
                if causal and s < r:
                    keys = idx[s][:L]
                elif causal and s > r:
                    rows = idx[r][L:]
                rows, keys = rows[rows < n], keys[keys < n]
                if len(rows) and len(keys):
                    o, lse = mxfp8_ref.sdpa_fwd(qb[:, :, rows], kb[:, :, keys], vb[:, :, keys], causal=mask,
                                                out_dtype=torch.float32)
                    parts.append((rows, o.double(), lse.double()))
        lse_all = torch.full(qb.shape[:2] + (n, 1), float("-inf"), dtype=torch.float64)
        for rows, _, lse in parts:
            lse_all[:, :, rows] = torch.logaddexp(lse_all[:, :, rows], lse)
        if sink is not None:
            lse_all = torch.logaddexp(lse_all, sink.double().view(1, -1, 1, 1))
        o_all = torch.zeros(qb.shape[:2] + (n, vb.shape[3]), dtype=torch.float64)
        for rows, o, lse in parts:
            o_all[:, :, rows] += o * torch.exp(lse - lse_all[:, :, rows])
        out.append((o_all, lse_all))
    return out


def _ring_backward(case, o, lses, sink, causal):
    """(dq, dk, dv, dsink or None) of `ref.mxfp8_ref.sdpa_bwd` on each sequence's valid rows given O (whole
    batch) and the lse (per sequence), float32, in the whole-batch layout."""
    from ref import mxfp8_ref
    grads, dsink = [], None
    for i, (qb, kb, vb, dob, ob) in enumerate(zip(*(_valid(x, case) for x in (case.q, case.k, case.v, case.do, o)))):
        g = mxfp8_ref.sdpa_bwd(qb, kb, vb, ob, dob, lses[i].float(), causal=causal, out_dtype=torch.float32,
                               sink=None if sink is None else sink.float())
        grads.append(g[:3])
        if sink is not None:
            dsink = g[3] if dsink is None else dsink + g[3]
    return [_whole([g[j] for g in grads], like, case) for j, like in enumerate((case.q, case.k, case.v))] + [dsink]


def _exact(case, sink, causal):
    """(O, dq, dk, dv, dsink) of attention without quantization (float64), each sequence on its valid rows, in
    the whole-batch layout."""
    from ref import mxfp8_ref
    s = None if sink is None else sink.double()
    outs, dsink = [], None
    for qb, kb, vb, dob in zip(*(_valid(x, case) for x in (case.q, case.k, case.v, case.do))):
        qb, kb, vb, dob = (x.double() for x in (qb, kb, vb, dob))
        o, lse = mxfp8_ref.sdpa_fwd(qb, kb, vb, causal=causal, quantize_inputs=False, sink=s,
                                    out_dtype=torch.float64)
        g = mxfp8_ref.sdpa_bwd(qb, kb, vb, o, dob, lse, causal=causal, quantize_inputs=False, sink=s,
                               out_dtype=torch.float64)
        outs.append((o, *g[:3]))
        if sink is not None:
            dsink = g[3] if dsink is None else dsink + g[3]
    likes = (case.q, case.q, case.k, case.v)
    return [_whole([o[j] for o in outs], like, case) for j, like in enumerate(likes)] + [dsink]


# --------------------------------------------------------------------------- the cases each spawn runs


def _split(spec):
    spec = dict(spec)
    data = {key: spec.pop(key) for key in ("blocks", "hq", "hkv", "qkv_format", "batch", "lengths", "dv")
            if key in spec}
    return data, spec


#: padded batches: a length ending inside a chunk and one filling the sequence (S = 256 in both worlds); packed
#: ones: sequences of three lengths, each padded to a multiple of 64 * world
_PADDED = dict(batch=2, lengths=(150, 256), attn_mask_type="padding_causal")
_PADDED_4 = dict(batch=2, lengths=(100, 256), attn_mask_type="padding_causal")
_PACKED = dict(qkv_format="thd", lengths=(100, 37, 200), attn_mask_type="padding_causal")
_PACKED_4 = dict(qkv_format="thd", lengths=(300, 37, 200), attn_mask_type="padding_causal")

#: (name, cp_comm_type, inputs and options): a2a must match bit for bit, all_gather as the module docstring says
EXACT = {
    2: [("a2a-causal-gqa-learnable", "a2a", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="causal",
                                                 softmax_type="learnable")),
        ("a2a-nomask-sbhd-batch2", "a2a", dict(blocks=1, hq=4, hkv=4, qkv_format="sbhd", batch=2,
                                               attn_mask_type="no_mask")),
        ("a2a-causal-window-offbyone", "a2a", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="causal",
                                                   window_size=(40, 0), softmax_type="off-by-one")),
        ("a2a-nomask-window", "a2a", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="no_mask",
                                          window_size=(40, 24))),
        ("a2a-padding_causal-gqa-learnable", "a2a", dict(_PADDED, blocks=2, hq=4, hkv=2, qkv_format="bshd",
                                                         softmax_type="learnable")),
        ("a2a-thd-gqa", "a2a", dict(_PACKED, hq=4, hkv=2)),
        ("all_gather-causal-gqa-learnable", "all_gather", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd",
                                                               attn_mask_type="causal", softmax_type="learnable")),
        ("all_gather-nomask-sbhd-batch2", "all_gather", dict(blocks=1, hq=4, hkv=4, qkv_format="sbhd", batch=2,
                                                             attn_mask_type="no_mask")),
        ("all_gather-causal-window-offbyone", "all_gather", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd",
                                                                 attn_mask_type="causal", window_size=(40, 0),
                                                                 softmax_type="off-by-one")),
        ("all_gather-padding_causal-sbhd-gqa-offbyone", "all_gather", dict(_PADDED, blocks=2, hq=4, hkv=2,
                                                                           qkv_format="sbhd",
                                                                           softmax_type="off-by-one")),
        ("all_gather-thd-gqa-learnable", "all_gather", dict(_PACKED, hq=4, hkv=2, softmax_type="learnable")),
        ("all_gather-thd-padding", "all_gather", dict(_PACKED, hq=4, hkv=2, attn_mask_type="padding")),
        # MLA: V (and O, dO) of another head dim than Q and K
        ("a2a-causal-gqa-mla", "a2a", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="causal", dv=32)),
        ("all_gather-thd-gqa-mla-learnable", "all_gather", dict(_PACKED, hq=4, hkv=2, dv=32,
                                                                softmax_type="learnable"))],
    4: [("a2a-causal-learnable", "a2a", dict(blocks=1, hq=4, hkv=4, qkv_format="bshd", attn_mask_type="causal",
                                             softmax_type="learnable")),
        ("a2a-padding_causal", "a2a", dict(_PADDED_4, blocks=1, hq=4, hkv=4, qkv_format="bshd")),
        ("a2a-thd-gqa-learnable", "a2a", dict(_PACKED_4, hq=8, hkv=4, softmax_type="learnable")),
        ("all_gather-causal-gqa-window-learnable", "all_gather", dict(blocks=1, hq=4, hkv=2, qkv_format="bshd",
                                                                      attn_mask_type="causal", window_size=(48, 0),
                                                                      softmax_type="learnable")),
        ("all_gather-nomask-sbhd", "all_gather", dict(blocks=1, hq=4, hkv=2, qkv_format="sbhd",
                                                      attn_mask_type="no_mask")),
        ("all_gather-padding_causal-gqa-learnable", "all_gather", dict(_PADDED_4, blocks=1, hq=4, hkv=2,
                                                                       qkv_format="bshd", softmax_type="learnable")),
        ("all_gather-thd-gqa", "all_gather", dict(_PACKED_4, hq=4, hkv=2))],
}

#: (name, inputs and options) of the p2p cases
RING = {
    2: [("p2p-causal-gqa-learnable", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="causal",
                                          softmax_type="learnable")),
        ("p2p-causal-sbhd-batch2-offbyone", dict(blocks=1, hq=4, hkv=4, qkv_format="sbhd", batch=2,
                                                 attn_mask_type="causal", softmax_type="off-by-one")),
        ("p2p-padding_causal-gqa-learnable", dict(_PADDED, blocks=2, hq=4, hkv=2, qkv_format="bshd",
                                                  softmax_type="learnable")),
        ("p2p-thd-gqa", dict(_PACKED, hq=4, hkv=2)),
        ("p2p-causal-gqa-mla", dict(blocks=2, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="causal", dv=32))],
    4: [("p2p-causal-gqa-learnable", dict(blocks=1, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="causal",
                                          softmax_type="learnable")),
        ("p2p-nomask", dict(blocks=1, hq=4, hkv=2, qkv_format="bshd", attn_mask_type="no_mask")),
        ("p2p-padding_causal-sbhd", dict(_PADDED_4, blocks=1, hq=4, hkv=2, qkv_format="sbhd")),
        ("p2p-thd-gqa-learnable", dict(_PACKED_4, hq=4, hkv=2, softmax_type="learnable")),
        ("p2p-thd-padding", dict(_PACKED_4, hq=4, hkv=2, attn_mask_type="padding"))],
}


def _run_exact(rank, world, group, comm_type, spec):
    data, options = _split(spec)
    case = _inputs(world, **data)
    got = _sharded(case, rank, world, group, comm_type, **options)
    if rank == 0:
        return dict(_compare(got, _single(case, **options)), padding_zero=_padding_is_zero(got, case))


def _run_ring(rank, world, group, spec):
    data, options = _split(spec)
    causal = options["attn_mask_type"] in ("causal", "padding_causal")
    case = _inputs(world, **data)
    got = _sharded(case, rank, world, group, "p2p", **options)
    if rank != 0:
        return None
    kind = options.get("softmax_type", "vanilla")
    logits = {"learnable": case.sink, "off-by-one": torch.zeros_like(case.sink)}.get(kind)
    ring = _ring_definition(case, logits, world, causal)
    grads = _ring_backward(case, got[0], [lse for _, lse in ring], logits, causal)
    definition = [_whole([o for o, _ in ring], case.q, case).bfloat16(), *(g.bfloat16() for g in grads[:3]),
                  grads[3] if kind == "learnable" else None]
    single = _single(case, **options)
    exact = _exact(case, logits, causal)
    return {"definition": _compare(got, definition), "single": _compare(got, single),
            "mxfp8_error": {n: _rel(s, e) for n, s, e in zip(NAMES, single, exact) if s is not None},
            "padding_zero": _padding_is_zero(got, case)}


def _error_kwargs(rank, world, group, case):
    """context_parallel_attention's arguments of an error case on this rank."""
    ranks = dist.get_process_group_ranks(group)
    hkv, length, dtype, comm_type, options = 2, 64, torch.bfloat16, "all_gather", {}
    if case == "bad-comm-type-on-one-rank":
        comm_type = "ring" if rank == 1 else "p2p"
    elif case == "misaligned-length":
        length = 48
    elif case == "ranks-disagree-on-shape":
        length = 128 if rank == 1 else 64
    elif case == "p2p-window":
        comm_type, options = "p2p", dict(window_size=(40, 0))
    elif case == "all_gather-nomask-window":
        options = dict(attn_mask_type="no_mask", window_size=(40, 24))
    elif case == "global-ranks":
        ranks = ranks[::-1]
    elif case == "a2a-heads":
        comm_type = "a2a"
    elif case == "ranks-disagree-on-dtype":
        dtype = torch.float16 if rank == world - 1 else torch.bfloat16
    elif case == "padding-without-cu_seqlens":
        options = dict(attn_mask_type="padding_causal")
    elif case == "cu_seqlens-differ-across-ranks":
        options = dict(attn_mask_type="padding_causal", cu_seqlens_q=_cu([60 if rank == 1 else 50]))
    elif case == "thd-misaligned-padded-length":  # the second sequence pads to 96 tokens, not a multiple of 128
        length, options = 112, dict(qkv_format="thd", cu_seqlens_q=_cu([100, 90]), cu_seqlens_q_padded=_cu([128, 96]))
    elif case == "thd-padded-lengths-differ-across-ranks":
        padded = [512, 0] if rank == world - 1 else [256, 256]
        length, options = 128, dict(qkv_format="thd", cu_seqlens_q=_cu([100, 0]), cu_seqlens_q_padded=_cu(padded))
    shape = (lambda h: (length, h, D)) if options.get("qkv_format") == "thd" else (lambda h: (B, length, h, D))
    q, k, v = (torch.randn(shape(h)).to(dtype) for h in (4, hkv, hkv))
    return dict(q=q, k=k, v=v, cp_group=group, cp_global_ranks=ranks, cp_comm_type=comm_type, backend="reference",
                **options)


#: (case, exception type, words its message has) for each world size
ERRORS = {
    2: [("bad-comm-type-on-one-rank", "ValueError", ["rank 1 of cp_group", "cp_comm_type must be one of", "'ring'"]),
        ("misaligned-length", "ValueError", ["96 tokens", "chunks of a multiple of 32 tokens", "multiple of 128"]),
        ("ranks-disagree-on-shape", "ValueError", ["disagree on q shape", "rank 0: (1, 64, 4, 64)",
                                                   "rank 1: (1, 128, 4, 64)"]),
        ("p2p-window", "ValueError", ["window_size=(40, 0)", "cp_comm_type='p2p' cannot carry"]),
        ("all_gather-nomask-window", "ValueError", ["cp_comm_type='all_gather' cannot carry",
                                                    "use cp_comm_type='a2a'"]),
        ("global-ranks", "ValueError", ["cp_global_ranks=[1, 0] does not match cp_group"]),
        ("padding-without-cu_seqlens", "ValueError", ["padding attn_mask_type needs cu_seqlens_q"]),
        ("cu_seqlens-differ-across-ranks", "ValueError", ["disagree on cu_seqlens", "rank 0: cu_seqlens_q [0, 50]",
                                                          "rank 1: cu_seqlens_q [0, 60]"]),
        ("thd-misaligned-padded-length", "ValueError", ["sequence 1 has 96 tokens in cu_seqlens_q_padded",
                                                        "chunks of a multiple of 32 tokens",
                                                        "pad it to a multiple of 128 tokens (128)"])],
    4: [("a2a-heads", "ValueError", ["key/value heads (2)", "divisible by cp_size"]),
        ("ranks-disagree-on-dtype", "ValueError", ["disagree on dtype", "rank 3: torch.float16",
                                                   "rank 0: torch.bfloat16"]),
        ("thd-padded-lengths-differ-across-ranks", "ValueError", [
            "disagree on cu_seqlens", "rank 0: cu_seqlens_q [0, 100, 100], cu_seqlens_q_padded [0, 256, 512]",
            "rank 3: cu_seqlens_q [0, 100, 100], cu_seqlens_q_padded [0, 512, 512]"])],
}


def _run_error(rank, world, group, case):
    from mxattn import context_parallel_attention
    try:
        context_parallel_attention(**_error_kwargs(rank, world, group, case))
        got = ("no error", "")
    except Exception as exc:  # (any type: the test compares them)
        got = (type(exc).__name__, str(exc))
    every = [None] * world
    dist.all_gather_object(every, got, group=group)
    return {"errors": every} if rank == 0 else None


def _run_one_rank_groups(rank, world):
    """A group of one rank: the plain call, O and gradients bit for bit (each rank its own group; a packed batch
    with padding between its sequences too); the module keeps its ordinary path."""
    from mxattn import DotProductAttention
    groups = [dist.new_group([r]) for r in range(world)]  # (every rank takes part in making every group)
    options = dict(attn_mask_type="causal", softmax_type="learnable")
    case = _inputs(1, 4, 2, "bshd", blocks=2, seed=rank)
    record = _compare(_sharded(case, 0, 1, groups[rank], "p2p", **options), _single(case, **options))
    packed = _inputs(1, 4, 2, "thd", seed=rank, lengths=(40, 7))
    thd = _compare(_sharded(packed, 0, 1, groups[rank], "p2p", **options), _single(packed, **options))
    module = DotProductAttention(4, D, num_gqa_groups=2)
    module.set_context_parallel_group(groups[rank], [rank], cp_comm_type="a2a")
    return dict(record, thd=thd, module_path_unchanged=module._context_parallel is None) if rank == 0 else None


def _run_module(rank, world, group, qkv_format):
    """`DotProductAttention.set_context_parallel_group` (all_gather): the module's output shard and the learnable
    sink's gradient (summed over the ranks) against the same module on the whole batch (thd: a packed batch,
    its lengths given as TE gives them, against the module on the valid tokens alone)."""
    from mxattn import DotProductAttention
    from mxattn.context_parallel import shard_sequence
    thd = qkv_format == "thd"
    case = _inputs(world, 4, 2, qkv_format, blocks=2, **(dict(lengths=(100, 37, 200)) if thd else {}))
    mask = "padding_causal" if thd else "causal"
    modules = [DotProductAttention(4, D, num_gqa_groups=2, qkv_format=qkv_format, attn_mask_type=mask,
                                   softmax_type="learnable", backend="reference") for _ in range(2)]
    for m in modules:
        with torch.no_grad():
            m.softmax_offset.copy_(case.sink)
    modules[1].set_context_parallel_group(group, dist.get_process_group_ranks(group), cp_comm_type="all_gather")
    padded = case.lengths.get("cu_seqlens_q_padded")
    lengths = dict(cu_seqlens_q=case.lengths["cu_seqlens_q"], cu_seqlens_kv=case.lengths["cu_seqlens_q"],
                   cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded, max_seqlen_q=200,
                   max_seqlen_kv=200) if thd else {}
    out = modules[1](*(shard_sequence(x, world, rank, _seq_dim(qkv_format), padded) for x in (case.q, case.k, case.v)),
                     **lengths)
    out.backward(shard_sequence(case.do, world, rank, _seq_dim(qkv_format), padded).reshape(out.shape))
    full = _gather_full(out.detach(), group, case)
    dist.all_reduce(modules[1].softmax_offset.grad, group=group)
    if rank != 0:
        return None
    if thd:
        ref = modules[0](*(_unpadded(x, case) for x in (case.q, case.k, case.v)),
                         cu_seqlens_q=case.lengths["cu_seqlens_q"])
        ref.backward(_unpadded(case.do, case).reshape(ref.shape))
        cu = case.lengths["cu_seqlens_q"].tolist()
        parts = [ref.detach().view(-1, 4, D)[a:b].transpose(0, 1).unsqueeze(0) for a, b in zip(cu, cu[1:])]
        ref = _whole(parts, case.q, case).reshape(full.shape)
    else:
        ref = modules[0](case.q, case.k, case.v)
        ref.backward(case.do.reshape(ref.shape))
    import copy
    return {"o_equal": bool(torch.equal(full, ref.detach())), "shape": list(out.shape),
            "dsink_rel": _rel(modules[1].softmax_offset.grad, modules[0].softmax_offset.grad),
            "copy_shares_group": copy.deepcopy(modules[1])._context_parallel.group is group}


def _run_fused_views(rank, world, group, comm_type):
    """q, k, v as a model hands them over: strided views of one fused projection's output [B, S/cp, 3, H, D]
    (bshd, MHA), the gradient flowing into that one tensor; against the same call on contiguous copies."""
    from mxattn import context_parallel_attention
    from mxattn.context_parallel import shard_sequence
    case = _inputs(world, hq=4, hkv=4, qkv_format="bshd", blocks=2)
    shards = [shard_sequence(x, world, rank, 1) for x in (case.q, case.k, case.v)]
    do = shard_sequence(case.do, world, rank, 1)
    kw = dict(cp_group=group, cp_global_ranks=dist.get_process_group_ranks(group), cp_comm_type=comm_type,
              backend="reference", qkv_format="bshd", attn_mask_type="causal")
    fused = torch.stack(shards, dim=2).requires_grad_()  # [B, S/cp, 3, H, D]
    o = context_parallel_attention(fused[:, :, 0], fused[:, :, 1], fused[:, :, 2], **kw)
    o.backward(do)
    leaves = [x.clone().requires_grad_() for x in shards]
    want = context_parallel_attention(*leaves, **kw)
    want.backward(do)
    return {"views": not fused[:, :, 0].is_contiguous(), "o_equal": bool(torch.equal(o, want)),
            "grads_equal": bool(torch.equal(fused.grad, torch.stack([x.grad for x in leaves], dim=2)))}


def _run_kept(rank, world, group, comm_type):
    """What the context-parallel forward keeps for the backward (every tensor autograd saves, by storage): its
    bytes, and whether any is an FP8 copy, against the local shards' and O's bytes."""
    from mxattn import context_parallel_attention
    from mxattn.context_parallel import shard_sequence
    case = _inputs(world, hq=4, hkv=2, qkv_format="bshd", blocks=2)
    ins = [shard_sequence(x, world, rank, 1).requires_grad_() for x in (case.q, case.k, case.v)]
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), str(t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = context_parallel_attention(*ins, cp_group=group, cp_global_ranks=dist.get_process_group_ranks(group),
                                       cp_comm_type=comm_type, backend="reference", qkv_format="bshd",
                                       attn_mask_type="causal")
    o.float().sum().backward()  # (the backward still runs on what was kept)
    local = sum(x.numel() * x.element_size() for x in (*ins, o))
    return {"bytes": sum(n for n, _ in kept.values()), "local": local,
            "fp8": sorted({d for _, d in kept.values() if "float8" in d})}


def _run_one_width(rank, world, group, comm_type):
    """MLA (V 32 wide beside Q's 64) on a backend of one head dim (a stand-in computing the reference backend's
    arithmetic): each partial call gets V zero-padded, and O and every gradient are the reference backend's."""
    from one_width_backend import one_width_triton
    case = _inputs(world, hq=4, hkv=2, qkv_format="bshd", blocks=2, dv=32)
    options = dict(attn_mask_type="causal", softmax_type="learnable")
    want = _sharded(case, rank, world, group, comm_type, **options)
    with pytest.MonkeyPatch.context() as patch:
        _, widths = one_width_triton(patch)
        got = _sharded(case, rank, world, group, comm_type, backend="triton", **options)
    if rank == 0:
        return dict(_compare(got, want), widths=sorted(set(widths)))


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD
    jobs = [(name, lambda c=c, s=s: _run_exact(rank, world, group, c, s)) for name, c, s in EXACT[world]]
    jobs += [(name, lambda s=s: _run_ring(rank, world, group, s)) for name, s in RING[world]]
    jobs += [(name, lambda n=name: _run_error(rank, world, group, n)) for name, _, _ in ERRORS[world]]
    if world == 2:
        jobs += [("one-rank-groups", lambda: _run_one_rank_groups(rank, world)),
                 ("module", lambda: _run_module(rank, world, group, "bshd")),
                 ("module-thd", lambda: _run_module(rank, world, group, "thd"))]
    jobs += [(f"kept-{c}", lambda c=c: _run_kept(rank, world, group, c)) for c in ("p2p", "all_gather")]
    if world == 2:
        jobs += [(f"one-width-{c}", lambda c=c: _run_one_width(rank, world, group, c))
                 for c in ("p2p", "all_gather", "a2a")]
        jobs += [(f"fused-views-{c}", lambda c=c: _run_fused_views(rank, world, group, c))
                 for c in ("p2p", "all_gather", "a2a")]
    run_jobs(rank, jobs, out)


def _case(world, name, tmp_path_factory):
    return record_of(_worker, world, name, tmp_path_factory, 240)


@pytest.mark.parametrize("world,name", [(w, n) for w in EXACT for n, _, _ in EXACT[w]])
def test_a2a_and_all_gather_match_the_single_device_call(world, name, tmp_path_factory):
    record = _case(world, name, tmp_path_factory)
    exact = NAMES if name.startswith("a2a") else ("o", "dq")
    assert record["padding_zero"], record  # (rows past a length: O = 0, zero gradients)
    for n in NAMES:
        if n not in record:
            continue
        if n in exact:
            assert record[n]["equal"], (n, record[n])
        else:  # the ranks' float32 partial sums, rounded once
            assert record[n]["rel"] <= TOL, (n, record[n])
    assert ("dsink" in record) == ("learnable" in name)


@pytest.mark.parametrize("world,name", [(w, n) for w in RING for n, _ in RING[w]])
def test_p2p_is_the_ring_definition_and_within_the_recipes_error_of_the_single_call(world, name, tmp_path_factory):
    record = _case(world, name, tmp_path_factory)
    assert record["padding_zero"], record
    for n, cmp in record["definition"].items():
        assert cmp["rel"] <= TOL, ("vs the ring's definition", n, cmp)
    for n, cmp in record["single"].items():
        # P's E4M3 rounding follows each partial call's running maximum: the ring departs from the single call,
        # by less than MXFP8 departs from exact attention
        assert cmp["rel"] <= record["mxfp8_error"][n], ("vs the single call", n, cmp, record["mxfp8_error"][n])
    assert record["single"]["o"]["rel"] > 0  # (a ring that matched bit for bit would make the bound moot)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_inputs_as_views_of_a_fused_qkv_projection(comm_type, tmp_path_factory):
    record = _case(2, f"fused-views-{comm_type}", tmp_path_factory)
    assert record == {"views": True, "o_equal": True, "grads_equal": True, "seconds": record["seconds"]}, record


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_mla_on_a_backend_of_one_head_dim_pads_v_and_gives_the_reference_numbers(comm_type, tmp_path_factory):
    record = _case(2, f"one-width-{comm_type}", tmp_path_factory)
    assert record["widths"] == [64], record  # (every call the stand-in ran got V as wide as Q)
    assert all(record[n]["equal"] for n in NAMES), record


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_the_forward_keeps_the_local_shards_not_the_sequences_fp8_copies(world, comm_type, tmp_path_factory):
    # the backward passes K/V around again and remakes each step's copies: what waits for it is the rank's own
    # q, k, v, O and log-sum-exp, whatever the group's size
    record = _case(world, f"kept-{comm_type}", tmp_path_factory)
    assert record["fp8"] == [], record
    assert record["bytes"] <= 1.5 * record["local"], record


@pytest.mark.parametrize("world,name,kind,words", [(w, *e) for w in ERRORS for e in ERRORS[w]])
def test_bad_arguments_raise_the_same_clear_error_on_every_rank(world, name, kind, words, tmp_path_factory):
    errors = _case(world, name, tmp_path_factory)["errors"]
    assert all(tuple(e) == tuple(errors[0]) for e in errors), errors
    assert errors[0][0] == kind, errors[0]
    for word in words:
        assert word in errors[0][1], (word, errors[0][1])


def test_a_group_of_one_rank_is_the_plain_call(tmp_path_factory):
    record = _case(2, "one-rank-groups", tmp_path_factory)
    assert all(record[n]["equal"] for n in NAMES) and record["module_path_unchanged"], record
    assert all(record["thd"][n]["equal"] for n in NAMES), record["thd"]


@pytest.mark.parametrize("qkv_format,shape", [("bshd", [B, 2 * 64, 4 * D]), ("thd", [(128 + 128 + 256) // 2, 4 * D])])
def test_the_module_runs_context_parallel_after_set_context_parallel_group(qkv_format, shape, tmp_path_factory):
    record = _case(2, "module" if qkv_format == "bshd" else "module-thd", tmp_path_factory)
    assert record["o_equal"] and record["shape"] == shape, record
    assert record["dsink_rel"] <= TOL, record
    assert record["copy_shares_group"], record  # (an EMA copy of the module: process groups do not copy)


# --------------------------------------------------------------------------- NCCL on two or more GPUs


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _on(case, device):
    """The case with its tensors (inputs, sink, length offsets) on `device`."""
    moved = [x.to(device) for x in (case.q, case.k, case.v, case.do, case.sink)]
    return case._replace(q=moved[0], k=moved[1], v=moved[2], do=moved[3], sink=moved[4],
                         lengths={n: t.to(device) for n, t in case.lengths.items()})


#: (name, cp_comm_type, inputs and options) run over NCCL on min(GPUs, 4) ranks with the triton backend; the KV
#: heads (4) divide over 2 and 4 ranks, as a2a needs
ON_GPUS = [
    ("a2a-causal-gqa-learnable", "a2a", dict(blocks=4, hq=8, hkv=4, qkv_format="bshd", attn_mask_type="causal",
                                             softmax_type="learnable")),
    ("a2a-thd-gqa", "a2a", dict(qkv_format="thd", lengths=(300, 37, 500), hq=8, hkv=4,
                                attn_mask_type="padding_causal")),
    ("all_gather-causal-gqa-learnable", "all_gather", dict(blocks=4, hq=8, hkv=4, qkv_format="bshd",
                                                           attn_mask_type="causal", softmax_type="learnable")),
    ("all_gather-thd-gqa", "all_gather", dict(qkv_format="thd", lengths=(300, 37, 500), hq=8, hkv=4,
                                              attn_mask_type="padding_causal")),
    ("p2p-causal-gqa-learnable", "p2p", dict(blocks=4, hq=8, hkv=4, qkv_format="bshd", attn_mask_type="causal",
                                             softmax_type="learnable")),
    ("p2p-nomask-sbhd-batch2", "p2p", dict(blocks=2, hq=8, hkv=4, qkv_format="sbhd", batch=2,
                                           attn_mask_type="no_mask")),
    ("p2p-thd-gqa", "p2p", dict(qkv_format="thd", lengths=(300, 37, 500), hq=8, hkv=4,
                                attn_mask_type="padding_causal")),
]


def _run_on_device(rank, world, group, comm_type, spec, device, backend):
    """One ON_GPUS case on this rank's device: the context-parallel call unsharded against `backend`'s single
    call on the whole batch (rank 0), and for p2p how far that single call is from exact attention."""
    data, options = _split(spec)
    case = _on(_inputs(world, **data), device)
    got = _sharded(case, rank, world, group, comm_type, backend=backend, **options)
    if rank != 0:
        return None
    single = _single(case, backend=backend, **options)
    record = dict(_compare(got, single), padding_zero=_padding_is_zero(got, case))
    if comm_type == "p2p":
        kind = options.get("softmax_type", "vanilla")
        logits = {"learnable": case.sink, "off-by-one": torch.zeros_like(case.sink)}.get(kind)
        causal = options["attn_mask_type"] in ("causal", "padding_causal")
        exact = _exact(case, logits, causal)
        record["mxfp8_error"] = {n: _rel(s, e) for n, s, e in zip(NAMES, single, exact) if s is not None}
    return record


def _nccl_worker(rank: int, world: int, init_file: str, out: str) -> None:
    warnings.simplefilter("ignore")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=device)
    group = dist.group.WORLD
    run_jobs(rank, [(name, lambda c=c, s=s: _run_on_device(rank, world, group, c, s, device, "triton"))
                    for name, c, s in ON_GPUS], out)


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs (context parallelism over NCCL)")
@pytest.mark.parametrize("name,comm_type", [(n, c) for n, c, _ in ON_GPUS])
def test_context_parallel_over_nccl_on_gpus_matches_the_single_gpu_call(name, comm_type, tmp_path_factory):
    record = record_of(_nccl_worker, min(_gpus(), 4), name, tmp_path_factory, 600)
    assert record["padding_zero"], record
    for n in NAMES:
        if n not in record:
            continue
        if comm_type == "a2a" or (comm_type == "all_gather" and n in ("o", "dq")):
            assert record[n]["equal"], (n, record[n])
        elif comm_type == "all_gather":  # the ranks' float32 partial sums, rounded once
            assert record[n]["rel"] <= TOL, (n, record[n])
        else:  # p2p: the partial calls round P against their own running maxima (see the CPU cases above)
            assert record[n]["rel"] <= record["mxfp8_error"][n], (n, record[n], record["mxfp8_error"][n])
    assert ("dsink" in record) == ("learnable" in name)
