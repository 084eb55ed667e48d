"""benchmarks/compiled_step_ablation.py's arms on the CPU: its launch switch skips exactly the replayed launches
while set (and launches them otherwise), and its attention functions without attention (the null op pair and
query + key + value) train a transformers GPT-2 eagerly and compiled, with gradients reaching the projections."""
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from repo_paths import ROOT

pytest.importorskip("transformers")
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("compiled_step_ablation",
                                                  ROOT / "benchmarks" / "compiled_step_ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.register_null()
    module.register_null_op()
    return module


def _entry(calls):
    """A cached launch entry (kernel, tail) whose compiled launcher records its calls."""
    run = SimpleNamespace(launch=lambda *args: calls.append(("direct", args)), global_scratch_size=0,
                          profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)
    kernel = SimpleNamespace(run=run, function=1, packed_metadata=2)
    return kernel, ()


def test_the_switch_skips_replayed_launches_only_while_set(ablation, monkeypatch):
    from mxattn.kernels import triton_launch
    calls = []
    monkeypatch.setattr(triton_launch, "run_compiled", lambda entry, grid, stream, args: calls.append(("run", args)))
    monkeypatch.setattr(ablation, "SKIP", [False])
    monkeypatch.setattr(triton_launch, "direct_launcher", triton_launch.direct_launcher)
    ablation.skip_replayed_launches()
    launch, between = triton_launch.direct_launcher(_entry(calls))
    assert between[0] == 1 and between[5] == 2
    launch(1, 1, 1, 0, "a")
    triton_launch.run_compiled(None, (1,), 0, ["b"])
    ablation.SKIP[0] = True
    launch(1, 1, 1, 0, "c")
    triton_launch.run_compiled(None, (1,), 0, ["d"])
    ablation.SKIP[0] = False
    launch(1, 1, 1, 0, "e")
    assert calls == [("direct", (1, 1, 1, 0, "a")), ("run", ["b"]), ("direct", (1, 1, 1, 0, "e"))]


#: opcheck's checks that do not compare values (the null ops return uninitialised memory)
_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def test_the_null_ops_match_their_fake_kernels(ablation):
    q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
    torch.library.opcheck(torch.ops.mxattn_ablation.fwd, (q, k, v), test_utils=_CHECKS)
    o, block = torch.ops.mxattn_ablation.fwd(q, k, v)
    assert block.numel() == q.numel() * ablation.SAVED_BYTES_PER_ELEMENT and block.dtype == torch.uint8
    torch.library.opcheck(torch.ops.mxattn_ablation.bwd, (torch.randn_like(o), o.detach(), block.detach(),
                                                          k.detach()), test_utils=_CHECKS)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("which", ["NULL", "NULL_OP"])
def test_attention_without_attention_trains_a_gpt2(ablation, which, compiled):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    cfg._attn_implementation = getattr(ablation, which)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    run = torch.compile(model) if compiled else model
    ids = torch.randint(0, 100, (2, 32))
    run(input_ids=ids, labels=ids).loss.backward()
    for block in model.transformer.h:
        assert block.attn.c_attn.weight.grad is not None
