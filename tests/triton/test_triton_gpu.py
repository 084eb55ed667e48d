"""Triton backend on a CUDA GPU: fused quantizer bit-identity, accuracy against `ref` on identical quantized
bytes, determinism, masks, GQA, ragged lengths, head dims and layouts. Host-side checks (no kernel) live in
test_triton_host.py; variable-length batches in test_varlen_triton_gpu.py."""

import math

import pytest
import torch

from mxattn.backends.base import AttentionParams, SavedForBackward
from mxattn.formats import quantize_mxfp8, swizzle_128x4
from mxattn.mask import MaskSpec
from triton_helpers import as_bytes, same_values, triton_backend
from ref import mxfp8_ref as ref

pytestmark = pytest.mark.gpu

O_MAX_ABS = 1e-2
O_ULP_FRACTION = 0.99
GRAD_REL_RMS = 1e-2




def _bf16_ulp(r: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at each value of r (fp32 tensor of BF16 values)."""
    _, e = torch.frexp(r.float())
    return torch.ldexp(torch.ones_like(r, dtype=torch.float32), (e - 8).clamp(min=-133))


def _make(B, hq, hkv, sq, skv, d, dtype=torch.bfloat16, layout="bhsd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(h, s):
        if layout == "bhsd":
            return torch.randn(B, h, s, d, device="cuda", dtype=dtype, generator=g)
        if layout == "bshd":
            return torch.randn(B, s, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(s, B, h, d, device="cuda", dtype=dtype, generator=g).permute(1, 2, 0, 3)
    return mk(hq, sq), mk(hkv, skv), mk(hkv, skv), mk(hq, sq)


def _pair(t):
    return (t.data.cpu(), t.scale.cpu())


def _ref_opts(mask: MaskSpec, scale: float, out_dtype):
    return dict(attn_scale=scale, causal=mask.causal, diagonal_alignment=mask.diagonal_alignment,
                window=(mask.left_bound, None if mask.causal else mask.right_bound), out_dtype=out_dtype)


def _check_against_ref(B, hq, hkv, sq, skv, d, mask, dtype=torch.bfloat16, seed=0, layout="bhsd"):
    be = triton_backend()
    q, k, v, do = _make(B, hq, hkv, sq, skv, d, dtype, layout, seed)
    scale = 1.0 / math.sqrt(d)
    params = AttentionParams(softmax_scale=scale, mask=mask, out_dtype=dtype)
    o, stats, saved = be.forward(q, k, v, params)
    assert isinstance(saved, SavedForBackward)
    dq, dk, dv = be.backward(saved, o, stats, do, params)
    torch.cuda.synchronize()
    opts = _ref_opts(mask, scale, dtype)
    v_col = quantize_mxfp8(v, axis=2)  # bit-identical to the fused quantizer (tested below)
    ro, rstats = ref.sdpa_fwd_quantized(saved.q_row.data.cpu(), saved.q_row.scale.cpu(), saved.k_row.data.cpu(),
                                        saved.k_row.scale.cpu(), v_col.data.cpu(), v_col.scale.cpu(), **opts)
    o_c, ro_f = o.float().cpu(), ro.float()
    diff = (o_c - ro_f).abs()
    assert torch.isfinite(o_c).all()
    assert diff.max().item() <= O_MAX_ABS, f"O max abs diff {diff.max().item():.3g}"
    within = (diff <= _bf16_ulp(ro_f)).float().mean().item()
    assert within >= O_ULP_FRACTION, f"only {within:.4f} of O within one ulp"
    s_c = stats.cpu()
    assert torch.equal(torch.isinf(s_c), torch.isinf(rstats))
    fin = torch.isfinite(rstats)
    assert (s_c[fin] - rstats[fin]).abs().max().item() <= 1e-4 if fin.any() else True

    do_row, do_col = quantize_mxfp8(do, axis=3), quantize_mxfp8(do, axis=2)
    rdq, rdk, rdv = ref.sdpa_bwd_quantized(_pair(saved.q_row), _pair(saved.q_col), _pair(saved.k_row),
                                           _pair(saved.k_col), _pair(saved.v_row), o.cpu(), do.cpu(),
                                           _pair(do_row), _pair(do_col), stats.cpu(), **opts)
    errs = {}
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        g, w = got.float().cpu(), want.float()
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.isfinite(g).all(), name
        denom = w.norm().item()
        err = (g - w).norm().item() / denom if denom > 0 else (g - w).norm().item()
        errs[name] = err
        assert err <= GRAD_REL_RMS, f"{name} relative RMS {err:.3g}"
    return o, stats, (dq, dk, dv), errs, within, diff.max().item()


# --------------------------------------------------------------------------- quantizer


def _special(x):
    """Put zeros, huge, tiny, inf and NaN blocks/elements into x (a [B,H,S,D] view) in place."""
    x[0, 0, :32, :32] = 0
    x[0, 0, 32:64, :32] *= 1e30
    x[0, 0, 64:96, 32:64] *= 1e-30
    x[0, 0, 5, 40] = float("inf")
    x[0, 0, 70, 3] = float("-inf")
    x[0, 0, 100, 100 % x.shape[3]] = float("nan")
    return x


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "sbhd"])
@pytest.mark.parametrize("shape,dtype", [((2, 4, 1000, 128), torch.bfloat16), ((1, 3, 177, 96), torch.float16),
                                         ((1, 2, 256, 256), torch.bfloat16), ((2, 2, 130, 64), torch.float32)])
def test_quantizer_bit_identical(layout, shape, dtype):
    triton_backend()
    from mxattn.kernels.triton_quantize import quantize_rowcol
    B, H, S, D = shape
    x, _, _, _ = _make(B, H, H, S, S, D, dtype, layout, seed=3)
    x = _special(x * 4)
    got = quantize_rowcol(x, swizzle=True)
    want_r, want_c = quantize_mxfp8(x, axis=3), quantize_mxfp8(x, axis=2)
    assert got.row.axis == 3 and got.col.axis == 2
    assert got.row.data.stride() == want_r.data.stride()
    assert torch.equal(as_bytes(got.row.data), as_bytes(want_r.data))
    assert torch.equal(as_bytes(got.row.scale), as_bytes(want_r.scale))
    assert torch.equal(as_bytes(got.col.data), as_bytes(want_c.data))
    assert torch.equal(as_bytes(got.col.scale), as_bytes(want_c.scale))
    assert torch.equal(as_bytes(got.row_swizzled), as_bytes(swizzle_128x4(want_r.scale)))


@pytest.mark.parametrize("shape,dtype", [((2, 4, 1000, 128), torch.bfloat16), ((1, 3, 177, 96), torch.float16),
                                         ((3, 2, 256, 256), torch.bfloat16), ((2, 5, 130, 64), torch.float32)])
def test_quantizer_writes_the_cudnn_graph_scale_bytes(shape, dtype):
    """swizzle=True: the row and column scales in the byte order of the cuDNN graph's F8_128x4 tensors
    (`cudnn_graphs.operand` of the compact scales), the column ones over all (b, h) slabs at once."""
    cudnn_buffers = pytest.importorskip("mxattn.backends.cudnn.buffers")
    triton_backend()
    from mxattn.kernels.triton_quantize import quantize_rowcol
    B, H, S, D = shape
    x, _, _, _ = _make(B, H, H, S, S, D, dtype, "bshd", seed=4)
    x = _special(x * 4)
    got = quantize_rowcol(x, swizzle=True)
    want_r, want_c = quantize_mxfp8(x, axis=3), quantize_mxfp8(x, axis=2)
    assert torch.equal(as_bytes(got.row_swizzled), as_bytes(cudnn_buffers.row_scale_buffer(want_r.scale)))
    assert torch.equal(as_bytes(got.col_swizzled), as_bytes(cudnn_buffers.col_scale_bytes(want_c.scale)))


# --------------------------------------------------------------------------- accuracy (issue configs)


@pytest.mark.parametrize("name,B,hq,hkv,s,d,causal", [
    ("dense", 2, 4, 4, 1024, 128, False),
    ("causal", 2, 4, 4, 1024, 128, True),
    ("gqa4to1", 2, 4, 1, 1024, 128, False),
    ("gqa4to1_causal", 2, 4, 1, 1024, 128, True),
    ("s1000", 2, 4, 4, 1000, 128, False),
    ("s1000_causal", 2, 4, 4, 1000, 128, True),
])
def test_accuracy_against_ref(name, B, hq, hkv, s, d, causal):
    _, _, _, errs, within, omax = _check_against_ref(B, hq, hkv, s, s, d, MaskSpec(causal=causal), seed=11)
    print(f"{name}: O max abs {omax:.3g}, within 1 ulp {within:.5f}, grads rel-RMS {errs}")


@pytest.mark.parametrize("sq,skv,align,left,right,causal", [
    (300, 1000, "bottom_right", None, None, True),
    (1000, 300, "bottom_right", None, None, True),   # rows that keep nothing
    (500, 500, "top_left", 100, None, True),         # causal sliding window
    (400, 700, "top_left", 64, 50, False),           # band
    (257, 257, "bottom_right", 1, None, True),       # diagonal only
    (333, 200, "top_left", None, 17, False),
])
def test_masks_against_ref(sq, skv, align, left, right, causal):
    mask = MaskSpec(causal=causal, diagonal_alignment=align, left_bound=left, right_bound=right)
    o, stats, (dq, _, _), _, _, _ = _check_against_ref(1, 4, 2, sq, skv, 64, mask, seed=5)
    keep = mask.keep(sq, skv, device="cuda")
    empty = ~keep.any(dim=1)
    if empty.any():
        assert torch.all(o[:, :, empty] == 0)
        assert torch.all(torch.isneginf(stats[:, :, empty]))
        assert torch.all(dq[:, :, empty] == 0)


@pytest.mark.parametrize("d", [32, 64, 96, 192, 256])
def test_head_dims_against_ref(d):
    _check_against_ref(1, 2, 1, 300, 300, d, MaskSpec(causal=True), seed=d)


def test_fp16_and_sbhd_layout():
    _check_against_ref(1, 4, 2, 384, 384, 128, MaskSpec(causal=False), dtype=torch.float16, layout="sbhd", seed=2)


# --------------------------------------------------------------------------- determinism, layouts, errors


def test_deterministic_and_layout_independent():
    be = triton_backend()
    mask = MaskSpec(causal=True)
    params = AttentionParams(softmax_scale=0.1, mask=mask)
    q, k, v, do = _make(2, 8, 2, 1000, 1000, 128, layout="bshd", seed=7)
    runs = []
    for _ in range(2):
        o, st, sv = be.forward(q, k, v, params)
        runs.append((o, st) + be.backward(sv, o, st, do, params))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    qc, kc, vc, doc = (t.contiguous() for t in (q, k, v, do))
    o, st, sv = be.forward(qc, kc, vc, params)
    grads = be.backward(sv, o, st, doc, params)
    for a, b in zip(runs[0], (o, st) + grads):
        assert torch.equal(a.contiguous(), b.contiguous())


def test_backward_paths_agree(monkeypatch):
    """The backward's two data paths (bf16 scratch per head chunk, chosen by default; FP8 streamed with on-chip
    dequantization, chosen when one head's scratch is too large) give the same numbers."""
    from mxattn.kernels import triton_attention_bwd as tb
    be = triton_backend()
    params = AttentionParams(softmax_scale=0.09, mask=MaskSpec(causal=True, left_bound=300))
    q, k, v, do = _make(2, 8, 4, 700, 700, 128, seed=9)
    o, st, sv = be.forward(q, k, v, params)
    assert tb.bwd_streams_bf16(2, 8, 4, 700, 700, 128)
    outs = {"pre": be.backward(sv, o, st, do, params)}
    monkeypatch.setattr(tb, "bwd_streams_bf16", lambda *a: False)
    outs["fp8"] = be.backward(sv, o, st, do, params)
    for a, b in zip(outs["pre"], outs["fp8"]):
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= 2 * _bf16_ulp(a.float().abs().max()).item(), diff


def test_backward_head_chunks_do_not_change_results(monkeypatch):
    """The "pre" backward's chunks of KV heads (balanced, when the scratch of all heads passes the budget)
    partition the work only: gradients bit-identical to one chunk, for 2 + 2 + 3 and 1-head chunks (GQA 2:1,
    causal, S not a multiple of the tiles)."""
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import triton_attention_bwd as tb
    # the budget is a module constant that launch plans do not key on: this test changes it between calls
    monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)
    be = triton_backend()
    B, hq, hkv, S, D = 2, 14, 7, 300, 64
    params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True))
    q, k, v, do = _make(B, hq, hkv, S, S, D, seed=11)
    o, st, sv = be.forward(q, k, v, params)
    one_chunk = be.backward(sv, o, st, do, params)
    per_head = tb._pre_scratch_per_kv_head(B, hq // hkv, S, S, D)
    real_launch = tb.launch
    for heads_per_chunk, chunks in ((3, 3), (1, 7)):
        dkdv = []

        def spy(fn, grid, *a, **kw):
            if fn.__name__ == "_dkdv_kernel":
                dkdv.append(grid[1] // B)
            real_launch(fn, grid, *a, **kw)
        monkeypatch.setattr(tb, "launch", spy)
        monkeypatch.setattr(tb, "SCRATCH_BUDGET_BYTES", heads_per_chunk * per_head)
        chunked = be.backward(sv, o, st, do, params)
        assert len(dkdv) == chunks and sum(dkdv) == hkv and max(dkdv) - min(dkdv) <= 1
        for a, b in zip(one_chunk, chunked):
            assert torch.equal(a, b)


def test_on_chip_dequantization_is_exact_for_every_byte_and_scale():
    """The kernels' integer E4M3 -> BF16 widening times the E8M0 factors equals E4M3 * 2^(e - 127) computed in
    FP64 for all 256 bytes and every scale whose products are representable in BF16 (spec section 8), and
    round_p_to_bf16 equals torch's RNE cast to E4M3 on P * 256 values over [0, 448]."""
    import triton
    import triton.language as tl
    from mxattn.kernels.triton_quantize import dequant_rows, round_p_to_bf16
    triton_backend()

    @triton.jit
    def deq(X, S, Y, R: tl.constexpr):
        r = tl.arange(0, R)[:, None]
        c = tl.arange(0, 256)[None, :]
        x = tl.load(X + r * 256 + c)
        s = tl.load(S + r * 8 + tl.arange(0, 8)[None, :])
        tl.store(Y + r * 256 + c, dequant_rows(x, s, R, 256))

    @triton.jit
    def rnd(P, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, round_p_to_bf16(tl.load(P + i)))

    scales = torch.arange(0, 255, dtype=torch.int64)
    rows = scales.numel()
    r = triton.next_power_of_2(rows)
    xp = torch.zeros(r, 256, dtype=torch.uint8, device="cuda")
    sp = torch.full((r, 8), 127, dtype=torch.uint8, device="cuda")
    xp[:rows] = torch.arange(256, device="cuda").to(torch.uint8)
    xp[:, 0x7F] = 0
    xp[:, 0xFF] = 0  # the E4M3 NaN patterns
    sp[:rows] = scales.view(-1, 1).to(torch.uint8).cuda()
    y = torch.empty(r, 256, dtype=torch.bfloat16, device="cuda")
    deq[(1,)](xp.view(torch.float8_e4m3fn), sp, y, R=r)
    want = xp[:rows].view(torch.float8_e4m3fn).double() * torch.exp2(scales.double() - 127).cuda().view(-1, 1)
    got = y[:rows].double()
    representable = (want == want.to(torch.bfloat16).double()) & (want.abs() < 2.0 ** 127)
    assert representable.float().mean() > 0.9
    assert torch.equal(got[representable], want[representable])

    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.cat([torch.rand(1 << 16, generator=g, device="cuda") * 448,
                   torch.rand(1 << 16, generator=g, device="cuda") * 2.0 ** -5,
                   torch.tensor([0.0, 448.0, 2.0 ** -10, 2.0 ** -9, 0.015625, 255.9], device="cuda")])
    n = triton.next_power_of_2(p.numel())
    pp = torch.zeros(n, device="cuda")
    pp[:p.numel()] = p
    yp = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    rnd[(1,)](pp, yp, N=n)
    assert torch.equal(yp[:p.numel()].float(), p.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_input_gives_nan_where_it_reaches(where):
    """As the README promises (and `ref` does): a NaN in Q makes its row of O NaN; a NaN in K or V makes every
    row that attends to it NaN (here all, no mask); rows it cannot reach stay finite."""
    be = triton_backend()
    q, k, v, _ = _make(1, 2, 2, 200, 200, 64, seed=4)
    {"q": q, "k": k, "v": v}[where][0, 0, 37, 5] = float("nan")
    params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(), out_dtype=torch.bfloat16)
    o, stats, _ = be.forward(q, k, v, params)
    nan_rows = o[0, 0].isnan().any(-1)
    if where == "q":
        assert nan_rows[37] and nan_rows.sum() == 1 and o[0, 0, 37].isnan().all()
        assert stats[0, 0, 37].isnan().all() and not stats[0, 0, 36].isnan().any()
    else:
        assert nan_rows.all()
    assert not o[0, 1].isnan().any()  # the other head never sees it


def test_inference_forward_makes_only_the_forward_copies(monkeypatch):
    """Without a gradient the triton backend quantizes Q and K row-wise only and V column-wise only (no copies
    for a backward that will not run), with the same O as a call that keeps them."""
    import mxattn
    from mxattn.kernels import triton_quantize as tq
    triton_backend()
    q, k, v, _ = _make(2, 4, 2, 300, 300, 128, seed=9)
    kinds = []
    real = tq._prepare
    monkeypatch.setattr(tq, "_prepare", lambda x, **kw: kinds.append((kw["row"], kw["col"])) or real(x, **kw))
    with torch.no_grad():
        o_inf = mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="triton")
    assert kinds == [(True, False), (True, False), (True, True)]  # (V: row=True as col_dequant needs it)
    kinds.clear()
    qg = q.clone().requires_grad_()
    o_grad = mxattn.mxfp8_attention(qg, k, v, qkv_format="bhsd", attn_mask_type="causal", backend="triton")
    assert kinds == [(True, True), (True, True), (True, True)]
    assert torch.equal(o_inf, o_grad.detach())


@pytest.mark.parametrize("shape", [(1, 2, 128, 64), (2, 3, 333, 128), (1, 2, 160, 96)])
def test_quantizer_bytes_do_not_depend_on_the_outputs_requested(shape):
    """Every output of quantize_rowcol is the same whichever others are requested (the backend asks for
    different sets in training and inference), and the bf16 copies equal the dequantized MXFP8 tensors."""
    from mxattn.kernels.triton_quantize import quantize_rowcol
    triton_backend()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = _special(torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * 3)
    full = quantize_rowcol(x, row_dequant=True, col_dequant=True)
    assert same_values(full.col_dequant, full.col.dequantize(torch.bfloat16))
    assert same_values(full.row_dequant, full.row.dequantize(torch.bfloat16))
    for kw in (dict(row=False), dict(col=False), dict(col=False, row_dequant=True), dict(col_dequant=True),
               dict(row=False, col_seq_major=True), dict(col_seq_major=True)):
        got = quantize_rowcol(x, **kw)
        for name in ("row", "col"):
            a, b = getattr(got, name), getattr(full, name)
            if a is not None:
                assert torch.equal(as_bytes(a.data), as_bytes(b.data)) and torch.equal(as_bytes(a.scale), as_bytes(b.scale)), (kw, name)
        for name in ("row_dequant", "col_dequant"):
            if getattr(got, name) is not None:
                assert same_values(getattr(got, name), getattr(full, name)), (kw, name)
        if got.col_seq_major is not None:
            assert torch.equal(as_bytes(got.col_seq_major.data)[..., :shape[2]], as_bytes(full.col.data).transpose(2, 3))
    with pytest.raises(ValueError, match="col_dequant needs row=True"):
        quantize_rowcol(x, row=False, col_dequant=True)


@pytest.mark.parametrize("kind", ["dense_gqa_cross", "padded", "packed", "empty_kv"])
def test_quantize_qkv_equals_three_calls(kind):
    """The forward's one-launch quantization of Q, K and V writes the bytes and bf16 copies of three
    `quantize_rowcol` calls with the same options (tensors of different lengths and head counts, variable
    lengths, the seq-major V copy, an empty K/V)."""
    from mxattn.kernels.triton_quantize import quantize_qkv, quantize_rowcol
    from mxattn.seqinfo import SeqInfo
    triton_backend()
    g = torch.Generator(device="cuda").manual_seed(4)
    qa, kva = {}, {}
    if kind == "packed":
        cu_q = torch.tensor([0, 5, 70, 200], dtype=torch.int32, device="cuda")
        cu_kv = torch.tensor([0, 33, 33, 100], dtype=torch.int32, device="cuda")
        q = torch.randn(200, 4, 64, device="cuda", generator=g).permute(1, 0, 2).unsqueeze(0)
        k, v = (torch.randn(100, 2, 64, device="cuda", generator=g).permute(1, 0, 2).unsqueeze(0) for _ in range(2))
        qa = dict(cu_seqlens=cu_q, max_seqlen=130, packed=True)
        kva = dict(cu_seqlens=cu_kv, max_seqlen=67, packed=True)
    else:
        skv = 0 if kind == "empty_kv" else 333
        q = _special(torch.randn(2, 4, 200, 128, device="cuda", dtype=torch.bfloat16, generator=g))
        k, v = (torch.randn(2, 2, skv, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        if kind == "padded":
            qa = dict(cu_seqlens=torch.tensor([0, 150, 350], dtype=torch.int32, device="cuda"))
            kva = dict(cu_seqlens=torch.tensor([0, 333, 400], dtype=torch.int32, device="cuda"))
    for v_opts in (dict(row=True, col_dequant=True), dict(row=False, col_seq_major=True)):
        opts = (dict(qa), dict(kva, row_dequant=True), dict(kva, **v_opts))
        got = quantize_qkv(q, k, v, *opts)
        for x, o, res in zip((q, k, v), opts, got):
            exp = quantize_rowcol(x, **o)
            for name in ("row", "col"):
                a, b = getattr(res, name), getattr(exp, name)
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(as_bytes(a.data), as_bytes(b.data)), (kind, name)
                    assert torch.equal(as_bytes(a.scale), as_bytes(b.scale)), (kind, name)
            for name in ("row_dequant", "col_dequant"):
                a, b = getattr(res, name), getattr(exp, name)
                assert (a is None) == (b is None) and (a is None or same_values(a, b)), (kind, name)
            if exp.col_seq_major is not None:
                cols = slice(None)
                if kind == "packed":  # only the columns of sequences' blocks are written
                    cu = o["cu_seqlens"].tolist()
                    cols = [(c // 32 + b) * 32 + j for b, (c, n) in enumerate(zip(cu, cu[1:]))
                            for j in range(-(-(n - c) // 32) * 32)]
                assert torch.equal(as_bytes(res.col_seq_major.data)[..., cols],
                                   as_bytes(exp.col_seq_major.data)[..., cols])
                assert torch.equal(as_bytes(res.col_seq_major.scale), as_bytes(exp.col_seq_major.scale))
    with pytest.raises(ValueError, match="share tile"):
        quantize_qkv(q, k, v, dict(qa, tile=(64, 4)), kva, kva)
