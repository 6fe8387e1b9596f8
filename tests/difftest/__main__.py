"""Campaigns and replays from the command line (run from the repository root):

    python -m tests.difftest --runs 300 --seed 7            # a sampled campaign
    python -m tests.difftest --case KEY                     # one case again (KEY as printed)
    python -m tests.difftest --case KEY --save DIR          # minimize it, keep it as a model
    python -m tests.difftest --kinds cumsum_over_sequence --modes 'llm/ort/kv=*/q=none' --runs 20

Prints one line per case (status, key, detail) and a summary; exits 1 when a run had a finding
that KNOWN (known.py) does not expect.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from fnmatch import fnmatch

from .cases import Case, sample
from .known import known_reason
from .regressions import minimize, save_regression
from .worker import Worker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.difftest", description=__doc__)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", action="append", default=[], help="a case key to run (repeatable)")
    ap.add_argument("--kinds", default="*", help="fnmatch pattern(s), comma-separated")
    ap.add_argument("--modes", default="*", help="fnmatch pattern over preset/target/kv=/q=")
    ap.add_argument("--fixtures", default="*", help="fnmatch pattern over fixture names")
    ap.add_argument("--all-dtypes", action="store_true", help="float16 exports too")
    ap.add_argument("--save", metavar="DIR", help="save each finding as a regression model")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)

    if args.case:
        cases = [Case.parse(k) for k in args.case]
    else:
        kinds = args.kinds.split(",")
        pool = sample(args.seed, args.runs * 20, None if args.all_dtypes else "float32")
        cases = [
            c
            for c in pool
            if any(fnmatch(c.mutation, k) for k in kinds)
            and fnmatch(str(c.mode), args.modes)
            and fnmatch(c.fixture, args.fixtures)
        ][: args.runs]
    worker = Worker(args.timeout)
    counts: Counter[str] = Counter()
    unexpected = 0
    start = time.monotonic()
    try:
        for case in cases:
            t0 = time.monotonic()
            outcome = worker.run(case)
            status = outcome.status
            if outcome.finding:
                reason = known_reason(case)  # (reason, strict) or None
                status = "known" if reason else "FINDING"
                unexpected += reason is None
                if args.save:
                    small, small_outcome = minimize(case, outcome, worker.run)
                    path = save_regression(small, small_outcome, args.save)
                    print(f"  saved {path} ({small.key})")
            counts[status] += 1
            print(
                f"{status:8} {case.key}  [{outcome.stage}] {outcome.detail}"
                f"  ({time.monotonic() - t0:.1f} s)",
                flush=True,
            )
            if outcome.finding:
                print(f"  rerun: {case.command}", flush=True)
    finally:
        worker.close()
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"{len(cases)} runs in {time.monotonic() - start:.0f} s: {summary}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
