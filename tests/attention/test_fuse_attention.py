"""fuse_attention (stage 1: decomposed SDPA -> internal Attention) with lower_attention (stage 2):
Attention-23 for target onnx, standard ops (decompose_attention) as the fallback. Real exports
of every fixture architecture, both exporters, fp32 and fp16, plus small hand-built variants
that must not fuse."""

from __future__ import annotations

from typing import Any

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.attention_models import counters, run_sdpa, sdpa_feeds, sdpa_model
from support.fusion_util import ort_run
from support.llm_fixtures import (
    Fixture,
    assert_parity,
    fixtures,
    ids,
    op_count,
    optimize,
    router_softmaxes,
)

PASSES = ["fuse_attention", "lower_attention"]
# gemma3 TorchScript: without fuse_rms_norm (not in these pass lists) its decomposed q/k norms
# hide the kv head count ("the number of kv heads is unknown"); the llm preset fuses them first
# (tests/fusion/test_llm_preset.py covers gemma3 there).
ALL = [
    fx
    for fx in fixtures(fused_attention=True)
    if fx.name not in ("gemma3_ts_float32", "gemma3_ts_float16")
]


def attention_passes(target: str) -> tuple[list[str], dict[str, int]]:
    default = fastopt.pipeline.registry.preset("classic")
    if target == "onnx":
        return ["convert_version", *default, *PASSES], {"opset": 23}
    # The fallback: attention_lowering=0 makes lower_attention decompose whatever the target.
    return [*default, *PASSES], {"attention_lowering": 0}


@pytest.mark.parametrize("fx", ALL, ids=ids(ALL))
def test_fixture_attention23(fx: Fixture) -> None:
    passes, options = attention_passes("onnx")
    report, out = optimize(fx, passes=passes, target="onnx", options=options)
    fused = counters(report, "fuse_attention")
    assert fused.get("attention") == fx.layers, fused
    assert fused.get("boolean mask") == fx.layers  # every fixture carries a padding mask
    grouped = fx.kv_heads < fx.heads
    assert fused.get("grouped kv heads", 0) == (fx.layers if grouped else 0)
    assert counters(report, "lower_attention").get("lowered to Attention-23") == fx.layers
    assert op_count(out, "Attention", "") == fx.layers
    assert op_count(out, "Softmax") == router_softmaxes(fx)
    assert op_count(out, "IsNaN") == 0
    assert all(n.domain != "ai.fastopt.internal" for n in out.graph.node)
    onnx.checker.check_model(out, full_check=True)
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", ALL, ids=ids(ALL))
def test_fixture_fallback(fx: Fixture) -> None:
    passes, options = attention_passes("ort")
    report, out = optimize(fx, passes=passes, target="ort", options=options)
    assert counters(report, "fuse_attention").get("attention") == fx.layers
    assert counters(report, "lower_attention").get("kept as standard ops") == fx.layers
    # One Softmax per layer again, on scores built from the un-repeated kv heads.
    assert op_count(out, "Softmax") == fx.layers + router_softmaxes(fx)
    assert all(n.domain != "ai.fastopt.internal" for n in out.graph.node)
    onnx.checker.check_model(out)
    assert_parity(fx, out)


def test_lower_needs_opset_23() -> None:
    fx = fixtures(arch="llama", exporter="dynamo", dtype="float32")[0]
    passes = [*fastopt.pipeline.registry.preset("classic"), *PASSES]
    report = fastopt.optimize(fx.path, passes=passes, target="onnx", explain="lower_attention")
    lines = [line for line in report.explain if "kept as standard ops" in line]
    assert len(lines) == fx.layers and all("opset" in line for line in lines), report.explain


# ---- hand-built SDPA variants ----


@pytest.mark.parametrize("target", ["onnx", "ort"])
@pytest.mark.parametrize("scale_on", ["scores", "q"])
def test_small_fuses_with_parity(target: str, scale_on: str) -> None:
    model = sdpa_model(scale_on=scale_on)
    report, out = run_sdpa(model, target)
    assert counters(report, "fuse_attention").get("attention") == 1
    assert op_count(out, "Attention") == (1 if target == "onnx" else 0)
    feeds = sdpa_feeds()
    expected, got = ort_run(model, feeds)[0], ort_run(out, feeds)[0]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert np.all(got[1, :, :2] == 0)  # fully masked rows are 0 on both sides
    onnx.checker.check_model(out, full_check=target == "onnx")


def test_untyped_intermediates() -> None:
    # Without shape inference only the graph inputs have types (as for the outputs of an
    # earlier fusion, e.g. a fused RotaryEmbedding): dtypes and ranks come from the producers.
    model = sdpa_model(scale_on="q")
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=["fuse_attention", "lower_attention"],
        target="ort",
        options={"attention_lowering": 0},
    )
    assert report.model is not None
    assert counters(report, "fuse_attention").get("attention") == 1
    out = report.model.to_onnx()
    feeds = sdpa_feeds()
    np.testing.assert_allclose(ort_run(out, feeds)[0], ort_run(model, feeds)[0], atol=1e-5)


def test_finite_mask_value_stays_additive() -> None:
    # Where(mask, 0, -1): not a "masked" value, so the additive float mask is kept as is.
    model = sdpa_model(mask_neg=-1.0)
    report, out = run_sdpa(model, "onnx")
    assert counters(report, "fuse_attention").get("additive mask") == 1
    feeds = sdpa_feeds()
    np.testing.assert_allclose(ort_run(out, feeds)[0], ort_run(model, feeds)[0], atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"axis": 2}, "Softmax is not over the last axis"),
        ({"perm": (1, 0, 3, 2)}, "unsupported permutation"),
        ({"nan_zero": 1.0}, "not Where(IsNaN(p), 0, p)"),
        ({"scores_output": True}, "is a graph output"),
        ({"scale": "s"}, "is not a constant"),
    ],
)
def test_small_must_not_fuse(kwargs: dict[str, Any], reason: str) -> None:
    model = sdpa_model(**kwargs)
    report, out = run_sdpa(model, "onnx", explain="fuse_attention")
    assert counters(report, "fuse_attention").get("attention", 0) == 0
    assert op_count(out, "Softmax") == 1
    assert any(reason in line for line in report.explain), report.explain


def test_intermediate_with_other_use_not_fused() -> None:
    model = sdpa_model()
    # The softmax output also feeds a second consumer.
    extra = helper.make_node("ReduceSum", ["p"], ["psum"], keepdims=0)
    model.graph.node.append(extra)
    model.graph.output.append(helper.make_tensor_value_info("psum", TensorProto.FLOAT, None))
    report, _ = run_sdpa(model, "onnx", explain="fuse_attention")
    assert counters(report, "fuse_attention").get("attention", 0) == 0
    assert any("other uses" in line for line in report.explain), report.explain
