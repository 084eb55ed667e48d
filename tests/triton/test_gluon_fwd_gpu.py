"""The Gluon Hopper forward (`mxattn.kernels.gluon_attention_fwd`) against the Triton forward on identical
quantized operands, on an sm_90 GPU; and, on any machine with Triton, that the kernel compiles for sm_90a
without register spills.

Both kernels read the same bytes (the fused quantizer's Q and K row-wise copies and V's seq-major column-wise
copy, i.e. the Triton forward's FP8 data path) and run the same arithmetic per element; only the FP32 sums of the
tensor-core products and of the row sums may round differently, so O must agree within one bf16 ulp in >= 99.9%
of its elements and the stats closely.
"""

import importlib.util
import math

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _quantized(B, HQ, HKV, S, D, layout, g, SKV=None, kv="fp8"):
    """(q_data, q_scale, k_data, k_scale, v) from the fused quantizer, laid out bhsd or (layout "bshd") as
    [B, S, H, D] memory viewed as [B, H, S, D]; S query rows and SKV (default S) keys. kv "fp8": K's FP8 bytes and
    scales, V as SeqMajorColumns (its data as [B, D, H, L] memory in bshd); kv "bf16": the bf16-scratch path's
    operands, K's and V's exact bf16 dequantizations [B, HKV, SKV, D] (row-wise K, column-wise V) and k_scale
    None."""
    from mxattn.kernels.triton_quantize import SeqMajorColumns, quantize_qkv
    SKV = S if SKV is None else SKV
    q, k, v = (torch.randn(B, h, n, D, device="cuda", generator=g).to(torch.bfloat16)
               for h, n in ((HQ, S), (HKV, SKV), (HKV, SKV)))
    if kv == "bf16":
        qq, kq, vq = quantize_qkv(q, k, v, dict(col=False), dict(col=False, row_dequant=True),
                                  dict(row=True, col=True, col_dequant=True))
        qd, qs, kd, ks, v_arg = qq.row.data, qq.row.scale, kq.row_dequant, None, vq.col_dequant
    else:
        qq, kq, vq = quantize_qkv(q, k, v, dict(col=False), dict(col=False), dict(row=False, col_seq_major=True))
        qd, qs, kd, ks, v_arg = qq.row.data, qq.row.scale, kq.row.data, kq.row.scale, vq.col_seq_major
    if layout == "bshd":
        def bshd(t):  # a byte copy (CUDA copies have no kernel for every float8 dtype)
            return t.view(torch.uint8).transpose(1, 2).contiguous().transpose(1, 2).view(t.dtype)
        qd, qs, kd = bshd(qd), bshd(qs), bshd(kd)
        if kv == "bf16":
            v_arg = v_arg.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            ks, v_arg = bshd(ks), SeqMajorColumns(bshd(v_arg.data), bshd(v_arg.scale))
        assert qd.stride(1) == D
    return qd, qs, kd, ks, v_arg


def _outputs(B, HQ, S, D, layout):
    if layout == "bshd":
        out = torch.empty(B, S, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        out = torch.empty(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
    return out, torch.empty(B, HQ, S, 1, device="cuda", dtype=torch.float32)


def _ordered_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers ordered like the values (neighbouring bf16 values differ by 1)."""
    i = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def _assert_like_triton(o, st, o_ref, s_ref):
    """O within one bf16 ulp of the Triton forward's in >= 99.9% of its elements (and at rounding level of O's
    scale elsewhere), the stats close (equal infinities: rows without keys)."""
    ulps = (_ordered_bf16(o) - _ordered_bf16(o_ref)).abs()
    share = (ulps <= 1).float().mean().item()
    assert share >= 0.999, f"{share:.5f} of O within 1 bf16 ulp (max {ulps.max().item()} ulps)"
    assert (o.float() - o_ref.float()).abs().max() <= 1e-2 * o_ref.float().abs().max()
    torch.testing.assert_close(st, s_ref, rtol=1e-5, atol=1e-5)


#: (sink logits per query head, up to 8 heads: large and small ones; a sink of 8 dominates rows of N(0, 1) logits)
SINKS = (-30.0, -2.0, 0.5, 4.0, 8.0, -8.0, 1.0, 0.0)
#: (case, Sq, Skv, offset, left_bound, right_bound, sink): windows narrower than a block, of about one block and
#: spanning several, with and without the causal edge, Sq != Skv (bottom-right offsets and a negative one that
#: leaves the first rows without keys), alone and with sinks
SINK_WINDOW_CASES = [
    ("sink", 1000, 1000, 0, None, None, True),
    ("sink_causal", 700, 1000, 300, None, 0, True),
    ("sink_causal_empty_rows", 600, 500, -150, None, 0, True),
    ("window_small_causal", 1000, 1000, 0, 50, 0, False),
    ("window_one_block_causal", 700, 1000, 300, 128, 0, False),
    ("window_129", 1000, 777, 0, 129, 0, False),
    ("window_multi_left_only", 1000, 1000, 0, 300, None, False),
    ("window_multi_causal_offset", 500, 1100, 600, 400, 0, False),
    ("window_right_edge", 1000, 1000, 0, 200, 64, False),
    ("window_empty_rows", 600, 500, -150, 77, 0, False),
    ("window_sink", 1000, 1000, 0, 200, 0, True),
    ("window_sink_empty_rows", 600, 500, -150, 300, 0, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("S", [1000, 2048])
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_gluon_fwd_matches_triton_fwd(D, causal, heads, layout, S, pingpong, kv):
    """The Gluon forward against the Triton forward on the same operands: FP8 K/V (its FP8 data path) or the bf16
    dequantizations of K and V (the bf16-scratch path, the bf16-K/V variant)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    g = torch.Generator(device="cuda").manual_seed(1234 + D + S + heads[1])
    HQ, HKV = heads
    B = 2
    qd, qs, kd, ks, vsm = _quantized(B, HQ, HKV, S, D, layout, g, kv=kv)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), offset=0, left_bound=None, right_bound=0 if causal else None)
    o_ref, s_ref = _outputs(B, HQ, S, D, layout)
    tf.attention_fwd(qd, qs, kd, ks, vsm, out=o_ref, stats=s_ref, **kw)
    o, st = _outputs(B, HQ, S, D, layout)
    stages = (gf.BF16_KV_STAGES[D], 1) if kv == "bf16" else gf.STAGES[D]
    gf.attention_fwd_gluon(qd, qs, kd, ks, vsm, out=o, stats=st, config=(*stages, pingpong), **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(st).all()
    ulps = (_ordered_bf16(o) - _ordered_bf16(o_ref)).abs()
    share = (ulps <= 1).float().mean().item()
    assert share >= 0.999, f"{share:.5f} of O within 1 bf16 ulp (max {ulps.max().item()} ulps)"
    # elsewhere (values near zero, where an ulp is tiny) the difference stays at rounding level of O's scale
    assert (o.float() - o_ref.float()).abs().max() <= 1e-2 * o_ref.float().abs().max()
    torch.testing.assert_close(st, s_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SINK_WINDOW_CASES, ids=[c[0] for c in SINK_WINDOW_CASES])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_gluon_fwd_sinks_and_windows_match_triton_fwd(case, D, heads, layout, kv):
    """Attention sinks and sliding windows (left bounds): the Gluon forward against the Triton forward on the same
    operands (FP8 K/V, or their bf16 dequantizations). Rows without keys (a negative offset under the causal
    edge) get O = 0 and stats -inf, or with a sink the sink's stats, in both."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    name, SQ, SKV, offset, lb, rb, with_sink = case
    HQ, HKV = heads
    B = 2
    g = torch.Generator(device="cuda").manual_seed(4321 + D + SQ + SKV + HKV)
    qd, qs, kd, ks, vsm = _quantized(B, HQ, HKV, SQ, D, layout, g, SKV=SKV, kv=kv)
    sink = torch.tensor(SINKS[:HQ], device="cuda") if with_sink else None
    kw = dict(softmax_scale=1.0 / math.sqrt(D), offset=offset, left_bound=lb, right_bound=rb, sink=sink)
    o_ref, s_ref = _outputs(B, HQ, SQ, D, layout)
    tf.attention_fwd(qd, qs, kd, ks, vsm, out=o_ref, stats=s_ref, **kw)
    o, st = _outputs(B, HQ, SQ, D, layout)
    gf.attention_fwd_gluon(qd, qs, kd, ks, vsm, out=o, stats=st, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    _assert_like_triton(o, st, o_ref, s_ref)
    if offset < 0 and rb is not None:  # rows r < -offset - rb meet no key
        empty = -offset - rb
        assert (o[:, :, :empty] == 0).all()
        if with_sink:
            torch.testing.assert_close(st[:, :, :empty, 0], sink.view(1, HQ, 1).expand(B, HQ, empty))
        else:
            assert (st[:, :, :empty] == float("-inf")).all()


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "free"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_gluon_fwd_windows_of_every_width_match_triton_fwd(D, pingpong, kv):
    """Sliding windows of widths 1 to a few blocks (the first visited block and the split between the masked and
    mask-free loops move with them), causal and not, with a sink on every other call, for both schedules."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    g = torch.Generator(device="cuda").manual_seed(77 + D)
    B, HQ, HKV, SQ, SKV = 1, 2, 1, 640, 900
    qd, qs, kd, ks, vsm = _quantized(B, HQ, HKV, SQ, D, "bhsd", g, SKV=SKV, kv=kv)
    for i, (lb, rb) in enumerate([(1, 0), (2, 0), (63, 0), (64, 0), (127, 0), (128, 0), (129, 0), (192, 0),
                                  (256, 0), (257, 5), (385, None), (700, 0), (1, None), (1000, None)]):
        sink = torch.tensor([1.5, -3.0], device="cuda") if i % 2 else None
        kw = dict(softmax_scale=0.125, offset=SKV - SQ, left_bound=lb, right_bound=rb, sink=sink)
        o_ref, s_ref = _outputs(B, HQ, SQ, D, "bhsd")
        tf.attention_fwd(qd, qs, kd, ks, vsm, out=o_ref, stats=s_ref, **kw)
        o, st = _outputs(B, HQ, SQ, D, "bhsd")
        stages = (gf.BF16_KV_STAGES[D], 1) if kv == "bf16" else gf.STAGES[D]
        gf.attention_fwd_gluon(qd, qs, kd, ks, vsm, out=o, stats=st, config=(*stages, pingpong), **kw)
        torch.cuda.synchronize()
        _assert_like_triton(o, st, o_ref, s_ref)


@pytest.mark.gpu
def test_gluon_fwd_offset_and_short_kv():
    """A causal band with a dense caller's offset (bottom-right: Skv - Sq) and a KV length that is not a multiple
    of the block (TMA zero fill past the end, scales 127 there)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    from mxattn.kernels.triton_quantize import quantize_qkv
    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, SQ, SKV, D = 1, 4, 300, 777, 128
    q = torch.randn(B, H, SQ, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, H, SKV, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    qq, kq, vq = quantize_qkv(q, k, v, dict(col=False), dict(col=False), dict(row=False, col_seq_major=True))
    for rb in (None, 0):
        kw = dict(softmax_scale=0.1, offset=SKV - SQ, left_bound=None, right_bound=rb)
        outs = []
        for fn in (tf.attention_fwd, gf.attention_fwd_gluon):
            o = torch.empty(B, H, SQ, D, device="cuda", dtype=torch.bfloat16)
            st = torch.empty(B, H, SQ, 1, device="cuda", dtype=torch.float32)
            fn(qq.row.data, qq.row.scale, kq.row.data, kq.row.scale, vq.col_seq_major, out=o, stats=st, **kw)
            outs.append((o, st))
        torch.cuda.synchronize()
        (o_ref, s_ref), (o, st) = outs
        ulps = (_ordered_bf16(o) - _ordered_bf16(o_ref)).abs()
        assert (ulps <= 1).float().mean().item() >= 0.999
        torch.testing.assert_close(st, s_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_cached_gluon_launches_read_each_calls_tensors():
    """`triton_launch.launch` compiles once per signature and then launches the cached kernel with new TMA
    descriptors: calls on fresh tensors (new addresses) and new sequence lengths (a new descriptor shape: one
    dispatcher call each) read their own operands (O and stats as the Triton forward's on the same bytes), and a
    repeated shape hits the cache."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    from mxattn.runtime import triton_launch
    g = torch.Generator(device="cuda").manual_seed(99)
    B, HQ, HKV, D = 1, 4, 2, 128
    entries = []
    for S in (512, 512, 640, 1024, 512):
        qd, qs, kd, ks, vsm = _quantized(B, HQ, HKV, S, D, "bhsd", g)
        kw = dict(softmax_scale=1.0 / math.sqrt(D), offset=0, left_bound=None, right_bound=0)
        o_ref, s_ref = _outputs(B, HQ, S, D, "bhsd")
        tf.attention_fwd(qd, qs, kd, ks, vsm, out=o_ref, stats=s_ref, **kw)
        o, st = _outputs(B, HQ, S, D, "bhsd")
        gf.attention_fwd_gluon(qd, qs, kd, ks, vsm, out=o, stats=st, **kw)
        torch.cuda.synchronize()
        ulps = (_ordered_bf16(o) - _ordered_bf16(o_ref)).abs()
        assert (ulps <= 1).float().mean().item() >= 0.999, f"S={S}: max {ulps.max().item()} ulps"
        torch.testing.assert_close(st, s_ref, rtol=1e-5, atol=1e-5)
        entries.append(len(triton_launch._CACHES.get(id(gf._gluon_attn_fwd_kernel), {})))
    if triton_launch.fast_path_usable():  # one entry per descriptor shape: the repeated S 512 adds none
        assert entries[0] >= 1 and entries[1] == entries[0] and entries[-1] == entries[-2], entries


def test_gluon_fwd_refuses_unsupported_calls():
    """The launcher's ValueErrors (checked before anything touches a GPU); sinks and left bounds are taken, a sink
    that is not a contiguous fp32 [Hq] tensor is refused as the Triton forward refuses it; padded batches are
    taken, packed ones refused."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed here")
    from mxattn.kernels import gluon_attention_fwd as gf
    from mxattn.runtime.recipe_flags import KernelRecipe
    from mxattn.kernels.triton_quantize import SeqMajorColumns
    q = torch.zeros(1, 2, 64, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.zeros(1, 2, 64, 4, dtype=torch.uint8)
    v = SeqMajorColumns(torch.zeros(1, 2, 128, 64, dtype=torch.uint8).view(torch.float8_e4m3fn),
                        torch.zeros(1, 2, 2, 128, dtype=torch.uint8))
    out = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    st = torch.zeros(1, 2, 64, 1)
    base = dict(softmax_scale=0.1, offset=0, left_bound=None, right_bound=None, out=out, stats=st)
    cases = [(dict(sink=torch.zeros(3)), "sink must be"),
             (dict(sink=torch.zeros(2, dtype=torch.float16)), "sink must be"),
             (dict(flags=KernelRecipe(v_raw=True)), "v_operand='bf16'"),
             (dict(bottom_right=True), "variable-length"),
             (dict(out=out.float()), "bf16 or fp16 O")]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            gf.attention_fwd_gluon(q, s, q, s, v, **{**base, **extra})
    with pytest.raises(ValueError, match="v must be a bf16 tensor"):  # k_scale None: bf16 K and V
        gf.attention_fwd_gluon(q, s, q, None, v, **base)
    kb = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must both be"):
        gf.attention_fwd_gluon(q, s, kb, None, kb[:, :, :32], **base)
    with pytest.raises(ValueError, match="k_data must be a bf16 tensor"):
        gf.attention_fwd_gluon(q, s, kb.half(), None, kb, **base)
    q96 = torch.zeros(1, 2, 64, 96, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="head dims"):
        gf.attention_fwd_gluon(q96, s, q96, s, v, **base)
    # padded and packed batches (thd) are taken, with their own diagonal offsets
    from mxattn.seqinfo import SeqInfo
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    packed, padded = SeqInfo(cu, cu, 34, 34, True), SeqInfo(cu[:2], cu[:2], 30, 30, False)
    for seq in (packed, padded):
        assert gf.unsupported_reason(q, s, v, seq=seq) is None
        assert gf.unsupported_reason(q, s, v, seq=seq, bottom_right=True) is None


#: padded-batch cases (lengths of the queries and keys per batch entry, Sq / Skv the tensors' rows, mask, sink):
#: lengths ending mid-block, of one block and of zero, a query length below the keys' (bottom-right offsets), and
#: tiles wholly past a sequence's queries
PADDED_CASES = [
    ("dense_lengths", (1000, 77, 1024, 300), (1000, 77, 1024, 300), 1024, 1024, None, False, False),
    ("causal_top_left", (1000, 130, 1024, 1), (900, 130, 1024, 513), 1024, 1024, 0, False, False),
    ("causal_bottom_right", (200, 130, 1, 640), (900, 130, 1024, 640), 640, 1024, 0, True, False),
    ("empty_sequences", (0, 500, 128, 0), (700, 0, 128, 0), 512, 700, 0, True, False),
    ("sink_causal_bottom_right", (200, 1, 640, 33), (900, 128, 640, 700), 640, 1024, 0, True, True),
    ("window_causal", (1000, 400), (1000, 700), 1000, 1000, 0, False, False),
]


def _varlen_cases(test):
    """The padded and packed forward tests' cases: PADDED_CASES x head dims 64 / 128 x MHA / GQA x FP8 / bf16 K/V."""
    for mark in (pytest.mark.parametrize("kv", ["fp8", "bf16"]),
                 pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"]),
                 pytest.mark.parametrize("D", [64, 128]),
                 pytest.mark.parametrize("case", PADDED_CASES, ids=[c[0] for c in PADDED_CASES]), pytest.mark.gpu):
        test = mark(test)
    return test


def _varlen_operands(q, k, v, seq, kv):
    """The forward kernels' operands of a variable-length batch, quantized as the backend does (the quantizer told
    seq's lengths): (Q's data and scales, K's, V's) with kv "fp8" (K row-wise, V's seq-major copy) or "bf16" (the
    quantizer's exact dequantizations of K and V)."""
    from mxattn.kernels.triton_quantize import quantize_qkv
    from mxattn.seqinfo import quantizer_args
    aq, akv = quantizer_args(seq, "q"), quantizer_args(seq, "kv")
    if kv == "bf16":
        qq, kq, vq = quantize_qkv(q, k, v, dict(col=False, **aq), dict(col=False, row_dequant=True, **akv),
                                  dict(row=True, col=True, col_dequant=True, **akv))
        return qq.row.data, qq.row.scale, kq.row_dequant, None, vq.col_dequant
    qq, kq, vq = quantize_qkv(q, k, v, dict(col=False, **aq), dict(col=False, **akv),
                              dict(row=False, col_seq_major=True, **akv))
    return qq.row.data, qq.row.scale, kq.row.data, kq.row.scale, vq.col_seq_major


def _padded(B, HQ, HKV, SQ, SKV, D, lens_q, lens_kv, g, kv):
    """A padded batch's (seq, operands) as the backend quantizes it: randn rows everywhere (padding rows too),
    the quantizer told the lengths (padding rows quantized as zeros); kv "fp8" or "bf16" as `_quantized`."""
    from mxattn.seqinfo import SeqInfo
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    seq = SeqInfo(cu(lens_q), cu(lens_kv), max(lens_q), max(lens_kv), False)
    q, k, v = (torch.randn(B, h, n, D, device="cuda", generator=g).to(torch.bfloat16)
               for h, n in ((HQ, SQ), (HKV, SKV), (HKV, SKV)))
    return seq, _varlen_operands(q, k, v, seq, kv)


@_varlen_cases
def test_gluon_fwd_padded_batches_match_triton_fwd(case, D, heads, kv):
    """A padded batch (seq with packed False: sequence b is rows 0 .. len of batch b) on the Gluon forward against
    the Triton forward on the same operands and seq: O within one bf16 ulp, the stats close, padding rows O = 0
    and stats = -inf in both; and the backend's forward takes the Gluon kernel for it (`takes`)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    name, lens_q, lens_kv, SQ, SKV, rb, bottom_right, sink = case
    HQ, HKV = heads
    B = len(lens_q)
    g = torch.Generator(device="cuda").manual_seed(77 + D + HKV + len(name))
    seq, ops = _padded(B, HQ, HKV, SQ, SKV, D, lens_q, lens_kv, g, kv)
    kw = dict(softmax_scale=1.0 / math.sqrt(D), offset=0, left_bound=200 if name.startswith("window") else None,
              right_bound=rb, seq=seq, bottom_right=bottom_right,
              sink=torch.tensor(SINKS[:HQ], device="cuda") if sink else None)
    assert gf.takes(ops[0], ops[3], ops[4], k_data=ops[2], left_bound=kw["left_bound"], seq=seq,
                    bottom_right=bottom_right, sink=kw["sink"])
    o_ref, s_ref = _outputs(B, HQ, SQ, D, "bhsd")
    tf.attention_fwd(*ops, out=o_ref, stats=s_ref, **kw)
    o, st = _outputs(B, HQ, SQ, D, "bhsd")
    gf.attention_fwd_gluon(*ops, out=o, stats=st, **kw)
    torch.cuda.synchronize()
    _assert_like_triton(o, st, o_ref, s_ref)
    for b, n in enumerate(lens_q):  # padding rows
        assert (o[b, :, n:] == 0).all() and (st[b, :, n:] == float("-inf")).all()


def _packed(HQ, HKV, D, lens_q, lens_kv, g, kv, extra_rows=5, nan_in=None):
    """A packed batch's (seq, operands) as the backend quantizes it (thd as [1, H, T, D]; V's seq-major copy
    quantized per sequence), with extra_rows rows after the last sequence on both sides; nan_in: the index of a
    sequence whose V rows are all NaN (the others' numbers must not change: `test_gluon_fwd_packed_batches_...`)."""
    from mxattn.seqinfo import SeqInfo
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    seq = SeqInfo(cu(lens_q), cu(lens_kv), max(lens_q), max(lens_kv), True)
    tq, tkv = sum(lens_q) + extra_rows, sum(lens_kv) + extra_rows
    q, k, v = (torch.randn(1, h, n, D, device="cuda", generator=g).to(torch.bfloat16)
               for h, n in ((HQ, tq), (HKV, tkv), (HKV, tkv)))
    if nan_in is not None:
        c = seq.cu_seqlens_kv.tolist()
        v[:, :, c[nan_in]:c[nan_in + 1]] = float("nan")
    return seq, _varlen_operands(q, k, v, seq, kv)


@_varlen_cases
def test_gluon_fwd_packed_batches_match_triton_fwd(case, D, heads, kv):
    """A packed batch (thd: sequence b rows cu[b] .. cu[b + 1] of the tensors' batch 0) on the Gluon forward
    against the Triton forward on the same operands and seq: O within one bf16 ulp, the stats close, the rows
    after the last sequence untouched by both; the backend's forward takes the Gluon kernel for it (`takes`).
    Isolation: with every V row of the second sequence NaN, every other sequence's O and stats are the bits of
    the clean run (a KV block running past a sequence's keys never reads the next sequence's V)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_fwd as tf
    name, lens_q, lens_kv, _, _, rb, bottom_right, sink = case
    HQ, HKV = heads
    kw = dict(softmax_scale=1.0 / math.sqrt(D), offset=0, left_bound=200 if name.startswith("window") else None,
              right_bound=rb, bottom_right=bottom_right,
              sink=torch.tensor(SINKS[:HQ], device="cuda") if sink else None)
    runs = {}
    for nan_in in (None, 1):
        g = torch.Generator(device="cuda").manual_seed(91 + D + HKV + len(name))
        seq, ops = _packed(HQ, HKV, D, lens_q, lens_kv, g, kv, nan_in=nan_in)
        assert gf.takes(ops[0], ops[3], ops[4], k_data=ops[2], left_bound=kw["left_bound"], seq=seq,
                        bottom_right=bottom_right, sink=kw["sink"])
        T = ops[0].shape[2]
        o_ref, s_ref = _outputs(1, HQ, T, D, "bhsd")
        o, st = _outputs(1, HQ, T, D, "bhsd")
        for x in (o_ref, o):
            x.fill_(7.0)
        for x in (s_ref, st):
            x.fill_(5.0)
        tf.attention_fwd(*ops, out=o_ref, stats=s_ref, seq=seq, **kw)
        gf.attention_fwd_gluon(*ops, out=o, stats=st, seq=seq, **kw)
        torch.cuda.synchronize()
        end = sum(lens_q)
        assert (o[:, :, end:] == 7).all() and (st[:, :, end:] == 5).all()  # past the last sequence
        runs[nan_in] = (seq, o, st, o_ref, s_ref)
    seq, o, st, o_ref, s_ref = runs[None]
    _assert_like_triton(o, st, o_ref, s_ref)
    c = seq.cu_seqlens_q.tolist()
    _, o_nan, st_nan, o_ref_nan, _ = runs[1]
    for b in range(len(lens_q)):
        if b == 1:
            continue
        rows = slice(c[b], c[b + 1])
        assert torch.equal(o_nan[:, :, rows], o[:, :, rows]), f"sequence {b} changed with NaN in sequence 1's V"
        assert torch.equal(st_nan[:, :, rows], st[:, :, rows])
        assert torch.equal(o_ref_nan[:, :, rows], o_ref[:, :, rows])  # the Triton forward's isolation too


def test_gluon_fwd_no_keys_and_v_length():
    """Skv = 0 gives the Triton forward's O = 0 and stats = -inf without a launch (TMA cannot describe an empty
    tensor; in a packed batch the sequences' rows only); a V length that is not a multiple of 32 is refused (the producer would read scale rows past v.scale)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed here")
    from mxattn.kernels import gluon_attention_fwd as gf
    from mxattn.kernels.triton_quantize import SeqMajorColumns
    q = torch.zeros(1, 2, 64, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.zeros(1, 2, 64, 4, dtype=torch.uint8)
    k0 = torch.zeros(1, 2, 0, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    v0 = SeqMajorColumns(torch.zeros(1, 2, 128, 0, dtype=torch.uint8).view(torch.float8_e4m3fn),
                         torch.zeros(1, 2, 0, 128, dtype=torch.uint8))
    out = torch.full((1, 2, 64, 128), 7.0, dtype=torch.bfloat16)
    st = torch.zeros(1, 2, 64, 1)
    gf.attention_fwd_gluon(q, s, k0, s[:, :, :0], v0, softmax_scale=0.1, offset=0, left_bound=None,
                           right_bound=None, out=out, stats=st)
    assert (out == 0).all() and (st == float("-inf")).all()
    sink = torch.tensor([0.3, -2.0])  # with a sink: the kernels' stats of a row without keys, (m + 8 - 8) ln 2
    out.fill_(7.0)
    gf.attention_fwd_gluon(q, s, k0, s[:, :, :0], v0, softmax_scale=0.1, offset=0, left_bound=None,
                           right_bound=None, out=out, stats=st, sink=sink)
    m = sink * torch.tensor(1.4426950408889634)
    want = ((m + 8.0 - 8.0) * 0.6931471805599453).view(2, 1).expand(2, 64)
    assert (out == 0).all() and torch.equal(st[0, :, :, 0], want)
    torch.testing.assert_close(st[0, :, :, 0], sink.view(2, 1).expand(2, 64))
    # a packed batch without keys: its sequences' rows (up to cu_q[-1] = 50) only, the rows after untouched
    from mxattn.seqinfo import SeqInfo
    packed = SeqInfo(torch.tensor([0, 30, 50], dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 30, 0, True)
    for sk, fill in ((sink, want), (None, torch.full((2, 64), float("-inf")))):
        out.fill_(7.0)
        st.fill_(5.0)
        gf.attention_fwd_gluon(q, s, k0, s[:, :, :0], v0, softmax_scale=0.1, offset=0, left_bound=None,
                               right_bound=None, out=out, stats=st, sink=sk, seq=packed)
        assert (out[:, :, :50] == 0).all() and (out[:, :, 50:] == 7).all()
        assert torch.equal(st[0, :, :50, 0], fill[:, :50]) and (st[:, :, 50:] == 5).all()
    v48 = SeqMajorColumns(torch.zeros(1, 2, 128, 48, dtype=torch.uint8).view(torch.float8_e4m3fn),
                          torch.zeros(1, 2, 1, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        gf.attention_fwd_gluon(q, s, q[:, :, :40], s[:, :, :40], v48, softmax_scale=0.1, offset=0, left_bound=None,
                               right_bound=None, out=out, stats=st)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("d,causal,bottom_right,kv_bf16,has_sink", [
    (128, False, False, False, False), (128, True, True, False, False), (64, True, True, False, True),
    (128, True, False, True, False), (64, False, False, True, False)],
    ids=["d128", "d128-causal-br", "d64-causal-br-sink", "d128-causal-bf16kv", "d64-bf16kv"])
def test_gluon_fwd_varlen_variants_build_without_spills_in_their_loops(d, causal, bottom_right, kv_bf16, has_sink,
                                                                       packed):
    """The padded- and packed-batch variants (VARLEN: lengths read from cu_seqlens, so SKV and the offset sit in
    registers rather than the constant bank; PACKED: each sequence from its first row, the tail block's V columns
    zeroed or, bf16 K/V, its V rows loaded by the producer) build for sm_90a with asynchronous wgmmas and no local
    memory in their KV loops; at D128 on FP8 K/V ptxas spills a few registers in the epilogue (once per CTA,
    outside the loops), which this test allows and the dense builds' test does not. The dense builds' SASS is
    unchanged by the variants."""
    import os
    import subprocess
    import tempfile
    import triton
    from mxattn.kernels import gluon_attention_fwd as gf
    try:
        kernel = gf.compile_sm90(d, causal, kv_bf16=kv_bf16, has_sink=has_sink, varlen=True,
                                 bottom_right=bottom_right, packed=packed)
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"cannot compile for sm_90a here: {e}")
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg.inc" in ptx and kernel.metadata.shared <= 227 * 1024
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import sass_loops
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    assert not sass_loops.wgmma_serialised(ptx)
    found = sass_loops.loops(sass_loops.instructions(sass))
    inner = [ops for a, b, ops in found if any(op.startswith("HGMMA") for op in ops)
             and not any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2, _ in found)]
    assert len(inner) >= 4  # the KV loops of both consumer warpgroups
    for ops in inner:
        assert not any(op.startswith(("STL", "LDL")) for op in ops)


def _compile_or_skip(d, causal, pingpong, has_lb=False, has_sink=False, kv_bf16=False):
    if not HAS_TRITON:
        pytest.skip("triton is not installed here")
    try:
        from mxattn.kernels import gluon_attention_fwd as gf
        return gf.compile_sm90(d, causal, pingpong=pingpong, has_lb=has_lb, has_sink=has_sink, kv_bf16=kv_bf16)
    except ImportError as e:  # pragma: no cover - a Triton without GPU-target compilation or without Gluon
        pytest.skip(f"cannot compile for sm_90a here: {e}")


def _assert_sm90_build(kernel, max_stack=0, max_local_ops=0):
    """An sm_90a build (CompiledKernel) of a warp-specialised Gluon kernel: wgmma, 4-D TMA loads and setmaxnreg in
    its PTX, within the H100's shared memory, no local memory (spills) in its cubin (Triton's cuobjdump), and no
    wgmma serialisation by ptxas. max_stack / max_local_ops: a build known to keep a few loop bounds on the stack
    may use at most that many stack bytes and STL / LDL instructions in its whole SASS."""
    import re
    import os
    import subprocess
    import tempfile
    import triton
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor.4d" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert kernel.metadata.shared <= 227 * 1024
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    assert "LOCAL:0" in usage, usage
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= max_stack, usage
    assert len(re.findall(r"\b(?:STL|LDL)\b", sass)) <= max_local_ops
    # ptxas keeps the wgmmas asynchronous (no C7512 "wgmma.mma_async instructions are serialized" for lack of
    # registers, which would wait for every GEMM as it is issued)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", path, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True, check=True).stderr
    assert "C7512" not in log and "serialized" not in log, log


@pytest.mark.parametrize("d,causal,pingpong,has_lb,has_sink,kv_bf16", [
    (64, False, True, False, False, False), (128, False, True, False, False, False),
    (128, True, True, False, False, False), (128, True, False, False, False, False),
    (128, True, True, True, True, False), (128, False, True, True, False, False), (64, True, True, True, False, False),
    (128, True, True, False, False, True), (64, False, True, False, False, True), (128, True, True, True, True, True)],
    ids=["d64", "d128", "d128-causal", "d128-causal-free", "d128-window-sink", "d128-left", "d64-window",
         "bf16kv-d128-causal", "bf16kv-d64", "bf16kv-d128-window-sink"])
def test_gluon_fwd_compiles_for_sm90a_without_spills(d, causal, pingpong, has_lb, has_sink, kv_bf16):
    """The warp-specialised kernel builds for sm_90a with Triton's ptxas: no local memory (spills), the
    producer/consumer register split (setmaxnreg), wgmma with A from registers, TMA loads, within the H100's
    shared memory; also its sliding-window and sink variants and its bf16-K/V variant."""
    _assert_sm90_build(_compile_or_skip(d, causal, pingpong, has_lb, has_sink, kv_bf16))


def _fresh_plan_caches(mp):
    """Empty launch-plan caches at every level (backend, op bodies, whole calls, call signatures) for the rest of
    mp's context: a run that toggles which kernel serves a signature records its own plans."""
    from triton_helpers import install_plan_caches, new_plan_caches
    install_plan_caches(new_plan_caches(), mp.setattr)


def _rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bshd_causal_gqa_d64", "bhsd_views_d128", "sbhd_causal_d128", "sink_causal_d128",
                                  "bshd_sink_gqa_d64", "window_causal_gqa_d64", "bshd_window_sink_d128"])
@pytest.mark.parametrize("path", ["fp8", "bf16_scratch"])
def test_the_backends_fp8_path_runs_the_gluon_forward(monkeypatch, case, path):
    """Through the public API on the triton backend's FP8 data path (a large problem's, forced here) and on its
    bf16-scratch path (these sizes' own): the Gluon forward runs where it takes the call, and O, the stats the
    backward reads and the gradients agree with the Triton forward's (MXATTN_GLUON_FWD=0's path): O within one
    bf16 ulp in >= 99.9% of elements, gradients to rel-RMS 2e-4; also with attention sinks (learnable softmax
    offsets) and sliding windows."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    import mxattn
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_fwd as gf
    from triton_helpers import force_fp8_data_paths
    _fresh_plan_caches(monkeypatch)  # (an earlier test's recorded op bodies of these signatures would replay)
    if path == "fp8":
        force_fp8_data_paths(monkeypatch)
    else:  # no launch plans: each run below takes the body (the toggled choice is not in the plan key)
        monkeypatch.setattr(backend_module, "_forward_key", lambda roots, params: None)
        monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)
    ran = []
    real = gf.attention_fwd_gluon
    monkeypatch.setattr(gf, "attention_fwd_gluon", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(11)
    d = 64 if "d64" in case else 128
    hq, hkv = (8, 2) if "gqa" in case else (4, 4)
    fmt = case.split("_")[0] if case.split("_")[0] in ("bshd", "sbhd") else "bhsd"
    B, S = 2, 700
    shapes = {"bshd": lambda h: (B, S, h, d), "sbhd": lambda h: (S, B, h, d), "bhsd": lambda h: (B, S, h, d)}[fmt]
    base = [torch.randn(*shapes(h), device="cuda", generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv)]
    if fmt == "bhsd":  # bhsd views of bshd projections, as models hand them to torch SDPA
        base = [t.transpose(1, 2) for t in base]
    kwargs = dict(qkv_format=fmt, attn_mask_type="causal" if "causal" in case or "window" in case else "no_mask",
                  backend="triton")
    if "sink" in case:
        kwargs.update(softmax_type="learnable",
                      softmax_offset=torch.linspace(-4.0, 3.0, hq, device="cuda"))
    if "window" in case:
        kwargs.update(window_size=(200 if d == 64 else 77, 0))
    do = torch.randn_like(base[0])  # O's layout: q's

    def run(gluon_on):
        monkeypatch.setattr(backend_module, "GLUON_FORWARD", gluon_on)
        monkeypatch.setattr(backend_module, "_GLUON", {})
        ran.clear()
        q, k, v = (t.detach().clone().requires_grad_() for t in base)
        o = mxattn.mxfp8_attention(q, k, v, **kwargs)
        o.backward(do)
        torch.cuda.synchronize()
        return len(ran), o.detach(), q.grad, k.grad, v.grad

    n_on, o, *grads = run(True)
    n_off, o_ref, *grads_ref = run(False)
    assert n_off == 0 and n_on == 1
    ulps = (_ordered_bf16(o) - _ordered_bf16(o_ref)).abs()
    assert (ulps <= 1).float().mean().item() >= 0.999, f"max {ulps.max().item()} ulps"
    for a, b in zip(grads, grads_ref):
        assert _rel_rms(a, b) <= 2e-4


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("path", ["fp8", "bf16_scratch"])
def test_repeated_calls_replay_the_gluon_forward_on_each_calls_tensors(grad, path):
    """Launch plans are on (the FP8 path chosen by size alone): a signature's first calls run the body (the Gluon
    forward's Python), later calls replay the recorded launches with TMA descriptors re-based onto the new call's
    quantized K and V. Each call gets new inputs; every O (and, with grad, every gradient) agrees with the Triton
    forward's on the same inputs (MXATTN_GLUON_FWD=0's path): O within one bf16 ulp in >= 99.9% of elements."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    import mxattn
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_fwd as gf, triton_attention_bwd as tb, triton_attention_fwd as tf
    g = torch.Generator(device="cuda").manual_seed(5)
    inputs = [[torch.randn(1, 512, 8, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
              for _ in range(5)]
    do = torch.randn(1, 512, 8, 64, device="cuda", generator=g).to(torch.bfloat16)

    def run(gluon_on):
        results, ran = [], []
        with pytest.MonkeyPatch.context() as mp:
            _fresh_plan_caches(mp)  # (else the second run would replay the first run's recorded launches)
            if path == "fp8":
                mp.setattr(tf, "fwd_streams_bf16", lambda *a: False)
                mp.setattr(tb, "bwd_streams_bf16", lambda *a: False)
            mp.setattr(backend_module, "GLUON_FORWARD", gluon_on)
            mp.setattr(backend_module, "_GLUON", {})
            real = gf.attention_fwd_gluon
            mp.setattr(gf, "attention_fwd_gluon", lambda *a, **kw: ran.append(1) or real(*a, **kw))
            for q, k, v in inputs:
                leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
                with torch.set_grad_enabled(grad):
                    o = mxattn.mxfp8_attention(*leaves, attn_mask_type="causal", backend="triton")
                if grad:
                    o.backward(do)
                results.append([o.detach()] + ([t.grad for t in leaves] if grad else []))
            torch.cuda.synchronize()
        return results, len(ran)

    got, n_python = run(True)
    want, n_off = run(False)
    assert n_off == 0 and 1 <= n_python < len(inputs)  # the later calls replayed (the Gluon Python not called)
    for (o, *grads), (o_ref, *grads_ref) in zip(got, want):
        ulps = (_ordered_bf16(o) - _ordered_bf16(o_ref)).abs()
        assert (ulps <= 1).float().mean().item() >= 0.999, f"max {ulps.max().item()} ulps"
        for a, b in zip(grads, grads_ref):
            assert _rel_rms(a, b) <= 2e-4
