"""Marks for torch.compile that cost nothing at import time.

`torch.compiler.assume_constant_result` imports torch._dynamo (and with it inductor and triton: seconds) the
moment it decorates a function. `constant_result` marks a function the same way without that import, so
`import mxattn` stays near `import torch`; `tests/api/test_import_cost.py` checks the two marks agree.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def constant_result(fn: F) -> F:
    """`torch.compiler.assume_constant_result(fn)`: Dynamo calls fn at trace time and bakes its result into the
    graph. fn must be pure in its (hashable, constant) arguments."""
    fn._dynamo_marked_constant = True
    return fn


__all__ = ["constant_result"]
