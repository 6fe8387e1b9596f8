"""infer_shapes: onnx shape inference on the skeleton, types applied to the model in place."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt import _C
from onnx import TensorProto, helper, numpy_helper
from support.folding_helpers import assert_parity, make_model, optimize, out

F, INT = TensorProto.FLOAT, TensorProto.INT64


def mlp() -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("MatMul", ["X", "W"], ["a"]),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("Shape", ["r"], ["s"]),
            helper.make_node("Reshape", ["r", "flat"], ["f"]),
            helper.make_node("Cast", ["f"], ["Y"], to=TensorProto.DOUBLE),
        ],
        [out("X", F, ["batch", 8])],
        [out("Y", TensorProto.DOUBLE, ["batch", None])],
        {"W": np.ones((8, 4), np.float32), "flat": np.array([0, -1], np.int64)},
    )


def test_types_are_applied_and_saved(tmp_path: Path) -> None:
    model = mlp()
    m = fastopt.from_onnx(model)
    assert m.graph.value("a").shape is None
    fastopt.infer_shapes(m)
    assert (m.graph.value("a").dtype, m.graph.value("a").shape) == (F, ("batch", 4))
    assert m.graph.value("s").shape == (2,)
    assert m.graph.value("f").shape == ("batch", 4)  # data propagation through Reshape
    assert m.graph.value("X").shape == ("batch", 8)  # inputs keep their declared types
    path = tmp_path / "typed.onnx"
    m.save(path)
    saved = onnx.load(str(path))
    assert [vi.name for vi in saved.graph.value_info] == ["a", "r", "s", "f"]
    assert saved.graph.output[0].type.tensor_type.shape.dim[1].dim_value == 4  # refined
    onnx.checker.check_model(saved, full_check=True)
    assert_parity(model, path, tmp_path)


def test_data_propagation() -> None:
    model = make_model(
        [helper.make_node("Shape", ["Z"], ["s"]), helper.make_node("Reshape", ["X", "s"], ["Y"])],
        [out("X", F, [2, 6]), out("Z", F, [3, 4])],
        [out("Y", F, [None, None])],
    )
    m = fastopt.from_onnx(model)
    fastopt.infer_shapes(m, data_prop=False)
    assert m.graph.value("Y").shape == (None, None)
    fastopt.infer_shapes(m)
    assert m.graph.value("Y").shape == (3, 4)


def test_more_specific_types_refine_existing_ones() -> None:
    model = mlp()
    model.graph.value_info.extend(
        [
            helper.make_tensor_value_info("a", F, ["batch", "n"]),  # symbolic -> 4
            helper.make_tensor_value_info("r", F, None),  # no shape -> shape
            helper.make_tensor_value_info("s", TensorProto.INT32, [2]),  # conflicting: kept
        ]
    )
    m = fastopt.from_onnx(model)
    fastopt.infer_shapes(m)
    assert m.graph.value("a").shape == ("batch", 4)
    assert m.graph.value("r").shape == ("batch", 4)
    assert m.graph.value("s").dtype == TensorProto.INT32
    assert len(m.to_onnx().graph.value_info) == 4  # a, r, s as they were listed; f added


def test_subgraph_values_get_types() -> None:
    branch = helper.make_graph(
        [helper.make_node("Add", ["X", "X"], ["t"]), helper.make_node("Neg", ["t"], ["o"])],
        "then",
        [],
        [out("o", F, [3])],
    )
    model = make_model(
        [helper.make_node("If", ["c"], ["Y"], then_branch=branch, else_branch=branch)],
        [out("c", TensorProto.BOOL, []), out("X", F, [3])],
        [out("Y", F, [3])],
    )
    m = fastopt.from_onnx(model)
    fastopt.infer_shapes(m)
    (then, other) = m.graph.nodes[0].subgraphs
    assert then.value("t").shape == (3,) and other.value("t").shape == (3,)
    assert m.to_onnx().graph.node[0].attribute[0].g.value_info[0].name == "t"


def test_strict_raises_lenient_does_not() -> None:
    model = make_model(
        [helper.make_node("Add", ["X", "Z"], ["Y"])],
        [out("X", F, [2, 3]), out("Z", F, [4, 5])],
        [out("Y", F, None)],
    )
    m = fastopt.from_onnx(model)
    with pytest.raises(fastopt.RejectedModelError, match="shape inference") as caught:
        fastopt.infer_shapes(m, strict=True)
    assert isinstance(caught.value.__cause__, onnx.shape_inference.InferenceError)
    fastopt.infer_shapes(m)  # the node's output just stays untyped


def test_pass_counts_and_is_idempotent(tmp_path: Path) -> None:
    report, path = optimize(mlp(), ["infer_shapes"], tmp_path)
    # An analysis: no rewrites, the types it refined are counted.
    assert report.passes[0].rewrites == 0
    want = {"types_refined": 5, "engine:native": 1, "native_nodes": 5}
    assert report.passes[0].counters == want
    assert report.shape_inference == ["infer_shapes: native for 5 nodes"]
    again = fastopt.optimize(fastopt.load(path), passes=["infer_shapes"])
    assert again.passes[0].counters == {"engine:native": 1, "native_nodes": 5}
    assert "analysis" in fastopt.get_pass("infer_shapes").tags


def test_passes_needing_shapes_reuse_fresh_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = _C.analyze_shapes

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_C, "analyze_shapes", spy)
    model = mlp()
    model.graph.node.insert(0, helper.make_node("Constant", [], ["k"], value_float=1.0))
    model.graph.node.append(helper.make_node("Mul", ["r", "k"], ["r2"]))
    m = fastopt.from_onnx(model)
    fastopt.optimize(m, passes=["infer_shapes", "fold_shapes"])
    assert len(calls) == 1  # fold_shapes found the types fresh
    fastopt.optimize(m, passes=["fold_shapes", "fold_constants", "fold_shapes"])
    assert len(calls) == 3  # a new run starts stale; fold_constants' rewrite made them stale


def test_external_data_model(tmp_path: Path) -> None:
    model = mlp()
    model.graph.initializer[0].CopyFrom(
        numpy_helper.from_array(np.ones((8, 4096), np.float32), "W")
    )
    model.graph.node[3].input[1] = "flat"
    src = tmp_path / "src.onnx"
    onnx.save(model, str(src))
    path = tmp_path / "ext.onnx"
    fastopt.load(src).save(path, external_data=True)
    m = fastopt.load(path)
    fastopt.infer_shapes(m)
    assert m.graph.value("a").shape == ("batch", 4096)
    assert m.graph.initializer("W").is_external
