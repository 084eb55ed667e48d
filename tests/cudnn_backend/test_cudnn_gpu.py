"""cuDNN MXFP8 attention on a GPU.

* Any CUDA GPU that is not SM 10.x (`gpu`): cuDNN refuses with a readable reason, fast, without leaking.
* Blackwell (`blackwell`, and cuDNN >= 9.21): forward and backward against `ref.mxfp8_ref` on identical quantized
  bytes, for a covering set of the configs of the CPU matrix (every s, head dim, head ratio, mask and layout, and
  every (layout, heads, head dim) triple), at least as tight as the cuDNN frontend's own MXFP8 test (O atol 0.12
  rtol 0.2; dQ/dK/dV atol 0.08 rtol 0.2) plus a relative-RMS bound; deterministic backward; amax outputs;
  variable lengths and attention sinks (softmax_type, through `mxattn.mxfp8_attention`) against the reference
  backend.
"""

import dataclasses
import gc
import itertools
import os
import statistics
import time
import zlib

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

import mxattn  # noqa: E402
from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends.base import AttentionParams  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends.cudnn.backend import CudnnBackend  # noqa: E402
from mxattn.backends.cudnn.run import cudnn_backward, cudnn_forward  # noqa: E402
from mxattn.backends.cudnn.support import MIN_BACKEND_VERSION, cudnn_support  # noqa: E402
from mxattn.errors import MXFP8NotSupportedError  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402
from mxattn.metrics import rel_rms  # noqa: E402
from ref import mxfp8_ref  # noqa: E402


def _capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


from cudnn_matrix import HEAD_DIMS, HEADS, LAYOUTS, MASKS, SEQS  # noqa: E402
O_TOL = dict(atol=0.12, rtol=0.2)  # the cuDNN frontend's MXFP8 test
GRAD_TOL = dict(atol=0.08, rtol=0.2)
O_REL_RMS, GRAD_REL_RMS = 0.03, 0.05  # tighter, scale-free: catches wrong bytes the loose atol would hide


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------------------------------------------
# not Blackwell: a clear refusal
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(_capability()[0] == 10, reason="runs on CUDA GPUs other than SM 10.x")
def test_non_blackwell_refuses_fast_with_a_reason_and_no_leak():
    major, minor = _capability()
    ok, reason = cudnn_support()
    assert not ok and f"SM {major}.{minor}" in reason and "SM 10.x" in reason
    if cudnn.backend_version() < MIN_BACKEND_VERSION:  # a frontend installed with an older cuDNN says so too
        assert "older than 9.21.0" in reason and "nvidia-cudnn-cu1" in reason

    q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    qr, vc = quantize_mxfp8(q, -1), quantize_mxfp8(q, -2)
    params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True))
    cfg = cudnn_config.GraphConfig.from_layout(1, 4, 4, 256, 256, 128, layout="bshd", mask=MaskSpec(causal=True))
    handle = cudnn.create_handle()
    messages = []

    def attempt():
        with pytest.raises(MXFP8NotSupportedError) as backend_path:
            CudnnBackend().forward(q, q, q, params)
        with pytest.raises(MXFP8NotSupportedError) as typed_path:
            cudnn_forward(qr, qr, vc, attn_scale=0.125)
        messages[:] = [str(backend_path.value), str(typed_path.value)]
        for kind, build in (("forward", cudnn_graphs.build_forward_graph), ("backward", cudnn_graphs.build_backward_graph)):
            with pytest.raises(MXFP8NotSupportedError) as cudnn_path:  # cuDNN's own answer for this device
                cudnn_graphs.plan_graph(build(cfg, handle), cfg, kind)
            messages.append(str(cudnn_path.value))

    try:
        for _ in range(5):  # warm up: first-use imports, the frontend's engine manifest, default handles
            attempt()
        gc.collect()
        torch.cuda.synchronize()
        mem0, rss0, fds0 = torch.cuda.memory_allocated(), _rss_bytes(), _open_fds()
        times = []
        for _ in range(100):
            t0 = time.perf_counter()
            attempt()
            times.append(time.perf_counter() - t0)
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == mem0
        assert _open_fds() <= fds0 + 2
        assert _rss_bytes() - rss0 < 64 * 2**20, f"RSS grew by {(_rss_bytes() - rss0) / 2**20:.1f} MiB"
    finally:
        cudnn.destroy_handle(handle)
    assert max(times) < 1.0 and statistics.median(times) < 0.5, f"slowest {max(times):.3f} s"
    for message in messages:
        assert "MXFP8" in message and len(message) > 60, message
    assert all("SM" in m for m in messages[:2]) and all("cuDNN" in m for m in messages[2:])


# --------------------------------------------------------------------------------------------------------------
# Blackwell: numerics against ref on identical quantized bytes
# --------------------------------------------------------------------------------------------------------------
def _blackwell_ready():
    ok, reason = cudnn_support() if _capability()[0] == 10 else (False, "not SM 10.x")
    return ok, reason


def covering_cases():
    """(b, s_q, s_kv, d_qk, d_v, h_q, h_kv, mask, layout, out_dtype): every (layout, heads, head dims) triple, s
    and mask cycling through all values; plus s_q < s_kv and FP16 output."""
    cases = []
    masks = list(MASKS)
    for i, (layout, (hq, hk), (dqk, dv)) in enumerate(itertools.product(LAYOUTS, HEADS, HEAD_DIMS)):
        s = SEQS[i % len(SEQS)]
        cases.append((1 if s == 4096 else 2, s, s, dqk, dv, hq, hk, masks[i % len(masks)], layout, torch.bfloat16))
    cases.append((2, 256, 1024, 128, 128, 8, 2, "causal_br", "bshd", torch.bfloat16))
    cases.append((2, 500, 500, 128, 128, 8, 2, "causal_br", "bhsd", torch.bfloat16))  # backward refused by cuDNN
    cases.append((2, 512, 512, 64, 64, 8, 8, "causal_tl", "bshd", torch.float16))
    return cases


def _case_id(c):
    return f"b{c[0]}-sq{c[1]}-skv{c[2]}-d{c[3]}x{c[4]}-h{c[5]}_{c[6]}-{c[7]}-{c[8]}-{str(c[9])[6:]}"


def _view(shape, layout, gen, dtype):
    perm = LAYOUTS[layout]
    physical = torch.randn([shape[i] for i in perm], generator=gen, device="cuda").to(dtype)
    return physical.permute([perm.index(i) for i in range(4)])


def _gqa_bshd(seed):
    """A CUDA generator seeded with seed, then drawn from it in this order: q [2,8,384,128], k and v
    [2,2,384,128], do [2,8,384,128], bfloat16 bshd views (`_view`); the generator is returned for more draws."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_shape, kv_shape = (2, 8, 384, 128), (2, 2, 384, 128)
    return (gen, *[_view(shape, "bshd", gen, torch.bfloat16) for shape in (q_shape, kv_shape, kv_shape, q_shape)])


def _cudnn_rejects_backward(s_q, s_kv, mask):
    """cuDNN 9.28's rule (see test_cudnn_graphs): a bottom-right band with a right bound needs s % 64 == 0."""
    return mask.diagonal_alignment == "bottom_right" and mask.right_bound is not None \
        and (s_q % 64 or s_kv % 64)


def _ref_kwargs(mask, attn_scale, out_dtype):
    return dict(attn_scale=attn_scale, causal=mask.causal, diagonal_alignment=mask.diagonal_alignment,
                window=(mask.left_bound, mask.right_bound), out_dtype=out_dtype)


def _close_amax(amax, t):
    expected = t.float().abs().max()
    torch.testing.assert_close(amax.reshape(()), expected, atol=1e-6, rtol=2**-7)  # amax is taken before rounding


@pytest.mark.blackwell
@pytest.mark.parametrize("case", covering_cases(), ids=_case_id)
def test_cudnn_matches_ref_on_identical_bytes(case):
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    b, s_q, s_kv, dqk, dv, hq, hk, mask_name, layout, out_dtype = case
    mask, attn_scale = MASKS[mask_name], dqk ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(_case_id(case).encode()))
    q = _view((b, hq, s_q, dqk), layout, gen, torch.bfloat16)
    k = _view((b, hk, s_kv, dqk), layout, gen, torch.bfloat16)
    v = _view((b, hk, s_kv, dv), layout, gen, torch.bfloat16)
    do = _view((b, hq, s_q, dv), layout, gen, out_dtype)
    qr, kr, vc = quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2)
    rk = _ref_kwargs(mask, attn_scale, out_dtype)

    o, stats, amax_o = cudnn_forward(qr, kr, vc, attn_scale=attn_scale, mask=mask, out_dtype=out_dtype)
    assert o.dtype == out_dtype and o.shape == (b, hq, s_q, dv) and stats.shape == (b, hq, s_q, 1)
    ref_o, ref_stats = mxfp8_ref.sdpa_fwd_quantized(qr.data, qr.scale, kr.data, kr.scale, vc.data, vc.scale, **rk)
    # the frontend's own MXFP8 reference runs the forward with P scaled by 16 and lazy rescaling (threshold 4)
    alt_o, _ = mxfp8_ref.sdpa_fwd_quantized(qr.data, qr.scale, kr.data, kr.scale, vc.data, vc.scale, **rk,
                                            p_scale=16.0, rescale_threshold=4.0)
    torch.testing.assert_close(o.float(), ref_o.float(), **O_TOL)
    err = min(rel_rms(o, ref_o), rel_rms(o, alt_o))
    assert err < O_REL_RMS, f"O rel RMS {err:.4f}"
    finite = torch.isfinite(ref_stats)
    assert torch.equal(finite, torch.isfinite(stats))
    torch.testing.assert_close(stats[finite], ref_stats[finite], atol=2e-2, rtol=1e-2)
    _close_amax(amax_o, o)

    qc, kc, vr = quantize_mxfp8(q, -2), quantize_mxfp8(k, -2), quantize_mxfp8(v, -1)
    dor, doc = quantize_mxfp8(do, -1), quantize_mxfp8(do, -2)
    args = (qr, qc, kr, kc, vr, o, do, dor, doc, stats)
    if _cudnn_rejects_backward(s_q, s_kv, mask):
        with pytest.raises(MXFP8NotSupportedError, match="multiple of 64"):
            cudnn_backward(*args, attn_scale=attn_scale, mask=mask)
        return
    first = cudnn_backward(*args, attn_scale=attn_scale, mask=mask, deterministic=True)
    second = cudnn_backward(*args, attn_scale=attn_scale, mask=mask, deterministic=True)
    for name, a, bb in zip(("dQ", "dK", "dV", "amax_dQ", "amax_dK", "amax_dV"), first, second):
        assert torch.equal(a, bb), f"{name} differs between two deterministic runs"
    dq, dk, dv_, amax_dq, amax_dk, amax_dv = first
    assert [t.shape for t in (dq, dk, dv_)] == [q.shape, k.shape, v.shape]
    assert [t.stride() for t in (dq, dk, dv_)] == [q.stride(), k.stride(), v.stride()]
    refs = mxfp8_ref.sdpa_bwd_quantized(q_row=(qr.data, qr.scale), q_col=(qc.data, qc.scale),
                                        k_row=(kr.data, kr.scale), k_col=(kc.data, kc.scale),
                                        v_row=(vr.data, vr.scale), o=o, do=do, do_row=(dor.data, dor.scale),
                                        do_col=(doc.data, doc.scale), stats=stats, **rk)
    for name, got, want, amax in (("dQ", dq, refs[0], amax_dq), ("dK", dk, refs[1], amax_dk),
                                  ("dV", dv_, refs[2], amax_dv)):
        assert got.dtype == out_dtype
        torch.testing.assert_close(got.float(), want.float(), **GRAD_TOL, msg=lambda m: f"{name}: {m}")
        err = rel_rms(got, want)
        assert err < GRAD_REL_RMS, f"{name} rel RMS {err:.4f}"
        _close_amax(amax, got)


@pytest.mark.blackwell
def test_backend_class_is_the_typed_functions_and_the_cache_is_reused():
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    gen, q, k, v, do = _gqa_bshd(7)
    params = AttentionParams(softmax_scale=0.1, mask=MaskSpec(causal=True))
    backend = CudnnBackend()
    assert backend.availability(q.device)[0]
    o, stats, saved = backend.forward(q, k, v, params)
    n_graphs = len(cudnn_graphs.GRAPH_CACHE)
    o2, stats2, _ = backend.forward(q, k, v, params)
    assert len(cudnn_graphs.GRAPH_CACHE) == n_graphs and torch.equal(o, o2) and torch.equal(stats, stats2)
    expected, _, _ = cudnn_forward(quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2),
                                   attn_scale=0.1, mask=MaskSpec(causal=True))
    assert torch.equal(o, expected)
    assert o.stride() == q.stride()  # O comes back in the inputs' (bshd) layout
    grads = backend.backward(saved, o, stats, do, params)
    direct = cudnn_backward(saved.q_row, saved.q_col, saved.k_row, saved.k_col, saved.v_row, o, do,
                            quantize_mxfp8(do, -1), quantize_mxfp8(do, -2), stats, attn_scale=0.1,
                            mask=MaskSpec(causal=True))
    for a, b in zip(grads, direct[:3]):
        assert torch.equal(a, b)
    # a non-dense dO (here every other row of a taller tensor) is made dense, not rejected
    tall = _view((2, 8, 768, 128), "bshd", gen, torch.bfloat16)
    strided_do = tall[:, :, ::2]
    grads2 = backend.backward(saved, o, stats, strided_do, params)
    grads3 = backend.backward(saved, o, stats, strided_do.contiguous(), params)
    for a, b in zip(grads2, grads3):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------------------
# Blackwell: variable lengths (padded and packed/thd) against the reference backend on the same inputs
# --------------------------------------------------------------------------------------------------------------
VARLEN_LENGTHS = (([300, 0, 77, 512], [512, 64, 200, 129]), ([130, 257, 1], [130, 257, 400]))


def _varlen_batch(varlen, lengths_q, lengths_kv, hq, hk, d, gen, s_pad=512):
    from mxattn.seqinfo import SeqInfo
    cu_q = torch.tensor([0] + list(itertools.accumulate(lengths_q)), dtype=torch.int32, device="cuda")
    cu_kv = torch.tensor([0] + list(itertools.accumulate(lengths_kv)), dtype=torch.int32, device="cuda")
    seq = SeqInfo(cu_q, cu_kv, max(lengths_q), max(lengths_kv), varlen == "packed")
    if varlen == "packed":
        def x(h, t):  # [T, H, D] viewed as [1, H, T, D], as mxattn.attention hands it over
            return torch.randn(t, h, d, generator=gen, device="cuda").to(torch.bfloat16).permute(1, 0, 2)[None]
        tq, tkv = sum(lengths_q), sum(lengths_kv)
    else:
        def x(h, t):
            return _view((len(lengths_q), h, t, d), "bshd", gen, torch.bfloat16)
        tq = tkv = s_pad
    return seq, x(hq, tq), x(hk, tkv), x(hk, tkv), x(hq, tq)


@pytest.mark.blackwell
@pytest.mark.parametrize("varlen", ["padded", "packed"])
@pytest.mark.parametrize("mask_name", ["none", "causal_tl", "causal_br", "swa_tl"])
@pytest.mark.parametrize("d", [64, 128])
def test_cudnn_varlen_matches_the_reference_backend(varlen, mask_name, d):
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    from mxattn.backends.base import Problem
    from mxattn.backends.reference import ReferenceBackend
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{varlen}{mask_name}{d}".encode()))
    mask = MASKS[mask_name]
    for lengths_q, lengths_kv in VARLEN_LENGTHS:
        seq, q, k, v, do = _varlen_batch(varlen, lengths_q, lengths_kv, 8, 2, d, gen)
        problem = Problem(q.device, q.dtype, seq.batch, 8, 2, seq.max_seqlen_q if seq.packed else q.shape[2],
                          seq.max_seqlen_kv if seq.packed else k.shape[2], d, mask, varlen, True)
        ok, reason = CudnnBackend.supports(problem)
        if not ok:  # decided up front; then the calls themselves must refuse too
            assert "cuDNN" in reason
            with pytest.raises(MXFP8NotSupportedError):
                params = AttentionParams(softmax_scale=d ** -0.5, mask=mask, seq=seq)
                o, stats, saved = CudnnBackend().forward(q, k, v, params)
                CudnnBackend().backward(saved, o, stats, do, params)
            continue
        params = AttentionParams(softmax_scale=d ** -0.5, mask=mask, seq=seq)
        o, stats, saved = CudnnBackend().forward(q, k, v, params)
        o_ref, stats_ref, saved_ref = ReferenceBackend().forward(q, k, v, params)
        for a, b in zip(saved.tensors(), saved_ref.tensors()):  # the same quantized bytes
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        torch.testing.assert_close(o.float(), o_ref.float(), **O_TOL)
        assert rel_rms(o, o_ref) < O_REL_RMS
        finite = torch.isfinite(stats_ref)
        assert torch.equal(finite, torch.isfinite(stats))  # -inf exactly on rows without keys / padding
        torch.testing.assert_close(stats[finite], stats_ref[finite], atol=0.02, rtol=0.01)
        grads = CudnnBackend().backward(saved, o, stats.contiguous(), do, params)
        grads_ref = ReferenceBackend().backward(saved_ref, o_ref, stats_ref, do, params)
        for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
            torch.testing.assert_close(got.float(), want.float(), **GRAD_TOL, msg=lambda m: f"{name}: {m}")
            assert rel_rms(got, want) < GRAD_REL_RMS, name


@pytest.mark.blackwell
@pytest.mark.parametrize("varlen", ["padded", "packed"])
def test_new_lengths_at_the_same_maximum_do_not_rebuild(varlen, monkeypatch):
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    built = []
    real = cudnn_graphs.build_and_plan
    monkeypatch.setattr(cudnn_graphs, "build_and_plan",
                        lambda kind, cfg, handle: built.append(kind) or real(kind, cfg, handle))
    cudnn_graphs.GRAPH_CACHE.clear()
    gen = torch.Generator(device="cuda").manual_seed(11)
    for lengths_q, lengths_kv in (([300, 5, 77, 512], [512, 64, 200, 129]), ([1, 512, 400, 9], [33, 512, 2, 300])):
        seq, q, k, v, do = _varlen_batch(varlen, lengths_q, lengths_kv, 8, 2, 128, gen)
        params = AttentionParams(softmax_scale=0.1, mask=MaskSpec(causal=True), seq=seq)
        o, stats, saved = CudnnBackend().forward(q, k, v, params)
        CudnnBackend().backward(saved, o, stats.contiguous(), do, params)
    torch.cuda.synchronize()
    assert built == ["forward", "backward"]


# --------------------------------------------------------------------------------------------------------------
# Blackwell: attention sinks (TE softmax_type "off-by-one" / "learnable") through the public API, cudnn against
# the reference backend on the same inputs
# --------------------------------------------------------------------------------------------------------------
SINK_CASES = [  # (qkv_format, attn_mask_type, window_size, h_q, h_kv, d, lengths_q, lengths_kv)
    ("bshd", "no_mask", None, 8, 8, 128, None, None),
    ("bshd", "causal", None, 8, 2, 128, None, None),
    ("bhsd", "causal_bottom_right", None, 8, 1, 64, None, None),
    ("sbhd", "no_mask", (128, 0), 8, 2, 128, None, None),
    ("bshd", "padding_causal", None, 8, 2, 128, [300, 0, 77, 512], [512, 64, 200, 129]),
    ("thd", "padding_causal", None, 8, 2, 128, [300, 5, 77, 512], [512, 64, 200, 129]),
    ("thd", "padding", None, 8, 2, 64, [130, 257, 1], [130, 257, 400]),
]
DSINK_REL_TOL = 0.03  # |dOffset - ref| <= 3% of max|ref| (a sum over batch and query rows of p_sink * delta)


def _sink_case_id(c):
    return f"{c[0]}-{c[1]}-w{c[2]}-h{c[3]}_{c[4]}-d{c[5]}" + ("-varlen" if c[6] else "")


def _sink_inputs(case, gen, s=512, b=2):
    fmt, mask_type, window, hq, hk, d, lengths_q, lengths_kv = case
    kw = dict(qkv_format=fmt, attn_mask_type=mask_type, window_size=window)
    if lengths_q is not None:
        cu_q = torch.tensor([0] + list(itertools.accumulate(lengths_q)), dtype=torch.int32, device="cuda")
        cu_kv = torch.tensor([0] + list(itertools.accumulate(lengths_kv)), dtype=torch.int32, device="cuda")
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        b = len(lengths_q)
    if fmt == "thd":
        shapes = [(sum(lengths_q), hq, d), (sum(lengths_kv), hk, d), (sum(lengths_kv), hk, d),
                  (sum(lengths_q), hq, d)]
    else:
        def shape(h):
            return {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "bhsd": (b, h, s, d)}[fmt]
        shapes = [shape(hq), shape(hk), shape(hk), shape(hq)]
    q, k, v, do = (torch.randn(sh, generator=gen, device="cuda").to(torch.bfloat16) for sh in shapes)
    return q, k, v, do, kw


def _run_sink(backend, q, k, v, do, kw, softmax_type, offset):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sink = None if offset is None else offset.detach().clone().requires_grad_(True)
    extra = dict(softmax_type=softmax_type)
    if sink is not None:
        extra["softmax_offset"] = sink
    o = mxattn.mxfp8_attention(*leaves, backend=backend, **kw, **extra)
    o.backward(do)
    return o.detach(), [t.grad for t in leaves], (None if sink is None else sink.grad)


@pytest.mark.blackwell
@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
@pytest.mark.parametrize("case", SINK_CASES, ids=_sink_case_id)
def test_cudnn_sinks_match_the_reference_backend(case, softmax_type):
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32((_sink_case_id(case) + softmax_type).encode()))
    q, k, v, do, kw = _sink_inputs(case, gen)
    hq = case[3]
    # logits spread around the scores' range, so the sink takes from nothing to most of a row's mass
    offset = torch.linspace(-3.0, 4.0, hq, device="cuda") if softmax_type == "learnable" else None
    o, grads, doffset = _run_sink("cudnn", q, k, v, do, kw, softmax_type, offset)
    o_ref, grads_ref, doffset_ref = _run_sink("reference", q, k, v, do, kw, softmax_type, offset)
    assert o.dtype == q.dtype and o.shape == q.shape
    torch.testing.assert_close(o.float(), o_ref.float(), **O_TOL)
    assert rel_rms(o, o_ref) < O_REL_RMS
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(got.float(), want.float(), **GRAD_TOL, msg=lambda m: f"{name}: {m}")
        assert rel_rms(got, want) < GRAD_REL_RMS, name
    if softmax_type == "learnable":
        assert doffset.shape == (hq,) and doffset.dtype == torch.float32 and torch.isfinite(doffset).all()
        scale = doffset_ref.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(doffset, doffset_ref, atol=DSINK_REL_TOL * scale, rtol=0.0)
    else:
        assert doffset is None
    # the sink changes the output (it takes softmax mass): the test is not passing on vanilla attention
    o_vanilla, _, _ = _run_sink("reference", q, k, v, do, kw, "vanilla", None)
    assert rel_rms(o_ref, o_vanilla) > 4 * O_REL_RMS


@pytest.mark.blackwell
def test_cudnn_dsink_is_the_gradient_of_its_own_forward():
    """The backend's dSink (cuDNN's dSink_token) against the generic formula on cuDNN's own O and stats
    (`base.sink_grad`), and deterministic; the sink enters the stats and not O's support."""
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    from mxattn.backends.base import sink_grad
    gen, q, k, v, do = _gqa_bshd(13)
    sink = torch.linspace(-2.0, 3.0, 8, device="cuda")
    backend = CudnnBackend()
    base = AttentionParams(softmax_scale=128 ** -0.5, mask=MaskSpec(causal=True))
    params = AttentionParams(softmax_scale=128 ** -0.5, mask=MaskSpec(causal=True), sink=sink,
                             sink_requires_grad=True)
    o0, stats0, _ = backend.forward(q, k, v, base)
    o, stats, saved = backend.forward(q, k, v, params)
    # stats = logaddexp(stats without sink, sink)
    torch.testing.assert_close(stats, torch.logaddexp(stats0, sink.view(1, -1, 1, 1)), atol=2e-2, rtol=1e-2)
    first = backend.backward(saved, o, stats, do, params)
    second = backend.backward(saved, o, stats, do, params)
    assert len(first) == 4 and all(torch.equal(a, b) for a, b in zip(first, second))
    want = sink_grad(o, do, stats, sink)
    torch.testing.assert_close(first[3], want, atol=DSINK_REL_TOL * want.abs().max().item(), rtol=0.0)
    off = backend.backward(saved, o, stats, do, dataclasses.replace(params, sink_requires_grad=False))
    assert len(off) == 3 and all(torch.equal(a, b) for a, b in zip(off, first[:3]))


# --------------------------------------------------------------------------------------------------------------
# Blackwell: public calls replayed by launch plans (the graph execution as a recorded host call)
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.blackwell
@pytest.mark.parametrize("hkv, causal", [(8, False), (2, True)], ids=["mha", "gqa_causal"])
def test_replayed_public_calls_equal_the_ordinary_path_bit_for_bit(hkv, causal, monkeypatch):
    """Five forward+backward calls of one signature on new inputs each (calls 3-5 replay the recorded op bodies:
    quantizer launches, then `graph.execute` with the variant pack rebuilt on the call's tensors) give O, dQ, dK
    and dV equal bit for bit to the same calls with op replays off, and the replay did run (no backend code on
    the last call)."""
    from mxattn import op_plans
    from mxattn.runtime import launch_plan
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(11)
    kw = dict(backend="cudnn", attn_mask_type="causal" if causal else "no_mask")
    inputs = [tuple(torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
                    for shape in ((2, 384, 8, 128), (2, 384, hkv, 128), (2, 384, hkv, 128), (2, 384, 8, 128)))
              for _ in range(5)]

    def call(q, k, v, do):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o = mxattn.mxfp8_attention(q, k, v, **kw)
        o.backward(do)
        return [o.detach(), q.grad, k.grad, v.grad]

    replayed = [call(*x) for x in inputs[:4]]
    forwards = []
    real_forward = CudnnBackend.forward
    monkeypatch.setattr(CudnnBackend, "forward", lambda *a, **k: forwards.append(1) or real_forward(*a, **k))
    replayed.append(call(*inputs[4]))
    assert not forwards, "the fifth call of one signature should replay its recorded body"
    assert any(isinstance(p, launch_plan.LaunchPlan) and p._host_calls for p in op_plans.PLANS._plans.values())
    monkeypatch.setitem(op_plans._REPLAYS, "cudnn", False)
    for x, got in zip(inputs, replayed):
        for a, b in zip(got, call(*x)):
            assert torch.equal(a, b)
