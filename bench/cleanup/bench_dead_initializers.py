"""Time eliminate_dead_nodes on Y = Identity(X) plus N float scalars nothing reads.

    python bench/cleanup/bench_dead_initializers.py 100000 200000 1000000

Prints one line per N: the pass's own time (load excluded), in a fresh process each, so that a
slow N can be stopped (--timeout, default 600 s) without losing the others.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CHILD = """
import sys, time
sys.path.insert(0, sys.argv[2])
import fastopt
from fastopt import _C
from test_scale import dead_initializers_model
n = int(sys.argv[1])
model = fastopt.load_bytes(dead_initializers_model(n))
start = time.perf_counter()
rewrites, _ = _C.run_pass(model, "eliminate_dead_nodes")
print(f"{time.perf_counter() - start:.3f} {rewrites}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="+", type=int)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    tests = str(Path(__file__).resolve().parents[2] / "tests" / "io")
    for n in args.n:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(n), tests],
                capture_output=True,
                text=True,
                timeout=args.timeout,
                check=True,
            )
            seconds, rewrites = proc.stdout.split()
            print(f"{n:>9} dead initializers: {float(seconds):8.3f} s ({rewrites} removed)")
        except subprocess.TimeoutExpired:
            print(f"{n:>9} dead initializers: not finished in {args.timeout:.0f} s")


if __name__ == "__main__":
    main()
