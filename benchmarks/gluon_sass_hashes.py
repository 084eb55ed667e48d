"""Fingerprints of the Gluon kernels' sm_90a machine code, built on a machine without a GPU (Triton's compiler and
its ptxas; `compile_sm90` of each kernel module): the sha1 of each build's SASS instruction text, for six builds of
the forward and six each of the dK/dV and dQ kernels (dense, causal, bf16-K/V, window + sink, padded causal
bottom-right, padded window). A change meant to leave the default recipe's kernels alone (a new constexpr switch,
a refactor) must leave every line of this output unchanged: run it before and after and diff.

Usage: python benchmarks/gluon_sass_hashes.py [--kernel fwd|bwd|all]
"""

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import sass_loops  # noqa: E402

FWD_BUILDS = [dict(d=128), dict(d=128, has_rb=True), dict(d=128, kv_bf16=True),
              dict(d=64, has_rb=True, has_lb=True, has_sink=True),
              dict(d=128, has_rb=True, varlen=True, bottom_right=True), dict(d=64, kv_bf16=True, varlen=True)]
BWD_BUILDS = [dict(d=128), dict(d=128, has_rb=True), dict(d=64, has_rb=True), dict(d=64),
              dict(d=128, has_rb=True, varlen=True, bottom_right=True),
              dict(d=64, varlen=True, has_lb=True, has_rb=True)]


def sass_sha1(kernel) -> str:
    """sha1 (12 hex digits) of a CompiledKernel's SASS instructions (addresses and encodings left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([sass_loops.cuda_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    return hashlib.sha1("\n".join(t for _, t in sass_loops.instructions(sass)).encode()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=["fwd", "bwd", "all"], default="all")
    args = parser.parse_args()
    if args.kernel in ("fwd", "all"):
        from mxattn.kernels import gluon_attention_fwd as gf
        for build in FWD_BUILDS:
            kw = dict(build)
            print("fwd", kw, sass_sha1(gf.compile_sm90(kw.pop("d"), **kw)), flush=True)
    if args.kernel in ("bwd", "all"):
        from mxattn.kernels import gluon_attention_bwd as gb
        from mxattn.kernels import gluon_attention_dq as gd
        for build in BWD_BUILDS:
            kw = dict(build)
            d = kw.pop("d")
            print("dkdv", build, sass_sha1(gb.compile_sm90(d, **kw)), "dq", sass_sha1(gd.compile_sm90(d, **kw)),
                  flush=True)


if __name__ == "__main__":
    main()
