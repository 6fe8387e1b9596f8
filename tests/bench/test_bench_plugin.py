"""The ort_benchmark pytest plugin, run in pytest subprocesses on a tiny test file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.bench_models import cached_decoder

pytest_plugins = ["pytester"]

TEST_FILE = """
MODEL = {model!r}

def test_decode(ort_benchmark):
    result = ort_benchmark(MODEL, provider="cpu", phase="decode", seq=16, rounds=5,
                           warmup_rounds=1)
    assert result.kind == "decoder_cache"
    assert result.stats.runs == {runs}

def test_plain():
    assert True
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_decoder(tmp_path_factory.mktemp("plugin") / "standard", "standard")


def test_json_carries_extra_info(pytester: pytest.Pytester, model: Path) -> None:
    pytester.makepyfile(test_it=TEST_FILE.format(model=str(model), runs=5))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-json=out.json")
    result.assert_outcomes(passed=2)
    doc = json.loads((pytester.path / "out.json").read_text())
    (entry,) = doc["benchmarks"]
    assert entry["name"] == "test_decode"
    assert entry["stats"]["rounds"] == 5
    info = entry["extra_info"]
    assert info["provider"] == "CPUExecutionProvider"
    assert (info["phase"], info["batch"], info["seq"], info["tokens"]) == ("decode", 1, 16, 1)
    assert info["tokens_per_s"] == pytest.approx(1 / entry["stats"]["median"])


def test_benchmark_disabled(pytester: pytest.Pytester, model: Path) -> None:
    pytester.makepyfile(test_it=TEST_FILE.format(model=str(model), runs=1))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--benchmark-disable")
    result.assert_outcomes(passed=2)


def test_without_pytest_benchmark(pytester: pytest.Pytester, model: Path) -> None:
    """pytest runs as usual without pytest-benchmark; only the fixture's users fail (at set-up),
    saying what to install."""
    pytester.makepyfile(test_it=TEST_FILE.format(model=str(model), runs=5))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:benchmark")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ort_benchmark needs pytest-benchmark*"])


def test_plugin_import_is_light() -> None:
    code = "import sys, fastopt.bench.pytest_plugin; print('onnxruntime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


CUDA_TEST_FILE = """
def test_decode(ort_benchmark):
    result = ort_benchmark({model!r}, provider="cuda", phase="decode", seq=16, rounds=2)
    assert result.kind == "decoder_cache"
"""


@pytest.mark.skipif(
    "CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers(),
    reason="this onnxruntime has CUDA",
)
def test_cuda_where_there_is_none_skips_saying_why(pytester: pytest.Pytester, model: Path) -> None:
    """The README's example (provider="cuda") on a CPU-only machine: skipped, not an error."""
    pytester.makepyfile(test_it=CUDA_TEST_FILE.format(model=str(model)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*ort_benchmark: provider 'cuda' was asked for*"])
