"""Shared by the benchmark scripts in bench/: running one measurement per fresh process
(wall time and peak RSS from wait4), the child's result line, the machine and versions for a
results header, a snapshot of the installed fastopt, number formatting, and helpers for the
children (calling the ModelProto peers, op histogram of a model, an ONNX Runtime CPU session).

Standard library only: the benchmark parents import this, and Linux carries a parent's RSS
high-water mark into an exec'd child's ru_maxrss, so a fat parent would inflate every
measurement. The child helpers import onnx / onnxruntime when called, not here.
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


def _rss(pid: int) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def spawn(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, max_rss: int = 0
) -> tuple[int, float, int, str, str]:
    """Run cmd; (exit code, wall seconds, peak RSS bytes, stdout, stderr). wait4 gives this
    child's own rusage (RUSAGE_CHILDREN would be the max over all children). The child is
    killed (exit code -9) past `timeout` seconds or, when `max_rss` is set, once its RSS
    exceeds that many bytes (checked every ~0.1 s): on a shared machine a tool that loads
    a multi-GB model whole must not take the memory of everyone else."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        deadline = t0 + timeout
        polls = 0
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            polls += 1
            too_big = max_rss and polls % 20 == 0 and _rss(p.pid) > max_rss
            if too_big or time.perf_counter() > deadline:
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


def peer_optimize(tool: str, model: Any) -> Any:
    """`onnxslim` or `onnxoptimizer` on an onnx.ModelProto, called as their READMEs show
    (defaults: onnxslim's full pipeline, onnxoptimizer's fuse-and-eliminate passes); returns
    the optimized ModelProto. onnxoptimizer serializes the proto for its C++ core and, for
    a model over 2 GB, falls back by itself to temporary files with external data."""
    if tool == "onnxslim":
        import onnxslim

        out = onnxslim.slim(model)  # without an output path it returns the model
        if out is None:
            raise RuntimeError("onnxslim.slim returned None")
        return out
    if tool == "onnxoptimizer":
        import onnxoptimizer

        return onnxoptimizer.optimize(model)  # passes=None: its fuse-and-eliminate default
    raise ValueError(f"not a ModelProto peer: {tool!r}")


def op_histogram(model: Any) -> dict[str, int]:
    """'domain::op' (plain op for ai.onnx) -> count over the graph, subgraphs and functions."""
    from onnx import AttributeProto

    hist: dict[str, int] = {}

    def walk(nodes: Any) -> None:
        for node in nodes:
            key = (
                node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
            )
            hist[key] = hist.get(key, 0) + 1
            for a in node.attribute:
                if a.type == AttributeProto.GRAPH:
                    walk(a.g.node)
                elif a.type == AttributeProto.GRAPHS:
                    for g in a.graphs:
                        walk(g.node)

    walk(model.graph.node)
    for fn in model.functions:
        walk(fn.node)
    return hist


def ort_session(path: str, optimize: bool, threads: int = 0, quiet_pool: bool = False) -> Any:
    """A CPU InferenceSession with ORT's graph optimizations all on or all off. `threads` sets
    the intra-op pool; `quiet_pool` also pins inter-op to 1 and stops the pool spinning after a
    run (for several sessions interleaved in one process)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if threads:
        so.intra_op_num_threads = threads
        if quiet_pool:
            so.inter_op_num_threads = 1
            # A session's pool threads spinning after its run would steal the cores from the
            # next session's run.
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def write_results(md: str, report: dict[str, Any], out: str) -> None:
    """Prints the markdown report and writes it to `out`, the full report next to it as .json."""
    print()
    print(md)
    md_path = Path(out)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(md)
    md_path.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {md_path} and {md_path.with_suffix('.json')}")
