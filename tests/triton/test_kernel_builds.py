"""Kernel variants the backends launch compile for Hopper (sm_90) on a machine without a GPU: Triton's compiler
and the ptxas it ships run on the CPU, so CI catches a kernel that would not build before a GPU run does. (What
the kernels compute is checked on the GPU: test_quantizing_fwd_gpu.py, test_kvcache_gpu.py.)"""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")

from triton_compile import PAGED_TYPES, compile_for, compile_paged  # noqa: E402


@pytest.mark.parametrize("dp,window_sink,dtype,heads,pass_", [(64, False, "bf16", 4, 0), (128, True, "fp32", 8, 0),
                                                              (128, True, "bf16", 4, 1), (96, True, "fp16", 2, 2)])
def test_paged_attention_kernel_builds_for_sm90(dp, window_sink, dtype, heads, pass_):
    """The paged kernel's passes (single, split max, split) load the FP8 pages 16 bytes at a time (ld.v4 / 16-byte
    cp.async) where D is a power of two: strides as Triton's launcher specialises them (multiples of 16)."""
    from mxattn.kernels import triton_paged_attention as tp
    bm, warps, stages = tp.paged_config(dp)
    pdp = tp.padded_head_dim(dp)
    types = dict(PAGED_TYPES, Q=f"*{dtype}", VT=f"*{dtype}", O="*fp16" if dtype == "fp16" else "*bf16")
    kernel = compile_paged(tp._paged_attn_kernel, dict(HAS_LB=window_sink, HAS_SINK=window_sink, BM=bm,
                                                       BN=tp.BLOCK_N, DP=pdp, GP=heads, EVEN_D=pdp == dp,
                                                       WHOLE_PAGES=pass_ != 2, PASS=pass_, DECODE=False),
                           num_warps=warps, num_stages=stages, types=types)
    assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024
    ptx = kernel.asm["ptx"]
    if pdp == dp:
        assert "ld.global.v4.b32" in ptx or "cp.async.cg.shared.global [ %r" in ptx
        # byte loads only for scalars and the E8M0 scales (a byte-wise FP8 tile would take 100+ per thread)
        assert ptx.count("ld.global.b8") <= 32
    if pass_ == 1:
        assert "cvt.rn.f16x2.e4m3x2" not in ptx  # the max pass rounds no P (and quantizes no open V block)


@pytest.mark.parametrize("pass_,dp,page", [(0, 128, 256), (1, 128, 256), (2, 128, 256), (2, 64, 64), (2, 96, 32)])
def test_paged_decode_path_builds_for_sm90(pass_, dp, page):
    """The paged kernel's decode path on the 16-row tile (FAST_TILE): the FP8 bytes go to the f16 tensor cores (mma.sync
    m16n8k16 on f16, E4M3 pairs converted with cvt.rn.f16x2.e4m3x2); the max pass reads K only; the sealed V
    blocks are read two bytes at a time and converted before their transposition, so byte-wise shared-memory
    loads appear at most in the run that reaches the open V block (128 per thread there)."""
    import re
    from mxattn.kernels import triton_paged_attention as tp
    bm, warps, stages = tp.paged_config(dp, exact=False, rows=4)
    assert (bm, warps, stages) == tp.FAST_TILE
    pdp = tp.padded_head_dim(dp)
    kernel = compile_paged(tp._paged_attn_kernel,
                           dict(HAS_LB=dp == 64, HAS_SINK=True, BM=bm, BN=tp.BLOCK_N, DP=pdp, GP=4, EVEN_D=pdp == dp,
                                WHOLE_PAGES=page % tp.BLOCK_N == 0, PASS=pass_, DECODE=True),
                           num_warps=warps, num_stages=stages)
    ptx = kernel.asm["ptx"]
    assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    byte_loads = len(re.findall(r"ld\.shared(\.[a-z0-9]+)*\.(u8|b8|s8)\b", ptx))
    if pass_ == 1:
        assert byte_loads == 0  # K only (no V, no open block)
    elif pdp == dp:
        assert byte_loads <= 128, byte_loads


def test_split_combine_kernel_builds_for_sm90():
    from mxattn.kernels import triton_paged_attention as tp
    kernel = compile_for(tp._combine_splits_kernel, dict(O="*bf16", MF="*fp32", LP="*fp32", OP="*fp32"),
                         dict(SP=64, DP=128), num_warps=4, num_stages=2)
    assert "cubin" in kernel.asm


def test_one_launch_forward_builds_for_sm90():
    """The forward kernel with Q, K, V quantized on load (QDQ), a padded variable-length batch, GQA, a window."""
    import torch
    from mxattn.kernels import triton_attention_fwd as tf
    bm, warps, stages = tf.quantizing_fwd_config(1, 64, torch.bfloat16)
    types = dict(Q="*bf16", QS="*bf16", K="*bf16", KS="*bf16", V="*bf16", VS="*bf16", O="*bf16", LSE="*fp32",
                 CU_Q="*i32", CU_KV="*i32", SINK="*fp32", qk_scale="fp32")
    kernel = compile_for(tf._attn_fwd_kernel, types,
                         dict(HAS_LB=True, HAS_RB=True, BM=bm, BN=tf.BLOCK_N, DP=64, EVEN_D=True, VARLEN=True,
                              PACKED=False, BOTTOM_RIGHT=True, HAS_SINK=False, KV_BF16=False, QDQ=True),
                         num_warps=warps, num_stages=stages)
    assert "cubin" in kernel.asm


@pytest.mark.parametrize("dtype,dp,tail_pass", [("bf16", 64, False), ("bf16", 128, True), ("fp32", 128, False),
                                                ("fp16", 256, False)])
def test_paged_append_kernel_builds_for_sm90(dtype, dp, tail_pass):
    """The KV cache's append (K quantized row-wise, V sealed column-wise or kept in the tail) for each cache dtype
    and head dim the launcher picks (8 warps above D 128); the tail pass stores no FP8 byte."""
    from mxattn.kernels import triton_paged_append as ta
    types = dict(META="*i32", K=f"*{dtype}", V=f"*{dtype}", PT="*i32", KD="*fp8e4nv", KS="*u8", VD="*fp8e4nv",
                 VS="*u8", VT=f"*{dtype}", SEQ_LENS="*i32")
    kernel = compile_for(ta._paged_append_kernel, types, dict(DP=dp, TAIL_PASS=tail_pass),
                         num_warps=4 if dp <= 128 else 8, num_stages=1)
    assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024
    ptx = kernel.asm["ptx"]
    assert ("cvt.rn.satfinite.e4m3x2.f32" not in ptx) == tail_pass


def test_sass_loops_reports_the_decode_kernels_loop_bodies(capsys):
    """benchmarks/sass_loops.py reads loop bodies off the sm_90 SASS: the decode kernel's maximum pass (K only) costs
    fewer instructions per block than its split pass (K and V), and both report registers and loops."""
    import importlib.util
    import os
    import re
    from repo_paths import ROOT
    spec = importlib.util.spec_from_file_location("sass_loops", os.path.join(ROOT, "benchmarks", "sass_loops.py"))
    sass_loops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_loops)
    per_block = {}
    for pass_ in (1, 2):
        assert sass_loops.main(["--pass", str(pass_), "--head-dim", "64"]) == 0
        out = capsys.readouterr().out
        assert "REG:" in out
        counts = [int(n) for n in re.findall(r"(\d+) instructions per iteration and warp", out)]
        per_block[pass_] = max(counts)
    assert per_block[1] < per_block[2]


@pytest.mark.parametrize("defer", [0, 1])
def test_sass_loops_reports_the_gluon_dkdv_kernels_consumer_loops(capsys, defer):
    """benchmarks/sass_loops.py on the Gluon dK/dV kernel (D128, 32-row query blocks): ptxas keeps its wgmmas
    asynchronous with and without the software-pipelined dK, and each innermost consumer loop (masked, mask-free
    and masked again) issues one streamed block's four GEMMs per iteration, S^T and dP^T (D / 16 k-steps each)
    and dV and dK (32 / 16 each): 20 HGMMA, whichever schedule."""
    import importlib.util
    import os
    import re
    from repo_paths import ROOT
    spec = importlib.util.spec_from_file_location("sass_loops", os.path.join(ROOT, "benchmarks", "sass_loops.py"))
    sass_loops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_loops)
    assert sass_loops.main(["--kernel", "gluon-dkdv", "--head-dim", "128", "--defer", str(defer)]) == 0
    out = capsys.readouterr().out
    assert "wgmma serialised by ptxas: no" in out
    found = [(int(a, 16), int(b, 16), int(g)) for a, b, g in
             re.findall(r"loop 0x([0-9a-f]+)-0x([0-9a-f]+): \d+ instructions.*tensor-core instructions (\d+)", out)]
    innermost = [g for a, b, g in found if not any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2, _ in found)]
    assert len(innermost) == 6  # three loops in each of the two consumer warpgroups' code
    assert set(innermost) == {2 * 128 // 16 + 2 * 32 // 16}


@pytest.mark.parametrize("mode", [0, 4, 5])
def test_sass_loops_shows_where_the_gluon_dkdv_kernel_loads_lse_and_delta(capsys, mode):
    """benchmarks/sass_loops.py --stats-loads on the Gluon dK/dV kernel (D128, its default schedule): with the consumers' global loads (mode 0)
    each innermost consumer loop issues global loads (LDG) of its block's LSE and delta, whose results the step
    waits for; with mode 4 it issues no LDG, only the next block's asynchronous copies into shared memory
    (LDGSTS) and shared-memory loads (LDS) of this block's; with the default (mode 5, STATS_LOADS: the producer
    TMA-loads them with the block's tiles) neither LDG nor LDGSTS, only LDS."""
    import importlib.util
    import os
    import re
    from repo_paths import ROOT
    from mxattn.kernels import gluon_attention_bwd as gb
    assert gb.STATS_LOADS[128] == 5
    spec = importlib.util.spec_from_file_location("sass_loops", os.path.join(ROOT, "benchmarks", "sass_loops.py"))
    sass_loops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_loops)
    assert sass_loops.main(["--kernel", "gluon-dkdv", "--head-dim", "128", "--stats-loads", str(mode),
                            "--top", "200"]) == 0
    out = capsys.readouterr().out
    block_m = gb.schedule(128, mode)[0]  # the wide schedule's 64-row blocks in mode 5, 32-row ones otherwise
    gemms = 2 * 128 // 16 + 2 * block_m // 16  # S^T and dP^T (D / 16 k-steps each), dV and dK (block_m / 16 each)
    loops = [line for line in out.splitlines()
             if re.match(r"loop 0x", line) and f"tensor-core instructions {gemms}" in line]
    assert len(loops) == 6  # the innermost consumer loops (three per consumer warpgroup)
    for line in loops:
        ops = dict((name, int(n)) for name, n in re.findall(r"([A-Z][A-Z0-9_.]*) (\d+)(?:,|;)", line))
        assert ("LDG.E.64" in ops) == (mode == 0), line
        assert ("LDGSTS.E.64" in ops) == (mode == 4), line
        if mode == 5:
            assert not any(name.startswith("LDG") for name in ops), line
        if mode != 0:
            assert any(name.startswith("LDS") for name in ops), line


def test_gluon_bwd_bench_variants_take_launch_keywords():
    """benchmarks/gluon_bwd_bench.py --variant: name:key=value,... -> the Gluon kernel's launch keywords (defer a
    bool, the others ints; a variant's own stages / block_m override the command line's), unknown keys refused
    by argparse's type error, a report's stages / block rows one value or the sorted distinct ones, and --padded's
    per-sequence lengths."""
    import argparse
    import os
    import sys
    from repo_paths import ROOT
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gluon_bwd_bench as bench
    assert bench._variant("cur") == ("cur", {})
    assert bench._variant("w64:defer=0,block_m=64,stages=2") == ("w64", {"defer": False, "block_m": 64, "stages": 2})
    assert bench._variant("s5:stats_loads=5,defer=1") == ("s5", {"stats_loads": 5, "defer": True})
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant key 'bm'"):
        bench._variant("x:bm=64")
    assert bench._distinct([4, 4, 4]) == 4 and bench._distinct([32, 64, 32]) == [32, 64]
    # --padded's lengths: the first sequence full, each next shorter by S / 2B, never empty
    assert bench.padded_lengths(2, 4096) == [4096, 3072]
    assert bench.padded_lengths(4, 1000) == [1000, 875, 750, 625]
    assert bench.padded_lengths(3, 1) == [1, 1, 1]
