"""`fastopt quantize` as a user runs it against the peers' own commands, interleaved: wall time,
user and system CPU and peak RSS of each whole process (Python start, imports, load, work, save
and, for fastopt, its run check and fsync), the 1-minute load average at each start.

    python bench/quant/bench_quantize_cli.py MODEL [--modes int4,int8-dynamic] [--runs 3]
                                             [--baseline-python /path/to/other/python]

int4: `fastopt quantize MODEL -o OUT --mode int4` (block 32, symmetric, accuracy level 4: its
defaults) against `python -m onnxruntime.quantization.matmul_nbits_quantizer --input_model MODEL
--output_model OUT --block_size 32 --symmetric True --accuracy_level 4` (its own command line:
it saves with external data and neither fsyncs nor checks its output). int8-dynamic: `fastopt
quantize --mode int8-dynamic` against onnxruntime.quantization.quantize_dynamic(weight_type
QInt8, use_external_data_format=True), which has no command line. fastopt runs twice per round:
as it comes (run check and fsync included), and with --no-run-check, so that the check's cost
is stated. Peers run under `flock /tmp/heavy.lock` (the machine's rule for multi-GB jobs), or
the whole bench does: `flock /tmp/heavy.lock python bench/quant/bench_quantize_cli.py ...
--peer-lock ''`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
import _benchlib as bl

PEER_INT8 = (
    "import sys; from onnxruntime.quantization import QuantType, quantize_dynamic; "
    "quantize_dynamic(sys.argv[1], sys.argv[2], weight_type=QuantType.QInt8, "
    "use_external_data_format=True)"
)


def commands(mode: str, model: str, out: str, lock: str, baseline: str) -> dict[str, list[str]]:
    fastopt = [sys.executable, "-m", "fastopt", "quantize", model, "-o", out, "--mode", mode]
    if mode == "int4":
        peer = [sys.executable, "-m", "onnxruntime.quantization.matmul_nbits_quantizer",
                "--input_model", model, "--output_model", out, "--block_size", "32",
                "--symmetric", "True", "--accuracy_level", "4"]  # fmt: skip
    else:
        peer = [sys.executable, "-c", PEER_INT8, model, out]
    cmds = {
        "fastopt": fastopt,
        "fastopt --no-run-check": [*fastopt, "--no-run-check"],
        "peer": ["flock", lock, *peer] if lock else peer,
    }
    if baseline:  # another install's fastopt (main's) in the same rounds
        cmds["fastopt (baseline)"] = [baseline, *fastopt[1:]]
    return cmds


def run(cmd: list[str], out_dir: str, make_folder: bool) -> dict[str, Any]:
    shutil.rmtree(out_dir, ignore_errors=True)
    if make_folder:  # (MatMulNBitsQuantizer's save needs the output folder; fastopt makes it)
        os.makedirs(out_dir)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    log = os.path.join(os.path.dirname(out_dir), "stderr.txt")
    with open(log, "w") as f:  # (a pipe would fill up with the peer's log and block it)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
        _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = Path(log).read_text(errors="replace")
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({status}):\n{err[-2000:]}")
    size = sum(p.stat().st_size for p in Path(out_dir).iterdir())
    return {"wall": wall, "user": ru.ru_utime, "sys": ru.ru_stime,
            "rss": ru.ru_maxrss * 1024, "load": load, "size": size}  # fmt: skip


def summary(rows: list[dict[str, Any]]) -> str:
    walls = [r["wall"] for r in rows]
    cpus = [r["user"] + r["sys"] for r in rows]
    each = ", ".join(
        f"{r['wall']:.2f} s ({r['user']:.2f} u + {r['sys']:.2f} s, load {r['load']:.1f})"
        for r in rows
    )
    return (
        f"{min(walls):.2f} | {statistics.median(walls):.2f} | {min(cpus):.2f} | "
        f"{statistics.median(cpus):.2f} | {bl.fmt_mb(max(r['rss'] for r in rows))} | "
        f"{bl.fmt_mb(rows[0]['size'])} | {each}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--modes", default="int4,int8-dynamic")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", default="/tmp/fastopt-bench-quantize-cli")
    ap.add_argument(
        "--peer-lock",
        default="/tmp/heavy.lock",
        help="flock file for the peers' runs; '' when the whole bench runs under it",
    )
    ap.add_argument(
        "--baseline-python",
        default="",
        help="also run `fastopt quantize` with this interpreter's fastopt (e.g. main's install)",
    )
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {bl.cpu_model()}, "
          f"{os.cpu_count()} cores; model {a.model}")  # fmt: skip
    for mode in a.modes.split(","):
        out = os.path.join(a.work, "out", "model.onnx")
        cmds = commands(mode, a.model, out, a.peer_lock, a.baseline_python)
        rows: dict[str, list[dict[str, Any]]] = {k: [] for k in cmds}
        for i in range(a.runs):
            for name, cmd in cmds.items():
                rows[name].append(run(cmd, os.path.dirname(out), name == "peer"))
                print(f"  {mode} {name} run {i + 1}: {rows[name][-1]}", flush=True)
        print(f"\n{mode}\n")
        print("| command | wall min | wall median | CPU min | CPU median | peak RSS | output | "
              "each run |")  # fmt: skip
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for name, rs in rows.items():
            print(f"| {name} | {summary(rs)} |")
        peer = rows["peer"]
        for name in [k for k in rows if k != "peer"]:
            ours = rows[name]
            ratio = [p["wall"] / o["wall"] for p, o in zip(peer, ours)]
            cpu = [(p["user"] + p["sys"]) / (o["user"] + o["sys"]) for p, o in zip(peer, ours)]
            best = min(p["wall"] for p in peer) / min(o["wall"] for o in ours)
            walls = ", ".join(f"{r:.1f}x" for r in ratio)
            cpus = ", ".join(f"{r:.1f}x" for r in cpu)
            print(f"\npeer / {name}, per round: wall {walls}; CPU {cpus}; min/min wall {best:.1f}x")


if __name__ == "__main__":
    main()
