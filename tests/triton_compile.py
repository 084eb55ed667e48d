"""Compile a @triton.jit kernel for a GPU architecture without a GPU (Triton's own compiler and the ptxas it
ships): CPU tests check that kernel variants build, and what they use (shared memory, registers)."""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for(fn, types: dict, constexprs: dict, *, num_warps: int, num_stages: int, arch: int = 90,
                divisible=None):
    """fn compiled for sm_<arch>: types maps each run-time parameter to a Triton type string ("*bf16", "i32",
    "fp32", ...; parameters left out are i32), constexprs each constexpr parameter to its value; divisible: the
    parameters known divisible by 16 (pointers aligned to 16 bytes, integers multiples of 16), as Triton's
    launcher specialises them at run time (default: every pointer). Returns the compiled kernel (its .asm holds
    ttir .. cubin, its .metadata the shared memory)."""
    names = fn.arg_names
    signature = {}
    for p in fn.params:
        signature[p.name] = "constexpr" if p.is_constexpr else types.get(p.name, "i32")
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"constexprs missing: {missing}")
    if divisible is None:
        divisible = [n for n, t in signature.items() if t.startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(c),): v for c, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))
