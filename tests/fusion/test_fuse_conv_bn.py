"""fuse_conv_bn: Conv (+ bias) + inference BatchNormalization folded into the Conv."""

from __future__ import annotations

from collections import Counter

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from support.fusion_util import (
    TORCH_EXPORTERS,
    check_fusion,
    info,
    light_feeds,
    light_models,
    make_model,
    materialize_light,
    ops,
    ort_run,
    out_info,
    random,
    rewrites,
    run_passes,
    tensor,
    torch_cnn,
    torch_export,
)

F = TensorProto.FLOAT
PASS = ["fuse_conv_bn"]


def bn_params(c: int, dtype=np.float32, seed: int = 1) -> list[onnx.TensorProto]:
    rng = np.random.default_rng(seed)
    return [
        tensor("scale", rng.uniform(0.5, 2.0, c).astype(dtype)),
        tensor("shift", rng.standard_normal(c).astype(dtype)),
        tensor("mean", rng.standard_normal(c).astype(dtype)),
        tensor("var", rng.uniform(0.1, 2.0, c).astype(dtype)),
    ]


def conv_bn(
    cin: int = 4,
    cout: int = 6,
    group: int = 1,
    spatial: tuple[int, ...] = (8, 8),
    bias: bool = True,
    dtype=np.float32,
    opset: int = 17,
    bn_attrs: dict | None = None,
    conv_attrs: dict | None = None,
) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    k = (3,) * len(spatial)
    inits = [tensor("W", random((cout, cin // group, *k), dtype, seed=2)), *bn_params(cout, dtype)]
    conv_inputs = ["x", "W"]
    if bias:
        inits.append(tensor("b", random((cout,), dtype, seed=3)))
        conv_inputs.append("b")
    attrs = {"pads": [1] * (2 * len(spatial)), "group": group, **(conv_attrs or {})}
    nodes = [
        helper.make_node("Conv", conv_inputs, ["c"], "conv", **attrs),
        helper.make_node(
            "BatchNormalization",
            ["c", "scale", "shift", "mean", "var"],
            ["y"],
            "bn",
            **{"epsilon": 1e-3, **(bn_attrs or {})},
        ),
    ]
    return make_model(
        nodes,
        [info("x", elem, [2, cin, *spatial])],
        [out_info("y", elem, 2 + len(spatial))],
        inits,
        opset,
    )


def feeds_for(model: onnx.ModelProto, dtype=np.float32) -> dict[str, np.ndarray]:
    vi = model.graph.input[0]
    shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    return {vi.name: random(shape, dtype, seed=7)}


# ---- fires ----


@pytest.mark.parametrize("bias", [True, False])
def test_conv_bn_folds(bias):
    model = conv_bn(bias=bias)
    out = check_fusion(model, PASS, feeds_for(model), 1)
    assert ops(out) == ["Conv"]
    conv = out.graph.node[0]
    assert conv.output == ["y"]  # the graph output keeps its name
    assert sorted(a.name for a in conv.attribute) == ["group", "pads"]
    assert len(conv.input) == 3


def test_original_weights_untouched():
    model = conv_bn()
    report, out = run_passes(model, PASS)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    # Only the fusion ran: the old tensors are still there (unused), bit for bit.
    for name in ("W", "b"):
        np.testing.assert_array_equal(inits[name], before[name])
    new_w = out.graph.node[0].input[1]
    assert new_w != "W" and not np.array_equal(inits[new_w], before["W"])
    assert report.passes[0].counters == {"fuse_conv_bn": 1}
    # DCE drops the unused originals.
    _, cleaned = run_passes(out, ["eliminate_dead_nodes"])
    assert {t.name for t in cleaned.graph.initializer} == set(out.graph.node[0].input[1:])


def test_folded_values():
    model = conv_bn(cout=3)
    _, out = run_passes(model, PASS)
    t = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    s = t["scale"] / np.sqrt(t["var"] + 1e-3)
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    w, b = (inits[n] for n in out.graph.node[0].input[1:])
    assert w.dtype == np.float32 and b.dtype == np.float32
    np.testing.assert_allclose(w, t["W"] * s[:, None, None, None], rtol=1e-6)
    np.testing.assert_allclose(b, (t["b"] - t["mean"]) * s + t["shift"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("cin", "cout", "group"), [(4, 6, 2), (6, 6, 6), (4, 8, 4)], ids=["group2", "dw", "dw_x2"]
)
def test_group_conv(cin, cout, group):
    model = conv_bn(cin=cin, cout=cout, group=group)
    check_fusion(model, PASS, feeds_for(model), 1)


@pytest.mark.parametrize("spatial", [(9,), (4, 5, 6)], ids=["conv1d", "conv3d"])
def test_conv_1d_3d(spatial):
    model = conv_bn(spatial=spatial)
    check_fusion(model, PASS, feeds_for(model), 1)


def test_strided_dilated_conv():
    model = conv_bn(conv_attrs={"strides": [2, 1], "dilations": [1, 2], "pads": [1, 2, 1, 2]})
    check_fusion(model, PASS, feeds_for(model), 1)


@pytest.mark.parametrize(
    ("opset", "bn_attrs"),
    [(7, {"spatial": 1}), (9, {}), (14, {"training_mode": 0}), (15, {}), (21, {})],
    ids=["opset7", "opset9", "opset14_training0", "opset15", "opset21"],
)
def test_opsets(opset, bn_attrs):
    model = conv_bn(opset=opset, bn_attrs=bn_attrs)
    check_fusion(model, PASS, feeds_for(model), 1)


def test_opset6_is_test():
    model = conv_bn(opset=6, bn_attrs={"is_test": 1})
    _, out = run_passes(model, PASS)
    assert ops(out) == ["Conv"]


def test_float16():
    model = conv_bn(dtype=np.float16)
    out = check_fusion(model, PASS, feeds_for(model, np.float16), 1, tol=1e-2)
    assert {t.data_type for t in out.graph.initializer} == {TensorProto.FLOAT16}


def test_float64_reference_evaluator():
    # ORT has no double Conv on CPU: compare with onnx's reference evaluator.
    model = conv_bn(dtype=np.float64)
    _, out = run_passes(model, PASS)
    assert ops(out) == ["Conv"]
    feeds = feeds_for(model, np.float64)
    expected = ReferenceEvaluator(model).run(None, feeds)[0]
    actual = ReferenceEvaluator(out).run(None, feeds)[0]
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-10)


def test_bn_params_mixed_dtype():
    # Opset 15: scale/B (T1) and mean/var (T2) may differ from X; the new tensors take W's type.
    model = conv_bn(opset=15, dtype=np.float16)
    for t in model.graph.initializer:
        if t.name in ("mean", "var"):
            t.CopyFrom(tensor(t.name, numpy_helper.to_array(t).astype(np.float32)))
    check_fusion(model, PASS, feeds_for(model, np.float16), 1, tol=1e-2)


def test_params_from_constant_nodes():
    model = conv_bn()
    g = model.graph
    consts = []
    for t in list(g.initializer):
        if t.name in ("scale", "shift", "mean", "var"):
            consts.append(helper.make_node("Constant", [], [t.name], value=t))
            g.initializer.remove(t)
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(consts + nodes)
    out = check_fusion(model, PASS, feeds_for(model), 1)
    assert ops(out).count("BatchNormalization") == 0


def test_shared_weight_two_convs():
    # Two Convs share W, each followed by its own BN: each gets its own folded copy.
    c = 4
    inits = [tensor("W", random((c, c, 3, 3), seed=2)), *bn_params(c, seed=1)]
    inits += [
        tensor(f"{n}2", numpy_helper.to_array(t)[::-1].copy())
        for n, t in zip(("scale", "shift", "mean", "var"), bn_params(c, seed=5))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "scale", "shift", "mean", "var"], ["y1"]),
        helper.make_node("Conv", ["y1", "W"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c2", "scale2", "shift2", "mean2", "var2"], ["y"]),
    ]
    model = make_model(nodes, [info("x", F, [1, c, 6, 6])], [out_info("y", F, 4)], inits)
    out = check_fusion(model, PASS, feeds_for(model), 2)
    assert ops(out) == ["Conv", "Conv"]
    assert out.graph.node[0].input[1] != out.graph.node[1].input[1]


def test_bn_output_feeds_two_consumers():
    # Only the Conv's output must be single-use; the BN's output may fan out.
    model = conv_bn()
    g = model.graph
    g.node.append(helper.make_node("Relu", ["y"], ["r"]))
    g.output.append(out_info("r", F, 4))
    out = check_fusion(model, PASS, feeds_for(model), 1)
    assert ops(out) == ["Conv", "Relu"]


def test_inside_if_branch():
    c = 3
    branch_nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["yb"]),
    ]
    then_g = helper.make_graph(branch_nodes, "then", [], [out_info("yb", F, 4)])
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["ye"])], "else", [], [out_info("ye", F, 4)]
    )
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)]
    inits = [tensor("W", random((c, c, 3, 3), seed=2)), *bn_params(c)]
    inputs = [info("cond", TensorProto.BOOL, []), info("x", F, [1, c, 5, 5])]
    model = make_model(nodes, inputs, [out_info("y", F, 4)], inits)
    feeds = {"cond": np.array(True), "x": random((1, c, 5, 5), seed=3)}
    out = check_fusion(model, PASS, feeds, 1)
    then_g = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    then_ops = [n.op_type for n in then_g.node]
    assert then_ops == ["Conv"]


def function_model(out_name: str) -> onnx.ModelProto:
    c = 3
    params = [tensor("W", random((c, c, 3, 3), seed=2)), *bn_params(c)]
    body = [helper.make_node("Constant", [], [t.name], value=t) for t in params] + [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], [out_name]),
    ]
    fn = helper.make_function(
        "local", "ConvBN", ["x"], [out_name], body, [helper.make_opsetid("", 17)]
    )
    return make_model(
        [helper.make_node("ConvBN", ["x"], ["y"], domain="local")],
        [info("x", F, [1, c, 5, 5])],
        [out_info("y", F, 4)],
        extra_opsets=[helper.make_opsetid("local", 1)],
        functions=[fn],
    )


def test_inside_function_uses_constants():
    # Function bodies have no initializers: the folded tensors become Constant nodes there.
    model = function_model("fy")
    report, out = run_passes(model, ["fuse_conv_bn", "eliminate_dead_nodes"])
    assert rewrites(report, "fuse_conv_bn") == 1
    assert Counter(n.op_type for n in out.functions[0].node) == {"Constant": 2, "Conv": 1}
    feeds = feeds_for(model)
    np.testing.assert_allclose(
        ort_run(out, feeds)[0], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-4
    )


# ---- must not fire ----


def assert_unchanged(model: onnx.ModelProto, passes=PASS) -> None:
    report, out = run_passes(model, passes)
    assert report.rewrites == 0, report.passes
    assert ops(out) == ops(model)


def test_inside_function_output_name_used_elsewhere():
    # Functions have their own namespace: the function output 'y' keeps its name even though
    # the main graph also has a value 'y'.
    report, _ = run_passes(function_model("y"), ["fuse_conv_bn"])
    assert rewrites(report, "fuse_conv_bn") == 1


def test_conv_in_enclosing_graph_not_folded():
    # The BN sits in an If branch and reads a Conv of the main graph: not folded across graphs.
    c = 3
    then_g = helper.make_graph(
        [helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["yb"])],
        "then",
        [],
        [out_info("yb", F, 4)],
    )
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["ye"])], "else", [], [out_info("ye", F, 4)]
    )
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    inits = [tensor("W", random((c, c, 3, 3), seed=2)), *bn_params(c)]
    inputs = [info("cond", TensorProto.BOOL, []), info("x", F, [1, c, 5, 5])]
    assert_unchanged(make_model(nodes, inputs, [out_info("y", F, 4)], inits))


def test_training_mode_not_folded():
    assert_unchanged(conv_bn(opset=15, bn_attrs={"training_mode": 1}))


def test_opset6_training_not_folded():
    assert_unchanged(conv_bn(opset=6, bn_attrs={"is_test": 0}))
    assert_unchanged(conv_bn(opset=6))  # is_test defaults to 0


def test_spatial0_not_folded():
    assert_unchanged(conv_bn(opset=7, bn_attrs={"spatial": 0}))


def test_mean_not_constant():
    model = conv_bn()
    g = model.graph
    mean = next(t for t in g.initializer if t.name == "mean")
    g.initializer.remove(mean)
    g.input.append(info("mean", F, [6]))
    assert_unchanged(model)


def test_initializer_that_is_also_an_input_not_folded():
    # An initializer listed as a graph input can be overridden at run time: not a constant.
    model = conv_bn()
    model.graph.input.append(info("var", F, [6]))
    assert_unchanged(model)


def test_weight_not_constant():
    model = conv_bn()
    g = model.graph
    w = next(t for t in g.initializer if t.name == "W")
    g.initializer.remove(w)
    g.input.append(info("W", F, list(w.dims)))
    assert_unchanged(model)


def test_conv_bias_not_constant():
    model = conv_bn()
    g = model.graph
    g.initializer.remove(next(t for t in g.initializer if t.name == "b"))
    g.input.append(info("b", F, [6]))
    assert_unchanged(model)


def test_conv_output_has_another_consumer():
    model = conv_bn()
    model.graph.node.append(helper.make_node("Relu", ["c"], ["r"]))
    model.graph.output.append(out_info("r", F, 4))
    assert_unchanged(model)


def test_conv_output_is_graph_output():
    model = conv_bn()
    model.graph.output.append(out_info("c", F, 4))
    assert_unchanged(model)


def test_statistics_outputs_used():
    # Opset 9: extra outputs mean training; one that is used blocks the fold.
    model = conv_bn(opset=9)
    bn = model.graph.node[1]
    bn.output.extend(["running_mean", "running_var", "saved_mean", "saved_var"])
    model.graph.output.append(out_info("running_mean", F, 1))
    assert_unchanged(model)


def test_bn_after_non_conv_stays():
    c = 4
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("BatchNormalization", ["r", "scale", "shift", "mean", "var"], ["y"]),
    ]
    model = make_model(nodes, [info("x", F, [1, c, 3, 3])], [out_info("y", F, 4)], bn_params(c))
    assert_unchanged(model)


def test_conv_transpose_not_folded():
    c = 4
    nodes = [
        helper.make_node("ConvTranspose", ["x", "W"], ["c"]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["y"]),
    ]
    inits = [tensor("W", random((c, c, 3, 3), seed=2)), *bn_params(c)]
    model = make_model(nodes, [info("x", F, [1, c, 3, 3])], [out_info("y", F, 4)], inits)
    assert_unchanged(model)


def test_bfloat16_not_folded():
    model = conv_bn()
    g = model.graph
    w = next(t for t in g.initializer if t.name == "W")
    w.CopyFrom(helper.make_tensor("W", TensorProto.BFLOAT16, w.dims, np.zeros(np.prod(w.dims))))
    b = next(t for t in g.initializer if t.name == "b")
    b.CopyFrom(helper.make_tensor("b", TensorProto.BFLOAT16, b.dims, np.zeros(np.prod(b.dims))))
    g.input[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    g.output[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    assert_unchanged(model)


def test_channel_count_mismatch_not_folded():
    # A [1]-shaped scale would broadcast in ORT but is not a per-channel vector of W's M.
    model = conv_bn()
    g = model.graph
    scale = next(t for t in g.initializer if t.name == "scale")
    scale.CopyFrom(tensor("scale", np.array([2.0], np.float32)))
    report, _ = run_passes(model, PASS)
    assert report.rewrites == 0


def test_explain_says_why():
    model = conv_bn(opset=15, bn_attrs={"training_mode": 1})
    report = fastopt.optimize(fastopt.from_onnx(model), passes=PASS, explain="fuse_conv_bn")
    assert any("training_mode" in line for line in report.explain), report.explain


# ---- acceptance: the onnx wheel's light CNNs ----

HEAVY = {"light_bvlc_alexnet", "light_vgg19", "light_zfnet512"}  # big FC weights, no BN


def with_logits(model: onnx.ModelProto) -> onnx.ModelProto:
    """Also outputs each Softmax's input: class scores show differences a softmax flattens."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == "Softmax":
            out.graph.output.append(out_info(node.input[0], F, 2))
    return out


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in HEAVY else [])
        for p in light_models()
    ],
)
def test_light_models_preset_default(path):
    original = onnx.load(path)
    # Weights are ConstantOfShape nodes in IR v3 models (see materialize_light): made constants
    # here as constant folding would, with random values so that the scores are not uniform.
    model = with_logits(materialize_light(original))
    feeds = light_feeds(original)
    report, out = run_passes(model, None)
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    producers = {o: n for n in model.graph.node for o in n.output}
    uses = Counter(i for n in model.graph.node for i in n.input)
    foldable = [
        n
        for n in bns
        if n.input[0] in producers
        and producers[n.input[0]].op_type == "Conv"
        and uses[n.input[0]] == 1
    ]
    assert rewrites(report, "fuse_conv_bn") == len(foldable)
    left = [n for n in out.graph.node if n.op_type == "BatchNormalization"]
    assert len(left) == len(bns) - len(foldable)
    if path.stem != "light_densenet121":
        assert not left  # every BN follows a Conv
    else:
        # Pre-activation DenseNet: the BNs left normalize Concat/pooling outputs, no Conv before.
        assert {producers[n.input[0]].op_type for n in left} <= {"Concat", "MaxPool", "AveragePool"}
    # Parity relative to each output's scale: with random weights these deep nets reach 1e5-1e6,
    # and folding moves rounding by a few ulps of that (ORT's own Conv+BN fusion, at
    # ORT_ENABLE_BASIC, moves the scores just as far).
    expected, actual = ort_run(model, feeds), ort_run(out, feeds)
    for e, a in zip(expected, actual):
        assert a.shape == e.shape
        assert np.abs(a - e).max() <= 1e-4 * max(1.0, float(np.abs(e).max()))
    # Unused weights are gone.
    used = {i for n in out.graph.node for i in n.input}
    assert all(t.name in used for t in out.graph.initializer)


# ---- real exports: PyTorch, exporters that keep BatchNormalization ----


@pytest.mark.parametrize(
    ("exporter", "folded"),
    [
        ("torchscript_nofold", 3),
        # The bias-less grouped Conv gets a zero bias computed by Shape/Expand/CastLike nodes:
        # not a constant until constant folding runs, so that BN stays.
        ("dynamo_noopt", 2),
    ],
)
def test_torch_export(exporter, folded, tmp_path):
    pytest.importorskip("torch")
    net, args = torch_cnn()
    model = torch_export(net, args, tmp_path, **TORCH_EXPORTERS[exporter])
    assert ops(model).count("BatchNormalization") == 3
    report, out = run_passes(model, None)
    assert rewrites(report, "fuse_conv_bn") == folded
    assert ops(out).count("BatchNormalization") == 3 - folded
    feeds = {"x": args[0].numpy()}
    expected, actual = ort_run(model, feeds), ort_run(out, feeds)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(actual[0], net(*args).detach().numpy(), rtol=1e-4, atol=1e-4)


def test_float16_overflow_not_folded():
    # var ~ 0 makes scale / sqrt(var + eps) huge: the folded fp16 weight would be inf.
    model = conv_bn(dtype=np.float16, bn_attrs={"epsilon": 1e-8})
    var = next(t for t in model.graph.initializer if t.name == "var")
    var.CopyFrom(tensor("var", np.zeros(6, np.float16)))
    scale = next(t for t in model.graph.initializer if t.name == "scale")
    scale.CopyFrom(tensor("scale", np.full(6, 1000, np.float16)))
    assert_unchanged(model)


def test_weight_computed_from_constants_is_scaled_not_materialized(tmp_path):
    """W = ConstantOfShape(shape) (as the onnx wheel's light_* models carry their weights): the
    BatchNormalization still folds, as W * factor[M,1,1,1] left for the runtime's constant
    folding, without writing the full weight into the file."""
    rng = np.random.default_rng(3)
    m_, c, k = 64, 32, 3  # 73 KB of weight: over what constant folding may materialize
    shape = numpy_helper.from_array(np.array([m_, c, k, k], np.int64), "wshape")
    params = [
        numpy_helper.from_array(a.astype(np.float32), n)
        for n, a in (
            ("scale", rng.uniform(0.5, 1.5, m_)),
            ("B", rng.normal(size=m_)),
            ("mean", rng.normal(size=m_)),
            ("var", rng.uniform(0.5, 2.0, m_)),
        )
    ]
    nodes = [
        helper.make_node(
            "ConstantOfShape",
            ["wshape"],
            ["W"],
            value=numpy_helper.from_array(np.array([0.05], np.float32)),
        ),
        helper.make_node("Conv", ["X", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "B", "mean", "var"], ["Y"], epsilon=1e-3
        ),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, c, 5, 5])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, m_, 5, 5])],
        [shape, *params],
    )
    src = tmp_path / "in.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    out = tmp_path / "out.onnx"
    report = fastopt.optimize(src, preset="default", output=out)
    assert report.ops_after.get("BatchNormalization", 0) == 0
    saved = onnx.load(out)
    onnx.checker.check_model(saved, full_check=True)
    # Nothing weight-sized was written: only the [M,1,1,1] factor and the [M] bias are new.
    assert all(np.prod(t.dims) <= m_ for t in saved.graph.initializer if t.name != "wshape")
    x = rng.normal(size=(1, c, 5, 5)).astype(np.float32)
    fastopt.verify(src, out, inputs={"X": x})
