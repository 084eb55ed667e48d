"""Build and print cuDNN's MXFP8 attention graphs for one config; on Blackwell, run them against `ref`.

    python samples/cudnn_graphs.py --batch 2 --heads 8 --kv-heads 2 --seq 1024 --head-dim 128 --mask causal
    python samples/cudnn_graphs.py --head-dim 192 --head-dim-v 128 --layout sbhd --left-bound 256 --json
    python samples/cudnn_graphs.py --varlen packed --seq 700 --mask causal   # thd: ragged offsets, packed scales
    python samples/cudnn_graphs.py --softmax-type learnable                  # attention sink: SINK in, DSINK out

The graphs are built without a GPU and checked by cuDNN's own validation (targeting SM 10.0); the tables list
every tensor of the forward and backward graphs (uid, dims, strides, data type, reordering, ragged offset uid).
`--varlen padded|packed` prints the variable-length graphs (padding mask, per-sequence lengths; packed: --seq is
the longest sequence, every token tensor is ragged). `--softmax-type off-by-one|learnable` adds the attention sink
(cuDNN's sink_token, fp32 [1, H, 1, 1], to both graphs; learnable: the backward's dSink_token output too). With a
Blackwell GPU
and cuDNN >= 9.21 the graphs then run on random inputs and are compared with `ref.mxfp8_ref` on the same
quantized bytes; elsewhere the script says why they cannot run.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mxattn.backends.cudnn import config as cudnn_config  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends.cudnn.support import cudnn_support  # noqa: E402
from mxattn.errors import MXFP8NotSupportedError  # noqa: E402
from mxattn.mask import MaskSpec  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--seq-kv", type=int, default=None, help="default: --seq")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--head-dim-v", type=int, default=None, help="default: --head-dim (cuDNN: 128 with 192)")
    p.add_argument("--layout", choices=("bshd", "bhsd", "sbhd"), default="bshd")
    p.add_argument("--mask", choices=("none", "causal", "causal_bottom_right"), default="none")
    p.add_argument("--left-bound", type=int, default=None, help="cuDNN diagonal band left bound (>= 1)")
    p.add_argument("--right-bound", type=int, default=None, help="cuDNN diagonal band right bound (>= 0)")
    p.add_argument("--out-dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--non-deterministic", action="store_true", help="ask for the non-deterministic backward")
    p.add_argument("--varlen", choices=("padded", "packed"), default=None,
                   help="variable-length graphs (packed: thd, --seq/--seq-kv are the longest sequences)")
    p.add_argument("--softmax-type", choices=tuple(cudnn_config.SOFTMAX_TYPES), default="vanilla",
                   help="TE's softmax_type: off-by-one / learnable add the attention sink (learnable: and dSink)")
    p.add_argument("--json", action="store_true", help="print cuDNN's full JSON of both graphs too")
    return p.parse_args(argv)


def config(args) -> cudnn_config.GraphConfig:
    mask = MaskSpec(causal=args.mask != "none",
                    diagonal_alignment="bottom_right" if args.mask == "causal_bottom_right" else "top_left",
                    left_bound=args.left_bound, right_bound=args.right_bound)
    kw = dict(mask=mask, out_dtype=DTYPES[args.out_dtype], deterministic=not args.non_deterministic)
    sizes = (args.batch, args.heads, args.kv_heads or args.heads, args.seq, args.seq_kv or args.seq, args.head_dim,
             args.head_dim_v)
    if args.varlen == "packed":
        cfg = cudnn_config.GraphConfig.from_packed(*sizes, **kw)
    else:
        cfg = cudnn_config.GraphConfig.from_layout(*sizes, layout=args.layout, **kw)
        cfg = dataclasses.replace(cfg, varlen=args.varlen) if args.varlen else cfg
    return cfg.for_softmax(args.softmax_type)  # the forward graph ignores dsink


def print_graph(kind: str, cfg: cudnn_config.GraphConfig, full_json: bool) -> bool:
    build = cudnn_graphs.build_forward_graph if kind == "forward" else cudnn_graphs.build_backward_graph
    try:
        j = cudnn_graphs.graph_json(build(cfg))
    except MXFP8NotSupportedError as exc:
        print(f"\n{kind} graph: cuDNN rejects it: {exc}")
        return False
    (node,) = j["nodes"]
    print(f"\n{kind} graph ({node['tag']}, cuDNN {j['cudnn_backend_version']}, frontend "
          f"{j['cudnn_frontend_version']}): valid")
    print(f"  {'uid':>4} {'name':8} {'dims':22} {'strides':30} {'type':9} reordering")
    for t in sorted(j["tensors"], key=lambda t: t["uid"]):
        if not t["is_virtual"]:
            ragged = f"  ragged offset: uid {t['ragged_offset_uid']}" if t.get("ragged_offset_uid") else ""
            print(f"  {t['uid']:>4} {t['name']:8} {str(t['dim']):22} {str(t['stride']):30} {t['data_type']:9} "
                  f"{t['reordering_type']}{ragged}")
    attrs = {k: node[k] for k in ("diagonal_alignment", "left_bound", "right_bound", "attn_scale_value",
                                  "generate_stats", "is_deterministic_algorithm", "padding_mask",
                                  "max_total_seq_len_q", "max_total_seq_len_kv") if node.get(k) is not None}
    print("  attributes:", attrs)
    if full_json:
        print(json.dumps(j, indent=1))
    return True


def run_on_blackwell(cfg: cudnn_config.GraphConfig, layout: str) -> None:
    """Random inputs in cfg's layout; cuDNN vs ref on the same quantized bytes; prints an error table."""
    from mxattn.backends.cudnn.run import cudnn_backward, cudnn_forward
    from mxattn.formats import quantize_mxfp8
    from mxattn.metrics import max_abs, rel_rms
    from ref import mxfp8_ref

    perm = cudnn_config.LAYOUT_PERMUTATIONS[layout]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def view(shape, dtype=torch.bfloat16):
        physical = torch.randn([shape[i] for i in perm], generator=gen, device="cuda").to(dtype)
        return physical.permute([perm.index(i) for i in range(4)])

    q, k, v, do = view(cfg.q_shape), view(cfg.k_shape), view(cfg.v_shape), view(cfg.o_shape, cfg.out_dtype)
    qr, kr, vc = quantize_mxfp8(q, -1), quantize_mxfp8(k, -1), quantize_mxfp8(v, -2)
    m = cfg.mask
    rk = dict(attn_scale=cfg.attn_scale, causal=m.causal, diagonal_alignment=m.diagonal_alignment,
              window=(m.left_bound, m.right_bound), out_dtype=cfg.out_dtype)
    o, stats, amax_o = cudnn_forward(qr, kr, vc, attn_scale=cfg.attn_scale, mask=m, out_dtype=cfg.out_dtype)
    ref_o, _ = mxfp8_ref.sdpa_fwd_quantized(qr.data, qr.scale, kr.data, kr.scale, vc.data, vc.scale, **rk)
    alt_o, _ = mxfp8_ref.sdpa_fwd_quantized(qr.data, qr.scale, kr.data, kr.scale, vc.data, vc.scale, **rk,
                                            p_scale=16.0, rescale_threshold=4.0)
    rows = [("O", o, ref_o, amax_o, rel_rms(o, alt_o))]
    qc, kc, vr = quantize_mxfp8(q, -2), quantize_mxfp8(k, -2), quantize_mxfp8(v, -1)
    dor, doc = quantize_mxfp8(do, -1), quantize_mxfp8(do, -2)
    args = (qr, qc, kr, kc, vr, o, do, dor, doc, stats)
    try:
        first = cudnn_backward(*args, attn_scale=cfg.attn_scale, mask=m, deterministic=cfg.deterministic)
        second = cudnn_backward(*args, attn_scale=cfg.attn_scale, mask=m, deterministic=cfg.deterministic)
        refs = mxfp8_ref.sdpa_bwd_quantized(q_row=(qr.data, qr.scale), q_col=(qc.data, qc.scale),
                                            k_row=(kr.data, kr.scale), k_col=(kc.data, kc.scale),
                                            v_row=(vr.data, vr.scale), o=o, do=do, do_row=(dor.data, dor.scale),
                                            do_col=(doc.data, doc.scale), stats=stats, **rk)
        rows += [(n, g, r, a, float("nan")) for n, g, r, a in zip(("dQ", "dK", "dV"), first[:3], refs, first[3:])]
        identical = all(torch.equal(a, b) for a, b in zip(first, second))
    except MXFP8NotSupportedError as exc:
        print(f"backward not run: {exc}")
        identical = None
    print(f"\n{'':4} {'max|diff|':>10} {'relRMS':>9} {'relRMS p16':>10} {'amax':>10} {'max|out|':>10}   vs ref on the "
          "same bytes (p16: ref with P scale 16, lazy rescale 4)")
    for name, got, want, amax, alt in rows:
        print(f"{name:4} {max_abs(got, want):10.3e} {rel_rms(got, want):9.2e} {alt:10.2e} {amax.item():10.4f} "
              f"{got.float().abs().max().item():10.4f}")
    if identical is not None:
        print(f"two backward runs bit-identical: {identical}")


def main(argv=None) -> int:
    args = parse(argv)
    cfg = config(args)
    print("config:", cfg.describe())
    ok_graphs = [print_graph(kind, cfg, args.json) for kind in ("forward", "backward")]
    ok, reason = cudnn_support()
    if not ok:
        print(f"\ncannot run the graphs here: {reason}")
        return 0
    if not ok_graphs[0]:
        return 0
    if cfg.varlen or cfg.sink:
        print(f"\n{'variable-length' if cfg.varlen else 'attention-sink'} graphs are run against the reference "
              "backend by tests/cudnn_backend/test_cudnn_gpu.py")
        return 0
    run_on_blackwell(cfg, args.layout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
