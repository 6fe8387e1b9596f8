"""Where ``fastopt export``'s memory goes: peak RSS per phase of one export, in process.

The export runs through ``fastopt.export.export`` with a progress callback; each progress
message starts a phase (reading, loading, the PyTorch check outputs, torch.onnx, the save, the
check in ONNX Runtime, each optimize pass, quantization, the run check and write). At each
phase boundary the process's peak RSS (``VmHWM``) is read and reset (writing 5 to
``/proc/self/clear_refs``), so every phase gets its own exact peak; a sampler thread (every
20 ms) splits the RSS into anonymous memory (what the process allocated) and file pages (mapped
checkpoint and data files, which the kernel can drop and re-read). CPU time (user+sys of the
process) and the load average are recorded beside the wall time: the machine is shared.

    flock /tmp/heavy.lock python bench/export/bench_export_memory.py --sizes 0.5b,1.5b \
        [--quantize int4] [--builder 0.5b] [--models-dir /tmp/x-export-bench] [--out F.json]

The checkpoints are bench_export.py's (random Qwen2 of the 0.5B / 1.5B shape, fp32,
save_pretrained, a word-level tokenizer). With --builder the model builder runs on the same
checkpoint right after (one process, wait4's ru_maxrss), and both int4 folders' decode speed is
measured interleaved (bench_export.decode_speed, best of --rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_export
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
import contextlib

import _benchlib as bl

MB = 1 << 20
_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in _KEYS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class PhaseMeter:
    """Per phase: wall, CPU, exact peak RSS (VmHWM since the phase began) and the sampled
    maxima of anonymous and file-backed RSS."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._anon = self._file = 0
        self._stop = False
        self._name = "start"
        self._t = time.perf_counter()
        self._cpu = cpu_seconds()
        reset_peak()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop:
            s = status()
            with self._lock:
                self._anon = max(self._anon, s.get("RssAnon", 0))
                self._file = max(self._file, s.get("RssFile", 0))
            time.sleep(0.02)

    def phase(self, name: str) -> None:
        s = status()
        now, cpu = time.perf_counter(), cpu_seconds()
        with self._lock:
            self.rows.append(
                {
                    "phase": self._name,
                    "seconds": round(now - self._t, 2),
                    "cpu_s": round(cpu - self._cpu, 2),
                    "peak_rss": s["VmHWM"],
                    "anon_max": max(self._anon, s["RssAnon"]),
                    "file_max": max(self._file, s["RssFile"]),
                    "rss_end": s["VmRSS"],
                }
            )
            self._anon, self._file = s["RssAnon"], s["RssFile"]
        reset_peak()
        self._name, self._t, self._cpu = name, now, cpu
        print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)

    def close(self) -> None:
        self.phase("end")
        self._stop = True


def child(hf: str, out: str, quantize: str | None, exporter: str) -> dict[str, Any]:
    meter = PhaseMeter()
    meter.phase("import fastopt")
    import fastopt

    t0, c0 = time.perf_counter(), cpu_seconds()
    report = fastopt.export(
        hf,
        out,
        exporter=exporter,  # type: ignore[arg-type]
        quantize=quantize,
        progress=meter.phase,
    )
    meter.close()
    return {
        "seconds": time.perf_counter() - t0,
        "cpu_s": cpu_seconds() - c0,
        "checkpoint_bytes": report.checkpoint_bytes,
        "phases": meter.rows,
        "report_seconds": report.seconds,
        # PyTorch's half (load, check outputs, torch.onnx, save) runs in a process of its own
        "torch_peak_rss": getattr(report, "torch_peak_rss", 0),
    }


def group(phase: str) -> str:
    """A phase's row in the table: the optimize passes apart from quantization and the run
    check are one row (their maximum)."""
    if phase.startswith("optimize "):
        rest = phase.split(": ", 1)[1]
        if rest.startswith(("quantize", "run check", "loading")):
            return "optimize: " + rest.split(" (")[0]
        return "optimize: passes"
    if phase.startswith("loading "):
        return "transformers load"
    return phase.split(" (")[0] if phase.startswith("torch.onnx") else phase


def table(rows: list[dict[str, Any]], ckpt: int) -> str:
    merged: dict[str, dict[str, Any]] = {}
    for r in rows:
        g = group(r["phase"])
        m = merged.setdefault(g, {"seconds": 0.0, "cpu_s": 0.0, "peak_rss": 0, "anon_max": 0})
        m["seconds"] += r["seconds"]
        m["cpu_s"] += r["cpu_s"]
        if r["peak_rss"] > m["peak_rss"]:
            m["peak_rss"], m["at"] = r["peak_rss"], r["phase"]
        m["anon_max"] = max(m["anon_max"], r["anon_max"])
    lines = [
        "| phase | wall | CPU | peak RSS | / checkpoint | anon max |",
        "|---|---|---|---|---|---|",
    ]
    for g, m in merged.items():
        lines.append(
            f"| {g} | {m['seconds']:.1f} s | {m['cpu_s']:.1f} s | {m['peak_rss'] / MB:,.0f} MB "
            f"| {m['peak_rss'] / ckpt:.2f}x | {m['anon_max'] / MB:,.0f} MB |"
        )
    return "\n".join(lines)


def _spawn(cmd: list[str], what: str) -> dict[str, Any]:
    print(f"{what}: {' '.join(cmd)}  (load {os.getloadavg()[0]:.1f})", flush=True)
    t0 = os.times()
    rc, wall, rss, out, err = bl.spawn(cmd, timeout=3 * 3600, max_rss=20 << 30)
    t1 = os.times()
    cpu = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    row: dict[str, Any] = {
        "cmd": " ".join(cmd),
        "rc": rc,
        "seconds": wall,
        "cpu_s": cpu,
        "peak_rss": rss,
        "load_after": os.getloadavg()[0],
    }
    if rc != 0:
        row["error"] = bl.error_text(rc, err)
    else:
        with contextlib.suppress(ValueError):
            row["result"] = bl.result_line(out)
    print(f"  rc {rc}, {wall:.0f} s wall, {cpu:.0f} s CPU, peak RSS {rss / MB:,.0f} MB", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b")
    ap.add_argument("--quantize", default="int4", help="'' for none")
    ap.add_argument("--exporter", default="dynamo")
    ap.add_argument("--builder", default="", help="sizes the model builder also runs on")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models-dir", default="/tmp/x-export-bench")
    ap.add_argument("--out", default="/tmp/x-export-bench/export_memory.json")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child(args.child[0], args.child[1], args.quantize or None, args.exporter)
        print(bl.RESULT_TAG + json.dumps(result), flush=True)
        return
    import bench_export as be

    results: dict[str, Any] = {"environment": bl.environment(["torch", "transformers"])}
    if Path(args.out).exists():
        results.update(json.loads(Path(args.out).read_text()))
    py = sys.executable
    for size in args.sizes.split(","):
        base = Path(args.models_dir) / size
        hf = base / "hf"
        if not (hf / "config.json").exists():
            code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            code += f"import bench_export as b; b.make_hf({size!r}, {str(hf)!r})"
            _spawn([py, "-c", code], f"{size} checkpoint")
        ckpt = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        tag = f"{size}_{args.quantize or 'fp32'}_{args.exporter}"
        out = base / f"fastopt_{args.quantize or 'fp32'}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [py, __file__, "--child", str(hf), str(out), "--quantize", args.quantize]
        row = _spawn([*cmd, "--exporter", args.exporter], f"{size} fastopt export")
        row["checkpoint_bytes"] = ckpt
        if "result" in row:
            # (wait4's ru_maxrss is the last phase's: resetting VmHWM resets it too)
            row["peak_rss"] = max(r["peak_rss"] for r in row["result"]["phases"])
            print(table(row["result"]["phases"], ckpt), flush=True)
            torch_peak = row["result"].get("torch_peak_rss", 0)
            if torch_peak:
                row["torch_peak_rss"] = torch_peak
                print(
                    f"PyTorch process peak RSS {torch_peak / MB:,.0f} MB "
                    f"({torch_peak / ckpt:.2f}x)",
                    flush=True,
                )
        if size in args.builder.split(","):
            bdir = base / "builder_int4"
            shutil.rmtree(bdir, ignore_errors=True)
            bcmd = [py, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(bdir)]
            row["builder"] = _spawn([*bcmd, "-p", "int4", "-e", "cpu"], f"{size} builder")
            folders = {"fastopt": out, "builder": bdir}
            speeds: dict[str, list[dict[str, Any]]] = {k: [] for k in folders}
            for _ in range(args.rounds):
                for tool, folder in folders.items():
                    if not (folder / "genai_config.json").exists():
                        continue
                    rc, _, _, o, err = bl.spawn(
                        [py, be.__file__, "--decode", str(folder)], timeout=1800
                    )
                    if rc == 0:
                        speeds[tool].append(bl.result_line(o) | {"load": os.getloadavg()[0]})
                    else:
                        print(f"  decode {tool}: {bl.error_text(rc, err)}", flush=True)
            row["decode"] = speeds
            for tool, runs in speeds.items():
                print(f"  decode {tool}: {[round(r['tokens_per_s'], 2) for r in runs]}")
        results[tag] = row
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
