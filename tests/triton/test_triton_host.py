"""Host-side logic of the triton backend and its kernels' entry points, on the CPU (no GPU): argument checks
and messages raised before any kernel launch, grid sizing, and what `supports` accepts. Needs triton
importable (CI has it); nothing here launches a kernel."""

import importlib.util

import pytest
import torch

from mxattn.backends.base import AttentionParams, Problem
from mxattn.errors import MXFP8NotSupportedError
from mxattn.mask import MaskSpec
from mxattn.seqinfo import SeqInfo
from triton_helpers import record_launches as _record_launches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


# --------------------------------------------------------------------------- quantizer entry point


def test_quantizer_rejects_bad_input():
    from mxattn.kernels.triton_quantize import quantize_rowcol
    with pytest.raises(TypeError, match="x must have dtype"):
        quantize_rowcol(torch.zeros(1, 1, 32, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="4-D"):
        quantize_rowcol(torch.zeros(32, 32))
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        quantize_rowcol(torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16))


def test_quantizer_checks_lengths_before_any_kernel(monkeypatch):
    from mxattn import checks
    from mxattn.kernels import triton_quantize as tq

    launched = []
    monkeypatch.setattr(tq, "launch", lambda *a, **k: launched.append(a))
    real = checks.check_bhsd_tensor
    monkeypatch.setattr(tq, "check_bhsd_tensor", lambda x, n, d, dev=None: real(x, n, d))  # accept CPU x
    x = torch.zeros(1, 2, 64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="packed=True needs cu_seqlens"):
        tq.quantize_rowcol(x, packed=True)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        tq.quantize_rowcol(x, cu_seqlens=[0, 64], packed=True)
    with pytest.raises(ValueError, match="1-D int32"):
        tq.quantize_rowcol(x, cu_seqlens=torch.tensor([0, 64]), packed=True)  # int64
    with pytest.raises(ValueError, match="swizzle=True is not available for a packed batch"):
        tq.quantize_rowcol(x, cu_seqlens=_cu([64]), packed=True, swizzle=True)
    with pytest.raises(ValueError, match=r"\[1, H, T, D\]"):
        tq.quantize_rowcol(torch.zeros(2, 2, 64, 32), cu_seqlens=_cu([64, 64]), packed=True)
    with pytest.raises(ValueError, match="expected 3"):
        tq.quantize_rowcol(torch.zeros(2, 2, 64, 32), cu_seqlens=_cu([64]), packed=False)
    assert not launched


def test_quantizer_varlen_shapes_without_a_kernel(monkeypatch):
    """Output shapes, segments and the grid of a packed / padded call (the launch itself is stubbed)."""
    from mxattn import checks
    from mxattn.kernels import triton_quantize as tq

    grids = []
    monkeypatch.setattr(tq, "launch", lambda fn, grid, *a, **k: grids.append((grid, k)))
    real = checks.check_bhsd_tensor
    monkeypatch.setattr(tq, "check_bhsd_tensor", lambda x, n, d, dev=None: real(x, n, d))
    lengths = [0, 1, 33, 300]
    cu = _cu(lengths)
    x = torch.zeros(sum(lengths), 3, 64).permute(1, 0, 2).unsqueeze(0)  # thd viewed as [1, H, T, D]
    got = tq.quantize_rowcol(x, cu_seqlens=cu, max_seqlen=300, packed=True)
    assert got.col.scale.shape == (1, 3, 334 // 32 + 4, 64) and got.col.segments is cu
    assert got.row.scale.shape == (1, 3, 334, 2) and got.row.segments is None
    assert torch.all(got.col.scale.view(torch.uint8) == 0)  # unused rows are byte 0 (zeros allocation)
    (grid, kw), = grids
    assert grid == (tq.row_tiles(300, tq.QUANT_TILE[0]), 1, 4 * 3) == (10, 1, 12)
    assert kw["VARLEN"] and kw["PACKED"]
    grids.clear()
    xp = torch.zeros(4, 3, 300, 64)
    got = tq.quantize_rowcol(xp, cu_seqlens=cu, max_seqlen=300)
    assert got.col.scale.shape == (4, 3, 10, 64) and got.col.segments is None
    (grid, kw), = grids
    assert grid == (10, 1, 12) and kw["VARLEN"] and not kw["PACKED"]


def test_quantize_qkv_is_one_launch_unless_the_grid_overflows(monkeypatch):
    """The forward's Q, K, V quantization: one launch over the three tensors' programs (grid rows of the
    longest), three launches when their sequences * heads exceed a grid axis; refusals before any launch."""
    from mxattn import checks
    from mxattn.kernels import triton_quantize as tq

    launched = []
    monkeypatch.setattr(tq, "launch", lambda fn, grid, *a, **k: launched.append((fn, grid, len(a), k)))
    real = checks.check_bhsd_tensor
    monkeypatch.setattr(tq, "check_bhsd_tensor", lambda x, n, d, dev=None: real(x, n, d))
    q, k, v = torch.zeros(2, 4, 64, 32), torch.zeros(2, 2, 160, 32), torch.zeros(2, 2, 160, 32)
    qq, kq, vq = tq.quantize_qkv(q, k, v, {}, dict(row_dequant=True), dict(col_seq_major=True))
    (fn, grid, n_args, kw), = launched
    assert fn is tq._quantize_qkv_kernel and grid == (5, 1, 8 + 4 + 4) and n_args == 3 * tq.TILE_ARGS_NO_SWIZZLE + 2
    assert (kw["ROW_DQ1"], kw["CSM2"], kw["CSM0"], kw["COL_DQ2"]) == (True, True, False, False)
    assert kq.row_dequant.shape == (2, 2, 160, 32) and vq.col_seq_major.data.shape == (2, 2, 32, 160)
    assert qq.row.data.shape == (2, 4, 64, 32) and qq.col.scale.shape == (2, 4, 2, 32)
    launched.clear()
    monkeypatch.setattr(tq, "MAX_GRID_YZ", 15)
    tq.quantize_qkv(q, k, v, {}, {}, {})
    one = tq._quantize_rowcol_kernel
    assert [(fn, grid) for fn, grid, _, _ in launched] == [(one, (2, 1, 8)), (one, (5, 1, 4)), (one, (5, 1, 4))]
    launched.clear()
    with pytest.raises(ValueError, match="share tile"):
        tq.quantize_qkv(q, k, v, dict(swizzle=True), {}, {})
    with pytest.raises(ValueError, match="share tile"):
        tq.quantize_qkv(q, k, v, {}, dict(tile=(64, 4)), {})
    assert not launched


def test_grid_helpers():
    from mxattn.kernels.triton_quantize import MAX_GRID_YZ, col_scale_rows, row_tiles, seq_programs
    from mxattn.seqinfo import covered_rows
    # packed: tiles for the longest sequence only (4096 + 128 + 128 costs about its tokens)
    assert row_tiles(covered_rows(4096 + 256, 4096, True), 128) == 32
    assert row_tiles(covered_rows(4096 + 256, None, True), 128) == 34
    # dense and padded: every row of the tensor (padding rows get their zeros from the kernels)
    assert row_tiles(1000, 128) == 8 and row_tiles(covered_rows(1000, 10, False), 128) == 8
    assert seq_programs(2, 8) == 16
    assert seq_programs(1, 8, _cu([5, 0, 7]), packed=True) == 24
    assert seq_programs(3, 8, _cu([5, 0, 7]), packed=False) == 24
    with pytest.raises(ValueError, match="CUDA grid limit"):
        seq_programs(1, 64, torch.zeros(MAX_GRID_YZ // 64 + 2, dtype=torch.int32), packed=True)
    assert col_scale_rows(100) == 4
    assert col_scale_rows(100, _cu([1, 99]), packed=True) == 100 // 32 + 2


# --------------------------------------------------------------------------- attention entry points


def test_attention_kernels_check_seq_before_any_kernel():
    from mxattn.kernels.triton_attention_fwd import check_seq
    from mxattn.kernels.triton_quantize import row_tiles, seq_programs
    from mxattn.seqinfo import grid_rows, grid_sequences, kernel_flags
    q = torch.zeros(1, 4, 70, 64)
    k = torch.zeros(1, 2, 90, 64)
    with pytest.raises(ValueError, match="bottom_right=True is for variable-length calls"):
        check_seq(None, q, k, bottom_right=True)
    assert check_seq(None, q, k) is None
    assert row_tiles(grid_rows(None, "q", 70), 64) == 2 and seq_programs(grid_sequences(None, 1), 4) == 4
    assert kernel_flags(None, False) == dict(VARLEN=False, PACKED=False, BOTTOM_RIGHT=False)
    seq = SeqInfo(_cu([30, 40]), _cu([50, 40]), 40, 50, True)
    assert check_seq(seq, q, k, bottom_right=True) is seq
    assert row_tiles(grid_rows(seq, "q", 70), 32) == 2 and row_tiles(grid_rows(seq, "kv", 90), 32) == 2
    assert seq_programs(grid_sequences(seq, 1), 4) == 8
    assert kernel_flags(seq, True) == dict(VARLEN=True, PACKED=True, BOTTOM_RIGHT=True)
    with pytest.raises(ValueError, match="pass offset=0"):
        check_seq(seq, q, k, bottom_right=True, offset=3)
    with pytest.raises(ValueError, match="different batch sizes"):
        check_seq(SeqInfo(_cu([30, 40]), _cu([90]), 40, 90, True), q, k)
    with pytest.raises(ValueError, match="seq.cu_seqlens_kv has 3 entries"):
        check_seq(SeqInfo(_cu([30]), _cu([50, 40]), 30, 50, False), q, k)


def test_backend_argument_checks_before_any_kernel():
    from mxattn.backends.triton_backend import TritonBackend
    be = TritonBackend()
    params = AttentionParams(softmax_scale=0.1, mask=MaskSpec())
    q = torch.randn(1, 2, 64, 80, dtype=torch.bfloat16)
    with pytest.raises(MXFP8NotSupportedError, match="head_dim 80"):
        be.forward(q, q, q, params)
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 3, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        be.forward(q, k, k, params)
    with pytest.raises(TypeError, match="q must have dtype"):
        be.forward(q.to(torch.int32), q, q, params)
    with pytest.raises(ValueError, match="CUDA"):
        be.forward(q, q, q, params)
    with pytest.raises(TypeError, match="params.out_dtype"):
        be.forward(q, q, q, AttentionParams(softmax_scale=0.1, mask=MaskSpec(), out_dtype=torch.float64))


def test_supports_variable_lengths(monkeypatch):
    from mxattn.backends.triton_backend import TritonBackend
    monkeypatch.setattr(TritonBackend, "availability", classmethod(lambda cls, dev: (True, "stub")))
    for varlen in (None, "padded", "packed"):
        problem = Problem(device=torch.device("cuda"), dtype=torch.float32, batch=3, heads_q=8, heads_kv=2,
                          seqlen_q=300, seqlen_kv=129, head_dim=128, mask=MaskSpec(causal=True), varlen=varlen,
                          needs_backward=True)
        assert TritonBackend.supports(problem) == (True, "stub")


def test_forward_data_path_is_chosen_by_the_problem():
    """bf16 K/V scratch for head dims up to 128 while K + V in bf16 fit the budget; FP8 dequantized on chip for
    larger head dims or scratch (the same numbers either way: test_varlen_triton_gpu.py::test_forward_paths_agree)."""
    from mxattn.kernels.triton_attention_fwd import SCRATCH_BUDGET_BYTES, fwd_streams_bf16
    assert fwd_streams_bf16(2, 16, 4096, 128) and fwd_streams_bf16(1, 8, 8192, 96) and fwd_streams_bf16(4, 16, 2048, 64)
    assert not fwd_streams_bf16(1, 2, 256, 192) and not fwd_streams_bf16(1, 2, 256, 256)
    rows = SCRATCH_BUDGET_BYTES // (4 * 128 * 8)  # K + V bf16 of 8 heads at D = 128: 4 bytes per row element
    assert fwd_streams_bf16(1, 8, rows, 128) and not fwd_streams_bf16(1, 8, rows + 1, 128)


def test_quantizer_refuses_col_dequant_without_row():
    from mxattn.kernels.triton_quantize import quantize_rowcol
    x = torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="col_dequant needs row=True"):
        quantize_rowcol(x.cuda() if torch.cuda.is_available() else x, row=False, col_dequant=True)


def test_launches_per_call_without_a_gpu(monkeypatch, request):
    """The triton backend's host path issues two launches per forward (Q/K/V quantization, attention) and, per
    chunk of heads, four per backward (query-side prep, dK/dV, key-side prep, dQ): run on CPU tensors with the
    launches recorded instead of made (host-side structure only; the GPU tests check the numbers)."""
    import mxattn
    launched = _record_launches(monkeypatch, request)
    q, k, v = (torch.randn(1, 96, 4, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
    assert [name for name, _ in launched] == ["quantize_qkv_kernel", "attn_fwd_kernel"]
    launched.clear()
    o.backward(torch.ones_like(o))
    assert [name for name, _ in launched] == ["bwd_prep_kernel", "dkdv_kernel", "bwd_prep_kernel", "dq_kernel"]
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_calls_without_backward_whose_queries_fit_one_tile_are_one_launch(monkeypatch, request):
    """Without a backward, a call whose queries fit one tile (a decode step, a short chunk; head dim <= 128)
    is one launch (the forward kernel quantizes Q, K, V as it reads them); longer queries, head dim 256 and
    calls with a backward keep the quantizer's launch."""
    import mxattn
    launched = _record_launches(monkeypatch, request)

    def names(sq, skv, d, grad=False, **kw):
        launched.clear()
        q = torch.randn(2, sq, 4, d, dtype=torch.bfloat16, requires_grad=grad)
        k, v = (torch.randn(2, skv, 2, d, dtype=torch.bfloat16, requires_grad=grad) for _ in range(2))
        with torch.set_grad_enabled(grad):
            mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal_bottom_right", backend="triton", **kw)
        return [name for name, _ in launched]

    assert names(1, 700, 64) == ["attn_fwd_kernel"]
    assert names(128, 128, 128) == ["attn_fwd_kernel"]
    assert names(16, 300, 96) == ["attn_fwd_kernel"]
    assert names(64, 300, 64) == ["attn_fwd_kernel"]
    assert names(65, 300, 64) == ["quantize_qkv_kernel", "attn_fwd_kernel"]  # two tiles of 64 at D64
    assert names(129, 300, 64) == ["quantize_qkv_kernel", "attn_fwd_kernel"]
    assert names(1, 300, 256) == ["quantize_qkv_kernel", "attn_fwd_kernel"]
    assert names(1, 700, 64, grad=True) == ["quantize_qkv_kernel", "attn_fwd_kernel"]
    # a packed batch: its longest query sequence decides
    cu_q = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    cu_kv = torch.tensor([0, 40, 90, 300], dtype=torch.int32)
    launched.clear()
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(300, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        mxattn.mxfp8_attention(q, k, v, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                               cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, backend="triton")
    assert [name for name, _ in launched] == ["attn_fwd_kernel"]


def test_one_launch_forward_checks_before_any_kernel():
    from mxattn.kernels import triton_attention_fwd as tf
    x = torch.zeros(1, 2, 1, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 40, 64, dtype=torch.bfloat16)
    out, stats = torch.empty_like(x), torch.empty(1, 2, 1, 1)
    args = dict(softmax_scale=0.125, offset=0, left_bound=None, right_bound=None, out=out, stats=stats)
    with pytest.raises(ValueError, match="k and v must be"):
        tf.attention_fwd_quantizing(x, kv, kv[:, :1], **args)
    with pytest.raises(ValueError, match="unit stride along its last axis"):
        tf.attention_fwd_quantizing(x, kv.transpose(2, 3).contiguous().transpose(2, 3), kv, **args)
    with pytest.raises(ValueError, match=r"query rows of one tile per sequence \(64 at D=64\), got D=64 and 65"):
        tf.attention_fwd_quantizing(torch.zeros(1, 2, 65, 64), kv, kv, **args)
    with pytest.raises(ValueError, match="head dims up to 128"):
        tf.attention_fwd_quantizing(torch.zeros(1, 2, 1, 256), torch.zeros(1, 2, 4, 256), torch.zeros(1, 2, 4, 256),
                                    **args)
    with pytest.raises(ValueError, match="sink must be"):
        tf.attention_fwd_quantizing(x, kv, kv, sink=torch.zeros(3), **args)
    # the bf16 path's tile and warps (bit-equal results), fewer pipeline stages
    assert tf.quantizing_fwd_config(1, 64, torch.bfloat16) == (64, 4, 2)
    assert tf.quantizing_fwd_config(100, 96, torch.float32) == (128, 8, 1)
    assert tf.quantizing_fwd_config(65, 64, torch.bfloat16) is None


def test_backward_head_chunks_are_balanced_without_a_gpu(monkeypatch, request):
    """When the bf16 scratch of all heads exceeds the budget, the backward splits the KV heads into the fewest
    chunks that fit, with sizes within one head of each other (7 heads at 3 per chunk: 2 + 2 + 3, not
    3 + 3 + 1, whose last launches would run a fraction of a wave), covering every head once."""
    import mxattn
    from mxattn.kernels import triton_attention_bwd as tb
    launched = _record_launches(monkeypatch, request)
    B, S, H, D = 1, 96, 7, 64
    per_head = tb._pre_scratch_per_kv_head(B, 1, S, S, D)
    monkeypatch.setattr(tb, "SCRATCH_BUDGET_BYTES", 3 * per_head)
    q, k, v = (torch.randn(B, S, H, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")
    launched.clear()
    o.backward(torch.ones_like(o))
    heads = [grid[1] // B for name, grid in launched if name == "dkdv_kernel"]
    assert sorted(heads) == [2, 2, 3]
    assert [name for name, _ in launched] == ["bwd_prep_kernel", "dkdv_kernel", "bwd_prep_kernel",
                                               "dq_kernel"] * 3


def test_triton_availability_reads_the_gpu_once(monkeypatch):
    """The triton backend's availability on a CUDA device is read once per device index (a decode loop chooses a
    backend for every new KV length; the GPU's capability does not change in a process)."""
    pytest.importorskip("triton")
    from mxattn.backends import triton_backend as tb
    reads = []
    monkeypatch.setattr(tb, "_CUDA_AVAILABILITY", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (reads.append(i), (8, 0))[1])
    first = tb.TritonBackend.availability(torch.device("cuda"))
    second = tb.TritonBackend.availability(torch.device("cuda:0"))
    assert first == second and not first[0] and "8.0" in first[1] and reads == [0]


def test_launch_cache_keys_ints_by_tritons_own_specialization():
    """Two int arguments share a launch-cache key entry exactly when Triton's own specializer
    (`native_specialize_impl`, what its dispatcher keys compiled kernels on) puts them in one class: a new
    sequence length reuses the compiled kernel when, and only when, Triton's dispatcher would."""
    pytest.importorskip("triton")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from mxattn.runtime.triton_launch import _args_key
    values = [0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 48, 127, 128, 4095, 4096, 65536 + 8, -1, -16, -17,
              2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1, -2**31 - 16, 2**40 + 3,
              2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16]
    triton_class = {a: native_specialize_impl(BaseBackend, a, False, True, True) for a in values}
    ours = {a: _args_key((a,)) for a in values}
    for a in values:
        for b in values:
            assert (ours[a] == ours[b]) == (triton_class[a] == triton_class[b]), (a, b)
    # bools, floats and tensors keep their own entries
    assert len({_args_key((x,)) for x in (True, False, 1, 0.5)}) == 4


@pytest.mark.parametrize("recipe_fields", [dict(v_operand="bf16"), dict(scale_rounding="floor"),
                                           dict(p_quant="lazy16", ds_quant="bf16"),
                                           dict(p_quant="none", v_operand="bf16", ds_quant="bf16",
                                                scale_rounding="floor")],
                         ids=["v_bf16", "floor", "lazy16_ds_bf16", "all"])
@pytest.mark.parametrize("path", ["bf16_scratch", "fp8"])
def test_recipe_switches_reach_every_launch_without_a_gpu(monkeypatch, request, recipe_fields, path):
    """A recipe variant's host path on CPU tensors (launches recorded, not made), forward and backward through
    the public API: every launch carries the recipe's switches (`runtime.recipe_flags`), the bf16-V recipe
    quantizes Q and K only (no V programs in the fused quantizer's grid) and keeps V in bf16 for the backward
    (`SavedWithBF16V`), whose key-side prep skips V. The numbers are checked on the GPU
    (tests/recipe/test_recipe_triton_gpu.py)."""
    import mxattn
    from mxattn import Recipe
    from mxattn.kernels import triton_bwd_prep as tp
    from mxattn.runtime.recipe_flags import kernel_recipe
    from triton_helpers import force_fp8_data_paths

    launched = _record_launches(monkeypatch, request, keep_kwargs=True)
    if path == "fp8":
        force_fp8_data_paths(monkeypatch)
    recipe = Recipe(**recipe_fields)
    flags = kernel_recipe(recipe)
    q = torch.randn(1, 96, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 96, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    o = mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton", recipe=recipe)
    names = [name for name, _, _ in launched]
    assert names == ["quantize_qkv_kernel", "attn_fwd_kernel"]
    (_, qkv_grid, qkv_kw), (_, _, fwd_kw) = launched
    assert qkv_kw["FLOOR"] == flags.floor
    assert qkv_grid[2] == 4 + 2 + (0 if flags.v_raw else 2)  # (sequence, head) programs of Q, K (and V)
    assert {n: fwd_kw[n] for n in flags.fwd()} == flags.fwd()
    launched.clear()
    o.backward(torch.ones_like(o))
    by_name = {}
    for name, _, kw in launched:
        by_name.setdefault(name, []).append(kw)
    assert {n: by_name["dkdv_kernel"][0][n] for n in flags.bwd()} == flags.bwd()
    dq_switches = {n: v for n, v in flags.bwd().items() if n != "P_BF16"}
    assert {n: by_name["dq_kernel"][0][n] for n in dq_switches} == dq_switches
    if path == "fp8":  # dO quantized by the fused quantizer: its scale rule is the recipe's
        assert by_name["quantize_rowcol_kernel"][0]["FLOOR"] == flags.floor
    else:
        kinds = {kw["KIND"]: kw for kw in by_name["bwd_prep_kernel"]}
        assert kinds[tp.PREP_Q.value]["FLOOR"] == flags.floor
        assert kinds[tp.PREP_KV.value]["WITH_V"] == (not flags.v_raw)
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("recipe_fields", [dict(v_operand="bf16"), dict(p_quant="lazy16", scale_rounding="floor")],
                         ids=["v_bf16", "lazy16_floor"])
def test_compiled_recipe_variant_host_path_without_a_gpu(monkeypatch, request, recipe_fields):
    """torch.compile (aot_eager, fullgraph) of a forward and backward with a recipe variant on the triton backend,
    on CPU tensors with the launches recorded: the custom ops' fake kernels promise what the backend saves (the
    bf16-V recipe's `SavedWithBF16V`: nine tensors, V in bf16) and the same launches run as in eager. The GPU
    compile tests check the numbers of the default recipe (tests/api/test_api_gpu.py)."""
    import mxattn
    from mxattn import Recipe
    torch._dynamo.reset()
    launched = _record_launches(monkeypatch, request)
    recipe = Recipe(**recipe_fields)
    q = torch.randn(1, 96, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 96, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn(1, 96, 4, 64, dtype=torch.bfloat16)

    def forward(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton", recipe=recipe)

    forward(q, k, v).backward(do)
    eager = [name for name, _ in launched]
    launched.clear()
    q.grad = k.grad = v.grad = None
    torch.compile(forward, backend="aot_eager", fullgraph=True)(q, k, v).backward(do)
    assert [name for name, _ in launched] == eager == ["quantize_qkv_kernel", "attn_fwd_kernel", "bwd_prep_kernel",
                                                       "dkdv_kernel", "bwd_prep_kernel", "dq_kernel"]
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    torch._dynamo.reset()


# --------------------------------------------------------------------------- the Gluon forward's dispatch


def _fake_gluon(monkeypatch):
    """The backend's Gluon forward replaced by a recorder behind the real `unsupported_reason` (as on an SM 9.0
    GPU); returns the list of (kwargs, out) of its launches."""
    from types import SimpleNamespace

    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_fwd as gluon
    calls = []
    fake = SimpleNamespace(takes=gluon.takes,
                           attention_fwd_gluon=lambda *args, **kwargs: calls.append(dict(kwargs, args=args)))
    monkeypatch.setattr(backend_module, "_gluon_forward", lambda device: fake)
    return calls


@pytest.mark.parametrize("case, gluon_runs", [
    ("causal_gqa_d64", True), ("no_mask_d128", True), ("sink", True), ("window", True), ("fp16_out", True),
    ("head_dim_96", False), ("padded_varlen", True), ("packed_varlen", True), ("floor_recipe", True),
    ("p_none_recipe", True), ("lazy16_recipe", True), ("bf16_v_recipe", False), ("bf16_scratch_bf16_v_recipe", True),
    ("bf16_scratch_path", True), ("bf16_scratch_packed", True),
    ("bf16_scratch_path_d128", True), ("bf16_scratch_window", True), ("bf16_scratch_head_dim_96", False)])
def test_the_fp8_forward_runs_on_the_gluon_kernel_where_it_takes_the_call(monkeypatch, request, case, gluon_runs):
    """The forward kernel is the Gluon warp-specialised one where it takes the call (every P recipe, either scale
    rule, bf16 V on the bf16-scratch path, dense, padded and packed batches, sinks and windows included, D 64/128,
    bf16 or fp16 O), else the Triton forward (bf16 V on the FP8 path, other head dims):
    on the FP8 data path (large problems) on the FP8 operands, on the bf16-scratch path (the default at these
    sizes) its bf16-K/V variant on the quantizer's bf16 K and V (k_scale None). The numbers are compared on the GPU (tests/triton/test_gluon_fwd_gpu.py)."""
    import mxattn
    from mxattn import Recipe
    from mxattn.runtime.recipe_flags import kernel_recipe
    from triton_helpers import force_fp8_data_paths

    launched = _record_launches(monkeypatch, request, keep_kwargs=True)
    calls = _fake_gluon(monkeypatch)
    bf16_kv = case.startswith("bf16_scratch")
    if not bf16_kv:
        force_fp8_data_paths(monkeypatch)
    d = 128 if case.endswith("d128") else 96 if case.endswith("96") else 64
    dtype = torch.float16 if case == "fp16_out" else torch.bfloat16
    q = torch.randn(2, 160, 4, d, dtype=dtype)
    k, v = (torch.randn(2, 160, 2, d, dtype=dtype) for _ in range(2))
    kwargs = dict(attn_mask_type="no_mask" if case == "no_mask_d128" else "causal", backend="triton")
    packed = case in ("packed_varlen", "bf16_scratch_packed")
    if packed:  # thd: the two sequences of padded_varlen, one after the other
        q, k, v = (torch.cat([t[0], t[1, :100]]) for t in (q, k, v))
        kwargs.update(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=_cu([160, 100]),
                      cu_seqlens_kv=_cu([160, 100]))
    if case == "sink":
        kwargs.update(softmax_type="learnable", softmax_offset=torch.zeros(4))
    if case in ("window", "bf16_scratch_window"):
        kwargs.update(window_size=(64, 0))
    recipe = {"floor_recipe": Recipe(scale_rounding="floor"), "p_none_recipe": Recipe(p_quant="none"),
              "lazy16_recipe": Recipe(p_quant="lazy16"), "bf16_v_recipe": Recipe(v_operand="bf16"),
              "bf16_scratch_bf16_v_recipe": Recipe(v_operand="bf16")}.get(case)
    if recipe is not None:
        kwargs.update(recipe=recipe)
    if case == "padded_varlen":
        kwargs.update(attn_mask_type="padding_causal", cu_seqlens_q=_cu([160, 100]), cu_seqlens_kv=_cu([160, 100]))
    o = mxattn.mxfp8_attention(q, k, v, **kwargs)
    names = [name for name, *_ in launched]
    assert names == (["quantize_qkv_kernel"] if gluon_runs else ["quantize_qkv_kernel", "attn_fwd_kernel"])
    assert len(calls) == int(gluon_runs)
    if gluon_runs:
        (kw,) = calls
        assert kw["out"].data_ptr() == o.data_ptr() and kw["softmax_scale"] == pytest.approx(d ** -0.5)
        assert kw["out"].dtype == dtype and kw["flags"] == kernel_recipe(recipe or Recipe())
        assert (kw.get("seq") is not None) == (case == "padded_varlen" or packed)
        if kw.get("seq") is not None:
            assert kw["seq"].packed == packed and kw["seq"].cu_seqlens_q.tolist() == [0, 160, 260]
        assert kw["right_bound"] == (None if case == "no_mask_d128" else 0) and kw["offset"] == 0
        assert kw["left_bound"] == (65 if "window" in case else None)  # TE's window (64, 0): left_bound 65
        q_data, q_scale, k_data, k_scale, v_arg = kw["args"]
        B, S = (1, 260) if packed else (2, 160)  # a packed batch: the tensors' batch 1, the tokens along S
        assert q_data.dtype == torch.float8_e4m3fn and q_data.shape == (B, 4, S, d)
        if bf16_kv:  # the quantizer's exact bf16 dequantizations of K (row-wise) and V (column-wise)
            assert k_scale is None and k_data.dtype == v_arg.dtype == torch.bfloat16
            assert k_data.shape == v_arg.shape == (B, 2, S, d)
        else:
            assert k_scale is not None and k_data.dtype == torch.float8_e4m3fn and hasattr(v_arg, "scale")
        if case == "sink":
            assert kw["sink"].dtype == torch.float32 and kw["sink"].is_contiguous() and kw["sink"].shape == (4,)
        else:
            assert kw["sink"] is None


@pytest.mark.parametrize("case, dkdv_chunks, dq_chunks", [
    ("causal_gqa_d128", 1, 1), ("no_mask_d128", 1, 1), ("sink_d128", 1, 1), ("many_heads_d128", 2, 2),
    ("d64", 1, 1), ("many_heads_d64", 2, 2), ("window_d128", 1, 1), ("padded_varlen_d128", 1, 1),
    ("packed_varlen_d128", 1, 1), ("packed_dq_refuses_d128", 0, 0), ("packed_short_docs_d128", 0, 0),
    ("floor_recipe_d128", 1, 1), ("all_switches_recipe_d128", 1, 1), ("packed_bf16_v_recipe_d128", 0, 0),
    ("fp8_data_path_d128", 0, 0)])
def test_the_pre_backward_runs_the_gluon_kernels_where_they_take_the_chunk(monkeypatch, request, case,
                                                                          dkdv_chunks, dq_chunks):
    """On the bf16-scratch backward (mode "pre") each chunk of heads runs the Gluon dK/dV kernel where it takes
    it (`gluon_attention_bwd.takes`: every recipe's backward switches (bf16 V not with a packed batch), dense,
    padded or packed, no mask, a causal band or a sliding window,
    head dim 128 or 64 with GQA, as here: 4 query heads on 2 KV heads; a sink lives in the stats) with the chunk's
    views, else the Triton dK/dV kernel; likewise the Gluon dQ kernel
    (`gluon_attention_dq.takes`: the same refusals, head dims 64 and 128) with the chunk's bf16 scratch (bwd_prep's
    Q and dO, kv_prep's K both ways and V), stats and delta slices and dQ head slice, else the Triton dQ kernel;
    the FP8 data path never asks. A packed batch runs both Gluon kernels on the gapped scratch (PACKED_GAP zero rows
    after each sequence) where both take the call and the gaps add at most the batch's own rows, else both Triton
    kernels on the packed scratch (here: the dQ kernel's key minimum raised; three documents in 260 rows). The
    numbers are compared on the GPU (tests/triton/test_gluon_bwd_gpu.py)."""
    from types import SimpleNamespace

    import mxattn
    from mxattn import Recipe
    from mxattn.backends import triton_backend as backend_module
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from mxattn.kernels import triton_attention_bwd as tb
    from mxattn.runtime.recipe_flags import kernel_recipe
    from triton_helpers import force_fp8_data_paths

    launched = _record_launches(monkeypatch, request, keep_kwargs=True)
    calls, dq_calls, preps = [], [], {"bwd": [], "kv": []}
    fake = SimpleNamespace(takes=gb.takes, dkdv_gluon=lambda *args, **kwargs: calls.append((args, kwargs)))
    fake_dq = SimpleNamespace(takes=gd.takes, dq_gluon=lambda *args, **kwargs: dq_calls.append((args, kwargs)))
    monkeypatch.setattr(backend_module, "_gluon_backward", lambda device: fake)
    monkeypatch.setattr(backend_module, "_gluon_dq", lambda device: fake_dq)
    monkeypatch.setattr(backend_module, "_backward_key", lambda roots, params: None)
    monkeypatch.setattr(gd, "MIN_KEYS", {64: 0, 128: 0})  # (160 keys: below the kernel's minimum, tested apart)
    monkeypatch.setattr(gb, "MIN_QUERY_ROWS", {64: 0, 128: 0})
    monkeypatch.setattr(gb, "MHA_MIN_QUERY_ROWS", {64: 0, 128: 0})
    for name, key in (("bwd_prep", "bwd"), ("kv_prep", "kv")):  # each chunk's scratch, to follow it into the calls
        real = getattr(tb, name)
        monkeypatch.setattr(tb, name, lambda *a, real=real, key=key, **k: preps[key].append(real(*a, **k)) or
                            preps[key][-1])
    if case == "fp8_data_path_d128":
        force_fp8_data_paths(monkeypatch)
    d = 64 if case.endswith("d64") else 128
    if case.startswith("many_heads"):  # two chunks of heads (a scratch budget of one KV head's scratch)
        monkeypatch.setattr(tb, "PRE_BUDGET_BYTES", 1)
        monkeypatch.setattr(tb, "SCRATCH_BUDGET_BYTES", tb._pre_scratch_per_kv_head(2, 2, 160, 160, d))
    q = torch.randn(2, 160, 4, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 160, 2, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    kwargs = dict(attn_mask_type="no_mask" if case == "no_mask_d128" else "causal", backend="triton")
    if case == "packed_dq_refuses_d128":
        monkeypatch.setattr(gd, "MIN_KEYS", {64: 0, 128: 10 ** 6})
    packed = case.startswith("packed")
    if packed:  # thd: two sequences of 160 and 100 tokens (short_docs: three, 160, 50 and 50, whose gaps, 3 x 128
        # rows, would outnumber their 260 rows: the packed scratch and the Triton kernels)
        docs = [160, 50, 50] if case == "packed_short_docs_d128" else [160, 100]
        q, k, v = (torch.cat([t[0], t[1, :100]]).detach().requires_grad_(True) for t in (q, k, v))
        kwargs.update(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=_cu(docs),
                      cu_seqlens_kv=_cu(docs))
    if case == "sink_d128":
        kwargs.update(softmax_type="learnable", softmax_offset=torch.zeros(4))
    if case == "window_d128":
        kwargs.update(window_size=(64, 0))
    recipe = {"floor_recipe_d128": Recipe(scale_rounding="floor"),
              "all_switches_recipe_d128": Recipe(p_quant="none", v_operand="bf16", ds_quant="bf16",
                                                 scale_rounding="floor"),
              "packed_bf16_v_recipe_d128": Recipe(v_operand="bf16")}.get(case)
    if recipe is not None:
        kwargs.update(recipe=recipe)
    if case == "padded_varlen_d128":
        kwargs.update(attn_mask_type="padding_causal", cu_seqlens_q=_cu([160, 100]), cu_seqlens_kv=_cu([160, 100]))
    o = mxattn.mxfp8_attention(q, k, v, **kwargs)
    launched.clear()
    o.backward(torch.randn_like(o))
    names = [name for name, *_ in launched]
    chunks = max(1, dkdv_chunks, dq_chunks)
    assert len(calls) == dkdv_chunks and len(dq_calls) == dq_chunks
    assert names.count("dkdv_kernel") == (0 if dkdv_chunks else chunks)
    assert names.count("dq_kernel") == (0 if dq_chunks else chunks)
    per = 2 // chunks  # KV heads per chunk
    # (batch, rows) of the tensors and of the scratch: a packed batch's [1, H, 260, D], gapped scratch 260 + 2 gaps
    bs, rows = (1, 260) if packed else (2, 160)
    scratch_rows = rows + 2 * tb.PACKED_GAP if packed else rows
    if packed:
        assert [p[0].shape[2] for p in preps["bwd"]] == [scratch_rows if dkdv_chunks else rows] * chunks
    for h, (args, kw) in enumerate(calls):
        q_r, q_c, k_row, v_row, do_r, do_c, stats, delta, dk, dv = args
        assert k_row.data.shape == (bs, per, rows, d) and dk.shape == dv.shape == (bs, per, rows, d)
        assert q_r.shape == q_c.shape == do_r.shape == do_c.shape == (bs, 2 * per, scratch_rows, d)
        assert q_r.dtype == torch.bfloat16 and stats.shape == (bs, 2 * per, rows, 1)
        assert delta.shape == (bs, 2 * per, rows)
        first_dk = calls[0][0][8]  # the chunks write head slices of one dK
        assert dk.untyped_storage().data_ptr() == first_dk.untyped_storage().data_ptr()
        assert dk.data_ptr() - first_dk.data_ptr() == h * per * dk.stride(1) * dk.element_size()
        assert kw["checked"] and kw["softmax_scale"] == pytest.approx(d ** -0.5)
        assert kw["right_bound"] == (None if case == "no_mask_d128" else 0) and kw["offset"] == 0
        assert (kw.get("seq") is not None) == (case in ("padded_varlen_d128", "packed_varlen_d128"))
        assert kw["left_bound"] == (65 if case == "window_d128" else None)  # TE's window (64, 0)
        assert kw["flags"] == kernel_recipe(recipe or Recipe())  # the recipe's switches reach the kernel
        if recipe is not None and recipe.v_operand == "bf16":  # V as a bf16 tensor of K's shape
            assert isinstance(v_row, torch.Tensor) and v_row.dtype == torch.bfloat16 and v_row.shape == dk.shape
    if dq_chunks:
        assert len(preps["bwd"]) == len(preps["kv"]) == chunks
    for h, (args, kw) in enumerate(dq_calls):
        q_r, k_r, k_c, v_r, do_r, stats, delta, dq = args
        do_r_h, _, q_r_h, _ = preps["bwd"][h]  # the chunk's bf16 scratch: bwd_prep's Q and dO, kv_prep's K and V
        assert q_r is q_r_h and do_r is do_r_h and (k_r, k_c, v_r) == preps["kv"][h]
        assert q_r.shape == do_r.shape == (bs, 2 * per, scratch_rows, d) and q_r.dtype == torch.bfloat16
        assert dq.shape == (bs, 2 * per, rows, d)
        assert k_r.shape == k_c.shape == v_r.shape == (bs, per, scratch_rows, d) and k_c.dtype == torch.bfloat16
        assert stats.shape == (bs, 2 * per, rows, 1) and delta.shape == (bs, 2 * per, rows)
        if h < len(calls):  # the dK/dV pass's slices of the same chunk
            assert stats is calls[h][0][6] and delta is calls[h][0][7]
        first = dq_calls[0][0]  # the chunks read head slices of one stats / delta and write head slices of one dQ
        for t, t0 in ((stats, first[5]), (delta, first[6]), (dq, first[7])):
            assert t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr()
            assert t.data_ptr() - t0.data_ptr() == h * 2 * per * t.stride(1) * t.element_size()
        assert dq.stride(3) == 1
        assert kw["checked"] and kw["softmax_scale"] == pytest.approx(d ** -0.5)
        assert kw["right_bound"] == (None if case == "no_mask_d128" else 0) and kw["offset"] == 0
        assert (kw.get("seq") is not None) == (case in ("padded_varlen_d128", "packed_varlen_d128"))  # the lengths
        assert kw["left_bound"] == (65 if case == "window_d128" else None)
        assert kw["flags"] == kernel_recipe(recipe or Recipe())


_GLUON_CHOICES = {"_gluon_forward": ("gluon_attention_fwd", "GLUON_FORWARD"),
                  "_gluon_backward": ("gluon_attention_bwd", "GLUON_BACKWARD"),
                  "_gluon_dq": ("gluon_attention_dq", "GLUON_BACKWARD")}


@pytest.mark.parametrize("getter", list(_GLUON_CHOICES), ids=["forward", "dkdv", "dq"])
def test_the_gluon_kernels_are_used_on_sm90_only(monkeypatch, getter):
    """`_gluon_forward` / `_gluon_backward` / `_gluon_dq`: the Gluon module on a CUDA SM 9.0 device (read once per
    device and module), None on other capabilities, on the CPU, and with its switch off (MXATTN_GLUON_FWD=0 /
    MXATTN_GLUON_BWD=0, the latter for both backward kernels), which leaves the other switch's modules alone."""
    import importlib

    from mxattn.backends import triton_backend as backend_module
    module_name, switch = _GLUON_CHOICES[getter]
    module = importlib.import_module(f"mxattn.kernels.{module_name}")
    capability = {0: (9, 0), 1: (10, 0), 2: (8, 9)}
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or capability[i])
    monkeypatch.setattr(backend_module, "_GLUON", {})
    choose = getattr(backend_module, getter)
    assert choose(torch.device("cpu")) is None
    assert choose(torch.device("cuda", 0)) is module
    assert choose(torch.device("cuda", 0)) is module
    assert choose(torch.device("cuda", 1)) is None
    assert choose(torch.device("cuda", 2)) is None
    assert asked == [0, 1, 2]
    others = {g: importlib.import_module(f"mxattn.kernels.{m}") for g, (m, _) in _GLUON_CHOICES.items() if g != getter}
    for other, other_module in others.items():
        assert getattr(backend_module, other)(torch.device("cuda", 0)) is other_module
    assert asked == [0, 1, 2, 0, 0]  # (each module's choice cached apart)
    monkeypatch.setattr(backend_module, switch, False)
    assert choose(torch.device("cuda", 0)) is None
    for other, other_module in others.items():  # the same switch turns both backward kernels off, not the forward
        same_switch = _GLUON_CHOICES[other][1] == switch
        assert getattr(backend_module, other)(torch.device("cuda", 0)) is (None if same_switch else other_module)


def test_gluon_takes_sinks_and_windows_and_refuses_the_rest():
    """`unsupported_reason` takes attention sinks and left bounds (sliding windows), alone or together, with or
    without a right bound, and padded and packed batches (the grid's y limit counted in sequences for a packed
    one), every P recipe with either scale rule and fp16 O, and still refuses bottom_right without seq, bf16 V on
    FP8 K/V, an unknown P recipe, head dims other than 64/128, O neither bf16 nor fp16 and, on FP8 K/V, a V that
    is not SeqMajorColumns; bf16 K/V (k_scale None: the bf16-K/V variant, bf16 V's recipe too)
    are taken as bf16 tensors only."""
    from mxattn.kernels.gluon_attention_fwd import unsupported_reason
    from mxattn.runtime.recipe_flags import KernelRecipe
    from mxattn.kernels.triton_quantize import SeqMajorColumns
    f8 = torch.float8_e4m3fn
    q = torch.zeros(1, 2, 128, 64, dtype=f8)
    ks = torch.zeros(1, 2, 128, 2, dtype=torch.uint8)
    v = SeqMajorColumns(torch.zeros(1, 2, 64, 128, dtype=f8), torch.zeros(1, 2, 4, 64, dtype=torch.uint8))
    k = torch.zeros(1, 2, 128, 64, dtype=f8)
    sink = torch.zeros(2)
    for extra in (dict(sink=sink), dict(left_bound=1), dict(left_bound=300), dict(left_bound=64, sink=sink)):
        assert unsupported_reason(q, ks, v, **extra) is None, extra
        assert unsupported_reason(q, ks, v, k_data=k, **extra) is None, extra
    from mxattn.seqinfo import SeqInfo
    cu = torch.tensor([0, 128], dtype=torch.int32)
    for packed in (False, True):
        assert unsupported_reason(q, ks, v, seq=SeqInfo(cu, cu, 128, 128, packed), bottom_right=True) is None
    many = torch.arange(0, 40001, dtype=torch.int32) // 313  # 40000 sequences (most empty) x 2 heads
    assert "40000 x 2 (sequences x query heads)" in unsupported_reason(q, ks, v, k_data=k,
                                                                        seq=SeqInfo(many, many, 1, 1, True))
    refused = [(dict(bottom_right=True), "variable-length"),
               (dict(flags=KernelRecipe(v_raw=True)), "v_operand='bf16'"),
               (dict(flags=KernelRecipe(p_mode=1, log2_ps=8.0)), "P's recipes"),
               (dict(out=torch.zeros(1, 2, 128, 64, dtype=torch.float32)), "bf16 or fp16 O")]
    for extra, match in refused:
        assert match in unsupported_reason(q, ks, v, left_bound=64, sink=sink, **extra), extra
    # the recipes it takes: P rounded to bf16 (p_quant "none"), the floor scale rule (the quantizer's), fp16 O
    for extra in (dict(flags=KernelRecipe(p_mode=2)), dict(flags=KernelRecipe(floor=True)),
                  dict(flags=KernelRecipe(p_mode=1, log2_ps=4.0)),
                  dict(flags=KernelRecipe(p_mode=2, floor=True)),
                  dict(out=torch.zeros(1, 2, 128, 64, dtype=torch.float16))):
        assert unsupported_reason(q, ks, v, left_bound=64, sink=sink, **extra) is None, extra
    kb, vb = (torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16) for _ in range(2))
    assert unsupported_reason(q, None, vb, k_data=kb, left_bound=64, sink=sink) is None
    assert unsupported_reason(q, None, vb, k_data=kb, flags=KernelRecipe(v_raw=True)) is None
    assert "v must be a bf16 tensor" in unsupported_reason(q, None, v, left_bound=64, sink=sink)
    assert "k_data must be a bf16 tensor" in unsupported_reason(q, None, vb, k_data=k)
    assert "v must be a bf16 tensor" in unsupported_reason(q, None, vb.half(), k_data=kb)
    assert "SeqMajorColumns" in unsupported_reason(q, ks, v.data, left_bound=64, sink=sink)
    q96 = torch.zeros(1, 2, 128, 96, dtype=f8)
    assert "head dims" in unsupported_reason(q96, ks, v, left_bound=64, sink=sink)


def test_gluon_refusals_name_what_tma_cannot_address():
    """`unsupported_reason` with k_data: K or V bytes TMA cannot address (misaligned, strides not multiples of
    16 bytes) and grids past CUDA's y limit are refused with the reason, so the backend takes the Triton forward."""
    from mxattn.kernels.gluon_attention_fwd import unsupported_reason
    from mxattn.kernels.triton_quantize import SeqMajorColumns
    f8 = torch.float8_e4m3fn
    q = torch.zeros(1, 2, 128, 64, dtype=f8)
    ks = torch.zeros(1, 2, 128, 2, dtype=torch.uint8)
    v = SeqMajorColumns(torch.zeros(1, 2, 64, 128, dtype=f8), torch.zeros(1, 2, 4, 64, dtype=torch.uint8))
    k = torch.zeros(1, 2, 128, 64, dtype=f8)
    assert unsupported_reason(q, ks, v, k_data=k) is None
    odd = torch.zeros(1 + 2 * 128 * 64, dtype=f8)[1:].view(1, 2, 128, 64)
    assert "k_data must be 16-byte aligned" in unsupported_reason(q, ks, v, k_data=odd)
    v_odd = SeqMajorColumns(torch.zeros(1, 2, 64, 136, dtype=f8)[..., :128], v.scale)
    assert "v.data must be 16-byte aligned" in unsupported_reason(q, ks, v_odd, k_data=k)
    wide = torch.zeros(1, 65536, 1, 64, dtype=f8).expand(2, 65536, 1, 64)
    assert "y limit 65535" in unsupported_reason(wide, ks, v, k_data=k)
    # bf16 K/V: the strides in bytes (2 per element)
    kb = torch.zeros(1, 2, 128, 64, dtype=torch.bfloat16)
    assert unsupported_reason(q, None, kb, k_data=kb) is None
    kb_odd = torch.zeros(1, 2, 128, 68, dtype=torch.bfloat16)[..., :64]  # rows of 136 bytes
    assert "k_data must be 16-byte aligned" in unsupported_reason(q, None, kb, k_data=kb_odd)
    assert "v must be 16-byte aligned" in unsupported_reason(q, None, kb_odd, k_data=kb)
    assert unsupported_reason(q, None, kb, k_data=torch.zeros(1, 2, 128, 72, dtype=torch.bfloat16)[..., :64]) is None
