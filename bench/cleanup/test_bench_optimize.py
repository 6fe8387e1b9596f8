"""pytest-benchmark: fastopt.optimize(preset="classic") vs onnxscript's optimizer on one corpus
model (llama_ts_nocache when present). Skips when ../shared/corpus is absent; the onnxscript
benchmarks skip when onnxscript is not installed.

    pytest bench/cleanup/test_bench_optimize.py --benchmark-only
    pytest bench/cleanup/test_bench_optimize.py --benchmark-only --benchmark-compare  # vs saved

Two groups, so that like is compared with like:
- `optimize-file`: path in, file out (fastopt.optimize(path, output=...) vs onnx.load +
  onnxscript.optimizer.optimize + onnx.save);
- `optimize-call`: the call on an already loaded model (fastopt.optimize(Model) vs
  onnxscript.optimizer.optimize(ModelProto)); loading happens in the untimed setup.

bench_peers_cleanup.py compares more tools, each in its own process.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import onnx
import pytest

CORPUS_DIR = Path(__file__).resolve().parents[3] / "shared" / "corpus"
PREFERRED = "llama_ts_nocache"
ROUNDS = 5

Setup = Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]


@pytest.fixture(scope="module")
def fastopt() -> ModuleType:
    return pytest.importorskip("fastopt")


@pytest.fixture(scope="module")
def onnxscript_optimizer() -> ModuleType:
    return pytest.importorskip("onnxscript.optimizer")


@pytest.fixture(scope="module")
def corpus_model() -> str:
    models = sorted(CORPUS_DIR.glob("*/model.onnx"))
    if not models:
        pytest.skip(f"no corpus models in {CORPUS_DIR}")
    preferred = CORPUS_DIR / PREFERRED / "model.onnx"
    return str(preferred if preferred in models else models[0])


def _out_in(tmp_path: Path) -> Callable[[], Path]:
    """A new output path per round: nothing is overwritten, no round cleans up another's."""
    counter = iter(range(1_000_000))
    return lambda: tmp_path / f"out{next(counter)}.onnx"


def _nodes(path: str | Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)


# --- optimize-file: path in, file out --------------------------------------------------------


@pytest.mark.benchmark(group="optimize-file")
def test_fastopt_optimize_file(
    benchmark: Any, fastopt: ModuleType, corpus_model: str, tmp_path: Path
) -> None:
    new_out = _out_in(tmp_path)

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (corpus_model,), {"preset": "classic", "output": new_out()}

    report = benchmark.pedantic(fastopt.optimize, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    assert report.nodes_after <= report.nodes_before
    assert report.output is not None
    assert _nodes(report.output) == report.nodes_after


@pytest.mark.benchmark(group="optimize-file")
def test_onnxscript_optimize_file(
    benchmark: Any, onnxscript_optimizer: ModuleType, corpus_model: str, tmp_path: Path
) -> None:
    new_out = _out_in(tmp_path)

    def run(src: str, dst: Path) -> Path:
        onnx.save(onnxscript_optimizer.optimize(onnx.load(src)), str(dst))
        return dst

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (corpus_model, new_out()), {}

    out = benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    assert _nodes(out) <= _nodes(corpus_model)


# --- optimize-call: the call on a loaded model ------------------------------------------------


@pytest.mark.benchmark(group="optimize-call")
def test_fastopt_optimize_call(benchmark: Any, fastopt: ModuleType, corpus_model: str) -> None:
    # fastopt optimizes a Model in place: every round gets a freshly loaded one
    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (fastopt.load(corpus_model),), {"preset": "classic"}

    report = benchmark.pedantic(fastopt.optimize, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    assert report.nodes_after <= report.nodes_before


@pytest.mark.benchmark(group="optimize-call")
def test_onnxscript_optimize_call(
    benchmark: Any, onnxscript_optimizer: ModuleType, corpus_model: str
) -> None:
    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (onnx.load(corpus_model),), {}

    out = benchmark.pedantic(
        onnxscript_optimizer.optimize, setup=setup, rounds=ROUNDS, warmup_rounds=1
    )
    assert len(out.graph.node) <= _nodes(corpus_model)
