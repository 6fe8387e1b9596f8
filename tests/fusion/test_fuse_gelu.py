"""fuse_gelu (elementwise GELU -> Gelu/FastGelu or Gelu-20) and fuse_bias_gelu (Add(bias) +
GELU -> BiasGelu / FastGelu(x, b)) on the LLM fixtures and on hand-built graphs."""

from __future__ import annotations

import math

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.fusion_util import (
    check_fusion,
    info,
    make_model,
    ops,
    out_info,
    random,
    run_passes,
    tensor,
)
from support.llm_fixtures import assert_parity, fixtures, ids, op_count, optimize

F = TensorProto.FLOAT
MS = "com.microsoft"
GELU = ["fuse_gelu", "fuse_bias_gelu", "eliminate_dead_nodes"]
GELU_ARCHS = ["gpt2", "bert", "gpt_neox", "gemma"]


@pytest.mark.parametrize("fx", fixtures(arch=GELU_ARCHS), ids=ids(fixtures(arch=GELU_ARCHS)))
def test_fixtures_ort(fx):
    _report, out = optimize(fx, passes=fastopt.pipeline.registry.preset("classic") + GELU)
    n = fx.layers
    for op in ("Erf", "Tanh"):
        assert op_count(out, op) == 0, op
    if fx.arch == "gpt2":  # the MLP bias sits in a Gemm: plain FastGelu
        assert op_count(out, "FastGelu", MS) == n
    elif fx.arch in ("bert", "gpt_neox"):  # MatMul -> Add(bias) -> erf GELU
        assert op_count(out, "BiasGelu", MS) == n
        assert op_count(out, "Gelu") == 0
    elif fx.exporter == "ts":  # gemma: tanh GELU written out, no bias
        assert op_count(out, "FastGelu", MS) == n
    else:  # gemma dynamo: Gelu-20 tanh without bias stays (same speed as FastGelu on ORT CPU)
        assert op_count(out, "Gelu", "") == n
    assert_parity(fx, out)


TS = fixtures(arch=GELU_ARCHS, exporter="ts")


@pytest.mark.parametrize("fx", TS, ids=ids(TS))
def test_fixtures_onnx(fx):
    passes = [*fastopt.pipeline.registry.preset("classic"), "convert_version", "fuse_gelu"]
    _report, out = optimize(fx, passes=passes, target="onnx", options={"opset": 23})
    assert op_count(out, "Gelu", "") == fx.layers
    assert op_count(out, "Erf") == op_count(out, "Tanh") == 0
    tanh = fx.arch in ("gpt2", "gemma")
    for node in out.graph.node:
        if node.op_type == "Gelu":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs.get("approximate", b"none") == (b"tanh" if tanh else b"none")
    onnx.checker.check_model(out, full_check=True)
    assert_parity(fx, out)


# ---- hand-built graphs ----


def model(nodes, inits, shape=(2, 3, 8), opset=17, dtype=F):
    return make_model(
        nodes, [info("x", dtype, list(shape))], [out_info("y", dtype, len(shape))], inits, opset
    )


def c(name, value, dtype=np.float32):
    return tensor(name, np.array(value, dtype=dtype))


SQRT2 = math.sqrt(2)
K_TANH = math.sqrt(2 / math.pi)


def erf_gelu(div=("Div", SQRT2), half_last=True, one=1.0, extra_use=False):
    nodes = [
        helper.make_node(div[0], ["x", "s"], ["a"]),
        helper.make_node("Erf", ["a"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["t"]),
    ]
    if half_last:
        nodes += [
            helper.make_node("Mul", ["x", "t"], ["m"]),
            helper.make_node("Mul", ["m", "half"], ["y0"]),
        ]
    else:
        nodes += [
            helper.make_node("Mul", ["half", "x"], ["m"]),
            helper.make_node("Mul", ["t", "m"], ["y0"]),
        ]
    out = "y0"
    if extra_use:  # the Erf output is read twice
        nodes.append(helper.make_node("Add", ["y0", "e"], ["y1"]))
        out = "y1"
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    return model(nodes, [c("s", div[1]), c("one", one), c("half", 0.5)])


def tanh_gelu(megatron=False, cube="pow", k=K_TANH):
    N = helper.make_node
    if megatron:  # 0.79788 * x * (1 + 0.044715 * x * x)
        nodes = [
            N("Mul", ["x", "c"], ["cx"]),
            N("Mul", ["cx", "x"], ["cxx"]),
            N("Add", ["cxx", "one"], ["p"]),
            N("Mul", ["x", "k"], ["kx"]),
            N("Mul", ["kx", "p"], ["arg"]),
        ]
    else:
        nodes = (
            [N("Pow", ["x", "three"], ["x3"])]
            if cube == "pow"
            else [N("Mul", ["x", "x"], ["xx"]), N("Mul", ["xx", "x"], ["x3"])]
        )
        nodes += [
            N("Mul", ["x3", "c"], ["cx3"]),
            N("Add", ["x", "cx3"], ["p"]),
            N("Mul", ["p", "k"], ["arg"]),
        ]
    nodes += [
        N("Tanh", ["arg"], ["th"]),
        N("Add", ["th", "one"], ["t"]),
        N("Mul", ["x", "half"], ["hx"]),
        N("Mul", ["hx", "t"], ["y"]),
    ]
    inits = [c("three", 3.0), c("c", 0.044715), c("k", k), c("one", 1.0), c("half", 0.5)]
    return model(nodes, inits)


FEEDS = {"x": random((2, 3, 8), seed=1) * 3}


@pytest.mark.parametrize("div", [("Div", math.sqrt(2)), ("Mul", math.sqrt(0.5))])
@pytest.mark.parametrize("half_last", [True, False])
def test_erf_forms(div, half_last):
    out = check_fusion(erf_gelu(div, half_last), ["fuse_gelu"], FEEDS, 1)
    assert ops(out) == ["Gelu", "Identity"]


@pytest.mark.parametrize("megatron,cube", [(False, "pow"), (False, "mul"), (True, "")])
def test_tanh_forms(megatron, cube):
    out = check_fusion(tanh_gelu(megatron, cube), ["fuse_gelu"], FEEDS, 1, tol=1e-3)
    assert ops(out) == ["FastGelu"]


def test_target_onnx_needs_opset_20():
    _report, out = run_passes(erf_gelu(), ["fuse_gelu"], target="onnx")
    assert "Erf" in ops(out)
    m20 = erf_gelu()
    m20.opset_import[0].version = 20
    out = check_fusion(m20, ["fuse_gelu"], FEEDS, 1, target="onnx")
    assert ops(out) == ["Gelu", "Identity"]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: erf_gelu(div=("Div", 1.5)),  # wrong constant
        lambda: erf_gelu(one=2.0),
        lambda: erf_gelu(extra_use=True),  # an intermediate has another reader
        lambda: tanh_gelu(k=0.7),
    ],
)
def test_does_not_fire(bad):
    report, out = run_passes(bad(), ["fuse_gelu"])
    assert report.passes[0].rewrites == 0
    assert "Gelu" not in ops(out) and "FastGelu" not in ops(out)


def test_explain():
    report = fastopt.optimize(
        fastopt.from_onnx(erf_gelu(one=2.0)), passes=["fuse_gelu"], explain="fuse_gelu_erf"
    )
    assert report.explain and all(line.startswith("fuse_gelu_erf @") for line in report.explain)
    assert any("1.000000" in line for line in report.explain), report.explain


# ---- fuse_bias_gelu ----


def bias_gelu(gelu="ms", bias_shape=(8,), extra_use=False):
    N = helper.make_node
    nodes = [N("Add", ["x", "b"], ["a"])]
    if gelu == "ms":
        nodes.append(N("Gelu", ["a"], ["y"], domain=MS))
    elif gelu == "fast":
        nodes.append(N("FastGelu", ["a"], ["y"], domain=MS))
    else:
        nodes.append(N("Gelu", ["a"], ["y"], approximate=gelu))
    outs = [out_info("y", F, 3)]
    if extra_use:
        outs.append(out_info("a", F, 3))
    return make_model(
        nodes,
        [info("x", F, [2, 3, 8])],
        outs,
        [tensor("b", random(bias_shape, seed=4))],
        opset=20,
        extra_opsets=[helper.make_opsetid(MS, 1)],
    )


@pytest.mark.parametrize(
    "gelu,fused",
    [("ms", "BiasGelu"), ("none", "BiasGelu"), ("fast", "FastGelu"), ("tanh", "FastGelu")],
)
def test_bias_gelu(gelu, fused):
    out = check_fusion(bias_gelu(gelu), ["fuse_bias_gelu"], FEEDS, 1, tol=1e-3)
    assert ops(out) == [fused]
    assert list(out.graph.node[0].input) == ["x", "b"]


@pytest.mark.parametrize("kw", [{"bias_shape": (1, 8)}, {"bias_shape": (1,)}, {"extra_use": True}])
def test_bias_gelu_does_not_fire(kw):
    report, _ = run_passes(bias_gelu(**kw), ["fuse_bias_gelu"])
    assert report.passes[0].rewrites == 0
    report, _out = run_passes(bias_gelu(), ["fuse_bias_gelu"], target="onnx")
    assert report.passes[0].rewrites == 0
