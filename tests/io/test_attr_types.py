"""An attribute of the wrong type (Softmax's axis given as a string) blocks every rewrite of its
node: ONNX Runtime refuses such a model, and fusing or folding the node would hand back one it
runs. The pattern matcher fails the match with a reason; fuse_attention and the folders skip the
node. The attribute types come from the op schemas (csrc/schema/attr_schema_table.inc)."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.attr_sweep import sweep
from support.llm_fixtures import fixtures
from support.norm_models import rms_model, run
from support.paths import ROOT

F = TensorProto.FLOAT
CORPUS = ROOT.parent / "shared" / "corpus"


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


# ---- plain-walk passes: a test per family --------------------------------------------------


def _gemm_model(alpha: object) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    c = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "c")
    gemm = helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm")
    _retype(gemm, "alpha", alpha)
    return helper.make_model(
        helper.make_graph(
            [gemm],
            "g",
            [helper.make_tensor_value_info("x", F, [4, 16])],
            [helper.make_tensor_value_info("y", F, [4, 16])],
            [w, c],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )


def test_int8_dynamic_keeps_a_gemm_whose_alpha_is_an_int() -> None:
    """quantize_dynamic read Gemm's alpha with a float accessor: an INT alpha read as 1.0 and
    the Gemm became DynamicQuantizeMatMul, a model ORT runs."""
    good = fastopt.from_onnx(_gemm_model(1.0))
    fastopt.quantize(good, mode="int8-dynamic")
    assert "Gemm" not in good.op_counts(), good.op_counts()  # the well-typed one quantizes

    bad_proto = _gemm_model(1)  # an INT where the schema says FLOAT
    _ort_refuses(bad_proto)
    bad = fastopt.from_onnx(bad_proto)
    report = fastopt.quantize(bad, mode="int8-dynamic")
    assert bad.op_counts() == {"Gemm": 1}, bad.op_counts()
    kept = [w for w in report.weights if w.action == "kept" and w.node == "gemm"]
    assert kept and "alpha" in kept[0].reason and "FLOAT" in kept[0].reason, report.weights
    _ort_refuses(bad.to_onnx())


def test_fp16_refuses_a_constant_whose_value_float_is_an_int() -> None:
    """convert_precision rewrote Constant(value_float) into a value tensor: an INT value_float
    became an empty float16 tensor, a model ORT loads."""
    const = helper.make_node("Constant", [], ["k"])
    _retype(const, "value_float", 3)
    model = helper.make_model(
        helper.make_graph(
            [const, helper.make_node("Add", ["x", "k"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", F, [2])],
            [helper.make_tensor_value_info("y", F, [2])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    _ort_refuses(model)
    with pytest.raises(fastopt.ModelError, match=r"value_float.*INT"):
        fastopt.quantize(fastopt.from_onnx(model), mode="fp16")


def test_cse_does_not_merge_mistyped_nodes() -> None:
    """Two identical Transposes with perm as a string: left alone (CSE reads no attribute of a
    node ORT refuses)."""
    nodes = []
    for name in ("a", "b"):
        t = helper.make_node("Transpose", ["x"], [name])
        _retype(t, "perm", "1,0")
        nodes.append(t)
    nodes.append(helper.make_node("Add", ["a", "b"], ["y"]))
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", F, [3, 3])],
            [helper.make_tensor_value_info("y", F, [3, 3])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["eliminate_common_subexpressions"])
    assert report.ops_after == {"Transpose": 2, "Add": 1}


# ---- the sweep: every (op, attribute) of real exports retyped, one at a time -----------------

# Each found a hole before the plain-walk checks (fastopt then made ORT accept the model):
# Reshape.allowzero (attention head splits), GatherND.batch_dims (the KV cache's mask proof),
# Gather.axis (TorchScript head sizes), Shape.start (clip's encoder attention).
SWEEP_FIXTURES = ["llama_dynamo_float32", "llama_ts_float32", "clip_dynamo_float32"]
SWEEP_CONFIGS = [{"preset": "default"}, {"preset": "default", "kv_cache": "inplace"}]


@pytest.mark.parametrize("name", SWEEP_FIXTURES)
def test_no_mistyped_attribute_is_optimized_into_a_model_ort_runs(name: str) -> None:
    fx = next(f for f in fixtures() if f.name == name)
    for config in SWEEP_CONFIGS:
        refused, accepted = sweep(fx.path, **config)
        assert refused >= 5, (config, refused)  # the sweep has something to check
        assert not accepted, (config, accepted)


@pytest.mark.slow
def test_the_sweep_over_every_export() -> None:
    paths = [f.path for f in fixtures() if f.dtype == "float32"]
    paths += sorted(CORPUS.glob("*/model.onnx")) if CORPUS.is_dir() else []
    for path in paths:
        for config in SWEEP_CONFIGS:
            _, accepted = sweep(path, **config)
            assert not accepted, (path, config, accepted)
