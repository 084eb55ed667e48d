"""`import mxattn` loads what it needs and no more: torch.compile's machinery (torch._dynamo, inductor) and triton
load on first use, so importing the package costs little beyond `import torch`."""

import subprocess
import sys

import torch

from mxattn.compile_marks import constant_result


def test_import_leaves_the_compiler_and_triton_unloaded():
    code = ("import sys, mxattn\n"
            "print(','.join(m for m in ('torch._dynamo', 'torch._inductor', 'triton', 'transformers', 'cudnn')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "", f"import mxattn loaded {out.stdout.strip()}"


def test_lazy_public_names_resolve():
    import mxattn
    from mxattn.attention_quantized import mxfp8_attention_quantized, quantize_attention_inputs
    assert mxattn.mxfp8_attention_quantized is mxfp8_attention_quantized
    assert mxattn.quantize_attention_inputs is quantize_attention_inputs
    assert set(mxattn.__all__) <= set(dir(mxattn))


def test_constant_result_marks_a_function_as_torch_compiler_does():
    def ours():
        return 1

    def torchs():
        return 1

    constant_result(ours)
    torch.compiler.assume_constant_result(torchs)
    assert ours.__dict__ == torchs.__dict__ and ours.__dict__


def test_a_constant_result_is_baked_into_a_compiled_graph():
    calls = []

    @constant_result
    def answer(x: int) -> int:
        calls.append(x)
        return x + 1

    @torch.compile(backend="eager", fullgraph=True)
    def f(t):
        return t * answer(2)

    assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))
    assert len(calls) == 1
