"""The search kernel alone against round to nearest's, in process CPU time (no mapped model read,
nothing written): a 4096 x 1024 float32 weight, int4 asymmetric blocks of 64, the search weighted
by an importance vector, best of --runs. Before the speed-up of stop 29: 8.6-9.4x; after: 5.1x
(AVX-512 machine; bench/results/quantize_accuracy.md, "q4m's cost").

    python bench/quant/bench_search_kernel.py [--runs 5]
"""

from __future__ import annotations

import argparse
import time

import fastopt
import numpy as np


def cpu_seconds(w: np.ndarray, runs: int, method: str, **kw: object) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.process_time()
        fastopt._C.quantization_error(
            w, bits=4, block_size=64, symmetric=False, method=method, **kw
        )
        best = min(best, time.process_time() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    w = np.random.default_rng(0).standard_normal((4096, 1024)).astype(np.float32)
    imp = np.random.default_rng(1).uniform(0.1, 10, 4096).astype(np.float32)
    rtn = cpu_seconds(w, args.runs, "rtn")
    search = cpu_seconds(w, args.runs, "search", importance=imp)
    print(f"round to nearest {rtn:.4f} s, search {search:.4f} s CPU: {search / rtn:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
