"""``fastopt.verify.check``: is a model valid ONNX that ONNX Runtime can load?

Three independent stages, each timed and reported:

``checker``
    ``onnx.checker.check_model`` (with ``full_check`` it also runs onnx's strict type and shape
    inference, without data propagation).
``shape_inference``
    ``onnx.shape_inference.infer_shapes(check_type=True, strict_mode=True, data_prop=True)``:
    data propagation folds shape computations (Shape -> Gather -> Concat -> Reshape), which finds
    inconsistencies the checker's full check cannot see.
``onnxruntime``
    an ``InferenceSession`` load (CPU unless ``providers`` says otherwise) with graph optimizations
    off, so every node is resolved against a kernel exactly as written rather than after ORT's own
    fusions have replaced it.

Large models never go through protobuf in memory (it cannot hold 2 GB): paths are handed to the
tools by path (``infer_shapes_path``, checker by path, ORT by path), and an in-memory Model whose
self-contained size is over the limit is first saved to a temporary folder with external data.

Contrib operators (``com.microsoft`` and other custom domains): onnx has no schemas for them. The
checker accepts a node of an unknown domain when the model imports that domain's opset (and
rejects it, rightly, when it does not), and onnx's shape inference (1.16 and 1.23 checked) skips
nodes without a schema, and whatever depends only on their outputs, even in strict mode. Should an
onnx version report an inference error *on* a custom-domain node that has no model-local function,
it is not fatal here: it is kept as a note in the stage's message. Errors on standard-domain nodes
(``""``, ``ai.onnx*``) and on nodes backed by a model-local function always fail the stage.

A model is judged against the runtime it targets: ONNX Runtime's own ops (its contrib domains, and
the few it registers in the ONNX domain, such as the ``SimplifiedLayerNormalization`` that target
"ort" writes) pass, checked against ORT's schemas (:mod:`fastopt.runtime.ops`), and the report says
the model runs in ONNX Runtime only (``CheckReport.runtime_ops``).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

from fastopt import _C
from fastopt._io import load
from fastopt.errors import entry_point
from fastopt.runtime.ops import describe, ort_knows, ort_schemas, runtime_ops
from fastopt.runtime.providers import CPU, provider_name, resolve, short_name

if TYPE_CHECKING:
    import onnx

ModelLike = Union[str, "os.PathLike[str]", _C.Model, "onnx.ModelProto"]

# Protobuf cannot serialize or parse a message of 2 GiB or more. Models above this limit go
# through files with external data. A module variable so tests can take that road with small
# models.
_INLINE_LIMIT = 2**31 - 1

STAGES = ("checker", "shape_inference", "onnxruntime")
_STAGE_TITLES = {
    "checker": "onnx.checker",
    "shape_inference": "strict shape inference",
    "onnxruntime": "the ONNX Runtime session load",
}
# Longest stage message kept in a report line or an exception; the full text stays in `detail`.
_MESSAGE_LIMIT = 400
_DETAIL_LIMIT = 20_000


class CheckError(_C.ModelError):
    """A model failed ``fastopt.verify.check``; ``report`` holds every stage's outcome.

    A subclass of :class:`fastopt.ModelError`, so code that handles bad models catches it too.
    """

    def __init__(self, message: str, report: CheckReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class StageResult:
    """One stage of a check: ``status`` is "ok", "failed" or "skipped"."""

    name: str
    status: str
    message: str = ""  # the first error, trimmed to a paragraph; or a note when ok
    seconds: float = 0.0
    detail: str = ""  # the tool's full error text (capped)

    @property
    def ok(self) -> bool:
        return self.status != "failed"


@dataclass
class CheckReport:
    model: str  # the path, or a description of the in-memory model
    stages: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0  # total, preparation (e.g. saving a large in-memory model) included
    # ONNX Runtime's own ops in the model, nodes by op ("com.microsoft::GroupQueryAttention";
    # no prefix for its ops in the ONNX domain): when any, the model runs in ORT only.
    runtime_ops: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.stages)

    @property
    def ort_only(self) -> bool:
        return bool(self.runtime_ops)

    @property
    def failed(self) -> list[StageResult]:
        return [s for s in self.stages if not s.ok]

    def stage(self, name: str) -> StageResult:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["ort_only"] = self.ort_only
        return out

    def __str__(self) -> str:
        rows = [(s.name, s.status, f"{s.seconds:.3f}s", s.message) for s in self.stages]
        head = f"check {'passed' if self.ok else 'FAILED'}: {self.model} ({self.seconds:.2f}s)"
        if self.runtime_ops:
            head += "\n" + describe(self.runtime_ops)
        return head + "\n" + format_table(("stage", "status", "time", "message"), rows)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table with columns padded to their widest cell (the last column is not)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(r[:-1], widths)] + [str(r[-1])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# --- getting a model to the tools -------------------------------------------------------------


@dataclass
class Source:
    """A model in the form ONNX tools take: a file path, a small ModelProto, or its bytes."""

    label: str
    path: str | None = None
    proto: onnx.ModelProto | None = None
    data: bytes | None = None

    def serialized(self) -> bytes:
        if self.data is None:
            assert self.proto is not None
            self.data = self.proto.SerializeToString()
        return self.data

    def for_ort(self) -> str | bytes:
        return self.path if self.path is not None else self.serialized()


def _save_external(model: _C.Model, stack: ExitStack) -> str:
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-"))
    path = os.path.join(folder, "model.onnx")
    # 4096-aligned tensors let ORT map them instead of copying.
    model.save(path, external_data=True, align=4096)
    return path


def open_source(model: ModelLike, stack: ExitStack, *, in_memory: str = "proto") -> Source:
    """Puts `model` where the ONNX tools can read it; temporary files live as long as `stack`.

    in_memory: "proto" or "bytes": what a small in-memory fastopt Model becomes.
    """
    import onnx

    if isinstance(model, onnx.ModelProto):
        return Source("<onnx.ModelProto>", proto=model)
    if isinstance(model, _C.Model):
        label = f"<fastopt.Model of {model.path}>" if model.path else "<fastopt.Model>"
        if model.self_contained_size() > _INLINE_LIMIT:
            return Source(label, path=_save_external(model, stack))
        if in_memory == "bytes":
            return Source(label, data=model.serialize())
        return Source(label, proto=model.to_onnx())
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"expected a path, fastopt.Model or onnx.ModelProto, not {type(model)}")
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no model file at '{path}'")
    if os.path.getsize(path) > _INLINE_LIMIT:
        # A single file past protobuf's limit: fastopt reads it, onnx and ORT cannot.
        return Source(path, path=_save_external(load(path), stack))
    return Source(path, path=path)


# --- error messages ---------------------------------------------------------------------------

# onnx prefixes each node's inference error with "(op_type:Add, node name: n1): ".
_NODE_ERROR = re.compile(r"\(op_type:([^,)]*)(?:, node name: ([^)]*))?\):")


def summarize_error(text: str, limit: int = _MESSAGE_LIMIT) -> str:
    """The first error of a tool's message as one short line.

    onnx follows a checker error with "==> Context:" and sometimes a dump of the node; strict
    shape inference lists every failing node; ORT's messages can embed whole graphs. Keep the
    first error and one line of context, and say how much was dropped.
    """
    text = text.strip()
    main, _, context = text.partition("==> Context:")
    entries = list(_NODE_ERROR.finditer(main))
    more = ""
    if len(entries) > 1:
        main = main[: entries[1].start()]
        more = f" (and {len(entries) - 1} more node errors)"
    summary = " ".join(main.split())
    context_line = context.strip().splitlines()[0].strip() if context.strip() else ""
    if context_line:
        summary += f" [context: {context_line}]"
    summary += more
    if len(summary) > limit:
        dropped = len(summary) - limit
        summary = f"{summary[:limit].rstrip()}... ({dropped} more characters)"
    return summary


def _is_standard_domain(domain: str) -> bool:
    return domain in ("", "ai.onnx") or domain.startswith("ai.onnx.")


def _custom_nodes(source: Source) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(node name -> domain, op_type -> domains) over all graphs, for nodes that onnx can only
    know through a schema: calls of model-local functions are left out, since errors inside a
    function body are real."""
    model = load(source.path) if source.path is not None else _C.load_bytes(source.serialized())
    functions = {(f.domain, f.name) for f in model.functions}
    by_name: dict[str, str] = {}
    by_op: dict[str, set[str]] = {}
    graphs = [model.graph] + [f.graph for f in model.functions]
    while graphs:
        g = graphs.pop()
        for n in g.nodes:
            graphs.extend(n.subgraphs)
            if (n.domain, n.op_type) in functions:
                continue
            if n.name:
                by_name[n.name] = n.domain
            by_op.setdefault(n.op_type, set()).add(n.domain)
    return by_name, by_op


def _custom_domain_only(message: str, source: Source) -> str | None:
    """A note when every node error in an inference message is on a custom-domain node, else
    None (the errors are real, or cannot be attributed to nodes)."""
    entries = list(_NODE_ERROR.finditer(message))
    if not entries:
        return None
    try:
        by_name, by_op = _custom_nodes(source)
    except _C.ModelError:
        return None
    for m in entries:
        op_type, node_name = m.group(1).strip(), (m.group(2) or "").strip()
        if node_name and node_name in by_name:
            custom = not _is_standard_domain(by_name[node_name])
        else:
            domains = by_op.get(op_type, set())
            custom = bool(domains) and not any(_is_standard_domain(d) for d in domains)
        if not custom:
            return None
    return "ignored inference errors on custom-domain nodes: " + summarize_error(message)


# --- the stages -------------------------------------------------------------------------------


def _timed(name: str, fn: Callable[[], str]) -> StageResult:
    start = time.perf_counter()
    try:
        note = fn()
    except Exception as e:  # any failure of the tool is the stage's verdict
        text = str(e) or type(e).__name__
        if type(e).__module__.split(".")[0] not in ("onnx", "onnxruntime"):
            text = f"{type(e).__name__}: {text}"
        return StageResult(
            name,
            "failed",
            summarize_error(text),
            time.perf_counter() - start,
            text[:_DETAIL_LIMIT],
        )
    return StageResult(name, "ok", note, time.perf_counter() - start)


def _checker(source: Source, full_check: bool) -> str:
    import onnx

    target: Any = source.path if source.path is not None else source.proto
    try:
        onnx.checker.check_model(target, full_check=full_check)
    except onnx.checker.ValidationError as e:
        # Only where onnx could not take ORT's schemas (ort_schemas: onnx before 1.16).
        op = re.search(r"No Op registered for (\S+) ", str(e))
        if op is None or not ort_knows(op.group(1)):
            raise
        raise onnx.checker.ValidationError(
            f"{op.group(1)} is an ONNX Runtime op in the ONNX domain, which has no schema for it "
            f"in onnx {onnx.__version__} (1.16 or later checks it against ONNX Runtime's schema): "
            f"onnx.checker: {e}"
        ) from e
    except onnx.shape_inference.InferenceError as e:
        note = _custom_domain_only(str(e), source)
        if note is None:
            raise
        onnx.checker.check_model(target, full_check=False)  # the structure must still hold
        return note
    return ""


def _shape_inference(source: Source, stack: ExitStack) -> str:
    import onnx

    opts: dict[str, Any] = {"check_type": True, "strict_mode": True, "data_prop": True}
    try:
        if source.path is not None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-"))
            out = os.path.join(folder, "inferred.onnx")
            onnx.shape_inference.infer_shapes_path(source.path, out, **opts)
        else:
            assert source.proto is not None
            onnx.shape_inference.infer_shapes(source.proto, **opts)
    except onnx.shape_inference.InferenceError as e:
        note = _custom_domain_only(str(e), source)
        if note is None:
            raise
        return note
    return ""


def onnxruntime() -> Any:
    """The onnxruntime module, imported on first use (it takes a while and has no stubs)."""
    import onnxruntime as ort  # type: ignore[import-untyped]

    return ort


def run_once_options() -> Any:
    """SessionOptions for a CPU session of fastopt's own that runs a model a few times: graph
    optimizations off, quiet, and no MLAS weight prepacking (which would copy every MatMul
    weight once more for runs this few)."""
    ort = onnxruntime()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_prepacking", "1")
    return so


def ort_session(
    source: Source,
    providers: Sequence[Any] | None,
    *,
    optimize: bool = False,
    profile_prefix: str | None = None,
) -> Any:
    """An InferenceSession of `source` (CPU unless `providers`), graph optimizations off by
    default: what runs is the graph as written.

    providers: one session's priority list of entries (names, short like "cuda" or full, or
    (name, options) pairs). ORT's habit of retrying on CPU when an accelerator fails is off, and
    a session that did not get every provider asked for is refused.
    profile_prefix: profile the session, writing its JSON under this prefix (see
    :func:`fastopt.runtime.providers.read_profile`).
    """
    ort = onnxruntime()
    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    chosen = check_providers(providers)
    sess = ort.InferenceSession(source.for_ort(), so, providers=chosen, enable_fallback=0)
    _check_started(chosen, sess.get_providers())
    return sess


def _check_started(chosen: Sequence[Any], started: Sequence[str]) -> None:
    """ORT drops a provider it cannot start (e.g. CUDA without its libraries) with only a log
    line, and the session then runs on CPU: refuse that."""
    missing = [provider_name(p) for p in chosen if provider_name(p) not in started]
    if missing:
        raise ValueError(
            f"ONNX Runtime could not start execution provider(s) {', '.join(missing)} "
            f"(the session got {', '.join(started)}); refusing to run on CPU instead"
        )


def check_providers(providers: Sequence[Any] | None) -> list[Any]:
    """The providers to use (CPU by default), short names resolved to ORT's. ORT quietly falls
    back to CPU for a provider it does not have, which would check something else than asked:
    refuse that instead."""
    chosen = [resolve(p) for p in providers] if providers else [CPU]
    available = onnxruntime().get_available_providers()
    for p in chosen:
        name = provider_name(p)
        if name not in available:
            raise ValueError(
                f"execution provider {name!r} is not available in this onnxruntime "
                f"(available: {', '.join(f'{short_name(a)} ({a})' for a in available)})"
            )
    return chosen


def _ort_load(source: Source, providers: Sequence[Any] | None) -> str:
    ort_session(source, providers)
    return ""


@entry_point("check")
def check(
    model_or_path: ModelLike,
    *,
    full_check: bool = True,
    strict_shapes: bool = True,
    ort: bool = True,
    providers: Sequence[Any] | None = None,
) -> CheckReport:
    """Check a model with onnx.checker, strict shape inference and an ONNX Runtime load.

    Every enabled stage runs even after another failed, so the report is complete.

    Parameters
    ----------
    model_or_path : str, os.PathLike, fastopt.Model or onnx.ModelProto
    full_check : bool, default True
        onnx.checker's full check (with its shape inference).
    strict_shapes : bool, default True
        Run onnx's strict shape inference.
    ort : bool, default True
        Load the model in ONNX Runtime.
    providers : sequence, optional
        The execution providers of the ONNX Runtime load (default CPU).

    Returns
    -------
    CheckReport
        One result per stage, when all pass.

    Raises
    ------
    CheckError
        A stage failed (a :class:`fastopt.ModelError` carrying ``.report``); the message names
        the first failing stage and its first error.
    FileNotFoundError
        No file at the path.
    """
    start = time.perf_counter()
    with ExitStack() as stack:
        source = open_source(model_or_path, stack, in_memory="proto")
        ops = _runtime_ops(model_or_path, source)
        with ort_schemas(ops):
            stages = [_timed("checker", lambda: _checker(source, full_check))]
            if strict_shapes:
                stages.append(_timed("shape_inference", lambda: _shape_inference(source, stack)))
            else:
                stages.append(StageResult("shape_inference", "skipped"))
        if ort:
            stages.append(_timed("onnxruntime", lambda: _ort_load(source, providers)))
        else:
            stages.append(StageResult("onnxruntime", "skipped"))
    report = CheckReport(source.label, stages, time.perf_counter() - start, ops)
    if not report.ok:
        raise CheckError(_failure_message(report, full_check), report)
    return report


def _runtime_ops(model: ModelLike, source: Source) -> dict[str, int]:
    """ORT's own ops in the model; {} when fastopt cannot read it (the checker will say why)."""
    try:
        if isinstance(model, _C.Model):
            return runtime_ops(model)
        if source.path is not None:
            return runtime_ops(load(source.path))
        return runtime_ops(_C.load_bytes(source.serialized()))
    except _C.ModelError:
        return {}


def _failure_message(report: CheckReport, full_check: bool) -> str:
    first, *rest = report.failed
    title = _STAGE_TITLES[first.name]
    if first.name == "checker" and full_check:
        title += " (full check)"
    text = f"{report.model} failed the {first.name} stage: {title} reported: {first.message}"
    if rest:
        text += f" (also failed: {', '.join(s.name for s in rest)})"
    return text
