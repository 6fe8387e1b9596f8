#!/usr/bin/env python3
"""Graph work per pass, and optimize + save against cp (issue 12).

Graph work is optimize minus load and save: the model is loaded first, then
`fastopt.optimize(model, preset=...)` runs without an output, timed around the call (so the pass
manager's own time between passes counts). Each model runs --repeat times in this process; the
table gives the minimum and median wall time, the minimum CPU time of this thread (robust to
other processes on a shared machine), the manager's share (wall minus the passes' own times) and
the passes that cost most (their time summed over the preset's runs of them, minimum over the
repeats).

  fixtures   tests/fixtures/models/*, --preset default (target <= 10 ms each)
  large      the TorchScript Qwen2-0.5B export, --preset llm --kv-cache inplace (<= 100 ms)
  save       the same export: `fastopt optimize ... -o OUT` (load + graph work + save) against
             `cp model.onnx model.onnx.data OUT/`, each in a fresh process, interleaved,
             --save-repeat rounds after a warm-up round; time inside the child for fastopt
             (imports excluded), the whole process for cp (target: <= 1.2x)

    python bench/pipeline/bench_graph_work.py          # all three, writes the results file
    python bench/pipeline/bench_graph_work.py --only fixtures --out /tmp/gw.md
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
LARGE = Path("/tmp/fastopt-bench/qwen2_0.5b_ts/model.onnx")
FIXTURE_TARGET_MS = 10.0
LARGE_TARGET_MS = 100.0
SAVE_TARGET = 1.2

_CHILD = """
import sys, time, fastopt
t0 = time.perf_counter()
model = fastopt.load(sys.argv[1])
t1 = time.perf_counter()
kw = {} if sys.argv[3] == "1" else {"fsync": False}  # (--against builds may predate it)
r = fastopt.optimize(model, output=sys.argv[2], preset="llm", kv_cache="inplace", **kw)
t2 = time.perf_counter()
print(t2 - t0, t1 - t0, sum(p.seconds for p in r.passes))
"""


def graph_work(path: str, preset: str, kv_cache: str | None, repeat: int) -> dict[str, object]:
    import fastopt

    walls, cpus, managers = [], [], []
    per_pass: dict[str, list[float]] = defaultdict(list)
    nodes = 0
    for _ in range(repeat):
        model = fastopt.load(path)
        c0, t0 = time.thread_time(), time.perf_counter()
        report = fastopt.optimize(model, preset=preset, kv_cache=kv_cache)  # type: ignore[arg-type]
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        walls.append(wall)
        cpus.append(cpu)
        managers.append(wall - sum(p.seconds for p in report.passes))
        sums: dict[str, float] = defaultdict(float)
        for p in report.passes:
            sums[p.name] += p.seconds
        for name, s in sums.items():
            per_pass[name].append(s)
        nodes = report.nodes_after
    top = sorted(((min(v), k) for k, v in per_pass.items()), reverse=True)
    return {
        "min": min(walls),
        "median": statistics.median(walls),
        "cpu": min(cpus),
        "manager": min(managers),
        "top": top,
        "nodes": nodes,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def fixtures(repeat: int) -> list[str]:
    import fastopt

    paths = sorted(glob.glob(str(REPO / "tests/fixtures/models/*/model.onnx")))
    fastopt.optimize(fastopt.load(paths[0]))  # imports and first-call costs outside the table
    rows, mins, cpus = [], [], []
    pass_total: dict[str, float] = defaultdict(float)
    for p in paths:
        r = graph_work(p, "default", None, repeat)
        mins.append(float(r["min"]))  # type: ignore[arg-type]
        cpus.append(float(r["cpu"]))  # type: ignore[arg-type]
        for s, name in r["top"]:  # type: ignore[attr-defined]
            pass_total[name] += s
        top3 = ", ".join(f"{n} {_ms(s)}" for s, n in r["top"][:3])  # type: ignore[index]
        rows.append(
            f"| {Path(p).parent.name} | {r['nodes']} | {_ms(r['min'])} | {_ms(r['median'])} | "  # type: ignore[arg-type]
            f"{_ms(r['cpu'])} | {_ms(r['manager'])} | {top3} |"  # type: ignore[arg-type]
        )
        print(rows[-1], flush=True)
    over = [Path(p).parent.name for p, m in zip(paths, mins) if m * 1e3 > FIXTURE_TARGET_MS]
    lines = [
        f"## Fixtures ({len(paths)}), `--preset default`",
        "",
        f"- graph work, minimum wall over the fixtures' minima: {_ms(min(mins))} ms .. "
        f"{_ms(max(mins))} ms (target <= {FIXTURE_TARGET_MS:.0f} ms; over: "
        f"{', '.join(over) or 'none'}); CPU {_ms(min(cpus))} .. {_ms(max(cpus))} ms; "
        f"sum over the fixtures {_ms(sum(mins))} ms wall, {_ms(sum(cpus))} ms CPU",
        "",
        "| model | nodes after | wall min (ms) | wall median | CPU min | manager | "
        "costliest passes (ms) |",
        "|---|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "Passes summed over all fixtures (minimum per fixture, ms):",
        "",
        "| pass | ms |",
        "|---|---:|",
        *(
            f"| {n} | {_ms(s)} |"
            for n, s in sorted(pass_total.items(), key=lambda kv: -kv[1])
            if s >= 0.5e-3
        ),
        "",
    ]
    return lines


def large(repeat: int) -> list[str]:
    r = graph_work(str(LARGE), "llm", "inplace", repeat)
    top = ", ".join(f"{n} {_ms(s)}" for s, n in r["top"][:8])  # type: ignore[index]
    return [
        "## TorchScript Qwen2-0.5B export, `--preset llm --kv-cache inplace`",
        "",
        f"- graph work: wall min {_ms(r['min'])} ms, median {_ms(r['median'])} ms, CPU min "  # type: ignore[arg-type]
        f"{_ms(r['cpu'])} ms, manager {_ms(r['manager'])} ms (target <= "  # type: ignore[arg-type]
        f"{LARGE_TARGET_MS:.0f} ms); {r['nodes']} nodes after",
        f"- costliest passes (ms): {top}",
        "",
    ]


_FILES = ("model.onnx", "model.onnx.data")


def _cp(src_dir: Path, out: Path, fsync: bool) -> list[float]:
    """cp's wall time; with fsync, the copies are then fsynced too, as fastopt's save does."""
    t0 = time.perf_counter()
    subprocess.run(["cp", *(str(src_dir / f) for f in _FILES), str(out)], check=True)
    if fsync:
        for f in _FILES:
            fd = os.open(out / f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return [time.perf_counter() - t0]


def _fastopt(src: Path, out: Path, python: str = sys.executable, fsync: bool = True) -> list[float]:
    """[total, load, passes] inside the child (the rest of the total is the save)."""
    done = subprocess.run(
        [python, "-c", _CHILD, str(src), str(out / "model.onnx"), "1" if fsync else "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    return [float(x) for x in done.stdout.strip().splitlines()[-1].split()]


def save_vs_cp(rounds: int, against: str | None = None) -> list[str]:
    modes = ("cp", "fastopt", "cp+fsync", "no-fsync", *(("against",) if against else ()))
    times: dict[str, list[list[float]]] = {m: [] for m in modes}
    work = Path(tempfile.mkdtemp(prefix="gw-save-", dir=str(LARGE.parent.parent)))
    try:
        for i in range(rounds + 1):  # round 0 warms the page cache
            for mode in modes:
                out = work / mode
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                subprocess.run(["sync"], check=True)
                if mode == "fastopt":
                    t = _fastopt(LARGE, out)
                elif mode == "no-fsync":
                    t = _fastopt(LARGE, out, fsync=False)
                elif mode == "against":
                    t = _fastopt(LARGE, out, against or "")
                else:
                    t = _cp(LARGE.parent, out, fsync=mode == "cp+fsync")
                if i:
                    times[mode].append(t)
                shutil.rmtree(out, ignore_errors=True)
            print("round", i, {k: v[-1:] for k, v in times.items()}, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = {m: [t[0] for t in times[m]] for m in modes}
    med = {m: statistics.median(total[m]) for m in modes}
    ratios = [f / c for f, c in zip(total["fastopt"], total["cp"])]
    load = statistics.median(t[1] for t in times["fastopt"])
    passes = statistics.median(t[2] for t in times["fastopt"])
    size = sum(os.path.getsize(LARGE.parent / f) for f in _FILES)

    def runs(m: str) -> str:
        return ", ".join(f"{t:.2f}" for t in total[m])

    return [
        "## optimize + save against cp (same export, same run)",
        "",
        f"- input {size / 1e9:.2f} GB; {rounds} interleaved rounds after a warm-up round, `sync` "
        "before each run, fresh process each, outputs on the same filesystem",
        f"- cp: median {med['cp']:.2f} s ({runs('cp')})",
        f"- fastopt: load + optimize(--preset llm --kv-cache inplace, output=OUT): median "
        f"{med['fastopt']:.2f} s ({runs('fastopt')}); of it load {load * 1e3:.0f} ms, passes "
        f"{passes * 1e3:.0f} ms, the rest the save (which fsyncs every file it writes)",
        f"- cp followed by fsync of the copies: median {med['cp+fsync']:.2f} s "
        f"({runs('cp+fsync')})",
        f"- fastopt / cp: ratio of medians {med['fastopt'] / med['cp']:.2f}x, per round "
        f"{', '.join(f'{r:.2f}' for r in ratios)} (target <= {SAVE_TARGET}x); fastopt / "
        f"(cp + fsync) {med['fastopt'] / med['cp+fsync']:.2f}x",
        f"- fastopt with fsync=False (`--no-fsync`: no writeback, no fsync, as cp): median "
        f"{med['no-fsync']:.2f} s ({runs('no-fsync')}); / cp: ratio of medians "
        f"{med['no-fsync'] / med['cp']:.2f}x, per round "
        f"{', '.join(f'{f / c:.2f}' for f, c in zip(total['no-fsync'], total['cp']))}",
        *(
            [
                f"- the same under `{against}` (--against, interleaved): median "
                f"{med['against']:.2f} s ({runs('against')}); this fastopt / that one "
                f"{med['fastopt'] / med['against']:.2f}x"
            ]
            if against
            else []
        ),
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--save-repeat", type=int, default=3)
    ap.add_argument("--only", choices=["fixtures", "large", "save"], action="append")
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--against",
        metavar="PYTHON",
        help="save: also time the child under this interpreter (another fastopt build), "
        "interleaved in the same rounds",
    )
    ap.add_argument("--out", default=str(BENCH / "results" / "graph_work.md"))
    a = ap.parse_args()
    parts = a.only or ["fixtures", "large", "save"]
    import fastopt

    load = os.getloadavg()[0]
    lines = [
        f"# Graph work and optimize + save vs cp {a.label}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; fastopt "
        f"{fastopt.__file__}; {os.cpu_count()} cores, load average {load:.1f} at the start",
        f"- `python bench/pipeline/bench_graph_work.py`; --repeat {a.repeat}",
        "",
    ]
    if "fixtures" in parts:
        lines += fixtures(a.repeat)
    if "large" in parts and LARGE.exists():
        lines += large(a.repeat)
    if "save" in parts and LARGE.exists():
        lines += save_vs_cp(a.save_repeat, a.against)
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
