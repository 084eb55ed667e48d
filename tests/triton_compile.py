"""Compile a @triton.jit kernel for a GPU architecture without a GPU (Triton's own compiler and the ptxas it
ships): CPU tests check that kernel variants build, and what they use (shared memory, registers)."""

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for(fn, types: dict, constexprs: dict, *, num_warps: int, num_stages: int, arch: int = 90,
                divisible=None, **options):
    """fn compiled for sm_<arch>: types maps each run-time parameter to a Triton type string ("*bf16", "i32",
    "fp32", ...; parameters left out are i32), constexprs each constexpr parameter to its value (those left out
    take their declared default); divisible: the
    parameters known divisible by 16 (pointers aligned to 16 bytes, integers multiples of 16), as Triton's
    launcher specialises them at run time (default: every pointer); options: further compile options (maxnreg).
    Returns the compiled kernel (its .asm holds
    ttir .. cubin, its .metadata the shared memory)."""
    names = fn.arg_names
    signature = {}
    for p in fn.params:
        signature[p.name] = "constexpr" if p.is_constexpr else types.get(p.name, "i32")
    defaults = inspect.signature(fn.fn).parameters
    constexprs = dict(constexprs)
    for p in fn.params:  # constexprs left out take their declared defaults (the default recipe's switches)
        if p.is_constexpr and p.name not in constexprs and defaults[p.name].default is not inspect.Parameter.empty:
            constexprs[p.name] = defaults[p.name].default
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"constexprs missing: {missing}")
    if divisible is None:
        divisible = [n for n, t in signature.items() if t.startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(c),): v for c, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


#: the paged attention kernels' pointer arguments and float scalars as Triton's launcher types them (bf16 queries)
PAGED_TYPES = dict(Q="*bf16", O="*bf16", MP="*fp32", MF="*fp32", LP="*fp32", OP="*fp32", CU_Q="*i32",
                   SLOTS="*i32", SEQ_LENS="*i32", SINK="*fp32", PT="*i32", KD="*fp8e4nv", KS="*u8", VD="*fp8e4nv",
                   VS="*u8", VT="*bf16", qk_scale="fp32", SW="*fp32")


def paged_divisible(fn, types: dict) -> list:
    """The parameters of a kernel over an MXFP8KVCache that Triton's launcher sees divisible by 16: every pointer
    (those typed in `types`), D, PAGE and every stride except K's scale row stride (ceil(D / 32) bytes) and the
    page table's."""
    return [p.name for p in fn.params if p.name.startswith("s") and p.name not in ("sks_n", "spt")
            and not p.is_constexpr] + ["D", "PAGE"] + [n for n, t in types.items() if t.startswith("*")]


def compile_paged(fn, constexprs: dict, *, num_warps: int, num_stages: int, types: dict = PAGED_TYPES, **options):
    """The paged attention kernel (triton_paged_attention._paged_attn_kernel; constexprs choose its pass and data
    path) compiled for sm_90 with the divisibility Triton's launcher sees for an MXFP8KVCache
    (`paged_divisible`)."""
    return compile_for(fn, types, constexprs, num_warps=num_warps, num_stages=num_stages,
                       divisible=paged_divisible(fn, types), **options)
