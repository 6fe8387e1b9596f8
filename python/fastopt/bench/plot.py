"""Latency against sequence length, one line per model, as a PNG (matplotlib, Agg backend:
no display needed)."""

from __future__ import annotations

from collections.abc import Sequence

from fastopt.bench.report import short_labels
from fastopt.bench.result import BenchResult


def plot_sweep(sweep: Sequence[Sequence[BenchResult]], path: str, title: str = "") -> None:
    """Draws the median latency (ms) of each model at each sequence length of `sweep` (one
    list of results per length, models in the same order) into `path`."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "plotting needs matplotlib: pip install matplotlib (or pip install 'fastopt[bench]')"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not sweep or not sweep[0]:
        raise ValueError("nothing to plot")
    seqs = [row[0].seq for row in sweep]
    names = short_labels([r.model for r in sweep[0]])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        lowest, highest = float("inf"), 0.0
        for i, name in enumerate(names):
            medians = [row[i].stats.median * 1e3 for row in sweep]
            ax.plot(seqs, medians, marker="o", label=name)
            lowest, highest = min(lowest, *medians), max(highest, *medians)
        first = sweep[0][0]
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.set_xlabel(
            "sequence length (tokens" + (" of context)" if first.phase == "decode" else ")")
        )
        if highest > 20 * lowest > 0:
            # a cached decoder next to recompute: on a linear axis the fast lines sit on zero
            ax.set_yscale("log")
            ax.set_ylabel("latency (ms, median, log scale)")
        else:
            ax.set_ylabel("latency (ms, median)")
            ax.set_ylim(bottom=0)
        provider = first.provider.replace("ExecutionProvider", "")
        ax.set_title(title or f"{first.phase} latency, batch {first.batch}, {provider}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
