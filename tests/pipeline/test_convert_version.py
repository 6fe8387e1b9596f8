"""convert_version: onnx.version_converter over the skeleton, bound back to the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from conftest import CORPUS_DIR, random_feeds, run_ort
from onnx import TensorProto, helper
from support.folding_helpers import assert_parity, make_model, optimize, out
from support.paths import TESTS

F = TensorProto.FLOAT


def address(t: fastopt.Tensor) -> int:
    return int(np.asarray(t.raw_bytes()).__array_interface__["data"][0])


def opset11_model() -> onnx.ModelProto:
    """Ops whose attributes became inputs since opset 11 (axes, split)."""
    return make_model(
        [
            helper.make_node("MatMul", ["X", "W"], ["a"]),
            helper.make_node("ReduceSum", ["a"], ["s"], axes=[1], keepdims=1),
            helper.make_node("Split", ["a"], ["p", "q"], axis=1, split=[2, 30]),
            helper.make_node("Unsqueeze", ["p"], ["u"], axes=[0]),
            helper.make_node("Squeeze", ["u"], ["v"], axes=[0]),
            helper.make_node("ReduceMean", ["q"], ["m"], axes=[1], keepdims=1),
            helper.make_node("Concat", ["v", "s", "m"], ["Y"], axis=1),
        ],
        [out("X", F, ["b", 16])],
        [out("Y", F, ["b", 4])],
        {"W": np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)},  # 2 KB
        opset=11,
    )


@pytest.mark.parametrize("target", [13, 18, 21])
def test_converts_with_parity_and_shared_weights(target: int, tmp_path: Path) -> None:
    model = opset11_model()
    m = fastopt.from_onnx(model)
    report, path = optimize(m, ["convert_version"], tmp_path, options={"opset": target})
    assert report.passes[0].rewrites == 1
    converted = report.model
    assert converted is not None and converted.opset_imports[""] == target
    assert address(converted.graph.initializer("W")) == address(m.graph.initializer("W"))
    squeeze = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "Squeeze")
    assert len(squeeze.input) == 2 and not squeeze.attribute  # axes moved to an input
    assert_parity(model, path, tmp_path)


def test_without_target_or_at_target_does_nothing() -> None:
    m = fastopt.from_onnx(opset11_model())
    assert fastopt.optimize(m, passes=["convert_version"]).rewrites == 0
    report = fastopt.optimize(m, passes=["convert_version"], options={"opset": 11})
    assert report.rewrites == 0 and report.model is m


def test_impossible_conversion_raises() -> None:
    model = make_model(
        [helper.make_node("LayerNormalization", ["X", "g"], ["Y"])],
        [out("X", F, [2, 4])],
        [out("Y", F, [2, 4])],
        {"g": np.ones(4, np.float32)},
    )
    with pytest.raises(fastopt.ModelError, match="version conversion to opset 9"):
        fastopt.optimize(fastopt.from_onnx(model), passes=["convert_version"], options={"opset": 9})
    # options are checked against their declarations (strings, as the CLI gives, are parsed)
    with pytest.raises(ValueError, match=r"opset must be an integer in \[1, 1000\]"):
        fastopt.optimize(
            fastopt.from_onnx(model), passes=["convert_version"], options={"opset": "eighteen"}
        )


@pytest.mark.skipif(
    not (CORPUS_DIR / "llama_ts_nocache" / "model.onnx").is_file(),
    reason="reference corpus (../shared/corpus) not present",
)
def test_corpus_export_17_to_18(tmp_path: Path) -> None:
    path = CORPUS_DIR / "llama_ts_nocache" / "model.onnx"
    meta = json.loads((path.parent / "meta.json").read_text())
    feeds = random_feeds(onnx.load(str(path)), meta)
    m = fastopt.load(path)
    report, out_path = optimize(m, ["convert_version"], tmp_path, options={"opset": 18})
    assert report.model is not None and report.model.opset_imports[""] == 18
    reduce = [n for n in onnx.load(str(out_path)).graph.node if n.op_type == "ReduceMean"]
    assert reduce and all(len(n.input) == 2 for n in reduce)
    for e, a in zip(run_ort(path, feeds), run_ort(out_path, feeds)):
        np.testing.assert_allclose(a, e, rtol=0, atol=1e-5)


def test_target_opset_converts_only_for_target_onnx() -> None:
    path = TESTS / "fixtures" / "models" / "llama_ts_float32" / "model.onnx"
    ort_report = fastopt.optimize(path, passes=["target_opset"], target="ort")
    assert ort_report.model is not None and ort_report.model.opset_imports[""] == 17
    onnx_report = fastopt.optimize(path, passes=["target_opset"], target="onnx")
    assert onnx_report.model is not None and onnx_report.model.opset_imports[""] == 23
    assert onnx_report.passes[0].rewrites == 1
    again = fastopt.optimize(onnx_report.model, passes=["target_opset"], target="onnx")
    assert again.passes[0].rewrites == 0
