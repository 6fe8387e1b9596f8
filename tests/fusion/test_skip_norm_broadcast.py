"""fuse_skip_norm refuses an Add that broadcasts a dim of 1 (x + mean over the sequence,
(B, S, D) + (B, 1, D)): ONNX's Add stretches it, the Skip kernels do not and fail at run time
("last two dimensions of skip need to be same as input"). Found by the differential tester
(tests/difftest, sequence_mean on qwen2 / mpt / qwen2_moe exports, the llm preset)."""

from __future__ import annotations

import fastopt
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper


def _model(simplified_first: bool, axes: int) -> bytes:
    """y = LayerNormalization(x + ReduceMean(x, axes, keepdims=1)), x (B, S, 8)."""
    c = numpy_helper.from_array
    inits = [
        c(np.array([axes], np.int64), "axes"),
        c(np.linspace(0.5, 1.5, 8).astype(np.float32), "gamma"),
        c(np.linspace(-0.1, 0.1, 8).astype(np.float32), "beta"),
    ]
    mean = helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=1)
    add = helper.make_node("Add", ["m", "x"] if simplified_first else ["x", "m"], ["s"])
    norm = helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1)
    graph = helper.make_graph(
        [mean, add, norm],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _run(data: bytes, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    out: np.ndarray = ort.InferenceSession(data, so).run(None, {"x": x})[0]
    return out


@pytest.mark.parametrize("skip_first", [False, True])
def test_add_broadcasting_a_dim_of_one_is_not_a_skip(skip_first: bool) -> None:
    data = _model(skip_first, axes=1)
    report = fastopt.optimize(fastopt.load_bytes(data), preset="llm", target="ort")
    assert report.model is not None
    ops = report.model.op_counts()
    assert not any("Skip" in op for op in ops), ops
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(report.model.serialize(), x), _run(data, x), atol=1e-5)


def test_same_shape_add_still_fuses() -> None:
    """The must-fire twin: an Add of two (B, S, 8) inputs still becomes a Skip norm."""
    c = numpy_helper.from_array
    inits = [c(np.ones(8, np.float32) * 0.7, "gamma"), c(np.zeros(8, np.float32) + 0.1, "beta")]
    nodes = [
        helper.make_node("Add", ["x", "z"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", 8]) for n in "xz"]
    graph = helper.make_graph(
        nodes, "g", vi, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    report = fastopt.optimize(fastopt.load_bytes(data.SerializeToString()), preset="llm")
    assert report.model is not None
    assert "com.microsoft::SkipLayerNormalization" in report.model.op_counts()
