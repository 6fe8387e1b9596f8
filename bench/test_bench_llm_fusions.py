"""pytest-benchmark: `fastopt optimize --preset llm` on one LLM fixture (llama, dynamo export,
float32), path in, file out, in-process.

    pytest bench/test_bench_llm_fusions.py --benchmark-only
    pytest bench/test_bench_llm_fusions.py --benchmark-only --benchmark-compare   # vs a saved run

bench_llm_fusions.py compares against the peers, each in its own process; the check below
(skipped by --benchmark-only) runs that script end to end on one fixture.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parent / "tests" / "fixtures" / "models" / "llama_dynamo_float32" / "model.onnx"
ROUNDS = 5


@pytest.fixture(scope="module")
def fastopt() -> ModuleType:
    return pytest.importorskip("fastopt")


@pytest.mark.benchmark(group="optimize-llm")
def test_fastopt_llm_preset(benchmark: Any, fastopt: ModuleType, tmp_path: Path) -> None:
    counter = iter(range(1_000_000))

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (str(FIXTURE),), {"preset": "llm", "output": tmp_path / f"{next(counter)}.onnx"}

    report = benchmark.pedantic(fastopt.optimize, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    assert report.nodes_after <= report.nodes_before
    assert report.output is not None and Path(report.output).exists()


def test_bench_script_smoke(fastopt: ModuleType, tmp_path: Path) -> None:
    """The whole script on one fixture, fastopt and ORT offline, 2 latency runs."""
    out = tmp_path / "llm.md"
    cmd = [sys.executable, str(HERE / "bench_llm_fusions.py"), "--models", "llama_dynamo_float32",
           "--tools", "fastopt,ort_offline", "--skip-large", "--runs", "2", "--warmup", "1",
           "--seq", "16", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    report = json.loads(out.with_suffix(".json").read_text())
    m = report["models"]["llama_dynamo_float32"]
    assert m["layers"] == 2
    for tool in ("fastopt", "ort_offline"):
        assert m["timing"][tool]["runs"] == 1, m["timing"][tool]
        assert m["check"]["tools"][tool]["ort"] == "ok"
        assert tool in m["latency"]["ms"]
    assert "## Fused ops" in out.read_text()
