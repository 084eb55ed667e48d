"""CPU checks of the cuDNN MXFP8 attention graphs: cuDNN's own validation and JSON, variant packs, scale bytes.

Expected dims/strides/types are computed here from spec sections 4-5 (not from mxattn.backends.cudnn), and the
scale bytes from the F8_128x4 byte-offset formula; the graphs are lowered to the cuDNN C++ frontend without a
GPU (deviceless, targeting SM 10.0), so cuDNN's own arch-aware validation runs on every config.
"""

import itertools
import struct
import subprocess
import sys
import threading

import pytest
from repo_paths import ROOT
import torch

cudnn = pytest.importorskip("cudnn")

from mxattn.backends.cudnn import buffers as cudnn_buffers  # noqa: E402
from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends.base import AttentionParams  # noqa: E402
from mxattn.backends.cudnn.backend import CudnnBackend  # noqa: E402
from mxattn.backends.cudnn.run import backward_buffers, backward_config, cudnn_forward, forward_buffers, forward_config  # noqa: E402
from mxattn.backends.cudnn.support import cudnn_support, version_text  # noqa: E402
from mxattn.errors import MXFP8NotSupportedError  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402

# cuDNN's own validation of MXFP8 graphs needs a backend that knows them
needs_mxfp8_cudnn = pytest.mark.skipif(cudnn.backend_version() < 92100,
                                       reason=f"cuDNN {cudnn.backend_version()} < 9.21 cannot validate MXFP8 graphs")

from cudnn_matrix import HEAD_DIMS, HEADS, LAYOUTS, MASKS, SEQS  # noqa: E402
from cudnn_fixtures import check_pack_against_graph  # noqa: E402


def cdiv(a, b):
    return -(-a // b)


def view_strides(shape, layout):
    """Strides of the [B, H, S, D] view of a dense tensor stored in `layout` order (via torch, independently)."""
    perm = LAYOUTS[layout]
    physical = torch.empty([shape[i] for i in perm], dtype=torch.uint8, device="meta")
    inverse = [perm.index(i) for i in range(4)]
    return list(physical.permute(inverse).stride())


def row_major(dims):
    return list(torch.empty(dims, dtype=torch.uint8, device="meta").stride())


def row_sf(b, h, s, d):  # spec 4: SF_Q, SF_K, SF_dO, backward SF_V: [B, H, Sp, D32p]
    dims = [b, h, cdiv(s, 128) * 128, cdiv(cdiv(d, 32), 4) * 4]
    return dims, row_major(dims)


def col_sf(b, h, s, d):  # spec 4: forward SF_V and *_T: [B, H, S32p, Dp], the C++ sample's strides (or row-major)
    s32p, dp = cdiv(cdiv(s, 32), 4) * 4, cdiv(d, 128) * 128
    dims = [b, h, s32p, dp]
    return dims, [h * s32p * dp, s32p * dp, 1, s32p] if cudnn_config.COL_SCALE_BLOCK_AXIS_CONTIGUOUS else row_major(dims)


def expected_tensors(kind, b, hq, hk, sq, skv, dqk, dv, layout, out="BFLOAT16"):
    """uid -> (name, dims, strides, data_type, reordering) per spec section 5."""
    q, k, v, o = [b, hq, sq, dqk], [b, hk, skv, dqk], [b, hk, skv, dv], [b, hq, sq, dv]
    st = {n: view_strides(x, layout) for n, x in (("q", q), ("k", k), ("v", v), ("o", o))}
    stats = ([b, hq, sq, 1], [hq * sq, sq, 1, 1], "FLOAT", "NONE")
    amax = ([1, 1, 1, 1], [1, 1, 1, 1], "FLOAT", "NONE")
    f8 = "FP8_E4M3"
    E = lambda dims_strides: (*dims_strides, "FP8_E8M0", "F8_128x4")  # noqa: E731
    if kind == "forward":
        return {1: ("Q", q, st["q"], f8, "NONE"), 2: ("K", k, st["k"], f8, "NONE"), 3: ("V", v, st["v"], f8, "NONE"),
                4: ("SF_Q", *E(row_sf(*q))), 5: ("SF_K", *E(row_sf(*k))), 6: ("SF_V", *E(col_sf(*v))),
                7: ("O", o, st["o"], out, "NONE"), 8: ("STATS", *stats), 9: ("AMAX_O", *amax)}
    return {101: ("Q", q, st["q"], f8, "NONE"), 102: ("Q_T", q, st["q"], f8, "NONE"),
            103: ("K", k, st["k"], f8, "NONE"), 104: ("K_T", k, st["k"], f8, "NONE"),
            105: ("V", v, st["v"], f8, "NONE"), 106: ("O", o, st["o"], out, "NONE"),
            107: ("DO_F16", o, st["o"], out, "NONE"), 108: ("DO", o, st["o"], f8, "NONE"),
            109: ("DO_T", o, st["o"], f8, "NONE"), 110: ("STATS", *stats),
            111: ("SF_Q", *E(row_sf(*q))), 112: ("SF_Q_T", *E(col_sf(*q))), 113: ("SF_K", *E(row_sf(*k))),
            114: ("SF_K_T", *E(col_sf(*k))), 115: ("SF_V", *E(row_sf(*v))), 116: ("SF_DO", *E(row_sf(*o))),
            117: ("SF_DO_T", *E(col_sf(*o))), 118: ("DQ", q, st["q"], out, "NONE"),
            119: ("DK", k, st["k"], out, "NONE"), 120: ("DV", v, st["v"], out, "NONE"),
            121: ("AMAX_DQ", *amax), 122: ("AMAX_DK", *amax), 123: ("AMAX_DV", *amax)}


def cudnn_rejects(kind, s_q, s_kv, mask):
    """cuDNN 9.28's own rule (its C++ validation): the backward's bottom-right band with a right bound needs
    s_q and s_kv multiples of 64."""
    return (kind == "backward" and mask.diagonal_alignment == "bottom_right"
            and mask.right_bound is not None and (s_q % 64 or s_kv % 64))


def check_json(j, kind, cfg, layout):
    tensors = {t["uid"]: t for t in j["tensors"] if not t["is_virtual"]}
    want = expected_tensors(kind, cfg.b, cfg.h_q, cfg.h_k, cfg.s_q, cfg.s_kv, cfg.d_qk, cfg.d_v, layout)
    assert sorted(tensors) == sorted(want)
    for uid, (name, dims, strides, dtype, reorder) in want.items():
        got = tensors[uid]
        assert (got["name"], got["dim"], got["stride"], got["data_type"], got["reordering_type"]) == \
            (name, dims, strides, dtype, reorder), f"{kind} uid {uid}"
    (node,) = j["nodes"]
    assert node["tag"] == ("SDPA_MXFP8_FWD" if kind == "forward" else "SDPA_MXFP8_BWD") and node["is_mxfp8"]
    assert node["attn_scale_value"] == struct.pack(">f", cfg.attn_scale).hex().upper()
    m = cfg.mask
    assert node["diagonal_alignment"] == m.diagonal_alignment.upper()
    assert node["left_bound"] == m.left_bound and node["right_bound"] == m.right_bound
    ports = {**node["inputs"], **node["outputs"]}
    if kind == "forward":
        assert node["generate_stats"] is True
        assert ports == {"Q": 1, "K": 2, "V": 3, "Descale_Q": 4, "Descale_K": 5, "Descale_V": 6, "O": 7,
                         "Stats": 8, "Amax_O": 9}
    else:
        assert node["is_deterministic_algorithm"] is cfg.deterministic
        assert ports == {"Q": 101, "Q_T": 102, "K": 103, "K_T": 104, "V": 105, "O": 106, "dO_f16": 107, "dO": 108,
                         "dO_T": 109, "Stats": 110, "Descale_Q": 111, "Descale_Q_T": 112, "Descale_K": 113,
                         "Descale_K_T": 114, "Descale_V": 115, "Descale_dO": 116, "Descale_dO_T": 117,
                         "dQ": 118, "dK": 119, "dV": 120, "Amax_dQ": 121, "Amax_dK": 122, "Amax_dV": 123}


@needs_mxfp8_cudnn
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_every_graph_of_the_matrix_validates_with_spec_tensors(kind):
    """Full product: 4 s x 3 d x 3 head ratios x 6 masks x 3 layouts. Each graph passes pygraph validate() and
    build_operation_graph() and cuDNN's C++ validate(); its JSON has exactly the spec's tensors."""
    build = cudnn_graphs.build_forward_graph if kind == "forward" else cudnn_graphs.build_backward_graph
    checked = rejected = 0
    for s, (dqk, dv), (hq, hk), mask, layout in itertools.product(SEQS, HEAD_DIMS, HEADS, MASKS.values(), LAYOUTS):
        cfg = cudnn_config.GraphConfig.from_layout(2, hq, hk, s, s, dqk, dv, layout=layout, mask=mask, attn_scale=0.0884)
        graph = build(cfg)  # pygraph validate() + build_operation_graph()
        if cudnn_rejects(kind, s, s, mask):
            with pytest.raises(MXFP8NotSupportedError, match="multiple of 64"):
                cudnn_graphs.graph_json(graph)
            rejected += 1
            continue
        check_json(cudnn_graphs.graph_json(graph), kind, cfg, layout)
        checked += 1
    assert checked + rejected == 4 * 3 * 3 * len(MASKS) * 3
    assert rejected == (27 * 2 if kind == "backward" else 0)


@needs_mxfp8_cudnn
def test_unequal_lengths_fp16_and_nondeterministic_backward():
    cfg = cudnn_config.GraphConfig.from_layout(1, 4, 4, 256, 1024, 128, layout="bshd", out_dtype=torch.float16,
                                     mask=MaskSpec(causal=True, diagonal_alignment="bottom_right"),
                                     deterministic=False)
    for kind, build in (("forward", cudnn_graphs.build_forward_graph), ("backward", cudnn_graphs.build_backward_graph)):
        graph = build(cfg)
        j = cudnn_graphs.graph_json(graph)
        out = {t["name"]: t["data_type"] for t in j["tensors"]}
        assert out["O"] == "HALF" and (kind == "forward" or out["DQ"] == "HALF")
        if kind == "backward":
            # we ask for the non-deterministic algorithm; cuDNN's frontend routes MXFP8 backward on SM 10.x to the
            # deterministic one anyway (spec section 5), which its JSON shows
            assert graph.nodes[0].params["use_deterministic_algorithm"] is False
            assert j["nodes"][0]["is_deterministic_algorithm"] is True
        assert j["nodes"][0]["diagonal_alignment"] == "BOTTOM_RIGHT"


@needs_mxfp8_cudnn
@pytest.mark.parametrize("case, message", [
    (dict(d_qk=192, d_v=192), "d_qk == 192 and d_v == 128"),
    (dict(s_q=512, s_kv=256, mask=MaskSpec(causal=True, diagonal_alignment="bottom_right")), "max_s_q > max_s_kv"),
])
def test_cudnn_rejection_carries_cudnns_reason(case, message):
    args = dict(b=1, h_q=2, h_kv=2, s_q=256, s_kv=256, d_qk=128)
    args.update({k: v for k, v in case.items() if k in args})
    cfg = cudnn_config.GraphConfig.from_layout(**args, d_v=case.get("d_v"), mask=case.get("mask"))
    with pytest.raises(MXFP8NotSupportedError, match=message.replace("(", r"\(")):
        cudnn_graphs.graph_json(cudnn_graphs.build_forward_graph(cfg))


@pytest.mark.parametrize("bad, error", [
    (dict(h_k=4), ValueError), (dict(s_q=0), ValueError), (dict(q_stride=(1, 1, 1, 2)), ValueError),
    (dict(out_dtype=torch.float32), ValueError), (dict(fp8_dtype=torch.int8), ValueError),
    (dict(attn_scale=float("nan")), ValueError), (dict(mask="causal"), TypeError),
])
def test_config_rejects_bad_values(bad, error):
    good = dict(b=1, h_q=6, h_k=2, h_v=2, s_q=128, s_kv=128, d_qk=64, d_v=64, attn_scale=0.125,
                q_stride=(49152, 8192, 64, 1), k_stride=(16384, 8192, 64, 1), v_stride=(16384, 8192, 64, 1),
                o_stride=(49152, 8192, 64, 1))
    cudnn_config.GraphConfig(**good)
    with pytest.raises(error):
        cudnn_config.GraphConfig(**{**good, **bad})


# --------------------------------------------------------------------------------------------------------------
# scale bytes against an independent byte-offset computation
# --------------------------------------------------------------------------------------------------------------
def grid(*sizes):
    return torch.meshgrid(*[torch.arange(n) for n in sizes], indexing="ij")


def expected_row_bytes(scale):
    """Spec section 4 for row-wise scales [B, H, M=S, K=ceil(D/32)]: per-(b, h) slabs, one after another."""
    B, H, M, K = scale.shape
    Mp, Kp = cdiv(M, 128) * 128, cdiv(K, 4) * 4
    b, h, m, k = grid(B, H, M, K)
    off = (b * H + h) * Mp * Kp + ((m // 128) * (Kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 \
        + k % 4
    out = torch.zeros(B * H * Mp * Kp, dtype=torch.uint8)
    out[off.flatten()] = scale.view(torch.uint8).flatten()
    return out


def expected_col_bytes(scale):
    """Column-wise scales [B, H, K=ceil(S/32), M=D] as cuDNN reads them: the 128x4 rule on M=D x K=B*H*S32p (each
    slab's K padded to S32p), D tile outermost. For Dp == 128 this is spec section 4's per-slab order."""
    B, H, K, M = scale.shape
    S32p, Dp = cdiv(K, 4) * 4, cdiv(M, 128) * 128
    b, h, k, m = grid(B, H, K, M)
    off = ((m // 128) * (B * H * S32p // 4) + (b * H + h) * (S32p // 4) + k // 4) * 512 + (m % 32) * 16 \
        + ((m % 128) // 32) * 4 + k % 4
    out = torch.zeros(B * H * S32p * Dp, dtype=torch.uint8)
    out[off.flatten()] = scale.view(torch.uint8).flatten()
    return out


def spec_slab_col_bytes(scale):
    """Spec section 4 read literally for a column-wise scale: per-(b, h) slabs of the transposed [D, S32] matrix."""
    return expected_row_bytes(scale.transpose(2, 3))


def raw_bytes(t):
    """The bytes a (possibly as_strided) pack tensor covers, in memory order."""
    n = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return torch.as_strided(t.view(torch.uint8), (n,), (1,), t.storage_offset()).clone()


def random_scale(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, shape, dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("b, h, s, d", [(1, 1, 128, 64), (2, 3, 500, 192), (1, 2, 4096, 128), (2, 1, 33, 96)])
def test_scale_buffers_hold_the_f8_128x4_bytes(b, h, s, d):
    row = random_scale(b, h, s, cdiv(d, 32), seed=1)
    buf = cudnn_buffers.row_scale_buffer(row)
    assert list(buf.shape) == row_sf(b, h, s, d)[0] and buf.dtype == torch.float8_e8m0fnu
    assert torch.equal(raw_bytes(buf), expected_row_bytes(row))
    col = random_scale(b, h, cdiv(s, 32), d, seed=2)
    buf = cudnn_buffers.col_scale_buffer(col)
    assert (list(buf.shape), list(buf.stride())) == col_sf(b, h, s, d)
    assert torch.equal(raw_bytes(buf), expected_col_bytes(col))
    same_as_spec_slabs = torch.equal(expected_col_bytes(col), spec_slab_col_bytes(col))
    assert same_as_spec_slabs == (d <= 128 or b * h == 1)  # the spec's per-slab order differs only for D > 128


# --------------------------------------------------------------------------------------------------------------
# variant packs built from real tensors
# --------------------------------------------------------------------------------------------------------------
def covering_configs():
    """Every value of s, d, heads, mask and layout appears, and every (layout, heads, d) triple (27 cases)."""
    masks, seqs = list(MASKS), list(SEQS)
    out = []
    for i, (layout, heads, dims) in enumerate(itertools.product(LAYOUTS, HEADS, HEAD_DIMS)):
        out.append((seqs[i % 4], dims, heads, masks[i % len(masks)], layout))
    return out


def make_inputs(cfg_tuple, seed):
    s, (dqk, dv), (hq, hk), mask_name, layout = cfg_tuple
    b = 1 if s >= 1024 else 2
    g = torch.Generator().manual_seed(seed)

    def tensor(h, d, dtype=torch.bfloat16):
        perm = LAYOUTS[layout]
        shape = (b, h, s, d)
        physical = torch.randn([shape[i] for i in perm], generator=g).to(dtype)
        return physical.permute([perm.index(i) for i in range(4)])  # a [B, H, S, D] view, never a copy

    return b, tensor(hq, dqk), tensor(hk, dqk), tensor(hk, dv), tensor(hq, dv), tensor(hq, dv), mask_name


@needs_mxfp8_cudnn
@pytest.mark.parametrize("case", covering_configs(), ids=lambda c: f"s{c[0]}-d{c[1][0]}-h{c[2][0]}_{c[2][1]}-{c[3]}-"
                                                                     f"{c[4]}")
def test_variant_packs_match_the_graphs(case):
    s, (dqk, dv), (hq, hk), mask_name, layout = case
    b, q, k, v, o, do, _ = make_inputs(case, seed=len(str(case)))
    mask = MASKS[mask_name]
    qr, qc, kr, kc = (quantize_mxfp8(q, -1), quantize_mxfp8(q, -2), quantize_mxfp8(k, -1), quantize_mxfp8(k, -2))
    vr, vc, dor, doc = quantize_mxfp8(v, -1), quantize_mxfp8(v, -2), quantize_mxfp8(do, -1), quantize_mxfp8(do, -2)
    stats = torch.randn(b, hq, s, 1)

    fcfg = forward_config(qr, kr, vc, attn_scale=0.1, mask=mask)
    fpack, (o_out, stats_out, amax) = forward_buffers(fcfg, qr, kr, vc)
    args = (qr, qc, kr, kc, vr, o, do, dor, doc, stats)
    bcfg = backward_config(*args, attn_scale=0.1, mask=mask)
    bpack, grads = backward_buffers(bcfg, *args)
    assert fcfg.q_stride == tuple(view_strides(q.shape, layout))
    assert b == 1 or cudnn_config.layout_name(fcfg.q_stride) == layout  # at b=1, bshd and sbhd strides coincide
    # O comes back in the inputs' layout (strides of size-1 axes are immaterial)
    assert [st for st, n in zip(o_out.stride(), o_out.shape) if n > 1] == \
        [st for st, n in zip(view_strides(o_out.shape, layout), o_out.shape) if n > 1]

    for kind, cfg, pack, build in (("forward", fcfg, fpack, cudnn_graphs.build_forward_graph),
                                   ("backward", bcfg, bpack, cudnn_graphs.build_backward_graph)):
        graph = build(cfg)
        if cudnn_rejects(kind, s, s, mask):
            continue
        tensors = {t["uid"]: t for t in cudnn_graphs.graph_json(graph)["tensors"] if not t["is_virtual"]}
        check_pack_against_graph(pack, tensors, packed=False)

    # data slots are the quantized tensors themselves (layout by strides, no copies); scales hold the spec bytes
    assert fpack[cudnn_config.FwdUid.Q] is qr.data and fpack[cudnn_config.FwdUid.K] is kr.data and fpack[cudnn_config.FwdUid.V] is vc.data
    assert fpack[cudnn_config.FwdUid.O] is o_out and fpack[cudnn_config.FwdUid.STATS] is stats_out and fpack[cudnn_config.FwdUid.AMAX_O] is amax
    for uid, x in ((cudnn_config.FwdUid.SF_Q, qr), (cudnn_config.FwdUid.SF_K, kr)):
        assert torch.equal(raw_bytes(fpack[uid]), expected_row_bytes(x.scale))
    assert torch.equal(raw_bytes(fpack[cudnn_config.FwdUid.SF_V]), expected_col_bytes(vc.scale))
    B = cudnn_config.BwdUid
    for uid, x in ((B.Q, qr), (B.Q_T, qc), (B.K, kr), (B.K_T, kc), (B.V, vr), (B.DO, dor), (B.DO_T, doc)):
        assert bpack[uid] is x.data
    assert bpack[B.O] is o and bpack[B.DO_F16] is do and torch.equal(bpack[B.STATS], stats)
    for uid, x in ((B.SF_Q, qr), (B.SF_K, kr), (B.SF_V, vr), (B.SF_DO, dor)):
        assert torch.equal(raw_bytes(bpack[uid]), expected_row_bytes(x.scale))
    for uid, x in ((B.SF_Q_T, qc), (B.SF_K_T, kc), (B.SF_DO_T, doc)):
        assert torch.equal(raw_bytes(bpack[uid]), expected_col_bytes(x.scale))
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert [g.stride() for g in grads[:3]] == [q.stride(), k.stride(), v.stride()]


def test_pack_rejects_a_mismatching_tensor_by_name():
    case = (128, (64, 64), (8, 2), "none", "bshd")
    b, q, k, v, *_ = make_inputs(case, seed=3)
    qr, kr, vc = quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2)
    cfg = forward_config(qr, kr, vc, attn_scale=0.125)
    pack, (o, stats, amax) = forward_buffers(cfg, qr, kr, vc)
    (qd, sf_q), (kd, sf_k), (vd, sf_v) = cudnn_buffers.operand(qr), cudnn_buffers.operand(kr), cudnn_buffers.operand(vc)
    ok = dict(q=qd, sf_q=sf_q, k=kd, sf_k=sf_k, v=vd, sf_v=sf_v, o=o, stats=stats, amax_o=amax)
    assert cudnn_buffers.forward_pack(cfg, **ok).keys() == pack.keys()
    for name, bad in (("q", qd.contiguous()), ("sf_v", sf_v.contiguous()), ("o", o.float()),
                      ("stats", stats[:, :1])):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            cudnn_buffers.forward_pack(cfg, **{**ok, name: bad})


def test_typed_interface_rejects_bad_inputs_before_running():
    case = (128, (64, 64), (8, 2), "none", "bshd")
    b, q, k, v, o, do, _ = make_inputs(case, seed=4)
    qr, kr, vc, vr = quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2), quantize_mxfp8(v, -1)
    with pytest.raises(ValueError, match="quantized along S"):
        forward_config(qr, kr, vr, attn_scale=0.1)
    with pytest.raises(TypeError, match="MXFP8Tensor"):
        forward_config(q, kr, vc, attn_scale=0.1)
    with pytest.raises(ValueError, match="h_q"):
        forward_config(qr, quantize_mxfp8(k[:, :1].expand(-1, 3, -1, -1).contiguous(), -1), vc, attn_scale=0.1)
    with pytest.raises(ValueError, match="CUDA"):
        cudnn_forward(qr, kr, vc, attn_scale=0.1)
    with pytest.raises(ValueError, match="CUDA"):
        CudnnBackend().forward(q, k, v, AttentionParams(softmax_scale=0.1, mask=MaskSpec()))
    args = [qr, quantize_mxfp8(q.contiguous(), -2), kr, quantize_mxfp8(k, -2), vr, o, do, quantize_mxfp8(do, -1),
            quantize_mxfp8(do, -2), torch.zeros(b, 8, 128, 1)]
    with pytest.raises(ValueError, match="q_col data strides"):
        backward_config(*args, attn_scale=0.1)


def test_cache_keys_pin_every_fact_of_the_arguments():
    from mxattn.backends.cudnn.run import backward_key, forward_key
    case = (128, (64, 64), (8, 2), "none", "bshd")
    b, q, k, v, o, do, _ = make_inputs(case, seed=5)
    qr, kr, vc = quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2)
    key = forward_key(qr, kr, vc, 0.1, MaskSpec(), torch.bfloat16)
    assert key == forward_key(quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2), 0.1,
                              MaskSpec(), torch.bfloat16)  # equal facts, new tensors: one graph
    variants = [
        forward_key(quantize_mxfp8(q.contiguous(), -1), kr, vc, 0.1, MaskSpec(), torch.bfloat16),  # strides
        forward_key(qr, kr, quantize_mxfp8(v, -1), 0.1, MaskSpec(), torch.bfloat16),  # orientation
        forward_key(quantize_mxfp8(q, -1, fp8_dtype=torch.float8_e5m2), kr, vc, 0.1, MaskSpec(), torch.bfloat16),
        forward_key(qr, kr, vc, 0.2, MaskSpec(), torch.bfloat16),
        forward_key(qr, kr, vc, 0.1, MaskSpec(causal=True), torch.bfloat16),
        forward_key(qr, kr, vc, 0.1, MaskSpec(), torch.float16),
        forward_key(type(qr)(qr.data, qr.scale.to("meta"), 3), kr, vc, 0.1, MaskSpec(), torch.bfloat16),  # device
    ]
    assert len({key, *variants}) == len(variants) + 1
    args = [qr, quantize_mxfp8(q, -2), kr, quantize_mxfp8(k, -2), quantize_mxfp8(v, -1), o, do,
            quantize_mxfp8(do, -1), quantize_mxfp8(do, -2), torch.zeros(b, 8, 128, 1)]
    bkey = backward_key(*args, 0.1, MaskSpec(), True)
    assert bkey != backward_key(*args, 0.1, MaskSpec(), False)
    assert bkey != backward_key(*args[:5], o.contiguous(), *args[6:], 0.1, MaskSpec(), True)


# --------------------------------------------------------------------------------------------------------------
# cache and support check
# --------------------------------------------------------------------------------------------------------------
def test_graph_cache_is_a_bounded_thread_safe_lru():
    built = []
    lock = threading.Lock()

    def get(cache, kind, cfg, device_index):
        def fake_build():  # stands in for build + plan, which need the device
            with lock:
                built.append((kind, cfg.s_q, device_index))
            return cudnn_graphs.PlannedGraph(kind, cfg, object(), 0)
        return cache.get((kind, cfg, device_index), fake_build)

    cache = cudnn_graphs.GraphCache(maxsize=3)
    cfgs = [cudnn_config.GraphConfig.from_layout(1, 2, 2, s, s, 64) for s in (128, 256, 384, 512)]
    first = get(cache, "forward", cfgs[0], 0)
    same = cudnn_config.GraphConfig.from_layout(1, 2, 2, 128, 128, 64)  # equal config, new object: a hit
    assert get(cache, "forward", same, 0) is first and len(built) == 1
    assert cache.lookup(("forward", same, 0)) is first and cache.lookup(("forward", cfgs[1], 0)) is None
    assert get(cache, "forward", cfgs[0], 1) is not first  # another device: another graph
    assert get(cache, "backward", cfgs[0], 0).kind == "backward"
    get(cache, "forward", cfgs[0], 0)  # refresh: now the most recent
    get(cache, "forward", cfgs[1], 0)  # evicts the least recently used: device 1
    assert len(cache) == 3
    n = len(built)
    assert get(cache, "forward", cfgs[0], 0) is first and len(built) == n
    get(cache, "forward", cfgs[0], 1)
    assert len(built) == n + 1

    def failing():
        raise MXFP8NotSupportedError("no plan")

    with pytest.raises(MXFP8NotSupportedError):
        cache.get("never", failing)
    assert cache.lookup("never") is None  # failures are not cached

    cache = cudnn_graphs.GraphCache(maxsize=2)
    results, barrier = [], threading.Barrier(16)

    def worker(i):
        barrier.wait()
        for j in range(50):
            results.append(get(cache, "forward", cfgs[(i + j) % 4], 0))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 800 and len(cache) == 2
    assert all(r.cfg == cfgs[r.cfg.s_q // 128 - 1] for r in results)
    with pytest.raises(ValueError):
        cudnn_graphs.GraphCache(maxsize=0)


def test_cudnn_support_on_this_machine_says_why_and_never_raises():
    ok, reason = cudnn_support()
    if not torch.cuda.is_available():
        assert not ok and "no CUDA device" in reason and "SM 10.x" in reason
        assert f"cuDNN {version_text(cudnn.backend_version())}" in reason and "libcudnn" in reason
    for weird in ("cpu", "not-a-device", 12345, torch.device("meta")):
        ok, reason = cudnn_support(weird)
        assert not ok and isinstance(reason, str) and reason
    assert version_text(92100) == "9.21.0" and version_text(92800) == "9.28.0"


@needs_mxfp8_cudnn
def test_sample_prints_both_graphs_and_why_it_cannot_run_them_here():
    root = ROOT
    result = subprocess.run([sys.executable, "samples/cudnn_graphs.py", "--seq", "500", "--head-dim", "192",
                             "--head-dim-v", "128", "--kv-heads", "2", "--layout", "sbhd", "--left-bound", "64"],
                            cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "forward graph (SDPA_MXFP8_FWD" in out and "backward graph (SDPA_MXFP8_BWD" in out
    assert "SF_Q_T   [2, 8, 16, 256]" in out and "F8_128x4" in out and "'left_bound': 64" in out
    ok, reason = cudnn_support()
    if not ok:
        assert f"cannot run the graphs here: {reason}" in out
    else:
        assert "bit-identical: True" in out
