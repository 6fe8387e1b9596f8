"""Timing: warm-up, then one wall-clock sample per run, and the statistics of the samples."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Stats:
    """Latency statistics of a list of runs, in seconds."""

    runs: int
    median: float
    p90: float
    p99: float
    mean: float
    min: float
    max: float
    stdev: float  # 0 for a single run

    @classmethod
    def of(cls, times: Sequence[float]) -> Stats:
        if not times:
            raise ValueError("no timed runs")
        p50, p90, p99 = np.percentile(np.asarray(times, dtype=np.float64), [50, 90, 99])
        return cls(
            runs=len(times),
            median=float(p50),
            p90=float(p90),
            p99=float(p99),
            mean=statistics.fmean(times),
            min=min(times),
            max=max(times),
            stdev=statistics.stdev(times) if len(times) > 1 else 0.0,
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def measure(step: Callable[[], object], runs: int, warmup: int) -> list[float]:
    """`warmup` untimed calls of `step`, then the wall time of each of `runs` calls."""
    return interleaved([step], runs, warmup)[0]


def interleaved(steps: Sequence[Callable[[], object]], runs: int, warmup: int) -> list[list[float]]:
    """Times several steps round by round, the order rotating each round, so that noise (other
    processes, frequency changes) hits them all alike. Returns the samples of each step."""
    if runs < 1 or warmup < 0:
        raise ValueError(f"runs must be positive and warmup not negative ({runs}, {warmup})")
    for step in steps:
        for _ in range(warmup):
            step()
    times: list[list[float]] = [[] for _ in steps]
    clock = time.perf_counter
    for r in range(runs):
        for k in range(len(steps)):
            i = (r + k) % len(steps)
            step = steps[i]
            t0 = clock()
            step()
            times[i].append(clock() - t0)
    return times
