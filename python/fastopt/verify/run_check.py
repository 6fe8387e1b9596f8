"""The run check: before ``optimize`` commits an output, ONNX Runtime (CPU, optimizations off)
creates a session of it and runs it once on small inputs made from its own graph inputs
(:func:`fastopt.verify.core.make_inputs` with batch 1, sequence 2, no past rows: a KV-cached output
gets its own past inputs). An output it cannot load or run is not written: the error names ORT's
message (:class:`RunCheckError`, an ``OutputRejectedError``; the CLI exits 1).

It compares nothing (``--verify`` does): it proves that the output loads and runs, which the
rewrites' own checks cannot (an op ORT refuses for these shapes, an internal op left over).
Only when the output fails is the original run too, on its own inputs made the same way: if ORT
cannot run the original on CPU either (a model for a GPU provider, a custom op library), the
check is skipped with a note, as it is when an output made for CUDA (``options cuda=1``, bf16)
does not run on CPU.

Cost: session creation without MLAS weight prepacking and one run at batch 1 x 2 tokens, on the
model serialized in memory up to 4 MiB (milliseconds on the test fixtures). Above, ORT loads the
model's skeleton with zeros for its large tensors from a sparse file (nothing copied, nothing
read: the check is about the graph, not the values). Where one run would read or make more than
256 MiB of weights (:func:`run_bytes`) the session is created but not run: a run touches every
weight's pages, and ORT's MatMulNBits, with prepacking off, makes a float32 copy of its weight
(the 0.5B int4 output's run: 3 s of CPU and 1 GB of RSS, more than its quantization; figures:
bench/results/run_check.md, bench/results/quantize.md). Serializing
a 1.5 GB model instead took 20-50 s; handing ORT the mapped weights as OrtValues was tried too:
add_external_initializers copies them (5x slower than loading the file) and add_initializer
leaves them graph inputs that ORT then wants fed.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.errors import UnsupportedModelError
from fastopt.forked import Forked, call_forked
from fastopt.verify.check import onnxruntime, run_once_options, summarize_error
from fastopt.verify.inputs import _synthesize
from fastopt.verify.report import OutputRejectedError, VerifyReport

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

# The smallest inputs that still exercise attention across positions.
RUN_CHECK_DIMS = {"batch": 1, "sequence": 2, "past": 0}
# Up to this the model goes to ORT serialized in memory, as it is; above, as its skeleton with
# zeros for the tensors of _SKELETON_THRESHOLD bytes or more (small ones, shapes and indices
# among them, keep their values): serialized, a model costs twice its size in memory (the bytes
# and ORT's copy), mapped zeros only the pages a run touches.
_SERIALIZE_LIMIT = 4 << 20
_SKELETON_THRESHOLD = 64 << 10
_ZEROS = "zeros.data"
# Above this (run_bytes) only the session is created: the bytes one run reads and makes cost
# their size in memory (the zeros' pages are allocated as they are touched) and seconds of CPU.
_RUN_LIMIT = 256 << 20
# Ops that read their first input's rows by index, not the whole tensor.
_ROW_READERS = {"Gather", "GatherBlockQuantized"}


class _Skip(Exception):
    """The check cannot be made (the note says why)."""


class RunCheckError(OutputRejectedError):
    """ONNX Runtime cannot load or run fastopt's output (while it runs the original, or the
    original could not be tried): the output was not written. A fastopt bug, please report it."""


@dataclass
class RunCheck:
    """What the run check did: ``ran`` (the output loaded and ran), ``note`` (why it was
    skipped, or what it could not try), ``seconds``."""

    ran: bool
    note: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        """OptimizeReport.run_check's text: "ran in N s", "NOTE, N s" or the note."""
        if not self.ran:
            return self.note
        return f"{self.note}, {self.seconds:.2f} s" if self.note else f"ran in {self.seconds:.2f} s"


def _session(model: _C.Model, stack: ExitStack) -> Any:
    """A CPU session of `model`, optimizations off, without writing a copy of its weights."""
    ort = onnxruntime()
    so = run_once_options()
    providers = ["CPUExecutionProvider"]
    if model.self_contained_size() <= _SERIALIZE_LIMIT:
        return ort.InferenceSession(model.serialize(), so, providers=providers)
    return ort.InferenceSession(_zero_weights(model, stack), so, providers=providers)


def _zero_weights(model: _C.Model, stack: ExitStack) -> str:
    """A file of `model`'s skeleton whose large tensors read zeros from a sparse data file
    beside it: the check proves that ORT loads and runs the graph, which the values do not
    change, so the weights are neither copied nor read (ORT maps the holes). Written by the C++
    writer (Model.zeros_skeleton): no onnx import, no ModelProto in Python."""
    skeleton, zeros = model.zeros_skeleton(_SKELETON_THRESHOLD, _ZEROS)
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-run-check-"))
    with open(os.path.join(folder, _ZEROS), "wb") as f:
        f.truncate(zeros)  # holes: no bytes written
    path = os.path.join(folder, "model.onnx")
    with open(path, "wb") as f:
        f.write(skeleton)
    return path


def run_bytes(model: _C.Model) -> int:
    """The weight bytes one run of `model` reads or makes: every initializer of at least
    _SKELETON_THRESHOLD bytes a node reads whole (a Gather's table is read by rows: not
    counted), plus the float32 copy of its weight that MatMulNBits makes on each run when its
    weights are not prepacked (K x N x 4 bytes), as the run check's sessions are."""
    read: dict[str, int] = {}
    made = 0

    def walk(graph: _C.Graph) -> None:
        nonlocal made
        for node in graph.nodes:
            for i, value in enumerate(node.inputs):
                t = value.initializer if value is not None else None
                if value is None or t is None or t.nbytes < _SKELETON_THRESHOLD:
                    continue
                if not (i == 0 and node.op_type in _ROW_READERS):
                    read[value.name] = t.nbytes
            if node.op_type == "MatMulNBits":
                attrs = node.attributes
                made += 4 * int(attrs.get("K", 0)) * int(attrs.get("N", 0))
            for body in node.subgraphs:
                walk(body)

    walk(model.graph)
    return sum(read.values()) + made


def _run_once(model: _C.Model) -> str:
    """Creates the session and runs it; "" when it ran, else what was left out."""
    try:
        feeds = _synthesize(model, RUN_CHECK_DIMS, seed=0)
    except (UnsupportedModelError, ValueError) as e:
        raise _Skip(f"no inputs can be made for it ({e})") from e
    with ExitStack() as stack:
        sess = _session(model, stack)
        weights = run_bytes(model)
        if weights > _RUN_LIMIT:
            return (
                f"session created, not run (a run would read or make {weights >> 20} MiB of "
                f"weights, over {_RUN_LIMIT >> 20} MiB)"
            )
        # (a rank-0 input is a numpy scalar, which ORT takes only as an array)
        sess.run(None, {i.name: np.asarray(feeds[i.name]) for i in sess.get_inputs()})
    return ""


def _original_runs(original: str | bytes | None) -> str | None:
    """None when ORT runs the original (its file, or its serialized bytes) on CPU, else why
    not."""
    if original is None:
        return "the original is not a file, so it was not tried"
    from fastopt._io import load, load_bytes

    try:
        call_forked(
            _run_once, load_bytes(original) if isinstance(original, bytes) else load(original)
        )
    except Exception as e:  # whatever ORT or input synthesis says: the original cannot run
        return summarize_error(str(e))
    return None


class PendingCheck:
    """The run check started in a forked child (:func:`start_run_check`) while this process
    saves: ``finish()`` waits for it (the save calls it before naming its files: a refused
    output is then never named); ``cancel()`` ends a child whose answer is not wanted (the save
    failed first). One of them must be called."""

    def __init__(self, model: _C.Model, original: str | bytes | None, not_for_cpu: str) -> None:
        self._start = time.perf_counter()
        self._original, self._not_for_cpu = original, not_for_cpu
        self._child = Forked(_run_timed, model)
        self.result: RunCheck | None = None

    def finish(self) -> RunCheck:
        """What the check found; raises RunCheckError when the output fails and the original
        runs, or could not be tried."""
        if self.result is None:
            self.result = self._conclude()
        return self.result

    def cancel(self) -> None:
        self._child.cancel()

    def _conclude(self) -> RunCheck:
        start = self._start
        try:
            left_out, seconds = self._child.result()
        except _Skip as e:
            return RunCheck(False, f"skipped: {e}", time.perf_counter() - start)
        except Exception as e:
            message = summarize_error(str(e))
            if self._not_for_cpu:
                note = f"skipped: {self._not_for_cpu}: {message}"
                return RunCheck(False, note, time.perf_counter() - start)
            original = self._original
            why_not = _original_runs(original)
            seconds = time.perf_counter() - start
            if why_not is not None and original is not None:
                note = f"skipped: ONNX Runtime (CPU) cannot run the original either: {why_not}"
                return RunCheck(False, note, seconds)
            text = f"ONNX Runtime cannot run the optimized model: {message}; it was not written"
            if why_not is None:
                text += " (the original runs: a fastopt bug, please report it)"
            else:
                text += f" ({why_not})"
            label = original if isinstance(original, str) else "<fastopt.Model>"
            report = VerifyReport(label, "<optimized>", error=text)
            raise RunCheckError(text, report) from e
        return RunCheck(True, left_out, seconds)


def _run_timed(model: _C.Model) -> tuple[str, float]:
    """_run_once and its own time (the wait beside the save is not the check's)."""
    start = time.perf_counter()
    left_out = _run_once(model)
    return left_out, time.perf_counter() - start


def start_run_check(
    model: _C.Model, original: str | bytes | None, not_for_cpu: str = ""
) -> PendingCheck:
    """:func:`run_check` started in a forked child, so that the save runs beside it (the
    session's creation and ORT's import, 0.2-0.4 s of CPU on the 0.5B, overlap the save's
    writes and fsync). `model` must not change until ``finish()``."""
    return PendingCheck(model, original, not_for_cpu)


def run_check(model: _C.Model, original: str | bytes | None, not_for_cpu: str = "") -> RunCheck:
    """Loads and runs `model` once in ORT (CPU); raises RunCheckError when that fails and the
    original (`original`: its file, its bytes, or None) runs, or could not be tried.
    `not_for_cpu`: why the output is not meant for the CPU provider; a failure is then a note
    (skipped), not an error."""
    return start_run_check(model, original, not_for_cpu).finish()
