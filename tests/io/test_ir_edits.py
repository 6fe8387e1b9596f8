"""Graph edits through the IR: every edit keeps the invariants (checked by Model.verify), and the
edited model saves and runs in ONNX Runtime with the expected result."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper


def _run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _chain_model() -> onnx.ModelProto:
    """Y = Relu(Neg(X) + X); Z = Exp(Y)"""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])
    z = helper.make_tensor_value_info("Z", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("Neg", ["X"], ["n"], name="neg"),
        helper.make_node("Add", ["n", "X"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["Y"], name="relu"),
        helper.make_node("Exp", ["Y"], ["Z"], name="exp"),
    ]
    g = helper.make_graph(nodes, "chain", [x], [y, z])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


X = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)


def test_insert_node_and_rewire(tmp_path: Path) -> None:
    m = fastopt.from_onnx(_chain_model())
    g = m.graph
    relu = next(n for n in g.nodes if n.op_type == "Relu")
    s = relu.inputs[0]
    # Insert Abs between Add and Relu: s -> Abs -> relu
    abs_node = g.add_node("Abs", [s], ["s_abs"], name="abs", before=relu)
    relu.set_input(0, abs_node.outputs[0])
    m.verify()
    assert [n.op_type for n in g.nodes] == ["Neg", "Add", "Abs", "Relu", "Exp"]
    assert [(u.name, i) for u, i in s.uses] == [("abs", 0)]
    out = tmp_path / "m.onnx"
    m.save(out)
    y, z = _run(out, {"X": X})
    np.testing.assert_array_equal(y, np.abs(-X + X))
    np.testing.assert_allclose(z, np.exp(y))


def test_output_names_are_made_unique() -> None:
    m = fastopt.from_onnx(_chain_model())
    g = m.graph
    node = g.add_node("Identity", [g.value("X")], ["s"])  # "s" is taken
    assert node.outputs[0].name != "s"
    assert g.value(node.outputs[0].name) == node.outputs[0]
    g.remove_node(node)
    m.verify()


def test_remove_node_refuses_used_outputs() -> None:
    m = fastopt.from_onnx(_chain_model())
    neg = m.graph.nodes[0]
    with pytest.raises(fastopt.ModelError, match="still used"):
        m.graph.remove_node(neg)
    m.verify()


def test_replace_all_uses_then_remove(tmp_path: Path) -> None:
    """Bypass Relu: its consumers, including the graph output Y, read s instead."""
    m = fastopt.from_onnx(_chain_model())
    g = m.graph
    relu = next(n for n in g.nodes if n.op_type == "Relu")
    relu_out = relu.outputs[0]
    relu_out.replace_all_uses_with(relu.inputs[0])
    assert relu_out.uses == []
    assert not relu_out.is_graph_output
    g.remove_node(relu)
    assert not relu.alive
    with pytest.raises(fastopt.ModelError, match="removed"):
        _ = relu.inputs
    m.verify()
    out = tmp_path / "m.onnx"
    m.save(out)
    saved = onnx.load(str(out))
    assert [n.op_type for n in saved.graph.node] == ["Neg", "Add", "Exp"]
    assert [o.name for o in saved.graph.output] == ["s", "Z"]
    y, z = _run(out, {"X": X})
    np.testing.assert_array_equal(y, -X + X)
    np.testing.assert_allclose(z, np.exp(-X + X))


def test_rename_keeps_names_unique(tmp_path: Path) -> None:
    m = fastopt.from_onnx(_chain_model())
    g = m.graph
    n = g.value("n")
    with pytest.raises(fastopt.ModelError, match="taken"):
        n.rename("s")
    n.rename("negated")
    assert g.value("negated") == n and g.value("n") is None
    m.verify()
    out = tmp_path / "m.onnx"
    m.save(out)
    saved = onnx.load(str(out))
    assert saved.graph.node[0].output[0] == "negated"
    assert saved.graph.node[1].input[0] == "negated"
    _run(out, {"X": X})


def test_topological_sort_restores_order(tmp_path: Path) -> None:
    proto = _chain_model()
    shuffled = list(proto.graph.node)[::-1]
    del proto.graph.node[:]
    proto.graph.node.extend(shuffled)
    m = fastopt.from_onnx(proto)  # out of order but acyclic: accepted as written
    assert [n.op_type for n in m.graph.nodes] == ["Exp", "Relu", "Add", "Neg"]
    m.graph.topological_sort()
    assert [n.op_type for n in m.graph.nodes] == ["Neg", "Add", "Relu", "Exp"]
    m.verify()
    out = tmp_path / "m.onnx"
    m.save(out)
    onnx.checker.check_model(str(out))
    _run(out, {"X": X})


def test_edit_that_makes_a_cycle_is_caught() -> None:
    m = fastopt.from_onnx(_chain_model())
    g = m.graph
    neg = g.nodes[0]
    neg.set_input(0, g.value("Y"))  # Neg now reads the output of Relu, which depends on Neg
    with pytest.raises(fastopt.ModelError, match="cycle"):
        m.verify()
    with pytest.raises(fastopt.ModelError, match="cycle"):
        g.topological_sort()


def _if_model() -> onnx.ModelProto:
    """The If branches read the outer value `h` directly."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])
    c = helper.make_tensor_value_info("C", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])
    then_g = helper.make_graph(
        [helper.make_node("Neg", ["h"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Abs", ["h"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])],
    )
    nodes = [
        helper.make_node("Relu", ["X"], ["h"], name="relu"),
        helper.make_node("If", ["C"], ["Y"], then_branch=then_g, else_branch=else_g),
    ]
    g = helper.make_graph(nodes, "main", [x, c], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_replace_all_uses_reaches_into_subgraphs(tmp_path: Path) -> None:
    m = fastopt.from_onnx(_if_model())
    g = m.graph
    h = g.value("h")
    inner = {u.op_type for u, _ in h.uses}
    assert inner == {"Neg", "Abs"}
    then_g, else_g = g.nodes[1].subgraphs
    assert then_g.outer_references == [h] and else_g.outer_references == [h]
    h.replace_all_uses_with(g.value("X"))
    g.remove_node(g.nodes[0])
    m.verify()
    out = tmp_path / "m.onnx"
    m.save(out)
    xv = np.array([-1.5, 2.0], np.float32)
    (y,) = _run(out, {"X": xv, "C": np.array(True)})
    np.testing.assert_array_equal(y, -xv)
    (y,) = _run(out, {"X": xv, "C": np.array(False)})
    np.testing.assert_array_equal(y, np.abs(xv))


def test_cycle_through_subgraph_outer_reference_is_caught() -> None:
    """A node that feeds a value used inside the If body, while itself reading the If's
    output, is a cycle even though no direct edge closes it."""
    proto = _if_model()
    proto.graph.node[0].input[0] = "Y"  # Relu(Y) -> h -> If body -> Y
    with pytest.raises(fastopt.ModelError, match="cycle"):
        fastopt.from_onnx(proto)


def test_removed_values_drop_their_value_info(tmp_path: Path) -> None:
    proto = _chain_model()
    proto.graph.value_info.extend(
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("n", "s")]
    )
    m = fastopt.from_onnx(proto)
    g = m.graph
    relu = next(n for n in g.nodes if n.op_type == "Relu")
    add = next(n for n in g.nodes if n.op_type == "Add")
    neg = next(n for n in g.nodes if n.op_type == "Neg")
    relu.set_input(0, g.value("X"))
    g.remove_node(add)
    g.remove_node(neg)
    m.verify()
    out = tmp_path / "m.onnx"
    m.save(out)
    saved = onnx.load(str(out))
    assert [vi.name for vi in saved.graph.value_info] == []
    onnx.checker.check_model(saved, full_check=True)


def test_rewired_subgraph_use_becomes_an_outer_reference(tmp_path: Path) -> None:
    # The If's branch reads `a`; it is rewired to `b`, made after the If. The branch must list
    # `b` as an outer reference, or topological_sort leaves the If before b's producer.
    def branch(name: str, op: str) -> onnx.GraphProto:
        out = helper.make_tensor_value_info(f"{name}_o", TensorProto.FLOAT, [2, 3])
        return helper.make_graph([helper.make_node(op, ["a"], [f"{name}_o"])], name, [], [out])

    nodes = [
        helper.make_node("Relu", ["X"], ["a"]),
        helper.make_node(
            "If", ["c"], ["Y"], then_branch=branch("t", "Neg"), else_branch=branch("e", "Abs")
        ),
        helper.make_node("Sigmoid", ["X"], ["s"]),
        helper.make_node("Exp", ["s"], ["b"]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
    )
    m = fastopt.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    m.graph.value("a").replace_all_uses_with(m.graph.value("b"))
    then = m.graph.nodes[1].subgraphs[0]
    assert "b" in [v.name for v in then.outer_references]
    m.graph.topological_sort()
    assert [n.op_type for n in m.graph.nodes][-1] == "If"
    m.verify()
    out = tmp_path / "m.onnx"
    m.save(out)
    onnx.checker.check_model(str(out))
    (y,) = _run(out, {"X": X, "c": np.array(True)})
    np.testing.assert_allclose(y, -np.exp(1 / (1 + np.exp(-X))), rtol=1e-6)
