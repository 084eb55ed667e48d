"""The triton backend's log-sum-exp gradient and float32 outputs on a CUDA GPU, against the reference backend on
identical bytes: dQ, dK, dV and dSink with a dstats (delta - dLSE) at rel-RMS <= 2e-4, both backward data paths
(bf16 scratch with the Gluon kernels, FP8 on chip); float32 O, dQ, dK, dV equal to the bf16 ones before rounding."""

import pytest
import torch

import mxattn
from mxattn.backends import Problem, choose_backend
from mxattn.backends.base import AttentionParams
from mxattn.backends.reference import ReferenceBackend
from mxattn.backends.triton_backend import TritonBackend
from mxattn.mask import MaskSpec
from mxattn.metrics import rel_rms
from mxattn.seqinfo import SeqInfo

pytestmark = pytest.mark.gpu


def _randn(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def _dstats_like(stats, gen):
    """A gradient of the stats: random in rows with a finite log-sum-exp, 0 in rows that keep nothing."""
    ds = torch.randn(stats.shape, device="cuda", generator=gen)
    return torch.where(torch.isfinite(stats), ds, torch.zeros_like(ds))


def _compare_with_dstats(q, k, v, do, params, gen):
    tri, ref = TritonBackend(), ReferenceBackend()
    o, stats, saved = tri.forward(q, k, v, params)
    dstats = _dstats_like(stats, gen)
    got = tri.backward(saved, o, stats, do, params, dstats=dstats)
    want = ref.backward(saved, o, stats, do, params, dstats=dstats)
    assert len(got) == len(want) == (4 if params.sink_requires_grad else 3)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel_rms(a, b) <= 2e-4, (name, rel_rms(a, b))
    plain = tri.backward(saved, o, stats, do, params)
    assert rel_rms(got[0], plain[0]) > 1e-2  # dstats took part
    assert all(torch.equal(a, b) for a, b in zip(got, tri.backward(saved, o, stats, do, params, dstats=dstats)))


@pytest.mark.parametrize("path", ["pre", "fp8"])
@pytest.mark.parametrize("hkv,d,mask,learnable", [
    (8, 128, MaskSpec(), False),
    (2, 128, MaskSpec(causal=True), True),
    (2, 64, MaskSpec(causal=True, left_bound=100), True),
])
def test_triton_backward_takes_dstats_as_the_reference_does(monkeypatch, path, hkv, d, mask, learnable):
    if path == "fp8":
        import mxattn.kernels.triton_attention_bwd as tb
        monkeypatch.setattr(tb, "bwd_streams_bf16", lambda *a: False)
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, hq, s = 2, 8, 333
    q, do = _randn(b, hq, s, d, gen=gen), _randn(b, hq, s, d, gen=gen)
    k, v = _randn(b, hkv, s, d, gen=gen), _randn(b, hkv, s, d, gen=gen)
    sink = torch.randn(hq, device="cuda", generator=gen) if learnable else None
    params = AttentionParams(softmax_scale=d ** -0.5, mask=mask, sink=sink, sink_requires_grad=learnable)
    _compare_with_dstats(q, k, v, do, params, gen)


def test_packed_dstats_with_a_sequence_without_keys():
    """Rows with no key keep stats = the sink: their dstats is the sink's gradient alone."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    lq, lk = [40, 300, 7, 129], [64, 0, 200, 129]
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, do = _randn(1, 4, sum(lq), 64, gen=gen), _randn(1, 4, sum(lq), 64, gen=gen)
    k, v = _randn(1, 2, sum(lk), 64, gen=gen), _randn(1, 2, sum(lk), 64, gen=gen)
    params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True, diagonal_alignment="bottom_right"),
                             seq=SeqInfo(cq, ck, max(lq), max(lk), True),
                             sink=torch.randn(4, device="cuda", generator=gen), sink_requires_grad=True)
    _compare_with_dstats(q, k, v, do, params, gen)


def test_public_lse_gradients_on_triton_equal_the_reference_backend():
    """return_lse=True under autograd: a loss of O and lse; "auto" runs it on triton (no fallback warning)."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    q, k, v = _randn(2, 256, 8, 128, gen=gen), _randn(2, 256, 2, 128, gen=gen), _randn(2, 256, 2, 128, gen=gen)
    offset = torch.randn(8, device="cuda", generator=gen)
    w, u = _randn(2, 256, 8, 128, gen=gen).float(), torch.randn(2, 8, 256, device="cuda", generator=gen)

    def grads(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, offset)]
        o, lse = mxattn.mxfp8_attention(*leaves[:3], attn_mask_type="causal", softmax_type="learnable",
                                        softmax_offset=leaves[3], backend=backend, return_lse=True)
        ((o.float() * w).sum() + (lse * u).sum()).backward()
        return [o.detach(), lse.detach(), *(t.grad for t in leaves)]

    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads("auto")
    assert not [w for w in caught if "chose 'reference'" in str(w.message)]  # triton takes the call
    want = grads("reference")
    assert torch.equal(got[1], grads("triton")[1])
    assert (got[1] - want[1]).abs().max().item() < 1e-4
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "doffset"), got, want):
        assert rel_rms(a, b) <= 2e-4, (name, rel_rms(a, b))


@pytest.mark.parametrize("path", ["pre", "fp8"])
@pytest.mark.parametrize("d,mask", [(128, MaskSpec(causal=True)), (64, MaskSpec())])
def test_float32_outputs_are_the_bf16_ones_before_rounding(monkeypatch, path, d, mask):
    """float32 O and gradients (context parallelism's partial results): against the reference backend's float32,
    and, rounded to bf16, the triton kernels' own bf16 results (gradients bit for bit: the kernels cast on store;
    O within one bf16 ulp, the bf16 forward being the Gluon kernel, the float32 one Triton's)."""
    if path == "fp8":
        import mxattn.kernels.triton_attention_bwd as tb
        monkeypatch.setattr(tb, "bwd_streams_bf16", lambda *a: False)
    gen = torch.Generator(device="cuda").manual_seed(14)
    b, hq, hkv, s = 2, 8, 2, 320
    q, do = _randn(b, hq, s, d, gen=gen), _randn(b, hq, s, d, gen=gen)
    k, v = _randn(b, hkv, s, d, gen=gen), _randn(b, hkv, s, d, gen=gen)
    tri, ref = TritonBackend(), ReferenceBackend()
    p32 = AttentionParams(softmax_scale=d ** -0.5, mask=mask, out_dtype=torch.float32)
    p16 = AttentionParams(softmax_scale=d ** -0.5, mask=mask)
    o32, stats, saved = tri.forward(q, k, v, p32)
    o16, stats16, _ = tri.forward(q, k, v, p16)
    ro32, _, _ = ref.forward(q, k, v, p32)
    # as the bf16 outputs agree (test_sinks_gpu): within one bf16 ulp in >= 99.9% of elements
    assert o32.dtype == torch.float32
    assert ((o32 - ro32).abs() <= ro32.abs() * 2.0 ** -7 + 2.0 ** -133).float().mean().item() >= 0.999
    assert torch.equal(stats, stats16)
    diff = (o32.bfloat16().float() - o16.float()).abs()
    assert (diff <= o16.float().abs() * 2.0 ** -7 + 2.0 ** -133).all(), diff.max()
    g32 = tri.backward(saved, o16, stats, do, p32)
    g16 = tri.backward(saved, o16, stats, do, p16)
    r32 = ref.backward(saved, o16, stats, do, p32)
    for name, a, a16, r in zip(("dq", "dk", "dv"), g32, g16, r32):
        assert a.dtype == torch.float32 and rel_rms(a, r) <= 2e-4, (name, rel_rms(a, r))
        assert torch.equal(a.bfloat16(), a16), name


def test_auto_gives_float32_partial_calls_to_triton():
    problem = Problem(device=torch.device("cuda"), dtype=torch.bfloat16, batch=1, heads_q=8, heads_kv=2,
                      seqlen_q=256, seqlen_kv=512, head_dim=128, mask=MaskSpec(causal=True),
                      needs_backward=True, out_dtype=torch.float32)
    assert choose_backend("auto", problem) == "triton"
