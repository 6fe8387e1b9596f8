"""Calls into ONNX Runtime that may kill the process, made in a forked child.

ORT itself dies on some graphs fastopt must still handle: its integer Div kernel raises SIGFPE
on INT_MIN / -1, which fastopt leaves unfolded (the value is undefined). The run check and the
fp16 range pass run models in ORT, so they run in a child: a death there is an exception here,
not the end of ``optimize``. Forking is cheap (the weights are shared mappings) and the child
never returns into the caller's code. Where the platform does not fork (not Linux), the call is
made in this process.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import sys
import warnings
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


# Address space for the answer (activation ranges of a large model: about 100 KB).
_ANSWER_BYTES = 64 << 20


class ChildDied(Exception):
    """The child making the call was killed by a signal, or exited without an answer."""


def call_forked(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a forked child (Linux): its result, or its exception raised here (as a
    RuntimeError with its text when it cannot be pickled); ChildDied when the child dies."""
    return Forked(fn, *args).result()


class Forked(Generic[T]):
    """``fn(*args)`` started in a forked child (Linux; made here at ``result()`` elsewhere), so
    that this process can work meanwhile (the run check's session while the save writes).
    ``result()`` waits for it, as :func:`call_forked`; ``cancel()`` kills and reaps a child whose
    answer is no longer wanted. One of them must be called."""

    def __init__(self, fn: Callable[..., T], *args: Any) -> None:
        self._fn, self._args = fn, args
        self._pid = 0
        self._shared: mmap.mmap | None = None
        self._local = sys.platform != "linux"
        if self._local:
            return
        # The answer comes back through shared memory, not a pipe: no write the kernel counts as
        # the process's I/O (tests count a quantize's written bytes), and pages cost only once
        # written.
        self._shared = mmap.mmap(-1, _ANSWER_BYTES)
        with warnings.catch_warnings():
            # (Python 3.12+ warns on fork in a threaded process; the child only makes this call)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                _answer(self._shared, fn, args)
            finally:
                os._exit(0)
        self._pid = pid

    def result(self) -> T:
        if self._local:
            return self._fn(*self._args)
        if self._shared is None:
            raise RuntimeError("the child's answer was already collected, or cancelled")
        shared, self._shared = self._shared, None
        with shared:
            _, status = os.waitpid(self._pid, 0)
            if os.WIFSIGNALED(status):
                name = signal.Signals(os.WTERMSIG(status)).name
                raise ChildDied(f"ONNX Runtime died of {name}")
            size = int.from_bytes(shared[:8], "little")
            if not size:
                code = os.waitstatus_to_exitcode(status)
                raise ChildDied(f"the process making the call exited with status {code}")
            ok, value = pickle.loads(shared[8 : 8 + size])
        if not ok:
            raise value
        return value

    def cancel(self) -> None:
        """Kills and reaps the child (nothing if result() was called)."""
        if self._shared is None:
            return
        shared, self._shared = self._shared, None
        with shared:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            os.waitpid(self._pid, 0)


def _answer(shared: mmap.mmap, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """In the child: fn's result or exception, pickled after its 8-byte length."""
    try:
        answer: tuple[bool, Any] = (True, fn(*args))
    except BaseException as e:
        answer = (False, e)
    try:
        data = pickle.dumps(answer)
    except Exception:
        data = pickle.dumps((False, RuntimeError(str(answer[1]))))
    if 8 + len(data) > len(shared):
        data = pickle.dumps((False, RuntimeError(f"an answer of {len(data)} bytes is too large")))
    shared[8 : 8 + len(data)] = data
    shared[:8] = len(data).to_bytes(8, "little")
