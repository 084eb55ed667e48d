"""CPU checks of the variable-length (padded and packed/thd) cuDNN MXFP8 graphs, and of the cudnn backend's
up-front support decision.

Expected dims/strides/ragged offsets are computed here independently of mxattn.backends.cudnn; the packed scale
bytes from the per-sequence-tile rule read in the cuDNN frontend 1.32 sources (`cudnn/sdpa/kernels/_mxfp8_sf.py`,
`cudnn/sdpa/bwd/api_dsl_sm107.py`: per head, sequence b's ceil(s_b/128) tiles from tile sum_{i<b} ceil(s_i/128),
each tile's bytes contiguous, column-wise D planes contiguous within a tile). Graphs are validated by cuDNN's own
C++ validation without a GPU (deviceless, SM 10.0).
"""

import dataclasses
import itertools

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

from cudnn_fixtures import (MASKS, check_pack_against_graph, fake_device, needs_mxfp8_cudnn,  # noqa: E402,F401
                            pretend_blackwell)
from mxattn.backends.cudnn import buffers as cudnn_buffers  # noqa: E402
from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends import Problem, pick_backend  # noqa: E402
from mxattn.backends.cudnn import backend as cudnn_backend  # noqa: E402
from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import refusals as cudnn_refusals  # noqa: E402
from mxattn.backends.cudnn import run as cudnn_run  # noqa: E402
from mxattn.backends.cudnn import run as cudnn_run  # noqa: E402
from mxattn.errors import MXFP8NotSupportedError  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402
from mxattn.seqinfo import SeqInfo  # noqa: E402

def cdiv(a, b):
    return -(-a // b)


def row_major(dims):
    return list(torch.empty(dims, dtype=torch.uint8, device="meta").stride())


def token_major(b, h, s, d):
    """[B, H, S, D] view strides of a [B*S (capacity), H, D] token-major tensor (via torch, independently)."""
    return list(torch.empty(b, s, h, d, device="meta").permute(0, 2, 1, 3).stride())


def expected(kind, cfg, varlen, layout="bshd"):
    """uid -> (dims, strides, data type, ragged offset uid) of every non-virtual tensor."""
    b, hq, hk, sq, skv, dqk, dv = cfg.b, cfg.h_q, cfg.h_k, cfg.s_q, cfg.s_kv, cfg.d_qk, cfg.d_v
    shapes = {"q": [b, hq, sq, dqk], "k": [b, hk, skv, dqk], "v": [b, hk, skv, dv], "o": [b, hq, sq, dv]}
    if varlen == "packed":
        st = {n: token_major(*x) for n, x in shapes.items()}
        stats_st = list(torch.empty(b, sq, hq, 1, device="meta").permute(0, 2, 1, 3).stride())
    else:
        st = {n: list(torch.empty([x[i] for i in (0, 2, 1, 3)], device="meta").permute(0, 2, 1, 3).stride())
              for n, x in shapes.items()}
        stats_st = row_major([b, hq, sq, 1])
    E8 = "FP8_E8M0"

    def row_sf(b_, h, s, d):
        dims = [b_, h, cdiv(s, 128) * 128, cdiv(cdiv(d, 32), 4) * 4]
        return dims, row_major(dims), E8, None

    def col_sf(b_, h, s, d):
        dims = [b_, h, cdiv(cdiv(s, 32), 4) * 4, cdiv(d, 128) * 128]
        return dims, [h * dims[2] * dims[3], dims[2] * dims[3], 1, dims[2]], E8, None

    packed = varlen == "packed"
    U = cudnn_config.FwdUid if kind == "forward" else cudnn_config.BwdUid
    rag = (lambda name: int(getattr(U, "RAGGED_" + name))) if packed else (lambda name: None)
    f8, out = "FP8_E4M3", "BFLOAT16"
    t = {}
    if kind == "forward":
        t.update({U.Q: (shapes["q"], st["q"], f8, rag("Q")), U.K: (shapes["k"], st["k"], f8, rag("K")),
                  U.V: (shapes["v"], st["v"], f8, rag("V")), U.SF_Q: row_sf(*shapes["q"]),
                  U.SF_K: row_sf(*shapes["k"]), U.SF_V: col_sf(*shapes["v"]),
                  U.O: (shapes["o"], st["o"], out, rag("O")),
                  U.STATS: ([b, hq, sq, 1], stats_st, "FLOAT", rag("STATS")),
                  U.AMAX_O: ([1, 1, 1, 1], [1, 1, 1, 1], "FLOAT", None)})
    else:
        for n, uids in (("q", (U.Q, U.Q_T)), ("k", (U.K, U.K_T)), ("o", (U.DO, U.DO_T))):
            for uid in uids:
                t[uid] = (shapes[n], st[n], f8, rag(n.upper()))
        t.update({U.V: (shapes["v"], st["v"], f8, rag("V")), U.O: (shapes["o"], st["o"], out, rag("O")),
                  U.DO_F16: (shapes["o"], st["o"], out, rag("O")),
                  U.STATS: ([b, hq, sq, 1], stats_st, "FLOAT", rag("STATS")),
                  U.SF_Q: row_sf(*shapes["q"]), U.SF_Q_T: col_sf(*shapes["q"]), U.SF_K: row_sf(*shapes["k"]),
                  U.SF_K_T: col_sf(*shapes["k"]), U.SF_V: row_sf(*shapes["v"]), U.SF_DO: row_sf(*shapes["o"]),
                  U.SF_DO_T: col_sf(*shapes["o"]), U.DQ: (shapes["q"], st["q"], out, rag("Q")),
                  U.DK: (shapes["k"], st["k"], out, rag("K")), U.DV: (shapes["v"], st["v"], out, rag("V"))})
        for uid in (U.AMAX_DQ, U.AMAX_DK, U.AMAX_DV):
            t[uid] = ([1, 1, 1, 1], [1, 1, 1, 1], "FLOAT", None)
    t[U.SEQ_LEN_Q] = t[U.SEQ_LEN_KV] = ([b, 1, 1, 1], [1, 1, 1, 1], "INT32", None)
    if packed:
        for name in ("Q", "K", "V", "O", "STATS"):
            t[getattr(U, "RAGGED_" + name)] = ([b + 1, 1, 1, 1], [1, 1, 1, 1], "INT32", None)
    return {int(uid): v for uid, v in t.items()}


def make_cfg(varlen, b, hq, hk, s_q, s_kv, dqk, dv, mask):
    if varlen == "packed":
        return cudnn_config.GraphConfig.from_packed(b, hq, hk, s_q, s_kv, dqk, dv, mask=mask, attn_scale=0.0884)
    return dataclasses.replace(cudnn_config.GraphConfig.from_layout(b, hq, hk, s_q, s_kv, dqk, dv, mask=mask,
                                                          attn_scale=0.0884), varlen="padded")


def check_json(j, kind, cfg, varlen):
    tensors = {t["uid"]: t for t in j["tensors"] if not t["is_virtual"]}
    want = expected(kind, cfg, varlen)
    assert sorted(tensors) == sorted(want)
    for uid, (dims, strides, dtype, ragged) in want.items():
        got = tensors[uid]
        assert (got["dim"], got["stride"], got["data_type"], got.get("ragged_offset_uid")) == \
            (dims, strides, dtype, ragged), f"{kind} {got['name']}"
    (node,) = j["nodes"]
    assert node["padding_mask"] is True
    U = cudnn_config.FwdUid if kind == "forward" else cudnn_config.BwdUid
    ins = node["inputs"]
    assert (ins["SEQ_LEN_Q"], ins["SEQ_LEN_KV"]) == (int(U.SEQ_LEN_Q), int(U.SEQ_LEN_KV))
    totals = (cfg.b * cfg.s_q, cfg.b * cfg.s_kv) if varlen == "packed" else (None, None)
    assert (node["max_total_seq_len_q"], node["max_total_seq_len_kv"]) == totals
    m = cfg.mask
    assert node["diagonal_alignment"] == m.diagonal_alignment.upper()
    assert (node["left_bound"], node["right_bound"]) == (m.left_bound, m.right_bound)


def cudnn_rejects(kind, s_q, s_kv, mask):
    """cuDNN 9.28's C++ rules for these graphs: the backward's bottom-right band with a right bound needs
    s_q <= s_kv and both multiples of 64 (the forward accepts s_q > s_kv with a padding mask)."""
    if kind != "backward" or not (mask.diagonal_alignment == "bottom_right" and mask.right_bound is not None):
        return None
    if s_q > s_kv:
        return "does not support s_q > s_kv"
    return "multiple of 64" if (s_q % 64 or s_kv % 64) else None


CASES = list(itertools.product(("padded", "packed"), ((500, 700), (512, 256), (384, 384)),
                               ((64, 64), (128, 128), (192, 128)), MASKS))


@needs_mxfp8_cudnn
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_every_varlen_graph_validates_with_the_expected_tensors(kind):
    """2 kinds x 3 length pairs x 3 head dims x 5 masks, GQA 8:2, batch 3: pygraph validate() +
    build_operation_graph() and cuDNN's C++ validate(); JSON: every tensor's dims, strides, dtype, ragged
    offset; the node's padding mask, lengths and packed totals."""
    build = cudnn_graphs.build_forward_graph if kind == "forward" else cudnn_graphs.build_backward_graph
    checked = rejected = 0
    for varlen, (s_q, s_kv), (dqk, dv), mask_name in CASES:
        cfg = make_cfg(varlen, 3, 8, 2, s_q, s_kv, dqk, dv, MASKS[mask_name])
        graph = build(cfg)
        why = cudnn_rejects(kind, s_q, s_kv, cfg.mask)
        if why:
            with pytest.raises(MXFP8NotSupportedError, match=why):
                cudnn_graphs.graph_json(graph)
            rejected += 1
            continue
        check_json(cudnn_graphs.graph_json(graph), kind, cfg, varlen)
        checked += 1
    assert checked + rejected == len(CASES)
    assert rejected == (2 * 3 * 2 * 2 if kind == "backward" else 0)  # (500,700) and (512,256) x 2 br masks


def test_config_validates_the_varlen_facts():
    cfg = cudnn_config.GraphConfig.from_packed(2, 4, 2, 256, 384, 128)
    assert cfg.varlen == "packed" and cfg.q_stride == (256 * 4 * 128, 128, 4 * 128, 1)
    assert cfg.max_total_seq_len_q == 512 and cfg.ragged_dtype == torch.int32
    assert cudnn_config.GraphConfig.from_packed(64, 64, 64, 8192, 8192, 128).ragged_dtype == torch.int64
    with pytest.raises(ValueError, match="token-major"):
        dataclasses.replace(cudnn_config.GraphConfig.from_layout(2, 4, 2, 256, 384, 128, layout="bhsd"), varlen="packed")
    with pytest.raises(ValueError, match="varlen"):
        dataclasses.replace(cfg, varlen="thd")
    assert "varlen=packed" in cfg.describe()


# --------------------------------------------------------------------------------------------------------------
# packed scale bytes against an independent per-sequence computation
# --------------------------------------------------------------------------------------------------------------
def atom_offset(m, k):
    return (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def expected_thd_row(compact, lengths, b, s_max):
    """compact [1, H, T, K] (rows = tokens) -> bytes of the packed per-sequence-tile row-wise layout."""
    _, h, t, k = compact.shape
    kp = cdiv(k, 4) * 4
    tiles_per_head = b * cdiv(s_max, 128)
    tile_bytes = 128 * kp
    out = torch.zeros(h * tiles_per_head * tile_bytes, dtype=torch.uint8)
    raw = compact.view(torch.uint8)
    tile0 = token0 = 0
    for n in lengths:
        for hh in range(h):
            for i in range(n):
                for kk in range(k):
                    tile, m = tile0 + i // 128, i % 128
                    off = hh * tiles_per_head * tile_bytes + tile * tile_bytes + (kk // 4) * 512 + atom_offset(m, kk)
                    out[off] = raw[0, hh, token0 + i, kk]
        tile0 += cdiv(n, 128)
        token0 += n
    return out


def expected_thd_col(segmented, lengths, b, s_max):
    """segmented [1, H, T//32 + B, D] (sequence i's blocks from row cu[i]//32 + i) -> packed column-wise bytes."""
    _, h, _, d = segmented.shape
    planes = cdiv(d, 128)
    tiles_per_head = b * cdiv(s_max, 128)
    tile_bytes = planes * 512
    out = torch.zeros(h * tiles_per_head * tile_bytes, dtype=torch.uint8)
    raw = segmented.view(torch.uint8)
    tile0 = token0 = 0
    for i, n in enumerate(lengths):
        first_block = token0 // 32 + i
        for hh in range(h):
            for blk in range(cdiv(n, 32)):
                for dd in range(d):
                    tile = tile0 + blk // 4
                    off = (hh * tiles_per_head * tile_bytes + tile * tile_bytes + (dd // 128) * 512
                           + atom_offset(dd % 128, blk % 4))
                    out[off] = raw[0, hh, first_block + blk, dd]
        tile0 += cdiv(n, 128)
        token0 += n
    return out


def raw_bytes(t):
    n = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return torch.as_strided(t.view(torch.uint8), (n,), (1,), t.storage_offset()).clone()


@pytest.mark.parametrize("lengths, d", [([130, 0, 1, 257], 64), ([200, 33], 192), ([128], 128), ([5, 300, 64], 256)])
def test_packed_scale_buffers_hold_the_per_sequence_tile_bytes(lengths, d):
    b, h, t = len(lengths), 2, sum(lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    g = torch.Generator().manual_seed(sum(lengths) + d)
    x = torch.randn(t, h, d, generator=g).permute(1, 0, 2).unsqueeze(0)
    s_max = cudnn_config.packed_capacity(max(lengths))
    row, col = quantize_mxfp8(x, -1), quantize_mxfp8(x, -2, segments=cu)
    buf = cudnn_buffers.thd_row_scale_buffer(row.scale, cu, b, s_max)
    assert tuple(buf.shape) == cudnn_config.row_scale_dims(b, h, s_max, d) and buf.stride() == cudnn_config.row_major(buf.shape)
    assert torch.equal(raw_bytes(buf), expected_thd_row(row.scale, lengths, b, s_max))
    buf = cudnn_buffers.thd_col_scale_buffer(col.scale, cu, b, s_max)
    dims = cudnn_config.col_scale_dims(b, h, s_max, d)
    assert tuple(buf.shape) == dims and buf.stride() == cudnn_config.col_scale_stride(dims)
    assert torch.equal(raw_bytes(buf), expected_thd_col(col.scale, lengths, b, s_max))


# --------------------------------------------------------------------------------------------------------------
# variant packs from real tensors
# --------------------------------------------------------------------------------------------------------------
def varlen_inputs(varlen, lengths_q, lengths_kv, hq=4, hk=2, dqk=64, dv=64, s_pad=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths_q)
    cu_q = torch.tensor([0] + list(itertools.accumulate(lengths_q)), dtype=torch.int32)
    cu_kv = torch.tensor([0] + list(itertools.accumulate(lengths_kv)), dtype=torch.int32)
    if varlen == "packed":
        seq = SeqInfo(cu_q, cu_kv, max(lengths_q), max(lengths_kv), True)

        def x(h, t, d):
            return torch.randn(t, h, d, generator=g).to(torch.bfloat16).permute(1, 0, 2).unsqueeze(0)
        tq, tk = sum(lengths_q), sum(lengths_kv)
    else:
        seq = SeqInfo(cu_q, cu_kv, max(lengths_q), max(lengths_kv), False)
        tq, tk = s_pad or max(lengths_q), s_pad or max(lengths_kv)

        def x(h, t, d):
            return torch.randn(b, t, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    return seq, x(hq, tq, dqk), x(hk, tk, dqk), x(hk, tk, dv), x(hq, tq, dv), x(hq, tq, dv)


def quantized(seq, q, k, v, do):
    segs = (seq.segments("q"), seq.segments("kv"))
    qr, qc = quantize_mxfp8(q, -1), quantize_mxfp8(q, -2, segments=segs[0])
    kr, kc = quantize_mxfp8(k, -1), quantize_mxfp8(k, -2, segments=segs[1])
    vr, vc = quantize_mxfp8(v, -1), quantize_mxfp8(v, -2, segments=segs[1])
    dor, doc = quantize_mxfp8(do, -1), quantize_mxfp8(do, -2, segments=segs[0])
    return qr, qc, kr, kc, vr, vc, dor, doc


@needs_mxfp8_cudnn
@pytest.mark.parametrize("varlen", ["padded", "packed"])
@pytest.mark.parametrize("mask_name", ["none", "causal_br"])
def test_varlen_variant_packs_match_the_graphs(varlen, mask_name):
    lq, lkv = [100, 0, 257], [300, 17, 129]
    seq, q, k, v, o, do = varlen_inputs(varlen, lq, lkv, s_pad=320, seed=len(varlen))
    qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
    mask = MASKS[mask_name]
    stats = torch.randn(q.shape[:3] + (1,))
    fcfg = cudnn_run.forward_config(qr, kr, vc, attn_scale=0.1, mask=mask, seq=seq)
    fpack, (o_out, stats_out, _) = cudnn_run.forward_buffers(fcfg, qr, kr, vc, seq=seq)
    args = (qr, qc, kr, kc, vr, o, do, dor, doc, stats)
    bcfg = cudnn_run.backward_config(*args, attn_scale=0.1, mask=mask, seq=seq)
    bpack, grads = cudnn_run.backward_buffers(bcfg, *args, seq=seq)
    assert fcfg.varlen == bcfg.varlen == varlen
    if varlen == "packed":
        assert (fcfg.b, fcfg.s_q, fcfg.s_kv) == (3, 384, 384)  # capacities: longest sequences rounded up to 128
        assert o_out.shape == (1, 4, 357, 64) and o_out.stride()[1:] == (64, 256, 1)
        assert stats_out.shape == (1, 4, 357, 1) and stats_out.stride()[1:3] == (1, 4)
    for kind, cfg, pack, build in (("forward", fcfg, fpack, cudnn_graphs.build_forward_graph),
                                   ("backward", bcfg, bpack, cudnn_graphs.build_backward_graph)):
        graph = build(cfg)
        if cudnn_rejects(kind, cfg.s_q, cfg.s_kv, mask):
            continue
        tensors = {t["uid"]: t for t in cudnn_graphs.graph_json(graph)["tensors"] if not t["is_virtual"]}
        check_pack_against_graph(pack, tensors, varlen == "packed")
    U = cudnn_config.FwdUid
    lens_q = torch.tensor(lq, dtype=torch.int32).view(3, 1, 1, 1)
    assert torch.equal(fpack[U.SEQ_LEN_Q], lens_q)
    assert torch.equal(fpack[U.SEQ_LEN_KV], torch.tensor(lkv, dtype=torch.int32).view(3, 1, 1, 1))
    if varlen == "packed":
        cu_q = torch.tensor([0, 100, 100, 357])
        assert torch.equal(fpack[U.RAGGED_Q].flatten(), (cu_q * 4 * 64).int())
        assert torch.equal(fpack[U.RAGGED_STATS].flatten(), (cu_q * 4).int())
        assert torch.equal(bpack[cudnn_config.BwdUid.RAGGED_K].flatten(), (torch.tensor([0, 300, 317, 446]) * 2 * 64).int())
        assert torch.equal(raw_bytes(fpack[U.SF_V]), expected_thd_col(vc.scale, lkv, 3, 384))
        assert torch.equal(raw_bytes(bpack[cudnn_config.BwdUid.SF_DO]), expected_thd_row(dor.scale, lq, 3, 384))
    with pytest.raises(ValueError, match="needs seq_len_q"):
        cudnn_buffers.forward_pack(fcfg, **{n: fpack[int(getattr(U, n.upper()))] for n in
                                 ("q", "k", "v", "sf_q", "sf_k", "sf_v", "o", "stats", "amax_o")})


def test_graph_keys_hold_the_capacity_not_the_lengths():
    seq, q, k, v, o, do = varlen_inputs("packed", [100, 37], [90, 200], seed=1)
    qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
    key = cudnn_run.forward_key(qr, kr, vc, 0.1, MaskSpec(), torch.bfloat16, seq)
    seq2, q2, k2, v2, o2, do2 = varlen_inputs("packed", [3, 120], [201, 4], seed=2)  # other totals, same capacity
    q2r, q2c, k2r, k2c, v2r, v2c, do2r, do2c = quantized(seq2, q2, k2, v2, do2)
    assert cudnn_run.forward_key(q2r, k2r, v2c, 0.1, MaskSpec(), torch.bfloat16, seq2) == key
    stats = torch.zeros(q.shape[:3] + (1,))
    stats2 = torch.zeros(q2.shape[:3] + (1,))
    assert cudnn_run.backward_key(qr, qc, kr, kc, vr, o, do, dor, doc, stats, 0.1, MaskSpec(), True, seq) == \
        cudnn_run.backward_key(q2r, q2c, k2r, k2c, v2r, o2, do2, do2r, do2c, stats2, 0.1, MaskSpec(), True, seq2)
    seq3 = SeqInfo(seq.cu_seqlens_q, seq.cu_seqlens_kv, 129, 200, True)  # longer max: another capacity
    assert cudnn_run.forward_key(qr, kr, vc, 0.1, MaskSpec(), torch.bfloat16, seq3) != key
    pseq = varlen_inputs("padded", [100, 37], [90, 200], s_pad=256)[0]
    pseq2 = varlen_inputs("padded", [256, 1], [2, 3], s_pad=256)[0]
    assert cudnn_run._seq_facts(pseq) == cudnn_run._seq_facts(pseq2) != cudnn_run._seq_facts(None)


@pytest.mark.parametrize("varlen", ["padded", "packed"])
def test_new_lengths_at_the_same_maximum_reuse_the_graph(fake_device, varlen):
    for i, (lq, lkv) in enumerate((([100, 37], [90, 200]), ([3, 120], [201, 4]), ([128, 128], [1, 256]))):
        seq, q, k, v, o, do = varlen_inputs(varlen, lq, lkv, s_pad=256, seed=i)
        qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
        o, stats, _ = cudnn_run.cudnn_forward(qr, kr, vc, attn_scale=0.1, seq=seq)
        cudnn_run.cudnn_backward(qr, qc, kr, kc, vr, o, do, dor, doc, stats.contiguous(), attn_scale=0.1, seq=seq)
    assert [kind for kind, _ in fake_device.built] == ["forward", "backward"]
    assert all(cfg.varlen == varlen for _, cfg in fake_device.built)


def test_rows_without_a_result_are_zero_and_minus_inf(fake_device):
    """cuDNN's outputs on padding rows / rows of a sequence without keys are overwritten with the reference's."""
    seq, q, k, v, o, do = varlen_inputs("padded", [3, 5], [0, 4], s_pad=8)
    qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
    o, stats, _ = cudnn_run.cudnn_forward(qr, kr, vc, attn_scale=0.1, seq=seq)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(o[1, :, 5:], torch.zeros_like(o[1, :, 5:]))
    assert bool((stats[0] == float("-inf")).all()) and bool((stats[1, :, 5:] == float("-inf")).all())
    keep = SeqInfo(torch.tensor([0, 2, 2, 5], dtype=torch.int32),
                   torch.tensor([0, 1, 3, 3], dtype=torch.int32), 3, 2, True).result_rows("q", 5)
    assert keep.flatten().tolist() == [True, True, False, False, False]


# --------------------------------------------------------------------------------------------------------------
# CudnnBackend.supports: decided up front, from the Problem
# --------------------------------------------------------------------------------------------------------------
def problem(s_q=512, s_kv=512, mask=MaskSpec(), varlen=None, needs_backward=False, d=128, batch=2):
    return Problem(device=torch.device("cuda", 0), dtype=torch.bfloat16, batch=batch, heads_q=8, heads_kv=2,
                   seqlen_q=s_q, seqlen_kv=s_kv, head_dim=d, mask=mask, varlen=varlen,
                   needs_backward=needs_backward)


@needs_mxfp8_cudnn
def test_known_refusals_agree_with_cudnns_validation():
    """known_refusal (no cuDNN call) says no exactly where cuDNN's deviceless validation of the planned graphs
    says no."""
    seen = set()
    for (s_q, s_kv), mask_name, varlen, nb in itertools.product(((500, 700), (512, 256), (384, 384), (256, 500)),
                                                                MASKS, (None, "padded", "packed"), (False, True)):
        p = problem(s_q, s_kv, MASKS[mask_name], varlen, nb, d=64)
        refusal = cudnn_refusals.known_refusal(p)
        ok, reason = cudnn_refusals.check_problem(dataclasses.replace(p, mask=MaskSpec()) if refusal else p)
        assert ok, reason  # the graphs themselves are fine without the band
        if refusal is None:
            ok, reason = cudnn_refusals.check_problem(p)
            assert ok, (p, reason)
        else:  # cuDNN agrees: the graphs with the band fail its validation
            cfgs = [cudnn_refusals.problem_config(p, kind) for kind in (("forward", "backward") if nb else ("forward",))]
            verdicts = []
            for cfg, build in zip(cfgs, (cudnn_graphs.build_forward_graph, cudnn_graphs.build_backward_graph)):
                try:
                    cudnn_graphs.graph_json(build(cfg))
                    verdicts.append(None)
                except MXFP8NotSupportedError as exc:
                    verdicts.append(str(exc))
            assert any(verdicts), (p, refusal)
            seen.add(refusal.split(": ")[-1].split(") with ")[-1].strip())
    assert seen == {"s_q > s_kv", "s_q > s_kv in the backward", "both must be multiples of 64",
                    "s_q=512 > s_kv=256 without per-sequence lengths (sliding window needs max_s_q <= max_s_kv)"}


def test_known_refusals_of_the_readme():
    br = MaskSpec(causal=True, diagonal_alignment="bottom_right")
    assert cudnn_refusals.known_refusal(problem(500, 500, br)) is None  # forward only: fine
    assert "multiples of 64" in cudnn_refusals.known_refusal(problem(500, 500, br, needs_backward=True))
    assert cudnn_refusals.known_refusal(problem(500, 500, br, varlen="packed", needs_backward=True)) is None  # capacity 512
    assert "s_q > s_kv" in cudnn_refusals.known_refusal(problem(512, 256, br))
    assert cudnn_refusals.known_refusal(problem(512, 256, br, varlen="padded")) is None
    assert "backward" in cudnn_refusals.known_refusal(problem(512, 256, br, varlen="padded", needs_backward=True))
    assert cudnn_refusals.known_refusal(problem(500, 500, MaskSpec(left_bound=64, diagonal_alignment="bottom_right"),
                                    needs_backward=True)) is None  # no right bound: not cuDNN's "causal" rule
    assert "float16" in cudnn_refusals.known_refusal(dataclasses.replace(problem(), out_dtype=torch.float32))



@needs_mxfp8_cudnn
def test_supports_plans_the_backward_up_front_and_caches_per_problem(pretend_blackwell):
    br = MaskSpec(causal=True, diagonal_alignment="bottom_right")
    assert cudnn_backend.CudnnBackend.supports(problem(500, 500, br)) == (True, "cuDNN forward validated")
    ok, reason = cudnn_backend.CudnnBackend.supports(problem(500, 500, br, needs_backward=True))
    assert not ok and "multiples of 64" in reason  # known refusal: no graph built
    assert cudnn_backend.CudnnBackend.supports(problem(512, 512, br, varlen="packed", needs_backward=True)) == \
        (True, "cuDNN forward and backward validated")
    for _ in range(3):
        assert cudnn_backend.CudnnBackend.supports(problem(384, 384, MaskSpec(causal=True), "padded", True))[0]
    assert len(pretend_blackwell) == 3  # one check per distinct problem, the known refusal needs none
    ok, reason = cudnn_backend.CudnnBackend.supports(problem(d=192))
    assert not ok and "head_dim 192" in reason
    ok, reason = cudnn_backend.CudnnBackend.supports(problem(d=256, varlen="packed", needs_backward=True))
    assert ok, reason


@needs_mxfp8_cudnn
def test_auto_and_explicit_backends_decide_before_any_work(pretend_blackwell, monkeypatch):
    import mxattn.backends as backends
    monkeypatch.setattr(backends, "_WARNED", set())
    bad = problem(500, 500, MaskSpec(causal=True, diagonal_alignment="bottom_right"), needs_backward=True)
    with pytest.raises(MXFP8NotSupportedError, match="backend 'cudnn' cannot run this call.*multiples of 64"):
        pick_backend("cudnn", bad)
    with pytest.warns(RuntimeWarning, match="cudnn: .*multiples of 64"):
        chosen = pick_backend("auto", dataclasses.replace(bad, device=torch.device("cpu")))
    assert chosen != "cudnn"
    assert pick_backend("cudnn", dataclasses.replace(bad, needs_backward=False)) == "cudnn"


def test_supports_on_this_machine_refuses_by_availability_without_building():
    ok, reason = cudnn_backend.CudnnBackend.supports(problem())
    if not torch.cuda.is_available():
        assert not ok and "CUDA" in reason
