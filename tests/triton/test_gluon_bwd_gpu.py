"""The Gluon dK/dV kernel (`mxattn.kernels.gluon_attention_bwd.dkdv_gluon`) against the Triton dK/dV kernel in mode
"pre" on identical inputs, on an sm_90 GPU; and, on any machine with Triton, that it compiles for sm_90a without
register spills and refuses what it does not take.

The inputs are built as `triton_attention_bwd.attention_bwd` builds them in mode "pre": Q, K, V quantized by the
fused quantizer, the prep pass (`bwd_prep`) writing delta and the bf16 scratch (Q and dO, row- and column-wise),
K's and V's row-wise MXFP8Tensors (head slices `_heads` for a chunk of heads). Both kernels run the same
arithmetic per element and add the same k16 slices of queries in the same order into their fp32 accumulators,
so dK and dV should be bit-equal in nearly every element and within one bf16 ulp everywhere.
"""

import importlib.util
import math

import pytest
import torch

from test_gluon_fwd_gpu import _assert_sm90_build, _ordered_bf16

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _pre_inputs(B, HQ, HKV, SQ, SKV, D, offset, right_bound, g, scale, with_kv=False):
    """(q_r, q_c, k_row, v_row, do_r, do_c, stats, delta) as attention_bwd hands them to the dK/dV launch in
    mode "pre" (all heads in one chunk); stats the natural-log LSE of the masked logits of the dequantized Q, K
    (-inf for rows without keys), o and dO random. with_kv: followed by `kv_prep`'s bf16 scratch (k_r, k_c,
    v_r) and K's column-wise MXFP8Tensor k_col (the dQ launch's key side)."""
    from mxattn.kernels.triton_bwd_prep import bwd_prep, kv_prep
    from mxattn.kernels.triton_quantize import quantize_rowcol
    from mxattn.seqinfo import kernel_cu_seqlens
    q, k, v = (torch.randn(B, h, n, D, device="cuda", generator=g).to(torch.bfloat16)
               for h, n in ((HQ, SQ), (HKV, SKV), (HKV, SKV)))
    o = torch.randn(B, HQ, SQ, D, device="cuda", generator=g).to(torch.bfloat16)
    do = torch.randn(B, HQ, SQ, D, device="cuda", generator=g).to(torch.bfloat16)
    qq, kq, vq = quantize_rowcol(q), quantize_rowcol(k), quantize_rowcol(v, col=False)
    stats = torch.empty(B, HQ, SQ, 1, device="cuda", dtype=torch.float32)
    cu = kernel_cu_seqlens(None, stats)
    k_r, k_c, v_r = kv_prep(kq.row, kq.col, vq.row, 0, HKV, None, cu)
    delta = torch.empty(B, HQ, SQ, device="cuda", dtype=torch.float32)
    do_r, do_c, q_r, q_c = bwd_prep(o, do, qq.row, qq.col, delta, 0, HQ, None, cu)
    drop = None
    if right_bound is not None:
        drop = torch.arange(SKV, device="cuda")[None, :] > torch.arange(SQ, device="cuda")[:, None] + offset + right_bound
    for h in range(HQ):  # one query head at a time (bounded memory at the benchmark's sizes)
        logits = q_r[:, h].float() @ k_r[:, h // (HQ // HKV)].float().transpose(1, 2) * scale
        if drop is not None:
            logits.masked_fill_(drop, float("-inf"))
        stats[:, h] = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = (q_r, q_c, kq.row, vq.row, do_r, do_c, stats, delta)
    return out + (k_r, k_c, v_r, kq.col) if with_kv else out


def _triton_pre_launch(which, q_shape, HKV, SKV, stats, scale, offset, right_bound):
    """The trailing arguments of attention_bwd's mode-"pre" launch `which` (0: `_launch_dkdv`, 1: `_launch_dq`)
    for a dense call with Q [B, HQ, SQ, D] (q_shape): (cfg, pre, args, common, seq, cu, flags), its default
    config."""
    from mxattn.kernels import triton_attention_bwd as tb
    from mxattn.runtime.recipe_flags import DEFAULT_FLAGS
    from mxattn.kernels.triton_quantize import padded_head_dim
    from mxattn.seqinfo import kernel_cu_seqlens, kernel_flags
    B, HQ, SQ, D = q_shape
    dp = padded_head_dim(D)
    args = (HQ // HKV, SQ, SKV, D, float(scale) * tb.LOG2E.value, float(scale), int(offset), 0,
            0 if right_bound is None else int(right_bound))
    common = dict(HAS_LB=False, HAS_RB=right_bound is not None, DP=dp, EVEN_D=dp == D, **kernel_flags(None, False))
    return tb._bwd_config(dp, "pre")[which], True, args, common, None, kernel_cu_seqlens(None, stats), DEFAULT_FLAGS


def _triton_dkdv(q_r, q_c, k_row, v_row, do_r, do_c, stats, delta, dk, dv, scale, offset, right_bound):
    """The Triton dK/dV launch of attention_bwd's mode "pre" (its config, args and constexprs)."""
    from mxattn.kernels import triton_attention_bwd as tb
    tb._launch_dkdv(q_r, q_c, k_row, v_row, do_r, do_c, stats, delta, dk, dv,
                    *_triton_pre_launch(0, q_r.shape, k_row.data.shape[1], k_row.data.shape[2], stats, scale, offset,
                                        right_bound))


def _assert_like_triton(x, ref, name):
    assert torch.isfinite(x).all(), name
    ulps = (_ordered_bf16(x) - _ordered_bf16(ref)).abs()
    exact = (ulps == 0).float().mean().item()
    near = (ulps <= 1).float().mean().item()
    assert near >= 0.9999, f"{name}: {near:.6f} within 1 bf16 ulp (max {ulps.max().item()}, exact {exact:.5f})"
    assert exact >= 0.99, f"{name}: only {exact:.5f} bit-equal (max {ulps.max().item()} ulps)"
    assert (x.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max().clamp_min(1e-30), name


#: (case, Sq, Skv, offset, causal): Sq = Skv, Sq != Skv (bottom-right offset, a negative one leaving the first rows
#: without keys, keys past the last query: KV tiles that no query meets), lengths not multiples of 128 (nor of
#: 64 / 32), fewer queries than one query block (TMA boxes past the tensor's end)
CASES = [
    ("square_1000", 1000, 1000, 0, False),
    ("square_1000_causal", 1000, 1000, 0, True),
    ("square_2048_causal", 2048, 2048, 0, True),
    ("short_q_bottom_right_causal", 700, 1100, 400, True),
    ("long_q_causal", 1100, 333, 0, True),
    ("empty_rows_causal", 600, 500, -150, True),
    ("short_kv", 257, 77, 0, False),
    ("long_kv", 97, 1000, 0, False),
    ("tiny_q_causal", 20, 300, 0, True),
    ("tiny_q_tiny_kv", 5, 3, 0, False),
]


def over_cases(fn):
    """A GPU comparison test over CASES x head dims 64 / 128 x MHA / GQA (arguments case, D, heads)."""
    fn = pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])(fn)
    fn = pytest.mark.parametrize("D", [64, 128])(fn)
    return pytest.mark.gpu(pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])(fn))


def case_inputs(case, D, heads, seed, with_kv=False):
    """(B, HQ, HKV, SQ, SKV, offset, right bound, scale, `_pre_inputs`' tensors) of one of CASES (B = 2,
    softmax scale 1 / sqrt(D), a causal case's right bound 0); skips unless an sm_90 GPU."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    _, SQ, SKV, offset, causal = case
    (HQ, HKV), B, scale, rb = heads, 2, 1.0 / math.sqrt(D), 0 if causal else None
    g = torch.Generator(device="cuda").manual_seed(seed + D + SQ + SKV + HKV)
    ins = _pre_inputs(B, HQ, HKV, SQ, SKV, D, offset, rb, g, scale, with_kv)
    return B, HQ, HKV, SQ, SKV, offset, rb, scale, ins


@over_cases
def test_gluon_dkdv_matches_triton_dkdv(case, D, heads):
    from mxattn.kernels import gluon_attention_bwd as gb
    B, HQ, HKV, SQ, SKV, offset, rb, scale, ins = case_inputs(case, D, heads, 4321)
    dk_ref, dv_ref = (torch.empty(B, HKV, SKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _triton_dkdv(*ins, dk_ref, dv_ref, scale, offset, rb)
    dk, dv = (torch.full((B, HKV, SKV, D), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert gb.unsupported_reason(ins[0], ins[2], ins[3], q_c=ins[1], do_r=ins[4], do_c=ins[5]) is None
    gb.dkdv_gluon(*ins, dk, dv, softmax_scale=scale, offset=offset, left_bound=None, right_bound=rb)
    torch.cuda.synchronize()
    _assert_like_triton(dv, dv_ref, "dV")
    _assert_like_triton(dk, dk_ref, "dK")


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_dkdv_head_chunk_views_and_stages(D):
    """A chunk of KV heads as attention_bwd passes it (head slices of K / V / dK / dV, the chunk's stats and
    delta slices, scratch of the chunk's query heads) gives the Triton kernel's numbers; every ring depth, with
    and without the software-pipelined dK GEMM, gives the same bits (the schedule, not the numbers, changes).
    One stage with the pipelined dK is refused (it would deadlock: a step holds the previous block's stage)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels.triton_attention_bwd import _heads
    B, HQ, HKV, SQ, SKV = 1, 6, 3, 900, 900
    scale = 1.0 / math.sqrt(D)
    g = torch.Generator(device="cuda").manual_seed(99 + D)
    q_r, q_c, k_row, v_row, do_r, do_c, stats, delta = _pre_inputs(B, HQ, HKV, SQ, SKV, D, 0, 0, g, scale)
    h0, h1, group = 1, 3, HQ // HKV
    q0, q1 = h0 * group, h1 * group
    chunk = (q_r[:, q0:q1].contiguous(), q_c[:, q0:q1].contiguous(), _heads(k_row, h0, h1), _heads(v_row, h0, h1),
             do_r[:, q0:q1].contiguous(), do_c[:, q0:q1].contiguous(), stats[:, q0:q1], delta[:, q0:q1])
    dk_ref, dv_ref = (torch.zeros(B, HKV, SKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    _triton_dkdv(*chunk, dk_ref[:, h0:h1], dv_ref[:, h0:h1], scale, 0, 0)
    results = []
    # (ring depth, software-pipelined dK GEMM, where the LSE / delta loads go): one ring stage only without the
    # pipelining (its stage is held a step longer)
    # (and the query rows per block: the wide schedule, 64-row blocks, waited, two stages, in every STATS mode)
    runs = [(None, None, None, None), (1, False, None, None), (2, True, None, None), (3, True, None, None),
            (3, False, None, None), (None, not gb.DEFER_WAITS[D], None, None)] + [
        (ns, None, mode, None) for mode in gb.STATS_MODES for ns in (None, 2)] + [
        (2, False, mode, 64) for mode in gb.STATS_MODES]
    for stages, defer, stats_loads, block_m in runs:
        dk, dv = (torch.zeros(B, HKV, SKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gb.dkdv_gluon(*chunk, dk[:, h0:h1], dv[:, h0:h1], softmax_scale=scale, offset=0, right_bound=0,
                      stages=stages, defer=defer, stats_loads=stats_loads, block_m=block_m)
        torch.cuda.synchronize()
        assert (dk[:, :h0] == 0).all() and (dk[:, h1:] == 0).all() and (dv[:, h1:] == 0).all()
        results.append((dk, dv))
    _assert_like_triton(results[0][1][:, h0:h1], dv_ref[:, h0:h1], "dV")
    _assert_like_triton(results[0][0][:, h0:h1], dk_ref[:, h0:h1], "dK")
    for dk, dv in results[1:]:
        assert torch.equal(dk, results[0][0]) and torch.equal(dv, results[0][1])
    with pytest.raises(ValueError, match="stages must be >= 2 with deferred GEMM waits"):
        gb.dkdv_gluon(*chunk, dk[:, h0:h1], dv[:, h0:h1], softmax_scale=scale, offset=0, right_bound=0, stages=1,
                      defer=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case, D", [("causal_gqa", 128), ("no_mask_mha", 128), ("sink_causal", 128),
                                     ("bottom_right_cross", 128), ("causal_gqa", 64), ("bottom_right_cross", 64),
                                     ("padded_causal_gqa", 128), ("padded_bottom_right", 64),
                                     ("window_causal_gqa", 128), ("window_padded", 64)])
def test_public_backward_on_the_gluon_kernels_equals_the_triton_kernels(monkeypatch, case, D):
    """The public backward on Hopper runs the Gluon dK/dV kernel (MHA and GQA; at D64 MHA in bottom_right_cross) and
    the Gluon dQ kernel at head dims 64 and 128 (their query-row / key minimums patched to 0) (`attention_bwd`'s gluon_dkdv / gluon_dq, asked per chunk) and gives the gradients of the
    Triton kernels (MXATTN_GLUON_BWD=0's path) bit for bit. Inputs as views (bshd from a fused QKV). Padded
    batches (cu_seqlens, valid lengths below the tensors' rows; bottom-right offsets per sequence) run both Gluon
    kernels too, and their padding rows get zero gradients; so do sliding windows (with a causal edge, dense and
    padded)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    import mxattn
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from test_gluon_fwd_gpu import _fresh_plan_caches
    _fresh_plan_caches(monkeypatch)  # no replays of earlier tests' recordings: each path runs its body
    monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)
    monkeypatch.setattr(gd, "MIN_KEYS", {64: 0, 128: 0})  # (700 keys: below the D64 minimum; the kernel runs here)
    monkeypatch.setattr(gb, "MIN_QUERY_ROWS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MHA_MIN_QUERY_ROWS", {64: 0, 128: 0})
    HQ, HKV = (8, 2) if case in ("causal_gqa", "padded_causal_gqa", "window_causal_gqa") else (4, 4)
    B, S = 2, 700
    g = torch.Generator(device="cuda").manual_seed(7 + D)
    qkv = torch.randn(B, S, HQ + 2 * HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    do = torch.randn(B, S, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    kwargs = dict(attn_mask_type="no_mask" if case == "no_mask_mha" else "causal", backend="triton")
    if case == "sink_causal":
        kwargs.update(softmax_type="learnable", softmax_offset=torch.randn(HQ, device="cuda", generator=g))
    if case == "bottom_right_cross":
        kwargs.update(attn_mask_type="causal_bottom_right")
    if case.startswith("window"):
        kwargs.update(window_size=(90, 0))
    padded = case.startswith("padded") or case == "window_padded"
    if padded:
        lens_q, lens_kv = (700, 333), ((600, 450) if case == "padded_bottom_right" else (700, 333))
        cu = lambda lens: torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32,  # noqa: E731
                                       device="cuda")
        kwargs.update(attn_mask_type="padding_causal_bottom_right" if case == "padded_bottom_right"
                      else "padding_causal", cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv))
    runs = []
    calls = {"dkdv": [], "dq": []}
    for module, name, key in ((gb, "dkdv_gluon", "dkdv"), (gd, "dq_gluon", "dq")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, key=key, **k: calls[key].append(1) or real(*a, **k))
    for on in (True, False):
        monkeypatch.setattr(backend_module, "GLUON_BACKWARD", on)
        x = qkv.clone().requires_grad_(True)
        q, k, v = x.split([HQ, HKV, HKV], dim=2)
        cut = case in ("bottom_right_cross", "padded_bottom_right")
        kq = k[:, : S - 100] if cut else k
        vq = v[:, : S - 100] if cut else v
        mxattn.mxfp8_attention(q, kq, vq, **kwargs).backward(do)
        runs.append(x.grad)
        if on:
            assert calls["dkdv"], "the Gluon dK/dV kernel did not run"
            assert calls["dq"], "the Gluon dQ kernel did not run"
            for c in calls.values():
                c.clear()
    assert not calls["dkdv"] and not calls["dq"]
    assert torch.equal(runs[0], runs[1])
    if padded:  # padding rows get zero gradients
        for b, (n_q, n_kv) in enumerate(zip(lens_q, lens_kv)):
            assert (runs[0][b, n_q:, :HQ] == 0).all() and (runs[0][b, n_kv:, HQ:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case, D", [("causal_gqa", 128), ("no_mask_mha", 64), ("bottom_right_cross", 128),
                                     ("bottom_right_cross", 64), ("window_causal_gqa", 128), ("causal_gqa", 64)])
def test_packed_backward_on_the_gluon_kernels_equals_the_triton_kernels(monkeypatch, case, D):
    """A packed batch (thd, sequences of 300, 1, 129 and 518 queries: 948 rows, a multiple of 4, where the LSE and
    delta could be TMA-loaded but the sequences start at rows TMA cannot begin a box at, so the consumers copy them;
    with bottom_right_cross other key lengths,
    each sequence's own diagonal) runs the Gluon dK/dV and dQ kernels on the gapped scratch (`bwd_prep` /
    `kv_prep` gap=PACKED_GAP: every tile that starts inside a sequence reads zeros past its end) and gives the
    Triton kernels' gradients (MXATTN_GLUON_BWD=0's path) bit for bit, q, k, v as views split from one fused thd
    QKV. A NaN in one sequence's dO stays in that sequence: every other sequence's dQ, dK, dV are the clean run's
    bits (the Triton kernels' masked loads keep that contract; on the Gluon kernels the gap's zero rows and the
    masked delta do)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    import mxattn
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from test_gluon_fwd_gpu import _fresh_plan_caches
    _fresh_plan_caches(monkeypatch)
    monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)
    monkeypatch.setattr(gd, "MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MIN_QUERY_ROWS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MHA_MIN_QUERY_ROWS", {64: 0, 128: 0})
    HQ, HKV = (8, 2) if case.endswith("gqa") else (4, 4)
    lens_q = [300, 1, 129, 518]
    lens_kv = [250, 7, 129, 600] if case == "bottom_right_cross" else lens_q
    cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
          for n in (lens_q, lens_kv)]
    tq, tkv = sum(lens_q), sum(lens_kv)
    g = torch.Generator(device="cuda").manual_seed(11 + D)
    qkv = torch.randn(max(tq, tkv), HQ + 2 * HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    do = torch.randn(tq, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
    kwargs = dict(qkv_format="thd", backend="triton", cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1],
                  attn_mask_type={"no_mask_mha": "padding", "bottom_right_cross": "padding_causal_bottom_right"}.get(
                      case, "padding_causal"))
    if case.startswith("window"):
        kwargs.update(window_size=(90, 0))
    calls = {"dkdv": [], "dq": []}
    for module, name, key in ((gb, "dkdv_gluon", "dkdv"), (gd, "dq_gluon", "dq")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, key=key, **k: calls[key].append(1) or real(*a, **k))

    def grads(on, d_o):
        monkeypatch.setattr(backend_module, "GLUON_BACKWARD", on)
        x = qkv.clone().requires_grad_(True)
        q, k, v = x.split([HQ, HKV, HKV], dim=1)
        mxattn.mxfp8_attention(q[:tq], k[:tkv], v[:tkv], **kwargs).backward(d_o)
        return x.grad[:tq, :HQ], x.grad[:tkv, HQ:]

    dq_g, dkv_g = grads(True, do)
    assert calls["dkdv"] and calls["dq"], "the Gluon backward kernels did not run"
    for c in calls.values():
        c.clear()
    dq_t, dkv_t = grads(False, do)
    assert not calls["dkdv"] and not calls["dq"]
    assert torch.equal(dq_g, dq_t) and torch.equal(dkv_g, dkv_t)
    assert dq_g.abs().sum() > 0 and dkv_g.abs().sum() > 0
    bad = 2  # sequence 2's dO all NaN: the other sequences' gradients are the clean run's bits
    do_nan = do.clone()
    do_nan[cu[0][bad]:cu[0][bad + 1]] = float("nan")
    dq_n, dkv_n = grads(True, do_nan)
    assert calls["dkdv"] and calls["dq"]
    for b in range(len(lens_q)):
        rq, rk = slice(cu[0][b], cu[0][b + 1]), slice(cu[1][b], cu[1][b + 1])
        if b == bad:
            assert dq_n[rq].isnan().any() and dkv_n[rk].isnan().any()
        else:
            assert torch.equal(dq_n[rq], dq_g[rq]) and torch.equal(dkv_n[rk], dkv_g[rk]), b


@pytest.mark.gpu
def test_transformers_llama_trains_on_the_gluon_backward_eager_and_compiled(monkeypatch):
    """A transformers Llama built from a config (GQA 4:2, head dim 64, the project's HF registration, triton
    backend), one training step on a dense batch (no padding: the public-backward tests above cover padded and
    packed batches on the Gluon kernels) eager and under torch.compile, with the Gluon backward kernels taking every chunk
    (their minimums patched to 0): both kernels run, the eager gradients match the Triton kernels' path (the
    attention's are bit-equal; rel-RMS 1e-5 leaves room for atomics elsewhere in the model), the same holds for
    the compiled model (Gluon against Triton, each compiled afresh), and the compiled step's loss is the eager
    one's within 1e-3 (its gradients within rel-RMS 0.1: the bf16 model's other ops round differently compiled,
    which moves some FP8 codes; they can exceed 1e-2)."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    transformers = pytest.importorskip("transformers")
    import mxattn.integrations.transformers as mx_hf
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from test_gluon_fwd_gpu import _fresh_plan_caches, _rel_rms
    monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)
    monkeypatch.setattr(gd, "MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MIN_QUERY_ROWS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MHA_MIN_QUERY_ROWS", {64: 0, 128: 0})
    calls = {"dkdv": [], "dq": []}
    for module, name, key in ((gb, "dkdv_gluon", "dkdv"), (gd, "dq_gluon", "dq")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, key=key, **k: calls[key].append(1) or real(*a, **k))
    name = "mxfp8_gluon_bwd_test"
    mx_hf.register(name, backend="triton")
    try:
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        cfg._attn_implementation = name
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).train()
        ids = torch.randint(1, 97, (2, 384), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))

        def step(fn, gluon):
            _fresh_plan_caches(monkeypatch)  # each path records its own launch plans
            monkeypatch.setattr(backend_module, "GLUON_BACKWARD", gluon)
            model.zero_grad()
            loss = fn(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.cuda.synchronize()
            return loss.item(), [p.grad.clone() for p in model.parameters()]

        loss_g, grads_g = step(model, True)
        assert calls["dkdv"] and calls["dq"], "the Gluon backward kernels did not run in the eager model"
        loss_t, grads_t = step(model, False)
        assert loss_g == loss_t
        assert all(_rel_rms(a, b) <= 1e-5 for a, b in zip(grads_g, grads_t))

        def compiled_step(gluon):
            for c in calls.values():
                c.clear()
            torch._dynamo.reset()
            return step(torch.compile(model), gluon)

        loss_c, grads_c = compiled_step(True)
        assert calls["dkdv"] and calls["dq"], "the Gluon backward kernels did not run in the compiled model"
        loss_ct, grads_ct = compiled_step(False)
        assert not calls["dkdv"] and not calls["dq"]
        assert loss_c == loss_ct
        worst = max(_rel_rms(a, b) for a, b in zip(grads_c, grads_ct))
        assert worst <= 1e-5, worst
        # compiled against eager: inductor rounds the bf16 model's other ops differently (fused), which moves some
        # of the attention's FP8 codes; a layout or stride error would be O(1)
        assert abs(loss_c - loss_g) <= 1e-3 * abs(loss_g), (loss_c, loss_g)
        worst = max(_rel_rms(a, b) for a, b in zip(grads_c, grads_g))
        assert worst < 0.1, worst
    finally:
        mx_hf.unregister(name)
        torch._dynamo.reset()


# --------------------------------------------------------------------------- CPU
def _cpu_operands(D=128, HQ=4, HKV=2, SQ=100, SKV=80, dtype=torch.bfloat16):
    from types import SimpleNamespace
    q = torch.zeros(1, HQ, SQ, D, dtype=dtype)
    k = SimpleNamespace(data=torch.zeros(1, HKV, SKV, D, dtype=torch.uint8).view(torch.float8_e4m3fn),
                        scale=torch.zeros(1, HKV, SKV, max(1, D // 32), dtype=torch.uint8), axis=3, segments=None)
    v = SimpleNamespace(data=k.data.clone(), scale=k.scale.clone(), axis=3, segments=None)
    return q, k, v


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
def test_gluon_dkdv_refuses_unsupported_calls():
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.runtime.recipe_flags import DEFAULT_FLAGS
    q, k, v = _cpu_operands()
    assert gb.unsupported_reason(q, k, v, q_c=q, do_r=q, do_c=q) is None
    assert gb.unsupported_reason(q, k, v, left_bound=64) is None  # sliding windows are taken
    from mxattn.seqinfo import SeqInfo
    cu = torch.tensor([0, 100], dtype=torch.int32)
    padded, packed = SeqInfo(cu, cu, 100, 100, False), SeqInfo(cu, cu, 100, 100, True)
    assert gb.unsupported_reason(q, k, v, seq=padded) is None  # padded batches are taken, with their own offsets
    assert gb.unsupported_reason(q, k, v, seq=padded, bottom_right=True) is None
    assert gb.unsupported_reason(q, k, v, seq=packed) is None  # packed batches too, on gapped scratch
    assert gb.packed_scratch_reason("q_r", q, 100, padded) is None  # (padded: any scratch)
    assert "gapped scratch" in gb.packed_scratch_reason("q_r", q, 100, packed)  # 100 rows, not 100 + PACKED_GAP
    gapped = torch.zeros(1, 4, 100 + gb.PACKED_GAP, 128, dtype=torch.bfloat16)
    assert gb.packed_scratch_reason("q_r", gapped, 100, packed) is None
    many = torch.arange(0, 40001, dtype=torch.int32)  # 40000 one-token sequences x 2 KV heads: past the y limit
    assert "65535" in gb.unsupported_reason(q, k, v, seq=SeqInfo(many, many, 1, 1, True))
    assert "variable-length" in gb.unsupported_reason(q, k, v, bottom_right=True)
    assert "sinks" in gb.unsupported_reason(q, k, v, sink=torch.zeros(4))
    assert "head dims" in gb.unsupported_reason(*_cpu_operands(D=96))
    assert "head dims" in gb.unsupported_reason(*_cpu_operands(D=32))
    assert "bf16 scratch" in gb.unsupported_reason(*_cpu_operands(dtype=torch.float16))
    assert "bf16 scratch" in gb.unsupported_reason(q, k, v, q_c=q, do_r=q.float(), do_c=q)
    assert "MXFP8Tensor" in gb.unsupported_reason(q, k, torch.zeros(1, 2, 80, 128, dtype=torch.bfloat16))
    odd = torch.zeros(1, 4, 100 * 129, dtype=torch.bfloat16).as_strided((1, 4, 100, 128), (4 * 100 * 129, 100 * 129,
                                                                                           129, 1))
    assert "TMA" in gb.unsupported_reason(odd, k, v)
    assert "TMA" in gb.unsupported_reason(q, k, v, q_c=odd)
    for name in ("ds_bf16", "floor"):  # every recipe's backward switches
        assert gb.unsupported_reason(q, k, v, flags=DEFAULT_FLAGS._replace(**{name: True})) is None
    assert gb.unsupported_reason(q, k, v, flags=DEFAULT_FLAGS._replace(p_mode=2)) is None
    raw = DEFAULT_FLAGS._replace(v_raw=True)
    v_bf16 = torch.zeros(k.data.shape, dtype=torch.bfloat16)
    assert gb.unsupported_reason(q, k, v_bf16, flags=raw) is None  # bf16 V: a bf16 tensor of K's shape
    assert "bf16 tensor" in gb.unsupported_reason(q, k, v, flags=raw)
    assert "bf16 V" in gb.unsupported_reason(q, k, v_bf16, flags=raw, seq=packed)
    with pytest.raises(ValueError, match="packed batch must be the gapped scratch"):
        gb.dkdv_gluon(q, q, k, v, q, q, torch.zeros(1, 4, 100, 1), torch.zeros(1, 4, 100),
                      torch.zeros(1, 2, 80, 128), torch.zeros(1, 2, 80, 128), softmax_scale=0.1, offset=0,
                      left_bound=3, right_bound=0, seq=packed)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
def test_gluon_dkdv_min_query_rows():
    """`takes` runs the kernel from MIN_QUERY_ROWS query rows per KV block on with GQA, MHA_MIN_QUERY_ROWS with MHA
    (query length times queries per KV head, half of it under a causal band: right_bound set; under a sliding
    window the window's width plus BLOCK_N, if fewer, times queries per KV head), where it was measured faster
    than the Triton dK/dV kernel, and not one row below; the refusals still apply above it."""
    from mxattn.kernels import gluon_attention_bwd as gb
    for d in (128, 64):
        least, mha = gb.MIN_QUERY_ROWS[d], gb.MHA_MIN_QUERY_ROWS[d]
        assert least > 0 and mha >= least
        for hq, hkv, sq, right_bound, want in ((4, 4, mha, None, True), (4, 4, mha - 1, None, False),
                                               (4, 4, 2 * mha, 0, True), (4, 4, 2 * mha - 2, 0, False),
                                               (4, 2, least // 2, None, True), (4, 2, least // 2 - 1, None, False),
                                               (8, 2, least // 4, None, True), (8, 2, least // 2, 0, True),
                                               (8, 2, least // 2 - 2, 0, False), (16, 2, 8 * least, 0, True)):
            q, k, v = _cpu_operands(D=d, HQ=hq, HKV=hkv, SQ=sq, SKV=64)
            assert gb.takes(q, k, v, right_bound=right_bound) is want, (d, hq, hkv, sq, right_bound)
        q, k, v = _cpu_operands(D=d, HQ=4, HKV=4, SQ=4 * mha, SKV=64)
        assert not gb.takes(q, k, v, sink=torch.zeros(4))
        # a sliding window bounds the query rows a KV block meets by its width plus the block's keys
        q, k, v = _cpu_operands(D=d, HQ=4, HKV=2, SQ=4 * least, SKV=64)
        assert not gb.takes(q, k, v, left_bound=5, right_bound=0)
        assert gb.takes(q, k, v, left_bound=least // 2 - gb.BLOCK_N, right_bound=0)
        assert not gb.takes(q, k, v, left_bound=least // 2 - gb.BLOCK_N - 1, right_bound=0)
    assert gb.MHA_MIN_QUERY_ROWS[64] > gb.MIN_QUERY_ROWS[64]  # D64 MHA: measured slower below 2048 rows


def test_gluon_dkdv_takes_the_triton_launchs_arguments():
    """Drop-in: dkdv_gluon's positional parameters are `_launch_dkdv`'s tensors in order (q_r, q_c, k_row,
    v_row, do_r, do_c, stats, delta, dk, dv), and it takes attention_bwd's mask keywords."""
    import inspect
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import triton_attention_bwd as tb
    ours = list(inspect.signature(gb.dkdv_gluon).parameters)
    theirs = list(inspect.signature(tb._launch_dkdv).parameters)
    assert theirs[:10] == ["qr", "qc", "kr", "vr", "dor", "doc", "stats", "delta", "dk", "dv"]
    assert ours[:10] == ["q_r", "q_c", "k_row", "v_row", "do_r", "do_c", "stats", "delta", "dk", "dv"]
    for kw in ("softmax_scale", "offset", "left_bound", "right_bound", "seq", "bottom_right", "flags"):
        assert kw in ours


def compile_or_skip(module: str, d, causal):
    """mxattn.kernels.<module>.compile_sm90(d, causal), or a skip where Triton cannot build for sm_90a here."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed here")
    try:
        import importlib
        return importlib.import_module(f"mxattn.kernels.{module}").compile_sm90(d, causal)
    except ImportError as e:  # pragma: no cover - a Triton without GPU-target compilation or without Gluon
        pytest.skip(f"cannot compile for sm_90a here: {e}")


def _dkdv_stack_allowance(d, causal, block_m, varlen=False):
    """(stack bytes, STL / LDL instructions) a dK/dV build may keep: at D128 with 64-query blocks (the wide
    schedule) causal keeps 40 bytes of loop bounds (28 STL / LDL, none in the unmasked block loop; WIDE_SCHEDULE's
    comment), measured faster than 32-query blocks without a stack; padded 16 bytes (10, none in a block loop),
    padded causal bottom-right 56 (48); every other build none."""
    if (d, block_m) != (128, 64):
        return (0, 0)
    return {(True, False): (40, 28), (False, True): (16, 10), (True, True): (56, 48)}.get((causal, varlen), (0, 0))


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)],
                         ids=["d64", "d64-causal", "d128", "d128-causal"])
def test_gluon_dkdv_compiles_for_sm90a_without_spills(d, causal):
    """The warp-specialised kernel builds for sm_90a with Triton's ptxas: no local memory (spills), the
    producer/consumer register split (setmaxnreg), wgmma (A from shared memory for S^T / dP^T, from registers for
    dV / dK), 4-D TMA loads, within the H100's shared memory, wgmmas left asynchronous by ptxas; where
    DEFER_WAITS is on, the dK GEMM is software-pipelined (waits that leave two GEMMs in flight)."""
    from mxattn.kernels import gluon_attention_bwd as gb
    kernel = compile_or_skip("gluon_attention_bwd", d, causal)
    block_m, _, defer = gb.schedule(d, gb.STATS_LOADS[d])
    _assert_sm90_build(kernel, *_dkdv_stack_allowance(d, causal, block_m))
    assert ("wgmma.wait_group.sync.aligned 2;" in kernel.asm["ptx"]) == defer
    assert ("cp.async.ca.shared.global" in kernel.asm["ptx"]) == (gb.STATS_LOADS[d] == 4)
    assert ("cp.async.bulk.tensor.3d" in kernel.asm["ptx"]) == (gb.STATS_LOADS[d] == 5)  # LSE / delta by TMA


def test_gluon_dkdv_schedule_is_wide_only_where_it_builds_clean():
    """`schedule`: the wide schedule (WIDE_SCHEDULE, 64-row blocks at D128) only for dense and padded batches
    without a window in STATS mode 5 (the builds that keep their registers in the block loops); the narrow one
    (BLOCK_M, STAGES, DEFER_WAITS) for windows, modes 0 / 4 and packed batches; any sweep override starts from the
    narrow one."""
    from mxattn.kernels import gluon_attention_bwd as gb
    narrow = {d: (gb.BLOCK_M[d], gb.STAGES[d], gb.DEFER_WAITS[d]) for d in gb.SUPPORTED_HEAD_DIMS}
    assert gb.schedule(128, 5) == gb.WIDE_SCHEDULE[128] == (64, 2, False)
    assert gb.schedule(64, 5) == narrow[64]
    for mode, packed, has_lb in [(4, False, False), (0, False, False), (5, False, True), (5, True, True),
                                 (5, True, False)]:
        assert gb.schedule(128, mode, packed, has_lb) == narrow[128]
    assert gb.schedule(128, 5, packed=False) == gb.WIDE_SCHEDULE[128]  # dense and padded batches
    assert gb.resolve_schedule(128, 5, False, False, None, None, None) == (64, 2, False)
    assert gb.resolve_schedule(128, 5, False, False, None, None, False) == (32, None, False)
    assert gb.resolve_schedule(128, 5, False, False, 64, 2, None) == (64, 2, True)


@pytest.mark.parametrize("block_m,stages", [(32, None), (64, 2)], ids=["bm32", "bm64"])
def test_gluon_dkdv_waited_schedule_builds_without_spills_at_d128(block_m, stages):
    """With DEFER off the dV GEMM runs on under dS (waited for with the dK GEMM): at D128, dense, with 32- and
    64-query blocks (two ring stages: four 64 x 128 bf16 tiles a stage) the kernel builds for sm_90a without
    spills and with asynchronous wgmmas (the A/B candidates against the software-pipelined dK)."""
    from mxattn.kernels import gluon_attention_bwd as gb
    try:
        kernel = gb.compile_sm90(128, False, stages=stages, block_m=block_m, defer=False)
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"cannot compile for sm_90a here: {e}")
    _assert_sm90_build(kernel)
    # per step two waits leave a GEMM in flight (S with dP^T, dP^T with dV) and one waits for all (dK, dV): more
    # of the former than the latter (the schedule that waited for dV before dS had one and three)
    ptx = kernel.asm["ptx"]
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") > ptx.count("wgmma.wait_group.sync.aligned 0;")


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_dkdv_stats_tma_falls_back_where_tma_cannot(D):
    """STATS 5 (the producer TMA-loads the LSE and delta) needs [B, H, SQ] fp32 views TMA can describe; at SQ = 901
    (rows of 3604 bytes) dkdv_gluon runs mode 4 instead, and both give mode 0's bits."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_bwd as gb
    B, HQ, HKV = 1, 4, 2
    scale = 1.0 / math.sqrt(D)
    for S in (901, 904):
        g = torch.Generator(device="cuda").manual_seed(5 + D + S)
        ins = _pre_inputs(B, HQ, HKV, S, S, D, 0, 0, g, scale)
        assert gb.stats_tma_ok(ins[7]) == (S % 4 == 0)
        out = []
        for mode in (0, 5):
            dk, dv = (torch.zeros(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            gb.dkdv_gluon(*ins, dk, dv, softmax_scale=scale, offset=0, right_bound=0, stats_loads=mode)
            out.append((dk, dv))
        torch.cuda.synchronize()
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("d,causal,mode", [(d, c, m) for m in (0, 4, 5) for d in (64, 128) for c in (False, True)])
def test_gluon_dkdv_stats_loads_variants_build_without_spills(d, causal, mode):
    """Every source of the LSE / delta (`STATS_LOADS`: 0 the consumers' global loads, 4
    the consumers' cp.async copies one step ahead, 5 the producer's TMA loads with the tiles, the default) builds
    without spills and with asynchronous wgmmas; cp.async only in mode 4, 3-D bulk tensor copies only in mode 5."""
    from mxattn.kernels import gluon_attention_bwd as gb
    try:
        kernel = gb.compile_sm90(d, causal, stats_loads=mode)
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"cannot compile for sm_90a here: {e}")
    _assert_sm90_build(kernel, *_dkdv_stack_allowance(d, causal, gb.schedule(d, mode)[0]))
    ptx = kernel.asm["ptx"]
    assert ("cp.async.ca.shared.global" in ptx) == (mode == 4)
    assert ("cp.async.wait_group" in ptx) == (mode == 4)
    assert ("cp.async.bulk.tensor.3d" in ptx) == (mode == 5)  # the producer's LSE / delta loads


@pytest.mark.parametrize("d,causal,bottom_right", [(128, False, False), (128, True, True), (64, False, False),
                                                   (64, True, True)])
@pytest.mark.parametrize("kernel", ["gluon_attention_bwd", "gluon_attention_dq"], ids=["dkdv", "dq"])
def test_gluon_backward_padded_variants_build_without_spills(kernel, d, causal, bottom_right):
    """The padded-batch variant (VARLEN: each sequence's lengths from cu_seqlens, BOTTOM_RIGHT its own offset) of
    the dK/dV and dQ kernels builds for sm_90a without spills and with asynchronous wgmmas (the dense builds' SASS
    is unchanged by it)."""
    import importlib
    module = importlib.import_module(f"mxattn.kernels.{kernel}")
    try:
        build = module.compile_sm90(d, causal, varlen=True, bottom_right=bottom_right)
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"cannot compile for sm_90a here: {e}")
    wide = kernel == "gluon_attention_bwd" and module.schedule(d, module.STATS_LOADS[d])[0] == 64
    _assert_sm90_build(build, *(_dkdv_stack_allowance(d, causal, 64, varlen=True) if wide else (0, 0)))
    dense = module.compile_sm90(d, causal).asm["ptx"]  # the lengths: more global loads than the dense build's
    assert build.asm["ptx"].count("ld.global") > dense.count("ld.global")


@pytest.mark.parametrize("d,causal,bottom_right,has_lb", [(128, False, False, False), (128, True, True, False),
                                                          (64, True, False, False), (64, True, True, True),
                                                          (128, True, False, True)])
@pytest.mark.parametrize("kernel", ["gluon_attention_bwd", "gluon_attention_dq"], ids=["dkdv", "dq"])
def test_gluon_backward_packed_variants_build_without_spills(kernel, d, causal, bottom_right, has_lb):
    """The packed-batch variant (PACKED: rows from each sequence's first, the scratch gapped by GAP rows) of the
    dK/dV kernel (its narrow schedule: `schedule`) and of the dQ kernel builds for sm_90a without spills and with
    asynchronous wgmmas, with causal edges, bottom-right offsets and sliding windows. The dK/dV builds (STATS 4,
    what `dkdv_gluon` runs for packed batches) keep a few loop bounds on the stack, allowed exactly as measured
    offline (Triton 3.6's ptxas; stack bytes, STL / LDL): none in the block loops without a window, 2 (D128,
    window, causal) and 8 (D64, window, bottom-right) in masked-block loops with one."""
    import importlib
    module = importlib.import_module(f"mxattn.kernels.{kernel}")
    try:
        build = module.compile_sm90(d, causal, packed=True, bottom_right=bottom_right, has_lb=has_lb)
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"cannot compile for sm_90a here: {e}")
    if kernel == "gluon_attention_bwd":  # (the LSE / delta copied by the consumers: `dkdv_gluon` for packed batches)
        assert "cp.async.ca.shared.global" in build.asm["ptx"] and "cp.async.bulk.tensor.3d" not in build.asm["ptx"]
    allowance = {(128, False, False, False): (8, 6), (128, True, True, False): (24, 18), (64, True, False, False): (8, 2),
                 (64, True, True, True): (56, 50), (128, True, False, True): (72, 63)}
    _assert_sm90_build(build, *(allowance[d, causal, bottom_right, has_lb] if kernel == "gluon_attention_bwd"
                                else (0, 0)))
    if kernel == "gluon_attention_bwd":
        assert module.schedule(d, module.STATS_LOADS[d], packed=True) == (module.BLOCK_M[d], module.STAGES[d],
                                                                           module.DEFER_WAITS[d])


@pytest.mark.parametrize("d,causal,varlen", [(128, False, False), (128, True, False), (64, True, False),
                                             (128, True, True), (64, True, True)])
@pytest.mark.parametrize("kernel", ["gluon_attention_bwd", "gluon_attention_dq"], ids=["dkdv", "dq"])
def test_gluon_backward_window_variants_build_without_spills(kernel, d, causal, varlen):
    """The sliding-window variant (HAS_LB) of the dK/dV and dQ kernels, alone, with a causal edge and with padded
    batches (bottom-right), builds for sm_90a without spills and with asynchronous wgmmas."""
    import importlib
    module = importlib.import_module(f"mxattn.kernels.{kernel}")
    try:
        build = module.compile_sm90(d, causal, has_lb=True, varlen=varlen, bottom_right=varlen)
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"cannot compile for sm_90a here: {e}")
    _assert_sm90_build(build)
