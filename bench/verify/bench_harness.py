#!/usr/bin/env python3
"""Overhead of fastopt.bench's timing loop against a bare ``session.run`` loop.

Both time the same session on the same feeds (the Runner's), in alternating blocks so that
machine noise hits both alike; the difference of the medians is what the harness adds per run.

    python bench/verify/bench_harness.py MODEL [--phase decode] [--seq 16] [--runs 2000]
        [--blocks 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import fastopt.bench as bench
from fastopt.bench.timing import measure


def bare_loop(session: object, feeds: dict, runs: int) -> list[float]:
    run = session.run  # type: ignore[attr-defined]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run(None, feeds)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--phase", default="prefill")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=5)
    args = ap.parse_args()
    with bench.Runner(args.model, provider="cpu", phase=args.phase, seq=args.seq) as runner:
        if runner.io_binding:
            raise SystemExit("pick a model the harness runs with a plain session.run")
        feeds = runner.workload.feeds
        bare: list[float] = []
        harness: list[float] = []
        measure(runner.step, runs=100, warmup=0)  # warm-up
        for _ in range(args.blocks):
            bare += bare_loop(runner.session, feeds, args.runs)
            harness += measure(runner.step, runs=args.runs, warmup=0)
    b, h = statistics.median(bare), statistics.median(harness)
    print(f"{args.model} {args.phase} seq {args.seq}: {args.blocks} x {args.runs} runs each")
    print(f"bare session.run loop: median {b * 1e6:.1f} us")
    print(f"fastopt.bench loop:    median {h * 1e6:.1f} us")
    print(f"difference: {(h - b) * 1e6:+.2f} us ({(h - b) / b:+.2%})")


if __name__ == "__main__":
    main()
