"""DotProductAttention (TE-style arguments, shapes, nn.Module behaviour), torch.compile with fullgraph, and the
saved-activation bound."""

import os

import warnings

import pytest
from repo_paths import ROOT
import torch
from torch import nn

import mxattn
from mxattn.layouts import from_bhsd


def _qkv(fmt, b=2, hq=4, hkv=2, s=64, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)]
    return [from_bhsd(torch.randn(sh, generator=gen), fmt).contiguous().bfloat16() for sh in shapes]


@pytest.mark.parametrize("fmt,expected", [("bshd", (2, 64, 128)), ("sbhd", (64, 2, 128)), ("bhsd", (2, 4, 64, 32))])
def test_module_output_shapes(fmt, expected):
    module = mxattn.DotProductAttention(4, 32, num_gqa_groups=2, qkv_format=fmt, backend="reference")
    assert module(*_qkv(fmt)).shape == expected


def test_module_has_no_state_and_moves():
    module = mxattn.DotProductAttention(4, 32, backend="reference")
    assert list(module.parameters()) == [] and module.state_dict() == {}
    assert module.to(torch.float16) is module and module.to("cpu") is module
    assert "num_attention_heads=4" in repr(module)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(attention_dropout=0.1), NotImplementedError, "attention_dropout"),
    (dict(num_gqa_groups=3), ValueError, "num_gqa_groups"),
    (dict(qkv_format="tbhd"), ValueError, "qkv_format"),
    (dict(attn_mask_type="padding_arbitrary"), ValueError, "attn_mask_type"),
    # TE's check_set_window_size: a causal type takes (-1, 0) or (>=0, 0); (-1, right > 0) is an error there
    (dict(window_size=(-1, 8), attn_mask_type="causal"), ValueError, "window_size"),
    (dict(window_size=(8, -1), attn_mask_type="no_mask"), ValueError, "window_size"),
    (dict(bottom_right_diagonal="yes"), TypeError, "bottom_right_diagonal"),
])
def test_module_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mxattn.DotProductAttention(4, 32, **kwargs)


def test_module_checks_heads_and_channels():
    module = mxattn.DotProductAttention(4, 32, num_gqa_groups=2, backend="reference")
    q, k, v = _qkv("bshd", hq=2, hkv=2)
    with pytest.raises(ValueError, match="query has 2 heads of size 32; this module expects 4"):
        module(q, k, v)


class _TinyBlock(nn.Module):
    def __init__(self, dim=64, heads=2, backend="reference"):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn = mxattn.DotProductAttention(heads, dim // heads, attn_mask_type="causal", backend=backend)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        return self.proj(self.attn(q, k, v))


_DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch import nn
sys.path.insert(0, {tests!r})
from test_module_compile_memory import _TinyBlock
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + {store!r})
model = nn.parallel.DistributedDataParallel(_TinyBlock().bfloat16())
model(torch.randn(2, 32, 64).bfloat16()).float().square().mean().backward()
grad = model.module.qkv.weight.grad
assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
dist.barrier()
del model  # release DDP's reducer while the process group is alive (gloo teardown can deadlock otherwise)
dist.destroy_process_group()
print("ddp ok")
"""


def test_ddp_wraps_a_model_using_the_module(tmp_path):
    # in a child process with a timeout: a gloo teardown problem must fail this test, not hang the suite
    import subprocess
    import sys
    root = str(ROOT)
    script = _DDP_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), store=str(tmp_path / "pg"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.path.join(root, "tests"),
                                                                    os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "ddp ok" in result.stdout, result.stderr[-2000:]


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyBlock().bfloat16()
    x = torch.randn(2, 64, 64).bfloat16()
    eager_out = model(x)
    eager_out.float().sum().backward()
    eager_grad = model.qkv.weight.grad.clone()
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.float().sum().backward()
    assert torch.equal(out, eager_out)
    assert torch.equal(model.qkv.weight.grad, eager_grad)


def test_torch_compile_dynamic_batch_and_sequence_lengths():
    """A compiled call fed new batch sizes and sequence lengths (torch.compile turns the sizes symbolic after the
    second shape) traces without graph breaks and gives the eager results, forward and backward; the backend
    choice is made without the symbolic sizes."""
    torch._dynamo.reset()

    def f(q, k, v):
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference")

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for b, s in ((2, 64), (1, 96), (3, 40)):
        q, k, v = (t.requires_grad_() for t in _qkv("bshd", b=b, s=s, seed=s))
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        expected = f(q, k, v)
        assert torch.equal(out, expected), (b, s)
        for g, e in zip(grads, torch.autograd.grad(expected.float().sum(), (q, k, v))):
            assert torch.equal(g, e), (b, s)


def test_torch_compile_inductor_fullgraph():
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: mxattn.mxfp8_attention(q, k, v, backend="reference") * 2, fullgraph=True)
    q, k, v = _qkv("bshd")
    expected = mxattn.mxfp8_attention(q, k, v, backend="reference") * 2
    assert torch.equal(fn(q, k, v), expected)


def test_library_ops_pass_opcheck():
    from mxattn import ops
    q, k, v = (t.permute(0, 2, 1, 3) for t in _qkv("bshd", s=40))
    args = (q, k, v, 0.125, False, None, 0, torch.bfloat16, "bshd", "reference", None, None, 0, 0, False, None)
    torch.library.opcheck(ops.attention_fwd, args, test_utils=("test_schema", "test_faketensor"))
    # a packed batch of 3 sequences (segmented column-wise scales have T // 32 + 3 rows)
    qp, kp, vp = (t[:1] for t in (q, k, v))
    cu = torch.tensor([0, 7, 7, 40], dtype=torch.int32)
    args = (qp, kp, vp, 0.125, False, None, 0, torch.bfloat16, "bshd", "reference", cu, cu, 33, 33, True,
            torch.zeros(4))
    torch.library.opcheck(ops.attention_fwd, args, test_utils=("test_schema", "test_faketensor"))


class _TransposedColumns:
    """A saved format of a test backend's own: the column-wise FP8 copies kept transposed ([B, H, D, S], as a
    kernel reading them seq-major would want) and one extra tensor, so the flat list differs from the default
    in shapes and in length. Counts its uses."""

    calls = {"from_tensors": 0, "fake_tensors": 0}

    def __init__(self, inner):
        self.inner = inner

    def tensors(self):
        flat = list(self.inner.tensors())
        for i in (2, 6):  # q_col, k_col data
            flat[i] = flat[i].transpose(2, 3).contiguous()
        return tuple(flat) + (torch.full((1,), 7.0, device=flat[0].device),)

    @classmethod
    def from_tensors(cls, flat, seq=None):
        from mxattn.backends.base import SavedForBackward
        cls.calls["from_tensors"] += 1
        flat = list(flat)
        assert len(flat) == 11 and flat.pop().item() == 7.0
        for i in (2, 6):
            flat[i] = flat[i].transpose(2, 3)
        return cls(SavedForBackward.from_tensors(flat, seq))

    @classmethod
    def fake_tensors(cls, q, k, v, seq=None):
        from mxattn.backends.base import SavedForBackward
        cls.calls["fake_tensors"] += 1
        flat = list(SavedForBackward.fake_tensors(q, k, v, seq))
        for i in (2, 6):
            flat[i] = flat[i].transpose(2, 3).contiguous()
        return tuple(flat) + (q.new_empty((1,), dtype=torch.float32),)


def test_a_backend_defines_what_it_saves(monkeypatch):
    """AttentionBackend.saved_format: a backend's own saved layout travels through autograd, the custom ops'
    schemas (opcheck) and torch.compile(fullgraph) unchanged, and gives the default format's numbers."""
    from mxattn import backends, ops
    from mxattn.backends.reference import ReferenceBackend

    class TransposingBackend(ReferenceBackend):
        saved_format = _TransposedColumns

        def forward(self, q, k, v, params):
            o, stats, saved = super().forward(q, k, v, params)
            return o, stats, None if saved is None else _TransposedColumns(saved)

        def backward(self, saved, o, stats, do, params):
            assert isinstance(saved, _TransposedColumns)
            return super().backward(saved.inner, o, stats, do, params)

    q, k, v = (t.requires_grad_(True) for t in _qkv("bshd"))
    fn = lambda q, k, v: mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference")  # noqa: E731
    out = fn(q, k, v)
    expected = (out,) + torch.autograd.grad(out.float().sum(), (q, k, v))
    monkeypatch.setitem(backends._INSTANCES, "reference", TransposingBackend())
    torch._dynamo.reset()
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        out = run(q, k, v)
        got = (out,) + torch.autograd.grad(out.float().sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert _TransposedColumns.calls["from_tensors"] >= 2 and _TransposedColumns.calls["fake_tensors"] >= 1
    qb, kb, vb = (t.detach().permute(0, 2, 1, 3) for t in (q, k, v))
    args = (qb, kb, vb, 0.125, False, None, 0, torch.bfloat16, "bshd", "reference", None, None, 0, 0, False, None)
    torch.library.opcheck(ops.attention_fwd, args, test_utils=("test_schema", "test_faketensor"))
    o, stats, *saved = ops.attention_fwd(*args)
    bwd_args = (torch.ones_like(o), o, stats, saved, list(kb.shape), 0.125, False, None, 0, torch.bfloat16,
                "bshd", "reference", None, None, 0, 0, False, None, False)
    # (test_schema compares the FP8 inputs with arithmetic the CPU lacks for float8: fake tensors only)
    torch.library.opcheck(ops.attention_bwd, bwd_args, test_utils=("test_faketensor",))
    torch._dynamo.reset()


def _saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(total)


# MHA: Q and K in two FP8 orientations + FP8 V + BF16 O is 7/8 of BF16's Q, K, V, O (plus 5/32 byte of scales).
# GQA 4:1 saves relatively more, because the per-query-head tensors (Q twice, O) dominate: bound it at BF16.
@pytest.mark.parametrize("hq,hkv,bound", [(8, 8, 0.90), (8, 2, 1.0)])
def test_saved_activations_bound_against_bf16_sdpa(hq, hkv, bound):
    b, s, d = 1, 256, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, s, d, generator=gen).bfloat16().requires_grad_()
    k = torch.randn(b, hkv, s, d, generator=gen).bfloat16().requires_grad_()
    v = torch.randn(b, hkv, s, d, generator=gen).bfloat16().requires_grad_()
    mx = _saved_bytes(lambda: mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference"))
    # BF16 SDPA saves Q, K, V, O at 2 bytes and its FP32 log-sum-exp [B, H, S]
    bf16 = 2 * (q.numel() + k.numel() + v.numel() + q.numel()) + 4 * b * hq * s
    ratio = mx / bf16
    print(f"saved activations: mxfp8 {mx} B, bf16 sdpa {bf16} B, ratio {ratio:.3f}")
    assert ratio <= bound
    # nothing high-precision but O is kept
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.dtype) or t, lambda t: t):
        mxattn.mxfp8_attention(q, k, v, qkv_format="bhsd", backend="reference")
    assert kept.count(torch.bfloat16) == 1


def _readme_block_source() -> str:
    """The README's `Block` example, as written (the python block that defines it)."""
    import re
    root = str(ROOT)
    with open(os.path.join(root, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    return next(b for b in blocks if "class Block" in b)


def test_readme_block_compiles_fullgraph_with_inductor():
    """The README's compiled Block (K, V from `.unbind(2)`: views with gaps) under inductor's stride checks,
    forward and backward, against the eager Block."""
    torch._dynamo.reset()
    namespace = {}
    exec(compile(_readme_block_source(), "README.md", "exec"), namespace)
    torch.manual_seed(0)
    compiled = namespace["model"]
    eager = compiled._orig_mod
    x = torch.randn(2, 64, 1024, dtype=torch.bfloat16, requires_grad=True)
    from torch._dynamo.utils import warn_once_cache
    warn_once_cache.clear()                 # (Dynamo warns once per process and message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(x)
    assert not [w for w in caught if "lru_cache" in str(w.message)], "Dynamo warned about an lru_cache in mxattn"
    out.float().square().mean().backward()
    grad = x.grad.clone()
    x.grad = None
    expected = eager(x)
    expected.float().square().mean().backward()
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert out.shape == expected.shape == (2, 64, 1024)
    assert rel(out, expected) < 2e-2 and rel(grad, x.grad) < 5e-2


def _op_case(case):
    """(q, k, v, qkv_format, seq args) as `mxfp8_attention` hands them to the forward op, for one layout case."""
    gen = torch.Generator().manual_seed(1)
    b, s, hq, hkv, d = 2, 40, 4, 2, 32
    if case == "unbind_views":          # k, v from unbind(2) of a fused [B, S, 2, H, D] projection
        q = torch.randn(b, s, hq, d, generator=gen).bfloat16().permute(0, 2, 1, 3)
        k, v = (t.permute(0, 2, 1, 3) for t in torch.randn(b, s, 2, hkv, d, generator=gen).bfloat16().unbind(2))
        return q, k, v, "bshd", (None, None, 0, 0, False)
    if case == "transposed_views":      # bshd tensors handed over as q.transpose(1, 2) (HF's layout)
        q, k, v = (torch.randn(b, h, s, d, generator=gen).bfloat16().transpose(1, 2).permute(0, 2, 1, 3)
                   for h in (hq, hkv, hkv))
        return q, k, v, "bshd", (None, None, 0, 0, False)
    if case in ("sbhd", "bhsd"):
        q, k, v = (from_bhsd(torch.randn(b, h, s, d, generator=gen), case).contiguous().bfloat16()
                   for h in (hq, hkv, hkv))
        from mxattn.layouts import to_bhsd
        return (*(to_bhsd(t, case) for t in (q, k, v)), case, (None, None, 0, 0, False))
    cu = torch.tensor([0, 13, 13, 40] if case == "thd" else [0, 13, 40], dtype=torch.int32)
    if case == "thd":                   # [T, H, D] viewed as [1, H, T, D]
        q, k, v = (torch.randn(s, h, d, generator=gen).bfloat16().permute(1, 0, 2).unsqueeze(0)
                   for h in (hq, hkv, hkv))
        return q, k, v, "bshd", (cu, cu, 27, 27, True)
    q, k, v = (torch.randn(b, s, h, d, generator=gen).bfloat16().permute(0, 2, 1, 3) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, 13, 53], dtype=torch.int32)   # padded: lengths 13 and 40
    return q, k, v, "bshd", (cu, cu, 40, 40, False)


CASES = ["unbind_views", "transposed_views", "sbhd", "bhsd", "thd", "padded_gqa"]


@pytest.mark.parametrize("case", CASES)
def test_forward_ops_fake_matches_real_for_every_layout(case):
    """opcheck of the forward ops (schema, fake kernel's shapes and strides) on the layouts and strides the
    eager path accepts."""
    from mxattn import ops
    q, k, v, fmt, seq = _op_case(case)
    args = (q, k, v, 0.125, False, None, 0, torch.bfloat16, fmt, "reference", *seq, None)
    for op in (ops.attention_fwd, ops.attention_fwd_no_grad):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("case", CASES)
def test_packed_ops_keep_what_the_unpacked_ops_keep_in_the_layout_their_fakes_promise(case):
    """The packed ops (`saved_block`: what compiled graphs call): opcheck of the forward (its block as long as its
    fake's), the block's views equal to the unpacked op's stats and saved tensors, the layout the backward
    computes from dO's and K's shapes equal to the forward's, and the packed backward's gradients (and their layouts)
    equal to the unpacked backward's, for every layout the eager path accepts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxattn import ops
    from mxattn.runtime import saved_block
    from mxattn.op_args import FwdArgs
    q, k, v, fmt, seq = _op_case(case)
    args = FwdArgs(q, k, v, 0.125, False, None, 0, torch.bfloat16, fmt, "reference", *seq, None)
    torch.library.opcheck(ops.attention_fwd_packed, tuple(args), test_utils=("test_schema", "test_faketensor"))
    o, stats, *saved = ops.attention_fwd(*args)
    po, block = ops.attention_fwd_packed(*args)
    layout_id, layout = ops._block_layout(args)
    kept = saved_block.unpack(block, layout)
    assert torch.equal(po, o) and block.dtype == torch.uint8 and block.shape == (layout.nbytes,)
    for got, want in zip(kept, [stats, *saved], strict=True):
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    assert saved_block.layout_for(ops._saved_format("reference", args.recipe),
                                  *saved_block.shapes(o.shape, k.shape, o.shape[3]), q.dtype, fmt,
                                  args.seq()) == (layout_id, layout)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = ops.attention_bwd(*args.backward_args(do, o, stats, saved, list(k.shape), False))
    packed_args = args.packed_backward_args(do, po, block, list(k.shape), q.dtype, False, seq[:2], None)
    got = ops.attention_bwd_packed(*packed_args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ops.attention_bwd_packed(*packed_args._replace(do=mode.from_tensor(do)))
    for g, w, f in zip(got, want, fake):
        assert torch.equal(g, w) and (g.shape, g.stride()) == (f.shape, f.stride()) == (w.shape, w.stride())


@pytest.mark.parametrize("case", CASES)
def test_backward_op_returns_the_layouts_its_fake_promises(case):
    """The backward op's dQ, dK, dV are dense in qkv_format order, as its fake kernel says, whatever strides dO
    arrives in (a compiled graph may hand it over otherwise than traced), and equal the eager gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxattn import ops
    from mxattn.layouts import dense_strides_bhsd
    from mxattn.op_args import FwdArgs
    q, k, v, fmt, seq = _op_case(case)
    args = FwdArgs(q, k, v, 0.125, False, None, 0, torch.bfloat16, fmt, "reference", *seq, None)
    o, stats, *saved = ops.attention_fwd(*args)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    expected = None
    for grad_o in (do, do.contiguous(), do.transpose(1, 2).contiguous().transpose(1, 2)):
        bwd = args.backward_args(grad_o, o, stats, saved, list(k.shape), False)
        dq, dk, dv, dsink = ops.attention_bwd(*bwd)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = ops.attention_bwd(*bwd._replace(do=mode.from_tensor(grad_o)))
        for got, promised, shape in zip((dq, dk, dv), fake, (q.shape, k.shape, k.shape)):
            assert got.shape == promised.shape == shape
            assert got.stride() == promised.stride() == dense_strides_bhsd(tuple(shape), fmt)
        assert dsink.numel() == fake[3].numel() == 0
        expected = expected or (dq, dk, dv)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), expected))


def test_compiled_call_with_one_tensor_for_k_and_v():
    """k is v (and cu_seqlens_kv is cu_seqlens_q) reach the autograd.Function once each (Dynamo refuses a
    tensor given twice): fullgraph compiles, and the gradient of the shared tensor is dK + dV."""
    torch._dynamo.reset()
    q, kv, _ = _qkv("bshd", hq=4, hkv=4)

    def fn(q, kv):
        return mxattn.mxfp8_attention(q, kv, kv, attn_mask_type="causal", backend="reference")

    results = []
    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaves = [t.detach().clone().requires_grad_() for t in (q, kv)]
        out = run(*leaves)
        out.float().square().sum().backward()
        results.append((out.detach(), leaves[0].grad, leaves[1].grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    k2, v2 = kv.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    mxattn.mxfp8_attention(q, k2, v2, attn_mask_type="causal", backend="reference").float().square().sum().backward()
    assert torch.equal(results[0][2], k2.grad + v2.grad)
    torch._dynamo.reset()


def test_compiled_inference_calls_the_forward_op_that_keeps_nothing(monkeypatch):
    """Under torch.compile without a gradient the graph calls `attention_fwd_no_grad` (the backend skips what
    only a backward needs) and gives the eager numbers."""
    from mxattn import ops
    torch._dynamo.reset()
    q, k, v = _qkv("bshd")
    calls = []
    real = ops._fwd_impl
    monkeypatch.setattr(ops, "_fwd_impl", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    fn = torch.compile(lambda q, k, v: mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference"),
                       fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got = fn(q, k, v)
        assert calls and all(kw == {"needs_backward": False} for kw in calls), calls
        assert torch.equal(got, mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="reference"))
    torch._dynamo.reset()
