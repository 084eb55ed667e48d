"""Run the paged kernel's decode path (DECODE, `mxattn.kernels.triton_paged_decode`) under Triton's interpreter on
the CPU and compare it with the reference backend: the path's logic (page tables, GQA packing, masks, windows,
sinks, the open V block, split passes and their combine) checked where CI runs, without a GPU. Its arithmetic is
checked on the GPU (tests/kvcache/test_kvcache_gpu.py); here only what it computes.

Run as a script with TRITON_INTERPRET=1 (set before triton decorates the kernels); prints one JSON line per
case: {"case", "max_abs", "within_one_ulp", "equal"}, then one per split case checking the logits workspace of the
split passes (STORE_S, `store_s_check`): {"store_s_case", "bit_equal", "poison_nan"}. Three things stand in for what the interpreter cannot run
or gets wrong (Triton 3.6):
* the kernel's inline-assembly conversions (E4M3 -> F16, P -> E4M3 -> F16) are replaced by the same conversions
  written with `.to` (exact: E4M3 values are F16 numbers);
* the interpreter's float -> E4M3 conversion truncates instead of rounding to nearest even: torch's conversion
  (RNE) replaces it (no value here exceeds 448, where torch would give NaN instead of saturating);
* with numpy 2 its `__index__` of a scalar tensor fails on one-element arrays (a `range` over run-time bounds).
"""

import json
import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

#: (name, head dim, page size, query heads, KV heads, cached tokens per sequence, query tokens per sequence,
#: num_splits (0: the automatic choice on a 132-SM GPU), extra mxfp8_attention_with_kvcache arguments)
CASES = [
    ("gqa_d128_p256_split3", 128, 256, 6, 2, (700, 37, 300), (1, 2, 1), 3, {}),
    ("window_sink_d96_p64_split5", 96, 64, 6, 2, (700, 37, 300, 1000), (1, 1, 3, 1), 5,
     dict(window_size=(200, 0), softmax_type="learnable")),
    ("mqa16_d32_p32_split2_offbyone", 32, 32, 16, 1, (70, 33, 31, 96), (1, 1, 1, 1), 2,
     dict(softmax_type="off-by-one")),
    ("single_pass_d64_p128", 64, 128, 8, 2, (1024, 640, 129), (2, 1, 1), 0, {}),
]


def _patch_interpreter():
    import triton.runtime.interpreter as ti

    patch_tensor = ti._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched_tensor
    convert = ti._convert_float
    widths = {32: np.float32, 16: np.float16}

    def patched_convert(data, src, dst, rounding):
        if dst == tl.float8e4nv and src in (tl.float32, tl.float16):
            x = torch.from_numpy(np.ascontiguousarray(data).view(widths[src.primitive_bitwidth]).astype(np.float32))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        if src == tl.float8e4nv and dst in (tl.float32, tl.float16):
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(torch.float8_e4m3fn).float()
            return x.numpy().astype(widths[dst.primitive_bitwidth])
        return convert(data, src, dst, rounding)

    ti._convert_float = patched_convert


@triton.jit
def _round_p_to_f16(p):
    return p.to(tl.float8e4nv).to(tl.float16)


@triton.jit
def _e4m3_to_f16(x):
    return x.to(tl.float16)


@triton.jit
def _e4m3_pairs_to_f16(w, R: tl.constexpr, C: tl.constexpr):
    lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(lo, hi), (R, C))


def _replace_inline_asm(td):
    td.round_p_to_f16, td.e4m3_to_f16, td.e4m3_pairs_to_f16 = _round_p_to_f16, _e4m3_to_f16, _e4m3_pairs_to_f16


def _inputs(case):
    """A case's cache, slots, queries, cu_seqlens, sink and the reference backend's O."""
    import mxattn
    name, d, page, hq, hkv, lens, qn, splits, kw = case
    g = torch.Generator().manual_seed(sum(lens) + d)
    cache = mxattn.MXFP8KVCache(num_pages=sum(-(-n // page) for n in lens) + 1, page_size=page, kv_heads=hkv,
                                head_dim=d, max_sequences=len(lens))
    slots = [cache.new_sequence() for _ in lens]
    for i, (s, n) in enumerate(zip(slots, lens)):
        cache.append(s, torch.randn(n, hkv, d, generator=g).bfloat16(),
                     (torch.randn(n, hkv, d, generator=g) * (1 + i)).bfloat16())
    q = (torch.randn(sum(qn), hq, d, generator=g) * 2).bfloat16()
    cu = torch.tensor([0] + list(np.cumsum(qn)), dtype=torch.int32)
    kw = dict(kw)
    sink = None
    if kw.get("softmax_type") == "learnable":
        sink = torch.randn(hq, generator=g) * 2
        kw["softmax_offset"] = sink
    elif kw.get("softmax_type") == "off-by-one":
        sink = torch.zeros(hq)
    want = mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu, backend="reference", **kw).float()
    return cache, slots, q, cu, sink, want


def _kernel_out(case, cache, slots, q, cu, sink) -> torch.Tensor:
    """O of `paged_attention_fwd` (interpreted) for a case's inputs."""
    from mxattn.kernels import triton_paged_attention as tp
    name, d, page, hq, hkv, lens, qn, splits, kw = case
    window = kw.get("window_size")
    out = torch.full_like(q, float("nan"))
    tp.paged_attention_fwd(q, cu, max(qn), torch.tensor(slots, dtype=torch.int32), cache,
                           softmax_scale=d ** -0.5, left_bound=None if window is None else window[0] + 1,
                           out=out, sink=sink, num_splits=splits, max_seqlen_kv=max(lens))
    return out


def run_case(case) -> dict:
    """One case: the kernel (interpreted) and the reference backend on the same cache and queries."""
    from mxattn.metrics import bf16_ulps
    name = case[0]
    cache, slots, q, cu, sink, want = _inputs(case)
    got = _kernel_out(case, cache, slots, q, cu, sink).float()
    ulps = bf16_ulps(got, want)
    return dict(case=name, max_abs=(got - want).abs().max().item(), nan=bool(torch.isnan(got).any()),
                within_one_ulp=(ulps <= 1).float().mean().item(), equal=(got == want).float().mean().item())


def store_s_check(case) -> dict:
    """The split passes' logits workspace (STORE_S) on a split case: {"store_s_case", "bit_equal": O equals the
    recomputing split pass's (no workspace: SCORES_MAX_BYTES 0) bit for bit, "poison_nan": with the workspace
    filled with NaN between the two passes every output is NaN (the split pass reads S from it, not from K)}."""
    from mxattn.kernels import triton_paged_attention as tp
    inputs = _inputs(case)[:-1]
    stored = _kernel_out(case, *inputs)
    cap, tp.SCORES_MAX_BYTES = tp.SCORES_MAX_BYTES, 0
    try:
        recomputed = _kernel_out(case, *inputs)
    finally:
        tp.SCORES_MAX_BYTES = cap
    launch, poisoned = tp.launch, []

    def poisoning_launch(kernel, grid, *args, **options):
        launch(kernel, grid, *args, **options)
        if options.get("PASS") == tp.MAX_PASS.value and options.get("STORE_S"):
            args[-2].fill_(float("nan"))  # SW, after the maximum pass wrote it
            poisoned.append(True)
    tp.launch = poisoning_launch
    try:
        nan_out = _kernel_out(case, *inputs)
    finally:
        tp.launch = launch
    return dict(store_s_case=case[0], bit_equal=bool(torch.equal(stored, recomputed)),
                poison_nan=bool(poisoned) and bool(torch.isnan(nan_out).all()))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    _patch_interpreter()
    from mxattn.kernels import triton_paged_attention as tp, triton_paged_decode as td
    from mxattn.runtime import triton_launch
    _replace_inline_asm(td)
    triton_launch.FAST_PATH = False          # Triton's own launcher (the interpreter's)
    tp.sm_count = lambda device: 132         # num_splits=0 decides as on an H100
    for case in CASES:
        print(json.dumps(run_case(case)), flush=True)
    for case in CASES:
        if case[7] > 1:
            print(json.dumps(store_s_check(case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
