"""eliminate_neutral_arithmetic: x*1, x+0, x-0, x/1 -> x, only when broadcasting keeps x."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
X = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)


def _model(op: str, const: np.ndarray, x_shape, const_first: bool = False) -> onnx.ModelProto:
    inputs = ["c", "X"] if const_first else ["X", "c"]
    nodes = [helper.make_node(op, inputs, ["y"]), helper.make_node("Relu", ["y"], ["Y"])]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", F, x_shape)],
        [helper.make_tensor_value_info("Y", F, x_shape)],
        [numpy_helper.from_array(const, "c")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray = X) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, {"X": x})[0]


def _optimize(proto: onnx.ModelProto) -> tuple[int, onnx.ModelProto]:
    m = fastopt.from_onnx(proto)
    report = fastopt.optimize(m, passes=["eliminate_neutral_arithmetic", "eliminate_dead_nodes"])
    m.verify()
    return report.passes[0].rewrites, m.to_onnx()


@pytest.mark.parametrize(
    ("op", "const", "const_first"),
    [
        ("Mul", np.array(1.0, np.float32), False),
        ("Mul", np.ones((4,), np.float32), True),
        ("Mul", np.ones((1, 3, 1), np.float32), False),
        ("Add", np.zeros((3, 4), np.float32), False),
        ("Add", np.array(0.0, np.float32), True),
        ("Sub", np.zeros((4,), np.float32), False),
        ("Div", np.ones((1,), np.float32), False),
    ],
)
def test_neutral_constant_is_removed(op: str, const: np.ndarray, const_first: bool) -> None:
    proto = _model(op, const, [2, 3, 4], const_first)
    rewrites, out = _optimize(proto)
    assert rewrites == 1
    assert [n.op_type for n in out.graph.node] == ["Relu"]
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_array_equal(_run(out), _run(proto))
    assert _optimize(out)[0] == 0  # idempotent


@pytest.mark.parametrize(
    ("op", "const", "x_shape", "const_first", "why"),
    [
        ("Mul", np.ones((4,), np.float32), [2, 3, 1], False, "broadcast widens the last dim"),
        ("Mul", np.ones((5, 2, 3, 4), np.float32), [2, 3, 4], False, "adds a leading dim"),
        ("Mul", np.ones((4,), np.float32), None, False, "x's rank is unknown"),
        ("Mul", np.full((4,), 2.0, np.float32), [2, 3, 4], False, "not neutral"),
        ("Mul", np.array([1.0, 1.0, 1.0, 0.5], np.float32), [2, 3, 4], False, "not all ones"),
        ("Sub", np.zeros((4,), np.float32), [2, 3, 4], True, "0 - x is -x"),
        ("Div", np.ones((4,), np.float32), [2, 3, 4], True, "1 / x is not x"),
    ],
)
def test_must_not_fire(op, const, x_shape, const_first, why) -> None:
    proto = _model(op, const, x_shape, const_first)
    del proto.graph.output[0].type.tensor_type.shape.dim[:]  # y's shape may differ from x's
    rewrites, out = _optimize(proto)
    assert rewrites == 0, why
    x = X[:, :, :1] if x_shape == [2, 3, 1] else X
    np.testing.assert_array_equal(_run(out, x), _run(proto, x))


def test_graph_output_keeps_its_name() -> None:
    g = helper.make_graph(
        [helper.make_node("Relu", ["X"], ["r"]), helper.make_node("Mul", ["r", "c"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", F, [2, 3, 4])],
        [helper.make_tensor_value_info("Y", F, [2, 3, 4])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "c")],
    )
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rewrites, out = _optimize(proto)
    assert rewrites == 1 and [o.name for o in out.graph.output] == ["Y"]
    np.testing.assert_array_equal(_run(out), _run(proto))
