"""Inputs for a model from its graph inputs' types (:func:`fastopt.verify.core.make_inputs`; the
rules are in the ``fastopt.verify.core`` docstring): symbolic dims by what their names mean, token
ids inside the vocabulary the ids reach, masks, positions and cache lengths that agree."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Callable

from fastopt import _C
from fastopt._io import from_onnx, load
from fastopt._lazy import lazy_module
from fastopt._numpy import numpy_dtype
from fastopt.errors import UnsupportedModelError, entry_point
from fastopt.verify.check import ModelLike

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

# Values for symbolic dims nobody named in `dims`.
BATCH = 2


SEQUENCE = 8


PAST = 4


UNKNOWN_DIM = 4


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
