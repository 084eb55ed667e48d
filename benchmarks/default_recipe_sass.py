"""The default recipe's kernels as the GPU runs them, fingerprinted without a GPU: every dense-attention Triton
kernel (fused quantizer, forward on each data path, backward prep, dK/dV and dQ kernels) is compiled for sm_90
with the default recipe's constexprs and one configuration per head dim the backend picks, and the sha256 of
its SASS instruction listing (addresses and instructions, no file names) is printed, one line per kernel.

Run it with --check after a change to the kernels: it compares every line with the reference list of the
committed tree, benchmarks/results/cpu/default_recipe_sass/<set>.txt (one file per kernel set: dense, paged,
gluon), and exits 1 naming each kernel whose fingerprint or shared memory differs. Equal fingerprints mean the
default recipe's machine code, hence its speed, did not change (recipe variants are constexpr specialisations that
must not touch it). A change that is meant to alter a kernel's machine code writes the new list with --update
(and is then measured on a GPU). Moving kernel code into a new `@triton.jit` helper can change the SASS although
the PTX instructions stay the same: the helper's inlined debug scope adds `$L__tmp` labels at its boundaries, and
ptxas schedules around labels, so one kernel of a set can change while the others keep their fingerprints; check
every kernel.

--kernels gluon fingerprints the Gluon Hopper forward (`gluon_attention_fwd.compile_sm90`, sm_90a) at head dims
128 and 64, no mask and causal, then its sink and sliding-window variants (`GLUON_VARIANTS`), then the Gluon
dK/dV kernel of the "pre" backward (`gluon_attention_bwd.compile_sm90`) at head dims 128 and 64, no mask and causal,
then the forward's bf16-K/V variant (kv_bf16) and the Gluon dQ kernel (`gluon_attention_dq.compile_sm90`) likewise,
then the three Gluon kernels' padded and packed builds (`GLUON_VARLEN`) (each group after the ones before it, so
that adding a group leaves the earlier lines in place).

--kernels paged fingerprints the paged KV cache's kernels instead (`paged_builds`: the attention kernel's exact
and decode data paths in each pass (the decode split passes with STORE_S, and without it as "recompute"), the split combine and the append, at head dims 128 and 64 over bf16 inputs, as
`paged_attention_fwd` and `paged_append` launch them); --kernels all, every set.

Usage: python benchmarks/default_recipe_sass.py [--kernels dense|paged|gluon|all] [--check | --update] [--out FILE]
(--kernels all: every set, each checked against or written to its own reference file.)
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the reference lists, one file per kernel set (`reference_path`)
REFERENCE_DIR = os.path.join(ROOT, "benchmarks", "results", "cpu", "default_recipe_sass")
KERNEL_SETS = ("dense", "paged", "gluon")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

from sass_loops import cuda_tool, instructions  # noqa: E402
from triton_compile import PAGED_TYPES, compile_for, paged_divisible  # noqa: E402

#: the pointer arguments of the dense kernels as Triton's launcher types them for bf16 inputs (FP8 data and
#: E8M0 bytes; every other parameter is an i32 or, for the scales, fp32)
FLOATS = dict(qk_scale="fp32", sm_scale="fp32")


def sass_digest(kernel) -> str:
    """sha256 of the cubin's SASS instructions (cuobjdump), 16 hex digits."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    text = "\n".join(f"{a:x} {t}" for a, t in instructions(sass))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _types(fn, fp8: set, u8: set, bf16: set, fp32: set, i32: set = frozenset()) -> dict:
    out = dict(FLOATS)
    for p in fn.params:
        if p.is_constexpr:
            continue
        n = p.name
        if n in fp8:
            out[n] = "*fp8e4nv"
        elif n in u8:
            out[n] = "*u8"
        elif n in bf16:
            out[n] = "*bf16"
        elif n in fp32:
            out[n] = "*fp32"
        elif n in i32:
            out[n] = "*i32"
    return {k: v for k, v in out.items() if k in fn.arg_names}


def builds():
    """[(name, fn, types, constexprs, warps, stages)] of the default recipe's kernels."""
    from mxattn.kernels import triton_attention_bwd as tb, triton_attention_fwd as tf, triton_quantize as tq
    from mxattn.kernels import triton_bwd_prep as tp
    out = []
    common = dict(HAS_LB=False, HAS_RB=True, VARLEN=False, PACKED=False, BOTTOM_RIGHT=False)
    cu = {"CU_Q", "CU_KV"}
    # forward: bf16 K/V scratch (D 64, 128), FP8 on chip (D 128, 256), quantizing one-tile path (D 64)
    for dp, kv_bf16 in ((64, True), (128, True), (128, False), (256, False)):
        bm, warps, stages = (tf.BF16_FWD_CONFIGS if kv_bf16 else tf.FWD_CONFIGS)[dp]
        types = _types(tf._attn_fwd_kernel, fp8=set() if kv_bf16 else {"Q", "K", "V"},
                       u8={"QS", "KS", "VS"}, bf16={"O"} | ({"K", "V"} if kv_bf16 else set()),
                       fp32={"LSE", "SINK"}, i32=cu)
        types["Q"] = "*fp8e4nv"
        out.append((f"fwd d{dp} {'bf16-kv' if kv_bf16 else 'fp8-kv'}", tf._attn_fwd_kernel, types,
                    dict(common, BM=bm, BN=tf.BLOCK_N, DP=dp, EVEN_D=True, HAS_SINK=False, KV_BF16=kv_bf16,
                         QDQ=False), warps, stages))
    import torch
    bm, warps, stages = tf.quantizing_fwd_config(1, 64, torch.bfloat16)
    types = _types(tf._attn_fwd_kernel, fp8=set(), u8=set(), bf16={"Q", "QS", "K", "KS", "V", "VS", "O"},
                   fp32={"LSE", "SINK"}, i32=cu)
    out.append(("fwd d64 quantizing", tf._attn_fwd_kernel, types,
                dict(common, BM=bm, BN=tf.BLOCK_N, DP=64, EVEN_D=True, HAS_SINK=False, KV_BF16=False, QDQ=True),
                warps, stages))
    # backward: "pre" (bf16 scratch) at D 64 and 128, "fp8" at D 128
    for dp, pre in ((64, True), (128, True), (128, False)):
        (bm1, bn1, w1, s1), (bm2, bn2, w2, s2) = tb._bwd_config(dp, "pre" if pre else "fp8")
        q_side = {"Q", "QC", "DO", "DOC"}
        types = _types(tb._dkdv_kernel, fp8=({"K", "V"} | (set() if pre else q_side)),
                       u8={"QS", "QCS", "KS", "VS", "DOS", "DOCS"}, bf16=({"DK", "DV"} | (q_side if pre else set())),
                       fp32={"LSE", "DELTA"}, i32=cu)
        out.append((f"dkdv d{dp} {'pre' if pre else 'fp8'}", tb._dkdv_kernel, types,
                    dict(common, BM=bm1, BN=bn1, DP=dp, EVEN_D=True, PRE=pre), w1, s1))
        kv_side = {"Q", "K", "KC", "V", "DO"}
        types = _types(tb._dq_kernel, fp8=set() if pre else kv_side, u8={"QS", "KS", "KCS", "VS", "DOS"},
                       bf16={"DQ"} | (kv_side if pre else set()), fp32={"LSE", "DELTA"}, i32=cu)
        out.append((f"dq d{dp} {'pre' if pre else 'fp8'}", tb._dq_kernel, types,
                    dict(common, BM=bm2, BN=bn2, DP=dp, EVEN_D=True, PRE=pre), w2, s2))
    for kind, name in ((tp.PREP_DELTA, "delta"), (tp.PREP_Q, "q"), (tp.PREP_KV, "kv")):
        fp8 = {"RD", "CD"} | ({"A"} if kind == tp.PREP_KV else set())
        types = _types(tp._bwd_prep_kernel, fp8=fp8, u8={"RS", "CS"} | ({"B"} if kind == tp.PREP_KV else set()),
                       bf16={"OUT_A", "OUT_B", "OUT_R", "OUT_C"} | (set() if kind == tp.PREP_KV else {"A", "B"}),
                       fp32={"DELTA"}, i32={"CU"})
        bd, warps = tp.PREP_TILES[128]
        out.append((f"prep {name} d128", tp._bwd_prep_kernel, types,
                    dict(DP=128, BD=bd, KIND=kind.value, VARLEN=False, PACKED=False), warps, 1))
    # the fused quantizer: one tensor (dO's two copies) and Q, K, V in one launch (the forward's bf16-KV path)
    bs, warps, bd = tq.QUANT_TILE
    types = _types(tq._quantize_rowcol_kernel, fp8={"QR", "QC"}, u8={"SR", "SC", "SRZ", "SCZ"},
                   bf16={"X", "RDQ", "CDQ"}, fp32=set(), i32={"CU"})
    out.append(("quantize rowcol", tq._quantize_rowcol_kernel, types,
                dict(BS=bs, BD=bd, ROW=True, COL=True, SWZ=False, ROW_DQ=False, COL_DQ=False, VARLEN=False,
                     PACKED=False, COL_SEQ_MAJOR=False), warps, 1))
    names = {f"{p}{i}" for i in range(3) for p in ("X", "RDQ", "CDQ")}
    types = _types(tq._quantize_qkv_kernel, fp8={f"{p}{i}" for i in range(3) for p in ("QR", "QC")},
                   u8={f"{p}{i}" for i in range(3) for p in ("SR", "SC")}, bf16=names, fp32=set(),
                   i32={f"CU{i}" for i in range(3)})
    flags = dict(ROW0=True, COL0=True, ROW_DQ0=False, COL_DQ0=False, CSM0=False,
                 ROW1=True, COL1=True, ROW_DQ1=True, COL_DQ1=False, CSM1=False,
                 ROW2=True, COL2=True, ROW_DQ2=False, COL_DQ2=True, CSM2=False)
    out.append(("quantize qkv", tq._quantize_qkv_kernel, types,
                dict(BS=bs, BD=bd, VARLEN=False, PACKED=False, **flags), warps, 1))
    return out


#: the paged kernels' fixed launch choices: a group of 4 query heads per KV head (GP 4), pages of 256 tokens
#: (whole KV blocks), no window and no sink (their unused SINK argument is the query tensor, as the launcher passes)
PAGED_GROUP, PAGE_TOKENS = 4, 256
#: the split count the combine kernel is fingerprinted for (SP, its power-of-two ceiling)
COMBINE_SPLITS = 8


def _paged_attention_builds(dp: int) -> list:
    """[(name, fn, types, constexprs, warps, stages, options)] of the paged attention kernel's passes on its exact
    and decode data paths (DECODE) at head dim dp: the tiles `paged_config` picks (exact; decode: FAST_TILE with
    DECODE_MAXNREG), the split passes' scratch in fp32, the single pass's unused scratch arguments the query
    tensor (bf16)."""
    from mxattn.kernels import triton_paged_attention as tp
    out = []
    fn = tp._paged_attn_kernel
    for label, config in (("exact", tp.paged_config(dp)),
                          ("decode", tp.paged_config(dp, exact=False, rows=PAGED_GROUP))):
        bm, warps, stages = config
        decode = label == "decode"
        options = dict(maxnreg=tp.DECODE_MAXNREG) if decode and tp.DECODE_MAXNREG is not None else {}
        for pass_ in (tp.SINGLE.value, tp.MAX_PASS.value, tp.SPLIT_PASS.value):
            scratch = "*bf16" if pass_ == tp.SINGLE.value else "*fp32"
            # the decode split passes store the logits (STORE_S) under the workspace cap, else recompute them
            for store_s in (True, False) if decode and pass_ != tp.SINGLE.value else (False,):
                types = dict(PAGED_TYPES, MP=scratch, MF=scratch, LP=scratch, OP=scratch, SINK="*bf16",
                             SW="*fp32" if store_s else "*bf16")
                constexprs = dict(HAS_LB=False, HAS_SINK=False, BM=bm, BN=tp.BLOCK_N, DP=dp,
                                  GP=tp.tile_heads(PAGED_GROUP, bm), EVEN_D=True,
                                  WHOLE_PAGES=PAGE_TOKENS % tp.BLOCK_N == 0, PASS=pass_, DECODE=decode,
                                  STORE_S=store_s)
                name = f"paged {label} d{dp} pass{pass_}" + (" recompute" if decode and not store_s
                                                             and pass_ != tp.SINGLE.value else "")
                out.append((name, fn, types, constexprs, warps, stages,
                            dict(options, divisible=paged_divisible(fn, types))))
    return out


def paged_builds() -> list:
    """[(name, fn, types, constexprs, warps, stages, options)] of the paged KV cache's kernels (bf16 queries and
    cache, head dims 128 and 64); options: `compile_for`'s divisible (as the launcher sees an MXFP8KVCache's
    strides) and maxnreg."""
    from triton.backends.nvidia.compiler import CUDAOptions
    from mxattn.kernels import triton_paged_append as ta, triton_paged_attention as tp
    stages = CUDAOptions.num_stages  # the launcher's default: these two kernels are launched without num_stages
    out = []
    for dp in (128, 64):
        out += _paged_attention_builds(dp)
        types = dict(O="*bf16", MF="*fp32", LP="*fp32", OP="*fp32")
        out.append((f"combine d{dp} sp{COMBINE_SPLITS}", tp._combine_splits_kernel, types,
                    dict(SP=COMBINE_SPLITS, DP=dp), 4, stages, dict(divisible=[*types, "so_t", "so_h", "D"])))
        types = dict(META="*i32", K="*bf16", V="*bf16", PT="*i32", KD="*fp8e4nv", KS="*u8", VD="*fp8e4nv",
                     VS="*u8", VT="*bf16", SEQ_LENS="*i32")
        for tail_pass in (False, True):
            out.append((f"append d{dp}{' tail' if tail_pass else ''}", ta._paged_append_kernel, types,
                        dict(DP=dp, TAIL_PASS=tail_pass), 4 if dp <= 128 else 8, stages,
                        dict(divisible=paged_divisible(ta._paged_append_kernel, types))))
    return out


def selected(kernels: str) -> list:
    """The builds of a --kernels choice, each with its compile options (none for the dense kernels)."""
    out = [b + ({},) for b in builds()] if kernels in ("dense", "all") else []
    return out + (paged_builds() if kernels in ("paged", "all") else [])


#: the Gluon forward's sink and sliding-window variants fingerprinted after the default ones: (name suffix,
#: causal right bound, left bound, sink)
GLUON_VARIANTS = ((" causal sink", True, False, True), (" window", True, True, False),
                  (" window sink", True, True, True), (" left", False, True, False))


def gluon_builds() -> list:
    """[(name, compile thunk)] of the Gluon Hopper forward (`gluon_attention_fwd.compile_sm90`, as its launcher
    specialises a typical call: the default stages and ping-pong) at head dims 128 and 64, no mask and causal;
    then its variants (`GLUON_VARIANTS`: attention sinks, sliding windows with and without the causal edge); then
    the Gluon dK/dV kernel's builds (`gluon_bwd_builds`)."""
    from mxattn.kernels import gluon_attention_fwd as gf
    return [(f"gluon fwd d{d}{' causal' if causal else ''}", lambda d=d, causal=causal: gf.compile_sm90(d, causal))
            for d in (128, 64) for causal in (False, True)] + \
        [(f"gluon fwd d{d}{suffix}", lambda d=d, rb=rb, lb=lb, sink=sink:
          gf.compile_sm90(d, rb, has_lb=lb, has_sink=sink)) for d in (128, 64) for suffix, rb, lb, sink in GLUON_VARIANTS] + \
        gluon_bwd_builds()


def gluon_bwd_builds() -> list:
    """[(name, compile thunk)] of the Gluon Hopper dK/dV kernel of the "pre" backward
    (`gluon_attention_bwd.compile_sm90`, as its launcher specialises a typical call) at head dims 128 and 64, no
    mask and causal (after the forward's lines, which keep their fingerprints); then the forward's bf16-K/V variant
    and the Gluon dQ kernel (`gluon_attention_dq.compile_sm90`) likewise."""
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from mxattn.kernels import gluon_attention_fwd as gf
    return [(f"gluon {name} d{d}{' causal' if causal else ''}", lambda build=build, d=d, causal=causal: build(d, causal))
            for name, build in (("dkdv", gb.compile_sm90),
                                ("fwd kvbf16", lambda d, causal: gf.compile_sm90(d, causal, kv_bf16=True)),
                                ("dq", gd.compile_sm90))
            for d in (128, 64) for causal in (False, True)] + gluon_varlen_builds()


#: the three Gluon kernels' variable-length builds fingerprinted last: (name suffix, compile_sm90 keywords)
GLUON_VARLEN = (("padded causal br", dict(has_rb=True, varlen=True, bottom_right=True)),
                ("padded window", dict(has_rb=True, has_lb=True, varlen=True)),
                ("packed causal", dict(has_rb=True, varlen=True, packed=True)))


def gluon_varlen_builds() -> list:
    """[(name, compile thunk)] of the Gluon forward, dK/dV and dQ kernels' padded and packed builds (`GLUON_VARLEN`)
    at head dims 128 and 64, after every older line."""
    from mxattn.kernels import gluon_attention_bwd as gb
    from mxattn.kernels import gluon_attention_dq as gd
    from mxattn.kernels import gluon_attention_fwd as gf
    return [(f"gluon {name} d{d} {suffix}", lambda build=build, d=d, kw=kw: build(d, **kw))
            for name, build in (("fwd", gf.compile_sm90), ("dkdv", gb.compile_sm90), ("dq", gd.compile_sm90))
            for d in (128, 64) for suffix, kw in GLUON_VARLEN]


def compile_jobs(kernels: str) -> list:
    """[(name, compile thunk)] of a --kernels choice (dense, paged, gluon or all)."""
    jobs = [(name, lambda fn=fn, types=types, constexprs=constexprs, warps=warps, stages=stages, options=options:
             compile_for(fn, types, constexprs, num_warps=warps, num_stages=stages, **options))
            for name, fn, types, constexprs, warps, stages, options in selected(kernels)]
    return jobs + (gluon_builds() if kernels in ("gluon", "all") else [])


def reference_path(kernel_set: str) -> str:
    """The reference list of a kernel set (dense, paged or gluon)."""
    return os.path.join(REFERENCE_DIR, f"{kernel_set}.txt")


def differences(lines: list, reference: list) -> list:
    """Messages for every kernel whose line differs from the reference's, or that only one side lists."""
    def by_name(rows):
        # a line is "<name padded to 24> <digest>  smem <bytes>"; names may hold spaces
        return {row[:row.rindex("  smem")].rsplit(" ", 1)[0].strip(): row.strip() for row in rows if row.strip()}
    new, old = by_name(lines), by_name(reference)
    out = [f"changed: {new[name]}  (reference: {old[name]})" for name in new if name in old and new[name] != old[name]]
    out += [f"not in the reference: {new[name]}" for name in new if name not in old]
    out += [f"missing here: {old[name]}" for name in old if name not in new]
    return out


def fingerprints(kernel_set: str) -> list:
    """The fingerprint lines of one kernel set, printed as each kernel is built."""
    lines = []
    for name, compile_kernel in compile_jobs(kernel_set):
        kernel = compile_kernel()
        lines.append(f"{name:24s} {sass_digest(kernel)}  smem {kernel.metadata.shared}")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("dense", "paged", "gluon", "all"), default="dense",
                        help="which kernels to fingerprint (default: the dense ones)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="compare with the reference list(s) in benchmarks/results/cpu/default_recipe_sass/; "
                           "exit 1 when a kernel differs")
    mode.add_argument("--update", action="store_true",
                      help="write the lines to the reference list(s) (after a change meant to alter the SASS)")
    parser.add_argument("--out", help="also write the lines to this file")
    args = parser.parse_args()
    sets = KERNEL_SETS if args.kernels == "all" else (args.kernels,)
    lines, failed = [], False
    for kernel_set in sets:
        got = fingerprints(kernel_set)
        lines += got
        path = reference_path(kernel_set)
        if args.update:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write("\n".join(got) + "\n")
            print(f"wrote {os.path.relpath(path, ROOT)}", flush=True)
        elif args.check:
            if not os.path.exists(path):
                print(f"no reference list {os.path.relpath(path, ROOT)} (write it with --update)", flush=True)
                failed = True
                continue
            with open(path) as f:
                diff = differences(got, f.read().splitlines())
            for message in diff:
                print(f"{kernel_set}: {message}", flush=True)
            print(f"{kernel_set}: {len(got)} kernels, "
                  + (f"{len(diff)} difference(s) from {os.path.relpath(path, ROOT)}" if diff
                     else f"equal to {os.path.relpath(path, ROOT)}"), flush=True)
            failed = failed or bool(diff)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
