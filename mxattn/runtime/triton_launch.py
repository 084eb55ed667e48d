"""Low-overhead launches of `@triton.jit` kernels.

Triton's dispatcher (`JITFunction.run`) rebuilds the argument binding, the specialization of every argument,
the cache key and the launch metadata in Python on each call: for a kernel with about 50 arguments that is
more host time than the quantizer kernels run on the GPU. Since every Triton launch of
the backend is issued from Python before the attention kernel can start, that host time was the gap between
the forward "including quantization" and the forward kernel alone.

`launch(fn, grid, *args, **kwargs)` behaves like `fn[grid](*args, **kwargs)`. The first call for a given
argument key goes through Triton's dispatcher (compiling if needed); later calls with the same key call the
compiled kernel's launcher directly. The key holds what Triton specializes an int on (== 1, multiple of 16,
its integer type) and the exact value of every bool, the dtype and low address bits of every tensor, the
type of float arguments, every keyword (constexprs and options such as num_warps) and the current device:
everything Triton specializes on is fixed by it, so the compiled kernel reused is the one Triton's
dispatcher would pick, also for new sizes (decode steps, new sequence lengths). Launch hooks (profilers) take
the ordinary path.
"""

import functools
import threading
from typing import Dict, Tuple

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver

from ..constants import ceil_div

#: the direct launcher call below uses Triton 3.6's internal CompiledKernel.run signature (checked on the
#: device with triton 3.6.0); any other Triton takes its ordinary dispatcher
FAST_PATH = triton.__version__.startswith("3.6.")

#: bound on the cached entries of one kernel (distinct shapes/strides); the cache is cleared beyond it
MAX_ENTRIES = 2048

_CACHES: Dict[int, Dict[tuple, Tuple[object, tuple]]] = {}


#: ceil(a / b) of host ints (`triton.cdiv` is a constexpr function in Triton 3.6: several microseconds of argument
#: unwrapping per host call)
cdiv = ceil_div


def pow2_ceil(n: int) -> int:
    """The least power of two >= n (n >= 1), for host ints (as `triton.next_power_of_2`, without its cost)."""
    return 1 << (n - 1).bit_length()


_I32, _I64 = 1 << 31, 1 << 63


def _int_class(a: int):
    """What Triton 3.6 specializes an int argument on (`native_specialize_impl`): 1 is a constant; otherwise
    its type (i32, i64, u64 by range) and whether it is a multiple of 16. Ints of one class share a compiled
    kernel (the values are run-time arguments), so a new sequence length reuses the kernel of the last one."""
    if a == 1:
        return "one"
    if -_I64 <= a < _I64:
        return (-_I32 <= a < _I32, not a % 16)
    return ("u64", not a % 16)


def _args_key(args) -> tuple:
    """ints by Triton's specialization class (`_int_class`); tensors as (dtype, low 4 address bits); floats
    as (float,); host TMA descriptors (`_descriptor_key`) by everything they hold but the address; anything else
    (bools) as (type, value), so no two kinds of argument share a key entry."""
    T = torch.Tensor
    return tuple([_int_class(a) if a.__class__ is int else (a.dtype, a.data_ptr() & 15) if isinstance(a, T)
                  else (float,) if a.__class__ is float else _descriptor_key(a) if is_tma_descriptor(a)
                  else (a.__class__, a) for a in args])


def is_tma_descriptor(a) -> bool:
    """Whether launch argument a is a host-side TMA descriptor (Triton's or Gluon's `TensorDescriptor`: a base
    tensor, shape, strides, block shape, padding)."""
    return hasattr(a, "block_shape") and hasattr(a, "base")


def _descriptor_key(d) -> tuple:
    """A host-side TMA descriptor (Gluon's `TensorDescriptor`: base tensor, shape, strides, block shape, shared
    layout, padding) keyed by all it holds except its base address: the base's dtype and low 4 address bits and
    the exact shape and strides (finer than any specialization Triton makes of them). The launcher encodes the
    descriptor (CUtensorMap) from the object on every launch, so a cached kernel launched with a new descriptor
    reads the new tensor."""
    return (d.__class__, d.base.dtype, d.base.data_ptr() & 15, tuple(d.shape), tuple(d.strides),
            tuple(d.block_shape), d.layout, d.padding)


def _hooked(hook) -> bool:
    """True when a launch hook is installed (a non-empty HookChain, or any other callable)."""
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (read once per device: a property query per call costs host time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch(fn, grid, *args, **kwargs) -> None:
    """fn[grid](*args, **kwargs) for a triton.jit (or gluon.jit) kernel fn whose constexpr parameters all follow
    its run-time parameters and are passed (with options such as num_warps) as keywords; args are tensors, ints,
    bools, floats and host TMA descriptors. grid: tuple of 1 to 3 ints. While a recording (`mxattn.runtime.launch_plan`) is active on this thread, the launch is
    also reported to it (with the compiled kernel, or None when Triton's own dispatcher ran it)."""
    recording = getattr(_LOCAL, "recording", None)
    rt = knobs.runtime
    if not FAST_PATH or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
        fn[grid](*args, **kwargs)
        if recording is not None:
            recording.on_launch(None, grid, args)
        return
    device = current_device()
    key = (device, _args_key(args),
           tuple([(k, v.__class__, v) for k, v in kwargs.items()]))
    cache = _CACHES.setdefault(id(fn), {})
    hit = cache.get(key)
    if hit is None:
        kernel = first_launch(fn, grid, args, kwargs)
        names = fn.arg_names[len(args):]
        if kernel is not None and all(n in kwargs for n in names):
            if len(cache) >= MAX_ENTRIES:
                cache.clear()
            cache[key] = (kernel, tuple(kwargs[n] for n in names))
        if recording is not None:
            recording.on_launch(cache.get(key), grid, args)
        return
    run_compiled(hit, grid, current_stream(device), args)
    if recording is not None:
        recording.on_launch(hit, grid, args)


def first_launch(fn, grid, args, kwargs):
    """fn[grid](*args, **kwargs) through Triton's dispatcher (compiling on first use) -> the compiled kernel,
    or None when the dispatcher did not return one."""
    kernel = fn[grid](*args, **kwargs)
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    return kernel


def run_compiled(entry, grid, stream, args) -> None:
    """Launch a compiled kernel: entry (kernel, constexpr tail) as `launch` caches it, grid of 1 to 3 ints,
    the CUDA stream handle, the run-time arguments (tensors or their device addresses as ints)."""
    kernel, tail = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)


def direct_launcher(entry):
    """(the C launch function, the arguments it takes between the stream and the kernel's own) for a cached
    entry (kernel, constexpr tail) as `launch` caches it, so that a caller may call Triton 3.6's generated
    launcher without its Python wrapper (`CudaLauncher.__call__`: a closure and two scratch checks per launch);
    None where the wrapper must run (a kernel that needs global or profiler scratch memory, another launcher).
    Its call: launch(gridX, gridY, gridZ, stream, *between, *args, *tail), as `run_compiled` would make it."""
    kernel = entry[0]
    run = kernel.run
    launch_fn = getattr(run, "launch", None)
    if (launch_fn is None or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0):
        return None
    return launch_fn, (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                       kernel.packed_metadata, None, None, None)


def current_device() -> int:
    """torch's current CUDA device index (launches go to its current stream)."""
    return torch.cuda.current_device()


def current_stream(device: int):
    """The handle of torch's current CUDA stream on device index `device` (what Triton launches on)."""
    return driver.active.get_current_stream(device)


def fast_path_usable() -> bool:
    """True when compiled kernels may be launched directly (Triton 3.6, no launch hooks installed)."""
    rt = knobs.runtime
    return FAST_PATH and not _hooked(rt.launch_enter_hook) and not _hooked(rt.launch_exit_hook)


#: per-thread state: the active `LaunchRecording` (mxattn.runtime.launch_plan), if any
_LOCAL = threading.local()


def set_recording(recording) -> None:
    """Make `recording` (an object with on_launch(entry, grid, args), or None) receive this thread's launches."""
    _LOCAL.recording = recording


__all__ = ["launch", "run_compiled", "direct_launcher", "current_stream", "fast_path_usable", "set_recording", "is_tma_descriptor", "cdiv", "pow2_ceil",
           "FAST_PATH", "MAX_ENTRIES"]
