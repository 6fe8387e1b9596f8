"""Memory a benchmark costs, where the platform reports it.

CPU: the growth of the process's peak resident set (``VmHWM`` in ``/proc/self/status``) over
session creation and runs. The peak is reset first (writing 5 to ``/proc/self/clear_refs``);
where that is refused, growth is reported only if the old peak was exceeded. Linux only.
CUDA: device memory the process holds (pynvml if importable, else ``nvidia-smi
--query-compute-apps``), read after the runs: ORT's arena keeps what the runs needed, so this
approximates their peak.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Any


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class PeakRssGrowth:
    """A context manager: ``bytes`` is how far the peak RSS rose above the RSS at entry, or
    None where the platform does not tell."""

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._rss = 0
        self._peak = 0
        self._reset = False

    def __enter__(self) -> PeakRssGrowth:
        self._reset = _reset_peak()
        before = _status()
        self._rss, self._peak = before.get("VmRSS", 0), before.get("VmHWM", 0)
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _status().get("VmHWM")
        if peak is None or not self._rss:
            return
        if self._reset or peak > self._peak:
            self.bytes = max(0, peak - self._rss)


def parse_compute_apps(text: str, pid: int) -> int | None:
    """Bytes used by `pid` from ``nvidia-smi --query-compute-apps=pid,used_memory
    --format=csv,noheader,nounits`` output (MiB per line), summed over devices."""
    found = None
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            found = (found or 0) + int(parts[1]) * 1024 * 1024
    return found


def cuda_memory_in_use(device_id: int = 0) -> int | None:
    """Device memory this process holds on GPU `device_id`, or None if nothing reports it."""
    pid = os.getpid()
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device_id)
            procs: Any = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            used = [p.usedGpuMemory for p in procs if p.pid == pid and p.usedGpuMemory]
            return int(sum(used)) if used else None
        except pynvml.NVMLError:
            return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        text = subprocess.run(
            [smi, "-i", str(device_id), "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(text, pid)
