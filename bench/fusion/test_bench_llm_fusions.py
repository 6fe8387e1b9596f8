"""pytest-benchmark: `fastopt optimize --preset llm` on one LLM fixture (llama, dynamo export,
float32), path in, file out, in-process.

    pytest bench/fusion/test_bench_llm_fusions.py --benchmark-only
    pytest bench/fusion/test_bench_llm_fusions.py --benchmark-only --benchmark-compare  # vs saved

bench_llm_fusions.py compares against the peers, each in its own process; the checks below
(skipped by --benchmark-only) run that script end to end on one fixture, the suite summary on
its report, the merge of two runs of one model, and the RSS limit of a tool run.
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
sys.path.insert(0, str(HERE.parent))  # bench/: _benchlib
from _benchlib import spawn  # noqa: E402
from bench_llm_fusions import merge_reports  # noqa: E402

FIXTURE = HERE.parents[1] / "tests" / "fixtures" / "models" / "llama_dynamo_float32" / "model.onnx"
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


SMOKE_TOOLS = ("fastopt", "onnxslim", "onnxoptimizer", "ort_offline")


def test_bench_script_smoke(fastopt: ModuleType, tmp_path: Path) -> None:
    """The whole script on one fixture, fastopt and three peers, 2 latency runs; then the
    suite summary of its report."""
    pytest.importorskip("onnxslim")
    pytest.importorskip("onnxoptimizer")
    out = tmp_path / "llm.md"
    cmd = [sys.executable, str(HERE / "bench_llm_fusions.py"), "--models", "llama_dynamo_float32",
           "--tools", ",".join(SMOKE_TOOLS), "--skip-large", "--runs", "2", "--warmup", "1",
           "--seq", "16", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    report = json.loads(out.with_suffix(".json").read_text())
    m = report["models"]["llama_dynamo_float32"]
    assert m["layers"] == 2
    for tool in SMOKE_TOOLS:
        assert m["timing"][tool]["runs"] == 1, m["timing"][tool]
        assert m["check"]["tools"][tool]["ort"] == "ok"
        assert m["check"]["tools"][tool]["max_abs"] <= 1e-4
        assert tool in m["latency"]["ms"]
    assert "## Fused ops" in out.read_text()

    suite = tmp_path / "suite.md"
    cmd = [sys.executable, str(HERE / "summarize_suite.py"), str(out.with_suffix(".json")),
           "--out", str(suite)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    text = suite.read_text()
    assert "| onnxslim | 1 |" in text  # one fixture timed
    assert "| onnxoptimizer | 0/1 | 1/1 | 1/1 | 1/1 |" in text  # validity
    assert "onnxslim 0." in text  # its version in the header


def _run_report(tools: list[str], ratio: float, date: str) -> dict[str, Any]:
    lat = {
        "ms": {"original": {"median": 10.0}, **{t: {"median": 10.0 * ratio} for t in tools}},
        "ratio": dict.fromkeys(tools, ratio),
        "errors": {},
        "groups": 1,
        "original_ms_per_group": [10.0],
    }
    model = {
        "bytes": 1,
        "timing": {t: {"runs": 1, "optimize_s": ratio, "peak_rss": 1} for t in tools},
        "check": {"original": {"nodes": 9}, "tools": {t: {"nodes": 5} for t in tools}},
        "latency": lat,
    }
    settings = {"runs": 20, "warmup": 3, "seq": 128, "repeat": 1, "timeout": 300, "total_s": 60}
    env = {"date": date, "versions": {}}
    return {"environment": env, "command": date, "tools": tools, **settings, "models": {"m": model}}


def test_merge_keeps_other_tools(tmp_path: Path) -> None:
    """A later run of one model with other tools adds them; the earlier tools stay, and a tool
    in both takes the later figures (latency ratios come from their own run)."""
    first = tmp_path / "a.json"
    later = tmp_path / "b.json"
    first.write_text(json.dumps(_run_report(["fastopt", "onnxscript"], 0.5, "d1")))
    later.write_text(json.dumps(_run_report(["onnxscript", "onnxslim"], 0.9, "d2")))
    m = merge_reports([str(first), str(later)])["models"]["m"]
    assert m["timing"]["fastopt"]["optimize_s"] == 0.5
    assert m["timing"]["onnxscript"]["optimize_s"] == 0.9
    assert set(m["check"]["tools"]) == {"fastopt", "onnxscript", "onnxslim"}
    assert m["latency"]["ratio"] == {"fastopt": 0.5, "onnxscript": 0.9, "onnxslim": 0.9}
    assert m["latency"]["original_ms_per_group"] == [10.0, 10.0]


def test_spawn_stops_a_child_over_the_rss_limit() -> None:
    grow = "b = b'x' * (400 << 20); import time; time.sleep(30)"
    rc, wall, peak, _, _ = spawn([sys.executable, "-c", grow], 60, max_rss=100 << 20)
    assert rc == -9 and wall < 30 and peak > 100 << 20
