"""The cudnn backend's host path up to the graph execution (graphs neither planned nor executed: the
`captured_packs` fixture keeps the variant packs that would reach cuDNN), through the public API, eager and
compiled, dense and padded:

* every FP8 and scale slot holds what `mxattn.formats` + `mxattn.backends.cudnn.buffers` make from the inputs (on the CPU
  with torch ops; on a CUDA GPU the fused Triton quantizer writes the same bytes, compared slot by slot);
* the backward hands cuDNN the forward's F8_128x4 scale tensors (the same memory, no second swizzle);
* the saved format's fake tensors (torch.compile) are shaped, typed and strided as the real ones.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("cudnn")

import mxattn  # noqa: E402
from mxattn.backends.cudnn import buffers as cudnn_buffers  # noqa: E402
from mxattn.backends.cudnn import backend as cb  # noqa: E402
from mxattn.backends.cudnn.config import BwdUid, FwdUid  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from cudnn_fixtures import captured_packs  # noqa: E402,F401

#: slots the host path fills from the inputs (the others are outputs, or the forward's uninitialised O and stats
#: that reach the backward because nothing executed)
FWD_INPUTS = (FwdUid.Q, FwdUid.K, FwdUid.V, FwdUid.SF_Q, FwdUid.SF_K, FwdUid.SF_V, FwdUid.SEQ_LEN_Q,
              FwdUid.SEQ_LEN_KV)
BWD_INPUTS = (BwdUid.Q, BwdUid.Q_T, BwdUid.K, BwdUid.K_T, BwdUid.V, BwdUid.DO_F16, BwdUid.DO, BwdUid.DO_T,
              BwdUid.SF_Q, BwdUid.SF_Q_T, BwdUid.SF_K, BwdUid.SF_K_T, BwdUid.SF_V, BwdUid.SF_DO, BwdUid.SF_DO_T)
#: backward scale slots that must be the forward's saved tensors (uid in the backward, uid in the forward)
SAME_MEMORY = ((BwdUid.SF_Q, FwdUid.SF_Q), (BwdUid.SF_K, FwdUid.SF_K))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of t (any strides) as int16 codes of their bytes, t's shape (comparable across dtypes)."""
    return t.contiguous().view(torch.uint8).to(torch.int16) if t.element_size() == 1 else t


def _inputs(device, padded: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s, skv, h, hkv, d = 2, 200, 160, 4, 2, 64
    q = torch.randn(b, s, h, d, generator=g).bfloat16().to(device)
    kv = torch.randn(b, skv, 2, hkv, d, generator=g).bfloat16().to(device)
    k, v = kv.unbind(2)                                    # views, as a fused KV projection gives them
    do = torch.randn(b, s, h, d, generator=g).bfloat16().to(device)
    kw = dict(qkv_format="bshd", attn_mask_type="padding_causal_bottom_right" if padded else "causal")
    if padded:
        kw.update(cu_seqlens_q=torch.tensor([0, 150, 350], dtype=torch.int32, device=device),
                  cu_seqlens_kv=torch.tensor([0, 100, 260], dtype=torch.int32, device=device),
                  max_seqlen_q=s, max_seqlen_kv=skv)
    return q, k, v, do, kw


def _run(q, k, v, do, kw, packs, compiled=False):
    """Forward + backward through the public API with backend="cudnn"; the (forward, backward) packs."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))

    def fn(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, backend="cudnn", **kw)

    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    packs.clear()
    fn(q, k, v).backward(do)
    kinds = [kind for kind, _, _ in packs]
    assert kinds == ["forward", "backward"], kinds
    return packs[0][2], packs[1][2]


def _zeroed(x: torch.Tensor, cu, n_rows):
    """x [B, H, S, D] with the rows past each length of cu set to 0 (the reference backend's padding rule)."""
    if cu is None:
        return x
    lengths = (cu[1:] - cu[:-1]).long()
    keep = torch.arange(n_rows, device=x.device)[None, :] < lengths[:, None]
    return x.masked_fill(~keep[:, None, :, None], 0)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("device", DEVICES)
def test_packs_hold_the_quantized_inputs_and_reuse_the_forward_scales(device, padded, captured_packs):
    q, k, v, do, kw = _inputs(device, padded)
    fwd, bwd = _run(q, k, v, do, kw, captured_packs)
    bhsd = {name: _zeroed(x.transpose(1, 2), kw.get(cu), x.shape[1]) for name, x, cu in
            (("q", q, "cu_seqlens_q"), ("k", k, "cu_seqlens_kv"), ("v", v, "cu_seqlens_kv"),
             ("do", do, "cu_seqlens_q"))}
    row = {n: quantize_mxfp8(x, axis=-1) for n, x in bhsd.items()}
    col = {n: quantize_mxfp8(x, axis=-2) for n, x in bhsd.items()}
    want = {FwdUid.Q: row["q"].data, FwdUid.K: row["k"].data, FwdUid.V: col["v"].data,
            FwdUid.SF_Q: cudnn_buffers.row_scale_buffer(row["q"].scale), FwdUid.SF_K: cudnn_buffers.row_scale_buffer(row["k"].scale),
            FwdUid.SF_V: cudnn_buffers.col_scale_buffer(col["v"].scale),
            BwdUid.Q: row["q"].data, BwdUid.Q_T: col["q"].data, BwdUid.K: row["k"].data, BwdUid.K_T: col["k"].data,
            BwdUid.V: row["v"].data, BwdUid.DO: row["do"].data, BwdUid.DO_T: col["do"].data,
            BwdUid.DO_F16: bhsd["do"],
            BwdUid.SF_Q: cudnn_buffers.row_scale_buffer(row["q"].scale), BwdUid.SF_Q_T: cudnn_buffers.col_scale_buffer(col["q"].scale),
            BwdUid.SF_K: cudnn_buffers.row_scale_buffer(row["k"].scale), BwdUid.SF_K_T: cudnn_buffers.col_scale_buffer(col["k"].scale),
            BwdUid.SF_V: cudnn_buffers.row_scale_buffer(row["v"].scale), BwdUid.SF_DO: cudnn_buffers.row_scale_buffer(row["do"].scale),
            BwdUid.SF_DO_T: cudnn_buffers.col_scale_buffer(col["do"].scale)}
    for uid, expected in want.items():
        got = (fwd if isinstance(uid, FwdUid) else bwd)[uid]
        assert got.shape == expected.shape, uid
        if uid in (FwdUid.SF_V, BwdUid.SF_Q_T, BwdUid.SF_K_T, BwdUid.SF_DO_T):
            assert got.stride() == expected.stride(), uid          # the declared column-scale strides
        assert torch.equal(_bytes(got), _bytes(expected)), uid
    for b_uid, f_uid in SAME_MEMORY:
        assert bwd[b_uid].data_ptr() == fwd[f_uid].data_ptr(), b_uid


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_call_sends_the_eager_bytes(device, padded, captured_packs):
    """Under torch.compile the saved format crosses the custom ops as fake tensors first: the compiled
    forward+backward reaches cuDNN with the eager call's bytes in every input slot."""
    q, k, v, do, kw = _inputs(device, padded, seed=1)
    eager = _run(q, k, v, do, kw, captured_packs)
    compiled = _run(q, k, v, do, kw, captured_packs, compiled=True)
    for uids, e, c in ((FWD_INPUTS, eager[0], compiled[0]), (BWD_INPUTS, eager[1], compiled[1])):
        for uid in uids:
            if uid in e:
                assert torch.equal(_bytes(e[uid]), _bytes(c[uid])), uid


@pytest.mark.parametrize("dims", [(64, 64), (192, 128)], ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_saved_format_fake_tensors_match_the_real_ones(packed, dims, captured_packs):
    from mxattn.backends.base import AttentionParams
    from mxattn.mask import MaskSpec
    from mxattn.seqinfo import SeqInfo
    g = torch.Generator().manual_seed(2)
    if packed:
        cu = torch.tensor([0, 40, 100], dtype=torch.int32)
        seq = SeqInfo(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=60, max_seqlen_kv=60, packed=True)
        shape = (1, 4, 100)
    else:
        seq, shape = None, (2, 4, 200)
    q, k, v = (torch.randn(*shape, d, generator=g).bfloat16() for d in (dims[0], dims[0], dims[1]))
    params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True), seq=seq, needs_backward=True)
    _, _, saved = cb.CudnnBackend().forward(q, k, v, params)
    real = saved.tensors()
    fake = cb.SavedWithScaleBuffers.fake_tensors(q, k, v, seq)
    assert len(real) == len(fake) == (10 if packed else 15)
    for i, (r, f) in enumerate(zip(real, fake)):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), i
    back = cb.SavedWithScaleBuffers.from_tensors(real, seq)
    assert [t.data_ptr() for t in back.tensors()] == [t.data_ptr() for t in real]


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_fused_quantizer_sends_the_torch_path_bytes(padded, captured_packs, monkeypatch):
    """On CUDA the fused Triton quantizer makes the operands; with it switched off the torch ops do: every input
    slot of both graphs holds the same values, the scale slots with the same (declared) strides. FP8 data may be
    laid out differently on the two routes: each graph config follows its data's strides."""
    q, k, v, do, kw = _inputs("cuda", padded, seed=3)
    if cb._fused_quantizer() is None:
        pytest.skip("Triton cannot be imported here")
    fused = _run(q, k, v, do, kw, captured_packs)
    monkeypatch.setattr(cb, "_fused_quantizer", lambda: None)
    torch_ops = _run(q, k, v, do, kw, captured_packs)
    for uids, a, b in ((FWD_INPUTS, fused[0], torch_ops[0]), (BWD_INPUTS, fused[1], torch_ops[1])):
        for uid in uids:
            if uid in a:
                if uid.name.startswith("SF_"):
                    assert a[uid].stride() == b[uid].stride(), uid
                assert torch.equal(_bytes(a[uid]), _bytes(b[uid])), uid


def _thd_inputs(seed=4):
    g = torch.Generator().manual_seed(seed)
    len_q, len_kv = [100, 1, 60], [130, 40, 200]
    q = torch.randn(sum(len_q), 4, 64, generator=g).bfloat16()
    k, v = (torch.randn(sum(len_kv), 2, 64, generator=g).bfloat16() for _ in range(2))
    cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (len_q, len_kv)]
    return q, k, v, dict(qkv_format="thd", attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=cu[0],
                         cu_seqlens_kv=cu[1], softmax_type="learnable", softmax_offset=torch.tensor([0., 1, -1, 2]))


@pytest.mark.parametrize("kind", ["dense", "padded", "packed"])
def test_quantized_inputs_reach_the_forward_graph_as_the_unquantized_call_sends_them(kind, captured_packs):
    """`mxfp8_attention_quantized` (`CudnnBackend.forward_quantized`) on `quantize_attention_inputs`' bytes sends
    the forward graph the config and, in every input slot (data, F8_128x4 scales, lengths, ragged offsets, sink),
    the bytes of the unquantized call: cuDNN then computes the same O. (Padded: the FP8 data may be laid out
    otherwise, as on the fused quantizer's route: the unquantized call's zeroed copies are contiguous [B, H, S, D],
    quantize_attention_inputs keeps q's layout; the config follows the data's strides.)"""
    if kind == "packed":
        q, k, v, kw = _thd_inputs()
    else:
        q, k, v, _, kw = _inputs("cpu", kind == "padded", seed=5)
    quantized_kw = {n: kw[n] for n in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv") if n in kw}
    with torch.no_grad():
        mxattn.mxfp8_attention(q, k, v, backend="cudnn", **kw)
        mxattn.mxfp8_attention_quantized(*mxattn.quantize_attention_inputs(q, k, v, **quantized_kw), backend="cudnn",
                                         **kw)
    (kind_a, cfg_a, want), (kind_b, cfg_b, got) = captured_packs
    assert kind_a == kind_b == "forward"
    layouts_may_differ = kind == "padded"
    facts = [f.name for f in dataclasses.fields(cfg_a) if not (layouts_may_differ and f.name.endswith("_stride"))]
    assert [getattr(cfg_a, f) for f in facts] == [getattr(cfg_b, f) for f in facts]
    outputs = (FwdUid.O, FwdUid.STATS, FwdUid.AMAX_O)
    assert set(got) == set(want) and len(set(got) - set(outputs)) >= (8 if kind == "packed" else 6)
    for uid in set(got) - set(outputs):
        assert got[uid].shape == want[uid].shape, uid
        if not (layouts_may_differ and uid in (FwdUid.Q, FwdUid.K, FwdUid.V)):
            assert got[uid].stride() == want[uid].stride(), uid
        assert torch.equal(_bytes(got[uid]), _bytes(want[uid])), uid


@pytest.mark.parametrize("which", ["q", "kv"])
def test_padded_operands_are_the_reference_backends_bytes(which):
    """On a padded batch the cudnn backend's torch-op quantizer (`quantize_operand` on the CPU) makes the reference
    backend's bytes (`recipe_operands.quantize_rowcol`, default recipe) from inputs with NaN on the padding rows:
    both zero padding with `seqinfo.zero_padding`."""
    from mxattn.backends import recipe_operands
    from mxattn.recipe import Recipe
    from mxattn.seqinfo import SeqInfo
    cu = torch.tensor([0, 37, 37, 101], dtype=torch.int32)  # lengths 37, 0, 64
    seq = SeqInfo(cu, cu, 64, 64, False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2, 64, 64, generator=gen).masked_fill(~seq.valid_rows(which, 64), float("nan"))
    mine = cb.quantize_operand(x, seq, which)
    ref = recipe_operands.quantize_rowcol(x, seq, which, Recipe())
    for a, b in zip(mine, ref):
        assert a.axis == b.axis
        assert torch.equal(_bytes(a.data), _bytes(b.data)) and torch.equal(_bytes(a.scale), _bytes(b.scale))
