"""``fold_constants_ort``: constant folding through ONNX Runtime, for what fold_constants leaves.

fold_constants (C++) evaluates the ops of shape computations natively. Nodes whose inputs are
all constants but whose op it does not implement (Pow, Trilu, Split, float Range, float16
arithmetic, ...) are evaluated here: all such nodes of a graph, and the natively foldable nodes
that depend on them, go into one small model (``_C.constant_nodes_model``) that ONNX Runtime runs
once; if that fails, nodes are tried one by one. A Div / Mod by a divisor computed in the batch
joins it only when it is float (an integer one may be zero, which crashes the runtime). Results
within the size limits (options ``fold_max_bytes``, ``fold_max_expand_bytes``, as for
fold_constants) replace the nodes. Constant inputs over ``fold_max_bytes`` are never sent
through protobuf; random ops are never folded; function bodies are left alone.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt._numpy import numpy_dtype
from fastopt.pipeline.registry import PassContext, register_pass

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

# Not deterministic, or not meant to run at fold time.
_SKIP = frozenset(
    {
        "Bernoulli",
        "Dropout",
        "Multinomial",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
    }
)


# ONNX element types whose values ONNX Runtime returns as plain numpy arrays.
@functools.cache
def _onnx_types() -> dict[Any, int]:
    return {numpy_dtype(t): t for t in (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13)}


class _Limits:
    def __init__(self, options: dict[str, object]) -> None:
        self.max_bytes = int(options.get("fold_max_bytes", _C.FOLD_MAX_BYTES))  # type: ignore[call-overload]
        self.max_expand_bytes = int(
            options.get("fold_max_expand_bytes", _C.FOLD_MAX_EXPAND_BYTES)  # type: ignore[call-overload]
        )

    def allows(self, out_bytes: int, in_bytes: int) -> bool:
        return out_bytes <= self.max_bytes and (
            out_bytes <= self.max_expand_bytes or out_bytes <= in_bytes
        )


def _candidates(graph: _C.Graph, limits: _Limits) -> tuple[list[_C.Node], dict[_C.Value, int]]:
    """The foldable nodes, and for each value they compute the bytes of the constants it comes
    from (what "not expanding a small constant" compares against). A native op on plain
    constants counts only when fold_constants declined it for its types (then ONNX Runtime may
    fold it), not for its limits or values (then no one should). The walk runs in C++
    (``_C.ort_fold_candidates``); only Div, Mod and Pow call back here."""
    found, computed = _C.ort_fold_candidates(
        graph, limits.max_bytes, limits.max_expand_bytes, _SKIP, _defined_in_ort
    )
    return found, computed


def _input_bytes(v: _C.Value, computed: dict[_C.Value, int]) -> int:
    t = v.constant
    return t.nbytes if t is not None else computed.get(v, 0)


# float, float16, double, bfloat16: division by zero gives inf / nan, it does not crash.
_FLOAT_TYPES = frozenset({1, 10, 11, 16})


def _defined_in_ort(node: _C.Node) -> bool:
    """Integer division by zero crashes the runtime: only divisors known to be non-zero. An
    integer Pow computes in doubles and casts back: a result past the type is undefined (x86
    gives INT_MIN, other machines saturate), so only constant operands whose results fit."""
    if node.op_type not in ("Div", "Mod", "Pow") or len(node.inputs) < 2:
        return True
    # Both operands have one type (T): a float dividend or divisor makes the division float
    # (falcon's 1 / sqrt(head_dim) scale divides by a computed Sqrt).
    if node.op_type != "Pow" and any(
        v is not None and v.dtype in _FLOAT_TYPES for v in node.inputs[:2]
    ):
        return True
    if node.op_type == "Pow":
        return _pow_fits(node)
    divisor = node.inputs[1]
    t = divisor.constant if divisor is not None else None
    if t is None:
        return False  # computed by another folded node: unknown until run
    arr = t.numpy()
    return bool(np.issubdtype(arr.dtype, np.floating) or np.all(arr != 0))


def _pow_fits(node: _C.Node) -> bool:
    """A float Pow, or an integer one on constants whose every result is a value of T."""
    base, exponent = (v.constant if v is not None else None for v in node.inputs[:2])
    base_type = base.dtype if base is not None else node.inputs[0].dtype if node.inputs[0] else 0
    if base_type in _FLOAT_TYPES:
        return True
    if base is None or exponent is None:
        return False  # computed by another folded node (or of unknown type): unknown until run
    b, e = base.numpy(), exponent.numpy()
    if not np.issubdtype(b.dtype, np.integer):
        return False
    try:
        with np.errstate(all="ignore"):
            r = np.power(b.astype(np.float64), e.astype(np.float64))
    except ValueError:
        return False  # shapes that do not broadcast: ONNX Runtime refuses the node
    info = np.iinfo(b.dtype)
    # float(info.max) rounds up to 2^63 for int64: the bound is exclusive there.
    return bool(np.all(np.isfinite(r) & (r >= float(info.min)) & (r < float(info.max) + 1)))


def _run(nodes: list[_C.Node], outputs: list[_C.Value] | None = None) -> dict[str, Any]:
    import onnxruntime as ort  # type: ignore[import-untyped]

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    session = ort.InferenceSession(
        _C.constant_nodes_model(nodes, outputs), so, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {})))


def _replace(
    node: _C.Node, results: dict[str, Any], limits: _Limits, origin: dict[_C.Value, int]
) -> bool:
    """Puts the computed outputs of ``node`` in place; True when at least one was."""
    in_bytes = sum(_input_bytes(v, origin) for v in node.inputs if v is not None)
    done = False
    for out in node.outputs:
        if out is None or (not out.uses and not out.is_graph_output):
            continue
        arr = results.get(out.name)
        if not isinstance(arr, np.ndarray) or arr.dtype not in _onnx_types():
            continue
        if not limits.allows(arr.nbytes, in_bytes):
            continue
        data = cast(Any, np.ascontiguousarray(arr))  # a buffer (numpy's stubs say so from 3.12)
        out.replace_with_constant(_onnx_types()[arr.dtype], list(arr.shape), data)
        done = True
    return done


def _dead(node: _C.Node) -> bool:
    return all(o is None or (not o.uses and not o.is_graph_output) for o in node.outputs)


def _fold_graph(graph: _C.Graph, limits: _Limits, counters: dict[str, int]) -> int:
    nodes, origin = _candidates(graph, limits)
    if not nodes:
        return 0
    folded = 0
    # Only the values read outside the batch: ONNX Runtime then sees the chain as the model has
    # it (exposing an intermediate float16 value, say, would change how it computes the rest).
    members = set(nodes)
    needed = [
        o
        for node in nodes
        for o in node.outputs
        if o is not None and (o.is_graph_output or any(u not in members for u, _ in o.uses))
    ]
    try:
        results = _run(nodes, needed)
    except Exception:  # ONNX Runtime refused the batch: one node at a time, in order
        for node in nodes:
            if not node.alive or any(v is not None and v.constant is None for v in node.inputs):
                continue
            op = node.op_type
            try:
                replaced = _replace(node, _run([node]), limits, origin)
            except Exception:
                continue
            if replaced:
                folded += 1
                counters[f"folded_{op}"] = counters.get(f"folded_{op}", 0) + 1
            if node.alive and _dead(node):
                graph.remove_node(node)
        return folded
    # Last nodes first: a node whose consumers all folded is dropped without a constant.
    for node in reversed(nodes):
        if not node.alive:
            continue
        op = node.op_type
        if _replace(node, results, limits, origin):
            folded += 1
            counters[f"folded_{op}"] = counters.get(f"folded_{op}", 0) + 1
        if node.alive and _dead(node):
            graph.remove_node(node)
    return folded


@register_pass(
    "fold_constants_ort",
    "evaluate constant nodes without a native folder through ONNX Runtime (size-capped)",
    tags=("cleanup",),
)
def fold_constants_ort(ctx: PassContext) -> int:
    limits = _Limits(ctx.options)
    graphs = _C.nested_graphs(ctx.model)
    return sum(_fold_graph(g, limits, ctx.counters) for g in graphs)
