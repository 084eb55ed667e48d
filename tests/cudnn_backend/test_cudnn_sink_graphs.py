"""CPU checks of the attention-sink (TE softmax_type "off-by-one" / "learnable") cuDNN MXFP8 graphs and of the
cudnn backend's sink wiring.

cuDNN frontend 1.32: `sdpa_mxfp8(..., sink_token=)` and `sdpa_mxfp8_backward(..., sink_token=, dSink_token=)`, both
fp32 [1, H_q, 1, 1] (dSink_token is an output port). Graphs are lowered to the cuDNN C++ frontend without a GPU and
validated by cuDNN itself (SM 10.0); expected dims/strides are written out here, not taken from mxattn.
"""

import dataclasses
import importlib.util
import io
import itertools
from contextlib import redirect_stdout

import pytest
from repo_paths import ROOT
import torch

cudnn = pytest.importorskip("cudnn")

from cudnn_fixtures import MASKS, fake_device, needs_mxfp8_cudnn, pretend_blackwell  # noqa: E402,F401
from mxattn.backends.cudnn import buffers as cudnn_buffers  # noqa: E402
from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends import Problem  # noqa: E402
from mxattn.backends.cudnn import backend as cudnn_backend  # noqa: E402
from mxattn.backends.cudnn import refusals as cudnn_refusals  # noqa: E402
from mxattn.backends.cudnn import run as cudnn_run  # noqa: E402
from mxattn.backends.cudnn import refusals as cudnn_refusals  # noqa: E402
from mxattn.backends.base import AttentionParams  # noqa: E402
from mxattn.errors import MXFP8NotSupportedError  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402
from mxattn.seqinfo import SeqInfo  # noqa: E402

SINK_TYPES = ("off-by-one", "learnable")
TORCH_OF = {"FP8_E4M3": torch.float8_e4m3fn, "FP8_E8M0": torch.float8_e8m0fnu, "BFLOAT16": torch.bfloat16,
            "HALF": torch.float16, "FLOAT": torch.float32, "INT32": torch.int32, "INT64": torch.int64}
# the sink slots, written out: uid -> name (spec section 11; fp32 [1, H_q, 1, 1], contiguous, no reordering)
SINK_UIDS = {"forward": {17: "SINK"}, "backward": {131: "SINK", 132: "DSINK"}}


def make_cfg(varlen, b, hq, hk, s_q, s_kv, dqk, dv, mask):
    if varlen == "packed":
        return cudnn_config.GraphConfig.from_packed(b, hq, hk, s_q, s_kv, dqk, dv, mask=mask, attn_scale=0.0884)
    cfg = cudnn_config.GraphConfig.from_layout(b, hq, hk, s_q, s_kv, dqk, dv, mask=mask, attn_scale=0.0884)
    return dataclasses.replace(cfg, varlen=varlen) if varlen else cfg


def verdict(kind, cfg):
    """(cuDNN's JSON, None) or (None, cuDNN's reason) for the `kind` graph of cfg."""
    build = cudnn_graphs.build_forward_graph if kind == "forward" else cudnn_graphs.build_backward_graph
    try:
        return cudnn_graphs.graph_json(build(cfg)), None
    except MXFP8NotSupportedError as exc:
        return None, str(exc).split(": ", 1)[-1].split("cudnnGraphNotSupportedError: ")[-1]


def sink_tensor(uid, name, h_q):
    return dict(uid=uid, name=name, dim=[1, h_q, 1, 1], stride=[h_q, 1, 1, 1], data_type="FLOAT",
                reordering_type="NONE", is_virtual=False)


def check_sink_json(j, base, kind, softmax_type, h_q):
    """j (a sink graph) == base (the same graph without a sink) plus exactly the sink tensors and ports."""
    tensors = {t["uid"]: t for t in j["tensors"] if not t["is_virtual"]}
    base_tensors = {t["uid"]: t for t in base["tensors"] if not t["is_virtual"]}
    want = {uid: name for uid, name in SINK_UIDS[kind].items() if name == "SINK" or softmax_type == "learnable"}
    assert sorted(tensors) == sorted([*base_tensors, *want])
    for uid, t in base_tensors.items():
        assert tensors[uid] == t, f"{kind} {t['name']} changed with a sink"
    for uid, name in want.items():
        got = tensors[uid]
        assert {k: got.get(k) for k in ("uid", "name", "dim", "stride", "data_type", "reordering_type",
                                        "is_virtual")} == sink_tensor(uid, name, h_q)
        assert got.get("ragged_offset_uid") is None  # one logit per head, never ragged
    (node,) = j["nodes"]
    (base_node,) = base["nodes"]
    ports = {"SINK_TOKEN": min(want)}
    if softmax_type == "learnable" and kind == "backward":
        assert node["outputs"].pop("DSINK_TOKEN") == 132
    assert node["inputs"].pop("SINK_TOKEN") == ports["SINK_TOKEN"]
    assert node == base_node  # every attribute and the other ports as without a sink


# --------------------------------------------------------------------------------------------------------------
# the graphs: cuDNN's validation and JSON
# --------------------------------------------------------------------------------------------------------------
def matrix():
    """dense, padded, packed x 5 masks x (MHA d128, GQA 4:1 d192/128, MQA d64) x (equal, s_q > s_kv) lengths."""
    shapes = ((8, 8, 128, 128), (8, 2, 192, 128), (8, 1, 64, 64))
    for varlen, mask_name, shape, lengths in itertools.product((None, "padded", "packed"), MASKS, shapes,
                                                               ((256, 256), (384, 128))):
        yield varlen, mask_name, shape, lengths


@needs_mxfp8_cudnn
def test_sink_graphs_validate_exactly_where_the_plain_ones_do():
    """Every graph of the matrix, forward and backward, off-by-one (sink only) and learnable (sink + dSink): cuDNN
    accepts it exactly where it accepts the graph without a sink (same reason where it refuses), and its JSON is
    the plain graph's plus the fp32 [1, H_q, 1, 1] sink tensors and ports."""
    accepted = refused = 0
    for varlen, mask_name, (hq, hk, dqk, dv), (s_q, s_kv) in matrix():
        base_cfg = make_cfg(varlen, 2, hq, hk, s_q, s_kv, dqk, dv, MASKS[mask_name])
        for softmax_type in SINK_TYPES:
            ok = {}
            for kind in ("forward", "backward"):
                base, base_reason = verdict(kind, base_cfg)
                cfg = base_cfg.for_softmax(softmax_type, kind)
                assert cfg.sink and cfg.dsink == (softmax_type == "learnable" and kind == "backward")
                j, reason = verdict(kind, cfg)
                assert reason == base_reason, (varlen, mask_name, hq, hk, dqk, s_q, s_kv, kind, softmax_type)
                ok[kind] = j is not None
                if j is None:
                    refused += 1
                    continue
                check_sink_json(j, base, kind, softmax_type, hq)
                accepted += 1
            # CudnnBackend.supports refuses up front exactly these (no graph built)
            p = Problem(device=torch.device("cuda", 0), dtype=torch.bfloat16, batch=2, heads_q=hq, heads_kv=hk,
                        seqlen_q=s_q, seqlen_kv=s_kv, head_dim=dqk, mask=MASKS[mask_name], varlen=varlen,
                        softmax_type=softmax_type)
            assert (cudnn_refusals.known_refusal(p) is None) == ok["forward"]
            assert (cudnn_refusals.known_refusal(dataclasses.replace(p, needs_backward=True)) is None) == \
                (ok["forward"] and ok["backward"])
    assert accepted + refused == 3 * 5 * 3 * 2 * 2 * 2
    assert accepted > 3 * refused  # most of the matrix runs; the refusals are the mask rules of cudnn_backend


@needs_mxfp8_cudnn
@pytest.mark.parametrize("varlen", [None, "padded"])
def test_sink_with_a_single_query_row_validates(varlen):
    """cuDNN's generic SDPA refuses a sink in decode mode (s_q == 1); its MXFP8 graphs validate one (whether a
    device plans it is `CudnnBackend.supports`'s question on Blackwell)."""
    cfg = make_cfg(varlen, 2, 8, 2, 1, 1000, 128, 128, MaskSpec()).for_softmax("learnable")
    for kind in ("forward", "backward"):
        j, reason = verdict(kind, cfg)
        assert reason is None, reason


def test_mxattn_checks_the_sink_geometry():
    """cuDNN 9.28's deviceless validation does not look at the sink tensor (a [1, 2, 1, 1], a bf16 or a
    [4, 1, 1, 1] sink_token in an h_q=4 graph all validate), so mxattn checks it: the config declares fp32
    [1, h_q, 1, 1], the variant pack check and `sink_operand` refuse anything else by name."""
    seq, q, k, v, o, do = inputs(None, hq=4, hk=4)
    qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
    cfg = cudnn_run.forward_config(qr, kr, vc, attn_scale=0.1, sink=True)
    pack, _ = cudnn_run.forward_buffers(cfg, qr, kr, vc, sink=torch.zeros(4))
    slots = {n: pack[int(getattr(cudnn_config.FwdUid, n.upper()))] for n in
             ("q", "k", "v", "sf_q", "sf_k", "sf_v", "o", "stats", "amax_o")}
    assert cudnn_buffers.forward_pack(cfg, **slots, sink=torch.zeros(1, 4, 1, 1)).keys() == pack.keys()
    for bad in (torch.zeros(1, 2, 1, 1), torch.zeros(1, 4, 1, 1, dtype=torch.bfloat16), torch.zeros(4, 1, 1, 1),
                torch.zeros(1, 8, 1, 1)[:, ::2]):
        with pytest.raises(ValueError, match=r"^sink must be \(1, 4, 1, 1\) torch.float32 with strides"):
            cudnn_buffers.forward_pack(cfg, **slots, sink=bad)
    with pytest.raises(ValueError, match="one logit per query head"):
        cudnn_run.forward_buffers(cfg, qr, kr, vc, sink=torch.zeros(2))


def test_config_sink_facts():
    cfg = cudnn_config.GraphConfig.from_layout(2, 8, 2, 256, 256, 128)
    assert (cfg.sink, cfg.dsink) == (False, False)
    assert cfg.for_softmax("vanilla") == cfg
    off, learn = cfg.for_softmax("off-by-one"), cfg.for_softmax("learnable")
    assert (off.sink, off.dsink, learn.sink, learn.dsink) == (True, False, True, True)
    assert cfg.for_softmax("learnable", "forward") == off  # a forward graph has no dSink: one config for both
    assert len({cfg, off, learn}) == 3 and "sink+dsink" in learn.describe() and " sink" in off.describe()
    assert int(cudnn_config.FwdUid.SINK) not in cfg.forward_specs and int(cudnn_config.BwdUid.SINK) not in cfg.backward_specs
    assert off.forward_specs[17] == ((1, 8, 1, 1), (8, 1, 1, 1), torch.float32)
    assert 132 not in off.backward_specs and learn.backward_specs[132] == ((1, 8, 1, 1), (8, 1, 1, 1), torch.float32)
    assert learn.forward_specs == off.forward_specs  # dsink never reaches the forward graph
    # the uids of the plain graphs are unchanged
    assert [int(u) for u in cudnn_config.FwdUid][:16] == list(range(1, 17)) and int(cudnn_config.BwdUid.RAGGED_STATS) == 130
    with pytest.raises(ValueError, match="softmax_type"):
        cfg.for_softmax("softmax1")
    with pytest.raises(ValueError, match="needs sink"):
        dataclasses.replace(cfg, dsink=True)
    with pytest.raises(TypeError, match="sink must be a bool"):
        dataclasses.replace(cfg, sink=1)


# --------------------------------------------------------------------------------------------------------------
# variant packs from real tensors
# --------------------------------------------------------------------------------------------------------------
def inputs(varlen, hq=8, hk=2, d=64, seed=0):
    """(seq, q, k, v, o, do) as the backend gets them: dense [2, H, 256, D] bshd views, a padded batch of lengths
    [100, 0] / [200, 17] in 256 rows, or a packed one ([1, H, T, D] token-major views)."""
    g = torch.Generator().manual_seed(seed)
    lq, lkv = [100, 0, 257], [200, 17, 129]
    if varlen is None:
        seq, b, tq, tk = None, 2, 256, 256
    else:
        cu_q = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32)
        cu_kv = torch.tensor([0] + list(itertools.accumulate(lkv)), dtype=torch.int32)
        seq = SeqInfo(cu_q, cu_kv, max(lq), max(lkv), varlen == "packed")
        b, tq, tk = 3, (sum(lq) if seq.packed else 320), (sum(lkv) if seq.packed else 320)
    if varlen == "packed":
        def x(h, t):
            return torch.randn(t, h, d, generator=g).to(torch.bfloat16).permute(1, 0, 2).unsqueeze(0)
    else:
        def x(h, t):
            return torch.randn(b, t, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    return seq, x(hq, tq), x(hk, tk), x(hk, tk), x(hq, tq), x(hq, tq)


def quantized(seq, q, k, v, do):
    segs = (None, None) if seq is None else (seq.segments("q"), seq.segments("kv"))
    return (quantize_mxfp8(q, -1), quantize_mxfp8(q, -2, segments=segs[0]), quantize_mxfp8(k, -1),
            quantize_mxfp8(k, -2, segments=segs[1]), quantize_mxfp8(v, -1), quantize_mxfp8(v, -2, segments=segs[1]),
            quantize_mxfp8(do, -1), quantize_mxfp8(do, -2, segments=segs[0]))


def check_pack(pack, j, packed):
    tensors = {t["uid"]: t for t in j["tensors"] if not t["is_virtual"]}
    assert sorted(pack) == sorted(tensors) and all(type(uid) is int for uid in pack)
    for uid, t in tensors.items():
        got = pack[uid]
        assert got.dtype == TORCH_OF[t["data_type"]], t["name"]
        if packed and t.get("ragged_offset_uid") is not None:  # [1, H, T, D] token rows
            assert (got.shape[1], got.shape[3]) == (t["dim"][1], t["dim"][3]), t["name"]
        else:
            assert (list(got.shape), list(got.stride())) == (t["dim"], t["stride"]), t["name"]


@needs_mxfp8_cudnn
@pytest.mark.parametrize("varlen", [None, "padded", "packed"])
@pytest.mark.parametrize("softmax_type", SINK_TYPES)
def test_sink_variant_packs_match_the_graphs(varlen, softmax_type):
    seq, q, k, v, o, do = inputs(varlen, seed=len(str(varlen)))
    qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
    mask = MaskSpec(causal=True)
    sink = torch.linspace(-1.0, 2.0, 8) if softmax_type == "learnable" else torch.zeros(8)
    dsink = softmax_type == "learnable"
    stats = torch.randn(q.shape[:3] + (1,))
    stats[:, :, :3] = float("-inf")  # rows without a result
    fcfg = cudnn_run.forward_config(qr, kr, vc, attn_scale=0.1, mask=mask, seq=seq, sink=True)
    fpack, _ = cudnn_run.forward_buffers(fcfg, qr, kr, vc, seq=seq, sink=sink)
    args = (qr, qc, kr, kc, vr, o, do, dor, doc, stats)
    bcfg = cudnn_run.backward_config(*args, attn_scale=0.1, mask=mask, seq=seq, sink=True, dsink=dsink)
    bpack, outputs = cudnn_run.backward_buffers(bcfg, *args, seq=seq, sink=sink)
    assert fcfg.sink and not fcfg.dsink and bcfg.sink and bcfg.dsink == dsink and bcfg.varlen == varlen
    for kind, cfg, pack in (("forward", fcfg, fpack), ("backward", bcfg, bpack)):
        j, reason = verdict(kind, cfg)
        assert reason is None, reason
        check_pack(pack, j, varlen == "packed")
    # the sink slots: views of the [H] logits, no copy; dSink a zeroed buffer returned after the amaxes
    for pack, uid in ((fpack, cudnn_config.FwdUid.SINK), (bpack, cudnn_config.BwdUid.SINK)):
        assert pack[uid].data_ptr() == sink.data_ptr() and torch.equal(pack[uid].flatten(), sink)
    assert len(outputs) == 6 + dsink
    if dsink:
        assert bpack[cudnn_config.BwdUid.DSINK] is outputs[6] and not outputs[6].any()
    else:
        assert int(cudnn_config.BwdUid.DSINK) not in bpack
    # rows without a result reach cuDNN as +inf (all their probabilities, the sink's included, are 0)
    handed = bpack[cudnn_config.BwdUid.STATS]
    assert bool((handed[:, :, :3] == float("inf")).all())
    finite = torch.isfinite(stats)
    assert torch.equal(handed[finite], stats[finite]) and bool((stats[:, :, :3] == float("-inf")).all())
    # a sink graph needs the sink; a plain graph has no slot for one
    names = ("q", "k", "v", "sf_q", "sf_k", "sf_v", "o", "stats", "amax_o")
    slots = {n: fpack[int(getattr(cudnn_config.FwdUid, n.upper()))] for n in names}
    slots.update({n: fpack[int(getattr(cudnn_config.FwdUid, n.upper()))] for n in cudnn_config.VARLEN_UIDS.get(varlen, ())
                  for n in [n.lower()]})
    with pytest.raises(ValueError, match="needs sink"):
        cudnn_buffers.forward_pack(fcfg, **slots)
    with pytest.raises(ValueError, match="no slot for sink"):
        cudnn_buffers.forward_pack(dataclasses.replace(fcfg, sink=False), **slots, sink=fpack[cudnn_config.FwdUid.SINK])


def test_sink_operand_checks_and_keys():
    assert cudnn_buffers.sink_operand(None, 8, torch.device("cpu")) is None
    s = torch.randn(16)[::2]  # strided: made contiguous
    view = cudnn_buffers.sink_operand(s, 8, torch.device("cpu"))
    assert view.shape == (1, 8, 1, 1) and view.is_contiguous() and torch.equal(view.flatten(), s)
    leaf = torch.randn(8, requires_grad=True)
    assert not cudnn_buffers.sink_operand(leaf, 8, torch.device("cpu")).requires_grad
    assert cudnn_buffers.sink_operand(torch.zeros(8, dtype=torch.bfloat16), 8, torch.device("cpu")).dtype == torch.float32
    for bad, error, match in ((torch.zeros(2), ValueError, r"\[8\]"), ([0.0] * 8, TypeError, "torch.Tensor"),
                              (torch.zeros(8, dtype=torch.int32), TypeError, "floating"),
                              (torch.zeros(8, device="meta"), ValueError, "meta")):
        with pytest.raises(error, match=match):
            cudnn_buffers.sink_operand(bad, 8, torch.device("cpu"))
    seq, q, k, v, o, do = inputs(None)
    qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
    keys = {cudnn_run.forward_key(qr, kr, vc, 0.1, MaskSpec(), torch.bfloat16, None, s) for s in (False, True)}
    args = (qr, qc, kr, kc, vr, o, do, dor, doc, torch.zeros(2, 8, 256, 1), 0.1, MaskSpec(), True, None)
    keys |= {cudnn_run.backward_key(*args, s, d) for s, d in ((False, False), (True, False), (True, True))}
    assert len(keys) == 5


# --------------------------------------------------------------------------------------------------------------
# the backend on CPU tensors, with cuDNN's plan and launch faked
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("varlen", [None, "padded", "packed"])
def test_backend_wires_the_sink_and_returns_dsink(fake_device, varlen):
    seq, q, k, v, _, do = inputs(varlen, seed=3)
    backend = cudnn_backend.CudnnBackend()
    sink = torch.linspace(-1.0, 2.0, 8)
    for softmax_type in ("vanilla", "off-by-one", "learnable"):
        fake_device.launches.clear()
        logits = None if softmax_type == "vanilla" else (sink if softmax_type == "learnable" else torch.zeros(8))
        params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True), seq=seq, sink=logits,
                                 sink_requires_grad=softmax_type == "learnable")
        o, stats, saved = backend.forward(q, k, v, params)
        grads = backend.backward(saved, o, stats, do, params)
        (fcfg, fpack), (bcfg, bpack) = fake_device.launches
        assert (fcfg.sink, fcfg.dsink) == (logits is not None, False)
        assert (bcfg.sink, bcfg.dsink) == cudnn_config.SOFTMAX_TYPES[softmax_type]
        if logits is not None:
            for pack, uid in ((fpack, cudnn_config.FwdUid.SINK), (bpack, cudnn_config.BwdUid.SINK)):
                assert pack[int(uid)].shape == (1, 8, 1, 1) and pack[int(uid)].data_ptr() == logits.data_ptr()
        if softmax_type == "learnable":
            assert len(grads) == 4
            dsink = grads[3]
            assert dsink.shape == (8,) and dsink.dtype == torch.float32
            assert torch.equal(dsink, torch.arange(8, dtype=torch.float32))  # cuDNN's dSink_token, as written
        else:
            assert len(grads) == 3
        assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    planned = {(e.kind, e.cfg) for e in cudnn_graphs.GRAPH_CACHE._entries.values()}
    assert len(planned) == 5  # forward: plain, sink; backward: plain, sink, sink + dSink


def test_typed_backward_needs_the_sink_for_its_gradient(fake_device):
    seq, q, k, v, o, do = inputs(None)
    qr, qc, kr, kc, vr, vc, dor, doc = quantized(seq, q, k, v, do)
    args = (qr, qc, kr, kc, vr, o, do, dor, doc, torch.zeros(2, 8, 256, 1))
    with pytest.raises(ValueError, match="sink_requires_grad needs the sink"):
        cudnn_run.cudnn_backward(*args, attn_scale=0.1, sink_requires_grad=True)
    with pytest.raises(ValueError, match=r"sink must have one logit per query head, \[8\]"):
        cudnn_run.cudnn_forward(qr, kr, vc, attn_scale=0.1, sink=torch.zeros(2))
    out = cudnn_run.cudnn_backward(*args, attn_scale=0.1, sink=torch.zeros(1, 8, 1, 1), sink_requires_grad=True)
    assert len(out) == 7 and out[6].shape == (8,)


def test_empty_packed_batch_gives_zero_dsink(fake_device):
    cu = torch.tensor([0, 0], dtype=torch.int32)
    seq = SeqInfo(cu, cu, 0, 0, True)
    x = torch.zeros(1, 8, 0, 64, dtype=torch.bfloat16)
    params = AttentionParams(softmax_scale=0.1, mask=MaskSpec(), seq=seq, sink=torch.ones(8), sink_requires_grad=True)
    o, stats, saved = cudnn_backend.CudnnBackend().forward(x, x[:, :2], x[:, :2], params)
    grads = cudnn_backend.CudnnBackend().backward(saved, o, stats, x, params)
    assert not fake_device.launches and grads[3].shape == (8,) and not grads[3].any()


# --------------------------------------------------------------------------------------------------------------
# deciding up front
# --------------------------------------------------------------------------------------------------------------
def problem(softmax_type="learnable", varlen=None, needs_backward=True, mask=MaskSpec(), s=512):
    return Problem(device=torch.device("cuda", 0), dtype=torch.bfloat16, batch=2, heads_q=8, heads_kv=2,
                   seqlen_q=s, seqlen_kv=s, head_dim=128, mask=mask, varlen=varlen, needs_backward=needs_backward,
                   softmax_type=softmax_type)


def test_known_refusals_of_sinks(monkeypatch):
    assert cudnn_refusals.known_refusal(problem(varlen="packed")) is None  # cuDNN 9.28 here
    # a size rule (bottom-right band with a right bound needs s_q <= s_kv): unknown sizes (the choice under
    # torch.compile) leave it to the call
    band = MaskSpec(causal=True, diagonal_alignment="bottom_right")
    big_q = dataclasses.replace(problem("vanilla", mask=band), seqlen_q=1024)
    assert "s_q > s_kv" in cudnn_refusals.known_refusal(big_q)
    assert cudnn_refusals.known_refusal(dataclasses.replace(big_q, batch=None, seqlen_q=None, seqlen_kv=None)) is None
    assert "softmax_type 'softmax1'" in cudnn_refusals.known_refusal(problem("softmax1"))
    monkeypatch.setattr(cudnn_refusals.cudnn, "backend_version", lambda: 92500)
    reason = cudnn_refusals.known_refusal(problem(varlen="packed"))
    assert "packed (thd) backward with an attention sink" in reason and "9.26.0" in reason
    assert "off-by-one" in cudnn_refusals.known_refusal(problem("off-by-one", varlen="packed"))
    for fine in (problem(varlen="packed", needs_backward=False), problem(varlen="padded"), problem(),
                 problem("vanilla", varlen="packed")):
        assert cudnn_refusals.known_refusal(fine) is None


def test_problem_config_carries_the_sink_facts():
    for softmax_type, (sink, dsink) in cudnn_config.SOFTMAX_TYPES.items():
        for varlen in (None, "padded", "packed"):
            p = problem(softmax_type, varlen)
            fwd, bwd = cudnn_refusals.problem_config(p, "forward"), cudnn_refusals.problem_config(p, "backward")
            assert (fwd.sink, fwd.dsink, bwd.sink, bwd.dsink, fwd.varlen) == (sink, False, sink, dsink, varlen)



@needs_mxfp8_cudnn
def test_supports_validates_the_sink_graphs_up_front(pretend_blackwell, monkeypatch):
    built = []
    real = cudnn_graphs.build_backward_graph
    monkeypatch.setattr(cudnn_refusals, "build_backward_graph", lambda cfg, **kw: built.append(cfg) or real(cfg, **kw))
    br = MaskSpec(causal=True, diagonal_alignment="bottom_right")
    for softmax_type in SINK_TYPES:
        for varlen in (None, "padded", "packed"):
            assert cudnn_backend.CudnnBackend.supports(problem(softmax_type, varlen, mask=br)) == \
                (True, "cuDNN forward and backward validated")
    assert [(c.sink, c.dsink) for c in built] == [(True, False)] * 3 + [(True, True)] * 3
    ok, reason = cudnn_backend.CudnnBackend.supports(problem("learnable", mask=br, s=500))  # the plain graphs' rule holds
    assert not ok and "multiples of 64" in reason
    ok, reason = cudnn_backend.CudnnBackend.supports(problem("softmax1"))
    assert not ok and "softmax_type" in reason
    assert len(pretend_blackwell) == 6


@needs_mxfp8_cudnn
def test_sample_prints_the_sink_slots():
    path = ROOT / "samples" / "cudnn_graphs.py"
    spec = importlib.util.spec_from_file_location("mxattn_sample_cudnn_graphs", path)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    out = io.StringIO()
    with redirect_stdout(out):
        assert sample.main(["--softmax-type", "learnable", "--varlen", "packed", "--seq", "256", "--heads", "4",
                            "--kv-heads", "1"]) == 0
    text = out.getvalue()
    assert "sink+dsink" in text and "forward graph (SDPA_MXFP8_FWD" in text
    assert "    17 SINK     [1, 4, 1, 1]" in text and "   131 SINK     [1, 4, 1, 1]" in text
    assert "   132 DSINK    [1, 4, 1, 1]" in text
