"""Every pass declared idempotent rewrites nothing when run again on its own output (issue 26):
the pass manager relies on it when it does not rerun such a pass while nothing changed (see
test_manager_contracts.py). Each pass of the presets runs twice, in its preset's place, on real
exports (tests/fixtures/models), the cached forms and a CNN."""

from __future__ import annotations

import fastopt
import pytest
from fastopt.pipeline.registry import PassContext, Target, default_opset, get_pass, place, preset
from support.paths import TESTS

FIXTURES = TESTS / "fixtures"
MODELS = FIXTURES / "models"
KV_MODES = {"standard": 1, "inplace": 2}

# (model, preset, target, kv_cache): decoders of each attention family, an encoder, an
# encoder-decoder half, both targets, both cached forms, and the CNN fusions.
CASES = [
    ("models/llama_dynamo_float32/model.onnx", "default", "ort", None),
    ("models/llama_ts_float32/model.onnx", "default", "onnx", None),
    ("models/gpt2_ts_float32/model.onnx", "default", "ort", "standard"),
    ("models/qwen2_dynamo_float32/model.onnx", "llm", "ort", "inplace"),
    ("models/phi3_ts_float16/model.onnx", "default", "ort", None),
    ("models/gemma2_dynamo_float32/model.onnx", "default", "ort", "standard"),
    ("models/bert_dynamo_float32/model.onnx", "default", "ort", None),
    ("models/t5_ts_float32/encoder.onnx", "default", "ort", None),
    ("models/bart_dynamo_float32/decoder.onnx", "default", "ort", "standard"),
    ("models/whisper_dynamo_float32/decoder.onnx", "default", "onnx", None),
    ("cnn/model.onnx", "classic", "ort", None),
]


def _second_runs(
    model: str, preset_name: str, target: Target, kv_cache: str | None
) -> dict[str, int]:
    """{pass: rewrites of its second run} for the idempotent passes whose second run rewrote."""
    names = preset(preset_name)
    options: dict[str, object] = {}
    if kv_cache is not None:
        names = place(names, "add_kv_cache")
        options["kv_cache"] = KV_MODES[kv_cache]
    ctx = PassContext(fastopt.load(str(FIXTURES / model)), target, options=options)
    again: dict[str, int] = {}
    first = 0
    for name in names:
        spec = get_pass(name)
        if not spec.applies_to(default_opset(ctx.model)):
            continue
        first += spec.run(ctx)
        if spec.idempotent and (n := spec.run(ctx)):
            again[name] = n
    assert first > 0  # the first runs rewrote the export (the second ones had work to redo)
    return again


@pytest.mark.parametrize("model, preset_name, target, kv_cache", CASES)
def test_idempotent_passes_rewrite_nothing_the_second_time(
    model: str, preset_name: str, target: Target, kv_cache: str | None
) -> None:
    assert _second_runs(model, preset_name, target, kv_cache) == {}


def test_convert_version_twice() -> None:
    ctx = PassContext(
        fastopt.load(str(MODELS / "gpt2_ts_float32/model.onnx")), options={"opset": 18}
    )
    spec = get_pass("convert_version")
    assert spec.idempotent and spec.run(ctx) == 1 and spec.run(ctx) == 0
