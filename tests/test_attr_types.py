"""An attribute of the wrong type (Softmax's axis given as a string) blocks every rewrite of its
node: ONNX Runtime refuses such a model, and fusing or folding the node would hand back one it
runs. The pattern matcher fails the match with a reason; fuse_attention and the folders skip the
node. The attribute types come from the op schemas (csrc/pattern/attr_schema_table.inc)."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from llm_fixtures import fixtures
from onnx import TensorProto, helper, numpy_helper
from test_fuse_norms import rms_model, run

F = TensorProto.FLOAT


def _retype(node: onnx.NodeProto, name: str, value: object) -> None:
    """Replaces `node`'s attribute `name` with one holding `value` (another type)."""
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend([*kept, helper.make_attribute(name, value)])


def _ort_refuses(model: onnx.ModelProto) -> None:
    with pytest.raises(Exception, match=r"attribute|type"):  # ORT's Fail / InvalidGraph
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_rms_norm_with_a_string_keepdims_is_not_fused() -> None:
    good = rms_model()
    _, fused = run(good, ["fuse_rms_norm"])
    assert [n.op_type for n in fused.graph.node] == ["SimplifiedLayerNormalization"]

    bad = rms_model()
    mean = next(n for n in bad.graph.node if n.op_type == "ReduceMean")
    _retype(mean, "keepdims", "1")
    _ort_refuses(bad)
    report, out = run(bad, ["fuse_rms_norm"], explain="*")
    assert "SimplifiedLayerNormalization" not in {n.op_type for n in out.graph.node}
    assert any(
        "wrong type" in line and "keepdims" in line and "ReduceMean" in line
        for line in report.explain
    ), report.explain
    _ort_refuses(out)  # still the model ORT refuses, not a repaired one


def test_attention_with_a_string_softmax_axis_is_not_fused() -> None:
    fx = fixtures(arch="llama", exporter="ts", dtype="float32")[0]
    model = onnx.load(str(fx.path))
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert softmaxes
    for n in softmaxes:
        _retype(n, "axis", "minus one")
    _ort_refuses(model)
    report = fastopt.optimize(fastopt.from_onnx(model), preset="llm", explain="fuse_attention")
    ops = report.ops_after
    assert ops.get("Softmax") == len(softmaxes), ops
    assert not any("Attention" in op for op in ops), ops
    assert any("attribute 'axis' of Softmax is a STRING" in line for line in report.explain)


def test_a_float_epsilon_given_as_int_blocks_conv_bn() -> None:
    c = 2
    x = helper.make_tensor_value_info("x", F, [1, c, 4, 4])
    y = helper.make_tensor_value_info("y", F, [1, c, 4, 4])
    inits = [
        numpy_helper.from_array(np.ones((c, c, 1, 1), np.float32), "w"),
        *[
            numpy_helper.from_array(np.full(c, v, np.float32), n)
            for n, v in (("s", 1.5), ("b", 0.1), ("m", 0.2), ("v", 0.9))
        ],
    ]
    bn = helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"])
    _retype(bn, "epsilon", 1)  # an INT where the schema says FLOAT
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), bn]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], initializer=inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    _ort_refuses(model)
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["fuse_conv_bn"])
    assert report.ops_after == {"Conv": 1, "BatchNormalization": 1}


def test_folding_skips_a_mistyped_node() -> None:
    """Transpose of a constant with perm given as a string: fold_constants must not fold it
    (the fold would read the default perm)."""
    t = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "t")
    node = helper.make_node("Transpose", ["t"], ["y"])
    _retype(node, "perm", "1,0")
    model = helper.make_model(
        helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", F, [3, 2])], [t]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["fold_constants"])
    assert report.ops_after == {"Transpose": 1}
    well_typed = fastopt.optimize(
        fastopt.from_onnx(
            helper.make_model(
                helper.make_graph(
                    [helper.make_node("Transpose", ["t"], ["y"], perm=[1, 0])],
                    "g",
                    [],
                    [helper.make_tensor_value_info("y", F, [3, 2])],
                    [t],
                ),
                opset_imports=[helper.make_opsetid("", 17)],
            )
        ),
        passes=["fold_constants"],
    )
    assert "Transpose" not in well_typed.ops_after  # the same node, well typed, folds
