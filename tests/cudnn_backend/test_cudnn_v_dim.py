"""Q/K of head dim d_qk and V/O/dO of head dim d_v != d_qk on the cudnn backend (MLA's 192/128; 128/64; 256/128,
which cuDNN refuses): on the CPU through cuDNN's deviceless validation (SM 10.0), on Blackwell against the
reference backend.

* The graphs the backend plans for a Problem of two head dims (dense, padded, packed x no mask, causal; GQA 8:2)
  have the spec's tensors (sections 4, 5, 16: Q, K of d_qk; V, O, dO, dV of d_v; each scale tensor padded along
  its own dim), expected dims/strides computed in the graph tests from the spec; a pair cuDNN refuses is refused
  up front with the reason, and cuDNN's validation refuses its graphs.
* The up-front check accepts exactly the (d_qk, d_v) pairs cuDNN validates, and builds no graph for the others.
* For (192, 128) the graphs equal, tensor by tensor, those of the cuDNN frontend's own MXFP8 test
  (`test/python/sdpa/mxfp8.py`, `generate_graph_fwd` / `generate_graph_bwd`), rebuilt here with its Python API.
* The public call's variant packs: V and dO quantized along the axes the recipe says, d_v wide; every slot as
  the graph's.
"""

import itertools
import math

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

import mxattn  # noqa: E402
import test_cudnn_graphs as dense_graphs  # noqa: E402
import test_cudnn_varlen_graphs as varlen_graphs  # noqa: E402
from cudnn_fixtures import (MASKS, captured_packs, check_pack_against_graph, needs_mxfp8_cudnn,  # noqa: E402,F401
                            pretend_blackwell)
from mxattn.backends.base import Problem  # noqa: E402
from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import refusals as cudnn_refusals  # noqa: E402
from mxattn.backends.cudnn.backend import CudnnBackend  # noqa: E402
from mxattn.backends.cudnn.config import BwdUid, FwdUid  # noqa: E402
from mxattn.backends.cudnn.graphs import build_backward_graph, build_forward_graph, graph_json  # noqa: E402
from mxattn.backends.cudnn.run import backward_config, forward_config  # noqa: E402
from mxattn.errors import MXFP8NotSupportedError  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402
from test_cudnn_host_path import _bytes, _zeroed  # noqa: E402

DIMS = ((192, 128), (128, 64), (256, 128))
REFUSED = {(256, 128)}
BUILD = {"forward": build_forward_graph, "backward": build_backward_graph}


def cdiv(a, b):
    return -(-a // b)


def problem(dqk, dv, varlen=None, mask=MaskSpec(), s_q=384, s_kv=500):
    """A training Problem on a CUDA device: batch 3, GQA 8:2, Q/K of head dim dqk, V of dv."""
    return Problem(device=torch.device("cuda", 0), dtype=torch.bfloat16, batch=3, heads_q=8, heads_kv=2,
                   seqlen_q=s_q, seqlen_kv=s_kv, head_dim=dqk, mask=mask, varlen=varlen, needs_backward=True,
                   head_dim_v=dv)


def tensors_of(j):
    """uid -> the graph's non-virtual JSON tensors."""
    return {t["uid"]: t for t in j["tensors"] if not t["is_virtual"]}


# --------------------------------------------------------------------------------------------------------------
# the graphs the backend plans, against the spec
# --------------------------------------------------------------------------------------------------------------
@needs_mxfp8_cudnn
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_graphs_of_two_head_dims_have_the_spec_tensors_or_are_refused(kind):
    """3 pairs x dense/padded/packed x no mask/causal, GQA 8:2, s_q 384 against s_kv 500 (packed capacities 384,
    512). The config carries both dims and the default scale 1/sqrt(d_qk); cuDNN's validation accepts the graph
    and its JSON has the spec's tensors, or (256, 128) is refused by cuDNN, by the up-front check and by
    `check_problem` with cuDNN's reason."""
    for (dqk, dv), varlen, mask_name in itertools.product(DIMS, (None, "padded", "packed"), ("none", "causal_tl")):
        p = problem(dqk, dv, varlen, MASKS[mask_name])
        cfg = cudnn_refusals.problem_config(p, kind)
        assert (cfg.d_qk, cfg.d_v, cfg.attn_scale, cfg.varlen) == (dqk, dv, dqk ** -0.5, varlen)
        graph = BUILD[kind](cfg)
        if (dqk, dv) in REFUSED:
            with pytest.raises(MXFP8NotSupportedError, match="unless d_qk == 192 and d_v == 128"):
                graph_json(graph)
            ok, reason = cudnn_refusals.check_problem(p)  # what planning on a device reports: cuDNN's message
            assert not ok and "hidden_dim d_qk" in reason and "d_qk == 192 and d_v == 128" in reason
            assert f"head_dim {dqk}" in CudnnBackend.v_dim_refusal(dqk, dv)
            continue
        j = graph_json(graph)
        if varlen is None:
            dense_graphs.check_json(j, kind, cfg, "bshd")
        else:
            varlen_graphs.check_json(j, kind, cfg, varlen)


def cudnn_validates(dqk, dv):
    """cuDNN's verdict on the forward and backward graphs of (dqk, dv) (small dense GQA shapes)."""
    cfg = cudnn_config.GraphConfig.from_layout(1, 2, 1, 256, 256, dqk, dv)
    try:
        for build in BUILD.values():
            graph_json(build(cfg))
    except MXFP8NotSupportedError:
        return False
    return True


@needs_mxfp8_cudnn
def test_the_up_front_check_takes_exactly_the_pairs_cudnn_validates(pretend_blackwell):
    """Every pair of 8 head dims (multiples of 16 up to 128, 160, 192, 256): `supports` says yes exactly where
    cuDNN validates both graphs; a refused pair is refused with its dims named (for listed dims, cuDNN's rule)
    before any graph is built."""
    grid = (16, 48, 64, 96, 128, 160, 192, 256)
    accepted = []
    for dqk, dv in itertools.product(grid, grid):
        p = problem(dqk, dv)
        ok, reason = CudnnBackend.supports(p)
        assert ok == cudnn_validates(dqk, dv), (dqk, dv, reason)
        if ok:
            accepted.append(p)
            continue
        assert f"head_dim {dqk}" in reason or f"head_dim_v {dv}" in reason, reason
        if dqk in CudnnBackend.supported_head_dims and dv in CudnnBackend.supported_head_dims:
            assert "d_qk == 192 and d_v == 128" in reason and "reference" in reason
    assert pretend_blackwell == accepted
    assert {(p.head_dim, p.head_dim_v) for p in accepted} >= {(192, 128), (128, 64), (64, 128), (256, 256)}


# --------------------------------------------------------------------------------------------------------------
# the cuDNN frontend's own MXFP8 test graphs for (192, 128)
# --------------------------------------------------------------------------------------------------------------
def fe_tensor(graph, dims, scale=False, data_type=cudnn.data_type.FP8_E4M3):
    """A contiguous (row-major) graph tensor, as the frontend's test declares every one (scale tensors E8M0 with
    F8_128x4 reordering)."""
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    if scale:
        return graph.tensor(dim=dims, stride=strides, data_type=cudnn.data_type.FP8_E8M0,
                            reordering_type=cudnn.tensor_reordering.F8_128x4)
    return graph.tensor(dim=dims, stride=strides, data_type=data_type)


def fe_output(t, dims, data_type):
    t.set_output(True).set_dim(dims).set_stride([math.prod(dims[i + 1:]) for i in range(4)]).set_data_type(data_type)


def fe_sizes(b, hq, hk, sq, skv, dqk, dv):
    """The frontend test's padded sizes: rows to 128, scale columns to 4, dims to 128."""
    r128, c4 = (lambda n: cdiv(n, 128) * 128), (lambda n: cdiv(cdiv(n, 32), 4) * 4)
    return dict(q=[b, hq, sq, dqk], k=[b, hk, skv, dqk], v=[b, hk, skv, dv], o=[b, hq, sq, dv],
                sf_q=[b, hq, r128(sq), c4(dqk)], sf_k=[b, hk, r128(skv), c4(dqk)],
                sf_q_t=[b, hq, c4(sq), r128(dqk)], sf_k_t=[b, hk, c4(skv), r128(dqk)],
                sf_v_fwd=[b, hk, c4(skv), r128(dv)], sf_v_bwd=[b, hk, r128(skv), c4(dv)],
                sf_do=[b, hq, r128(sq), c4(dv)], sf_do_t=[b, hq, c4(sq), r128(dv)])


def fe_graph():
    # (a deviceless handle for SM 10.0, so that cuDNN's validation runs here; the frontend's test plans on a GPU)
    return cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=cudnn.Handle(None), sm_version=100)


def fe_forward(sizes, attn_scale, right_bound):
    """`generate_graph_fwd`'s graph: BHSD Q, K (d_qk), V (d_v); SF_Q/SF_K along d_qk, SF_V along s_kv; O
    [b, h_q, s_q, d_v] bf16, Stats and Amax_O fp32; top-left diagonal."""
    g, s = fe_graph(), sizes
    o, stats, amax = g.sdpa_mxfp8(
        q=fe_tensor(g, s["q"]), k=fe_tensor(g, s["k"]), v=fe_tensor(g, s["v"]),
        descale_q=fe_tensor(g, s["sf_q"], True), descale_k=fe_tensor(g, s["sf_k"], True),
        descale_v=fe_tensor(g, s["sf_v_fwd"], True), attn_scale=attn_scale, generate_stats=True,
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_left_bound=None,
        diagonal_band_right_bound=right_bound, sink_token=None, unfuse_fma=False)
    fe_output(o, s["o"], cudnn.data_type.BFLOAT16)
    fe_output(stats, s["o"][:3] + [1], cudnn.data_type.FLOAT)
    fe_output(amax, [1, 1, 1, 1], cudnn.data_type.FLOAT)
    return g


def fe_backward(sizes, attn_scale, right_bound):
    """`generate_graph_bwd`'s graph: Q, Q_T, K, K_T (d_qk), V, dO, dO_T (d_v) in FP8, O and dO bf16, Stats; the
    seven scale tensors (row-wise along D, the _T ones along S), deterministic; dQ, dK, dV bf16 and amaxes."""
    g, s = fe_graph(), sizes
    bf16 = cudnn.data_type.BFLOAT16
    outs = g.sdpa_mxfp8_backward(
        q=fe_tensor(g, s["q"]), q_T=fe_tensor(g, s["q"]), k=fe_tensor(g, s["k"]), k_T=fe_tensor(g, s["k"]),
        v=fe_tensor(g, s["v"]), o_f16=fe_tensor(g, s["o"], data_type=bf16),
        dO_f16=fe_tensor(g, s["o"], data_type=bf16), dO=fe_tensor(g, s["o"]), dO_T=fe_tensor(g, s["o"]),
        stats=fe_tensor(g, s["o"][:3] + [1], data_type=cudnn.data_type.FLOAT),
        descale_q=fe_tensor(g, s["sf_q"], True), descale_q_T=fe_tensor(g, s["sf_q_t"], True),
        descale_k=fe_tensor(g, s["sf_k"], True), descale_k_T=fe_tensor(g, s["sf_k_t"], True),
        descale_v=fe_tensor(g, s["sf_v_bwd"], True), descale_dO=fe_tensor(g, s["sf_do"], True),
        descale_dO_T=fe_tensor(g, s["sf_do_t"], True), attn_scale=attn_scale, use_deterministic_algorithm=True,
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, left_bound=None, right_bound=right_bound,
        sink_token=None, dSink_token=None)
    for t, name in zip(outs, ("q", "k", "v")):
        fe_output(t, s[name], bf16)
    for t in outs[3:]:
        fe_output(t, [1, 1, 1, 1], cudnn.data_type.FLOAT)
    return g


def by_port(j):
    """(port name -> (dims, strides, data type, reordering) of its tensor, the node without names and uids)."""
    (node,) = j["nodes"]
    tensors = tensors_of(j)
    ports = {port: tensors[uid] for port, uid in {**node["inputs"], **node["outputs"]}.items()}
    facts = {port: (t["dim"], t["stride"], t["data_type"], t["reordering_type"]) for port, t in ports.items()}
    return facts, {k: v for k, v in node.items() if k not in ("name", "inputs", "outputs")}


def mxattn_graphs(b, hq, hk, sq, skv, dqk, dv, mask):
    """mxattn's forward and backward graph JSON for BHSD-contiguous bf16 inputs (the typed interface's configs)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g).bfloat16() for h, s, d in ((hq, sq, dqk), (hk, skv, dqk),
                                                                              (hk, skv, dv)))
    o, do = (torch.randn(b, hq, sq, dv, generator=g).bfloat16() for _ in range(2))
    qr, kr, vc = quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2)
    scale = dqk ** -0.5
    fcfg = forward_config(qr, kr, vc, attn_scale=scale, mask=mask)
    bcfg = backward_config(qr, quantize_mxfp8(q, -2), kr, quantize_mxfp8(k, -2), quantize_mxfp8(v, -1), o, do,
                           quantize_mxfp8(do, -1), quantize_mxfp8(do, -2), torch.zeros(b, hq, sq, 1),
                           attn_scale=scale, mask=mask)
    return graph_json(build_forward_graph(fcfg)), graph_json(build_backward_graph(bcfg))


#: the column-wise scale ports, whose strides mxattn declares scale-block axis first (`COL_SCALE_BLOCK_AXIS_
#: CONTIGUOUS`, the binding's and the C++ sample's) and the frontend's Python test row-major
COL_SCALE_PORTS = {"forward": ("Descale_V",), "backward": ("Descale_Q_T", "Descale_K_T", "Descale_dO_T")}


@needs_mxfp8_cudnn
@pytest.mark.parametrize("right_bound", [None, 0], ids=["no_mask", "causal"])
@pytest.mark.parametrize("block_axis_contiguous", [False, True])
def test_192_128_graphs_equal_the_frontend_tests(right_bound, block_axis_contiguous, monkeypatch):
    """b 2, GQA 4:2, s_q 320, s_kv 448 (scale padding on both), d_qk 192, d_v 128, scale 1/sqrt(192), bf16 out:
    every port's tensor (dims, strides, data type, reordering) and every node attribute of mxattn's graphs equal
    the frontend test's; with mxattn's default declaration the column-wise scale ports differ in their strides
    alone (the same bytes, spec section 4)."""
    monkeypatch.setattr(cudnn_config, "COL_SCALE_BLOCK_AXIS_CONTIGUOUS", block_axis_contiguous)
    b, hq, hk, sq, skv, dqk, dv = 2, 4, 2, 320, 448, 192, 128
    sizes = fe_sizes(b, hq, hk, sq, skv, dqk, dv)
    mask = MaskSpec(causal=right_bound == 0)
    mine = mxattn_graphs(b, hq, hk, sq, skv, dqk, dv, mask)
    theirs = (graph_json(fe_forward(sizes, dqk ** -0.5, right_bound)),
              graph_json(fe_backward(sizes, dqk ** -0.5, right_bound)))
    for kind, j_mine, j_theirs in zip(("forward", "backward"), mine, theirs):
        (ports, node), (fe_ports, fe_node) = by_port(j_mine), by_port(j_theirs)
        assert node == fe_node and sorted(ports) == sorted(fe_ports)
        for port, facts in ports.items():
            want = fe_ports[port]
            if block_axis_contiguous and port in COL_SCALE_PORTS[kind]:
                _, h, s32p, dp = want[0]
                want = (want[0], [h * s32p * dp, s32p * dp, 1, s32p], *want[2:])
            assert facts == want, (kind, port)
    assert by_port(mine[1])[0]["Descale_V"][0] == [b, hk, 512, 4]  # backward SF_V: 448 rows to 512, 128/32 blocks


# --------------------------------------------------------------------------------------------------------------
# the public call's variant packs
# --------------------------------------------------------------------------------------------------------------
def public_inputs(layout, dqk=192, dv=128):
    """(q, k, v, do, kw, v and do as [B, H, S, D] views with the padding rows zeroed, cu_seqlens or None) of a
    causal GQA 4:2 call: bshd, padded bshd or thd."""
    g = torch.Generator().manual_seed(len(layout))
    lens_q, lens_kv = [150, 200], [100, 160]
    if layout == "thd":
        q, do = (torch.randn(sum(lens_q), 4, d, generator=g).bfloat16() for d in (dqk, dv))
        k, v = (torch.randn(sum(lens_kv), 2, d, generator=g).bfloat16() for d in (dqk, dv))
        cu_q, cu_kv = (torch.tensor([0] + list(itertools.accumulate(n)), dtype=torch.int32) for n in (lens_q, lens_kv))
        kw = dict(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        return q, k, v, do, kw, v.transpose(0, 1)[None], do.transpose(0, 1)[None], (cu_q, cu_kv)
    q, do = (torch.randn(2, 200, 4, d, generator=g).bfloat16() for d in (dqk, dv))
    k, v = (torch.randn(2, 160, 2, d, generator=g).bfloat16() for d in (dqk, dv))
    kw = dict(qkv_format="bshd", attn_mask_type="causal")
    cu = (None, None)
    if layout == "padded":
        cu = tuple(torch.tensor([0] + list(itertools.accumulate(n)), dtype=torch.int32) for n in (lens_q, lens_kv))
        kw.update(attn_mask_type="padding_causal", cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1])
    return q, k, v, do, kw, _zeroed(v.transpose(1, 2), cu[1], 160), _zeroed(do.transpose(1, 2), cu[0], 200), None


@needs_mxfp8_cudnn
@pytest.mark.parametrize("layout", ["bshd", "padded", "thd"])
def test_public_call_sends_v_and_do_along_d_v_in_the_graphs_slots(layout, captured_packs):
    """mxfp8_attention(backend="cudnn") forward + backward at (192, 128): the configs carry both dims and the
    default scale 1/sqrt(192); every slot of both packs is as its graph declares it (cuDNN's JSON); V reaches the
    forward column-wise (blocks along S) and the backward row-wise (blocks along d_v), dO both ways, each d_v
    wide (a packed batch's column-wise blocks restart at every sequence)."""
    q, k, v, do, kw, v_bhsd, do_bhsd, packed_cu = public_inputs(layout)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = mxattn.mxfp8_attention(*leaves, backend="cudnn", **kw)
    assert out.shape == do.shape
    out.backward(do)
    (fkind, fcfg, fpack), (bkind, bcfg, bpack) = captured_packs
    assert (fkind, bkind) == ("forward", "backward")
    for kind, cfg, pack in (("forward", fcfg, fpack), ("backward", bcfg, bpack)):
        assert (cfg.d_qk, cfg.d_v) == (192, 128) and math.isclose(cfg.attn_scale, 192 ** -0.5, rel_tol=1e-12)
        check_pack_against_graph(pack, tensors_of(graph_json(BUILD[kind](cfg))), layout == "thd")
    seg_kv, seg_q = (None, None) if packed_cu is None else (packed_cu[1], packed_cu[0])
    want = ((fpack[FwdUid.V], quantize_mxfp8(v_bhsd, -2, segments=seg_kv).data),
            (bpack[BwdUid.V], quantize_mxfp8(v_bhsd, -1).data),
            (bpack[BwdUid.DO], quantize_mxfp8(do_bhsd, -1).data),
            (bpack[BwdUid.DO_T], quantize_mxfp8(do_bhsd, -2, segments=seg_q).data),
            (bpack[BwdUid.DO_F16], do_bhsd))
    for got, expected in want:
        assert got.shape == expected.shape and got.shape[-1] == 128
        assert torch.equal(_bytes(got), _bytes(expected))


# --------------------------------------------------------------------------------------------------------------
# Blackwell: the cudnn backend against the reference backend
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.blackwell
@pytest.mark.parametrize("dims", [(192, 128), (128, 64)], ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("layout", ["bshd", "padded", "thd"])
def test_cudnn_matches_the_reference_backend(layout, dims):
    """Forward and backward through mxfp8_attention (causal, GQA 4:2, default scale 1/sqrt(d_qk)): O and dQ, dK,
    dV of the cudnn backend against the reference backend's on the same inputs, with the Blackwell tests'
    tolerances (the cuDNN frontend test's atol/rtol and a relative-RMS bound)."""
    from test_cudnn_gpu import GRAD_REL_RMS, GRAD_TOL, O_REL_RMS, O_TOL, _blackwell_ready
    from mxattn.metrics import rel_rms
    ok, reason = _blackwell_ready()
    if not ok:
        pytest.skip(reason)
    q, k, v, do, kw, *_ = public_inputs(layout, *dims)
    results = []
    for backend in ("cudnn", "reference"):
        leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
        cuda_kw = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
        o = mxattn.mxfp8_attention(*leaves, backend=backend, **cuda_kw)
        o.backward(do.cuda())
        results.append((o.detach(), *(t.grad for t in leaves)))
    (o, *grads), (o_ref, *grads_ref) = results
    assert o.shape == o_ref.shape and o.shape[-1] == dims[1]
    torch.testing.assert_close(o.float(), o_ref.float(), **O_TOL)
    assert rel_rms(o, o_ref) < O_REL_RMS
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(got.float(), want.float(), **GRAD_TOL, msg=lambda m: f"{name}: {m}")
        assert rel_rms(got, want) < GRAD_REL_RMS, name
