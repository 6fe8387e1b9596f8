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
read: the check is about the graph, not the values). Above 1 GiB the session is created but not
run: a run touches every weight's pages (figures: bench/results/run_check.md). Serializing
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
from fastopt.forked import call_forked
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
# Above this only the session is created: one run reads every weight once (the zeros' pages get
# allocated as they are touched), seconds for a 1.5 GB model on a loaded 2-core machine.
_RUN_LIMIT = 1 << 30


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
    change, so the weights are neither copied nor read (ORT maps the holes)."""
    import onnx

    proto = onnx.ModelProto()
    proto.ParseFromString(model.skeleton(_SKELETON_THRESHOLD))
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-run-check-"))
    offset = 0
    for tensor in _placeholders(proto):
        size = int(next(e.value for e in tensor.external_data if e.key == "length"))
        del tensor.external_data[:]
        for key, value in (("location", _ZEROS), ("offset", offset), ("length", size)):
            tensor.external_data.add(key=key, value=str(value))
        offset += (size + 4095) // 4096 * 4096
    with open(os.path.join(folder, _ZEROS), "wb") as f:
        f.truncate(offset)  # holes: no bytes written
    path = os.path.join(folder, "model.onnx")
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    return path


def _placeholders(proto: Any) -> list[Any]:
    """The skeleton's placeholder tensors: initializers of the graph and its bodies, and tensor
    attributes (Constant values)."""
    out = []

    def walk(graph: Any) -> None:
        for t in graph.initializer:
            if t.external_data:
                out.append(t)
        for node in graph.node:
            for a in node.attribute:
                if a.HasField("t") and a.t.external_data:
                    out.append(a.t)
                out.extend(t for t in a.tensors if t.external_data)
                if a.HasField("g"):
                    walk(a.g)
                for g in a.graphs:
                    walk(g)

    walk(proto.graph)
    return out


def _run_once(model: _C.Model) -> str:
    """Creates the session and runs it; "" when it ran, else what was left out."""
    try:
        feeds = _synthesize(model, RUN_CHECK_DIMS, seed=0)
    except (UnsupportedModelError, ValueError) as e:
        raise _Skip(f"no inputs can be made for it ({e})") from e
    with ExitStack() as stack:
        sess = _session(model, stack)
        if model.self_contained_size() > _RUN_LIMIT:
            return "session created, not run (over 1 GiB: the run would touch every weight)"
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


def run_check(model: _C.Model, original: str | bytes | None, not_for_cpu: str = "") -> RunCheck:
    """Loads and runs `model` once in ORT (CPU); raises RunCheckError when that fails and the
    original (`original`: its file, its bytes, or None) runs, or could not be tried.
    `not_for_cpu`: why the output is not meant for the CPU provider; a failure is then a note
    (skipped), not an error."""
    start = time.perf_counter()
    try:
        left_out = call_forked(_run_once, model)
    except _Skip as e:
        return RunCheck(False, f"skipped: {e}", time.perf_counter() - start)
    except Exception as e:
        message = summarize_error(str(e))
        if not_for_cpu:
            return RunCheck(
                False, f"skipped: {not_for_cpu}: {message}", time.perf_counter() - start
            )
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
    return RunCheck(True, left_out, time.perf_counter() - start)
