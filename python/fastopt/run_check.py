"""The run check: before ``optimize`` commits an output, ONNX Runtime (CPU, optimizations off)
creates a session of it and runs it once on small inputs made from its own graph inputs
(:func:`fastopt.verify.make_inputs` with batch 1, sequence 2, no past rows: a KV-cached output
gets its own past inputs). An output it cannot load or run is not written: the error names ORT's
message (:class:`RunCheckError`, an ``OutputRejectedError``; the CLI exits 1).

It compares nothing (``--verify`` does): it proves that the output loads and runs, which the
rewrites' own checks cannot (an op ORT refuses for these shapes, an internal op left over).
Only when the output fails is the original run too, on its own inputs made the same way: if ORT
cannot run the original on CPU either (a model for a GPU provider, a custom op library), the
check is skipped with a note, as it is for outputs made for CUDA (``options cuda=1``, bf16).

Cost: session creation plus one run at batch 1 x 2 tokens, on the model serialized in memory
(no file is written). Past protobuf's 2 GB the model goes to ORT as its skeleton with the
weights handed over as OrtValues over the mapped bytes (zero-copy), so it costs no extra write.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.check import _INLINE_LIMIT, onnxruntime, summarize_error
from fastopt.errors import UnsupportedModelError
from fastopt.verify_inputs import _synthesize
from fastopt.verify_report import OutputRejectedError, VerifyReport

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

# The smallest inputs that still exercise attention across positions.
RUN_CHECK_DIMS = {"batch": 1, "sequence": 2, "past": 0}
_SKELETON_LOCATION = "*fastopt-skeleton*"


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


def _session(model: _C.Model) -> Any:
    """A CPU session of `model`, optimizations off, without writing a file."""
    ort = onnxruntime()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    weights: list[Any] = []  # OrtValues over the model's bytes: alive until the session is
    if model.self_contained_size() <= _INLINE_LIMIT:
        data: bytes = model.serialize()
    else:
        data = _skeleton_with_weights(model, so, weights)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _skeleton_with_weights(model: _C.Model, so: Any, values: list[Any]) -> bytes:
    """The skeleton of a model past 2 GB, its main graph's large initializers handed to ORT as
    OrtValues over their bytes (SessionOptions.add_external_initializers: no copy)."""
    import onnx

    ort = onnxruntime()
    proto = onnx.ModelProto()
    proto.ParseFromString(model.skeleton())
    tensors = {t.name: t for t in model.graph.initializers}
    kept = []
    names: list[str] = []
    for init in proto.graph.initializer:
        if any(e.key == "location" and e.value == _SKELETON_LOCATION for e in init.external_data):
            names.append(init.name)
            values.append(ort.OrtValue.ortvalue_from_numpy(tensors[init.name].numpy()))
        else:
            kept.append(init)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    data = proto.SerializeToString()
    if _SKELETON_LOCATION.encode() in data:
        # A large tensor outside the main graph's initializers (a Constant, a body's): no way
        # to hand it over without writing the model.
        raise _Skip("a large tensor outside the main graph's initializers")
    so.add_external_initializers(names, values)
    return data


class _Skip(Exception):
    pass


def _run_once(model: _C.Model) -> None:
    try:
        feeds = _synthesize(model, RUN_CHECK_DIMS, seed=0)
    except (UnsupportedModelError, ValueError) as e:
        raise _Skip(f"no inputs can be made for it ({e})") from e
    sess = _session(model)
    wanted = [i.name for i in sess.get_inputs()]
    sess.run(None, {n: feeds[n] for n in wanted})


def _original_runs(original: str | None) -> str | None:
    """None when ORT runs the original (its file) on CPU, else why not."""
    if original is None:
        return "the original is not a file, so it was not tried"
    from fastopt._io import load

    try:
        _run_once(load(original))
    except Exception as e:  # whatever ORT or input synthesis says: the original cannot run
        return summarize_error(str(e))
    return None


def run_check(model: _C.Model, original: str | None, skip_reason: str = "") -> RunCheck:
    """Loads and runs `model` once in ORT (CPU); raises RunCheckError when that fails and the
    original (`original`: its file, or None) runs, or could not be tried. `skip_reason`: the
    output is not meant for the CPU provider (the check is skipped with it as the note)."""
    start = time.perf_counter()
    if skip_reason:
        return RunCheck(False, skip_reason)
    try:
        _run_once(model)
    except _Skip as e:
        return RunCheck(False, f"skipped: {e}", time.perf_counter() - start)
    except Exception as e:
        message = summarize_error(str(e))
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
        report = VerifyReport(original or "<fastopt.Model>", "<optimized>", error=text)
        raise RunCheckError(text, report) from e
    return RunCheck(True, "", time.perf_counter() - start)
