"""Shared by the benchmark scripts in bench/: running one measurement per fresh process
(wall time and peak RSS from wait4), the child's result line, the machine and versions for a
results header, a snapshot of the installed fastopt, and number formatting.

Standard library only: the benchmark parents import this, and Linux carries a parent's RSS
high-water mark into an exec'd child's ru_maxrss, so a fat parent would inflate every
measurement.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MB = 1024 * 1024
RESULT_TAG = "@@RESULT "  # the child's result line: tools may print their own chatter


def proc_status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def spawn(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int, float, int, str, str]:
    """Run cmd; (exit code, wall seconds, peak RSS bytes, stdout, stderr). wait4 gives this
    child's own rusage (RUSAGE_CHILDREN would be the max over all children)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                _, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)  # already reaped: tell Popen
        out.seek(0)
        err.seek(0)
        return (
            p.returncode,
            wall,
            usage.ru_maxrss * 1024,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
        )


def result_line(out: str) -> dict[str, Any]:
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG) :]))
    raise ValueError("no result line")


def error_text(rc: int, err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else f"exit code {rc}")[:300]


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def mem_total() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def git(*args: str) -> str:
    res = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else "unknown"


def fastopt_dir() -> str | None:
    spec = importlib.util.find_spec("fastopt")  # top-level: finds without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(next(iter(spec.submodule_search_locations)))


def install_stamp(folder: str) -> str:
    """(path, size, mtime) of every file of the installed package, skipping bytecode caches."""
    stamp = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            st = os.stat(os.path.join(root, name))
            stamp.append(
                f"{os.path.relpath(os.path.join(root, name), folder)}:{st.st_size}:{st.st_mtime_ns}"
            )
    return ";".join(stamp)


def snapshot_fastopt(dest: str) -> str:
    """Copy the installed fastopt into dest/fastopt and return dest, for the children's
    PYTHONPATH: fastopt gets reinstalled while others work, and a reinstall in the middle of a
    run would mix two builds in one table. Retries while the install is being rewritten."""
    folder = fastopt_dir()
    if folder is None:
        raise RuntimeError("fastopt is not installed")
    for _ in range(10):
        before = install_stamp(folder)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(
            folder, os.path.join(dest, "fastopt"), ignore=shutil.ignore_patterns("__pycache__")
        )
        if install_stamp(folder) == before:
            return dest
        time.sleep(5)
    raise RuntimeError(f"{folder} kept changing while it was copied")


def environment(dists: list[str]) -> dict[str, Any]:
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {d: version(d) for d in dists},
        "fastopt_commit": git("describe", "--always", "--dirty"),
    }


def fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 0.01:
        return f"{s * 1000:.2f} ms"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def fmt_mb(b: float | None) -> str:
    return "-" if b is None else f"{b / MB:,.0f} MB"
