"""Timing: warm-up, then one wall-clock sample per run, and the statistics of the samples."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from fastopt._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:  # (the CLI imports this module for every command: `fastopt quantize` needs no numpy)
    np = lazy_module("numpy")


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


# Consecutive timed runs of one model per round. Switching models after every run would time
# each run with caches and ORT's thread pool warmed by another model: 2x the steady-state latency
# for a ~1 ms decode step, and not what a user's loop over one model sees.
BLOCK = 10


def interleaved(
    steps: Sequence[Callable[[], object]], runs: int, warmup: int, block: int = BLOCK
) -> list[list[float]]:
    """Times several steps in rounds, the order rotating each round, so that noise (other
    processes, frequency changes) hits them all alike: in a round, each step runs once untimed
    (back to steady state after the others) and then `block` times timed. A single step just
    runs `runs` times. Returns the `runs` samples of each step."""
    if runs < 1 or warmup < 0 or block < 1:
        raise ValueError(
            f"runs and block must be positive and warmup not negative ({runs}, {block}, {warmup})"
        )
    for step in steps:
        for _ in range(warmup):
            step()
    times: list[list[float]] = [[] for _ in steps]
    clock = time.perf_counter
    several = len(steps) > 1
    r = 0
    while len(times[0]) < runs:
        for k in range(len(steps)):
            i = (r + k) % len(steps)
            step = steps[i]
            if several:
                step()
            for _ in range(min(block, runs - len(times[i]))):
                t0 = clock()
                step()
                times[i].append(clock() - t0)
        r += 1
    return times
