"""Variable-length API of the reference emulator (ref.sdpa_fwd_varlen / ref.sdpa_bwd_varlen); CPU, small shapes.

Each sequence must be computed exactly as the dense functions compute it alone, so most checks are bit for
bit against per-sequence dense calls; the FP64 identity mode is checked against autograd with an explicit
block-diagonal mask (an oracle that shares no code with ref).
"""

import math
import sys

import pytest
from repo_paths import ROOT
import torch

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ref import sdpa_bwd, sdpa_bwd_varlen, sdpa_fwd, sdpa_fwd_varlen  # noqa: E402

# lengths cover: empty q with keys, q with no keys, < 32, just past 32, > 128 (two KV blocks), len_kv < len_q
LENS_Q = [0, 1, 31, 33, 70, 128, 129]
LENS_KV = [5, 0, 40, 33, 128, 70, 129]
HQ, HKV = 4, 2

MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "causal_br": dict(causal=True, diagonal_alignment="bottom_right"),
    "window": dict(window=(20, None)),
    "window_br": dict(window=(16, 3), diagonal_alignment="bottom_right"),
}


def _cu(lens, dtype=torch.int32):
    return torch.tensor([0] + lens, dtype=dtype).cumsum(0).to(dtype)


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _thd_inputs(lens_q, lens_kv, d=64, dtype=torch.bfloat16, seed=0, hq=HQ, hkv=HKV):
    g = torch.Generator().manual_seed(seed)
    tq, tkv = sum(lens_q), sum(lens_kv)
    q, do = (torch.randn(tq, hq, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(tkv, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, do


def _seq(x, cu, b):
    """Sequence b of a thd tensor as a contiguous dense [1, H, len, D] tensor (or stats [T, H] -> [1, H, len, 1])."""
    rows = x[cu[b]:cu[b + 1]]
    return (rows.t()[None, :, :, None] if x.dim() == 2 else rows.transpose(0, 1)[None]).contiguous()


# --------------------------------------------------------------------------- thd == per-sequence dense


@pytest.mark.parametrize("mask", list(MASKS))
def test_thd_equals_per_sequence_dense_bit_for_bit(mask):
    opts = MASKS[mask]
    fwd_extra = dict(p_scale=16.0, rescale_threshold=4.0) if mask == "causal_br" else {}
    q, k, v, do = _thd_inputs(LENS_Q, LENS_KV, seed=len(mask))
    cu_q, cu_kv = _cu(LENS_Q, torch.int32), _cu(LENS_KV, torch.int64)
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, **opts, **fwd_extra)
    assert o.shape == (q.shape[0], HQ, 64) and o.dtype == torch.bfloat16
    assert st.shape == (q.shape[0], HQ) and st.dtype == torch.float32
    stats_choices = (st, None) if mask == "causal" else (st,)
    grads = {id(s): sdpa_bwd_varlen(q, k, v, o, do, s, cu_q, cu_kv, **opts) for s in stats_choices}
    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    for b, (nq, nkv) in enumerate(zip(LENS_Q, LENS_KV)):
        rows_q, rows_kv = slice(cq[b], cq[b + 1]), slice(ckv[b], ckv[b + 1])
        if nq == 0 or nkv == 0:
            assert (o[rows_q] == 0).all() and torch.isneginf(st[rows_q]).all()
            for dq, dk, dv in grads.values():
                assert (dq[rows_q] == 0).all() and (dk[rows_kv] == 0).all() and (dv[rows_kv] == 0).all()
            continue
        qb, kb, vb, dob = _seq(q, cq, b), _seq(k, ckv, b), _seq(v, ckv, b), _seq(do, cq, b)
        o_b, st_b = sdpa_fwd(qb, kb, vb, **opts, **fwd_extra)
        assert _same_bits(_seq(o, cq, b), o_b), b
        assert _same_bits(_seq(st, cq, b), st_b), b
        for s in stats_choices:
            want = sdpa_bwd(qb, kb, vb, o_b, dob, None if s is None else st_b, **opts)
            got = grads[id(s)]
            for name, g_all, w, cu in (("dq", got[0], want[0], cq), ("dk", got[1], want[1], ckv),
                                       ("dv", got[2], want[2], ckv)):
                assert _same_bits(_seq(g_all, cu, b), w), (b, name, s is None)


def test_thd_mqa_head_dim_32_and_float16_output():
    lens_q, lens_kv = [33, 64, 7], [31, 64, 96]
    q, k, v, do = _thd_inputs(lens_q, lens_kv, d=32, dtype=torch.float16, seed=3, hq=3, hkv=1)
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, causal=True, out_dtype=torch.float16)
    dq, dk, dv = sdpa_bwd_varlen(q, k, v, o, do, st, cu_q, cu_kv, causal=True, out_dtype=torch.float16)
    assert o.dtype == dq.dtype == dk.dtype == torch.float16 and dk.shape == k.shape
    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    for b in range(3):
        args = (_seq(q, cq, b), _seq(k, ckv, b), _seq(v, ckv, b))
        o_b, st_b = sdpa_fwd(*args, causal=True, out_dtype=torch.float16)
        assert _same_bits(_seq(o, cq, b), o_b) and _same_bits(_seq(st, cq, b), st_b)
        want = sdpa_bwd(*args, o_b, _seq(do, cq, b), st_b, causal=True, out_dtype=torch.float16)
        for got, w, cu in ((dq, want[0], cq), (dk, want[1], ckv), (dv, want[2], ckv)):
            assert _same_bits(_seq(got, cu, b), w)


def test_neighbours_do_not_matter():
    """A sequence's result is the same whatever the other sequences of the pack hold (blocks restart per sequence)."""
    lens_q, lens_kv = [31, 45], [33, 50]
    q, k, v, do = _thd_inputs(lens_q, lens_kv, seed=4)
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv)
    grads = sdpa_bwd_varlen(q, k, v, o, do, st, cu_q, cu_kv)
    q2, k2, v2, do2 = (t.clone() for t in (q, k, v, do))
    for t, n in ((q2, 31), (k2, 33), (v2, 33), (do2, 31)):
        t[:n] *= 1000.0  # the first sequence's amax now dominates any block it might share
    o2, st2 = sdpa_fwd_varlen(q2, k2, v2, cu_q, cu_kv)
    grads2 = sdpa_bwd_varlen(q2, k2, v2, o2, do2, st2, cu_q, cu_kv)
    assert _same_bits(o2[31:], o[31:]) and _same_bits(st2[31:], st[31:])
    assert _same_bits(grads2[0][31:], grads[0][31:])
    assert _same_bits(grads2[1][33:], grads[1][33:]) and _same_bits(grads2[2][33:], grads[2][33:])


# --------------------------------------------------------------------------- padded layout


def _pad(x, cu, s_max, fill):
    """thd [T, H, *] -> padded [B, H, s_max, *] (stats [T, H] -> [B, H, s_max, 1]) with ``fill`` in padding rows."""
    batch = len(cu) - 1
    tail = (1,) if x.dim() == 2 else x.shape[2:]
    out = torch.full((batch, x.shape[1], s_max, *tail), fill, dtype=x.dtype)
    for b in range(batch):
        out[b, :, :cu[b + 1] - cu[b]] = _seq(x, cu, b)[0]
    return out


@pytest.mark.parametrize("mask", ["none", "causal_br", "window"])
def test_padded_equals_thd_and_padding_never_leaks(mask):
    opts = MASKS[mask]
    q, k, v, do = _thd_inputs(LENS_Q, LENS_KV, seed=7)
    cu_q, cu_kv = _cu(LENS_Q), _cu(LENS_KV)
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, **opts)
    dq, dk, dv = sdpa_bwd_varlen(q, k, v, o, do, st, cu_q, cu_kv, **opts)

    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    sq_max, skv_max = 140, 150
    nan = float("nan")
    qp, dop, op = (_pad(t, cq, sq_max, nan) for t in (q, do, o))
    kp, vp = (_pad(t, ckv, skv_max, nan) for t in (k, v))
    o_p, st_p = sdpa_fwd_varlen(qp, kp, vp, cu_q, cu_kv, layout="bhsd_padded", **opts)
    assert o_p.shape == (7, HQ, sq_max, 64) and st_p.shape == (7, HQ, sq_max, 1)
    grads_p = sdpa_bwd_varlen(qp, kp, vp, op, dop, _pad(st, cq, sq_max, nan), cu_q, cu_kv,
                              layout="bhsd_padded", **opts)

    # valid rows: the same bits as thd; padding rows: exactly 0 (stats -inf); no NaN anywhere
    assert _same_bits(o_p, _pad(o, cq, sq_max, 0.0)) and not torch.isnan(o_p).any()
    assert _same_bits(st_p, _pad(st, cq, sq_max, float("-inf"))) and not torch.isnan(st_p).any()
    for got, want, cu, s_max in zip(grads_p, (dq, dk, dv), (cq, ckv, ckv), (sq_max, skv_max, skv_max)):
        assert _same_bits(got, _pad(want, cu, s_max, 0.0)) and not torch.isnan(got).any()


def test_padded_without_stats_and_exact_fit():
    """stats=None recomputes P; sequences may fill S_max exactly."""
    lens_q, lens_kv = [64, 10], [40, 64]
    q, k, v, do = _thd_inputs(lens_q, lens_kv, seed=8)
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    o, _ = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, causal=True)
    want = sdpa_bwd_varlen(q, k, v, o, do, None, cu_q, cu_kv, causal=True)
    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    got = sdpa_bwd_varlen(_pad(q, cq, 64, 1e30), _pad(k, ckv, 64, -1e30), _pad(v, ckv, 64, 1e30),
                          _pad(o, cq, 64, 7.0), _pad(do, cq, 64, 1e30), None, cu_q, cu_kv,
                          layout="bhsd_padded", causal=True)
    for g, w, cu in zip(got, want, (cq, ckv, ckv)):
        assert _same_bits(g, _pad(w, cu, 64, 0.0))


# --------------------------------------------------------------------------- empty sequences


@pytest.mark.parametrize("layout", ["thd", "bhsd_padded"])
def test_empty_kv_sequence_gives_zero_output_and_grads(layout):
    lens_q, lens_kv = [5, 40, 0], [0, 37, 9]
    q, k, v, do = _thd_inputs(lens_q, lens_kv, seed=9)
    cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
    cq, ckv = cu_q.tolist(), cu_kv.tolist()
    if layout == "bhsd_padded":
        q, do = _pad(q, cq, 48, float("nan")), _pad(do, cq, 48, float("nan"))
        k, v = _pad(k, ckv, 40, float("nan")), _pad(v, ckv, 40, float("nan"))
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, layout=layout)
    dq, dk, dv = sdpa_bwd_varlen(q, k, v, o, do, st, cu_q, cu_kv, layout=layout)
    assert not any(torch.isnan(t).any() for t in (o, st, dq, dk, dv))
    if layout == "thd":
        first_q, last_kv = slice(0, 5), slice(37, 46)
        assert (o[first_q] == 0).all() and torch.isneginf(st[first_q]).all() and (dq[first_q] == 0).all()
        assert (dk[last_kv] == 0).all() and (dv[last_kv] == 0).all()  # keys of a sequence with no queries
        assert (o[5:] != 0).any() and torch.isfinite(st[5:]).all()
    else:
        assert (o[0] == 0).all() and torch.isneginf(st[0]).all() and (dq[0] == 0).all()
        assert (dk[2] == 0).all() and (dv[2] == 0).all()
        assert torch.isfinite(st[1, :, :40]).all() and torch.isneginf(st[1, :, 40:]).all()


def test_all_sequences_empty():
    q, k, v, do = _thd_inputs([0, 0], [3, 0], seed=10)
    cu_q, cu_kv = _cu([0, 0]), _cu([3, 0])
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv)
    assert o.shape == (0, HQ, 64) and st.shape == (0, HQ)
    dq, dk, dv = sdpa_bwd_varlen(q, k, v, o, do, st, cu_q, cu_kv)
    assert dq.shape == (0, HQ, 64) and dk.shape == (3, HKV, 64) and (dk == 0).all() and (dv == 0).all()
    q, k, v, do = _thd_inputs([4, 2], [0, 0], seed=11)
    o, st = sdpa_fwd_varlen(q, k, v, _cu([4, 2]), _cu([0, 0]))
    assert (o == 0).all() and torch.isneginf(st).all()
    dq, _, _ = sdpa_bwd_varlen(q, k, v, o, do, st, _cu([4, 2]), _cu([0, 0]))
    assert (dq == 0).all()


# --------------------------------------------------------------------------- FP64 oracle


def _block_diagonal_keep(lens_q, lens_kv, causal=False, diagonal_alignment="top_left", window=(None, None)):
    """Bool [T_q, T_kv]: query i keeps key j iff both are in sequence b and the cuDNN mask rule keeps (i, j)
    in sequence b's own coordinates (offset len_kv[b] - len_q[b] for bottom_right)."""
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q)), torch.tensor(lens_q))
    seq_kv = torch.repeat_interleave(torch.arange(len(lens_kv)), torch.tensor(lens_kv))
    start_q = torch.tensor([0] + lens_q[:-1]).cumsum(0)[seq_q]
    start_kv = torch.tensor([0] + lens_kv[:-1]).cumsum(0)[seq_kv]
    i = (torch.arange(sum(lens_q)) - start_q)[:, None]  # row inside its sequence
    j = (torch.arange(sum(lens_kv)) - start_kv)[None, :]
    keep = seq_q[:, None] == seq_kv[None, :]
    offset = 0
    if diagonal_alignment == "bottom_right":
        offset = (torch.tensor(lens_kv) - torch.tensor(lens_q))[seq_q][:, None]
    left, right = window
    if causal:
        right = 0
    if right is not None:
        keep &= j - i <= offset + right
    if left is not None:
        keep &= j - i > offset - left
    return keep


def _autograd64(q, k, v, do, keep, scale):
    """FP64 attention on [1, H, T, D] with a [T_q, T_kv] keep mask; rows keeping nothing give 0 / -inf."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    alive = keep.any(-1, keepdim=True)
    s = torch.where(keep, s, float("-inf"))
    s = torch.where(alive, s, 0.0)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.softmax(s, -1) * keep
    o = p @ v.repeat_interleave(g, 1)
    o.backward(do)
    return o.detach(), torch.where(alive, lse, float("-inf")).detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("mask", ["none", "causal_br", "window_br"])
def test_identity_mode_matches_fp64_autograd_with_block_diagonal_mask(mask):
    opts = MASKS[mask]
    q, k, v, do = _thd_inputs(LENS_Q, LENS_KV, seed=12, dtype=torch.float64)
    cu_q, cu_kv = _cu(LENS_Q), _cu(LENS_KV)
    keep = _block_diagonal_keep(LENS_Q, LENS_KV, **opts)
    as_bhsd = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = _autograd64(*(as_bhsd(t) for t in (q, k, v, do)), keep, 1 / math.sqrt(64))
    o_ref, dq_ref, dk_ref, dv_ref = (t[0].transpose(0, 1) for t in (o_ref, dq_ref, dk_ref, dv_ref))
    lse_ref = lse_ref[0, :, :, 0].t()

    ident = dict(quantize_inputs=False, out_dtype=torch.float64, **opts)
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, **ident)
    assert o.dtype == st.dtype == torch.float64
    assert (o - o_ref).abs().max() < 1e-10
    assert torch.equal(torch.isneginf(st), torch.isneginf(lse_ref)) and torch.isneginf(st).any()
    fin = torch.isfinite(lse_ref)
    assert (st[fin] - lse_ref[fin]).abs().max() < 1e-10
    for stats in (st, None):
        grads = sdpa_bwd_varlen(q, k, v, o, do, stats, cu_q, cu_kv, **ident)
        for got, want in zip(grads, (dq_ref, dk_ref, dv_ref)):
            assert not torch.isnan(got).any() and (got - want).abs().max() < 1e-10


# --------------------------------------------------------------------------- argument errors


def _err_cases():
    q, k, v, _ = _thd_inputs([3, 5], [4, 4], seed=13)
    cu_q, cu_kv = _cu([3, 5]), _cu([4, 4])
    qp, kp = torch.randn(2, HQ, 6, 64), torch.randn(2, HKV, 4, 64)
    return [
        ("not_tensor", TypeError, r"cu_seqlens_q: expected an int32/int64",
         lambda: sdpa_fwd_varlen(q, k, v, [0, 3, 8], cu_kv)),
        ("float_cu", TypeError, r"cu_seqlens_q: expected dtype int32 or int64",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q.float(), cu_kv)),
        ("2d_cu", ValueError, r"cu_seqlens_kv: expected a 1-D",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q, cu_kv[None])),
        ("short_cu", ValueError, r"cu_seqlens_q: expected a 1-D tensor \[B\+1\] with B >= 1",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q[:1], cu_kv[:1])),
        ("start", ValueError, r"cu_seqlens_q: must start at 0, got 1",
         lambda: sdpa_fwd_varlen(q, k, v, torch.tensor([1, 3, 8]), cu_kv)),
        ("decreasing", ValueError, r"cu_seqlens_kv: must be non-decreasing, got entry 2 = 8 after entry 1 = 9",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q, torch.tensor([0, 9, 8]))),
        ("last_q", ValueError, r"cu_seqlens_q: last entry 7 must equal the total length T = 8 of q",
         lambda: sdpa_fwd_varlen(q, k, v, torch.tensor([0, 3, 7]), cu_kv)),
        ("last_kv", ValueError, r"cu_seqlens_kv: last entry 9 must equal the total length T = 8 of k",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q, torch.tensor([0, 4, 9]))),
        ("batch", ValueError, r"cu_seqlens_kv: expected 3 entries",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q, torch.tensor([0, 8]))),
        ("padded_batch", ValueError, r"cu_seqlens_q: expected B\+1 = 3 entries",
         lambda: sdpa_fwd_varlen(qp, kp, kp, torch.tensor([0, 3]), torch.tensor([0, 4]), layout="bhsd_padded")),
        ("padded_len", ValueError, r"cu_seqlens_kv: sequence 1 has length 5 > S_max = 4 of k",
         lambda: sdpa_fwd_varlen(qp, kp, kp, torch.tensor([0, 3, 9]), torch.tensor([0, 4, 9]), layout="bhsd_padded")),
        ("layout", ValueError, r"layout: expected 'thd' or 'bhsd_padded'",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, layout="bshd")),
        ("ndim", ValueError, r"q: layout 'thd' expects a 3-D",
         lambda: sdpa_fwd_varlen(qp, kp, kp, cu_q, cu_kv)),
        ("heads", ValueError, r"k: number of heads 2 must divide the query heads 3",
         lambda: sdpa_fwd_varlen(q[:, :3], k, v, cu_q, cu_kv)),
        ("head_dim", ValueError, r"k: head dim 64 differs from q's head dim 32",
         lambda: sdpa_fwd_varlen(q[..., :32], k, v, cu_q, cu_kv)),
        ("v_rows", ValueError, r"v: expected the sequence and head dims of k",
         lambda: sdpa_fwd_varlen(q, k, v[:7], cu_q, cu_kv)),
        ("dtype", TypeError, r"q: expected dtype",
         lambda: sdpa_fwd_varlen(q.int(), k, v, cu_q, cu_kv)),
        ("mask_all_empty", ValueError, r"diagonal_alignment",
         lambda: sdpa_fwd_varlen(q[:0], k, v, _cu([0, 0]), cu_kv, diagonal_alignment="x")),
        ("p_scale", ValueError, r"p_scale",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, p_scale=0)),
        ("rescale", ValueError, r"rescale_threshold",
         lambda: sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, rescale_threshold=-1)),
        ("bwd_o", ValueError, r"o: expected shape \(8, 4, 64\)",
         lambda: sdpa_bwd_varlen(q, k, v, q[:7], q, None, cu_q, cu_kv)),
        ("bwd_stats", ValueError, r"stats: expected shape \(8, 4\)",
         lambda: sdpa_bwd_varlen(q, k, v, q, q, torch.zeros(8, HQ, 1), cu_q, cu_kv)),
        ("bwd_padded_stats", ValueError, r"stats: expected shape \(2, 4, 6, 1\)",
         lambda: sdpa_bwd_varlen(qp, kp, kp, qp, qp, torch.zeros(2, HQ, 6), torch.tensor([0, 3, 6]),
                                 torch.tensor([0, 4, 8]), layout="bhsd_padded")),
        ("bwd_cu", ValueError, r"cu_seqlens_kv: expected 3 entries",
         lambda: sdpa_bwd_varlen(q, k, v, q, q, None, cu_q, cu_kv[:2])),
        ("device", ValueError, r"k: expected a tensor on q's device",
         lambda: sdpa_fwd_varlen(q, k.to("meta"), v, cu_q, cu_kv)),
    ]


@pytest.mark.parametrize("case", _err_cases(), ids=lambda c: c[0])
def test_argument_errors_name_the_argument(case):
    _, exc, pattern, call = case
    with pytest.raises(exc, match=pattern):
        call()


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("layout", ["thd", "bhsd_padded"])
def test_varlen_tensors_follow_the_input_device(layout):
    """On the "meta" device any tensor made on the CPU by a missing device= makes torch raise (CPU stand-in)."""
    cu_q, cu_kv = _cu([0, 33, 70]), _cu([5, 0, 129])
    shape_q, shape_kv = ((103, HQ, 64), (134, HKV, 64)) if layout == "thd" else ((3, HQ, 80, 64), (3, HKV, 130, 64))
    q, do = (torch.empty(shape_q, device="meta") for _ in range(2))
    k, v = (torch.empty(shape_kv, device="meta") for _ in range(2))
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, layout=layout, causal=True)
    assert o.is_meta and st.is_meta
    assert all(t.is_meta for t in sdpa_bwd_varlen(q, k, v, o, do, st, cu_q, cu_kv, layout=layout, causal=True))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["thd", "bhsd_padded"])
def test_varlen_cuda_equals_cpu_bit_for_bit(layout):
    q, k, v, do = _thd_inputs(LENS_Q, LENS_KV, seed=14)
    cu_q, cu_kv = _cu(LENS_Q), _cu(LENS_KV)
    if layout == "bhsd_padded":
        cq, ckv = cu_q.tolist(), cu_kv.tolist()
        q, do = _pad(q, cq, 130, float("nan")), _pad(do, cq, 130, float("nan"))
        k, v = _pad(k, ckv, 129, float("nan")), _pad(v, ckv, 129, float("nan"))
    opts = dict(layout=layout, causal=True, diagonal_alignment="bottom_right")
    o, st = sdpa_fwd_varlen(q, k, v, cu_q, cu_kv, **opts)
    grads = sdpa_bwd_varlen(q, k, v, o, do, st, cu_q, cu_kv, **opts)
    qc, kc, vc, doc = (t.cuda() for t in (q, k, v, do))
    o_c, st_c = sdpa_fwd_varlen(qc, kc, vc, cu_q.cuda(), cu_kv.cuda(), **opts)
    grads_c = sdpa_bwd_varlen(qc, kc, vc, o_c, doc, st_c, cu_q.cuda(), cu_kv.cuda(), **opts)
    for got, want in zip((o_c, st_c, *grads_c), (o, st, *grads)):
        assert got.is_cuda and _same_bits(got.cpu(), want)
