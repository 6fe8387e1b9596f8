"""The project's own LLM fixtures (tests/fixtures/make_fixtures.py: real torch.onnx exports of
9 architectures with both exporters, fp32 and fp16): each round-trips exactly, and the
`default` preset keeps ONNX Runtime outputs within tolerance and passes onnx.checker."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import onnx
import pytest
from support.llm_fixtures import Fixture, matrix_fixtures, matrix_params
from support.paths import TESTS

FIXTURES = sorted((TESTS / "fixtures" / "models").glob("*/model.onnx"))
CACHE_DIMS = {
    "batch_size": 2,
    "sequence_length": 3,
    "past_sequence_length": 5,
    "past_window_length": 3,
    "total_sequence_length": 8,
}


def test_fixture_set_is_complete() -> None:
    archs = {json.loads((p.parent / "meta.json").read_text())["arch"] for p in FIXTURES}
    assert archs == {
        "llama",
        "mistral",
        "mixtral",
        "qwen2_moe",
        "olmoe",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma",
        "gemma3",
        "gemma2",
        "gpt2",
        "gpt_neox",
        "bert",
        "clip",
        "gptj",
        "cohere",
        "glm",
        "glm4",
        "phi3_longrope",
        "opt",
        "bloom",
        "mpt",
        "falcon",
        "nemotron",
        "modernbert",
        "deberta_v2",
    }
    exporters = {json.loads((p.parent / "meta.json").read_text())["exporter"] for p in FIXTURES}
    assert exporters == {"ts", "dynamo"}


@pytest.mark.parametrize("path", FIXTURES, ids=[p.parent.name for p in FIXTURES])
def test_fixture_roundtrip_and_classic_preset(path: Path, tmp_path: Path) -> None:
    same = tmp_path / "same.onnx"
    fastopt.load(path).save(same)
    assert onnx.load(str(same)) == onnx.load(str(path))
    out = tmp_path / "opt.onnx"
    # classic: standard ops only, so onnx.checker holds (the default preset's LLM fusions write
    # ORT contrib ops; test_llm_preset.py covers them)
    report = fastopt.optimize(path, preset="classic", output=out)
    assert report.nodes_after < report.nodes_before
    onnx.checker.check_model(str(out), full_check=True)
    # dtype-aware tolerances (fp32 1e-4, fp16 1e-2); a cached export's lengths must agree
    # (total = past + new; a sliding-window layer's past holds at most window - 1 rows)
    cached = json.loads((path.parent / "meta.json").read_text()).get("cache", False)
    fastopt.verify(path, out, dims=CACHE_DIMS if cached else None)


@pytest.mark.parametrize("fx", matrix_params("classic", matrix_fixtures(cache_export=None)))
def test_matrix_fixture_roundtrip_and_classic_preset(fx: Fixture, tmp_path: Path) -> None:
    """The same on the version matrix (tests/fixtures/matrix)."""
    test_fixture_roundtrip_and_classic_preset(fx.path, tmp_path)
