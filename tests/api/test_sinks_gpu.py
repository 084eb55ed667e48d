"""Attention sinks on a CUDA GPU: the triton backend against the reference backend on identical bytes (O within
one BF16 ulp in >= 99.9% of elements; dQ, dK, dV and dSink rel-RMS <= 2e-4), dense and packed."""

import pytest
import torch

from mxattn.backends.base import AttentionParams
from mxattn.backends.reference import ReferenceBackend
from mxattn.backends.triton_backend import TritonBackend
from mxattn.mask import MaskSpec
from mxattn.metrics import rel_rms
from mxattn.seqinfo import SeqInfo

pytestmark = pytest.mark.gpu


def _ulp_share_and_max(a, b):
    a, b = a.float(), b.float()
    ulp = torch.where(b == 0, torch.full_like(b, 2.0 ** -133), b.abs() * 2.0 ** -7)  # one bf16 ulp (upper bound)
    return ((a - b).abs() <= ulp).float().mean().item(), (a - b).abs().max().item()


def _compare(q, k, v, do, params):
    """Asserts the tolerances; returns triton's O."""
    tri, ref = TritonBackend(), ReferenceBackend()
    o, stats, saved = tri.forward(q, k, v, params)
    ro, rstats, _ = ref.forward(q, k, v, params)
    within, omax = _ulp_share_and_max(o, ro)
    assert within >= 0.999 and omax <= 4e-3, (within, omax)
    finite = torch.isfinite(rstats)
    assert torch.equal(finite, torch.isfinite(stats))
    assert (stats[finite] - rstats[finite]).abs().max().item() < 1e-4
    got = tri.backward(saved, o, stats, do, params)
    want = ref.backward(saved, o, stats, do, params)
    assert len(got) == len(want) == (4 if params.sink_requires_grad else 3)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel_rms(a, b) <= 2e-4, (name, rel_rms(a, b))
    again = tri.backward(saved, o, stats, do, params)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # deterministic
    return o


@pytest.mark.parametrize("hkv,mask", [(8, MaskSpec()), (2, MaskSpec(causal=True)),
                                      (1, MaskSpec(causal=True, left_bound=100))])
@pytest.mark.parametrize("learnable", [True, False])
def test_triton_sink_matches_reference(hkv, mask, learnable):
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, hq, s, d = 2, 8, 333, 128
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    sink = (torch.randn(hq, device="cuda", generator=gen) * 2) if learnable else torch.zeros(hq, device="cuda")
    params = AttentionParams(softmax_scale=d ** -0.5, mask=mask, sink=sink, sink_requires_grad=learnable)
    o = _compare(q, k, v, do, params)
    vanilla, _, _ = TritonBackend().forward(q, k, v, AttentionParams(softmax_scale=d ** -0.5, mask=mask))
    assert not torch.equal(o, vanilla)  # the sink took part in the softmax


def test_triton_sink_packed_with_an_empty_kv_sequence():
    gen = torch.Generator(device="cuda").manual_seed(8)
    lq, lk = [40, 300, 7, 129], [64, 0, 200, 129]
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(1, 4, sum(lq), 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 2, sum(lk), 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    seq = SeqInfo(cq, ck, max(lq), max(lk), True)
    sink = torch.randn(4, device="cuda", generator=gen)
    params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True, diagonal_alignment="bottom_right"),
                             seq=seq, sink=sink, sink_requires_grad=True)
    _compare(q, k, v, do, params)
    _, stats, _ = TritonBackend().forward(q, k, v, params)
    rows = slice(40, 340)  # the sequence with no keys: stats = its head's sink
    assert torch.allclose(stats[0, :, rows, 0], sink.view(-1, 1).expand(-1, 300))


def test_compiled_learnable_sink_forward_and_backward_equal_eager():
    """torch.compile(fullgraph) of a learnable-sink call on the triton backend, backward included (torch 2.11's
    Dynamo holds the autograd Function's saved tensors as a tuple: no list.pop there): O and dQ, dK, dV equal the
    eager call's bit for bit, dSink (torch ops Inductor fuses, its own summation order) to fp32 rounding."""
    import mxattn
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 192, 8, 64, generator=gen).bfloat16().cuda()
    k, v = (torch.randn(2, 192, 2, 64, generator=gen).bfloat16().cuda() for _ in range(2))
    do = torch.randn(2, 192, 8, 64, generator=gen).bfloat16().cuda()
    offset = torch.randn(8, generator=gen).cuda()

    def forward(q, k, v, offset):
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", softmax_type="learnable",
                                      softmax_offset=offset, backend="triton")

    def fwd_bwd(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, offset)]
        o = fn(*leaves)
        o.backward(do)
        return [o.detach(), *(t.grad for t in leaves)]

    expected = fwd_bwd(forward)
    compiled = torch.compile(forward, fullgraph=True)
    for _ in range(2):
        got = fwd_bwd(compiled)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
            assert torch.equal(a, b), name
        torch.testing.assert_close(got[4], expected[4], rtol=1e-5, atol=1e-6)
