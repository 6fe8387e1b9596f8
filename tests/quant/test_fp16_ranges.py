"""fp16 that overflows: the range check (fastopt.quant.fp16_ranges over
fastopt.quant.activation_ranges) keeps the ops whose activations reach float16's range in float32,
--verify fails loudly on NaN/inf outputs, and clamped values are a warning line.

The overflowing model is the gemma3 TorchScript fixture with its embedding table scaled by 5e4:
the table stays inside fp16 (max 2.0e4), but Gemma multiplies the embeddings by sqrt(hidden) = 8,
so the residual stream reaches 1.6e5, past 65504, while the fp32 logits stay finite (the norms
rescale it). On main, fp16 of it gives NaN logits everywhere, and --verify printed only
"cosine 0.000000, max rel err nan"."""

from __future__ import annotations

from pathlib import Path

import fastopt
import fastopt.cli.main
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.quant.activation_ranges import SENTINEL, collect_ranges
from fastopt.quant.fp16_ranges import FP16_MAX, LIMIT
from fastopt.verify.quantized import verify_quantized
from onnx import TensorProto, helper, numpy_helper
from support.llm_fixtures import fixtures

GEMMA3 = fixtures(arch="gemma3", exporter="ts", dtype="float32")[0]
EMBEDDING = "m.model.embed_tokens.weight"
SCALE = 5e4


def _session(path: Path | str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma3 whose residual stream passes 65504 (module docstring)."""
    model = onnx.load(str(GEMMA3.path))
    for t in model.graph.initializer:
        if t.name == EMBEDDING:
            table = numpy_helper.to_array(t) * np.float32(SCALE)
            assert np.abs(table).max() < FP16_MAX  # no weight clamps: the activations overflow
            t.CopyFrom(numpy_helper.from_array(table, EMBEDDING))
    path = tmp_path_factory.mktemp("overflow") / "model.onnx"
    onnx.save(model, str(path))
    return path


def _logits(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return np.asarray(_session(path).run(["logits"], feeds)[0], np.float64)


def _feeds(path: Path) -> dict[str, np.ndarray]:
    return fastopt.make_inputs(str(path), dims={"sequence_length": 16}, seed=7)


def test_default_fp16_keeps_the_overflowing_ops_fp32(overflowing: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp16.onnx"
    r = fastopt.quantize(overflowing, out, mode="fp16")
    feeds = _feeds(overflowing)  # a seed the range check did not see
    ref, got = _logits(overflowing, feeds), _logits(out, feeds)
    assert np.isfinite(ref).all()
    assert np.isfinite(got).all(), "fp16 logits overflow"
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() >= 0.99, cos.min()
    # What was kept and why: the embedding scale, every residual Add, each past the range.
    check = r.range_check
    assert check is not None and check.samples == 4 and check.limit == LIMIT
    kept = {k.node: k for k in check.kept}
    scale = kept["/m/model/embed_tokens/Mul"]
    assert scale.op == "Mul" and scale.max_abs > FP16_MAX
    assert scale.reason.endswith("over 4 inputs") and "max |x| 1.6" in scale.reason
    residual = [k for k in check.kept if k.op == "Add" and k.node.endswith(("/Add", "/Add_1"))]
    assert len(residual) >= 6 and all(k.max_abs > FP16_MAX for k in residual)
    assert 0 < check.newly_kept == r.passes[-1].counters["nodes_kept_range"] <= len(check.kept)
    reported = r.to_dict()["range_check"]["kept"]
    assert {k["node"]: k["reason"] for k in reported}[scale.node] == scale.reason
    # The kept ops run in float32 in the output: the scaled embeddings' Mul writes float32.
    model = onnx.load(str(out))
    mul = next(n for n in model.graph.node if n.name == "/m/model/embed_tokens/Mul")
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    assert types.get(mul.output[0], TensorProto.FLOAT) == TensorProto.FLOAT


def test_ordinary_models_keep_nothing(tmp_path: Path) -> None:
    r = fastopt.quantize(GEMMA3.path, tmp_path / "fp16.onnx", mode="fp16")
    assert r.range_check is not None and r.range_check.kept == []
    assert r.range_check.observed > 100
    assert "nodes_kept_range" not in r.passes[-1].counters


def test_verify_fails_loudly_on_nan_without_the_range_check(
    overflowing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fp16.onnx"
    code = fastopt.cli.main.main(
        ["quantize", str(overflowing), "-o", str(out), "--mode", "fp16", "--fp16-ranges", "off",
         "--verify"]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert code == 1
    assert "FAILED" in text and "NaN/inf where the original's are finite" in text, text
    # The same criterion for every mode: the quantized --verify of any mode reads the outputs.
    for mode in ("fp16", "int8", "int4", "int8-dynamic"):
        report = verify_quantized(overflowing, out, mode)
        assert not report.ok and report.outputs[0].nonfinite == report.outputs[0].size > 0
    # optimize --quantize --verify: exit 1 with the message too.
    code = fastopt.cli.main.main(
        ["optimize", str(overflowing), "-o", str(tmp_path / "o.onnx"), "--passes",
         "eliminate_dead_nodes", "--quantize", "fp16", "--fp16-ranges", "off", "--verify"]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert code == 1 and "NaN/inf" in text, text


def test_optimize_verify_names_nan_outputs(overflowing: Path, tmp_path: Path) -> None:
    """fastopt.verify.core (optimize --verify): NaN/inf where the original is finite is its own
    failure message, not a tolerance miss."""
    out = tmp_path / "fp16.onnx"
    fastopt.quantize(overflowing, out, mode="fp16", fp16_ranges=False, keep_io_types=True)
    with pytest.raises(fastopt.VerifyError, match="NaN/inf where the original's are finite"):
        fastopt.verify(overflowing, out, dims={"sequence_length": 16})


def test_collector_measures_max_abs_and_skips_mask_fills() -> None:
    """Exact max |x| per value; a mask's finfo.min fill is no magnitude; NaN is not counted."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "k"], ["big"]),
            helper.make_node("Add", ["big", "mask"], ["masked"]),
            helper.make_node("Sqrt", ["x"], ["root"]),  # NaN for negative x
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [
            helper.make_tensor_value_info("masked", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("root", TensorProto.FLOAT, [2, 3]),
        ],
        [
            numpy_helper.from_array(np.array(1000.0, np.float32), "k"),
            numpy_helper.from_array(np.array([0, 0, np.finfo(np.float32).min], np.float32), "mask"),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = fastopt.load_bytes(proto.SerializeToString())
    x1 = np.array([[1, -2, 3], [4, 5, -6]], np.float32)
    x2 = np.array([[-70, 0, 0], [0, 0, 0]], np.float32)
    r = collect_ranges(model, [{"x": x1}, {"x": x2}])
    assert r.samples == 2
    assert r.max_abs["x"] == 70.0
    assert r.max_abs["big"] == 70000.0
    assert r.max_abs["masked"] == 70000.0  # the -3.4e38 fill is past SENTINEL: not counted
    assert np.finfo(np.float32).max > SENTINEL
    assert r.max_abs["root"] == pytest.approx(np.sqrt(5.0))  # NaNs of sqrt(-x) not counted


def test_clamped_values_are_a_warning_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = np.array([1e6, -3.0e38, 70000.0, 1.0], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(big, "c")],
    )
    src = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    # (with the range check the Add reading them stays float32, and nothing clamps)
    code = fastopt.cli.main.main(
        ["quantize", str(src), "-o", str(tmp_path / "h.onnx"), "--mode", "fp16",
         "--fp16-ranges", "off"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("warning: 3 ")]
    assert len(warnings) == 1 and "clamped to ±65504" in warnings[0], err


def test_generation_verify_names_nan_logits(overflowing: Path, tmp_path: Path) -> None:
    """optimize --kv-cache --verify compares greedy generation: NaN logits fail it by name
    (max(err, nan) used to keep the old error, so only a token difference could fail)."""
    from fastopt.quant.settings import QuantSettings
    from fastopt.verify.generation import verify_generation

    out = tmp_path / "cached.onnx"
    fastopt.optimize(
        overflowing,
        preset="llm",
        output=out,
        kv_cache="standard",
        quantize=QuantSettings(mode="fp16", keep_io_types=True, fp16_ranges=False),
    )
    with pytest.raises(fastopt.VerifyError, match="NaN/inf where the original's are finite"):
        verify_generation(str(overflowing), str(out), steps=2)


def test_collector_with_large_constant_nodes() -> None:
    """A Constant node's tensor over the skeleton's threshold cannot be handed to ORT as an
    initializer: the skeleton is bound back to the weights instead; the numbers are the same."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 32)).astype(np.float32)  # 2 KB: a skeleton placeholder
    c = (rng.standard_normal(512) * 100).astype(np.float32)  # 2 KB in a Constant node
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c, "c")),
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            helper.make_node("Reshape", ["y", "shape"], ["flat"]),
            helper.make_node("Add", ["flat", "c"], ["z"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [512])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([512]), "shape")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = fastopt.load_bytes(proto.SerializeToString())
    x = rng.standard_normal((1, 16, 16)).astype(np.float32)
    r = collect_ranges(model, [{"x": x}])
    y = (x @ w).reshape(-1)
    assert r.max_abs["y"] == pytest.approx(np.abs(y).max(), rel=1e-6)
    assert r.max_abs["z"] == pytest.approx(np.abs(y + c).max(), rel=1e-6)


def test_a_model_ort_cannot_measure_converts_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An input without a shape: no sample inputs, so no ranges; the conversion goes on and
    says what it did not check."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    src = tmp_path / "noshape.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    code = fastopt.cli.main.main(
        ["quantize", str(src), "-o", str(tmp_path / "h.onnx"), "--mode", "fp16"]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert "warning: fp16 range check skipped: " in err and "no shape" in err, err
    r = fastopt.quantize(src, tmp_path / "h2.onnx", mode="fp16")
    assert r.range_check is not None and r.range_check.skipped and not r.range_check.kept


def test_collector_reads_external_data_in_place(tmp_path: Path) -> None:
    """Weights in external data files are read from those files (hard links beside the
    instrumented graph, which ORT maps), with the same numbers as the inline model."""
    inline = fastopt.load(GEMMA3.path)
    path = tmp_path / "ext" / "model.onnx"
    inline.save(path, external_data=True)
    external = fastopt.load(path)
    assert any(t.external_location for t in external.graph.initializers)
    feeds = [_feeds(GEMMA3.path)]
    want = collect_ranges(inline, feeds).max_abs
    got = collect_ranges(external, feeds, workdir=str(tmp_path)).max_abs
    assert got == want and len(got) > 100
    assert [p.name for p in tmp_path.iterdir()] == ["ext"]  # the links are gone


def test_a_float16_model_is_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing float32 to convert: nothing is measured, and ONNX Runtime is not started."""
    import importlib

    def no_ort() -> None:
        raise AssertionError("ONNX Runtime was started")

    # (the module, not fastopt.verify.check the function)
    monkeypatch.setattr(importlib.import_module("fastopt.verify.check"), "onnxruntime", no_ort)
    h = TensorProto.FLOAT16
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", h, [2])],
        [helper.make_tensor_value_info("y", h, [2])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    r = collect_ranges(fastopt.load_bytes(proto.SerializeToString()))
    assert r.max_abs == {}
