"""``fastopt.bench``: latency, tokens/s and memory of ONNX models in ONNX Runtime, on CUDA (IO
binding, optional CUDA graphs) when present and on CPU otherwise, with inputs made for LLM
decoders (prefill and decode, with and without a KV cache, in-place caches) and encoders.

    result = fastopt.bench.run("model.onnx", phase="decode", seq=128)
    print(result.provider, result.stats.median, result.tokens_per_s)

Modules: ``inputs`` (what to feed), ``session`` (providers and binding), ``timing``,
``memory``, ``result``, ``harness`` (run / compare / sweep), ``report`` (table, JSON),
``plot`` (latency vs sequence length), ``pytest_plugin`` (the ``ort_benchmark`` fixture).
This package imports onnxruntime only when a benchmark runs.
"""

from fastopt._signatures import spell_out_aliases
from fastopt.bench.harness import compare, run, sweep
from fastopt.bench.inputs import Workload, detect_kind, make_workload
from fastopt.bench.result import BenchResult
from fastopt.bench.session import ProviderUnavailableError, Runner, resolve_device
from fastopt.bench.timing import Stats

spell_out_aliases(compare, run, sweep)

__all__ = [
    "BenchResult",
    "ProviderUnavailableError",
    "Runner",
    "Stats",
    "Workload",
    "compare",
    "detect_kind",
    "make_workload",
    "resolve_device",
    "run",
    "sweep",
]
