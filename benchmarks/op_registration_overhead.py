"""Dispatch cost of a torch custom op by how it is registered and how wide its schema is (issue 19: a compiled
model pays the custom op's dispatch on every attention call). The op bodies do nothing but return a fresh empty
tensor, so each figure is registration + argument parsing + dispatch, per call on this CPU:

* schema: "wide" is mxattn::attention_fwd's (3 tensors, 13 options: floats, bools, SymInt?, ScalarType, str,
  Tensor?), "narrow" the same three tensors and the options packed into one int[] and one float;
* registration: `torch.library.custom_op` (what mxattn uses: Python wrapper, autograd registered through
  `register_autograd`), and `torch.library.Library` with a C++-dispatched schema (`lib.define` + `lib.impl` per
  dispatch key; autograd through `torch.library.register_autograd` on the same op);
* each figure: the lowest of three medians of 300 calls;
* called as `torch.ops.<ns>.<op>.default(...)` with grad mode on and inputs that do not require grad (inference
  and the compiled graph's calls), and with inputs that do (training's eager calls);
* last rows: the wide ops with torch's `fill_defaults` (called by `register_autograd`'s forward) replaced by a
  version that reads `schema.arguments` once instead of once per argument.

Usage: python benchmarks/op_registration_overhead.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_host_harness as harness  # noqa: E402

WIDE = ("(Tensor q, Tensor k, Tensor v, float softmax_scale, bool bottom_right, SymInt? left_bound, "
        "SymInt? right_bound, ScalarType out_dtype, str qkv_format, str backend, Tensor? cu_seqlens_q, "
        "Tensor? cu_seqlens_kv, SymInt max_seqlen_q, SymInt max_seqlen_kv, bool packed, Tensor? sink, "
        "str recipe) -> Tensor[]")
NARROW = "(Tensor q, Tensor k, Tensor v, SymInt[] options, float softmax_scale) -> Tensor[]"


def per_call_us(fn):
    """The lowest of three medians of 300 calls (this shared host's noise only ever adds time)."""
    return min(harness.per_call_us(fn) for _ in range(3))


def _body(q, *rest):
    return [torch.empty_like(q)]


def _backward(ctx, grads):
    return (grads[0],) + (None,) * (ctx.n - 1)


def _setup(ctx, inputs, output):
    ctx.n = len(inputs)


def library_op(name, schema):
    """An op defined with torch.library.Library from the schema string (kernels registered by the caller)."""
    lib = torch.library.Library(f"regbench_{name}", "FRAGMENT")
    lib.define("op" + schema)
    op = getattr(getattr(torch.ops, f"regbench_{name}"), "op")
    return lib, op


def main():
    wide_args = lambda q, k, v: (q, k, v, 0.125, True, None, None, torch.bfloat16, "bhsd", "triton",  # noqa: E731
                                 None, None, 512, 512, False, None, "fixed256,fp8,fp8,ceil,mxfp8")
    narrow_args = lambda q, k, v: (q, k, v, [1, -1, -1, 15, 0, 0, 512, 512, 0], 0.125)  # noqa: E731
    libs = []
    ops = {}
    # torch.library.custom_op: the Python-level API mxattn's ops use
    from typing import List, Optional

    @torch.library.custom_op("regbench_py::wide", mutates_args=())
    def wide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, bottom_right: bool,
             left_bound: Optional[int], right_bound: Optional[int], out_dtype: torch.dtype, qkv_format: str,
             backend: str, cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_kv: Optional[torch.Tensor],
             max_seqlen_q: int, max_seqlen_kv: int, packed: bool, sink: Optional[torch.Tensor],
             recipe: str) -> List[torch.Tensor]:
        return _body(q)

    @torch.library.custom_op("regbench_py::narrow", mutates_args=())
    def narrow(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: List[int],
               softmax_scale: float) -> List[torch.Tensor]:
        return _body(q)

    for fn in (wide, narrow):
        fn.register_fake(_body)
        fn.register_autograd(_backward, setup_context=_setup)
    ops["custom_op wide"] = (torch.ops.regbench_py.wide.default, wide_args)
    ops["custom_op narrow"] = (torch.ops.regbench_py.narrow.default, narrow_args)
    # torch.library.Library: schema defined directly, kernels per dispatch key
    for name, schema, make in (("wide", WIDE, wide_args), ("narrow", NARROW, narrow_args)):
        lib, op = library_op(name, schema)
        lib.impl("op", _body, "CPU")
        lib.impl("op", _body, "Meta")
        torch.library.register_autograd(f"regbench_{name}::op", _backward, setup_context=_setup, lib=lib)
        libs.append(lib)
        ops[f"Library {name}"] = (op.default, make)

    x = [torch.randn(16, 8, 512, 64, dtype=torch.bfloat16) for _ in range(3)]
    xg = [t.clone().requires_grad_() for t in x]
    print(f"torch {torch.__version__}; per call, lowest of three medians of 300 calls, us")
    print(f"{'registration / schema':24s} {'no grad needed':>15s} {'inputs need grad':>17s} {'torch.no_grad':>14s}")
    for label, (op, make) in ops.items():
        plain = per_call_us(lambda: op(*make(*x)))
        grad = per_call_us(lambda: op(*make(*xg)))
        with torch.no_grad():
            nograd = per_call_us(lambda: op(*make(*xg)))
        print(f"{label:24s} {plain:15.1f} {grad:17.1f} {nograd:14.1f}")
    base = per_call_us(lambda: _body(*wide_args(*x)))
    print(f"{'the body alone':24s} {base:15.1f}")
    # register_autograd's forward calls torch._library.utils.fill_defaults, which reads schema.arguments (a
    # fresh list of Argument objects) once per argument: quadratic in the schema's width. The same op with that
    # read hoisted out of the loop:
    from torch._library import utils

    def fill_defaults_linear(schema, args, kwargs):
        new_args, new_kwargs = [], {}
        for i, info in enumerate(schema.arguments):
            if info.kwarg_only:
                new_kwargs[info.name] = kwargs.get(info.name, info.default_value)
            else:
                new_args.append(args[i] if i < len(args) else info.default_value)
        return tuple(new_args), new_kwargs
    real = utils.fill_defaults
    utils.fill_defaults = fill_defaults_linear
    try:
        for label in ("custom_op wide", "Library wide"):
            op, make = ops[label]
            grad = per_call_us(lambda: op(*make(*xg)))
            print(f"{label + ', linear':24s} {'':15s} {grad:17.1f}   (fill_defaults reading the schema once)")
    finally:
        utils.fill_defaults = real


if __name__ == "__main__":
    main()
