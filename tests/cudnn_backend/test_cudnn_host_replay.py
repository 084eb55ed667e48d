"""The cudnn backend's per-signature host caches on the CPU (graphs neither planned nor executed: `captured_packs`):
the fused quantizer's launches replayed by launch plans (`CudnnBackend`'s `quantize_operands`) and the variant
packs built from per-config slot lists send cuDNN what the unoptimised path sends, call after call.

The fused Triton quantizer runs on the CPU through a stand-in for its compiled kernel that does what the kernel
does, at the addresses it is given (tensors on an ordinary launch, integers in a replay): it reads x with its
strides and writes the row-wise and column-wise data, the compact scales and the F8_128x4 scale bytes
(only the real scale bytes: the padding must be the zeros of the allocation, which a replay must zero again),
computed with `mxattn.formats` (to which the kernel is bit-identical). A wrong address, stride or size in a
replay then shows as wrong bytes in a variant-pack slot.
"""

import ctypes

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

pytest.importorskip("cudnn")
pytest.importorskip("triton")

import mxattn  # noqa: E402
from mxattn import checks, op_plans  # noqa: E402
from mxattn.backends.cudnn import backend as cb  # noqa: E402
from mxattn.backends.cudnn.buffers import col_scale_bytes, row_scale_buffer  # noqa: E402
from mxattn.backends.cudnn.config import BwdUid, FwdUid  # noqa: E402
from mxattn.formats import quantize_mxfp8  # noqa: E402
from mxattn.kernels import triton_quantize as tq  # noqa: E402
from mxattn.runtime import launch_plan, plan_cache  # noqa: E402
from cudnn_fixtures import captured_packs  # noqa: E402,F401
from triton_helpers import stub_compiled_launches  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _at(addr, dtype, shape, stride=None) -> torch.Tensor:
    """A CPU tensor over the memory at `addr` (a tensor's data_ptr or an address from a replay)."""
    if isinstance(addr, torch.Tensor):
        addr = addr.data_ptr()
    stride = stride or tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    size = extent * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer((ctypes.c_char * max(size, 1)).from_address(addr), dtype=torch.uint8)[:size]
    return raw.view(dtype).as_strided(shape, stride)


def _write_real_bytes(dst: torch.Tensor, src: torch.Tensor, real: torch.Tensor) -> None:
    """dst[real] = src[real] (uint8 views): the kernel writes the scale bytes of real blocks only."""
    dst.view(torch.uint8)[real] = src.view(torch.uint8)[real]


class _QuantizeKernel:
    """Stands in for the compiled `_quantize_rowcol_kernel`, the one kernel of this path (bf16 x, row + col + swizzle, as the cudnn backend
    launches it): run() quantizes x at the given addresses (module docstring)."""

    function = packed_metadata = None

    def __init__(self, log):
        self.log = log

    def run(self, g0, g1, g2, stream, function, metadata, h0, h1, h2, *a):
        self.log.append(g0)
        with _disable_current_modes():  # a kernel's work is no aten operation for a recording to see
            self._quantize(g2, *a)

    @staticmethod
    def _quantize(g2, *a):
        h, s, d, nr, nc = a[20:25]
        b = g2 // h
        x = _at(a[0], torch.bfloat16, (b, h, s, d), a[1:5]).clone()
        varlen = a[38]
        if varlen:
            lengths = _at(a[19], torch.int32, (b + 1,)).diff()
            x = x.masked_fill(~(torch.arange(s)[None, :] < lengths[:, None])[:, None, :, None], 0)
        row, col = quantize_mxfp8(x, axis=-1), quantize_mxfp8(x, axis=-2)
        _at(a[5], E4M3, (b, h, s, d), a[6:10]).copy_(row.data)
        _at(a[10], torch.uint8, (b, h, s, nr)).copy_(row.scale.view(torch.uint8))
        _at(a[11], E4M3, (b, h, s, d), a[12:16]).copy_(col.data)
        _at(a[16], torch.uint8, (b, h, nc, d)).copy_(col.scale.view(torch.uint8))
        ones_row, ones_col = torch.ones_like(row.scale.view(torch.uint8)), torch.ones_like(col.scale.view(torch.uint8))
        srz, scz = row_scale_buffer(row.scale), col_scale_bytes(col.scale)
        _write_real_bytes(_at(a[25], torch.uint8, tuple(srz.shape)), srz, row_scale_buffer(ones_row) != 0)
        _write_real_bytes(_at(a[26], torch.uint8, tuple(scz.shape)), scz, col_scale_bytes(ones_col).view(torch.uint8) != 0)


@pytest.fixture
def fused_on_cpu(monkeypatch, captured_packs):
    """The cudnn backend quantizes CPU tensors with the fused quantizer (its kernel: `_QuantizeKernel`), launch
    plans on fresh caches. Yields (captured packs, log of the kernel's runs)."""
    log = []
    kernel = _QuantizeKernel(log)
    stub_compiled_launches(monkeypatch, lambda fn: kernel)
    monkeypatch.setattr(tq, "check_bhsd_tensor", lambda x, name, dtypes, device_type=None:
                        checks.check_bhsd_tensor(x, name, dtypes, None))
    monkeypatch.setattr(cb, "_quantizer_for", lambda x: tq.quantize_rowcol)
    monkeypatch.setattr(cb, "_QUANT_PLANS", plan_cache.PlanCache(min_replays=16))
    yield captured_packs, log


def _inputs(kind: str, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s, skv, h, hkv, d = 2, 200, 160, 4, (1 if kind == "gqa" else 2), 64
    q = torch.randn(b, s, h, d, generator=g).bfloat16()
    kv = torch.randn(b, skv, 2, hkv, d, generator=g).bfloat16()
    k, v = kv.unbind(2)                                    # views, as a fused KV projection gives them
    do = torch.randn(b, s, h, d, generator=g).bfloat16()
    kw = dict(qkv_format="bshd", attn_mask_type="causal")
    if kind == "padded":
        kw.update(attn_mask_type="padding_causal_bottom_right", max_seqlen_q=s, max_seqlen_kv=skv,
                  cu_seqlens_q=torch.tensor([0, 150, 350], dtype=torch.int32),
                  cu_seqlens_kv=torch.tensor([0, 100, 260], dtype=torch.int32))
    if kind == "sink":
        kw.update(softmax_type="learnable", softmax_offset=torch.tensor([0.5, -1.0, 0.0, 2.0]))
    return q, k, v, do, kw


def _call(q, k, v, do, kw, packs):
    """(forward pack, backward pack) of one forward+backward through the public API."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    packs.clear()
    mxattn.mxfp8_attention(q, k, v, backend="cudnn", **kw).backward(do)
    assert [kind for kind, _, _ in packs] == ["forward", "backward"]
    return packs[0][2], packs[1][2]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def _inputs_of(pack) -> list:
    """The uids of a pack's slots the host path fills from the inputs (not the outputs)."""
    outputs = {FwdUid.O, FwdUid.STATS, FwdUid.AMAX_O, BwdUid.DQ, BwdUid.DK, BwdUid.DV, BwdUid.AMAX_DQ,
               BwdUid.AMAX_DK, BwdUid.AMAX_DV, BwdUid.DSINK, BwdUid.O, BwdUid.STATS}
    return [uid for uid in pack if uid not in outputs]


def _uid_name(uid: int) -> str:
    return (FwdUid(uid) if uid < BwdUid.Q else BwdUid(uid)).name


def _same_pack(got, want, layouts_may_differ=False) -> None:
    """Slot by slot: shape, dtype, strides (layouts_may_differ: those of the scale slots and the small ones
    alone: the torch-op route's zeroed padded copies are contiguous, the fused route keeps q's layout, and O and
    the gradients follow), and the bytes of every input slot."""
    assert sorted(got) == sorted(want)
    for uid in got:
        a, b = got[uid], want[uid]
        assert (a.shape, a.dtype) == (b.shape, b.dtype), uid
        if not (layouts_may_differ and a.dim() == 4 and a.shape[-1] > 1 and not _uid_name(uid).startswith("SF_")):
            assert a.stride() == b.stride(), uid
    for uid in _inputs_of(got):
        assert torch.equal(_bytes(got[uid]), _bytes(want[uid])), uid


@pytest.mark.parametrize("kind", ["dense", "padded", "gqa", "sink"])
def test_replayed_quantizer_sends_the_unoptimised_bytes(kind, fused_on_cpu, monkeypatch):
    """Calls 1 (plain), 2 (recorded) and 3-4 (replayed) send cuDNN the bytes and slot geometry of the fused
    quantizer without launch plans, and the bytes of the torch-op quantizer; the backward reads the forward's
    scale memory; each replay launches the kernel once per operand (Q, K, V; dO) and carves what the eager path
    keeps for the backward, and dO's copies, from one allocation each. (The ops' bodies not replayed: the
    quantizer's own plans serve the signatures whose bodies are refused, `test_cudnn_op_replay.py`.)"""
    monkeypatch.setitem(op_plans._REPLAYS, "cudnn", False)
    packs, log = fused_on_cpu
    q, k, v, do, kw = _inputs(kind)
    calls = [_call(q, k, v, do, kw, packs) for _ in range(4)]
    plans = [p for p in cb._QUANT_PLANS._plans.values() if isinstance(p, launch_plan.LaunchPlan)]
    assert [p.launch_count for p in plans] == [3, 1]                # Q, K, V in the forward; dO in the backward
    # eager autograd: the forward's saved copies (15 tensors) carved from one allocation, V's column-wise copy
    # (3) allocated one by one; dO's copies (6), used by one graph call, from one allocation
    assert [p.allocations_per_replay for p in plans] == [3 + 1, 1]
    assert len(log) == 4 * 4
    with monkeypatch.context() as m:
        m.setattr(cb._QUANT_PLANS, "run", lambda key, body, roots: body())
        plain = _call(q, k, v, do, kw, packs)
    with monkeypatch.context() as m:
        m.setattr(cb, "_quantizer_for", lambda x: None)
        torch_ops = _call(q, k, v, do, kw, packs)
    for fwd, bwd in calls:
        _same_pack(fwd, plain[0])
        _same_pack(bwd, plain[1])
        _same_pack(fwd, torch_ops[0], layouts_may_differ=kind == "padded")
        _same_pack(bwd, torch_ops[1], layouts_may_differ=kind == "padded")
        for b_uid, f_uid in ((BwdUid.SF_Q, FwdUid.SF_Q), (BwdUid.SF_K, FwdUid.SF_K)):
            assert bwd[b_uid].data_ptr() == fwd[f_uid].data_ptr(), b_uid
    first, last = calls[0][0], calls[-1][0]
    assert all(first[uid].data_ptr() != last[uid].data_ptr() for uid in (FwdUid.Q, FwdUid.SF_Q, FwdUid.SF_V))


def test_new_signatures_are_checked_and_recorded_on_their_own(fused_on_cpu, monkeypatch):
    """After replays at one signature, a new shape runs the quantizer's checks and allocations again (and sends
    its own right bytes), a tensor the quantizer refuses gets the unoptimised path's error (the quantizer's own
    plans: the ops' bodies not replayed)."""
    monkeypatch.setitem(op_plans._REPLAYS, "cudnn", False)
    packs, _ = fused_on_cpu
    q, k, v, do, kw = _inputs("dense")
    for _ in range(3):
        _call(q, k, v, do, kw, packs)
    short = [x[:, :96] for x in (q, k, v, do)]
    for _ in range(3):
        fwd, bwd = _call(*short, kw, packs)
    want = quantize_mxfp8(short[0].transpose(1, 2), axis=-1)
    assert torch.equal(_bytes(fwd[FwdUid.Q]), _bytes(want.data))
    assert torch.equal(_bytes(fwd[FwdUid.SF_Q]), _bytes(row_scale_buffer(want.scale)))
    assert sum(isinstance(p, launch_plan.LaunchPlan) for p in cb._QUANT_PLANS._plans.values()) == 4
    bad = torch.randn(1, 4, 64, 64, dtype=torch.float64)
    with pytest.raises(Exception) as plain:
        tq.quantize_rowcol(bad, swizzle=True)
    for _ in range(3):
        with pytest.raises(type(plain.value)) as replayed:
            cb.quantize_operands((bad,), None, ("q",))
        assert str(replayed.value) == str(plain.value)


#: (kind, op bodies replayed) -> (the op plans holding a recorded graph execution, the quantizer's own plans) after
#: four calls: K and V unbound from one fused KV tensor are not dense, so the forward body copies them (torch
#: work: refused) and the quantizer's plan serves it, while the backward body replays; a padded batch's bodies
#: mask with torch (both refused); dense K and V ("dense_kv") let both bodies replay (the backward keyed on its
#: forward's plan, "bwd after"; the dO quantizer's plan recorded on call 2 before the ops' plans took over)
_REPLAYED_PLANS = {("dense", False): ([], 2), ("padded", False): ([], 2), ("gqa", False): ([], 2),
                   ("dense_kv", False): ([], 2), ("dense", True): (["bwd"], 1), ("padded", True): ([], 2),
                   ("gqa", True): (["bwd"], 1), ("dense_kv", True): (["bwd after", "fwd"], 1)}


def _replayed_plans(op_plan_cache, quant_plan_cache):
    """(sorted kinds of the op plans that hold host calls, the count of recorded quantizer plans)."""
    host = sorted(key[0][0] for key, p in op_plan_cache._plans.items()
                  if isinstance(p, launch_plan.LaunchPlan) and p._host_calls)
    return host, sum(isinstance(p, launch_plan.LaunchPlan) for p in quant_plan_cache._plans.values())


def _dense_inputs(kind: str):
    """`_inputs` with K and V made dense tensors of their own (unbound views of a fused KV tensor are copied
    to a layout cuDNN takes: a body that computes, refused by the recorder)."""
    q, k, v, do, kw = _inputs(kind)
    return q, k.contiguous(), v.contiguous(), do, kw


def _kind_inputs(kind: str):
    """`_inputs`, with "dense_kv": the dense batch with K and V of their own (`_dense_inputs`)."""
    return _dense_inputs("dense") if kind == "dense_kv" else _inputs(kind)


@pytest.mark.parametrize("op_replays", [False, True], ids=["quantizer_plans", "op_bodies"])
@pytest.mark.parametrize("kind", ["dense", "padded", "gqa", "dense_kv"])
def test_which_plans_replay_the_cudnn_calls(kind, op_replays, fused_on_cpu, monkeypatch):
    """On the CPU (fused quantizer stubbed): which plans replay four calls of one signature
    (`_REPLAYED_PLANS`, the expectations the GPU test below checks with the real quantizer)."""
    packs, _ = fused_on_cpu
    monkeypatch.setattr(op_plans, "PLANS", plan_cache.PlanCache(max_entries=512, min_replays=16))
    monkeypatch.setitem(op_plans._REPLAYS, "cudnn", op_replays)
    q, k, v, do, kw = _kind_inputs(kind)
    for _ in range(4):
        _call(q, k, v, do, kw, packs)
    assert _replayed_plans(op_plans.PLANS, cb._QUANT_PLANS) == _REPLAYED_PLANS[kind, op_replays]


@pytest.mark.gpu
@pytest.mark.parametrize("op_replays", [False, True], ids=["quantizer_plans", "op_bodies"])
@pytest.mark.parametrize("kind", ["dense", "padded", "gqa", "dense_kv"])
def test_replayed_fused_quantizer_on_the_gpu_sends_the_torch_path_bytes(kind, op_replays, captured_packs,
                                                                        monkeypatch):
    """On a CUDA GPU (any: the graphs are neither planned nor executed), the real fused quantizer: calls 1
    (plain), 2 (recorded) and 3-4 (replayed by launch plans) send cuDNN the bytes of the torch-op quantizer in
    every input slot, and the same slot geometry as the first call. Replayed by the quantizer's own plans (op
    bodies not replayed) or by the ops' plans, where the graph execution is a recorded host call whose pack is
    rebuilt on the call's tensors (`_REPLAYED_PLANS` says which)."""
    if cb._fused_quantizer() is None:
        pytest.skip("Triton cannot be imported here")
    monkeypatch.setattr(cb, "_QUANT_PLANS", plan_cache.PlanCache(min_replays=16))
    monkeypatch.setattr(op_plans, "PLANS", plan_cache.PlanCache(max_entries=512, min_replays=16))
    monkeypatch.setitem(op_plans._REPLAYS, "cudnn", op_replays)
    q, k, v, do, kw = _kind_inputs(kind)
    q, do = q.cuda(), do.cuda()
    if kind == "dense_kv":
        k, v = k.cuda(), v.cuda()
    else:  # K and V unbound from one CUDA tensor, as on the CPU (`.cuda()` of a view would copy it densely)
        k, v = torch.stack((k, v), dim=2).cuda().unbind(2)
    kw = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    calls = [_call(q, k, v, do, kw, captured_packs) for _ in range(4)]
    assert not k.is_contiguous() or kind == "dense_kv"
    assert _replayed_plans(op_plans.PLANS, cb._QUANT_PLANS) == _REPLAYED_PLANS[kind, op_replays]
    monkeypatch.setitem(op_plans._REPLAYS, "cudnn", False)
    with monkeypatch.context() as m:
        m.setattr(cb, "_quantizer_for", lambda x: None)
        torch_ops = _call(q, k, v, do, kw, captured_packs)
    for fwd, bwd in calls:
        _same_pack(fwd, calls[0][0])
        _same_pack(bwd, calls[0][1])
        _same_pack(fwd, torch_ops[0], layouts_may_differ=kind == "padded")
        _same_pack(bwd, torch_ops[1], layouts_may_differ=kind == "padded")


def test_outputs_a_custom_op_returns_are_never_carved(fused_on_cpu):
    """Outside the eager autograd path (the backend called as the custom ops call it) a replay allocates each
    saved copy on its own: a custom op's returns must not share storage."""
    from mxattn.backends.base import AttentionParams
    from mxattn.mask import MaskSpec
    q, k, v = (x.transpose(1, 2) for x in _inputs("dense")[:3])
    params = AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True), needs_backward=True)
    for _ in range(3):
        _, _, saved = cb.CudnnBackend().forward(q, k, v, params)
    [plan] = [p for p in cb._QUANT_PLANS._plans.values() if isinstance(p, launch_plan.LaunchPlan)]
    assert plan.allocations_per_replay == 18
    storages = [t.untyped_storage().data_ptr() for t in saved.tensors()]
    assert len(set(storages)) == len(storages) == 15
