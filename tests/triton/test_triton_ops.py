"""The triton backend's `triton_op`s traced on the CPU: AOTAutograd's functional trace (what Inductor compiles) of
a forward and a backward on fake CUDA tensors holds the Triton launches themselves, with no argument that shares a
tensor with a written one (torch's analysis would take both as written and the graph return the unwritten copy),
and the ops' schemas are the generic ops'. Triton's driver is replaced by one that names an sm_90 target (no GPU
here: the kernels are lowered to Triton IR for the analysis, never compiled to a binary or run)."""

import contextlib

import pytest
import torch

triton = pytest.importorskip("triton")

import mxattn  # noqa: E402
from mxattn import ops, triton_ops  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402
from mxattn.op_args import FwdArgs  # noqa: E402
from mxattn.seqinfo import SeqInfo  # noqa: E402


class _Sm90Driver:
    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_active_torch_device(self):
        return torch.device("cuda", 0)


@pytest.fixture
def traceable(monkeypatch):
    """A CPU process in which the triton backend's bodies trace on fake CUDA tensors."""
    from mxattn.backends import triton_backend
    from mxattn.kernels import triton_attention_bwd
    monkeypatch.setattr(triton_backend, "device_guard", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(triton_attention_bwd, "sm_count", lambda device: 132)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Sm90Driver())  # (restored after the test)


def _trace(fn, *inputs):
    """The functional forward graph AOTAutograd gives fn on fake CUDA copies of inputs (no gradients)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses import FakeTensorMode
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    with FakeTensorMode():
        fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") if t is not None else None
                for t in inputs]
        aot_function(fn, fw_compiler=keep)(*fake)
    return graphs[0]


def _launches(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target)]


def _fwd_bwd(mask, seq_lengths=None, sink=False):
    """fn(x, do[, cu][, sink]): the triton ops' forward and backward on q, k, v unbound from x [B, S, 3, H, D]."""
    def fn(x, do, cu=None, sink_t=None):
        q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
        seq = None if cu is None else SeqInfo(cu, cu, x.shape[1], x.shape[1], False)
        args = FwdArgs.encode(q, k, v, softmax_scale=0.125, mask=mask, out_dtype=torch.bfloat16,
                              qkv_format="bshd", backend="triton", seq=seq, sink=sink_t)
        o, stats, *saved = triton_ops.attention_fwd(*args)
        grads = triton_ops.attention_bwd(*args.backward_args(do.transpose(1, 2), o, stats, saved, list(k.shape),
                                                            sink_t is not None))
        return (o, *grads)
    return fn


CASES = {
    "causal": (MaskSpec(diagonal_alignment="top_left", right_bound=0), False, False),
    "window_padded": (MaskSpec(diagonal_alignment="bottom_right", left_bound=32, right_bound=0), True, False),
    "sink": (MaskSpec(), False, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_backward_trace_into_launches(traceable, case):
    mask, padded, sink = CASES[case]
    x = torch.empty(2, 128, 3, 4, 64, dtype=torch.bfloat16)
    do = torch.empty(2, 128, 4, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 228], dtype=torch.int32) if padded else None
    sink_t = torch.empty(4, dtype=torch.float32) if sink else None
    gm = _trace(_fwd_bwd(mask, sink=sink), x, do, cu, sink_t)
    launches = _launches(gm)
    assert len(launches) == 6  # quantize, forward, prep (dO, Q), dK/dV, prep (K, V), dQ
    code = gm.code
    assert "mxattn" not in code  # no op call left: the launches themselves
    for n in launches:
        kwargs = n.kwargs["kwargs"]
        written = set(n.kwargs["tensors_to_clone"])
        by_tensor = {}
        for name, value in kwargs.items():
            if isinstance(value, torch.fx.Node):
                by_tensor.setdefault(value, []).append(name)
        for names_of_one in by_tensor.values():
            assert len(written.intersection(names_of_one)) <= 1, (names_of_one, written)


def test_no_grad_one_launch_forward_traces(traceable):
    def fn(q, k, v):
        args = FwdArgs.encode(q, k, v, softmax_scale=0.125, mask=MaskSpec(diagonal_alignment="bottom_right",
                                                                          right_bound=0),
                              out_dtype=torch.bfloat16, qkv_format="bhsd", backend="triton", seq=None, sink=None)
        return triton_ops.attention_fwd_no_grad(*args)

    q = torch.empty(4, 8, 1, 64, dtype=torch.bfloat16)
    k = torch.empty(4, 2, 300, 64, dtype=torch.bfloat16)
    gm = _trace(fn, q, k, k.clone())
    assert len(_launches(gm)) == 1  # the quantizing forward alone


def test_schemas_equal_the_generic_ops():
    for name in ("attention_fwd", "attention_fwd_no_grad", "attention_bwd"):
        generic = getattr(torch.ops.mxattn, name).default._schema
        traced = getattr(torch.ops.mxattn, f"triton_{name}").default._schema
        assert str(traced).replace(f"triton_{name}", name) == str(generic)


def test_applies_to_the_triton_backend_with_static_sizes(monkeypatch):
    q = torch.empty(1, 2, 8, 64)
    args = FwdArgs.encode(q, q, q, softmax_scale=0.1, mask=MaskSpec(), out_dtype=torch.bfloat16, qkv_format="bshd",
                          backend="triton", seq=None, sink=None)
    assert triton_ops.applies(args)
    assert not triton_ops.applies(args._replace(backend="reference"))
    assert not triton_ops.applies(args._replace(sink=torch.zeros(2)))
    monkeypatch.setattr(triton_ops, "ENABLED", False)
    assert not triton_ops.applies(args)
    monkeypatch.setattr(triton_ops, "ENABLED", True)
    # a symbolic size (dynamic shapes) keeps the generic ops: the bodies choose configurations from sizes
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses import FakeTensorMode
    env = ShapeEnv()
    sym = env.create_unbacked_symint()
    with FakeTensorMode(shape_env=env):
        qs = torch.empty(1, 2, sym, 64)
    assert not triton_ops.applies(args._replace(q=qs, k=qs, v=qs))


def test_compiled_calls_on_cpu_keep_the_reference_ops():
    """A compiled reference-backend call (CPU) still takes the generic ops (the triton ops are for triton)."""
    torch._dynamo.reset()
    q = torch.randn(1, 64, 2, 64).bfloat16()
    fn = torch.compile(lambda q: mxattn.mxfp8_attention(q, q, q, backend="reference"), backend="aot_eager",
                       fullgraph=True)
    assert torch.equal(fn(q), mxattn.mxfp8_attention(q, q, q, backend="reference"))
    assert ops._traced_ops(False)[0] is ops.attention_fwd
