"""Exceptions raised by mxattn."""


class MXFP8NotSupportedError(RuntimeError):
    """The requested MXFP8 attention path cannot run here (hardware, library version or configuration).

    The message always carries the reason, including cuDNN's own where cuDNN refused.
    """
