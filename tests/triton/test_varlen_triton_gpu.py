"""Variable-length batches (padded and packed thd) in the Triton kernels, on a CUDA GPU.

Against the `reference` backend on the same inputs: saved FP8 bytes and scales bit-equal, O within one ulp
(>= 99.9% of elements), stats to 1e-4, gradients (from the reference backward on the identical saved bytes,
O and stats) to a relative RMS of 2e-4; padding rows zero, NaN in padding rows reaching nothing. A packed
batch equals per-sequence dense triton calls bit for bit; the backward is deterministic.
"""

import math

import pytest
import torch

import mxattn
from mxattn.backends.base import AttentionParams
from mxattn.formats import quantize_mxfp8
from mxattn.mask import MaskSpec
from triton_helpers import as_bytes, same_values, triton_backend
from mxattn.seqinfo import SeqInfo

pytestmark = pytest.mark.gpu

O_MAX_ABS = 1e-2
O_ULP_FRACTION = 0.999
STATS_ABS = 1e-4
GRAD_REL_RMS = 2e-4

#: lengths with the edge cases of the 32-blocks and 64/128-row tiles; the KV side differs per sequence (so
#: bottom-right offsets differ), with one empty KV sequence and one empty query sequence
LENS_Q = [0, 1, 31, 33, 127, 129, 300]
LENS_KV = [5, 1, 33, 0, 129, 300, 127]

MASKS = {
    "padding": MaskSpec(),
    "padding_causal": MaskSpec(causal=True),
    "padding_causal_bottom_right": MaskSpec(causal=True, diagonal_alignment="bottom_right"),
    "window": MaskSpec(left_bound=65, right_bound=16),  # TE window_size=(64, 16)
    "causal_window_bottom_right": MaskSpec(causal=True, diagonal_alignment="bottom_right", left_bound=100),
}




def _cu(lengths, device="cuda"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _ulp(r: torch.Tensor, dtype) -> torch.Tensor:
    """One ulp of `dtype` (bf16/fp16) at each value of r (fp32 tensor of such values)."""
    _, e = torch.frexp(r.float())
    bits, low = (8, -133) if dtype == torch.bfloat16 else (11, -24)
    return torch.ldexp(torch.ones_like(r, dtype=torch.float32), (e - bits).clamp(min=low))


class Batch:
    """q, k, v, do as the backend takes them ([B,H,S,D] views; packed: [1,H,T,D] views of thd tensors),
    the SeqInfo, and the per-sequence (start, length) of each side."""

    def __init__(self, kind, lens_q, lens_kv, hq, hkv, d, dtype, seed=0, nan_padding=True, pad=(7, 5)):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.kind, self.lens_q, self.lens_kv = kind, list(lens_q), list(lens_kv)
        cu_q, cu_kv = _cu(lens_q), _cu(lens_kv)
        self.seq = SeqInfo(cu_q, cu_kv, max(lens_q), max(lens_kv), kind == "packed")
        self.cq, self.ckv = cu_q.tolist(), cu_kv.tolist()

        def rnd(*shape):
            return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

        if kind == "packed":
            tq, tkv = self.cq[-1], self.ckv[-1]
            self.thd = [rnd(tq, hq, d), rnd(tkv, hkv, d), rnd(tkv, hkv, d), rnd(tq, hq, d)]
            self.q, self.k, self.v, self.do = (t.permute(1, 0, 2).unsqueeze(0) for t in self.thd)
        else:
            B, sq, skv = len(lens_q), max(lens_q) + pad[0], max(lens_kv) + pad[1]
            self.q, self.do = rnd(B, sq, hq, d).transpose(1, 2), rnd(B, sq, hq, d).transpose(1, 2)  # bshd
            self.k, self.v = rnd(B, skv, hkv, d).transpose(1, 2), rnd(B, skv, hkv, d).transpose(1, 2)
            if nan_padding:
                for t, lens in ((self.q, lens_q), (self.do, lens_q), (self.k, lens_kv), (self.v, lens_kv)):
                    for b, n in enumerate(lens):
                        t[b, :, n:] = float("nan")
        if dtype == torch.float32:  # dO arrives in the kernels' output dtype
            self.do = self.do.to(torch.bfloat16)

    def rows(self, t, which, b):
        """[1, H, len, *] rows of sequence b of a [B, H, S, *] tensor (which: "q" or "kv")."""
        cu = self.cq if which == "q" else self.ckv
        if self.kind == "packed":
            return t[:, :, cu[b]:cu[b + 1]]
        return t[b:b + 1, :, :cu[b + 1] - cu[b]]

    def padding(self, t, which, b):
        """Rows of batch b past its length (padded batches; empty for packed ones)."""
        if self.kind == "packed":
            return t[:0]
        cu = self.cq if which == "q" else self.ckv
        return t[b:b + 1, :, cu[b + 1] - cu[b]:]


def _params(mask, d, out_dtype, seq):
    return AttentionParams(softmax_scale=1.0 / math.sqrt(d), mask=mask, out_dtype=out_dtype, seq=seq)


def _reference(bt: Batch, params, saved, o, stats):
    """Reference forward on the same CUDA inputs and reference backward on the triton run's saved bytes, O and
    stats (ref runs on CUDA bit-identically to CPU)."""
    from mxattn.backends.reference import ReferenceBackend
    ref = ReferenceBackend()
    ro, rstats, rsaved = ref.forward(bt.q, bt.k, bt.v, params)
    grads = ref.backward(saved, o, stats, bt.do, params)
    return ro, rstats, rsaved, grads


def _assert_saved_equal(saved, rsaved):
    for name in ("q_row", "q_col", "k_row", "k_col", "v_row"):
        a, b = getattr(saved, name), getattr(rsaved, name)
        assert a.axis == b.axis and a.data.shape == b.data.shape and a.scale.shape == b.scale.shape, name
        assert torch.equal(as_bytes(a.data).cpu(), as_bytes(b.data).cpu()), f"{name} data"
        assert torch.equal(as_bytes(a.scale).cpu(), as_bytes(b.scale).cpu()), f"{name} scale"
        assert (a.segments is None) == (b.segments is None), name


def _check_against_reference(bt: Batch, mask, out_dtype):
    be = triton_backend()
    d = bt.q.shape[3]
    params = _params(mask, d, out_dtype, bt.seq)
    o, stats, saved = be.forward(bt.q, bt.k, bt.v, params)
    dq, dk, dv = be.backward(saved, o, stats, bt.do, params)
    torch.cuda.synchronize()
    ro, rstats, rsaved, (rdq, rdk, rdv) = _reference(bt, params, saved, o, stats)
    _assert_saved_equal(saved, rsaved)

    o_c, ro_f = o.float().cpu(), ro.float().cpu()
    assert o.dtype == out_dtype and torch.isfinite(o_c).all()
    diff = (o_c - ro_f).abs()
    assert diff.max().item() <= O_MAX_ABS, f"O max abs diff {diff.max().item():.3g}"
    within = (diff <= _ulp(ro_f, out_dtype)).float().mean().item()
    assert within >= O_ULP_FRACTION, f"only {within:.5f} of O within one ulp"
    s_c, rs = stats.cpu(), rstats.cpu()
    assert torch.equal(torch.isneginf(s_c), torch.isneginf(rs)) and not torch.isnan(s_c).any()
    fin = torch.isfinite(rs)
    if fin.any():
        assert (s_c[fin] - rs[fin]).abs().max().item() <= STATS_ABS

    errs = {}
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        g, w = got.float().cpu(), want.float().cpu()
        assert got.shape == want.shape and got.dtype == out_dtype
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        denom = w.norm().item()
        err = (g - w).norm().item() / denom if denom > 0 else g.norm().item()
        errs[name] = err
        assert err <= GRAD_REL_RMS, f"{name} relative RMS {err:.3g}"

    for b in range(len(bt.lens_q)):  # padding rows: exact zeros and -inf; empty sequences likewise
        assert torch.all(bt.padding(o, "q", b) == 0) and torch.all(bt.padding(dq, "q", b) == 0)
        assert torch.all(torch.isneginf(bt.padding(stats, "q", b)))
        assert torch.all(bt.padding(dk, "kv", b) == 0) and torch.all(bt.padding(dv, "kv", b) == 0)
        if bt.lens_kv[b] == 0:
            assert torch.all(bt.rows(o, "q", b) == 0) and torch.all(torch.isneginf(bt.rows(stats, "q", b)))
            assert torch.all(bt.rows(dq, "q", b) == 0)
        if bt.lens_q[b] == 0:
            assert torch.all(bt.rows(dk, "kv", b) == 0) and torch.all(bt.rows(dv, "kv", b) == 0)
    return (o, stats, dq, dk, dv), errs, within


# --------------------------------------------------------------------------- quantizer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_quantizer_packed_bit_identical(dtype, d):
    triton_backend()
    from mxattn.kernels import triton_bwd_prep as tp
    from mxattn.kernels.triton_attention_fwd import check_seq
    from mxattn.seqinfo import kernel_cu_seqlens
    from mxattn.kernels.triton_quantize import quantize_rowcol
    lens = LENS_Q + [64, 2]
    cu = _cu(lens)
    g = torch.Generator(device="cuda").manual_seed(d)
    x = (torch.randn(sum(lens), 3, d, device="cuda", generator=g) * 4).to(dtype)
    x[40, 1, 3] = float("nan")
    x[200, 0, :] = float("inf")
    x[300:340] *= 1e-30
    xb = x.permute(1, 0, 2).unsqueeze(0)
    got = quantize_rowcol(xb, cu_seqlens=cu, max_seqlen=max(lens), packed=True)
    want_r, want_c = quantize_mxfp8(xb, axis=3), quantize_mxfp8(xb, axis=2, segments=cu)
    assert torch.equal(as_bytes(got.row.data), as_bytes(want_r.data)) and torch.equal(as_bytes(got.row.scale), as_bytes(want_r.scale))
    assert torch.equal(as_bytes(got.col.data), as_bytes(want_c.data)) and torch.equal(as_bytes(got.col.scale), as_bytes(want_c.scale))
    assert got.col.segments is cu and got.row.data.stride() == want_r.data.stride()
    # the backward's on-chip dequantization of these copies (its key-side prep pass) equals torch's
    seq = check_seq(SeqInfo(cu, cu, max(lens), max(lens), True), got.row.data, got.row.data)
    k_r, k_c, _ = tp.kv_prep(got.row, got.col, got.row, 0, 3, seq, kernel_cu_seqlens(seq, got.row.data))
    assert same_values(k_r, want_r.dequantize(torch.bfloat16))
    assert same_values(k_c, want_c.dequantize(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizer_padded_reads_padding_as_zero(dtype):
    triton_backend()
    from mxattn.kernels.triton_quantize import quantize_rowcol
    lens = [0, 1, 31, 33, 100]
    cu = _cu(lens)
    x = torch.randn(5, 106, 2, 128, device="cuda").to(dtype).transpose(1, 2)
    valid = (torch.arange(106, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None])
    valid = valid.view(5, 1, 106, 1)
    x = torch.where(valid, x, torch.full((), float("nan"), dtype=dtype, device="cuda"))
    got = quantize_rowcol(x, cu_seqlens=cu, max_seqlen=100, swizzle=True)
    xz = torch.where(valid, x, torch.zeros((), dtype=dtype, device="cuda"))
    want_r, want_c = quantize_mxfp8(xz, axis=3), quantize_mxfp8(xz, axis=2)
    for a, b in ((got.row, want_r), (got.col, want_c)):
        assert torch.equal(as_bytes(a.data), as_bytes(b.data)) and torch.equal(as_bytes(a.scale), as_bytes(b.scale))
    cudnn_buffers = pytest.importorskip("mxattn.backends.cudnn.buffers")      # the F8_128x4 bytes the cuDNN graphs read
    assert torch.equal(as_bytes(got.row_swizzled), as_bytes(cudnn_buffers.row_scale_buffer(want_r.scale)))
    assert torch.equal(as_bytes(got.col_swizzled), as_bytes(cudnn_buffers.col_scale_bytes(want_c.scale)))


# --------------------------------------------------------------------------- against the reference backend


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_varlen_against_reference(kind, mask_name):
    """GQA 4/2, D 128, bf16; padded batches carry NaN in every padding row."""
    bt = Batch(kind, LENS_Q, LENS_KV, 4, 2, 128, torch.bfloat16, seed=1)
    _, errs, within = _check_against_reference(bt, MASKS[mask_name], torch.bfloat16)
    print(f"{kind} {mask_name}: within 1 ulp {within:.5f}, grads rel-RMS {errs}")


@pytest.mark.parametrize("kind,mask_name,hq,hkv,d,dtype,self_attn", [
    ("packed", "padding_causal_bottom_right", 4, 1, 64, torch.float16, False),   # MQA, fp16
    ("packed", "window", 4, 1, 64, torch.float16, False),
    ("padded", "padding_causal_bottom_right", 4, 1, 64, torch.float16, False),
    ("padded", "window", 2, 2, 64, torch.bfloat16, True),
    ("packed", "padding_causal", 4, 2, 256, torch.bfloat16, True),               # D 256
    ("padded", "padding_causal_bottom_right", 2, 1, 256, torch.bfloat16, False),
    ("packed", "padding", 4, 2, 128, torch.float32, False),                      # fp32 in, bf16 out
    ("padded", "padding_causal", 4, 2, 128, torch.float32, True),
])
def test_varlen_configs_against_reference(kind, mask_name, hq, hkv, d, dtype, self_attn):
    lens_kv = LENS_Q if self_attn else LENS_KV
    bt = Batch(kind, LENS_Q, lens_kv, hq, hkv, d, dtype, seed=d + hq)
    out_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
    _, errs, within = _check_against_reference(bt, MASKS[mask_name], out_dtype)
    print(f"{kind} {mask_name} {hq}/{hkv} d{d} {dtype}: within 1 ulp {within:.5f}, grads {errs}")


# --------------------------------------------------------------------------- per-sequence identity, determinism


@pytest.mark.parametrize("kind", ["packed", "padded"])
@pytest.mark.parametrize("mask_name", ["padding_causal_bottom_right", "window"])
def test_varlen_equals_per_sequence_dense_calls(kind, mask_name):
    """Every sequence of a packed or padded batch gets exactly what a dense call on it alone gets."""
    be = triton_backend()
    bt = Batch(kind, LENS_Q, LENS_KV, 4, 2, 128, torch.bfloat16, seed=3)
    mask = MASKS[mask_name]
    params = _params(mask, 128, torch.bfloat16, bt.seq)
    o, stats, saved = be.forward(bt.q, bt.k, bt.v, params)
    dq, dk, dv = be.backward(saved, o, stats, bt.do, params)
    dense = _params(mask, 128, torch.bfloat16, None)
    for b in range(len(bt.lens_q)):
        if bt.lens_q[b] == 0 or bt.lens_kv[b] == 0:  # empty sequences: checked against the reference above
            continue
        q, k, v, do = (bt.rows(t, w, b) for t, w in ((bt.q, "q"), (bt.k, "kv"), (bt.v, "kv"), (bt.do, "q")))
        o1, st1, sv1 = be.forward(q, k, v, dense)
        dq1, dk1, dv1 = be.backward(sv1, o1, st1, do, dense)
        for name, got, want in (("o", bt.rows(o, "q", b), o1), ("stats", bt.rows(stats, "q", b), st1),
                                ("dq", bt.rows(dq, "q", b), dq1), ("dk", bt.rows(dk, "kv", b), dk1),
                                ("dv", bt.rows(dv, "kv", b), dv1)):
            assert torch.equal(got, want), f"sequence {b}: {name}"


def test_varlen_backward_deterministic():
    be = triton_backend()
    bt = Batch("packed", LENS_Q * 2, LENS_KV * 2, 8, 2, 128, torch.bfloat16, seed=4)
    params = _params(MASKS["padding_causal_bottom_right"], 128, torch.bfloat16, bt.seq)
    runs = []
    for _ in range(2):
        o, stats, saved = be.forward(bt.q, bt.k, bt.v, params)
        runs.append((o, stats) + be.backward(saved, o, stats, bt.do, params))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_pack_with_one_long_sequence():
    """4096 + 128 + 128 tokens: the grids are sized by the longest sequence; results still per sequence."""
    be = triton_backend()
    bt = Batch("packed", [4096, 128, 128], [4096, 128, 128], 2, 1, 128, torch.bfloat16, seed=5)
    params = _params(MASKS["padding_causal"], 128, torch.bfloat16, bt.seq)
    o, stats, saved = be.forward(bt.q, bt.k, bt.v, params)
    dq, dk, dv = be.backward(saved, o, stats, bt.do, params)
    dense = _params(MASKS["padding_causal"], 128, torch.bfloat16, None)
    b = 2
    q, k, v, do = (bt.rows(t, w, b) for t, w in ((bt.q, "q"), (bt.k, "kv"), (bt.v, "kv"), (bt.do, "q")))
    o1, st1, sv1 = be.forward(q, k, v, dense)
    grads = be.backward(sv1, o1, st1, do, dense)
    assert torch.equal(bt.rows(o, "q", b), o1)
    for got, want in zip((bt.rows(dq, "q", b), bt.rows(dk, "kv", b), bt.rows(dv, "kv", b)), grads):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- public API


def _api_run(q, k, v, cu, attn_mask_type, backend):
    """(O, dq, dk, dv) of mxfp8_attention on thd q, k, v (loss: sum of O squared)."""
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = mxattn.mxfp8_attention(qq, kk, vv, qkv_format="thd", attn_mask_type=attn_mask_type, backend=backend,
                               cu_seqlens_q=cu, cu_seqlens_kv=cu)
    o.float().square().sum().backward()
    return o, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("attn_mask_type", ["padding", "padding_causal_bottom_right"])
def test_public_api_thd_and_padded(attn_mask_type):
    triton_backend()
    torch.manual_seed(6)
    lens = [3, 300, 0, 129]
    cu = _cu(lens)
    starts = cu.tolist()
    q = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q[:, :2]), torch.randn_like(q[:, :2])
    o, *g = _api_run(q, k, v, cu, attn_mask_type, "triton")
    ro, *rg = _api_run(q, k, v, cu, attn_mask_type, "reference")
    assert (o.float().cpu() - ro.float().cpu()).abs().max().item() <= O_MAX_ABS
    for a, b in zip(g, rg):
        a, b = a.float().cpu(), b.float().cpu()
        assert torch.isfinite(a).all()
        assert (a - b).norm().item() <= 1e-2 * b.norm().item()

    # the same sequences padded (bshd, NaN padding): the same outputs on the real rows, zeros elsewhere
    B, S = len(lens), max(lens) + 3
    qp = torch.full((B, S, 4, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    kp, vp = qp[:, :, :2].clone(), qp[:, :, :2].clone()
    for b, n in enumerate(lens):
        c = starts[b]
        qp[b, :n], kp[b, :n], vp[b, :n] = q[c:c + n], k[c:c + n], v[c:c + n]
    op = mxattn.mxfp8_attention(qp, kp, vp, qkv_format="bshd", attn_mask_type=attn_mask_type, backend="triton",
                                cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for b, n in enumerate(lens):
        assert torch.equal(op[b, :n], o[starts[b]:starts[b] + n])
        assert torch.all(op[b, n:] == 0)


def _seq_major_expected(col, starts):
    """SeqMajorColumns expected from an MXFP8Tensor col [B, H, S, D] (axis 2): per sequence (batch row bt,
    first row r0, length n, first block b0, end z) the data transposed to columns b0 * 32 .. + n, zeros from
    there to column z."""
    B, H, _, D = col.data.shape
    n_blocks = col.scale.shape[2]
    want = torch.full((B, H, D, n_blocks * 32), 0xAA, dtype=torch.uint8)  # 0xAA: never written
    data = as_bytes(col.data).cpu()
    for bt, r0, n, b0, z in starts:
        want[bt, :, :, b0 * 32:b0 * 32 + n] = data[bt, :, r0:r0 + n].transpose(-1, -2)
        want[bt, :, :, b0 * 32 + n:z] = 0
    return want


@pytest.mark.parametrize("kind", ["dense", "padded", "packed"])
def test_quantizer_seq_major_columns_match_the_column_wise_tensor(kind):
    """col_seq_major=True (the forward kernel's V layout) holds exactly the column-wise bytes, transposed, each
    sequence from its first block's column, zeros to the end of its last block; the scales are col's."""
    triton_backend()
    from mxattn.kernels.triton_quantize import quantize_rowcol
    g = torch.Generator(device="cuda").manual_seed(5)
    if kind == "packed":
        lens = [5, 64, 33, 100, 1]
        cu = _cu(lens)
        x = (torch.randn(1, 2, sum(lens), 96, device="cuda", generator=g) * 3).to(torch.bfloat16)
        kw = dict(cu_seqlens=cu, max_seqlen=max(lens), packed=True)
        firsts = cu.tolist()
        starts = [(0, firsts[i], n, firsts[i] // 32 + i, (firsts[i] // 32 + i) * 32 + (n + 31) // 32 * 32)
                  for i, n in enumerate(lens)]
    elif kind == "padded":
        lens = [0, 31, 77]
        cu = _cu(lens)
        x = (torch.randn(3, 2, 77, 64, device="cuda", generator=g) * 3).to(torch.float16)
        kw = dict(cu_seqlens=cu, max_seqlen=77)
        starts = [(b, 0, n, 0, 96) for b, n in enumerate(lens)]
    else:
        x = (torch.randn(2, 3, 1000, 128, device="cuda", generator=g) * 3).to(torch.bfloat16)
        kw = {}
        starts = [(b, 0, 1000, 0, 1024) for b in range(2)]
    x[0, 0, 3, 5] = float("nan")  # a NaN block: in a short sequence (packed: length 5) its padding stays 0
    got = quantize_rowcol(x, **kw, col_seq_major=True)
    plain = quantize_rowcol(x, **kw)
    assert got.col is None and got.col_seq_major is not None
    sm = got.col_seq_major
    assert sm.data.stride(3) == 1 and sm.data.shape[3] == 32 * sm.scale.shape[2]
    assert torch.equal(as_bytes(sm.scale), as_bytes(plain.col.scale))
    want = _seq_major_expected(plain.col, starts)
    written = want != 0xAA
    assert torch.equal(as_bytes(sm.data).cpu()[written], want[written])
    assert torch.equal(as_bytes(got.row.data), as_bytes(plain.row.data))


@pytest.mark.parametrize("case", ["dense_causal_d128", "gqa_window_d64", "bottom_right_d96", "packed_causal",
                                  "padded_sink", "fp16_d32"])
def test_forward_paths_agree(case, monkeypatch):
    """The forward's two data paths give the same O and stats: K/V as exact bf16 dequantizations in HBM (the
    default up to head dim 128 within the scratch budget, what the other tests run) and FP8 dequantized on
    chip (head dims above 128, large problems): every element within one ulp of the other path, stats within
    1e-6."""
    from mxattn.kernels import triton_attention_fwd as tf
    be = triton_backend()
    g = torch.Generator(device="cuda").manual_seed(3)
    seq, sink, dtype = None, None, torch.bfloat16
    if case in ("packed_causal", "padded_sink"):
        kind = "packed" if case == "packed_causal" else "padded"
        b = Batch(kind, [1, 200, 33, 129], [5, 200, 300, 2], 4, 2, 128, torch.bfloat16, seed=7)
        q, k, v, seq = b.q, b.k, b.v, b.seq
        mask = MaskSpec(causal=True, diagonal_alignment="bottom_right") if kind == "packed" else MaskSpec()
        if kind == "padded":
            sink = torch.randn(4, device="cuda", generator=g)
    else:
        d, hq, hkv, sq, skv, mask = {
            "dense_causal_d128": (128, 4, 4, 333, 333, MaskSpec(causal=True)),
            "gqa_window_d64": (64, 8, 2, 400, 700, MaskSpec(left_bound=64, right_bound=50)),
            "bottom_right_d96": (96, 2, 1, 300, 1000, MaskSpec(causal=True, diagonal_alignment="bottom_right")),
            "fp16_d32": (32, 3, 3, 129, 257, MaskSpec()),
        }[case]
        dtype = torch.float16 if case == "fp16_d32" else torch.bfloat16
        q, k, v = (torch.randn(2, h, s, d, device="cuda", dtype=dtype, generator=g) * 2
                   for h, s in ((hq, sq), (hkv, skv), (hkv, skv)))
    params = AttentionParams(softmax_scale=0.1, mask=mask, out_dtype=dtype, seq=seq, sink=sink,
                             needs_backward=False)
    assert tf.fwd_streams_bf16(q.shape[0], k.shape[1], k.shape[2], k.shape[3])
    o_bf16, st_bf16, _ = be.forward(q, k, v, params)
    monkeypatch.setattr(tf, "fwd_streams_bf16", lambda *a: False)
    o_fp8, st_fp8, _ = be.forward(q, k, v, params)
    ulp = _ulp(o_bf16.float(), dtype)
    assert ((o_bf16.float() - o_fp8.float()).abs() <= ulp).all()
    assert torch.equal(o_bf16.isnan(), o_fp8.isnan()) and torch.equal(st_bf16.isinf(), st_fp8.isinf())
    fin = st_bf16.isfinite()
    assert ((st_bf16 - st_fp8)[fin].abs() <= 1e-6).all()


@pytest.mark.parametrize("kind,d", [("dense", 128), ("dense", 96), ("dense", 32), ("padded", 64), ("packed", 128),
                                    ("packed", 256)])
def test_backward_prep_equals_the_separate_kernels(kind, d):
    """`bwd_prep` (one launch for a chunk of heads: delta, dO's two bf16 dequantizations, Q's two) writes what
    separate passes write: the quantizer's dequantizations of dO and torch's dequantization of Q's saved copies
    bit for bit (NaN and inf blocks included), and delta = rowsum(O * dO) to fp32 rounding (zero on padding rows),
    for a head range that does not start at 0 and leaves the other heads' delta alone; `kv_prep` likewise
    writes torch's dequantization of K's two copies and V's row-wise one."""
    from mxattn.kernels import triton_bwd_prep as tp
    from mxattn.kernels.triton_attention_fwd import check_seq
    from mxattn.seqinfo import kernel_cu_seqlens
    from mxattn.formats import MXFP8Tensor
    from mxattn.kernels.triton_quantize import quantize_rowcol
    triton_backend()
    hq, h0, h1 = 6, 2, 5

    def dequantized(t, a, b):  # heads a .. b of an MXFP8Tensor, dequantized by torch (the oracle)
        return MXFP8Tensor(t.data[:, a:b], t.scale[:, a:b], t.axis, t.segments).dequantize(torch.bfloat16)

    if kind == "dense":
        g = torch.Generator(device="cuda").manual_seed(3)
        q, do, o = (torch.randn(2, 200, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                    for _ in range(3))
        seq, quant_seq, bt = None, {}, None
    else:
        bt = Batch(kind, LENS_Q, LENS_KV, hq, 2, d, torch.bfloat16, seed=3)
        q, do, seq = bt.q, bt.do, bt.seq
        o = torch.randn_like(do)
        quant_seq = dict(cu_seqlens=seq.cu_seqlens_q, max_seqlen=seq.max_seqlen_q, packed=seq.packed)
    B, _, S, _ = q.shape
    row = 40 if kind != "packed" else bt.cq[5] + 3  # a row inside a sequence
    do[0, 3, row, 1] = float("nan")
    do[0, 4, row + 1, :] *= 1e30
    q[0, 2, row, 2] = float("inf")
    qq = quantize_rowcol(q, **quant_seq)
    cu = kernel_cu_seqlens(check_seq(seq, qq.row.data, qq.row.data), o)
    delta = torch.full((B, hq, S), float("nan"), device="cuda")
    got = tp.bwd_prep(o, do, qq.row, qq.col, delta, h0, h1, seq, cu)
    exp_do = quantize_rowcol(do[:, h0:h1], row_dequant=True, col_dequant=True, **quant_seq)
    expected = (exp_do.row_dequant, exp_do.col_dequant, dequantized(qq.row, h0, h1), dequantized(qq.col, h0, h1))
    exp_delta = (o.float() * do.float()).sum(-1)
    delta_tol = 1e-5 * (o.float() * do.float()).abs().sum(-1) + 1e-6  # (the sums run in different orders)
    if bt is not None and kind == "padded":
        for b, n in enumerate(bt.lens_q):
            exp_delta[b, :, n:] = 0
            delta_tol[b, :, n:] = 0
    pieces = [slice(None)] if bt is None or kind == "padded" else \
        [slice(bt.cq[b], bt.cq[b + 1]) for b in range(len(bt.lens_q))]
    for rows in pieces:
        for name, a, e in zip(("dO row", "dO col", "Q row", "Q col"), got, expected):
            assert same_values(a[:, :, rows], e[:, :, rows]), (kind, d, name)
        dg, de = delta[:, h0:h1, rows], exp_delta[:, h0:h1, rows]
        assert torch.equal(torch.isnan(dg), torch.isnan(de)), (kind, d)
        err = (dg - de).nan_to_num(0.0).abs()
        assert (err <= delta_tol[:, h0:h1, rows].nan_to_num(0.0)).all(), (kind, d, err.max().item())
    assert torch.isnan(delta[:, :h0]).all() and torch.isnan(delta[:, h1:]).all()
    # the key side (`kv_prep`): K both ways and V row-wise, KV heads 1 .. 2
    if bt is None:
        g = torch.Generator(device="cuda").manual_seed(5)
        k, v = (torch.randn(2, 150, 3, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
                for _ in range(2))
        kv_seq, kv_pieces = {}, [slice(None)]
    else:
        k, v = bt.k, bt.v
        kv_seq = dict(cu_seqlens=seq.cu_seqlens_kv, max_seqlen=seq.max_seqlen_kv, packed=seq.packed)
        kv_pieces = [slice(None)] if kind == "padded" else \
            [slice(bt.ckv[b], bt.ckv[b + 1]) for b in range(len(bt.lens_kv))]
    k[0, 1, 7, 3] = float("nan")
    kq, vq = quantize_rowcol(k, **kv_seq), quantize_rowcol(v, col=False, **kv_seq)
    cu = kernel_cu_seqlens(check_seq(seq, qq.row.data, kq.row.data), o)
    h1 = 3 if bt is None else 2
    got = tp.kv_prep(kq.row, kq.col, vq.row, 1, h1, seq, cu)
    expected = (dequantized(kq.row, 1, h1), dequantized(kq.col, 1, h1), dequantized(vq.row, 1, h1))
    for rows in kv_pieces:
        for name, a, e in zip(("K row", "K col", "V row"), got, expected):
            assert same_values(a[:, :, rows], e[:, :, rows]), (kind, d, name)


@pytest.mark.parametrize("d", [64, 128])
def test_gapped_prep_equals_the_packed_prep(d):
    """`bwd_prep` / `kv_prep` with gap=PACKED_GAP (the Gluon backward kernels' layout of a packed batch's scratch):
    sequence b's rows at cu[b] + PACKED_GAP * b equal the packed scratch's rows bit for bit (NaN included), the
    PACKED_GAP rows after each sequence are zeros (garbage in the empty allocation otherwise), the scratch has
    T + PACKED_GAP * B rows, and delta is written for the sequences' rows exactly as without the gap. Lengths with
    an empty sequence on each side (LENS_Q, LENS_KV)."""
    from mxattn.kernels import triton_bwd_prep as tp
    from mxattn.kernels.triton_attention_fwd import check_seq
    from mxattn.kernels.triton_quantize import quantize_rowcol
    from mxattn.seqinfo import kernel_cu_seqlens
    gap = tp.PACKED_GAP
    hq, h0, h1 = 6, 2, 5
    bt = Batch("packed", LENS_Q, LENS_KV, hq, 3, d, torch.bfloat16, seed=4)
    seq, o = bt.seq, torch.randn_like(bt.do)
    bt.do[0, 3, bt.cq[5] + 2, 1] = float("nan")
    qs = dict(cu_seqlens=seq.cu_seqlens_q, max_seqlen=seq.max_seqlen_q, packed=True)
    ks = dict(cu_seqlens=seq.cu_seqlens_kv, max_seqlen=seq.max_seqlen_kv, packed=True)
    qq, kq, vq = quantize_rowcol(bt.q, **qs), quantize_rowcol(bt.k, **ks), quantize_rowcol(bt.v, col=False, **ks)
    cu = kernel_cu_seqlens(check_seq(seq, qq.row.data, kq.row.data), o)
    n = len(LENS_Q)
    for side, cuts in (("q", bt.cq), ("kv", bt.ckv)):
        deltas, outs = [], []
        for g in (0, gap):
            torch.cuda.empty_cache()
            if side == "q":
                delta = torch.full((1, hq, bt.cq[-1]), float("nan"), device="cuda")
                outs.append(tp.bwd_prep(o, bt.do, qq.row, qq.col, delta, h0, h1, seq, cu, gap=g))
                deltas.append(delta)
            else:
                outs.append(tp.kv_prep(kq.row, kq.col, vq.row, 1, 3, seq, cu, gap=g))
        packed, gapped = outs
        for a, e in zip(gapped, packed):
            assert a.shape[2] == e.shape[2] + gap * n
            for b in range(n):
                s0 = cuts[b] + gap * b
                ln = cuts[b + 1] - cuts[b]
                assert same_values(a[:, :, s0:s0 + ln], e[:, :, cuts[b]:cuts[b + 1]]), (side, b)
                assert (a[:, :, s0 + ln:s0 + ln + gap] == 0).all(), (side, b)
        if side == "q":
            assert torch.equal(deltas[0].isnan(), deltas[1].isnan())
            assert torch.equal(deltas[0].nan_to_num(7.0), deltas[1].nan_to_num(7.0))
