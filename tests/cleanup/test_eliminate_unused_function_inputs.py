"""eliminate_unused_function_inputs: inputs a local function never reads leave the function and
every call to it (in the main graph, in subgraphs, and in other functions)."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

F = TensorProto.FLOAT
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]


def _model() -> onnx.ModelProto:
    # f(a, b, c) = Relu(a) + c; b is never read.
    f = helper.make_function(
        "local",
        "f",
        ["a", "b", "c"],
        ["y"],
        [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Add", ["r", "c"], ["y"])],
        [helper.make_opsetid("", 17)],
    )
    # g(p, q) = f(p, q, p); g reads all of its inputs through f, but f drops q.
    g_fn = helper.make_function(
        "local",
        "g",
        ["p", "q"],
        ["z"],
        [helper.make_node("f", ["p", "q", "p"], ["z"], domain="local")],
        OPSETS,
    )
    then_g = helper.make_graph(
        [helper.make_node("f", ["X", "T", "X"], ["t"], domain="local")],
        "then",
        [],
        [helper.make_tensor_value_info("t", F, [3])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["X"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", F, [3])],
    )
    nodes = [
        helper.make_node("Sigmoid", ["X"], ["T"]),  # only feeds the unused argument
        helper.make_node("f", ["X", "T", "X"], ["Y1"], domain="local"),
        helper.make_node("g", ["X", "X"], ["Y2"], domain="local"),
        helper.make_node("If", ["C"], ["Y3"], then_branch=then_g, else_branch=else_g),
    ]
    graph = helper.make_graph(
        nodes,
        "main",
        [
            helper.make_tensor_value_info("X", F, [3]),
            helper.make_tensor_value_info("C", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info(n, F, [3]) for n in ("Y1", "Y2", "Y3")],
    )
    return helper.make_model(graph, opset_imports=OPSETS, functions=[f, g_fn])


def _run(model: onnx.ModelProto, c: bool) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"X": np.array([-1.0, 0.5, 2.0], np.float32), "C": np.array(c)})


def test_unused_function_input_leaves_function_and_calls() -> None:
    proto = _model()
    m = fastopt.from_onnx(proto)
    report = fastopt.optimize(
        m, passes=["eliminate_unused_function_inputs", "eliminate_dead_nodes"]
    )
    # f's b, then g's q: once f no longer takes b, g passes q on to nobody.
    assert report.passes[0].rewrites == 2
    m.verify()
    out = m.to_onnx()
    onnx.checker.check_model(out, full_check=True)
    f = next(fn for fn in out.functions if fn.name == "f")
    assert list(f.input) == ["a", "c"]
    calls = [n for n in out.graph.node if n.op_type == "f"]
    assert [list(n.input) for n in calls] == [["X", "X"]]
    assert "Sigmoid" not in [n.op_type for n in out.graph.node]  # T fed only f's b
    for c in (True, False):
        for a, b in zip(_run(out, c), _run(proto, c)):
            np.testing.assert_array_equal(a, b)
    g = next(fn for fn in out.functions if fn.name == "g")
    assert list(g.input) == ["p"]
    assert [list(n.input) for n in out.graph.node if n.op_type == "g"] == [["X"]]
    second = fastopt.optimize(m, passes=["eliminate_unused_function_inputs"])
    assert second.passes[0].rewrites == 0  # idempotent
