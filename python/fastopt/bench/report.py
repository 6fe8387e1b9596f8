"""Presenting results: a comparison table with ratios, and a JSON document with the machine
and library versions beside the numbers."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import PurePath
from typing import Any

from rich.table import Table

from fastopt.bench.result import BenchResult
from fastopt.verify.check import onnxruntime


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """What the numbers depend on besides the model: versions, providers, CPU."""
    import os

    ort = onnxruntime()
    return {
        "onnxruntime": ort.__version__,
        "onnxruntime_build": "gpu" if "CUDAExecutionProvider" in ort.get_available_providers()
        else "cpu",
        "providers": list(ort.get_available_providers()),
        "fastopt": _version("fastopt"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
    }  # fmt: skip


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.2f}"


def megabytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MB"


def ratios(results: Sequence[BenchResult]) -> list[float]:
    """Each result's median latency over the first's (below 1: faster than the first)."""
    base = results[0].stats.median
    return [r.stats.median / base for r in results]


def speedups(results: Sequence[BenchResult]) -> list[float]:
    """The first result's median latency over each one's (above 1: faster than the first)."""
    base = results[0].stats.median
    return [base / r.stats.median if r.stats.median > 0 else float("inf") for r in results]


def times(x: float) -> str:
    """A speed-up with the digits that matter: "175x", "17.6x", "1.00x", "0.0042x"."""
    if x >= 100:
        return f"{x:.0f}x"
    if x >= 10:
        return f"{x:.1f}x"
    if x >= 0.1:
        return f"{x:.2f}x"
    return f"{x:.2g}x"


def work(r: BenchResult) -> str:
    """What one run of `r` computes: "128 tokens", "1 token after 128 cached", "129 tokens,
    no cache (recompute)"."""
    rows = f"{r.batch} x " if r.batch > 1 else ""
    if r.phase != "decode":
        return f"{rows}{r.seq} tokens"
    if r.kind in ("decoder_cache", "decoder_inplace"):
        return f"{rows}1 token after {r.seq} cached"
    return f"{rows}{r.seq + 1} tokens, no cache (recompute)"


def same_work(results: Sequence[BenchResult]) -> bool:
    """Whether every run computes the same thing (a speed-up between them is like for like)."""
    return len({work(r) for r in results}) <= 1


def short_labels(labels: Sequence[str]) -> list[str]:
    """The shortest path tails (two components at least) that still tell `labels` apart:
    ``llama/model.onnx`` rather than a long absolute path."""
    parts = [PurePath(label).parts for label in labels]
    for k in range(2, max((len(p) for p in parts), default=0) + 1):
        tails = [str(PurePath(*p[-k:])) if p else "" for p in parts]
        if len(set(tails)) == len(set(labels)):
            return tails
    return list(labels)


def table(results: Sequence[BenchResult], title: str | None = None) -> Table:
    """A rich table of `results`: what each run computes, its latency, and its speed-up over the
    first result (the first's median latency over its own)."""
    t = Table(title=title, show_edge=False)
    columns = ["model", "provider", "work", "median ms", "p90 ms", "p99 ms", "tokens/s"]
    for name in [*columns, "memory", "speed-up"]:
        t.add_column(name, justify="left" if name in ("model", "provider", "work") else "right")
    names = short_labels([r.model for r in results])
    for r, speedup, name in zip(results, speedups(results), names):
        t.add_row(
            name,
            r.provider.replace("ExecutionProvider", ""),
            work(r),
            ms(r.stats.median),
            ms(r.stats.p90),
            ms(r.stats.p99),
            f"{r.tokens_per_s:,.0f}",
            megabytes(r.memory_bytes),
            times(speedup),
        )
    return t


def document(
    results: Sequence[BenchResult], sweep: Sequence[Sequence[BenchResult]] = ()
) -> dict[str, Any]:
    """Everything as JSON-ready data: environment, results with ratios, and a sweep if any."""
    out: dict[str, Any] = {
        "environment": environment(),
        "results": [{**r.to_dict(), "ratio": ratio} for r, ratio in zip(results, ratios(results))],
    }
    if sweep:
        out["sweep"] = [[r.to_dict() for r in row] for row in sweep]
    return out
