"""The report of `python -m mxattn bench`: its results dict as markdown tables (`markdown`) and as a bar chart of
TFLOP/s per config and implementation (`plot`, with matplotlib). Pure Python: it runs anywhere, also on a machine
without a GPU (`python -m mxattn bench --plot-from results.json`)."""

from __future__ import annotations

from typing import Dict


def fmt(v, nd=1) -> str:
    """A figure with nd decimals, "-" for None (a measurement that did not run)."""
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(results: Dict) -> str:
    """Markdown tables for the results dict."""
    lines = [f"# MXFP8 attention (triton backend) vs torch SDPA BF16 on {results['gpu']}", "",
             f"torch {results['torch']}, triton {results['triton']}; CUDA-event medians of {results['iters']} runs "
             f"after {results['warmup']} warm-up runs, then the median over {results.get('rounds', 1)} interleaved "
             "rounds (each round times every implementation in turn). TFLOP/s use 4*B*H*D*(kept pairs) for the "
             "forward, 2.5x that for the backward and 3.5x for forward+backward. 'fwd' is the forward without a "
             "backward to come, for both (inputs not requiring grad: O alone); the training-mode forward, which "
             "also keeps what the backward needs, is listed below the tables. Triton fwd/bwd include "
             "quantization of Q,K,V / dO; 'fwd kernel' excludes it. Ratios are SDPA time / triton time "
             "(higher is better).", "",
             "| config | impl | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
             "peak fwd+bwd MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results["configs"]:
        for impl, label in (("triton", "triton MXFP8"), ("sdpa_cudnn", "SDPA cuDNN bf16"),
                            ("sdpa_flash", "SDPA flash bf16")):
            if f"{impl}_fwd_ms" not in r:
                continue
            pk = r.get(f"{impl}_fwdbwd_peak_bytes")
            fwd = fmt(r[f"{impl}_fwd_ms"], 3)
            if f"{impl}_fwd_kernel_ms" in r:
                fwd += f" (kernel {fmt(r[impl + '_fwd_kernel_ms'], 3)})"
            lines.append(f"| {r['config']} | {label} | {fwd} | {fmt(r.get(impl + '_fwd_tflops'))} | "
                         f"{fmt(r.get(impl + '_bwd_ms'), 3)} | {fmt(r.get(impl + '_bwd_tflops'))} | "
                         f"{fmt(r.get(impl + '_fwdbwd_ms'), 3)} | {fmt(r.get(impl + '_fwdbwd_tflops'))} | "
                         f"{fmt(None if pk is None else pk / 2**20, 0)} |")
    lines += ["", "| config | fwd vs cuDNN (target 0.75) | fwd kernel vs cuDNN (target 0.85) | bwd vs cuDNN (target "
              "0.65) | fwd+bwd vs cuDNN (target 0.7) | peak mem triton / cuDNN (target <= 1 for MHA) | kept for "
              "backward triton / cuDNN (target <= 0.9) |", "|---|---|---|---|---|---|---|"]
    for r in results["configs"]:
        pk_t, pk_c = r.get("triton_fwdbwd_peak_bytes"), r.get("sdpa_cudnn_fwdbwd_peak_bytes")
        kt, kc = r.get("triton_kept_bytes"), r.get("sdpa_cudnn_kept_bytes")
        lines.append(f"| {r['config']} | {fmt(r.get('ratio_fwd_vs_cudnn'), 2)} | "
                     f"{fmt(r.get('ratio_fwd_kernel_vs_cudnn'), 2)} | {fmt(r.get('ratio_bwd_vs_cudnn'), 2)} | "
                     f"{fmt(r.get('ratio_fwdbwd_vs_cudnn'), 2)} | "
                     f"{fmt(None if not (pk_t and pk_c) else pk_t / pk_c, 2)} | "
                     f"{fmt(None if not (kt and kc) else kt / kc, 2)} |")
    if any("triton_fwd_train_ms" in r for r in results["configs"]):
        lines += ["", "Training-mode forward (inputs requiring grad; triton also writes the column-wise copies "
                  "the backward reads), ms: " + "; ".join(
                      f"{r['config']}: triton {fmt(r.get('triton_fwd_train_ms'), 3)} vs cuDNN "
                      f"{fmt(r.get('sdpa_cudnn_fwd_train_ms'), 3)} ({fmt(r.get('ratio_fwd_train_vs_cudnn'), 2)}x)"
                      for r in results["configs"])]
    lines += ["", "Triton GPU time without host overhead (CUDA-graph replay), ms: " + "; ".join(
        f"{r['config']}: fwd {fmt(r.get('triton_fwd_graph_ms'), 3)}, fwd+bwd {fmt(r.get('triton_fwdbwd_graph_ms'), 3)}"
        f" (cuDNN fwd+bwd timed per call, not from a graph: {fmt(r.get('sdpa_cudnn_fwdbwd_ms'), 3)})"
        for r in results["configs"])]
    if any("ratio_fwd_kernel_graph_vs_cudnn_graph" in r for r in results["configs"]):
        lines += ["", "GPU time alone, both sides replayed from CUDA graphs (the host's work before each call's first "
                  "launch is out of these; the tables above time each call from an idle queue), ratios cuDNN / "
                  "triton ('-': a side's CUDA-graph capture failed):", "", "| config | fwd kernel (target 0.85) | fwd incl. quantization | fwd+bwd | "
                  "triton fwd kernel / cuDNN fwd ms |", "|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {fmt(r.get('ratio_fwd_kernel_graph_vs_cudnn_graph'), 2)} | "
                  f"{fmt(r.get('ratio_fwd_graph_vs_cudnn_graph'), 2)} | "
                  f"{fmt(r.get('ratio_fwdbwd_graph_vs_cudnn_graph'), 2)} | "
                  f"{fmt(r.get('triton_fwd_kernel_graph_ms'), 3)} / {fmt(r.get('sdpa_cudnn_fwd_graph_ms'), 3)} |"
                  for r in results["configs"]]
    notes = [f"- {r['config']}: {n}" for r in results["configs"] for n in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:"] + notes
    vl = results.get("varlen")
    if vl:
        lines += ["", f"Variable lengths ({vl['config']}: {len(vl['lengths'])} causal sequences, {vl['tokens']} "
                  f"tokens, lengths {vl['lengths']}); baseline: {vl['baseline']}.", "",
                  "| phase | triton MXFP8 ms | TFLOP/s | BF16 varlen ms | ratio vs BF16 varlen | dense ratio vs cuDNN "
                  f"({vl['dense_config']}) | varlen / dense ratio (target >= 0.9) | triton TFLOP/s varlen / dense |",
                  "|---|---|---|---|---|---|---|---|"]
        for key in ("fwd", "fwdbwd"):
            lines.append(f"| {key} | {fmt(vl[f'triton_{key}_ms'], 3)} | {fmt(vl[f'triton_{key}_tflops'])} | "
                         f"{fmt(vl[f'bf16_{key}_ms'], 3)} | {fmt(vl[f'ratio_{key}_vs_bf16_varlen'], 2)} | "
                         f"{fmt(vl.get(f'dense_ratio_{key}_vs_cudnn'), 2)} | "
                         f"{fmt(vl.get(f'varlen_over_dense_ratio_{key}'), 2)} | "
                         f"{fmt(vl.get(f'varlen_over_dense_tflops_{key}'), 2)} |")
    ho = results.get("host")
    if ho:
        figures = ", ".join(f"{k.replace('_fwd_host_us', '')} {v:.0f} us" for k, v in ho.items())
        lines += ["", "Host overhead of one public-API forward call (CPU thread time per call issued with an idle "
                  f"launch queue, median; target <= 40 us): {figures}."]
    sk = results.get("sink")
    if sk:
        graph = (f"; forward GPU time (CUDA-graph replays, no host overhead) {fmt(sk.get('learnable_fwd_graph_ms'), 3)}"
                 f" vs {fmt(sk.get('vanilla_fwd_graph_ms'), 3)} ms ({fmt(sk.get('learnable_over_vanilla_fwd_graph'), 3)}x)")
        lines += ["", f"Attention sinks ({sk['config']}, triton, public API): softmax_type='learnable' vs 'vanilla': "
                  f"forward {sk['learnable_fwd_ms']:.3f} vs {sk['vanilla_fwd_ms']:.3f} ms "
                  f"({sk['learnable_over_vanilla_fwd']:.3f}x), forward+backward {sk['learnable_fwdbwd_ms']:.3f} vs "
                  f"{sk['vanilla_fwdbwd_ms']:.3f} ms ({sk['learnable_over_vanilla_fwdbwd']:.3f}x; target <= 1.03x)"
                  f"{graph}."]
    ml = results.get("mla")
    if ml:
        (dqk, dv), (b, h, s), (db, dh, ds) = ml["dims"], ml["train"], ml["decode"]
        lines += ["", f"MLA head dims (Q, K {dqk}, V {dv}; public API, `auto`) against torch SDPA in bf16, ratio = "
                  f"SDPA ms / mxattn ms: training B{b} H{h} S{s} causal forward {ml['train_mxattn_fwd_ms']:.3f} vs "
                  f"{ml['train_sdpa_bf16_fwd_ms']:.3f} ms ({ml['train_sdpa_over_mxattn_fwd']:.2f}x), forward+backward "
                  f"{ml['train_mxattn_fwdbwd_ms']:.3f} vs {ml['train_sdpa_bf16_fwdbwd_ms']:.3f} ms "
                  f"({ml['train_sdpa_over_mxattn_fwdbwd']:.2f}x); decode step B{db} H{dh} one query on {ds} keys "
                  f"{ml['decode_mxattn_fwd_ms']:.3f} vs {ml['decode_sdpa_bf16_fwd_ms']:.3f} ms "
                  f"({ml['decode_sdpa_over_mxattn_fwd']:.2f}x)."]
    qz = results.get("quantizer")
    if qz:
        lines += ["", f"Fused quantizer on bf16 {qz['shape']} (bytes read + written, CUDA-graph replays, so no "
                  "host launch overhead): device-to-device copy "
                  f"{qz['copy_GBps']:.0f} GB/s; quantizer row+col compact {qz['quant_compact_GBps']:.0f} GB/s "
                  f"({qz['quant_compact_vs_copy']:.2f}x copy), from a BSHD view {qz['quant_compact_bshd_GBps']:.0f}"
                  f" GB/s ({qz['quant_compact_bshd_vs_copy']:.2f}x), with swizzled scales too "
                  f"{qz['quant_swizzled_GBps']:.0f} GB/s ({qz['quant_swizzled_vs_copy']:.2f}x); target 0.70x."]
    return "\n".join(lines) + "\n"


def plot(results: Dict, path: str) -> bool:
    """Bar chart of TFLOP/s per config and impl; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cfgs = results["configs"]
    phases = ("fwd", "bwd", "fwdbwd")
    impls = (("triton", "triton MXFP8"), ("sdpa_cudnn", "SDPA cuDNN bf16"), ("sdpa_flash", "SDPA flash bf16"))
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4.5), sharey=True)
    width = 0.8 / len(impls)
    for ax, ph in zip(axes, phases):
        for i, (impl, label) in enumerate(impls):
            vals = [r.get(f"{impl}_{ph}_tflops") or 0.0 for r in cfgs]
            ax.bar([x + i * width for x in range(len(cfgs))], vals, width, label=label)
        ax.set_xticks([x + width for x in range(len(cfgs))])
        ax.set_xticklabels([r["config"] for r in cfgs], rotation=20, ha="right", fontsize=7)
        ax.set_title(ph)
        ax.set_ylabel("TFLOP/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"MXFP8 attention (triton) vs SDPA BF16 on {results['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


__all__ = ["fmt", "markdown", "plot"]
