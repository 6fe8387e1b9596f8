"""fold_constants_ort's candidate walk runs in C++ (`_C.ort_fold_candidates`): it must pick the
same nodes, in the same order, with the same origin bytes, as the node-by-node Python walk it
replaced (kept here as the reference), on random graphs of constants, computed values and
graph inputs; and `Model.node_count` (the pass manager's per-pass count) must equal the sum of
`op_counts`."""

from __future__ import annotations

import random

import fastopt
import numpy as np
import onnx
import pytest
from fastopt import _C
from fastopt.passes import fold_constants_ort as fco
from onnx import TensorProto, helper, numpy_helper
from support.paths import TESTS

FIXTURES = TESTS / "fixtures" / "models"


def reference_candidates(
    graph: _C.Graph, max_bytes: int, max_expand_bytes: int
) -> tuple[list[_C.Node], dict[_C.Value, int]]:
    """The walk as the Python pass did it before it moved to C++."""
    native = set(_C.native_fold_ops())
    found: list[_C.Node] = []
    computed: dict[_C.Value, int] = {}

    def small(v: _C.Value) -> bool:
        t = v.constant
        return t is not None and t.nbytes <= max_bytes

    def in_bytes(v: _C.Value) -> int:
        t = v.constant
        return t.nbytes if t is not None else computed.get(v, 0)

    for node in graph.nodes:
        if node.domain not in ("", "ai.onnx") or node.op_type in fco._SKIP or node.subgraphs:
            continue
        inputs = [v for v in node.inputs if v is not None]
        if not inputs or not all(v in computed or small(v) for v in inputs):
            continue
        downstream = any(v in computed for v in inputs)
        if (
            node.op_type in native
            and not downstream
            and not _C.native_fold_unsupported(node, max_bytes, max_expand_bytes)
        ):
            continue
        if fco._defined_in_ort(node):
            found.append(node)
            origin = sum(in_bytes(v) for v in inputs)
            computed.update((v, origin) for v in node.outputs if v is not None)
    return found, computed


_UNARY = ["Sqrt", "Neg", "Abs", "Exp", "Identity", "Cast", "Softmax"]
_BINARY = ["Add", "Mul", "Sub", "Div", "Mod", "Pow", "Max"]
_DTYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT64: np.int64,
    TensorProto.INT32: np.int32,
}


def random_model(rng: random.Random) -> onnx.ModelProto:
    """Constants (some with zeros, one per graph over the size cap), a graph input, Constant
    nodes and 25 random elementwise nodes over them, with an If whose branch reads them too."""
    inits, nodes, pool = [], [], []  # pool: (name, elem_type)
    for i in range(6):
        et = rng.choice(list(_DTYPES))
        n = rng.choice([1, 3, 4, 600])  # 600 elements: over fold_max_bytes=1024 below
        arr = np.array([rng.choice([0, 1, 2, 3, -2]) for _ in range(n)], _DTYPES[et])
        inits.append(numpy_helper.from_array(arr, f"c{i}"))
        pool.append((f"c{i}", et))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])]
    pool.append(("x", TensorProto.FLOAT))
    for i in range(2):
        arr = np.array([rng.choice([0, 2, 5])] * 3, np.int64)
        nodes.append(
            helper.make_node("Constant", [], [f"k{i}"], value=numpy_helper.from_array(arr))
        )
        pool.append((f"k{i}", TensorProto.INT64))
    for i in range(25):
        name = f"v{i}"
        if rng.random() < 0.35:
            op = rng.choice(_UNARY)
            src, et = rng.choice(pool)
            attrs: dict[str, object] = {}
            if op == "Cast":
                et = rng.choice(list(_DTYPES))
                attrs["to"] = et
            nodes.append(helper.make_node(op, [src], [name], **attrs))
        else:
            op = rng.choice(_BINARY)
            a, et = rng.choice(pool)
            same = [p for p in pool if p[1] == et]
            b, _ = rng.choice(same)
            nodes.append(helper.make_node(op, [a, b], [name]))
        pool.append((name, et))
    last, et = pool[-1]
    branch_out = helper.make_tensor_value_info("b", et, None)
    body = [
        helper.make_node("Neg", [rng.choice(pool)[0]], ["n"]),
        helper.make_node("Identity", ["n"], ["b"]),
    ]
    branch = helper.make_graph(body, "branch", [], [branch_out])
    nodes.append(helper.make_node("If", ["c_cond"], ["y"], then_branch=branch, else_branch=branch))
    inits.append(numpy_helper.from_array(np.array(True), "c_cond"))
    outputs = [
        helper.make_tensor_value_info(last, et, None),
        helper.make_tensor_value_info("y", et, None),
    ]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("seed", range(40))
def test_candidates_match_the_python_walk(seed: int) -> None:
    model = fastopt.from_onnx(random_model(random.Random(seed)))
    seen = 0
    for max_bytes, max_expand in ((1024, 1024), (1 << 20, 1 << 16), (8, 8)):
        for graph in _C.nested_graphs(model):
            want, want_origin = reference_candidates(graph, max_bytes, max_expand)
            got, got_origin = _C.ort_fold_candidates(
                graph, max_bytes, max_expand, fco._SKIP, fco._defined_in_ort
            )
            assert got == want
            assert got_origin == want_origin
            seen += len(got)
    if seed == 0:
        assert seen > 0  # the generator does produce candidates


def test_nested_graphs_order() -> None:
    model = fastopt.from_onnx(random_model(random.Random(1)))
    graphs = [list(g.nodes) for g in _C.nested_graphs(model)]  # Graph handles do not compare
    ifs = [n for n in model.graph.nodes if n.op_type == "If"]
    assert graphs == [list(model.graph.nodes)] + [list(g.nodes) for n in ifs for g in n.subgraphs]
    assert len(graphs) == 3


def test_division_by_a_zero_constant_is_not_a_candidate() -> None:
    inits = [
        numpy_helper.from_array(np.array([4, 6], np.int64), "a"),
        numpy_helper.from_array(np.array([2, 0], np.int64), "z"),
        numpy_helper.from_array(np.array([2, 3], np.int64), "nz"),
    ]
    nodes = [
        helper.make_node("Div", ["a", "z"], ["d0"]),
        helper.make_node("Mod", ["a", "nz"], ["d1"]),
        helper.make_node("Sqrt", ["f"], ["s"]),
    ]
    inits.append(numpy_helper.from_array(np.array([4.0], np.float16), "f"))
    outs = [
        helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in ("d0", "d1", "s")
    ]
    model = fastopt.from_onnx(
        helper.make_model(
            helper.make_graph(nodes, "g", [], outs, inits),
            opset_imports=[helper.make_opsetid("", 17)],
        )
    )
    got, origin = _C.ort_fold_candidates(
        model.graph, 1 << 20, 1 << 16, fco._SKIP, fco._defined_in_ort
    )
    want, want_origin = reference_candidates(model.graph, 1 << 20, 1 << 16)
    assert got == want
    assert origin == want_origin
    assert "Div" not in [n.op_type for n in got]


@pytest.mark.parametrize("name", ["llama_ts_float32", "gemma3_dynamo_float16"])
def test_node_count_is_the_op_count_sum(name: str) -> None:
    model = fastopt.load(str(FIXTURES / name / "model.onnx"))
    assert model.node_count() == sum(model.op_counts().values())
    report = fastopt.optimize(model)
    assert model.node_count() == sum(model.op_counts().values()) == report.nodes_after
    assert [p.nodes_after for p in report.passes][-1] == report.nodes_after
