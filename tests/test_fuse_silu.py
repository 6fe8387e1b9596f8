"""fuse_silu: x * Sigmoid(x) -> com.microsoft QuickGelu(alpha=1) (target ort)."""

from __future__ import annotations

import fastopt
import pytest
from fusion_util import check_fusion, info, make_model, ops, out_info, random, run_passes
from llm_fixtures import assert_parity, fixtures, ids, op_count, optimize
from onnx import TensorProto, helper

F = TensorProto.FLOAT
SILU_ARCHS = ["llama", "mistral", "qwen2", "phi3"]
FX = fixtures(arch=SILU_ARCHS)


@pytest.mark.parametrize("fx", FX, ids=ids(FX))
def test_fixtures(fx):
    _report, out = optimize(fx, passes=[*fastopt.registry.preset("default"), "fuse_silu"])
    assert op_count(out, "QuickGelu", "com.microsoft") == fx.layers  # one SwiGLU MLP per layer
    assert op_count(out, "Sigmoid") == 0
    for node in out.graph.node:
        if node.op_type == "QuickGelu":
            assert helper.get_attribute_value(node.attribute[0]) == 1.0
    assert_parity(fx, out)


def silu(order=("x", "s"), other=None, extra_use=False):
    nodes = [
        helper.make_node("Sigmoid", [other or "x"], ["s"]),
        helper.make_node("Mul", list(order), ["y"]),
    ]
    outs = [out_info("y", F, 2)]
    if extra_use:
        outs.append(out_info("s", F, 2))
    return make_model(nodes, [info("x", F, [4, 8]), info("z", F, [4, 8])], outs)


FEEDS = {"x": random((4, 8), seed=1), "z": random((4, 8), seed=2)}


@pytest.mark.parametrize("order", [("x", "s"), ("s", "x")])
def test_fires(order):
    out = check_fusion(silu(order), ["fuse_silu"], FEEDS, 1)
    assert ops(out) == ["QuickGelu"]


@pytest.mark.parametrize(
    "kw", [{"other": "z"}, {"extra_use": True}], ids=["sigmoid_of_other", "extra_use"]
)
def test_does_not_fire(kw):
    report, out = run_passes(silu(**kw), ["fuse_silu"])
    assert report.passes[0].rewrites == 0 and "QuickGelu" not in ops(out)


def test_target_onnx_does_nothing():
    _report, out = run_passes(silu(), ["fuse_silu"], target="onnx")
    assert ops(out) == ["Sigmoid", "Mul"]


def test_explain():
    report = fastopt.optimize(
        fastopt.from_onnx(silu(other="z")), passes=["fuse_silu"], explain="fuse_silu"
    )
    assert any(line.startswith("fuse_silu @") for line in report.explain), report.explain
