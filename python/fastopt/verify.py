"""``fastopt.verify``: does an optimized model compute what the original computes?

Both models run in ONNX Runtime with graph optimizations off (so ORT's own rewrites neither hide
nor cause differences) on the same inputs, and every output is compared by name.

Inputs come from :func:`make_inputs`, which builds valid inputs from the graph inputs' types:

* symbolic dims from ``dims`` (name -> int), else by what the name means: batch-like names 2,
  sequence-like names 8, past-like names (``past_sequence_length``, ...) 4 when the model has any
  (0 otherwise), total-like names (``total_sequence_length``) past + sequence, arithmetic names as
  dynamo writes them (``past_sequence_length + sequence_length``) evaluated, anything else 4.
  Given some of sequence / past / total in ``dims``, the others follow from total = past + seq.
* token ids uniform in [0, vocab), where vocab is the first dimension of the embedding table the
  input reaches (through Gather, GatherBlockQuantized or EmbedLayerNormalization, past reshapes
  and casts); attention masks all ones; position ids counting on from the past length;
  token type ids zeros; ``seqlens_k`` total - 1; integer scalars named like a dim that dim's
  value; other integers in [0, 2); booleans random; floats standard normal.

Interface: outputs are matched by name (missing or extra outputs fail, so do changed dtypes or
shapes), and the optimized model must take no input the original lacks and drop none it has.
A past length in ``dims`` is ignored for a model without past-like dims, so one ``dims`` serves
models with and without a KV cache.

Tolerances (``|opt - orig| <= atol + rtol * |orig|`` elementwise, NaNs in the same places, infs
equal) default by the output's type: float32 1e-4/1e-4, float16 and bfloat16 1e-2/1e-2, float64
1e-7/1e-7, other small floats twice their epsilon; integers, booleans and strings exactly.
When either side of a comparison ran on an accelerator (any provider but CPU), float results
legitimately differ more (other kernels and accumulation orders, TF32 matmuls on NVIDIA GPUs), so
the defaults there are float32 1e-3/1e-3, float16 2e-2/2e-2, bfloat16 5e-2/5e-2. ``atol`` and
``rtol`` override either.

Providers (``providers=``, short names such as "cpu", "cuda", "tensorrt", "dml" or ORT's names,
optionally as ``(name, options)``; see :mod:`fastopt.providers`):

* none or one entry: both models run on that provider (CPU by default) and are compared, as
  always.
* several entries: each is a run of its own (ORT adds CPU behind any accelerator by itself, so a
  priority list such as ["CUDAExecutionProvider", "CPUExecutionProvider"] is two runs, CUDA and
  CPU). Both models run on every provider, and the report holds three kinds of comparison:
  "optimization" (optimized vs original on the same provider: did fastopt change results),
  "provider" (the original on each further provider vs the original on the first: did the
  provider change results) and "end-to-end" (optimized on each further provider vs the
  original on the first). ``report.outputs`` stays the optimization comparison on the first
  provider.

Every run on an accelerator, and every run of a several-provider check, is profiled once to
record which nodes ORT placed on CPU instead (``report.runs[i].placement``).
"""

from __future__ import annotations

import ast
import ctypes
import math
import operator
import os
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

from fastopt import _C
from fastopt._io import from_onnx, load
from fastopt._lazy import lazy_module
from fastopt._numpy import numpy_dtype
from fastopt.check import (
    ModelLike,
    Source,
    check_providers,
    format_table,
    onnxruntime,
    open_source,
    ort_session,
    summarize_error,
)
from fastopt.errors import UnsupportedModelError, entry_point
from fastopt.providers import Placement, is_accelerator, labels, provider_name, read_profile

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

Tolerance = Union[float, Mapping[str, float], None]

# Values for symbolic dims nobody named in `dims`.
BATCH = 2
SEQUENCE = 8
PAST = 4
UNKNOWN_DIM = 4

# dtype name -> (atol, rtol)
_TOLERANCES = {
    "float64": (1e-7, 1e-7),
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (1e-2, 1e-2),
    "complex128": (1e-7, 1e-7),
    "complex64": (1e-4, 1e-4),
}
# The same when a side ran on an accelerator (see the module docstring).
_ACCELERATOR_TOLERANCES = {
    **_TOLERANCES,
    "float32": (1e-3, 1e-3),
    "float16": (2e-2, 2e-2),
    "bfloat16": (5e-2, 5e-2),
    "complex64": (1e-3, 1e-3),
}
# ONNX element types ORT's numpy bridge cannot carry: they travel as raw OrtValues.
_ORT_RAW_TYPES = {
    "tensor(bfloat16)": 16,
    "tensor(float8e4m3fn)": 17,
    "tensor(float8e4m3fnuz)": 18,
    "tensor(float8e5m2)": 19,
    "tensor(float8e5m2fnuz)": 20,
}


class VerifyError(_C.ModelError):
    """The optimized model's outputs differ from the original's (or it could not be run);
    ``report`` holds the comparison. A subclass of :class:`fastopt.ModelError`."""

    def __init__(self, message: str, report: VerifyReport) -> None:
        super().__init__(message)
        self.report = report


class InputRejectedError(VerifyError):
    """ONNX Runtime cannot load or run the original model (on the inputs made for it): bad
    input, not a mismatch (the CLI exits 2)."""


class OutputRejectedError(VerifyError):
    """ONNX Runtime loads and runs the original but not the model fastopt produced: a fastopt
    bug, reported as a failed verification (the CLI exits 1). Please report it."""


@dataclass
class OutputComparison:
    name: str
    dtype: str
    shape: list[int] | None  # the original's; None when the original lacks the output
    optimized_shape: list[int] | None
    ok: bool
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0  # over elements whose reference magnitude exceeds atol
    mismatches: int = 0  # elements outside the tolerance
    atol: float = 0.0
    rtol: float = 0.0
    message: str = ""  # why it failed, or where the worst element is


@dataclass
class ProviderComparison:
    """One run's outputs against a reference run's, e.g. optimized@cuda vs original@cuda."""

    kind: str  # "optimization", "provider" or "end-to-end" (see the module docstring)
    reference: str  # "original@cpu"
    subject: str  # "optimized@cuda"
    outputs: list[OutputComparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def failed(self) -> list[OutputComparison]:
        return [o for o in self.outputs if not o.ok]


@dataclass
class ProviderRun:
    """One model run on one provider."""

    model: str  # "original" or "optimized"
    provider: str  # its label: "cpu", "cuda", "cpu#2"
    seconds: float = 0.0
    placement: Placement | None = None  # None when not profiled

    @property
    def name(self) -> str:
        return f"{self.model}@{self.provider}"


@dataclass
class VerifyReport:
    original: str
    optimized: str
    inputs: dict[str, str] = field(default_factory=dict)  # name -> "int64[2, 8]"
    # the optimization comparison on the first provider (empty for compare_providers)
    outputs: list[OutputComparison] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    error: str = ""  # a model could not be loaded or run
    providers: list[str] = field(default_factory=list)  # labels of the runs' providers
    runs: list[ProviderRun] = field(default_factory=list)
    # with several providers: every comparison, the first provider's optimization one included
    comparisons: list[ProviderComparison] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            not self.error
            and all(o.ok for o in self.outputs)
            and all(c.ok for c in self.comparisons)
        )

    @property
    def failed(self) -> list[OutputComparison]:
        return [o for o in self.outputs if not o.ok]

    def output(self, name: str) -> OutputComparison:
        for o in self.outputs:
            if o.name == name:
                return o
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        for c, d in zip(self.comparisons, out["comparisons"]):
            d["ok"] = c.ok
        for r, d in zip(self.runs, out["runs"]):
            if r.placement is not None:
                d["placement"]["fallback_count"] = r.placement.fallback_count
        return out

    def comparison_table(self) -> str:
        """One row per cross-provider comparison: its worst output and verdict."""
        rows = []
        for c in self.comparisons:
            worst = max(c.outputs, key=lambda o: (not o.ok, o.max_abs_err), default=None)
            rows.append(
                (
                    c.kind,
                    c.subject,
                    c.reference,
                    f"{len(c.outputs) - len(c.failed)}/{len(c.outputs)}",
                    f"{worst.max_abs_err:.3g}" if worst else "-",
                    f"{worst.atol:g}/{worst.rtol:g}" if worst else "-",
                    "ok" if c.ok else "FAIL",
                    "" if worst is None or worst.ok else f"{worst.name}: {worst.message}",
                )
            )
        header = ("kind", "run", "reference", "outputs ok", "max_abs", "atol/rtol", "status")
        return format_table((*header, "note"), rows)

    def placement_table(self) -> str:
        """One row per profiled run: nodes per provider, CPU fallbacks by op type, transfers."""
        rows = []
        for r in self.runs:
            p = r.placement
            if p is None:
                continue
            nodes = ", ".join(f"{k} {v}" for k, v in sorted(p.nodes.items()))
            transfers = ", ".join(f"{k} {v}" for k, v in sorted(p.transfers.items()))
            rows.append(
                (r.name, nodes, str(p.fallback_count), transfers or "-", p.fallback_text() or "-")
            )
        header = ("run", "nodes by provider", "cpu fallbacks", "transfers", "fallback ops")
        return format_table(header, rows)

    def table(self, outputs: Sequence[OutputComparison] | None = None) -> str:
        rows = [
            (
                o.name,
                o.dtype,
                _shape_text(o.shape, o.optimized_shape),
                f"{o.max_abs_err:.3g}",
                f"{o.max_rel_err:.3g}",
                f"{o.atol:g}/{o.rtol:g}",
                "ok" if o.ok else "FAIL",
                o.message,
            )
            for o in (self.outputs if outputs is None else outputs)
        ]
        header = ("output", "dtype", "shape", "max_abs", "max_rel", "atol/rtol", "status", "note")
        return format_table(header, rows)

    def __str__(self) -> str:
        verdict = "passed" if self.ok else "FAILED"
        feeds = ", ".join(f"{k} {v}" for k, v in self.inputs.items())
        what = f"{self.optimized} vs {self.original}" if self.optimized else self.original
        text = f"verify {verdict}: {what}\ninputs: {feeds}\n"
        if len(self.providers) > 1:
            text += f"providers: {', '.join(self.providers)}\n"
        if self.error:
            text += f"error: {self.error}\n"
        parts = [self.table()] if self.outputs or not self.comparisons else []
        if self.comparisons:
            parts.append(self.comparison_table())
        if any(r.placement is not None for r in self.runs):
            parts.append(self.placement_table())
        return text + "\n\n".join(parts)


def _shape_text(a: list[int] | None, b: list[int] | None) -> str:
    def one(s: list[int] | None) -> str:
        return "-" if s is None else "[" + ", ".join(map(str, s)) + "]"

    return one(a) if a == b else f"{one(a)} vs {one(b)}"


# --- input synthesis --------------------------------------------------------------------------


def _as_model(model: ModelLike) -> _C.Model:
    import onnx

    if isinstance(model, _C.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return from_onnx(model)
    return load(model)


def _role(name: str) -> str | None:
    """What a symbolic dim (or a scalar input) named `name` counts: batch, past, total, sequence."""
    n = name.lower()
    if "batch" in n or n in ("b", "n", "bs"):
        return "batch"
    if "past" in n:
        return "past"
    if "total" in n or "present" in n:
        return "total"
    if "seq" in n or "len" in n or "token" in n or n in ("s", "t", "l"):
        return "sequence"
    return None


_BINOPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,  # dims are integers; sympy writes s0/2 for exact halves
    ast.Mod: operator.mod,
}


def _is_expression(name: str) -> bool:
    return any(c in name for c in "+*/%()") or " - " in name


class _Dims:
    """Values for the symbolic dims of a model's inputs, consistent with each other."""

    def __init__(self, names: set[str], given: Mapping[str, int]) -> None:
        self.given = {k: int(v) for k, v in given.items()}
        for k, v in self.given.items():
            if v < 0:
                raise ValueError(f"dims[{k!r}] = {v} is negative")
        has_past = any(_role(n) == "past" for n in names if not _is_expression(n))
        roles: dict[str, int] = {}
        for k, v in self.given.items():
            r = _role(k)
            # a past length for a model without a cache (a shared `dims`) would offset positions
            if r is not None and (r != "past" or has_past):
                roles.setdefault(r, v)
        seq, past, total = roles.get("sequence"), roles.get("past"), roles.get("total")
        if total is not None:
            if seq is None and past is None:
                past = max(0, min(PAST if has_past else 0, total - 1))
            if seq is None:
                seq = total - (past or 0)
            if past is None:
                past = total - seq
            if seq < 0 or past < 0:
                raise ValueError(f"dims: total length {total} is shorter than its parts")
        else:
            seq = SEQUENCE if seq is None else seq
            past = (PAST if has_past else 0) if past is None else past
            total = seq + past
        self.roles = {
            "batch": roles.get("batch", BATCH),
            "sequence": seq,
            "past": past,
            "total": total,
        }

    def value(self, name: str) -> int:
        if name in self.given:
            return self.given[name]
        if _is_expression(name):
            got = self._evaluate(name)
            if got is not None:
                return got
        role = _role(name)
        return self.roles[role] if role else UNKNOWN_DIM

    def _evaluate(self, expr: str) -> int | None:
        def ev(node: ast.AST) -> int:
            if isinstance(node, ast.Expression):
                return ev(node.body)
            if isinstance(node, ast.Constant) and isinstance(node.value, int):
                return node.value
            if isinstance(node, ast.Name):
                return self.value(node.id)
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
                return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                return -ev(node.operand)
            raise ValueError(expr)

        try:
            got = ev(ast.parse(expr, mode="eval"))
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            return None
        return got if got >= 0 else None

    def shape(self, v: _C.Value) -> list[int]:
        if v.shape is None:
            raise UnsupportedModelError(
                f"input '{v.name}' has no shape in the model; pass it in `inputs`"
            )
        return [
            d if isinstance(d, int) else UNKNOWN_DIM if d is None else self.value(d)
            for d in v.shape
        ]


# Ops that carry token ids on unchanged (up to layout and type) towards an embedding lookup.
_PASS_THROUGH = {"Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Expand"}


def _first_dim(v: _C.Value | None, axis: int = 0, depth: int = 0) -> int | None:
    """Static size of `v` along `axis`: from an initializer, a Constant, the declared shape, or
    through a Cast / Identity / DequantizeLinear in front of one."""
    if v is None or depth > 8:
        return None
    if v.initializer is not None:
        shape = v.initializer.shape
        return shape[axis] if len(shape) > axis else None
    if v.shape is not None and len(v.shape) > axis and isinstance(v.shape[axis], int):
        return int(v.shape[axis])  # type: ignore[arg-type]
    p = v.producer
    if p is None:
        return None
    if p.op_type == "Constant" and isinstance(p.attributes.get("value"), _C.Tensor):
        shape = p.attributes["value"].shape
        return shape[axis] if len(shape) > axis else None
    if p.op_type in ("Cast", "Identity", "DequantizeLinear") and p.inputs:
        return _first_dim(p.inputs[0], axis, depth + 1)
    return None


def _table_size(node: _C.Node, index: int) -> int | None:
    """The number of rows an index at input `index` of `node` may address, if it is a lookup."""
    ins = node.inputs
    if node.op_type == "Gather" and index == 1:
        axis = node.attributes.get("axis", 0)
        return _first_dim(ins[0], axis) if isinstance(axis, int) and axis >= 0 else None
    if node.op_type == "GatherBlockQuantized" and index == 1:
        axis = node.attributes.get("gather_axis", 0)
        return _first_dim(ins[0], axis) if isinstance(axis, int) and axis >= 0 else None
    if node.op_type == "EmbedLayerNormalization" and index in (0, 1):
        table = 2 if index == 0 else 4  # word / segment embedding
        return _first_dim(ins[table]) if len(ins) > table else None
    return None


def _reachable_vocab(v: _C.Value) -> int | None:
    """The smallest embedding table that `v` indexes (following pass-through ops), or None."""
    sizes: list[int] = []
    seen: set[str] = set()
    frontier = [v]
    while frontier:
        cur = frontier.pop()
        if cur.name in seen or len(seen) > 64:
            continue
        seen.add(cur.name)
        for node, index in cur.uses:
            size = _table_size(node, index)
            if size is not None and size > 0:
                sizes.append(size)
            elif node.op_type in _PASS_THROUGH and index == 0:
                frontier.extend(o for o in node.outputs if o is not None)
    return min(sizes) if sizes else None


def _fallback_vocab(graph: _C.Graph) -> int:
    """The first Gather with a 2-D initializer table, else an embedding-named initializer."""
    for node in graph.nodes:
        if node.op_type == "Gather" and node.inputs and node.inputs[0] is not None:
            t = node.inputs[0].initializer
            if t is not None and len(t.shape) >= 2 and t.shape[0] > 0:
                return t.shape[0]
    for t in graph.initializers:
        if ("embed" in t.name.lower() or "wte" in t.name.lower()) and len(t.shape) == 2:
            return t.shape[0]
    return 2


def _is_ids_name(name: str) -> bool:
    n = name.lower()
    return n.endswith("ids") or n in ("tokens", "input", "inputs")


def _cast(values: np.ndarray, onnx_type: int) -> np.ndarray:
    # np.ascontiguousarray would turn a scalar into shape (1,)
    return np.array(values, dtype=numpy_dtype(onnx_type), order="C")


def _synthesize(
    model: _C.Model,
    dims: Mapping[str, int] | None,
    seed: int,
    skip: Collection[str] = (),
) -> dict[str, np.ndarray]:
    graph = model.graph
    inputs = [
        v for v in graph.inputs if v is not None and v.initializer is None and v.name not in skip
    ]
    names = {d for v in graph.inputs if v is not None and v.shape for d in v.shape}
    sized = _Dims({d for d in names if isinstance(d, str)}, dims or {})
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for v in inputs:
        if v.dtype == 0:
            raise UnsupportedModelError(
                f"input '{v.name}' is not a tensor of known type; pass it in `inputs`"
            )
        shape = sized.shape(v)
        out[v.name] = _one_input(v, shape, sized, rng, graph)
    return out


def _one_input(
    v: _C.Value, shape: list[int], sized: _Dims, rng: np.random.Generator, graph: _C.Graph
) -> np.ndarray:
    n = v.name.lower()
    dtype = numpy_dtype(v.dtype)
    count = math.prod(shape)
    if dtype == np.bool_:
        if "mask" in n:
            return np.ones(shape, dtype=np.bool_)
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        total, past = sized.roles["total"], sized.roles["past"]
        if "position" in n:
            length = shape[-1] if shape else 1
            # the last `length` positions of the whole sequence: past..total for new tokens
            start = total - length if 0 <= total - length <= past else 0
            positions = np.arange(start, start + length)
            values = np.broadcast_to(positions, shape) if shape else np.asarray(start)
        elif "token_type" in n or "segment" in n:
            values = np.zeros(shape)
        elif "mask" in n:
            values = np.ones(shape)
        elif "seqlens_k" in n:
            values = np.full(shape, total - 1)  # GroupQueryAttention: lengths minus one
        else:
            vocab = _reachable_vocab(v)
            role = _role(v.name)
            if vocab is None and count == 1 and role is not None:
                values = np.full(shape, sized.roles[role])  # e.g. total_sequence_length
            else:
                if vocab is None and _is_ids_name(v.name):
                    vocab = _fallback_vocab(graph)
                values = rng.integers(0, vocab or 2, shape)
        return _cast(values, v.dtype)
    if dtype == np.object_:
        return np.full(shape, "a", dtype=object)
    if "mask" in n:
        return _cast(np.ones(shape), v.dtype)
    return _cast(rng.standard_normal(shape), v.dtype)


@entry_point("make_inputs")
def make_inputs(
    model_or_path: ModelLike, dims: Mapping[str, int] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Valid inputs for every graph input of a model (initializer-backed inputs excluded).

    dims: values for symbolic dims by name (e.g. ``{"batch_size": 1, "sequence_length": 16}``);
    unnamed ones get sensible, mutually consistent defaults (see the module's docstring). The
    arrays depend only on the model, `dims` and `seed`. Raises ValueError for an input whose type
    or rank the model does not declare.
    """
    return _synthesize(_as_model(model_or_path), dims, seed)


# --- running and comparing --------------------------------------------------------------------


def _ort_feed(array: np.ndarray, ort_type: str) -> Any:
    ort = onnxruntime()
    # not np.ascontiguousarray: it makes scalars 1-D
    array = array if array.flags.c_contiguous else array.copy(order="C")
    if ort_type in _ORT_RAW_TYPES:
        bits = array.view(np.uint8 if array.itemsize == 1 else np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            bits, onnx_element_type=_ORT_RAW_TYPES[ort_type]
        )
    return ort.OrtValue.ortvalue_from_numpy(array)


def _ort_fetch(value: Any, ort_type: str) -> Any:
    if ort_type in _ORT_RAW_TYPES:
        # numpy has no such dtype in ORT's bridge: copy the bytes of the (CPU) tensor.
        raw = ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes())
        dtype = numpy_dtype(_ORT_RAW_TYPES[ort_type])
        return np.frombuffer(raw, dtype=dtype).reshape(value.shape()).copy()
    return value.numpy()


def _run(
    source: Source,
    feeds: Mapping[str, np.ndarray],
    provider: Any,
    profile_prefix: str | None = None,
) -> tuple[list[str], dict[str, Any], Placement | None]:
    """Runs a model on `feeds` (only the inputs it declares) with one provider entry (None: CPU):
    its input names, its outputs by name in its order, and, with `profile_prefix`, where ORT
    placed its nodes."""
    sess = ort_session(
        source, None if provider is None else [provider], profile_prefix=profile_prefix
    )
    wanted = sess.get_inputs()
    missing = [i.name for i in wanted if i.name not in feeds]
    if missing:
        raise ValueError(f"it takes inputs the original does not: {', '.join(missing)}")
    outputs = sess.get_outputs()
    names = [o.name for o in outputs]
    if any(i.type in _ORT_RAW_TYPES for i in [*wanted, *outputs]):
        ort_feeds = {i.name: _ort_feed(feeds[i.name], i.type) for i in wanted}
        values = sess.run_with_ort_values(names, ort_feeds)
        fetched = {o.name: _ort_fetch(v, o.type) for o, v in zip(outputs, values)}
    else:
        results = sess.run(names, {i.name: feeds[i.name] for i in wanted})
        fetched = dict(zip(names, results))
    placement = None
    if profile_prefix is not None:
        requested = "cpu" if provider is None else provider_name(provider)
        placement = read_profile(sess.end_profiling(), requested)
    return [i.name for i in wanted], fetched, placement


def _float_kind(dtype: np.dtype) -> bool:
    return dtype.kind in "fc" or dtype.name in ("bfloat16",) or dtype.name.startswith("float")


def _default_tolerance(
    dtype: np.dtype, table: Mapping[str, tuple[float, float]] = _TOLERANCES
) -> tuple[float, float]:
    if dtype.name in table:
        return table[dtype.name]
    if _float_kind(dtype):
        import ml_dtypes

        eps = 2 * float(ml_dtypes.finfo(dtype).eps)
        return eps, eps
    return 0.0, 0.0


def _pick(option: Tolerance, name: str, is_float: bool, default: float) -> float:
    if isinstance(option, Mapping):
        return float(option[name]) if name in option else default
    if option is not None and is_float:
        return float(option)
    return default


def _compare(
    name: str,
    expected: Any,
    actual: Any,
    rtol: Tolerance,
    atol: Tolerance,
    table: Mapping[str, tuple[float, float]] = _TOLERANCES,
) -> list[OutputComparison]:
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not (isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple))):
            return [OutputComparison(name, "sequence", None, None, False, message="kind differs")]
        if len(expected) != len(actual):
            msg = f"sequence of {len(actual)} elements, expected {len(expected)}"
            return [OutputComparison(name, "sequence", None, None, False, message=msg)]
        found: list[OutputComparison] = []
        for i, (e, a) in enumerate(zip(expected, actual)):
            found += _compare(f"{name}[{i}]", e, a, rtol, atol, table)
        return found
    e, a = np.asarray(expected), np.asarray(actual)
    result = OutputComparison(name, e.dtype.name, list(e.shape), list(a.shape), True)
    is_float = _float_kind(e.dtype)
    d_atol, d_rtol = _default_tolerance(e.dtype, table)
    result.atol = _pick(atol, name, is_float, d_atol)
    result.rtol = _pick(rtol, name, is_float, d_rtol)
    if e.dtype != a.dtype:
        result.ok, result.message = False, f"dtype {a.dtype.name}, expected {e.dtype.name}"
        return [result]
    if e.shape != a.shape:
        result.ok, result.message = False, "shapes differ"
        return [result]
    if e.size == 0:
        return [result]
    if e.dtype == np.object_:
        bad = e != a
        result.mismatches = int(np.count_nonzero(bad))
    else:
        wide = np.complex128 if e.dtype.kind == "c" else np.float64
        ef, af = e.astype(wide), a.astype(wide)
        nan_e, nan_a = np.isnan(ef), np.isnan(af)
        both = nan_e & nan_a
        # the same infinity, or both NaN, is a match; elsewhere the tolerance decides
        same = (ef == af) | both
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(same, 0.0, np.abs(ef - af))
            diff = np.where(np.isnan(diff), np.inf, diff)
            bad = diff > result.atol + result.rtol * np.abs(ef)
            bad |= nan_e != nan_a
            result.max_abs_err = float(diff.max())
            big = np.abs(ef) > max(result.atol, np.finfo(np.float64).tiny)
            rel = diff[big] / np.abs(ef[big])
            result.max_rel_err = float(rel.max()) if rel.size else 0.0
        result.mismatches = int(np.count_nonzero(bad))
    if result.mismatches:
        flat = np.asarray(bad).reshape(-1)
        where = int(np.argmax(diff.reshape(-1))) if e.dtype != np.object_ else int(np.argmax(flat))
        index = list(np.unravel_index(where, e.shape)) if e.shape else []
        result.ok = False
        result.message = (
            f"{result.mismatches} of {e.size} elements off; worst at {[int(i) for i in index]}: "
            f"{_scalar(e.reshape(-1)[where])} expected, got {_scalar(a.reshape(-1)[where])}"
        )
    return [result]


def _scalar(x: Any) -> str:
    value = x.item() if hasattr(x, "item") else x
    return f"{value:.7g}" if isinstance(value, float) else repr(value)


def _describe(array: np.ndarray) -> str:
    return f"{array.dtype.name}[{', '.join(map(str, array.shape))}]"


def _label(model: ModelLike) -> str:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    if isinstance(model, _C.Model):
        return f"<fastopt.Model of {model.path}>" if model.path else "<fastopt.Model>"
    return "<onnx.ModelProto>"


def _compare_outputs(
    want: Mapping[str, Any],
    got: Mapping[str, Any],
    rtol: Tolerance,
    atol: Tolerance,
    table: Mapping[str, tuple[float, float]],
    subject: str = "optimized",
) -> list[OutputComparison]:
    """Every output of `want` against `got` by name; missing and extra outputs fail."""
    found: list[OutputComparison] = []
    for name, expected in want.items():
        if name not in got:
            found.append(
                OutputComparison(name, "-", None, None, False, message=f"missing from {subject}")
            )
            continue
        found += _compare(name, expected, got[name], rtol, atol, table)
    for name in got:
        if name not in want:
            found.append(
                OutputComparison(name, "-", None, None, False, message="not in the original")
            )
    return found


def _failure_text(report: VerifyReport) -> str:
    """The VerifyError message: what differs, and a table of the failing outputs."""
    if report.optimized:
        text = f"{report.optimized} differs from {report.original}"
    else:
        text = f"{report.original} differs across providers"
    reasons = [report.error] if report.error else []
    failed = report.failed
    if failed:
        reasons.append(f"{len(failed)} of {len(report.outputs)} outputs fail")
    bad = [c for c in report.comparisons if not c.ok and c.outputs is not report.outputs]
    for c in bad:
        reasons.append(f"{c.subject} vs {c.reference} ({c.kind}): {len(c.failed)} outputs fail")
    text += ": " + "; ".join(reasons)
    if failed:
        text += "\n" + report.table(failed)
    for c in bad:
        text += f"\n{c.subject} vs {c.reference}:\n" + report.table(c.failed)
    return text


def _verify(
    original: ModelLike,
    optimized: ModelLike | None,
    inputs: Mapping[str, np.ndarray] | None,
    dims: Mapping[str, int] | None,
    rtol: Tolerance,
    atol: Tolerance,
    seed: int,
    providers: Sequence[Any] | None,
) -> VerifyReport:
    """verify() and compare_providers(): `optimized` None runs only the original."""
    start = time.perf_counter()
    entries: list[Any] = check_providers(providers) if providers else [None]
    names = labels(entries) if providers else ["cpu"]
    several = len(entries) > 1
    given = {k: np.asarray(v) for k, v in (inputs or {}).items()}
    feeds = {**_synthesize(_as_model(original), dims, seed, skip=set(given)), **given}
    report = VerifyReport(
        _label(original),
        "" if optimized is None else _label(optimized),
        {k: _describe(np.asarray(v)) for k, v in feeds.items()},
        providers=names,
    )
    models = [("original", original)]
    if optimized is not None:
        models.append(("optimized", optimized))
    results: dict[tuple[str, str], dict[str, Any]] = {}
    declared: dict[str, list[str]] = {}
    with ExitStack() as stack:
        sources = {role: open_source(m, stack, in_memory="bytes") for role, m in models}
        profiles = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-profile-"))
        for entry, label in zip(entries, names):
            profile = several or (entry is not None and is_accelerator(provider_name(entry)))
            for role, _ in models:
                t = time.perf_counter()
                try:
                    prefix = os.path.join(profiles, f"{role}-{len(report.runs)}")
                    got = _run(sources[role], feeds, entry, prefix if profile else None)
                except (FileNotFoundError, TypeError):
                    raise
                except Exception as e:
                    where = f" on {label}" if several else ""
                    report.error = (
                        f"ONNX Runtime could not run the {role} model{where}: "
                        f"{summarize_error(str(e))}"
                    )
                    report.seconds["total"] = time.perf_counter() - start
                    if role == "original":
                        report.error += " (choose inputs with `inputs=` or `dims=`)"
                        raise InputRejectedError(report.error, report) from e
                    report.error += " (the original runs: a fastopt bug, please report it)"
                    raise OutputRejectedError(report.error, report) from e
                declared.setdefault(role, got[0])
                results[role, label] = got[1]
                seconds = time.perf_counter() - t
                report.runs.append(ProviderRun(role, label, seconds, got[2]))
                report.seconds[f"{role}@{label}" if several else role] = seconds
    _fill_comparisons(report, results, entries, names, optimized is not None, rtol, atol)
    if optimized is not None:
        dropped = [n for n in declared["original"] if n not in declared["optimized"]]
        if dropped:
            # ORT refuses feeds it does not know: callers of the original would break.
            report.error = f"the optimized model no longer takes input(s) {', '.join(dropped)}"
    report.seconds["total"] = time.perf_counter() - start
    if not report.ok:
        raise VerifyError(_failure_text(report), report)
    return report


def _fill_comparisons(
    report: VerifyReport,
    results: Mapping[tuple[str, str], Mapping[str, Any]],
    entries: Sequence[Any],
    names: Sequence[str],
    has_optimized: bool,
    rtol: Tolerance,
    atol: Tolerance,
) -> None:
    """The optimization comparison on the first provider into ``report.outputs``; with several
    providers, every comparison of the module docstring into ``report.comparisons``."""

    def table(*labels_: str) -> Mapping[str, tuple[float, float]]:
        accelerated = any(
            e is not None and is_accelerator(provider_name(e))
            for e, n in zip(entries, names)
            if n in labels_
        )
        return _ACCELERATOR_TOLERANCES if accelerated else _TOLERANCES

    def compare(kind: str, subject: tuple[str, str], reference: tuple[str, str]) -> None:
        outputs = _compare_outputs(
            results[reference],
            results[subject],
            rtol,
            atol,
            table(subject[1], reference[1]),
            subject[0],
        )
        report.comparisons.append(
            ProviderComparison(kind, "@".join(reference), "@".join(subject), outputs)
        )

    first = names[0]
    for label in names:
        if has_optimized:
            compare("optimization", ("optimized", label), ("original", label))
        if label != first:
            compare("provider", ("original", label), ("original", first))
            if has_optimized:
                compare("end-to-end", ("optimized", label), ("original", first))
    if has_optimized:
        report.outputs = report.comparisons[0].outputs
    if len(names) == 1:
        report.comparisons = []  # one provider: the classic report, nothing across providers


@entry_point("verify")
def verify(
    original: ModelLike,
    optimized: ModelLike,
    inputs: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    rtol: Tolerance = None,
    atol: Tolerance = None,
    seed: int = 0,
    providers: Sequence[Any] | None = None,
) -> VerifyReport:
    """Runs `original` and `optimized` on the same inputs and compares every output by name.

    original, optimized: paths, :class:`fastopt.Model` or ``onnx.ModelProto``; large in-memory
    models are saved to a temporary folder with external data, never serialized in memory.
    inputs: arrays for some or all graph inputs; the rest come from :func:`make_inputs` on the
    original with `dims` and `seed`. rtol, atol: one value for every floating-point output, or a
    mapping output name -> value; None takes the dtype's default (see the module docstring).
    providers: None (CPU) or one entry runs both models there; several entries compare across
    providers too (see the module docstring). An unavailable provider raises ValueError naming
    the available ones.
    Returns the report when every output matches; raises :class:`VerifyError`, whose message
    tables the failing outputs, when one does not, when output names, dtypes or shapes differ, or
    when a model cannot be loaded or run.
    """
    return _verify(original, optimized, inputs, dims, rtol, atol, seed, providers)


@entry_point("compare_providers")
def compare_providers(
    model: ModelLike,
    providers: Sequence[Any],
    inputs: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    rtol: Tolerance = None,
    atol: Tolerance = None,
    seed: int = 0,
) -> VerifyReport:
    """Runs one model on every provider in `providers` and compares each run to the first
    ("provider" comparisons only; ``report.optimized`` is empty and ``report.outputs`` too).

    Arguments as for :func:`verify`. Returns the report, with every run's node placement, when
    all runs agree; raises :class:`VerifyError` otherwise.
    """
    if not providers:
        raise ValueError("compare_providers needs at least one provider")
    return _verify(model, None, inputs, dims, rtol, atol, seed, providers)
