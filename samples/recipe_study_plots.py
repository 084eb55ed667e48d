"""PNG plots of samples/recipe_study.py's result (matplotlib, when it imports): part 1's O errors and part 3's
final training losses."""

from __future__ import annotations

import os


def save_plots(result: dict, out_dir: str) -> str:
    """PNG plots of the O errors and the final losses if matplotlib imports; returns what was done."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG plots written"
    written = []
    try:
        if "errors" in result:
            cases = result["errors"]
            labels = list(cases[0]["errors"])
            fig, ax = plt.subplots(figsize=(11, 4.5))
            width = 0.8 / len(labels)
            for j, label in enumerate(labels):
                means = [100 * c["errors"][label]["O"]["mean"] for c in cases]
                ax.bar([x + j * width for x in range(len(cases))], means, width, label=label)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))])
            ax.set_xticklabels([f"{c['distribution']}\n{c['mask']}" for c in cases], fontsize=7)
            ax.set_ylabel("O rel-RMS error vs FP64 (%)")
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = os.path.join(out_dir, "recipe_study_errors.png")
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(os.path.basename(path))
        if "training" in result:
            summary = result["training"]["summary"]
            labels = list(summary)
            means = [summary[lb]["final"]["mean"] for lb in labels]
            lo = [m - summary[lb]["final"]["min"] for m, lb in zip(means, labels)]
            hi = [summary[lb]["final"]["max"] - m for m, lb in zip(means, labels)]
            fig, ax = plt.subplots(figsize=(8, 4.5))
            ax.errorbar(range(len(labels)), means, yerr=[lo, hi], fmt="o", capsize=4)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel("final training loss (mean, min-max over seeds)")
            fig.tight_layout()
            path = os.path.join(out_dir, "recipe_study_training.png")
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(os.path.basename(path))
    except Exception as exc:  # a plot must not lose the study's numbers
        return f"plotting failed ({type(exc).__name__}: {exc}); wrote {written or 'nothing'}"
    return "written: " + ", ".join(written) if written else "nothing to plot"
