"""Runs the export's PyTorch half (:mod:`fastopt.export.child`) in a child process and reads
back what it left in the raw folder: the parent never loads the model, so the checkpoint is not
mapped while ONNX Runtime checks the export, and the child's memory goes back to the OS when it
exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastopt.export.child import ERROR_FILE, FEEDS_FILE, REQUEST_FILE, RESULT_FILE, STEP
from fastopt.export.errors import ExportError

LOG_FILE = "torch_process.log"  # the child's stderr, for the error line when it dies


@dataclass
class TorchGraph:
    name: str
    output: str  # the graph's checked output
    path: str  # the raw export
    what: str  # what the check batch is
    feeds: dict[str, Any]  # numpy
    expected: Any  # PyTorch's output, numpy float32


@dataclass
class TorchResult:
    graphs: list[TorchGraph]
    seconds: dict[str, float]
    peak_rss: int = 0  # the child's peak resident memory, bytes
    notes: list[str] = field(default_factory=list)


def child_command(request: Path) -> list[str]:
    return [sys.executable, "-m", "fastopt.export.child", str(request)]


def _env() -> dict[str, str]:
    """The child imports this very fastopt, wherever it was imported from."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _run(cmd: list[str], log: Path, say: Callable[[str], None]) -> tuple[int, int]:
    """(exit code or -signal, peak RSS in bytes); each step line relayed to `say` as it comes."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=_env(), text=True, errors="replace"
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(STEP):
                    say(line[len(STEP) :].rstrip("\n"))
                else:
                    sys.stderr.write(line)
            proc.stdout.close()
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024  # Linux reports KiB


def _failure(raw: Path, rc: int) -> ExportError:
    error_file = raw / ERROR_FILE
    if error_file.is_file():
        error = json.loads(error_file.read_text())
        if error["export_error"]:
            return ExportError(error["message"])
        return ExportError(f"the export process failed: {error['message']}")
    if rc < 0:
        return ExportError(f"the export process was killed (signal {-rc}; out of memory?)")
    log = (raw / LOG_FILE).read_text(errors="replace").strip().splitlines()
    last = " ".join(log[-1].split())[:300] if log else "no output"
    return ExportError(f"the export process failed (exit {rc}): {last}")


def run_torch_export(request: dict[str, Any], raw: Path, say: Callable[[str], None]) -> TorchResult:
    """The child's graphs and PyTorch outputs; ExportError (its own line, or what killed it)
    when it fails."""
    import numpy as np

    path = raw / REQUEST_FILE
    path.write_text(json.dumps({**request, "raw": str(raw)}))
    rc, peak = _run(child_command(path), raw / LOG_FILE, say)
    if rc != 0 or not (raw / RESULT_FILE).is_file():
        raise _failure(raw, rc)
    result = json.loads((raw / RESULT_FILE).read_text())
    graphs = []
    with np.load(raw / FEEDS_FILE, allow_pickle=False) as arrays:
        for i, g in enumerate(result["graphs"]):
            feeds = {k: arrays[f"{i}.feed.{k}"] for k in g["feeds"]}
            want = arrays[f"{i}.expected"]
            graphs.append(TorchGraph(g["name"], g["output"], g["path"], g["what"], feeds, want))
    return TorchResult(graphs, result["seconds"], peak)
