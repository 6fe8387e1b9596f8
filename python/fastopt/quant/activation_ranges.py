"""Activation statistics: the largest magnitude each float32 value of a model takes on a few
representative inputs, measured in ONNX Runtime (CPU, optimizations off).

The model is not run with its intermediate values as outputs (that would hold every activation
of the run at once): each observed value gets a small reduction, ``ReduceMax(Where(|x| <
SENTINEL, |x|, 0))``, whose scalar becomes a graph output, so ONNX Runtime frees the activations
as it always does and the run costs about one inference plus the reductions. The graph is edited
on the model's skeleton (``Model.skeleton``: weights stay where they are) and bound back to the
weights with ``_C.load_skeleton``.

Magnitudes at or past ``SENTINEL`` (1e30) are not counted: they are masks' fill values
(``torch.finfo(float32).min`` added to masked attention scores) and infinities, which an fp16
model writes as its own extremes on purpose (convert_precision clamps the constants they come
from to ±65504), not activations that grow. NaNs are not counted either.

Used by the fp16 range check (fastopt.quant.fp16_ranges); other consumers (activation-aware
quantization) read ``ActivationRanges.max_abs``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
    import onnx
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

# |x| at or past this is a mask's fill value or an infinity, not a magnitude (module docstring).
SENTINEL = 1e30
# Inputs the range pass runs on: seeds of fastopt.verify.core.make_inputs (batch 2 of 16 tokens for
# a decoder, as quantized --verify uses), so the statistics cover what --verify checks.
DEFAULT_SAMPLES = 4
DEFAULT_DIMS: dict[str, int] = {"sequence_length": 16, "past_sequence_length": 0}
_PREFIX = "fastopt_range/"
_FLOAT = 1  # onnx.TensorProto.FLOAT


@dataclass
class ActivationRanges:
    """max |x| per observed value (graph inputs and node outputs of type float32) over
    ``samples`` input sets; values that were not observed are absent. ``by_source``: the same
    per source of the inputs ("random": fastopt's input maker; "calibration": token ids of
    calibration text), with ``samples_by_source``."""

    max_abs: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    seconds: float = 0.0
    by_source: dict[str, dict[str, float]] = field(default_factory=dict)
    samples_by_source: dict[str, int] = field(default_factory=dict)

    def of(self, name: str) -> float | None:
        return self.max_abs.get(name)

    def add(self, names: Sequence[str], got: Sequence[Any], source: str = "random") -> None:
        """One run's reductions (``got``, the scalars of ``names``) from inputs of ``source``."""
        mine = self.by_source.setdefault(source, {})
        for name, m in zip(names, got):
            x = float(m)
            for table in (self.max_abs, mine):
                if x == x and x > table.get(name, 0.0):  # NaN, -inf (empty): no
                    table[name] = x
                else:
                    table.setdefault(name, 0.0)
        self.samples += 1
        self.samples_by_source[source] = self.samples_by_source.get(source, 0) + 1


class RangeProbe:
    """The range reductions as a probe of calibration's runs (fastopt.quant.calibration.Probe):
    max |x| of every float32 value on the calibration text, then on ``extra`` input sets
    (source "random"), in one ONNX Runtime session."""

    def __init__(self, model: _C.Model, extra: Sequence[Mapping[str, np.ndarray]] = ()) -> None:
        self.model = model
        self.extra = list(extra)
        self.observed: list[str] = []
        self.ranges = ActivationRanges()

    def instrument(self, proto: onnx.ModelProto) -> list[str]:
        self.observed = _float32_values(proto, self.model)
        _instrument(proto, self.observed)
        return [_PREFIX + v for v in self.observed]

    def add(self, got: Sequence[Any], source: str) -> None:
        self.ranges.add(self.observed, got, "calibration" if source == "calibration" else "random")

    def extra_inputs(self) -> Sequence[Mapping[str, np.ndarray]]:
        return self.extra


def representative_inputs(
    model: _C.Model,
    samples: int = DEFAULT_SAMPLES,
    dims: Mapping[str, int] | None = None,
) -> list[dict[str, np.ndarray]]:
    """``samples`` input sets made by fastopt's input maker (seeds 0..samples-1): token ids in
    the vocabulary, masks, positions, a 16-token prompt for decoders (an empty past)."""
    from fastopt.verify.inputs import make_inputs

    return [
        make_inputs(model, dims={**DEFAULT_DIMS, **(dims or {})}, seed=s) for s in range(samples)
    ]


def _float32_values(proto: onnx.ModelProto, model: _C.Model) -> list[str]:
    """Names of the main graph's float32 inputs and node outputs, types from fastopt's IR and
    onnx's shape inference; values of unknown type are skipped (a reduction over a non-float
    would not load)."""
    import onnx.shape_inference

    try:
        inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False)
    except Exception:  # inference is a help here: the IR's own types still count
        inferred = proto
    types: dict[str, int] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    g = model.graph
    names: list[str] = []
    seen: set[str] = set()
    initializers = {t.name for t in proto.graph.initializer}

    def add(v: _C.Value | None) -> None:
        if v is None or not v.name or v.name in seen or v.name in initializers:
            return
        seen.add(v.name)
        if (v.dtype or types.get(v.name, 0)) == _FLOAT:
            names.append(v.name)

    for v in g.inputs:
        add(v)
    for n in g.nodes:
        if n.op_type == "Constant":
            continue  # constants are converted (and clamped) by the pass itself
        for o in n.outputs:
            add(o)
    return names


def float32_value_names(model: _C.Model) -> list[str]:
    """The main graph's float32 inputs and node outputs (types as the range pass reads them)."""
    import onnx

    return _float32_values(onnx.load_from_string(model.skeleton()), model)


def _instrument(proto: onnx.ModelProto, values: Sequence[str]) -> None:
    """Adds a scalar output ``fastopt_range/<value>`` = max |value| below SENTINEL per value."""
    from onnx import TensorProto, helper, numpy_helper

    g = proto.graph
    first_new = len(g.node)
    sentinel = _PREFIX + "sentinel"
    zero = _PREFIX + "zero"
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array(SENTINEL, np.float32), sentinel),
            numpy_helper.from_array(np.array(0.0, np.float32), zero),
        ]
    )
    for i, name in enumerate(values):
        t = f"{_PREFIX}{i}/"
        out = _PREFIX + name
        g.node.extend(
            [
                helper.make_node("Abs", [name], [t + "abs"], name=t + "Abs"),
                helper.make_node("Less", [t + "abs", sentinel], [t + "finite"], name=t + "Less"),
                helper.make_node(
                    "Where", [t + "finite", t + "abs", zero], [t + "kept"], name=t + "Where"
                ),
                helper.make_node(
                    "ReduceMax", [t + "kept"], [out], name=t + "ReduceMax", keepdims=0
                ),
            ]
        )
        g.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, []))
    place_early(proto, first_new)


def place_early(proto: onnx.ModelProto, first_new: int) -> None:
    """Moves the main graph's nodes from ``first_new`` on (an instrumentation's, appended) to
    right after the last producer of their inputs. The session (``_session``: priority-based
    order, which runs ready nodes in graph order) then frees each activation once reduced;
    appended at the end, or in ONNX Runtime's default order, the reductions kept the observed
    activations alive to the end of the run (SmolLM2 at 512 tokens: 4.7 GB peak against 1.9 GB
    for the plain model; 2.0 GB so)."""
    nodes = list(proto.graph.node)
    anchor: dict[str, int] = {}  # value -> index of the original node after which it exists
    for i, n in enumerate(nodes[:first_new]):
        for o in n.output:
            anchor[o] = i
    after: dict[int, list[onnx.NodeProto]] = {}
    for n in nodes[first_new:]:
        at = max((anchor.get(x, -1) for x in n.input if x), default=-1)
        after.setdefault(at, []).append(n)
        for o in n.output:
            anchor[o] = at
    order = list(after.get(-1, []))
    for i, n in enumerate(nodes[:first_new]):
        order.append(n)
        order.extend(after.get(i, []))
    del proto.graph.node[:]
    proto.graph.node.extend(order)


def collect_ranges(
    model: _C.Model,
    inputs: Iterable[Mapping[str, np.ndarray]] | None = None,
    values: Sequence[str] | None = None,
    workdir: str = "",
) -> ActivationRanges:
    """Runs ``model`` on each input set (default: ``representative_inputs(model)``) and returns
    max |x| of every float32 value (or of ``values``). The model is not changed; its weights
    are read where they are (``workdir``: a folder for the temporary graph, best on the
    filesystem of the model's data files; $TMPDIR otherwise). Raises ModelError when ONNX
    Runtime cannot run the instrumented model."""
    import onnx

    from fastopt.verify.check import summarize_error

    start = time.perf_counter()
    feeds_list = list(inputs) if inputs is not None else representative_inputs(model)
    skeleton = model.skeleton()
    proto = onnx.load_from_string(skeleton)
    observed = list(values) if values is not None else _float32_values(proto, model)
    ranges = ActivationRanges()
    if not observed:  # nothing in float32 (an fp16 model): no run
        ranges.samples = len(feeds_list)
        ranges.seconds = time.perf_counter() - start
        return ranges
    _instrument(proto, observed)
    outputs = [_PREFIX + v for v in observed]
    with ExitStack() as stack:
        try:
            sess = _session(proto, skeleton.count(_PLACEHOLDER), model, stack, workdir)
            del proto
            wanted = {i.name for i in sess.get_inputs()}
            for feeds in feeds_list:
                fed = {k: np.asarray(v) for k, v in feeds.items() if k in wanted}
                ranges.add(observed, sess.run(outputs, fed))
        except _C.ModelError:
            raise
        except Exception as e:
            why = summarize_error(str(e))
            raise _C.ModelError(
                f"activation ranges: ONNX Runtime could not run the model: {why}"
            ) from e
    ranges.seconds = time.perf_counter() - start
    return ranges


_PLACEHOLDER = b"*fastopt-skeleton*"  # Model.skeleton's external-data location


def _session(
    proto: onnx.ModelProto, placeholders: int, model: _C.Model, stack: ExitStack, workdir: str
) -> Any:
    """An ORT session (CPU, optimizations off, no prepacking) of the instrumented skeleton.

    When every placeholder is a main-graph initializer, weights in external data files are read
    from those files, as ORT reads the original's (mapped: no copy): the instrumented graph is
    written to a temporary folder holding hard links to the files (ORT refuses data outside the
    model's folder, symbolic links included), made in ``workdir`` or $TMPDIR, whichever is on
    the files' filesystem. Other weights (made in memory by earlier passes, or where no link
    can be made) are handed over as OrtValues, which ORT copies. Otherwise (large Constant
    tensors, subgraphs) the skeleton is bound back to the weights and serialized, as
    fastopt.verify.core does."""
    from fastopt.verify.check import onnxruntime, open_source, ort_session, run_once_options

    ort = onnxruntime()
    by_name = {
        t.name: t
        for t in proto.graph.initializer
        if t.data_location == 1  # EXTERNAL
        and any(e.key == "location" and e.value == _PLACEHOLDER.decode() for e in t.external_data)
    }
    if len(by_name) != placeholders:
        instrumented = _C.load_skeleton(proto.SerializeToString(), model)
        return ort_session(open_source(instrumented, stack, in_memory="bytes"), None)
    where = {name: model.graph.initializer(name) for name in by_name}
    files = sorted(
        {
            os.path.realpath(t.external_location[0])
            for t in where.values()
            if t and t.external_location
        }
    )
    folder, links = "", dict[str, str]()
    if files:  # (else nothing is written: the graph goes to ORT as bytes)
        folder, links = _linked_folder(
            files, [d for d in (workdir, tempfile.gettempdir()) if d], stack
        )
    names, arrays = [], []
    for name, t in by_name.items():
        tensor = where[name]
        assert tensor is not None
        loc = tensor.external_location
        if loc is None or os.path.realpath(loc[0]) not in links:
            names.append(name)
            arrays.append(ort.OrtValue.ortvalue_from_numpy(tensor.numpy()))
            continue
        del t.external_data[:]
        link = links[os.path.realpath(loc[0])]
        for key, value in (("location", link), ("offset", loc[1]), ("length", loc[2])):
            t.external_data.add(key=key, value=str(value))
    source: str | bytes = proto.SerializeToString()
    if links:
        source = os.path.join(folder, "model.onnx")
        with open(source, "wb") as f:
            f.write(proto.SerializeToString())
    so = run_once_options()
    # Ready nodes in graph order (Kahn's sort; the default order is a DFS from the outputs, which
    # runs every reduction last): with place_early, each activation dies after its reduction.
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if names:
        so.add_external_initializers(names, arrays)
    sess = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    stack.callback(arrays.clear)  # the OrtValues outlive the session's use of them
    return sess


def _linked_folder(
    files: Sequence[str], candidates: Sequence[str], stack: ExitStack
) -> tuple[str, dict[str, str]]:
    """A temporary folder with hard links to ``files`` (path -> link name): in the first
    candidate where every link can be made; else the last candidate's, with the links made."""
    folder = ""
    for parent in candidates:
        if not os.path.isdir(parent):
            continue
        folder = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="fastopt-ranges-", dir=parent)
        )
        links: dict[str, str] = {}
        for i, real in enumerate(files):
            try:
                os.link(real, os.path.join(folder, f"weights{i}.data"))
                links[real] = f"weights{i}.data"
            except OSError:  # another filesystem, or not allowed (protected_hardlinks)
                pass
        if len(links) == len(files):
            return folder, links
    if not folder:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-ranges-"))
        links = {}
    return folder, links


def describe(max_abs: float, samples: int) -> str:
    """ "max |x| 1.2e+05 over 4 inputs": how a range reads in reports."""
    return f"max |x| {max_abs:.3g} over {samples} input{'s' if samples != 1 else ''}"
