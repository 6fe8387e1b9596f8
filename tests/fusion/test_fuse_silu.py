"""fuse_silu: x * Sigmoid(x) -> com.microsoft QuickGelu(alpha=1), and CLIP's quick_gelu
x * Sigmoid(1.702 x) -> QuickGelu(alpha=1.702) (target ort)."""

from __future__ import annotations

import fastopt
import pytest
from onnx import TensorProto, helper
from support.fusion_util import check_fusion, info, make_model, ops, out_info, random, run_passes
from support.llm_fixtures import MOE_ARCHS, assert_parity, fixtures, ids, op_count, optimize

F = TensorProto.FLOAT
# MoE decoders: the experts' SwiGLU on the gathered projections, one per layer; qwen2_moe's
# shared expert a second (its sigmoid gate on the expert's output is no SiLU and stays).
SILU_ARCHS = ["llama", "mistral", "qwen2", "phi3", *MOE_ARCHS]
SILU_PER_LAYER = {"qwen2_moe": 2}
FX = fixtures(arch=SILU_ARCHS)
CLIP = fixtures(arch="clip")


@pytest.mark.parametrize("fx", FX, ids=ids(FX))
def test_fixtures(fx):
    _report, out = optimize(fx, passes=[*fastopt.pipeline.registry.preset("classic"), "fuse_silu"])
    silu = SILU_PER_LAYER.get(fx.arch, 1) * fx.layers  # one SwiGLU MLP per layer
    assert op_count(out, "QuickGelu", "com.microsoft") == silu
    assert op_count(out, "Sigmoid") == (fx.layers if fx.arch == "qwen2_moe" else 0)
    for node in out.graph.node:
        if node.op_type == "QuickGelu":
            assert helper.get_attribute_value(node.attribute[0]) == 1.0
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", CLIP, ids=ids(CLIP))
def test_clip_quick_gelu(fx):
    _report, out = optimize(fx, passes=[*fastopt.pipeline.registry.preset("classic"), "fuse_silu"])
    gelus = [n for n in out.graph.node if n.op_type == "QuickGelu"]
    assert len(gelus) == fx.layers  # one MLP per layer
    assert op_count(out, "Sigmoid") == 0
    for node in gelus:
        assert helper.get_attribute_value(node.attribute[0]) == pytest.approx(1.702, rel=1e-6)
    assert_parity(fx, out)


def quick_gelu(alpha, alpha_first=False, shape=(), other=None):
    """y = x * Sigmoid(alpha * x), alpha a constant of `shape` (or `other`'s input instead)."""
    scaled = ["a", "x"] if alpha_first else ["x", "a"]
    nodes = [
        helper.make_node("Constant", [], ["a"], value=helper.make_tensor("av", F, shape, alpha)),
        helper.make_node("Mul", scaled, ["ax"]),
        helper.make_node("Sigmoid", ["ax"], ["s"]),
        helper.make_node("Mul", [other or "x", "s"], ["y"]),
    ]
    return make_model(nodes, [info("x", F, [4, 8]), info("z", F, [4, 8])], [out_info("y", F, 2)])


@pytest.mark.parametrize("alpha_first", [False, True])
def test_quick_gelu_fires(alpha_first):
    out = check_fusion(quick_gelu([1.702], alpha_first), ["fuse_silu"], FEEDS, 1)
    assert ops(out) == ["Constant", "QuickGelu"]  # alpha's Constant is left for dead-node cleanup
    assert helper.get_attribute_value(out.graph.node[1].attribute[0]) == pytest.approx(1.702)


@pytest.mark.parametrize(
    "kw",
    [
        {"alpha": [float(i) for i in range(8)], "shape": [8]},  # per channel, not one alpha
        {"alpha": [1.702], "shape": [1, 1, 1]},  # broadcasts x [4, 8] to rank 3
        {"alpha": [1.702], "other": "z"},
    ],
    ids=["alpha_per_channel", "alpha_raises_rank", "gates_another_value"],
)
def test_quick_gelu_does_not_fire(kw):
    report, out = run_passes(quick_gelu(**kw), ["fuse_silu"])
    assert report.passes[0].rewrites == 0 and "QuickGelu" not in ops(out)


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
