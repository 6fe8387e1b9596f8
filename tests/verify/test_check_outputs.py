"""`fastopt check` passes everything fastopt writes (issue 28): every preset x target output of
the fixtures, the KV-cache and quantized outputs. ORT's own ops (SimplifiedLayerNormalization in
the ONNX domain, com.microsoft contrib ops) are judged against ONNX Runtime's schemas and the
report says the model runs in ONNX Runtime only; a broken ORT op still fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fastopt
import fastopt.cli.main
import onnx
import pytest
from support.paths import TESTS

MODELS = TESTS / "fixtures" / "models"
PRESETS = ("default", "llm", "classic", "cleanup")
TARGETS = ("ort", "onnx")
# One of each kind in the default run (decoders of both exporters and dtypes, an encoder, MoE,
# an encoder-decoder's two graphs); every fixture with -m slow.
SAMPLE = [
    "llama_ts_float32/model.onnx",
    "qwen3_dynamo_float16/model.onnx",
    "gemma3_ts_float32/model.onnx",
    "gpt2_ts_float32/model.onnx",
    "bert_dynamo_float32/model.onnx",
    "mixtral_ts_float32/model.onnx",
    "t5_dynamo_float32/decoder.onnx",
    "whisper_ts_float32/encoder.onnx",
]
EVERY = sorted(str(p.relative_to(MODELS)) for p in MODELS.glob("*/*.onnx"))
# fastopt's other outputs of a decoder: the KV-cache forms and the quantization modes.
DECODER_OUTPUTS: list[tuple[str, dict[str, Any]]] = [
    ("kv-standard", {"preset": "llm", "kv_cache": "standard"}),
    ("kv-standard-onnx", {"preset": "llm", "kv_cache": "standard", "target": "onnx"}),
    ("kv-inplace-int4", {"preset": "llm", "kv_cache": "inplace", "quantize": "int4"}),
    ("int8", {"preset": "llm", "quantize": "int8"}),
    ("int8-dynamic", {"preset": "llm", "quantize": "int8-dynamic"}),
    ("fp16", {"preset": "llm", "quantize": "fp16"}),
]


def optimized(tmp_path: Path, source: str, **kwargs: Any) -> Path:
    out = tmp_path / "out" / "model.onnx"
    mode = kwargs.pop("quantize", None)
    if mode is not None:
        kwargs["quantize"] = fastopt.QuantSettings(mode=mode)
    fastopt.optimize(str(MODELS / source), output=str(out), **kwargs)
    return out


def assert_passes(path: Path, target: str) -> fastopt.CheckReport:
    report = fastopt.check(path)  # raises CheckError on any failed stage
    assert [s.status for s in report.stages] == ["ok"] * 3, str(report)
    if target == "onnx":
        assert not report.ort_only, str(report)  # standard ONNX: nothing of ORT's
    return report


def _every_preset_and_target(tmp_path: Path, source: str) -> None:
    for preset in PRESETS:
        for target in TARGETS:
            out = optimized(tmp_path / f"{preset}-{target}", source, preset=preset, target=target)
            assert_passes(out, target)


@pytest.mark.parametrize("source", SAMPLE)
def test_outputs_of_every_preset_and_target_pass(tmp_path: Path, source: str) -> None:
    _every_preset_and_target(tmp_path, source)


@pytest.mark.slow
@pytest.mark.parametrize("source", [s for s in EVERY if s not in SAMPLE])
def test_outputs_of_every_fixture_pass(tmp_path: Path, source: str) -> None:
    _every_preset_and_target(tmp_path, source)


@pytest.mark.parametrize("label,kwargs", DECODER_OUTPUTS, ids=[d[0] for d in DECODER_OUTPUTS])
def test_kv_cache_and_quantized_outputs_pass(
    tmp_path: Path, label: str, kwargs: dict[str, Any]
) -> None:
    out = optimized(tmp_path, "llama_ts_float32/model.onnx", **kwargs)
    assert_passes(out, kwargs.get("target", "ort"))


def test_default_output_is_reported_ort_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's optimize output: SimplifiedLayerNormalization in the ONNX domain plus
    contrib ops; `fastopt check` exits 0 and says the model runs in ONNX Runtime only."""
    out = optimized(tmp_path, "llama_ts_float32/model.onnx")
    report = assert_passes(out, "ort")
    assert report.runtime_ops["SimplifiedLayerNormalization"] >= 1
    assert report.runtime_ops["com.microsoft::GroupQueryAttention"] == 2
    assert report.to_dict()["ort_only"] is True
    assert fastopt.cli.main.main(["check", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "check passed" in printed
    assert "runs in ONNX Runtime only" in printed and "SimplifiedLayerNormalization" in printed
    # standard ONNX says nothing of the kind
    standard = assert_passes(
        optimized(tmp_path / "onnx", "llama_ts_float32/model.onnx", target="onnx"), "onnx"
    )
    assert "ONNX Runtime only" not in str(standard)


@pytest.mark.parametrize("damage", ["drop_scale", "unknown_attribute", "float_axis"])
def test_a_broken_ort_op_still_fails(tmp_path: Path, damage: str) -> None:
    """ORT's schema of SimplifiedLayerNormalization is what the checker applies: a node that
    breaks it fails the checker stage (and ORT's load), naming the node's op."""
    proto = onnx.load(str(optimized(tmp_path, "llama_ts_float32/model.onnx")))
    node = next(n for n in proto.graph.node if n.op_type == "SimplifiedLayerNormalization")
    if damage == "drop_scale":
        del node.input[1]
    elif damage == "unknown_attribute":
        node.attribute.append(onnx.helper.make_attribute("bogus", 1))
    else:
        for a in node.attribute:
            if a.name == "axis":
                a.CopyFrom(onnx.helper.make_attribute("axis", -1.0))
    with pytest.raises(fastopt.CheckError) as caught:
        fastopt.check(proto)
    assert caught.value.report.failed[0].name == "checker"
    assert "SimplifiedLayerNormalization" in str(caught.value)
    if damage != "unknown_attribute":  # ORT's load only warns about an unknown attribute
        assert caught.value.report.stage("onnxruntime").status == "failed"


def test_the_schemas_are_onnxs_only_during_a_check(tmp_path: Path) -> None:
    """ORT's schemas are lent to onnx for the check and taken back after it."""
    out = optimized(tmp_path, "llama_ts_float32/model.onnx")
    assert not onnx.defs.has("SimplifiedLayerNormalization")
    assert fastopt.check(out).runtime_ops["SimplifiedLayerNormalization"] >= 1
    assert not onnx.defs.has("SimplifiedLayerNormalization")
