"""Runs cases in a child process, so that a crash (a signal: SIGSEGV, SIGFPE, an abort) is a
finding with the stage it happened in instead of the end of the campaign.

The child (``python -m tests.difftest.worker``) reads case keys, one a line, and answers JSON
lines: ``{"stage": ...}`` as it goes, then ``{"outcome": {...}}``. ``Worker.run`` restarts it
after a crash or a timeout. Only the protocol goes to the child's real stdout; everything
else it prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .cases import Case
from .oracle import Outcome

ROOT = Path(__file__).resolve().parents[2]


class Worker:
    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        # The child's stderr, for the last words of a crash; closed in close().
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.difftest.worker"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
            )
            self._buf = b""
            self._stderr.seek(0)
            self._stderr.truncate()
        return self.proc

    def run(self, case: Case) -> Outcome:
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(case.key.encode() + b"\n")
        proc.stdin.flush()
        stage = "start"
        deadline = time.monotonic() + self.timeout
        while True:
            line = self._readline(proc, deadline)
            if line is None:  # timed out
                self.close()
                return Outcome("finding", f"timeout after {self.timeout:.0f} s", stage)
            if line == b"":  # the child died
                rc = proc.wait()
                self.proc = None
                what = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
                if stage == "start":  # the child could not even start: the tester's own bug
                    return Outcome("error", f"worker died ({what}): {self._last_words()}", stage)
                if stage in ("original", "mutate"):  # ORT or onnx died on the mutant itself
                    return Outcome("invalid", f"crash ({what}) running the mutant", stage)
                return Outcome("finding", f"crash ({what})", stage)
            msg = json.loads(line)
            if "stage" in msg:
                stage = msg["stage"]
            else:
                return Outcome(**msg["outcome"])

    def _readline(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return b""
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _last_words(self) -> str:
        self._stderr.seek(0)
        lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else ""

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __del__(self) -> None:
        self._stderr.close()


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (ORT, fastopt warnings) must not break the protocol
    sys.stdout = sys.stderr
    from .oracle import run_case

    for line in sys.stdin:
        case = Case.parse(line.strip())

        def stage(name: str) -> None:
            out.write(json.dumps({"stage": name}) + "\n")

        try:
            outcome = run_case(case, stage)
        except Exception as e:  # a bug in the tester itself
            outcome = Outcome("error", f"tester: {type(e).__name__}: {e}"[:500], "tester")
        out.write(json.dumps({"outcome": outcome.__dict__}) + "\n")


if __name__ == "__main__":
    main()
