"""Shape values broadcast like tensors: an empty integer value against a one-element one is
empty ((0) + (1) is (0), as ONNX Runtime computes it). Found by the differential tester
(tests/difftest, probe_empty_slice): the shape analysis read element 0 of the empty operand,
and infer_shapes died with SIGSEGV. Each model runs in a child process, so a crash fails the
test instead of ending pytest."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

_CHILD = """
import sys, fastopt, onnx
r = fastopt.optimize(fastopt.load(sys.argv[1]), preset="cleanup")
onnx.save(r.model.to_onnx(), sys.argv[2])
"""


def _model(op: str) -> onnx.ModelProto:
    """out = op(Slice(arange(5), 3, 1), Shape(ids)[0:1] * 0): (0) op (1)."""
    c = numpy_helper.from_array
    inits = [
        c(np.arange(5, dtype=np.int64), "data"),
        c(np.array([3], np.int64), "three"),
        c(np.array([1], np.int64), "one"),
        c(np.array([0], np.int64), "zero"),
    ]
    nodes = [
        helper.make_node("Slice", ["data", "three", "one"], ["empty"]),
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["batch"]),
        helper.make_node("Mul", ["batch", "zero"], ["nought"]),
        helper.make_node(op, ["empty", "nought"], ["out"]),
    ]
    out_type = TensorProto.BOOL if op == "Equal" else TensorProto.INT64
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("out", out_type, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op", ["Add", "Mul", "Sub", "Equal"])
def test_empty_value_broadcast_against_one_element(tmp_path, op: str) -> None:  # type: ignore[no-untyped-def]
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_model(op), src)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst)], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feed = {"ids": np.zeros((2, 3), np.int64)}
    expected = ort.InferenceSession(str(src), so).run(None, feed)[0]
    got = ort.InferenceSession(str(dst), so).run(None, feed)[0]
    assert expected.shape == got.shape == (0,)
