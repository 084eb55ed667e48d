"""The triton backend's ops as `torch.library.triton_op`s: what a compiled graph calls for the triton backend.

The generic ops (`mxattn.ops`) are opaque to Inductor: a compiled graph calls them, and each call runs their
Python bodies (argument decoding, the backend, its launch plans), tens of microseconds of host time per call
(`benchmarks/cpu_host_harness.py --ops`), which a compiled training step whose GPU work is short cannot hide.
These three ops take the same arguments (`FwdArgs`, `BwdArgs`: the same schemas) and run the same bodies, but
torch.compile traces the bodies: the backend records its Triton launches in the graph (`torch.library.wrap_triton`,
`mxattn.kernels.triton_launch.traced_launches`) and Inductor issues them from its generated code like its own
kernels, with the allocations planned with the rest of the graph. Called outside a trace (a compile backend
that does not decompose them, such as "aot_eager") they run the backend's ordinary path.

`mxattn.ops` calls them under torch.compile when the backend is triton and every size is static (the bodies pick
kernel configurations from sizes); `MXATTN_TRITON_OPS=0` in the environment keeps the generic ops.
"""

from __future__ import annotations

import inspect
import os
import typing
from typing import List, Tuple

import torch
from torch import Tensor

from .op_args import BwdArgs, FwdArgs

#: whether compiled graphs use these ops (`MXATTN_TRITON_OPS=0` keeps the generic ops, for comparisons)
ENABLED = os.environ.get("MXATTN_TRITON_OPS", "1") != "0"


def _typed(fields: type, returns, body):
    """A function taking `fields`' arguments (a NamedTuple: its annotations give the op's schema, q, k, v and
    dO as Tensor) that calls body(fields(...))."""
    hints = typing.get_type_hints(fields)
    params = []
    for name in fields._fields:
        annotation = Tensor if name in ("q", "k", "v", "do") else hints[name]
        default = fields._field_defaults.get(name, inspect.Parameter.empty)
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                        annotation=annotation))
    signature = inspect.Signature(params, return_annotation=returns)

    def op_body(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(fields(*bound.arguments.values()))

    op_body.__signature__ = signature
    op_body.__annotations__ = {**{p.name: p.annotation for p in params}, "return": returns}
    return op_body


def _fwd(args: FwdArgs) -> List[Tensor]:
    """[o, stats, *saved] of the forward (the backend's own layouts: the same body gives the fake's)."""
    from .ops import _fwd_impl
    return _fwd_impl(args)


def _fwd_no_grad(args: FwdArgs) -> Tensor:
    from .ops import _fwd_impl
    return _fwd_impl(args, needs_backward=False)


def _bwd(args: BwdArgs) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    from .ops import _bwd_impl
    return _bwd_impl(args, promised=False)


attention_fwd = torch.library.triton_op("mxattn::triton_attention_fwd", _typed(FwdArgs, List[Tensor], _fwd),
                                        mutates_args=())
attention_fwd_no_grad = torch.library.triton_op("mxattn::triton_attention_fwd_no_grad",
                                                _typed(FwdArgs, Tensor, _fwd_no_grad), mutates_args=())
attention_bwd = torch.library.triton_op("mxattn::triton_attention_bwd",
                                        _typed(BwdArgs, Tuple[Tensor, Tensor, Tensor, Tensor], _bwd),
                                        mutates_args=())


def applies(args: FwdArgs) -> bool:
    """True when a traced call with these arguments takes these ops: the triton backend, static sizes and no sink
    (a compiled call with a learnable sink gave O from a wrong sink on its second call on the H100: those calls
    keep the generic ops until that is understood)."""
    if not ENABLED or args.backend != "triton" or args.sink is not None:
        return False
    sizes = [*args.q.shape, *args.k.shape, *args.v.shape, *args.q.stride(), *args.k.stride(), *args.v.stride(),
             args.max_seqlen_q, args.max_seqlen_kv]
    return all(type(s) is int for s in sizes)


__all__ = ["attention_fwd", "attention_fwd_no_grad", "attention_bwd", "applies", "ENABLED"]
