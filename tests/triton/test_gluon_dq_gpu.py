"""The Gluon dQ kernel (`mxattn.kernels.gluon_attention_dq.dq_gluon`) against the Triton dQ kernel in mode "pre" on
identical inputs, on an sm_90 GPU; and, on any machine with Triton, that it compiles for sm_90a without register
spills, refuses what it does not take and takes `_launch_dq`'s tensors in order.

The inputs are built as `triton_attention_bwd.attention_bwd` builds them in mode "pre" (`_pre_inputs` of
test_gluon_bwd_gpu.py: the prep pass's bf16 scratch of Q and dO and delta, `kv_prep`'s of K both ways and V).
Both kernels run the same arithmetic per element and add the same k16 slices of keys in the same order into
their fp32 accumulators, so dQ should be bit-equal in nearly every element and within one bf16 ulp everywhere.
"""

import inspect
import math

import pytest
import torch

from test_gluon_bwd_gpu import (HAS_TRITON, _assert_like_triton, _cpu_operands, _is_hopper, _pre_inputs,
                                _triton_pre_launch, case_inputs, compile_or_skip, over_cases)
from test_gluon_fwd_gpu import _assert_sm90_build


def _dq_inputs(B, HQ, HKV, SQ, SKV, D, offset, right_bound, g, scale):
    """(q_r, k_r, k_c, v_r, do_r, stats, delta) as attention_bwd hands them to the dQ launch in mode "pre" (all
    heads in one chunk), then (k_row, k_col, v_row) for chunks of heads."""
    pre = _pre_inputs(B, HQ, HKV, SQ, SKV, D, offset, right_bound, g, scale, with_kv=True)
    return _dq_operands(pre), (pre[2], pre[11], pre[3])


def _dq_operands(pre):
    """The dQ launch's tensors (q_r, k_r, k_c, v_r, do_r, stats, delta) of `_pre_inputs(.., with_kv=True)`."""
    q_r, _, _, _, do_r, _, stats, delta, k_r, k_c, v_r, _ = pre
    return q_r, k_r, k_c, v_r, do_r, stats, delta


def _triton_dq(q_r, k_r, k_c, v_r, do_r, stats, delta, dq, scale, offset, right_bound):
    """The Triton dQ launch of attention_bwd's mode "pre" (its config, args and constexprs)."""
    from mxattn.kernels import triton_attention_bwd as tb
    tb._launch_dq(q_r, k_r, k_c, v_r, do_r, stats, delta, dq,
                  *_triton_pre_launch(1, q_r.shape, k_r.shape[1], k_r.shape[2], stats, scale, offset, right_bound))


@over_cases
def test_gluon_dq_matches_triton_dq(case, D, heads):
    from mxattn.kernels import gluon_attention_dq as gd
    B, HQ, HKV, SQ, SKV, offset, rb, scale, pre = case_inputs(case, D, heads, 1234, with_kv=True)
    ins = _dq_operands(pre)
    dq_ref = torch.empty(B, HQ, SQ, D, device="cuda", dtype=torch.bfloat16)
    _triton_dq(*ins, dq_ref, scale, offset, rb)
    dq = torch.full((B, HQ, SQ, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert gd.unsupported_reason(*ins[:5]) is None
    gd.dq_gluon(*ins, dq, softmax_scale=scale, offset=offset, left_bound=None, right_bound=rb)
    torch.cuda.synchronize()
    _assert_like_triton(dq, dq_ref, "dQ")
    if rb is not None and offset < 0:  # rows that meet no key
        assert (dq[:, :, :-offset] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_dq_head_chunk_views_and_stages(D):
    """A chunk of heads as attention_bwd passes it (scratch of the chunk's query heads from the prep pass and of
    its KV heads from `kv_prep(.., h0, h1, ..)`, the chunk's stats and delta slices, a head slice of dQ) gives the
    Triton kernel's numbers and leaves the other heads' dQ alone; every ring depth, with and without the
    software-pipelined dQ GEMM, gives the same bits; other KV block sizes the Triton kernel's numbers."""
    if not _is_hopper():
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from mxattn.kernels import gluon_attention_dq as gd
    from mxattn.kernels.triton_bwd_prep import kv_prep
    from mxattn.seqinfo import kernel_cu_seqlens
    B, HQ, HKV, SQ, SKV = 1, 6, 3, 900, 900
    scale = 1.0 / math.sqrt(D)
    g = torch.Generator(device="cuda").manual_seed(77 + D)
    (q_r, _, _, _, do_r, stats, delta), (k_row, k_col, v_row) = _dq_inputs(B, HQ, HKV, SQ, SKV, D, 0, 0, g, scale)
    h0, h1, group = 1, 3, HQ // HKV
    q0, q1 = h0 * group, h1 * group
    k_r, k_c, v_r = kv_prep(k_row, k_col, v_row, h0, h1, None, kernel_cu_seqlens(None, stats))
    chunk = (q_r[:, q0:q1].contiguous(), k_r, k_c, v_r, do_r[:, q0:q1].contiguous(), stats[:, q0:q1],
             delta[:, q0:q1])
    dq_ref = torch.zeros(B, HQ, SQ, D, device="cuda", dtype=torch.bfloat16)
    _triton_dq(*chunk, dq_ref[:, q0:q1], scale, 0, 0)
    results = []
    # (ring depth, software-pipelined dQ GEMM): one stage only without it; 4 stages of D128 tiles exceed shared
    # memory; at D64 the pipelined dQ runs with 64-key blocks (128: ptxas serialises its wgmmas)
    runs = [(None, None), (1, False), (2, not gd.DEFER_WAITS[D]), (3, False)] + ([(4, False)] if D == 64 else [])
    for stages, defer in runs:
        dq = torch.zeros(B, HQ, SQ, D, device="cuda", dtype=torch.bfloat16)
        gd.dq_gluon(*chunk, dq[:, q0:q1], softmax_scale=scale, offset=0, right_bound=0, stages=stages,
                    defer=defer)
        torch.cuda.synchronize()
        assert (dq[:, :q0] == 0).all() and (dq[:, q1:] == 0).all()
        results.append(dq)
    _assert_like_triton(results[0][:, q0:q1], dq_ref[:, q0:q1], "dQ")
    for dq in results[1:]:
        assert torch.equal(dq, results[0])
    for block_n, defer in ((64, True), (64, False)) if D == 64 else ((32, True), (32, False)):
        dq = torch.zeros(B, HQ, SQ, D, device="cuda", dtype=torch.bfloat16)
        gd.dq_gluon(*chunk, dq[:, q0:q1], softmax_scale=scale, offset=0, right_bound=0, defer=defer,
                    block_n=block_n)
        torch.cuda.synchronize()
        _assert_like_triton(dq[:, q0:q1], dq_ref[:, q0:q1], f"dQ (block_n {block_n})")
    with pytest.raises(ValueError, match="stages must be >= 2 with deferred GEMM waits"):
        gd.dq_gluon(*chunk, dq[:, q0:q1], softmax_scale=scale, offset=0, right_bound=0, stages=1, defer=True)


# --------------------------------------------------------------------------- CPU
def _cpu_scratch(D=128, HQ=4, HKV=2, SQ=100, SKV=80, dtype=torch.bfloat16):
    """(q_r, k_r, k_c, v_r, do_r) zeros of the given shapes."""
    q, _, _ = _cpu_operands(D, HQ, HKV, SQ, SKV, dtype)
    kv = torch.zeros(1, HKV, SKV, D, dtype=dtype)
    return q, kv, kv.clone(), kv.clone(), q.clone()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
def test_gluon_dq_refuses_unsupported_calls(monkeypatch):
    from mxattn.kernels import gluon_attention_dq as gd
    from mxattn.runtime.recipe_flags import DEFAULT_FLAGS
    monkeypatch.setattr(gd, "MIN_KEYS", {64: 0, 128: 0})  # (80 keys; the minimum: test_gluon_dq_min_keys)
    ops = _cpu_scratch()
    assert gd.unsupported_reason(*ops) is None and gd.takes(*ops)
    assert gd.unsupported_reason(*ops, left_bound=64) is None  # sliding windows are taken
    from mxattn.seqinfo import SeqInfo
    cu = torch.tensor([0, 100], dtype=torch.int32)
    assert gd.unsupported_reason(*ops, seq=SeqInfo(cu, cu, 100, 100, False)) is None  # padded batches are taken
    assert gd.unsupported_reason(*ops, seq=SeqInfo(cu, cu, 100, 100, False), bottom_right=True) is None
    assert gd.unsupported_reason(*ops, seq=SeqInfo(cu, cu, 100, 100, True)) is None  # packed: gapped scratch
    many = torch.arange(0, 20001, dtype=torch.int32)  # 20000 one-token sequences x 4 query heads: past the y limit
    assert "65535" in gd.unsupported_reason(*ops, seq=SeqInfo(many, many, 1, 1, True))
    assert "variable-length" in gd.unsupported_reason(*ops, bottom_right=True)
    assert "sinks" in gd.unsupported_reason(*ops, sink=torch.zeros(4))
    assert not gd.takes(*ops, sink=torch.zeros(4))
    assert "head dims" in gd.unsupported_reason(*_cpu_scratch(D=96))
    assert "head dims" in gd.unsupported_reason(*_cpu_scratch(D=32))
    assert "bf16 scratch" in gd.unsupported_reason(*_cpu_scratch(dtype=torch.float16))
    q, k_r, k_c, v_r, do_r = ops
    assert "k_c" in gd.unsupported_reason(q, k_r, k_c.float(), v_r, do_r)
    _, k_fp8, _ = _cpu_operands()
    assert "k_r" in gd.unsupported_reason(q, k_fp8, k_c, v_r, do_r)  # an MXFP8Tensor: mode "fp8"
    odd = torch.zeros(1, 4, 100 * 129, dtype=torch.bfloat16).as_strided((1, 4, 100, 128), (4 * 100 * 129, 100 * 129,
                                                                                           129, 1))
    assert "TMA" in gd.unsupported_reason(odd, k_r, k_c, v_r, do_r)
    assert "TMA" in gd.unsupported_reason(q, k_r, k_c, v_r, odd)
    for name in ("v_raw", "ds_bf16", "floor"):  # every recipe's backward switches (a bf16 V is the vr scratch)
        assert gd.unsupported_reason(*ops, flags=DEFAULT_FLAGS._replace(**{name: True})) is None
    assert "bf16 V" in gd.unsupported_reason(*ops, flags=DEFAULT_FLAGS._replace(v_raw=True),
                                             seq=SeqInfo(cu, cu, 100, 100, True))
    big = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16).expand(65536, 1, 64, 128)
    assert "65535" in gd.unsupported_reason(big, k_r, k_c, v_r, big)
    stats, delta, dq = torch.zeros(1, 4, 100, 1), torch.zeros(1, 4, 100), torch.zeros(1, 4, 100, 128)
    with pytest.raises(ValueError, match="packed batch must be the gapped scratch"):
        gd.dq_gluon(*ops, stats, delta, dq, softmax_scale=0.1, offset=0, left_bound=3, right_bound=0,
                    seq=SeqInfo(cu, cu, 100, 100, True))
    with pytest.raises(ValueError, match="multiple"):
        gd.dq_gluon(*_cpu_scratch(HQ=3), stats, delta, dq, softmax_scale=0.1, offset=0)
    with pytest.raises(ValueError, match="dq must have shape"):
        gd.dq_gluon(*ops, stats, delta, dq[:, :2], softmax_scale=0.1, offset=0)
    with pytest.raises(ValueError, match="stages"):
        gd.dq_gluon(*ops, stats, delta, dq, softmax_scale=0.1, offset=0, stages=0)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_dq_min_keys(d):
    """`takes` runs the kernel from MIN_KEYS keys per query block on (the KV length, half of it under a causal
    band: right_bound set; under a sliding window its width plus BLOCK_M where fewer), where it was measured
    faster than the Triton dQ kernel, and not one key below."""
    from mxattn.kernels import gluon_attention_dq as gd
    least = gd.MIN_KEYS[d]
    assert least > 0
    for skv, right_bound, want in ((least, None, True), (least - 1, None, False), (2 * least, 0, True),
                                   (2 * least - 2, 0, False), (2 * least, None, True)):
        assert gd.takes(*_cpu_scratch(D=d, SQ=128, SKV=skv), right_bound=right_bound) is want, (skv, right_bound)
    # a sliding window bounds the keys a query tile meets by its width plus the tile's rows
    ops = _cpu_scratch(D=d, SQ=128, SKV=4 * least)
    assert gd.takes(*ops, left_bound=least - gd.BLOCK_M, right_bound=0)
    assert not gd.takes(*ops, left_bound=least - gd.BLOCK_M - 1, right_bound=0)
    # refusals still apply above the minimum
    assert not gd.takes(*_cpu_scratch(D=d, SQ=128, SKV=2 * least), right_bound=0, sink=torch.zeros(4))
    assert not gd.takes(*_cpu_scratch(D=96, SQ=128, SKV=4096))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
def test_gluon_dq_takes_the_triton_launchs_arguments():
    """Drop-in: dq_gluon's positional parameters are `_launch_dq`'s tensors in order (q_r, k_r, k_c, v_r, do_r,
    stats, delta, dq), and it takes attention_bwd's mask keywords and dkdv_gluon's launch keywords."""
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from mxattn.kernels import triton_attention_bwd as tb
    ours = inspect.signature(gd.dq_gluon).parameters
    theirs = list(inspect.signature(tb._launch_dq).parameters)
    assert theirs[:8] == ["qr", "kr", "kc", "vr", "dor", "stats", "delta", "dq"]
    assert list(ours)[:8] == ["q_r", "k_r", "k_c", "v_r", "do_r", "stats", "delta", "dq"]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in list(ours.values())[:8])
    for kw in ("softmax_scale", "offset", "left_bound", "right_bound", "seq", "bottom_right", "flags", "stages",
               "checked"):
        assert ours[kw].kind == inspect.Parameter.KEYWORD_ONLY
        if kw in inspect.signature(gb.dkdv_gluon).parameters:
            assert ours[kw].default == inspect.signature(gb.dkdv_gluon).parameters[kw].default


@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (128, False), (128, True)],
                         ids=["d64", "d64-causal", "d128", "d128-causal"])
def test_gluon_dq_compiles_for_sm90a_without_spills(d, causal):
    """The warp-specialised kernel builds for sm_90a with Triton's ptxas: no local memory (spills), the
    producer/consumer register split (setmaxnreg), wgmma (A from shared memory for S / dP, from registers for
    dQ), 4-D TMA loads, within the H100's shared memory, wgmmas left asynchronous by ptxas; where DEFER_WAITS is
    on, the dQ GEMM is software-pipelined (waits that leave two GEMMs in flight)."""
    from mxattn.kernels import gluon_attention_dq as gd
    kernel = compile_or_skip("gluon_attention_dq", d, causal)
    _assert_sm90_build(kernel)
    assert ("wgmma.wait_group.sync.aligned 2;" in kernel.asm["ptx"]) == gd.DEFER_WAITS[d]
