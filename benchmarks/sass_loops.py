"""What a Triton kernel costs per loop iteration, read off its sm_90 build on a machine without a GPU.

Triton's compiler and the ptxas and cuobjdump it ships run on the CPU, so a kernel variant can be built for Hopper
and inspected before any device time is spent: registers, stack frame (spills), shared memory, and for every loop
of the SASS (a backward branch) its instruction count and the most frequent opcodes. A loop body's count per warp,
times the cycles per issued instruction, bounds a latency-bound kernel's time per iteration; byte-wise shared
memory loads (LDS.U8), barriers (BAR.SYNC) and register moves (IMAD.MOV) in a hot loop are the usual signs of
operands shuffled rather than computed.

The warp-specialised Gluon kernels of the triton backend (--kernel gluon-fwd, gluon-dkdv, gluon-dq: their
`compile_sm90` builds) are reported likewise, with whether ptxas serialised their wgmmas (its C7512 note: every
GEMM waited for as it is issued, which no benchmark shows as such, only as lost time). Their consumer loops are
the ones holding HGMMA; an instruction count per loop iteration there is per warp and per streamed block.

Usage: python benchmarks/sass_loops.py [--kernel decode|exact] [--pass 0|1|2] [--head-dim 128] [--warps 4]
                                        [--stages 2] [--maxnreg N] [--store-s 0|1] [--top 12]
       python benchmarks/sass_loops.py --kernel gluon-dkdv|gluon-dq|gluon-fwd [--head-dim 128] [--causal]
                                        [--stages N] [--defer 0|1] [--block N] [--kv-bf16] [--top 12]
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

def cuda_tool(name: str) -> str:
    """Path of a CUDA binary shipped in Triton's wheel (ptxas, cuobjdump, nvdisasm)."""
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def instructions(sass: str):
    """[(address, text)] of the SASS listing's instructions."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def loops(ins):
    """[(first address, last address, [opcodes])] of every backward branch's body, in address order. Branches
    past the last EXIT are left out: there ptxas puts the out-of-line retries of mbarrier waits (warp-specialised
    kernels), whose jumps back into the code are not loops."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    exits = [a for a, text in ins if opcode(text) == "EXIT"]
    end = max(exits) if exits else float("inf")
    found = []
    for i, (a, text) in enumerate(ins):
        if "BRA" not in text or a > end:
            continue
        m = re.search(r"0x([0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else None
        if target is not None and target < a and target in index:
            found.append((target, a, [opcode(t) for _, t in ins[index[target]:i + 1]]))
    return found


def build_paged(kernel: str, pass_: int, head_dim: int, warps: int, stages: int, maxnreg=None, store_s=False):
    """The sm_90 build of the paged attention kernel's data path (decode: DECODE, triton_paged_decode; exact: the
    dequantizing path) for a decode step's tile (16 rows, 4 query heads per KV head, pages of 256 tokens); store_s:
    the split passes' STORE_S (pass 1 writes the logits, pass 2 reads them)."""
    from triton_compile import compile_paged
    from mxattn.kernels import triton_paged_attention as tp
    dp = tp.padded_head_dim(head_dim)
    constexprs = dict(HAS_LB=False, HAS_SINK=False, BM=16, BN=tp.BLOCK_N, DP=dp, GP=4, EVEN_D=dp == head_dim,
                      WHOLE_PAGES=True, PASS=pass_, DECODE=kernel == "decode", STORE_S=store_s)
    options = {} if maxnreg is None else dict(maxnreg=maxnreg)
    return compile_paged(tp._paged_attn_kernel, constexprs, num_warps=warps, num_stages=stages, **options)


GLUON_KERNELS = {"gluon-fwd": "gluon_attention_fwd", "gluon-dkdv": "gluon_attention_bwd", "gluon-dq": "gluon_attention_dq"}


def build_gluon(kernel: str, head_dim: int, causal: bool, stages=None, defer=None, block=None, kv_bf16=False,
                stats_loads=None):
    """The sm_90a build of a Gluon kernel (`compile_sm90` of its module): defer the backward kernels'
    software-pipelined last GEMM (None: the module's default), block the dK/dV kernel's query rows (block_m) or the
    dQ kernel's keys (block_n) per streamed block, kv_bf16 the forward's bf16-K/V variant, stats_loads where the
    dK/dV kernel loads the LSE and delta (`STATS_LOADS`; None: its default)."""
    module = importlib.import_module(f"mxattn.kernels.{GLUON_KERNELS[kernel]}")
    if kernel == "gluon-fwd":
        return module.compile_sm90(head_dim, causal, stages=stages, kv_bf16=kv_bf16)
    if kernel == "gluon-dkdv":
        return module.compile_sm90(head_dim, causal, stages=stages, defer=defer, block_m=block,
                                   stats_loads=stats_loads)
    return module.compile_sm90(head_dim, causal, stages=stages, defer=defer, block_n=block)


def wgmma_serialised(ptx: str) -> bool:
    """Whether ptxas serialises the wgmmas of this PTX (its C7512 "Potential Performance Loss" note)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        log = subprocess.run([cuda_tool("ptxas"), "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return "C7512" in log


def report(cubin: bytes, top: int) -> str:
    """Resource usage and the per-loop instruction mix of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([cuda_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    resources = [line.strip() for line in usage.splitlines() if "REG:" in line]
    ins = instructions(sass)
    lines = [f"resources: {resources[-1] if resources else '?'}", f"SASS instructions: {len(ins)}"]
    for first, last, ops in loops(ins):
        counts = Counter(ops)
        gemms = sum(v for k, v in counts.items() if k.startswith(("HGMMA", "HMMA")))
        lines.append(f"loop {first:#x}-{last:#x}: {len(ops)} instructions per iteration and warp; "
                     + ", ".join(f"{k} {v}" for k, v in counts.most_common(top))
                     + (f"; tensor-core instructions {gemms}" if gemms else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("decode", "exact") + tuple(GLUON_KERNELS), default="decode",
                    help="the paged kernel's data path: decode (DECODE, triton_paged_decode; the 16-row tile's) "
                         "or exact (dequantizing); or a Gluon kernel of the triton backend (forward, dK/dV, dQ)")
    ap.add_argument("--causal", action="store_true", help="Gluon kernels: the causal-style band variant")
    ap.add_argument("--defer", type=int, choices=(0, 1), default=None,
                    help="Gluon dK/dV and dQ kernels: the software-pipelined last GEMM off / on (default: DEFER_WAITS)")
    ap.add_argument("--block", type=int, default=None,
                    help="Gluon dK/dV kernel: query rows per streamed block; dQ kernel: keys per block (default theirs)")
    ap.add_argument("--kv-bf16", action="store_true", help="Gluon forward: the bf16-K/V variant")
    ap.add_argument("--stats-loads", type=int, choices=(0, 4, 5), default=None,
                    help="Gluon dK/dV kernel: where the LSE / delta come from (default: STATS_LOADS)")
    ap.add_argument("--pass", dest="pass_", type=int, choices=(0, 1, 2), default=2,
                    help="0 single pass, 1 split maximum pass, 2 split pass (default)")
    ap.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--warps", type=int, default=4, help="num_warps (default 4)")
    ap.add_argument("--stages", type=int, default=None,
                    help="num_stages (default 2); Gluon kernels: ring stages (default theirs)")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap (default: none)")
    ap.add_argument("--store-s", type=int, choices=(0, 1), default=None,
                    help="the decode split passes' STORE_S: 1 store / load the logits, 0 recompute them (default: "
                         "what the launcher picks under its workspace cap: 1 for the decode path's passes 1 and 2)")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per loop (default 12)")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        print("sass_loops needs triton (pip install triton on Linux x86-64)", file=sys.stderr)
        return 2
    if args.kernel in GLUON_KERNELS:
        defer = None if args.defer is None else bool(args.defer)
        if args.stats_loads is not None and args.kernel != "gluon-dkdv":
            ap.error("--stats-loads applies to --kernel gluon-dkdv only")
        kernel = build_gluon(args.kernel, args.head_dim, args.causal, args.stages, defer, args.block, args.kv_bf16,
                             args.stats_loads)
        stats = "" if args.kernel != "gluon-dkdv" else \
            f", stats loads {'default' if args.stats_loads is None else args.stats_loads}"
        print(f"{args.kernel}, D {args.head_dim}{' causal' if args.causal else ''}, stages "
              f"{args.stages or 'default'}, defer {'default' if defer is None else int(defer)}, block "
              f"{args.block or 'default'}{stats}; shared memory {kernel.metadata.shared} bytes; wgmma serialised by ptxas: "
              f"{'yes' if wgmma_serialised(kernel.asm['ptx']) else 'no'}")
        print(report(kernel.asm["cubin"], args.top))
        return 0
    stages = 2 if args.stages is None else args.stages
    store_s = (args.kernel == "decode" and args.pass_ != 0) if args.store_s is None else bool(args.store_s)
    kernel = build_paged(args.kernel, args.pass_, args.head_dim, args.warps, stages, args.maxnreg, store_s)
    print(f"{args.kernel} path, pass {args.pass_}, D {args.head_dim}, {args.warps} warps, {stages} stages"
          + ("" if args.maxnreg is None else f", maxnreg {args.maxnreg}") + f", STORE_S {int(store_s)}; shared memory "
          f"{kernel.metadata.shared} bytes")
    print(report(kernel.asm["cubin"], args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
