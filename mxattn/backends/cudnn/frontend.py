"""The cuDNN frontend's Python module (`nvidia-cudnn-frontend`), checked on import.

On some machines `import cudnn` finds another package of that name (a namespace left by library wheels, an
unrelated project) that lacks the frontend's graph API; the backend's modules would then fail with an
AttributeError deep in their import. Every module of this backend imports `cudnn` from here instead, so such a
machine gets an ImportError that says what was found, which the registry turns into the cudnn backend being
unavailable with that reason (and `backend="auto"` moves on to the next backend).
"""

import cudnn

#: what this package uses of the frontend at import time
_NEEDED = ("pygraph", "data_type", "backend_version")

_missing = [name for name in _NEEDED if not hasattr(cudnn, name)]
if _missing:
    _where = getattr(cudnn, "__file__", None) or list(getattr(cudnn, "__path__", [])) or "an unknown location"
    raise ImportError(f"the module 'cudnn' found at {_where} is not the cuDNN frontend (it has no "
                      f"{', '.join(_missing)}); pip install nvidia-cudnn-frontend")

__all__ = ["cudnn"]
