"""fastopt.verify.check: onnx.checker, strict shape inference and an ONNX Runtime load, stage by
stage."""

from __future__ import annotations

import importlib
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.paths import ROOT

CORPUS_DIR = ROOT.parent / "shared" / "corpus"
CORPUS = sorted(CORPUS_DIR.glob("*/model.onnx")) if CORPUS_DIR.is_dir() else []
needs_corpus = pytest.mark.skipif(not CORPUS, reason="../shared/corpus is absent")
# `fastopt.verify.check` is the function; the module of the same name is reached through importlib.
check_module = importlib.import_module("fastopt.verify.check")


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opsets: Sequence[tuple[str, int]] = (("", 17),),
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=8
    )


def tensor(name: str, elem: int = TensorProto.FLOAT, shape: Any = (2, 3)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def valid_model() -> onnx.ModelProto:
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 4], [0.5] * 12)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    return make_model(nodes, [tensor("x")], [tensor("y", shape=[2, 4])], [w])


def type_error_model() -> onnx.ModelProto:
    """Add of a float and an int64 tensor: the checker's structure is fine, the types are not."""
    nodes = [helper.make_node("Add", ["x", "i"], ["y"])]
    return make_model(nodes, [tensor("x"), tensor("i", TensorProto.INT64)], [tensor("y")])


def failing(model: Any, **kwargs: Any) -> fastopt.CheckError:
    with pytest.raises(fastopt.CheckError) as info:
        fastopt.check(model, **kwargs)
    return info.value


def statuses(report: fastopt.CheckReport) -> dict[str, str]:
    return {s.name: s.status for s in report.stages}


ALL_OK = {"checker": "ok", "shape_inference": "ok", "onnxruntime": "ok"}


@pytest.mark.parametrize("form", ["path", "model", "proto"])
def test_valid_model_passes_every_stage(tmp_path: Path, form: str) -> None:
    proto = valid_model()
    onnx.save(proto, tmp_path / "m.onnx")
    given: Any = {
        "path": tmp_path / "m.onnx",
        "model": fastopt.load(tmp_path / "m.onnx"),
        "proto": proto,
    }[form]
    report = fastopt.check(given)
    assert report.ok and not report.failed
    assert statuses(report) == ALL_OK
    assert all(s.seconds >= 0 and s.message == "" for s in report.stages)
    if form == "path":
        assert report.model == str(tmp_path / "m.onnx")
    text = str(report)
    assert text.startswith("check passed") and "shape_inference" in text and "onnxruntime" in text
    as_dict = json.loads(json.dumps(report.to_dict()))
    assert as_dict["ok"] is True and [s["name"] for s in as_dict["stages"]] == list(ALL_OK)


def test_type_error_fails_at_the_checker_stage() -> None:
    err = failing(type_error_model())
    assert isinstance(err, fastopt.ModelError)  # one except clause catches every bad model
    first = err.report.failed[0]
    assert first.name == "checker"  # the full check runs onnx's own strict inference
    assert "inconsistent type tensor(int64)" in first.message
    message = str(err)
    assert "checker stage" in message and "full check" in message
    assert "inconsistent type tensor(int64)" in message and "\n" not in message
    # the same model fails strict shape inference and ORT's load too: all stages ran
    assert statuses(err.report) == {
        "checker": "failed",
        "shape_inference": "failed",
        "onnxruntime": "failed",
    }
    assert "also failed: shape_inference, onnxruntime" in message


def test_type_error_without_full_check_fails_at_shape_inference() -> None:
    err = failing(type_error_model(), full_check=False, ort=False)
    assert statuses(err.report) == {
        "checker": "ok",
        "shape_inference": "failed",
        "onnxruntime": "skipped",
    }
    assert "failed the shape_inference stage" in str(err)
    assert "inconsistent type" in err.report.stage("shape_inference").message


def test_incompatible_shapes_fail() -> None:
    nodes = [helper.make_node("Add", ["x", "w"], ["y"], name="the_add")]
    model = make_model(nodes, [tensor("x"), tensor("w", shape=[4, 5])], [tensor("y")])
    err = failing(model)
    assert err.report.failed[0].name == "checker"
    assert "Incompatible dimensions" in str(err) and "the_add" in str(err)


def test_data_propagation_finds_what_the_full_check_cannot() -> None:
    """Reshape(x[2,3], Concat(Shape(x)[0], -1)) is [2, 3], but the output is declared [2, 4]:
    only shape inference with data propagation folds the target shape. ORT loads it fine."""
    inits = [
        helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
        helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1]),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["s0"], axis=0),
        helper.make_node("Concat", ["s0", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    model = make_model(nodes, [tensor("x")], [tensor("y", shape=[2, 4])], inits)
    err = failing(model)
    assert statuses(err.report) == {
        "checker": "ok",
        "shape_inference": "failed",
        "onnxruntime": "ok",
    }
    assert "Inferred shape and existing shape differ" in str(err)
    with pytest.raises(fastopt.CheckError):
        fastopt.check(model, ort=False)
    assert fastopt.check(model, strict_shapes=False).stage("shape_inference").status == "skipped"


def test_structural_error_is_the_checkers() -> None:
    """A node reading a value nothing produces (fastopt's reader refuses it; onnx says why)."""
    nodes = [helper.make_node("Relu", ["nowhere"], ["y"])]
    err = failing(make_model(nodes, [tensor("x")], [tensor("y")]), ort=False)
    assert err.report.failed[0].name == "checker"
    assert "nowhere" in err.report.failed[0].message


def contrib_model(opsets: Sequence[tuple[str, int]], op: str = "FusedMatMul") -> onnx.ModelProto:
    nodes = [
        helper.make_node(op, ["x", "x"], ["t"], domain="com.microsoft", transB=1, alpha=0.5),
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    return make_model(nodes, [tensor("x")], [tensor("y", shape=[2, 2])], opsets=opsets)


def test_contrib_ops_pass_when_their_domain_is_imported() -> None:
    report = fastopt.check(contrib_model([("", 17), ("com.microsoft", 1)]))
    assert statuses(report) == ALL_OK


def test_contrib_op_without_its_opset_import_fails_at_the_checker() -> None:
    err = failing(contrib_model([("", 17)]))
    assert err.report.failed[0].name == "checker"
    assert "No opset import for domain 'com.microsoft'" in str(err)


def test_an_op_only_onnxruntime_rejects_fails_the_ort_stage() -> None:
    model = contrib_model([("", 17), ("com.microsoft", 1)], op="NoSuchContribOp")
    err = failing(model)
    assert statuses(err.report) == {
        "checker": "ok",
        "shape_inference": "ok",
        "onnxruntime": "failed",
    }
    assert "NoSuchContribOp" in str(err) and "ONNX Runtime" in str(err)
    assert fastopt.check(model, ort=False).stage("onnxruntime").status == "skipped"


def test_unknown_provider_fails_the_ort_stage() -> None:
    """ORT itself would quietly fall back to CPU and check something else than asked."""
    err = failing(valid_model(), providers=["NoSuchExecutionProvider"])
    assert err.report.failed[0].name == "onnxruntime"
    assert "'NoSuchExecutionProvider' is not available" in str(err)


def _fake_inference_error(message: str) -> Any:
    def infer(*args: Any, **kwargs: Any) -> Any:
        raise onnx.shape_inference.InferenceError(message)

    return infer


def test_inference_errors_on_custom_domain_nodes_are_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    """onnx skips nodes it has no schema for; should a version report an error on one anyway,
    only custom-domain nodes are forgiven."""
    model = contrib_model([("", 17), ("com.microsoft", 1)])
    model.graph.node[0].name = "fused"
    model.graph.node[1].name = "relu"
    custom = (
        "[ShapeInferenceError] Inference error(s): (op_type:FusedMatMul, node name: fused): boom"
    )
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", _fake_inference_error(custom))
    stage = fastopt.check(model, ort=False).stage("shape_inference")
    assert stage.status == "ok" and "custom-domain" in stage.message and "boom" in stage.message

    standard = custom + "\n(op_type:Relu, node name: relu): bad"
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", _fake_inference_error(standard))
    err = failing(model, ort=False)
    assert err.report.failed[0].name == "shape_inference"
    assert "(and 1 more node errors)" in err.report.failed[0].message

    # errors that name no node cannot be attributed: they count
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", _fake_inference_error("broken"))
    assert failing(model, ort=False).report.failed[0].name == "shape_inference"


def test_summarize_error_keeps_the_first_error_in_a_paragraph() -> None:
    long = "No Op registered for Foo\n\n==> Context: Bad node spec for node. Name: n OpType: Foo\n"
    long += "input: " + "x" * 5000
    short = check_module.summarize_error(long)
    assert short.startswith("No Op registered for Foo [context: Bad node spec for node.")
    assert "\n" not in short and "xxxx" not in short
    huge = check_module.summarize_error("error " * 2000)
    assert len(huge) < 500 and huge.endswith("more characters)")


def test_large_models_go_through_external_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the inline limit at 0 every model takes the >2 GB road: saved to a temporary folder
    with external data, checked and loaded by path; the folder is gone afterwards."""
    monkeypatch.setattr(check_module, "_INLINE_LIMIT", 0)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    # raw_data: Model.save keeps typed-field tensors (float_data) inline even then
    big_weight = numpy_helper.from_array(np.full((3, 400), 0.25, np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
    proto = make_model(nodes, [tensor("x")], [tensor("y", shape=[2, 400])], [big_weight])
    saved: list[Path] = []
    save_external = check_module._save_external

    def spy(model: fastopt.Model, stack: Any) -> str:
        path = save_external(model, stack)
        saved.append(Path(path))
        if model.parameter_bytes():  # the weights went to external data
            assert Path(path + ".data").stat().st_size >= model.parameter_bytes()
        return path

    monkeypatch.setattr(check_module, "_save_external", spy)
    model = fastopt.from_onnx(proto)
    assert statuses(fastopt.check(model)) == ALL_OK
    onnx.save(proto, tmp_path / "m.onnx")
    assert statuses(fastopt.check(tmp_path / "m.onnx")) == ALL_OK  # a "huge" single file
    err = failing(fastopt.from_onnx(type_error_model()))
    assert err.report.failed[0].name == "checker"
    assert len(saved) == 3 and all(scratch in p.parents for p in saved)
    assert list(scratch.iterdir()) == []


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fastopt.check(tmp_path / "absent.onnx")


@needs_corpus
@pytest.mark.parametrize("path", CORPUS, ids=[p.parent.name for p in CORPUS])
def test_corpus_models_pass(path: Path) -> None:
    report = fastopt.check(path)
    assert statuses(report) == ALL_OK, str(report)


@needs_corpus
def test_ort_optimized_model_with_contrib_ops_passes(tmp_path: Path) -> None:
    """ORT's extended fusions put com.microsoft ops (FusedMatMul, FastGelu) into GPT-2."""
    source = CORPUS_DIR / "gpt2_ts_nocache" / "model.onnx"
    if not source.is_file():
        pytest.skip("gpt2_ts_nocache is not in the corpus")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(source), so, providers=["CPUExecutionProvider"])
    counts = fastopt.load(tmp_path / "opt.onnx").op_counts()
    if not any(k.startswith("com.microsoft::") for k in counts):
        pytest.skip("this onnxruntime fused nothing into com.microsoft ops")
    assert statuses(fastopt.check(tmp_path / "opt.onnx")) == ALL_OK


def test_ort_op_in_the_onnx_domain_passes_as_ort_only() -> None:
    """SimplifiedLayerNormalization (what target "ort" writes) is an ONNX Runtime op registered in
    the ONNX domain, where onnx has no schema for it: the checker judges it by ORT's schema, and
    the report says the model runs in ONNX Runtime only."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    w = numpy_helper.from_array(np.ones(8, np.float32), "w")
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["t"], axis=-1),
        helper.make_node("Relu", ["t"], ["y"]),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)]
    )
    report = fastopt.check(model)
    assert statuses(report) == ALL_OK
    assert report.runtime_ops == {"SimplifiedLayerNormalization": 1} and report.ort_only
    assert "runs in ONNX Runtime only" in str(report)
    # a standard model is not ORT-only
    assert not fastopt.check(valid_model()).ort_only
    # the same op with a wrong input count breaks ORT's schema: the checker says so
    del model.graph.node[0].input[1]
    err = failing(model)
    assert err.report.failed[0].name == "checker" and "input size 1" in str(err)
