"""fuse_conv_activation: Conv + activation -> com.microsoft FusedConv (target ort, float)."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.fusion_util import (
    LIGHT_DIR,
    TORCH_EXPORTERS,
    check_fusion,
    info,
    light_feeds,
    make_model,
    materialize_light,
    ops,
    ort_run,
    out_info,
    random,
    run_passes,
    tensor,
    torch_cnn,
    torch_export,
)

F = TensorProto.FLOAT
PASS = ["fuse_conv_activation"]


def conv_act(
    act: str | None,
    act_attrs: dict | None = None,
    act_inputs: tuple[str, ...] = (),
    extra_inits: tuple[onnx.TensorProto, ...] = (),
    bias: bool = True,
    dtype=np.float32,
    opset: int = 17,
    conv_attrs: dict | None = None,
) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [tensor("W", random((6, 4, 3, 3), dtype, seed=2)), *extra_inits]
    conv_inputs = ["x", "W"]
    if bias:
        inits.append(tensor("b", random((6,), dtype, seed=3)))
        conv_inputs.append("b")
    attrs = {"pads": [1, 1, 1, 1], **(conv_attrs or {})}
    nodes = [helper.make_node("Conv", conv_inputs, ["c"], "conv", **attrs)]
    if act is not None:
        nodes.append(helper.make_node(act, ["c", *act_inputs], ["y"], "act", **(act_attrs or {})))
    else:
        nodes[0].output[0] = "y"
    return make_model(
        nodes, [info("x", elem, [2, 4, 7, 7])], [out_info("y", elem, 4)], inits, opset
    )


def feeds(dtype=np.float32) -> dict[str, np.ndarray]:
    return {"x": random((2, 4, 7, 7), dtype, seed=7)}


def fused(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = model.graph.node
    assert (node.domain, node.op_type) == ("com.microsoft", "FusedConv")
    assert node.output == ["y"]
    return node


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def f32(values) -> list[float]:
    return [float(np.float32(v)) for v in values]


# ---- fires ----


@pytest.mark.parametrize(
    ("act", "act_attrs", "expected_params"),
    [
        ("Relu", {}, None),
        ("Sigmoid", {}, None),
        ("Tanh", {}, None),
        ("LeakyRelu", {}, [0.01]),
        ("LeakyRelu", {"alpha": 0.3}, [0.3]),
        ("HardSigmoid", {}, [0.2, 0.5]),
        ("HardSigmoid", {"alpha": 0.1, "beta": 0.4}, [0.1, 0.4]),
    ],
    ids=["relu", "sigmoid", "tanh", "leaky_default", "leaky", "hsig_default", "hsig"],
)
def test_activations(act, act_attrs, expected_params):
    model = conv_act(act, act_attrs)
    out = check_fusion(model, PASS, feeds(), 1)
    a = attrs(fused(out))
    assert a["activation"] == act.encode()
    assert a.get("activation_params") == (None if expected_params is None else f32(expected_params))
    assert a["pads"] == [1, 1, 1, 1]
    assert any(o.domain == "com.microsoft" and o.version == 1 for o in out.opset_import)


@pytest.mark.parametrize(
    ("inputs", "values", "expected"),
    [
        (("lo", "hi"), (0.0, 6.0), [0.0, 6.0]),  # ReLU6
        (("lo",), (-0.5,), [-0.5, float(np.finfo(np.float32).max)]),
        (("", "hi"), (0.0, 1.5), [float(np.finfo(np.float32).min), 1.5]),
    ],
    ids=["relu6", "min_only", "max_only"],
)
def test_clip_inputs(inputs, values, expected):
    consts = tuple(
        tensor(n, np.array(v, np.float32)) for n, v in zip(("lo", "hi"), values) if n in inputs
    )
    model = conv_act("Clip", act_inputs=inputs, extra_inits=consts)
    out = check_fusion(model, PASS, feeds(), 1)
    a = attrs(fused(out))
    assert a["activation"] == b"Clip"
    assert a["activation_params"] == f32(expected)


def test_clip_opset6_attributes():
    model = conv_act("Clip", {"min": -1.0, "max": 2.0}, opset=10)
    out = check_fusion(model, PASS, feeds(), 1)
    assert attrs(fused(out))["activation_params"] == [-1.0, 2.0]


def test_clip_from_constant_nodes():
    bounds = (tensor("lo", np.array(0, np.float32)), tensor("hi", np.array(6, np.float32)))
    model = conv_act("Clip", act_inputs=("lo", "hi"), extra_inits=bounds)
    g = model.graph
    for t in [t for t in g.initializer if t.name in ("lo", "hi")]:
        g.initializer.remove(t)
    consts = [
        helper.make_node("Constant", [], ["lo"], value=tensor("lo", np.array(0, np.float32))),
        helper.make_node("Constant", [], ["hi"], value=tensor("hi", np.array(6, np.float32))),
    ]
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(consts + nodes)
    out = check_fusion(model, PASS, feeds(), 1)
    assert [n.op_type for n in out.graph.node if n.op_type != "Constant"] == ["FusedConv"]


def test_no_bias_and_conv_attributes():
    model = conv_act(
        "Relu", bias=False, conv_attrs={"strides": [2, 2], "dilations": [1, 1], "group": 2}
    )
    model.graph.initializer[0].CopyFrom(tensor("W", random((6, 2, 3, 3), seed=2)))
    out = check_fusion(model, PASS, feeds(), 1)
    node = fused(out)
    assert list(node.input) == ["x", "W"]
    assert attrs(node)["strides"] == [2, 2] and attrs(node)["group"] == 2


def test_conv_bn_relu_with_both_passes():
    rng = np.random.default_rng(1)
    c = 6
    bn = [
        tensor("scale", rng.uniform(0.5, 2, c).astype(np.float32)),
        tensor("shift", rng.standard_normal(c).astype(np.float32)),
        tensor("mean", rng.standard_normal(c).astype(np.float32)),
        tensor("var", rng.uniform(0.1, 2, c).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"]),
        helper.make_node("Relu", ["n"], ["y"]),
    ]
    inits = [tensor("W", random((c, 4, 3, 3), seed=2)), *bn]
    model = make_model(nodes, [info("x", F, [2, 4, 7, 7])], [out_info("y", F, 4)], inits)
    out = check_fusion(model, ["fuse_conv_bn", "fuse_conv_activation"], feeds(), 1)
    assert attrs(fused(out))["activation"] == b"Relu"
    # The default preset does the same and drops the replaced weights.
    _, out = run_passes(model, None)
    assert ops(out) == ["FusedConv"]
    assert len(out.graph.initializer) == 2


def test_conv1d():
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1]),
        helper.make_node("LeakyRelu", ["c"], ["y"], alpha=0.1),
    ]
    inits = [tensor("W", random((5, 3, 3), seed=2))]
    model = make_model(nodes, [info("x", F, [2, 3, 9])], [out_info("y", F, 3)], inits)
    out = check_fusion(model, PASS, {"x": random((2, 3, 9), seed=4)}, 1)
    assert attrs(fused(out))["activation"] == b"LeakyRelu"


def test_chain_of_convs():
    nodes, inits = [], []
    x = "x"
    for i in range(3):
        inits.append(tensor(f"W{i}", random((4, 4, 3, 3), seed=i)))
        nodes.append(helper.make_node("Conv", [x, f"W{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
        x = f"r{i}" if i < 2 else "y"
        nodes.append(helper.make_node("Relu", [f"c{i}"], [x]))
    model = make_model(nodes, [info("x", F, [1, 4, 5, 5])], [out_info("y", F, 4)], inits)
    out = check_fusion(model, PASS, {"x": random((1, 4, 5, 5), seed=9)}, 3)
    assert ops(out) == ["FusedConv"] * 3


def test_existing_ms_opset_kept():
    model = conv_act("Relu")
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    _, out = run_passes(model, PASS)
    assert [o.domain for o in out.opset_import].count("com.microsoft") == 1


# ---- must not fire ----


def assert_unchanged(model: onnx.ModelProto, target: str = "ort") -> None:
    report, out = run_passes(model, PASS, target)
    assert report.rewrites == 0, report.passes
    assert ops(out) == ops(model)
    assert all(o.domain != "com.microsoft" for o in out.opset_import)


def test_target_onnx():
    assert_unchanged(conv_act("Relu"), target="onnx")


def test_float16_not_fused():
    assert_unchanged(conv_act("Relu", dtype=np.float16))


def test_float64_not_fused():
    assert_unchanged(conv_act("Relu", dtype=np.float64))


def test_conv_output_has_another_consumer():
    model = conv_act("Relu")
    model.graph.node.append(helper.make_node("Sigmoid", ["c"], ["s"]))
    model.graph.output.append(out_info("s", F, 4))
    assert_unchanged(model)


def test_conv_output_is_graph_output():
    model = conv_act("Relu")
    model.graph.output.append(out_info("c", F, 4))
    assert_unchanged(model)


def test_clip_bound_not_constant():
    model = conv_act("Clip", act_inputs=("lo",), extra_inits=(tensor("lo", np.float32(0)),))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "lo"))
    model.graph.input.append(info("lo", F, []))
    assert_unchanged(model)


@pytest.mark.parametrize("act", ["Elu", "Softplus", "Selu", "PRelu"])
def test_unsupported_activation(act):
    slope = (tensor("slope", np.ones((1,), np.float32)),)
    model = (
        conv_act(act, act_inputs=("slope",), extra_inits=slope) if act == "PRelu" else conv_act(act)
    )
    assert_unchanged(model)


def test_activation_after_non_conv():
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2]),
        helper.make_node("Relu", ["p"], ["y"]),
    ]
    model = make_model(nodes, [info("x", F, [1, 4, 6, 6])], [out_info("y", F, 4)])
    assert_unchanged(model)


def test_unknown_dtype_not_fused():
    # Conv fed by a graph input without a type: nothing says the dtype is float.
    model = conv_act("Relu")
    g = model.graph
    g.initializer.remove(next(t for t in g.initializer if t.name == "W"))
    g.input.append(onnx.ValueInfoProto(name="W"))
    g.input[0].CopyFrom(onnx.ValueInfoProto(name="x"))
    report = fastopt.optimize(fastopt.from_onnx(model), passes=PASS)
    assert report.rewrites == 0


# ---- real exports: PyTorch (Conv + ReLU / ReLU6 / LeakyReLU) ----


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_torch_export(exporter, tmp_path):
    pytest.importorskip("torch")
    net, args = torch_cnn()
    model = torch_export(net, args, tmp_path, **TORCH_EXPORTERS[exporter])
    _, out = run_passes(model, None)
    fused_nodes = [n for n in out.graph.node if n.op_type == "FusedConv"]
    assert sorted(attrs(n)["activation"] for n in fused_nodes) == [b"Clip", b"LeakyRelu", b"Relu"]
    assert "Conv" not in ops(out)
    feeds = {"x": args[0].numpy()}
    np.testing.assert_allclose(
        ort_run(out, feeds)[0], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        ort_run(out, feeds)[0], net(*args).detach().numpy(), rtol=1e-4, atol=1e-4
    )


# ---- real exports: the onnx wheel's light CNNs (Caffe2 conversions, Conv -> Relu) ----


@pytest.mark.parametrize("name", ["light_squeezenet", "light_inception_v1", "light_resnet50"])
def test_light_models(name):
    original = onnx.load(LIGHT_DIR / f"{name}.onnx")
    model = materialize_light(original)  # weights as initializers (see fusion_util)
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    consumers = {i: n for n in model.graph.node for i in n.input}

    def single_consumer(node: onnx.NodeProto) -> onnx.NodeProto | None:
        v = node.output[0]
        return consumers[v] if uses.get(v) == 1 else None

    expected = 0
    for n in model.graph.node:
        nxt = single_consumer(n) if n.op_type == "Conv" else None
        if nxt is not None and nxt.op_type == "BatchNormalization":  # resnet50: folded first
            nxt = single_consumer(nxt)
        expected += nxt is not None and nxt.op_type == "Relu"
    assert expected > 0
    report, out = run_passes(model, ["fuse_conv_bn", "fuse_conv_activation"])
    assert report.passes[-1].rewrites == expected
    feeds = light_feeds(original)
    for e, a in zip(ort_run(model, feeds), ort_run(out, feeds)):
        assert np.abs(a - e).max() <= 1e-4 * max(1.0, float(np.abs(e).max()))
