"""The coverage-regression guard (issue 27): what the `llm` preset fuses and leaves for each
target, and whether the KV-cache rewrite is accepted (or why not), on every LLM fixture and
the version matrix, must equal the committed tests/fixtures/coverage.json. A change that loses
a fusion or a cache fails here with the diff; after an intended improvement, regenerate the
table (`python tests/support/coverage_table.py --write`) and commit it."""

from __future__ import annotations

import json

import pytest
from support import coverage_table as ct
from support.llm_fixtures import fixtures, matrix_fixtures
from support.seq2seq_generation import matrix_seq2seq_fixtures


def test_coverage_table_unchanged() -> None:
    expected = json.loads(ct.TABLE.read_text())
    lines = ct.diff(expected, ct.compute())
    assert not lines, (
        "coverage changed (expected -> now); if intended, run "
        "`python tests/support/coverage_table.py --write` and commit the table:\n"
        + "\n".join(lines)
    )


def test_guard_fails_on_a_lost_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard can fail: with fuse_rotary dropped from the llm preset, a fixture of models/ and
    one of the matrix differ from the table, and the diff names the lost RotaryEmbedding and the
    Sin/Cos/Neg left behind, per target."""
    import fastopt.pipeline.registry as registry

    items = fixtures(arch="llama", exporter="ts", dtype="float32")
    items += matrix_fixtures(release="5.0.0", arch="qwen2", exporter="dynamo", dtype="float32")
    table = json.loads(ct.TABLE.read_text())
    expected = {fx.name: table[fx.name] for fx in items}
    assert ct.diff(expected, ct.compute(items)) == []
    llm = [p for p in registry.PRESETS["llm"] if p != "fuse_rotary"]
    monkeypatch.setitem(registry.PRESETS, "llm", llm)
    lines = ct.diff(expected, ct.compute(items))
    assert [line.split(":")[0] for line in lines] == [
        "llama_ts_float32.onnx",
        "llama_ts_float32.ort",
        "qwen2_dynamo_float32.tf5.0.0.onnx",
        "qwen2_dynamo_float32.tf5.0.0.ort",
    ]
    for line in lines:
        before, after = (json.loads(side) for side in line.split(": ", 1)[1].split(" -> "))
        assert before["fused"]["RotaryEmbedding"] == 4 and "RotaryEmbedding" not in after["fused"]
        assert {"Sin", "Cos", "Neg"} <= set(after["residue"])


def test_guard_fails_on_a_lost_seq2seq_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on a matrix encoder-decoder (whisper, transformers 4.49): without fuse_attention
    both graphs lose their attentions for both targets (Softmax left) and the decoder's seq2seq
    cache is refused; the diff names each graph and cache mode."""
    import fastopt.pipeline.registry as registry

    items = matrix_seq2seq_fixtures(release="4.49.0", arch="whisper", exporter="dynamo")
    table = json.loads(ct.TABLE.read_text())
    expected = {fx.name: table[fx.name] for fx in items}
    assert ct.diff(expected, ct.compute(items)) == []
    llm = [p for p in registry.PRESETS["llm"] if p != "fuse_attention"]
    monkeypatch.setitem(registry.PRESETS, "llm", llm)
    lines = ct.diff(expected, ct.compute(items))
    name = "whisper_dynamo_float32.tf4.49.0"
    assert [line.split(": ")[0] for line in lines] == [
        f"{name}.decoder.onnx",
        f"{name}.decoder.ort",
        f"{name}.encoder.onnx",
        f"{name}.encoder.ort",
        f"{name}.kv_inplace",
        f"{name}.kv_standard",
    ]
    for line in lines[:4]:
        before, after = (json.loads(side) for side in line.split(": ", 1)[1].split(" -> "))
        assert "Softmax" not in before["residue"] and "Softmax" in after["residue"], line
    assert all('"ok" -> "refused: ' in line for line in lines[4:]), lines[4:]
