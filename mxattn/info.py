"""`python -m mxattn info`: versions, the GPU, and which backends can run here, with the reason."""

from __future__ import annotations

import platform

import torch

from .backends import BACKEND_NAMES, availability


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
        return getattr(module, "__version__", "installed")
    except Exception as exc:  # ImportError, or a broken install
        return f"not importable ({type(exc).__name__}: {exc})"


def collect() -> dict:
    """Everything `info` prints, as a dict (also used by the demo and benchmark headers)."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda or "none (CPU build)",
        "torch cuDNN": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none",
        "cudnn frontend": _version("cudnn"),
        "triton": _version("triton"),
    }
    try:
        import cudnn
        info["cuDNN backend (frontend)"] = str(cudnn.backend_version())
    except Exception as exc:
        info["cuDNN backend (frontend)"] = f"unavailable ({type(exc).__name__}: {exc})"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info["GPU"] = f"{torch.cuda.get_device_name()} (SM {major}.{minor})"
        device = torch.device("cuda")
    else:
        info["GPU"] = "none"
        device = torch.device("cpu")
    for name in BACKEND_NAMES:
        ok, reason = availability(name, device)
        info[f"backend {name}"] = ("usable" if ok else "not usable") + f": {reason}"
    return info


def main() -> int:
    info = collect()
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0
