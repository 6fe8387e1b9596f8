"""Progress of a long command, on stderr: rich's live bar on a terminal; in a pipe or a CI log,
plain lines, once the command has run for :data:`DELAY_S` seconds (a quick run prints none).

A plain line says what runs and for how long (``optimize: fuse_attention (pass 12 of 38),
4.1 s``). A ticker thread writes it, so a step that gives no news (a slow pass in C++, ONNX
Runtime's session creation) still shows: a line when the step changes (at most one each
:data:`EVERY_S`), and one each :data:`STILL_S` while the same step runs on.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from fastopt.cli.output import console

DELAY_S = 2.0  # no line before the command has run this long
EVERY_S = 2.0  # at most one line per this many seconds
STILL_S = 10.0  # the same step: a line again after this long
_TICK_S = 0.25


class CommandProgress:
    """``with CommandProgress("optimize") as p: p.update("fuse_attention", 12, 38)``.

    `update` takes what runs now and, where known, how much of `total` is done. `clock` and
    `write` are for tests (time.monotonic and a line on stderr by default)."""

    def __init__(
        self,
        command: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] | None = None,
        terminal: bool | None = None,
    ) -> None:
        self.command = command
        self._clock = clock
        self._write = write or _stderr_line
        err = console(stderr=True)
        self._terminal = err.is_terminal if terminal is None else terminal
        self._rich: Progress | None = None
        if self._terminal:
            self._rich = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TimeElapsedColumn(),
                console=err,
                transient=True,
            )
            self._task = self._rich.add_task(command, total=None)
        self._lock = threading.Lock()
        self._start = 0.0
        self._what = ""
        self._done: int | None = None
        self._total: int | None = None
        self._unit = ""
        self._printed: tuple[str, float] | None = None  # (line's step, when)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CommandProgress:
        self._start = self._clock()
        if self._rich is not None:
            self._rich.start()
        elif self._write is _stderr_line:  # a real run: tick in the background
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._rich is not None:
            self._rich.stop()

    def update(
        self, what: str, done: int | None = None, total: int | None = None, unit: str = ""
    ) -> None:
        """`what` runs now; `done` of `total` finished: "(pass 3 of 9)" with `unit` "pass"
        (`done` counts those before this one), else a percentage."""
        with self._lock:
            self._what, self._done, self._total, self._unit = what, done, total, unit
        if self._rich is not None:
            self._rich.update(
                self._task, description=f"{self.command}: {what}", total=total, completed=done or 0
            )

    def tick(self) -> None:
        """Writes a plain line if one is due (the ticker thread calls this)."""
        now = self._clock()
        elapsed = now - self._start
        with self._lock:
            step = self._step_text()
        if elapsed < DELAY_S:
            return
        if self._printed is not None:
            last_step, last_time = self._printed
            wait = STILL_S if step == last_step else EVERY_S
            if now - last_time < wait:
                return
        self._printed = (step, now)
        self._write(f"{self.command}: {step}, {elapsed:.1f} s")

    def _step_text(self) -> str:
        what = self._what or "starting"
        if self._total and self._done is not None:
            if self._unit:
                return f"{what} ({self._unit} {self._done + 1} of {self._total})"
            return f"{what} {round(100 * self._done / self._total)}%"
        return what

    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            self.tick()


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
