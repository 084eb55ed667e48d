"""Compatibility path: this code now lives in `mxattn.backends.cudnn` (support); names re-exported."""

from .backends.cudnn.support import (MIN_BACKEND_TEXT, MIN_BACKEND_VERSION, backend_facts, cudnn_support,
                                     loaded_cudnn_library, version_text)

__all__ = ["MIN_BACKEND_VERSION", "MIN_BACKEND_TEXT", "version_text", "loaded_cudnn_library", "backend_facts",
           "cudnn_support"]
