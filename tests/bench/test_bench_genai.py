"""`fastopt bench` and `fastopt check` on an onnxruntime-genai model builder folder: its past
inputs name the head size `kv_cache_dim` (symbolic), which bench takes from genai_config.json
beside the model or, without it, from the GroupQueryAttention attributes and projections.
The model is a 2-layer Qwen2 with random weights, hidden size 64, shipped in
tests/fixtures/genai (made by tests/fixtures/make_genai_fixtures.py: building it needs torch,
transformers and the builder, which the test requirements leave out)."""

from __future__ import annotations

import shutil
from pathlib import Path

import fastopt
import fastopt.bench
import fastopt.cli.main
import pytest
from support.paths import TESTS

GENAI_FOLDER = TESTS / "fixtures" / "genai" / "qwen2_builder_fp32"


@pytest.fixture(scope="module")
def genai_folder() -> Path:
    assert (GENAI_FOLDER / "model.onnx").is_file() and (
        GENAI_FOLDER / "genai_config.json"
    ).is_file()
    return GENAI_FOLDER


def test_the_builder_leaves_the_head_size_symbolic(genai_folder: Path) -> None:
    model = fastopt.load(genai_folder / "model.onnx")
    past = next(v for v in model.graph.inputs if v is not None and v.name.startswith("past"))
    assert isinstance(past.shape[3], str), past.shape  # else this test tests nothing


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_bench_runs_with_genai_config(genai_folder: Path, phase: str) -> None:
    r = fastopt.bench.run(genai_folder / "model.onnx", phase=phase, seq=16, runs=2, warmup=1)
    assert r.kind == "decoder_cache"
    past = 16 if phase == "decode" else 0
    assert r.inputs["past_key_values.0.key"] == f"float32[1, 2, {past}, 16]"


def test_bench_without_genai_config_reads_the_graph(genai_folder: Path, tmp_path: Path) -> None:
    lone = tmp_path / "lone"
    lone.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(genai_folder / name, lone / name)
    r = fastopt.bench.run(lone / "model.onnx", phase="decode", seq=8, runs=1, warmup=0)
    assert r.inputs["past_key_values.1.value"] == "float32[1, 2, 8, 16]"


def test_cli_bench_and_check(genai_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(genai_folder / "model.onnx")
    code = fastopt.cli.main.main(["bench", model, "--phase", "decode", "--seq", "8", "--runs", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "decode" in out and "Traceback" not in out + err
    code = fastopt.cli.main.main(["check", model])
    out, err = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in out + err
    assert "onnxruntime" in out and "ok" in out  # ORT loads it, whatever onnx.checker says
