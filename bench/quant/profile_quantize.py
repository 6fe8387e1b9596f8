"""Where the wall time of ``fastopt quantize SRC -o OUT --mode MODE`` goes: one child process per
run, as a user runs the command, with timers around its phases (Python start, ``import
fastopt.cli.main``, parsing the arguments, loading the model, the quantization pass, the run
check, the save, the rest), each phase's wall time and the process's user+sys CPU in it (the run
check's forked child included), and the whole process's wall time, CPU and peak RSS.

    python bench/quant/profile_quantize.py MODEL --mode int4 [--runs 3] [-- EXTRA CLI ARGS]

The timers wrap module attributes the CLI calls through (fastopt.optimize.load, quantize_step,
start_run_check, fastopt._C.Model.save, PendingCheck.finish): nothing in fastopt is changed.
The save's own split (bytes written, fsync) is in the strace summary: ``--strace`` runs the
child under ``strace -f -c``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
import _benchlib as bl

# The child: times its own phases and prints them as one JSON line.
CHILD = r"""
import json, os, resource, sys, time
t_start = time.time()
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
phases = []
mark = [time.perf_counter(), cpu()]
def lap(name):
    now, c = time.perf_counter(), cpu()
    phases.append({"phase": name, "wall": now - mark[0], "cpu": c - mark[1]})
    mark[0], mark[1] = now, c
import fastopt.cli.main as cli
lap("import fastopt.cli.main")
opt = sys.modules['fastopt.optimize']
from fastopt import _C
def timed(name, fn):
    def wrapper(*a, **k):
        lap("(between)")
        try:
            return fn(*a, **k)
        finally:
            lap(name)
    return wrapper
opt.load = timed("load (parse, map)", opt.load)
opt.quantize_step = timed("quantization pass", opt.quantize_step)
if hasattr(opt, "check_runs"):  # before the check ran beside the save (main before q5-speed)
    opt.check_runs = timed("run check", opt.check_runs)
else:
    opt.start_run_check = timed("run check (fork its child)", opt.start_run_check)
_C.Model.save = timed("save (write, fsync; the check's child ends)", _C.Model.save)
# The check's child runs beside the save, which waits for it before naming its files: that
# wait is inside the save's wall time (and the child's CPU in its CPU, counted when reaped).
from fastopt.verify import run_check as rcheck
waited = [0.0]
def timed_finish(self, finish=getattr(rcheck, "PendingCheck", None) and rcheck.PendingCheck.finish):
    t = time.perf_counter()
    try:
        return finish(self)
    finally:
        waited[0] += time.perf_counter() - t
if hasattr(rcheck, "PendingCheck"):
    rcheck.PendingCheck.finish = timed_finish
rc = cli.main(sys.argv[1:])
lap("(between)")
merged = {}
for p in phases:
    m = merged.setdefault(p["phase"], {"phase": p["phase"], "wall": 0.0, "cpu": 0.0})
    m["wall"] += p["wall"]; m["cpu"] += p["cpu"]
merged["wait"] = {"phase": "(in the save: waiting for the check)", "wall": waited[0], "cpu": None}
print("@@RESULT@@" + json.dumps({"rc": rc, "t_start": t_start, "phases": list(merged.values())}),
      file=sys.stderr, flush=True)
"""


def run_once(args: argparse.Namespace, out_dir: str, python: str) -> dict[str, Any]:
    shutil.rmtree(out_dir, ignore_errors=True)
    if args.existing_folder:
        os.makedirs(out_dir)
    cmd = [python, "-c", CHILD, "quantize", args.model, "-o",
           os.path.join(out_dir, "model.onnx"), "--mode", args.mode, *args.extra]  # fmt: skip
    if args.strace:
        cmd = ["strace", "-f", "-c", "-w", "-o", os.path.join(args.work, "strace.txt"), *cmd]
    load = os.getloadavg()[0]
    t0 = time.time()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    lines = [ln for ln in err.splitlines() if ln.startswith("@@RESULT@@")]
    if not lines:
        raise SystemExit(f"child failed ({status}):\n{err[-3000:]}")
    res = json.loads(lines[-1][len("@@RESULT@@") :])
    res["phases"].insert(0, {"phase": "Python start", "wall": res["t_start"] - t0, "cpu": None})
    res.update(wall=wall, user=ru.ru_utime, sys=ru.ru_stime, rss=ru.ru_maxrss * 1024, load=load)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--mode", default="int4")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default=tempfile.gettempdir() + "/fastopt-profile-quantize")
    ap.add_argument(
        "--existing-folder", action="store_true", help="the output folder exists before the run"
    )
    ap.add_argument("--strace", action="store_true", help="one run under strace -f -c")
    ap.add_argument(
        "--python",
        action="append",
        help="run the command with this interpreter (repeatable: the runs alternate between them, "
        "e.g. main's install and a branch's venv); default: this one",
    )
    ap.add_argument("extra", nargs="*", help="more CLI arguments (after --)")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    pythons = args.python or [sys.executable]
    order = [py for _ in range(args.runs) for py in pythons]
    runs = [run_once(args, os.path.join(args.work, "out"), py) for py in order]
    for i, py in enumerate(pythons):
        print(f"python {chr(ord('A') + i)}: {py}")
    names = list(dict.fromkeys(p["phase"] for r in runs for p in r["phases"]))
    print(f"fastopt quantize {args.model} --mode {args.mode} {' '.join(args.extra)}")
    tag = {py: chr(ord("A") + i) for i, py in enumerate(pythons)}
    heads = [f"run {i + 1} ({tag[py]}) wall / CPU" for i, py in enumerate(order)]
    print("| phase | " + " | ".join(heads) + " |")
    print("| --- |" + " ---: |" * len(runs))
    for name in names:
        cells = []
        for r in runs:
            p = next((p for p in r["phases"] if p["phase"] == name), None)
            if p is None:
                cells.append("-")
                continue
            cpu = "-" if p["cpu"] is None else f"{p['cpu']:.2f}"
            cells.append(f"{p['wall']:.2f} / {cpu} s")
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{r['wall']:.2f} / {r['user'] + r['sys']:.2f} s" for r in runs]
    print("| **process** (wall / user+sys) | " + " | ".join(cells) + " |")
    print("| user, sys | " + " | ".join(f"{r['user']:.2f}, {r['sys']:.2f}" for r in runs) + " |")
    print("| peak RSS | " + " | ".join(bl.fmt_mb(r["rss"]) for r in runs) + " |")
    print("| load (1 min) at start | " + " | ".join(f"{r['load']:.1f}" for r in runs) + " |")
    if args.strace:
        print(Path(args.work, "strace.txt").read_text())


if __name__ == "__main__":
    main()
