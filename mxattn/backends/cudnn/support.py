"""Can cuDNN's MXFP8 attention run here? `cudnn_support(device)` answers with the facts it found. Never raises.

Needs: an importable cuDNN frontend (`pip install nvidia-cudnn-frontend`), a cuDNN backend library >= 9.21.0
other than 9.23.0 and 9.23.1 (pip packages nvidia-cudnn-cu12 / nvidia-cudnn-cu13 >= 9.21, matching the CUDA major
of torch) and a CUDA device of compute capability 10.x (Blackwell: B200, GB200, B300, GB300).
"""

from __future__ import annotations

import importlib.metadata
from typing import Optional, Tuple

import torch

MIN_BACKEND_VERSION = 92100  # cuDNN encodes major*10000 + minor*100 + patch
MIN_BACKEND_TEXT = "9.21.0"
#: cuDNN releases whose MXFP8 attention gives Inf/NaN (fixed in 9.23.2 per cuDNN's release notes; Transformer
#: Engine disables FusedAttention for MXFP8 with these two as well)
BROKEN_BACKEND_VERSIONS = (92300, 92301)
_PIP_HINT = ("pip install 'nvidia-cudnn-cu13>=9.21' (CUDA 13 torch) or 'nvidia-cudnn-cu12>=9.21' (CUDA 12 torch); "
             "the frontend loads the libcudnn.so.9 found first on LD_LIBRARY_PATH, else the pip one")


def version_text(version: int) -> str:
    """92800 -> "9.28.0"."""
    return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"


def loaded_cudnn_library() -> Optional[str]:
    """Path of the libcudnn.so* mapped into this process (Linux /proc/self/maps), or None if none is mapped."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if "libcudnn.so" in line and "/" in line}
    except (OSError, IndexError):
        return None
    main = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith("libcudnn.so"))
    return main[0] if main else (sorted(paths)[0] if paths else None)


def _pip_cudnn_packages() -> str:
    found = []
    for name in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found) if found else "no nvidia-cudnn-cu12/cu13 pip package"


def backend_facts() -> Tuple[Optional[int], str]:
    """(backend version or None, text naming version, library file and pip packages). Never raises."""
    try:
        import cudnn
    except Exception as exc:  # ImportError, or a frontend whose native module fails to load
        return None, (f"the cuDNN frontend is not importable ({type(exc).__name__}: {exc}); "
                      "pip install nvidia-cudnn-frontend")
    try:
        version = int(cudnn.backend_version())
    except Exception as exc:
        return None, (f"cudnn-frontend {getattr(cudnn, '__version__', '?')} is installed but no cuDNN backend library "
                      f"could be loaded ({type(exc).__name__}: {exc}); {_PIP_HINT}")
    library = loaded_cudnn_library() or "an unknown file"
    return version, (f"cuDNN {version_text(version)} loaded from {library} ({_pip_cudnn_packages()}), "
                     f"cudnn-frontend {getattr(cudnn, '__version__', '?')}")


def cudnn_support(device=None) -> Tuple[bool, str]:
    """(ok, reason): whether cuDNN MXFP8 attention can run on `device` (None: the current CUDA device).

    The reason always states what was found (device and SM, cuDNN version and library file) and, when not ok,
    every missing requirement and how to get it. Never raises.
    """
    try:
        problems = []  # the hardware's first: no pip install helps without a Blackwell GPU
        where = _device_facts(device, problems)
        version, backend = backend_facts()
        if version is None:
            problems.append(backend)
        elif version < MIN_BACKEND_VERSION:
            problems.append(f"{backend} is older than {MIN_BACKEND_TEXT}, the first cuDNN with MXFP8 attention; "
                            f"{_PIP_HINT}")
        elif version in BROKEN_BACKEND_VERSIONS:
            problems.append(f"{backend}: cuDNN 9.23.0 and 9.23.1 produce Inf/NaN in MXFP8 attention (fixed in "
                            f"9.23.2); {_PIP_HINT.replace('>=9.21', '>=9.23.2')}")
        if problems:
            named = version is None or version < MIN_BACKEND_VERSION or version in BROKEN_BACKEND_VERSIONS
            return False, "; ".join(problems) + ("" if named else f" (found {backend})")
        return True, f"{where}; {backend}"
    except Exception as exc:  # a fact-finding bug must not take the caller down
        return False, f"cudnn_support failed to inspect this machine: {type(exc).__name__}: {exc}"


def _device_facts(device, problems) -> str:
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            problems.append(f"{device} is not a CUDA device; cuDNN MXFP8 attention needs a Blackwell (SM 10.x) GPU")
            return str(device)
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} built for CUDA {torch.version.cuda}" if torch.version.cuda \
            else f"torch {torch.__version__} is a CPU-only build"
        problems.append(f"no CUDA device is available ({build}); cuDNN MXFP8 attention needs a Blackwell "
                        "(SM 10.x) GPU")
        return "no CUDA device"
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    major, minor = torch.cuda.get_device_capability(index)
    where = f"cuda:{index} {torch.cuda.get_device_name(index)} (SM {major}.{minor})"
    if major != 10:
        problems.append(f"{where} is not a Blackwell datacenter GPU; cuDNN's MXFP8 attention needs SM 10.x "
                        "(B200/GB200/B300/GB300)")
    return where
