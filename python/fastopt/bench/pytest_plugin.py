"""pytest plugin (entry point ``pytest11``): the ``ort_benchmark`` fixture, an ONNX Runtime
benchmark timed by pytest-benchmark, so its statistics, ``--benchmark-compare`` and
``--benchmark-json`` work as for any benchmark::

    def test_decode(ort_benchmark):
        result = ort_benchmark("model.onnx", provider="cuda", phase="decode", seq=128)
        assert result.kind == "decoder_cache"

A provider this onnxruntime lacks or cannot start (``provider="cuda"`` on a machine without
CUDA) skips the test, saying why, as a test that needs a GPU is skipped without one; ``"auto"``
takes CUDA where it runs and the CPU elsewhere. The session and inputs are prepared outside the
timed function; only the run is timed. The JSON's ``extra_info`` says what ran (provider, kind,
phase, batch, seq, tokens per run, tokens/s at the median). pytest loads this module in every
run of every project in the environment: it imports neither onnxruntime nor pytest-benchmark
itself (the fixture asks for pytest-benchmark's ``benchmark`` fixture only when used).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest


def _benchmark_fixture(request: pytest.FixtureRequest) -> Any:
    try:
        return request.getfixturevalue("benchmark")
    except pytest.FixtureLookupError:
        pass  # failed outside the handler: the lookup error would only clutter the report
    pytest.fail("ort_benchmark needs pytest-benchmark: pip install pytest-benchmark", pytrace=False)


@pytest.fixture
def ort_benchmark(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """A function ``(model, *, provider="auto", phase="prefill", batch=1, seq=128,
    rounds=20, warmup_rounds=3, **options) -> BenchResult`` that benchmarks `model` with
    pytest-benchmark (once per test; options as :func:`fastopt.bench.run`). The result's
    stats are pytest-benchmark's samples (one run each)."""
    benchmark = _benchmark_fixture(request)
    used = False

    def measure(
        model: Any,
        *,
        provider: str = "auto",
        phase: str = "prefill",
        batch: int = 1,
        seq: int = 128,
        rounds: int = 20,
        warmup_rounds: int = 3,
        **options: Any,
    ) -> Any:
        nonlocal used
        if used:
            raise RuntimeError("ort_benchmark can be called once per test (as `benchmark`)")
        used = True
        from fastopt.bench.harness import result_of
        from fastopt.bench.session import ProviderUnavailableError, Runner
        from fastopt.bench.timing import measure as time_runs

        try:
            opened = Runner(model, provider=provider, phase=phase, batch=batch, seq=seq, **options)
        except ProviderUnavailableError as e:
            pytest.skip(f"ort_benchmark: {e}")
        with opened as runner:
            benchmark.pedantic(runner.step, rounds=rounds, warmup_rounds=warmup_rounds)
            stats = getattr(benchmark, "stats", None)
            times = list(stats.stats.data) if stats is not None else []
            if not times:  # --benchmark-disable: pytest-benchmark ran it once, untimed
                times = time_runs(runner.step, runs=1, warmup=0)
            result = result_of(runner, None, times, options.get("threads"))
        benchmark.extra_info.update(
            {
                "provider": result.provider,
                "kind": result.kind,
                "phase": result.phase,
                "batch": result.batch,
                "seq": result.seq,
                "tokens": result.tokens,
                "tokens_per_s": result.tokens_per_s,
                "io_binding": result.io_binding,
                "cuda_graph": result.cuda_graph,
                "note": result.note,
            }
        )
        return result

    return measure
