"""Variable lengths through the public API (reference backend, CPU): packed thd and padded batches, the
per-sequence semantics, NaN in padding, empty sequences, argument errors, the module and torch.compile."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import mxattn
from mxattn.seqinfo import cu_seqlens_from_padding_mask

warnings.filterwarnings("ignore", message="mxattn: backend='auto'")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _packed(lengths_q, lengths_kv, hq=4, hkv=2, d=32, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_kv)
    q = torch.randn(tq, hq, d, generator=gen).to(dtype)
    k = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    v = torch.randn(tk, hkv, d, generator=gen).to(dtype)
    do = torch.randn(tq, hq, d, generator=gen).to(dtype)
    return q, k, v, do


def _run(q, k, v, do, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = mxattn.mxfp8_attention(*leaves, backend="reference", **kw)
    o.backward(do)
    return [o.detach()] + [leaf.grad for leaf in leaves]


MASKS = ["padding", "padding_causal", "padding_causal_bottom_right"]


@pytest.mark.parametrize("mask", MASKS)
def test_thd_equals_per_sequence_dense_calls(mask):
    lq, lk = [5, 0, 70, 33, 1], [9, 4, 70, 0, 40]
    q, k, v, do = _packed(lq, lk)
    cq, ck = _cu(lq), _cu(lk)
    out = _run(q, k, v, do, qkv_format="thd", attn_mask_type=mask, cu_seqlens_q=cq, cu_seqlens_kv=ck)
    dense_mask = {"padding": "no_mask", "padding_causal": "causal",
                  "padding_causal_bottom_right": "causal_bottom_right"}[mask]
    for b in range(len(lq)):
        sq, sk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if lq[b] == 0:
            continue
        if lk[b] == 0:  # no key at all: O = 0, zero gradients, no NaN
            assert torch.equal(out[0][sq], torch.zeros_like(out[0][sq]))
            assert torch.equal(out[1][sq], torch.zeros_like(out[1][sq]))
            continue
        ref = _run(q[sq][None], k[sk][None], v[sk][None], do[sq][None], attn_mask_type=dense_mask)
        for got, want, rows in zip(out, ref, (sq, sk, sk, sk)):
            if got.shape[0] == q.shape[0]:
                rows = sq
            assert torch.equal(got[rows], want[0]), (b, mask)
    for t in out:
        assert not t.isnan().any()


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
def test_padded_equals_packed_and_nan_in_padding_leaks_nowhere(fmt):
    lq = [7, 40, 33]
    q, k, v, do = _packed(lq, lq, seed=1)
    cu = _cu(lq)
    packed = _run(q, k, v, do, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu)
    b, s = len(lq), max(lq) + 5

    def pad(x):
        out = torch.full((b, s) + tuple(x.shape[1:]), float("nan"), dtype=x.dtype)
        for i in range(b):
            out[i, :lq[i]] = x[int(cu[i]):int(cu[i + 1])]
        return out

    def unpad(x):
        return torch.cat([x[i, :lq[i]] for i in range(b)])

    to_fmt = {"bshd": lambda x: x, "sbhd": lambda x: x.transpose(0, 1), "bhsd": lambda x: x.transpose(1, 2)}[fmt]
    from_fmt = to_fmt
    dpad = torch.nan_to_num(pad(do))  # autograd sends zeros to the padding rows
    got = _run(*(to_fmt(pad(t)) for t in (q, k, v)), to_fmt(dpad), qkv_format=fmt,
               attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for g, want in zip(got, packed):
        g = from_fmt(g)
        assert not g.isnan().any()
        assert torch.equal(unpad(g), want)
        for i in range(b):
            assert torch.equal(g[i, lq[i]:], torch.zeros_like(g[i, lq[i]:]))


def test_varlen_against_fp64_attention_with_block_diagonal_mask():
    lq = [17, 64, 3]
    q, k, v, do = _packed(lq, lq, hq=4, hkv=4, seed=2)
    cu = _cu(lq)
    o, dq, dk, dv = _run(q, k, v, do, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu)
    seg = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
    pos = torch.arange(sum(lq)) - cu[:-1].long()[seg]
    keep = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    leaves = [t.double().transpose(0, 1).requires_grad_() for t in (q, k, v)]
    o64 = F.scaled_dot_product_attention(*leaves, attn_mask=keep)
    o64.backward(do.double().transpose(0, 1))
    want = [o64.detach()] + [leaf.grad for leaf in leaves]
    for got, ref in zip((o, dq, dk, dv), want):
        ref = ref.transpose(0, 1)
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < 0.1, err  # MXFP8 level (5-7e-2 on dense inputs); a wrong mask gives O(1)


def test_fp32_block_drop_in_keeps_fp32():
    """A pretrained fp32 block with its attention swapped: output and grads stay fp32 (torch SDPA's rule)."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, dim=64, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.attn = mxattn.DotProductAttention(heads, dim // heads, attn_mask_type="causal",
                                                   backend="reference")
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
            return self.proj(self.attn(q, k, v))

    block = Block()
    x = torch.randn(2, 40, 64, requires_grad=True)
    y = block(x)
    assert y.dtype == torch.float32
    y.square().mean().backward()
    assert x.grad.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in block.parameters())
    assert torch.isfinite(x.grad).all()


def test_module_thd_and_attention_mask():
    attn = mxattn.DotProductAttention(4, 32, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="padding_causal",
                                      backend="reference")
    lq = [6, 30]
    q, k, v, do = _packed(lq, lq, seed=3)
    cu = _cu(lq)
    o_thd = attn(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert o_thd.shape == (36, 4 * 32)
    b, s = 2, 30
    qp, kp, vp = (torch.zeros((b, s) + tuple(t.shape[1:]), dtype=t.dtype) for t in (q, k, v))
    for i in range(b):
        for dst, src in zip((qp, kp, vp), (q, k, v)):
            dst[i, :lq[i]] = src[int(cu[i]):int(cu[i + 1])]
    masked_out = torch.arange(s)[None, :] >= torch.tensor(lq)[:, None]  # TE: True = masked out
    o_pad = attn(qp, kp, vp, attention_mask=masked_out[:, None, None, :])
    assert o_pad.shape == (b, s, 128)
    assert torch.equal(torch.cat([o_pad[i, :lq[i]] for i in range(b)]), o_thd)
    with pytest.raises(ValueError, match="not right padding"):
        attn(qp, kp, vp, attention_mask=masked_out.flip(1)[:, None, None, :])


def test_cu_seqlens_from_padding_mask():
    keep = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    assert cu_seqlens_from_padding_mask(keep).tolist() == [0, 2, 5, 5]
    with pytest.raises(ValueError, match="row 0 is not right padding"):
        cu_seqlens_from_padding_mask(torch.tensor([[0, 1]], dtype=torch.bool))


def test_torch_compile_fullgraph_thd():
    lq = [5, 40]
    q, k, v, do = _packed(lq, lq, seed=4)
    cu = _cu(lq)
    fn = torch.compile(lambda q, k, v: mxattn.mxfp8_attention(
        q, k, v, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        max_seqlen_q=40, max_seqlen_kv=40, backend="reference"), fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves)
    o.backward(do)
    eager = _run(q, k, v, do, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu)
    for got, want in zip([o.detach()] + [leaf.grad for leaf in leaves], eager):
        assert torch.equal(got, want)


def _bad(**over):
    q, k, v, _ = _packed([4, 8], [4, 8])
    kw = dict(qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=_cu([4, 8]), cu_seqlens_kv=_cu([4, 8]),
              backend="reference")
    kw.update(over)
    return mxattn.mxfp8_attention(q, k, v, **kw)


@pytest.mark.parametrize("over,exc,match", [
    (dict(cu_seqlens_q=None), ValueError, "needs cu_seqlens_q"),
    (dict(cu_seqlens_q=_cu([4, 8]).long()), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    (dict(cu_seqlens_q=_cu([4, 8])[None]), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=torch.tensor([0, 8, 4], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([1, 4, 12], dtype=torch.int32)), ValueError, "must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 11], dtype=torch.int32)), ValueError, r"cu_seqlens_q\[-1\] must equal"),
    (dict(cu_seqlens_kv=torch.tensor([0, 12], dtype=torch.int32)), ValueError, "different batch sizes"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 12], dtype=torch.int32, device="meta")), ValueError, "device"),
    (dict(max_seqlen_q=3), ValueError, "smaller than the longest"),
    (dict(cu_seqlens_q="0,4"), TypeError, "cu_seqlens_q must be a torch.Tensor"),
])
def test_varlen_argument_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        _bad(**over)


def test_padded_length_errors():
    q = torch.randn(2, 8, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="batch size 2"):
        mxattn.mxfp8_attention(q, q, q, attn_mask_type="padding", cu_seqlens_q=_cu([8]), backend="reference")
    with pytest.raises(ValueError, match="exceeds the padded length 8"):
        mxattn.mxfp8_attention(q, q, q, attn_mask_type="padding", cu_seqlens_q=_cu([9, 1]), backend="reference")
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        mxattn.mxfp8_attention(q, q, q, attn_mask_type="padding_causal", backend="reference")


def test_auto_routes_around_a_backend_that_refuses_the_call(monkeypatch):
    """`supports` sees the whole call: a backend that is available but refuses this problem is skipped by auto
    (one warning) and an explicit request fails before any work."""
    from mxattn import backends
    from mxattn.backends.base import Problem
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.mask import MaskSpec
    monkeypatch.setattr(TritonBackend, "availability", classmethod(lambda cls, device: (True, "pretend")))
    monkeypatch.setattr(TritonBackend, "supports", classmethod(
        lambda cls, p: (False, "refuses head_dim 48") if p.head_dim == 48 else (True, "ok")))
    base = dict(device=torch.device("cpu"), dtype=torch.float32, batch=1, heads_q=2, heads_kv=2, seqlen_q=8,
                seqlen_kv=8, mask=MaskSpec())
    backends._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.pick_backend("auto", Problem(head_dim=64, **base)) == "triton"
        assert backends.pick_backend("auto", Problem(head_dim=48, **base)) == "reference"
    assert any("triton: refuses head_dim 48" in str(w.message) for w in caught)
    with pytest.raises(mxattn.MXFP8NotSupportedError, match="refuses head_dim 48"):
        backends.pick_backend("triton", Problem(head_dim=48, **base))


def test_demo_names_backend_in_one_line(capsys):
    from mxattn import demo
    assert demo.main(["--seq", "64", "--heads", "2", "--head-dim", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mxattn demo: running") and lines[0].endswith("...")   # before the work starts
    assert lines[2].startswith("cpu: reference backend (no CUDA device)") and len(lines[2]) < 120
    assert "python -m mxattn info" in lines[2]


def test_backend_choice_is_cached_per_problem(monkeypatch):
    """The support checks read library versions and package metadata: one call per distinct problem."""
    from mxattn import backends
    from mxattn.backends.reference import ReferenceBackend
    calls = []
    original = ReferenceBackend.supports.__func__
    monkeypatch.setattr(ReferenceBackend, "supports",
                        classmethod(lambda cls, p: calls.append(p) or original(cls, p)))
    q = torch.randn(1, 40, 2, 32, dtype=torch.bfloat16)
    for _ in range(3):
        mxattn.mxfp8_attention(q, q, q, backend="reference")
    mxattn.mxfp8_attention(q, q, q, backend="reference", attn_mask_type="causal")
    assert len(calls) == 2


def test_lengths_are_read_once_per_tensor_and_rechecked_when_changed(monkeypatch):
    """Every layer of a model passes the same cu_seqlens: their values are read on the host (a device sync on a
    GPU) once; an in-place change or a new tensor is checked again, so bad values still raise."""
    from mxattn import seqinfo
    reads = []
    real = seqinfo._check_values
    monkeypatch.setattr(seqinfo, "_check_values", lambda *a: (reads.append(a[0]), real(*a))[1])
    q = torch.randn(2, 16, 2, 32)
    cu = torch.tensor([0, 10, 26], dtype=torch.int32)
    kw = dict(attn_mask_type="padding_causal", cu_seqlens_q=cu, backend="reference")
    first = mxattn.mxfp8_attention(q, q, q, **kw)
    for _ in range(3):
        assert torch.equal(mxattn.mxfp8_attention(q, q, q, **kw), first)
    assert reads == ["cu_seqlens_q", "cu_seqlens_kv"]
    cu[2] = 40                                                  # in place: past the padded length
    with pytest.raises(ValueError, match="exceeds the padded length"):
        mxattn.mxfp8_attention(q, q, q, **kw)
    with pytest.raises(ValueError, match="must start at 0"):
        mxattn.mxfp8_attention(q, q, q, **dict(kw, cu_seqlens_q=torch.tensor([1, 10, 26], dtype=torch.int32)))


def test_module_takes_padded_lengths_equal_to_the_lengths_and_refuses_others():
    """Outside context parallelism the module's cu_seqlens_q_padded must hold cu_seqlens_q's values (a copy is
    fine, read once per pair of tensors); padding between sequences raises, on every call."""
    layer = mxattn.DotProductAttention(2, 32, qkv_format="thd", attn_mask_type="padding_causal", backend="reference")
    q, k, v = (torch.randn(96, 2, 32) for _ in range(3))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    want = layer(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for _ in range(2):
        got = layer(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu.clone(),
                    cu_seqlens_kv_padded=cu.clone())
        assert torch.equal(got, want)
    gapped = torch.tensor([0, 48, 96], dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(ValueError, match="cu_seqlens_q_padded must equal cu_seqlens_q"):
            layer(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=gapped)
