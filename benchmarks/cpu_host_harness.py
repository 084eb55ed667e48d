"""The triton backend's host path timed on a CPU, without a GPU: every Triton launch is stubbed out (counted),
the CUDA device checks are relaxed, and the public API's forward, backward and forward+backward are timed on
small CPU tensors (median wall time per call). The host's Python cost is what it measures, so changes to the
glue around the kernels can be compared on any machine; the GPU machine's host runs the same Python about 3x
slower. --decode: instead, decode-step calls (B8, one query token, H8 D64, bottom-right causal, no grad) at a
KV length no earlier call had (as in generation; one affine launch plan serves them once three lengths were
recorded) against repeated calls at one length (launch plans replay).
--ops: instead, the library ops as a compiled graph calls them (`torch.ops.mxattn.attention_fwd` / `attention_bwd`
on GPT-2-shaped bshd views of a fused projection, B16 S512 H8 D64, no grad mode) against their bodies called
directly: the dispatcher's share and the bodies'; and the packed ops a compiled graph calls instead
(`attention_fwd_packed` / `attention_bwd_packed`: stats and the saved copies in one block, `mxattn.runtime.saved_block`)
(min over interleaved rounds of medians; --profile adds cProfile of the ops, of the packed ones with --packed).
--hf-decode: instead, transformers' attention function registered by mxattn on decode steps (B8, Hq 16, Hkv 4, D64,
K/V views of a preallocated cache, a new KV length each step, 8 layers' calls per step as in the Llama of
models_bench.py, no mask) against transformers' own
`sdpa_attention_forward` on a one-element problem (B1 H1 D8, two keys: torch SDPA's CPU kernel then costs next to
nothing, so its figure is the function's host path).
--hf-paged: instead, the same decode steps over `MXFP8PagedCache` (each layer's update and attention: the cache's
checks and page bookkeeping, the append and attention launches replayed by `mxattn.runtime.paged_step`) against
transformers' `DynamicCache.update` and `sdpa_attention_forward` on the one-element problem; --profile adds cProfile
(sorted by cumulative time, or by each function's own time with --tottime).
Usage: python benchmarks/cpu_host_harness.py [--profile [--tottime]] [--decode | --ops | --hf-decode | --hf-paged]"""
import os
import statistics
import sys
import time

import torch

import mxattn
from mxattn import checks
from mxattn.backends import triton_backend as backend_module
from mxattn.kernels import triton_quantize as tq
from mxattn.runtime import triton_launch

_real_check = checks.check_bhsd_tensor


def _check_any_device(x, name, dtypes, device_type=None):
    return _real_check(x, name, dtypes, None)


class _FakeLauncher:
    """Stands in for Triton 3.6's launcher of a compiled kernel (`CudaLauncher`): calling it, or its C `launch`
    directly (as replays do, `triton_launch.direct_launcher`), counts the launch under the kernel's name."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, name, counter):
        self.name, self.counter = name, counter

    def __call__(self, *args):
        self.counter[self.name] = self.counter.get(self.name, 0) + 1

    launch = __call__


class _FakeKernel:
    """Stands in for a compiled Triton kernel: its run (a `_FakeLauncher`) counts launches."""

    function = packed_metadata = None

    def __init__(self, name, counter):
        self.run = _FakeLauncher(name, counter)


def install_stubs(counter):
    """Relax the CUDA checks, use one intra-op thread and replace Triton's dispatcher and the compiled kernels'
    launcher by counters (this process only): everything of the host path above the C launcher runs as on the GPU machine,
    the launch plans (mxattn.runtime.launch_plan) included."""
    # one intra-op thread: on tiny CPU tensors torch's thread pool adds only waits (tens of ms per call when
    # other processes share the cores), which no GPU host pays
    torch.set_num_threads(1)
    for module in (checks, backend_module, tq):
        module.check_bhsd_tensor = _check_any_device
    backend_module.TritonBackend.availability = classmethod(lambda cls, device: (True, "stubbed"))
    kernels = {}

    def first_launch(fn, grid, args, kwargs):
        kernel = kernels.setdefault(fn.__name__, _FakeKernel(fn.__name__, counter))
        kernel.run()
        return kernel

    triton_launch.FAST_PATH = True
    triton_launch.first_launch = first_launch
    triton_launch.current_device = lambda: 0
    triton_launch.current_stream = lambda device: 0


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def decode_calls() -> None:
    """Host time of decode-step calls at new KV lengths vs at one repeated length (see the module docstring)."""
    b, h, d, first, n = 8, 8, 64, 512, 200
    kv = torch.randn(b, first + n + 40, h, d, dtype=torch.bfloat16)
    q = torch.randn(b, 1, h, d, dtype=torch.bfloat16)

    def step(length):
        return mxattn.mxfp8_attention(q, kv[:, :length], kv[:, :length], attn_mask_type="causal_bottom_right",
                                      backend="triton")

    with torch.no_grad():
        for length in range(first, first + 20):
            step(length)
        times = []
        for length in range(first + 20, first + 20 + n):
            t0 = time.perf_counter()
            step(length)
            times.append(time.perf_counter() - t0)
        fresh = statistics.median(times) * 1e6
        same = per_call_us(lambda: step(first + 5), n=n)
    print(f"decode call, a new KV length each call  {fresh:7.0f} us")
    print(f"decode call, one repeated KV length     {same:7.0f} us  (launch plans replay)")
    print(f"ratio new / repeated: {fresh / same:.2f}")


def _hf_module(name: str):
    """A stand-in for a transformers attention module whose config names attn_implementation `name`."""
    class Module(torch.nn.Module):
        is_causal = True

        class config:
            _attn_implementation = name

    return Module()


def hf_decode_calls() -> None:
    """The HF attention function's host time per decode call (see the module docstring)."""
    import mxattn.integrations.transformers as mx_hf
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    name = mx_hf.register("mxfp8_harness", backend="triton")
    mxfp8_forward = AttentionInterface._global_mapping[name]

    module = _hf_module(name)

    def median_us(fn, b, hq, hkv, d, lengths, layers=8):
        cache = torch.randn(b, hkv, max(lengths) + 1, d, dtype=torch.bfloat16)
        q = torch.randn(b, hq, 1, d, dtype=torch.bfloat16)
        times = []
        for n in lengths:
            k = v = cache[:, :, :n]
            t0 = time.perf_counter()
            for _ in range(layers):
                fn(module, q, k, v, None, dropout=0.0, scaling=d ** -0.5)
            times.append((time.perf_counter() - t0) / layers)
        return statistics.median(times[20:]) * 1e6

    with torch.no_grad():
        mx = median_us(mxfp8_forward, 8, 16, 4, 64, list(range(500, 700)))
        sdpa = median_us(sdpa_attention_forward, 1, 1, 1, 8, [2] * 200)
    print(f"mxattn's HF attention function, decode B8 Hq16 Hkv4 D64, new KV lengths  {mx:6.0f} us per call")
    print(f"transformers' sdpa_attention_forward, B1 H1 D8 (host path)              {sdpa:6.0f} us")
    print(f"ratio: {mx / sdpa:.2f}")


def hf_paged_calls() -> None:
    """Host time per layer and decode step over `MXFP8PagedCache` (see the module docstring)."""
    import mxattn.integrations.transformers as mx_hf
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.integrations.hf_cache import MXFP8PagedCache
    from mxattn.kernels import triton_paged_attention
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    TritonBackend.availability = classmethod(lambda cls, device: (True, ""))   # (launches are stubbed)
    triton_paged_attention.sm_count = lambda device: 132
    name = mx_hf.register("mxfp8_harness", backend="triton")
    mxfp8_forward = AttentionInterface._global_mapping[name]
    module = _hf_module(name)
    b, hq, hkv, d, layers = 8, 16, 4, 64, 8
    cache = MXFP8PagedCache(max_cache_len=2048)
    prompt = torch.randn(b, hkv, 512, d, dtype=torch.bfloat16)
    q_prompt = torch.randn(b, hq, 512, d, dtype=torch.bfloat16)
    q, kv = torch.randn(b, hq, 1, d, dtype=torch.bfloat16), torch.randn(b, hkv, 1, d, dtype=torch.bfloat16)
    tiny, tiny_q = torch.randn(1, 1, 2, 8, dtype=torch.bfloat16), torch.randn(1, 1, 1, 8, dtype=torch.bfloat16)
    dynamic = DynamicCache()

    def paged_step():
        for layer in range(layers):
            k, v = cache.update(kv, kv, layer)
            mxfp8_forward(module, q, k, v, None, scaling=d ** -0.5)

    def sdpa_step():
        for layer in range(layers):
            dynamic.update(tiny[:, :, :1], tiny[:, :, :1], layer)
            sdpa_attention_forward(module, tiny_q, tiny, tiny, None, scaling=0.3)

    def median_per_layer_us(step, n=60):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) / layers)
        return statistics.median(times[5:]) * 1e6

    with torch.no_grad():
        for layer in range(layers):       # the prefill: each layer's cache made on the CPU, appends "on device"
            k, v = cache.update(prompt, prompt, layer)
            cache.layers[layer].store._append_kernel = True
            mxfp8_forward(module, q_prompt, k, v, None, scaling=d ** -0.5)
        paged = min(median_per_layer_us(paged_step) for _ in range(5))
        sdpa = min(median_per_layer_us(sdpa_step) for _ in range(5))
    print(f"MXFP8PagedCache update + mxattn's attention, decode B{b} Hq{hq} Hkv{hkv} D{d}   {paged:6.0f} us per layer")
    print(f"DynamicCache.update + transformers' sdpa_attention_forward, B1 H1 D8    {sdpa:6.0f} us")
    print(f"ratio: {paged / sdpa:.2f}")
    if "--profile" in sys.argv:
        import cProfile
        with torch.no_grad():
            cProfile.runctx("for _ in range(100): paged_step()", globals(), locals(), sort=("tottime" if "--tottime" in sys.argv else "cumulative"))


def op_calls() -> None:
    """The ops' call cost against their bodies' (see the module docstring)."""
    from mxattn import ops
    from mxattn.mask import MaskSpec
    from mxattn.op_args import FwdArgs
    b, s, h, d = 16, 512, 8, 64
    x = torch.randn(b, s, 3 * h * d, dtype=torch.bfloat16)
    q, k, v = (t.view(b, s, h, d).permute(0, 2, 1, 3) for t in x.split(h * d, dim=2))
    args = FwdArgs.encode(q, k, v, softmax_scale=d ** -0.5, mask=MaskSpec(causal=True), out_dtype=torch.bfloat16,
                          qkv_format="bshd", backend="triton", seq=None, sink=None)
    with torch.no_grad():
        o, stats, *saved = ops.attention_fwd(*args)
        bwd = args.backward_args(torch.randn_like(o), o, stats, saved, list(k.shape), False)
        o, block = ops.attention_fwd_packed(*args)
        bwd_packed = args.packed_backward_args(torch.randn_like(o), o, block, list(k.shape), q.dtype,
                                               False, (None, None), None)
        calls = {"forward op": lambda: ops.attention_fwd(*args), "forward body": lambda: ops._fwd_kernel(*args),
                 "backward op": lambda: ops.attention_bwd(*bwd), "backward body": lambda: ops._bwd_kernel(*bwd),
                 "packed fwd op": lambda: ops.attention_fwd_packed(*args),
                 "packed bwd op": lambda: ops.attention_bwd_packed(*bwd_packed)}
        best = {name: float("inf") for name in calls}
        for _ in range(15):
            for name, fn in calls.items():
                best[name] = min(best[name], per_call_us(fn, n=100))
        for name, us in best.items():
            print(f"{name:14s} {us:7.1f} us")
        if "--profile" in sys.argv:
            import cProfile
            statement = ("for _ in range(500): ops.attention_fwd_packed(*args); ops.attention_bwd_packed(*bwd_packed)"
                         if "--packed" in sys.argv else
                         "for _ in range(500): ops.attention_fwd(*args); ops.attention_bwd(*bwd)")
            cProfile.runctx(statement, globals(), locals(), sort="tottime")


#: glibc's malloc settings the harness runs under: without them, CPU tensors of several MB allocated and freed
#: per call move between mmap and the heap as glibc's dynamic threshold moves, and one tree's backward measured
#: 54-57 us in some processes and 68-77 us in others
STABLE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "4000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000"}


def main():
    if any(os.environ.get(name) != value for name, value in STABLE_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STABLE_MALLOC})  # (once)
    launches = {}
    install_stubs(launches)
    if "--decode" in sys.argv:
        decode_calls()
        return
    if "--ops" in sys.argv:
        op_calls()
        return
    if "--hf-decode" in sys.argv:
        hf_decode_calls()
        return
    if "--hf-paged" in sys.argv:
        hf_paged_calls()
        return
    q, k, v = (torch.randn(1, 128, 2, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def call():
        return mxattn.mxfp8_attention(q, k, v, attn_mask_type="causal", backend="triton")

    with torch.no_grad():
        print(f"forward, no grad   {per_call_us(call):7.0f} us")
    print(f"forward with grad  {per_call_us(call):7.0f} us")
    o = call()
    do = torch.randn_like(o)
    print(f"backward           {per_call_us(lambda: o.backward(do, retain_graph=True)):7.0f} us")
    print(f"forward+backward   {per_call_us(lambda: call().backward(do)):7.0f} us")
    launches.clear()
    call().backward(do)
    print("launches per forward+backward:", launches)
    print("plans:", backend_module._PLANS.last_reason)
    if "--profile" in sys.argv:
        import cProfile
        cProfile.runctx("for _ in range(300): call().backward(do)", globals(), locals(), sort="tottime")


if __name__ == "__main__":
    main()
