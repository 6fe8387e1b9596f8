"""Benchmarking entry points: one model, several on the same workload (interleaved), and a
sweep over sequence lengths."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

from fastopt.bench.memory import PeakRssGrowth, cuda_memory_in_use
from fastopt.bench.result import BenchResult
from fastopt.bench.session import Runner, make_session, resolve_device
from fastopt.bench.timing import Stats, interleaved
from fastopt.errors import entry_point, foreign_errors
from fastopt.verify.check import ModelLike, onnxruntime
from fastopt.verify.core import make_inputs

RUNS = 20
WARMUP = 3

_primed: set[tuple[str, int]] = set()  # the devices set up in this process
# the smallest model that makes ONNX Runtime set itself up
_TINY_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
tiny (float[1] x) => (float[1] y) { y = Relu(x) }
"""


def _prime_process(model: ModelLike, device: str, device_id: int) -> None:
    """Pays, once per process and device, the one-time costs that the first benchmark would
    otherwise carry in its memory figure (ORT's environment and thread pools, on CUDA the
    device context; first-use allocations of input synthesis): about 15 MB of RSS on CPU."""
    if (device, device_id) in _primed:
        return
    import numpy as np
    import onnx.parser

    tiny = onnx.parser.parse_model(_TINY_MODEL).SerializeToString()
    session = make_session(tiny, device, device_id=device_id)
    session.run(None, {"x": np.ones(1, np.float32)})
    with contextlib.suppress(ValueError):  # a model inputs cannot be made for fails later
        make_inputs(model)
    _primed.add((device, device_id))


def _prepare(model: ModelLike, warmup: int, options: dict[str, Any]) -> tuple[Runner, int | None]:
    """A runner, warmed up, and the memory its session creation and warm-up added."""
    device_id = int(options.get("device_id", 0))
    device = resolve_device(options["provider"], onnxruntime().get_available_providers())
    cuda_before = cuda_memory_in_use(device_id) if device == "cuda" else None
    with PeakRssGrowth() as rss:
        runner = Runner(model, **options)
        with foreign_errors(f"ONNX Runtime run of {runner.label}"):
            for _ in range(warmup):
                runner.step()
    if runner.device == "cuda":
        after = cuda_memory_in_use(device_id)
        return runner, None if after is None else after - (cuda_before or 0)
    return runner, rss.bytes


@entry_point("bench")
def compare(
    models: Sequence[ModelLike],
    *,
    runs: int = RUNS,
    warmup: int = WARMUP,
    provider: str = "auto",
    phase: str = "prefill",
    batch: int = 1,
    seq: int = 128,
    threads: int | None = None,
    cuda_graph: bool = False,
    max_length: int | None = None,
    optimization: str = "all",
    device_id: int = 0,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Benchmark `models` on the same workload, interleaved.

    Each model gets a session and inputs (same seed), `warmup` untimed runs, then `runs` timed
    runs in rotating rounds of consecutive runs per model
    (:func:`fastopt.bench.timing.interleaved`). All sessions are open at once. Memory is
    measured over each session's creation and warm-up (ONNX Runtime's one-time set-up is done
    before, so that the first model does not carry it).

    Parameters
    ----------
    models : sequence of str, os.PathLike, fastopt.Model or onnx.ModelProto
    runs, warmup, provider, phase, batch, seq, threads : as for :func:`run`
    cuda_graph, max_length, optimization, device_id, seed : as for :func:`run`
    progress : callable, optional
        ``progress(what)`` as each step starts (set-up, each model's session, the timing).

    Returns
    -------
    list of BenchResult
        One per model, in order. A decode step of a model with a KV cache and one without are
        not the same work (``fastopt.bench.report.work`` says what each computed).

    Raises
    ------
    fastopt.ModelError, ValueError
        As for :func:`run`.
    """
    say = progress or (lambda what: None)
    options: dict[str, Any] = {
        "provider": provider,
        "phase": phase,
        "batch": batch,
        "seq": seq,
        "threads": threads,
        "cuda_graph": cuda_graph,
        "max_length": max_length,
        "optimization": optimization,
        "device_id": device_id,
        "seed": seed,
        # a session's threads spinning after its run would slow the next model's run
        "spinning": len(models) == 1,
    }
    if models:
        say("setting up ONNX Runtime")
        device = resolve_device(provider, onnxruntime().get_available_providers())
        _prime_process(models[0], device, device_id)
    with ExitStack() as stack:
        prepared = []
        for i, model in enumerate(models):
            say(f"session and warm-up of model {i + 1} of {len(models)}")
            runner, memory = _prepare(model, warmup, options)
            stack.callback(runner.close)
            prepared.append((runner, memory))
        say(f"timing {runs} runs of each model")
        times = interleaved([r.step for r, _ in prepared], runs, warmup=0)
        return [result_of(r, m, t, threads) for (r, m), t in zip(prepared, times)]


def result_of(
    runner: Runner, memory: int | None, times: list[float], threads: int | None
) -> BenchResult:
    """The result of `runner`'s timed runs `times` (seconds) and measured `memory` (bytes)."""
    w = runner.workload
    if runner.device == "cuda":
        what = "CUDA device memory added by session + warm-up"
    else:
        what = "peak RSS growth over session creation + warm-up"
    return BenchResult(
        model=runner.label,
        provider=runner.provider,
        kind=w.kind,
        phase=w.phase,
        batch=w.batch,
        seq=w.seq,
        tokens=w.tokens,
        stats=Stats.of(times),
        memory_bytes=memory,
        memory=what if memory is not None else "not reported",
        io_binding=runner.io_binding,
        cuda_graph=runner.cuda_graph,
        threads=threads,
        inputs=w.describe(),
        note=w.note,
    )


@entry_point("bench")
def run(
    model: ModelLike,
    *,
    runs: int = RUNS,
    warmup: int = WARMUP,
    provider: str = "auto",
    phase: str = "prefill",
    batch: int = 1,
    seq: int = 128,
    threads: int | None = None,
    cuda_graph: bool = False,
    max_length: int | None = None,
    optimization: str = "all",
    device_id: int = 0,
    seed: int = 0,
) -> BenchResult:
    """Benchmark one model in ONNX Runtime: latency, tokens/s and memory.

    Parameters
    ----------
    model : str, os.PathLike, fastopt.Model or onnx.ModelProto
    runs : int, default 20
        Timed runs.
    warmup : int, default 3
        Untimed runs first.
    provider : {"auto", "cpu", "cuda"}, default "auto"
        "auto": CUDA when onnxruntime has it, else CPU; "cuda" where absent is an error.
    phase : {"prefill", "decode"}, default "prefill"
        prefill: `seq` new tokens, empty cache; decode: one new token after `seq` (a model
        without a cache recomputes all ``seq + 1``; see :mod:`fastopt.bench.inputs`).
    batch : int, default 1
    seq : int, default 128
    threads : int, optional
        ONNX Runtime's intra-op threads (None: its default).
    cuda_graph : bool, default False
        Capture the run as a CUDA graph (CUDA only; every output's shape must be known).
    max_length : int, optional
        Positions of an in-place cache buffer (default: the step's total length).
    optimization : {"disable", "basic", "extended", "all"}, default "all"
        ONNX Runtime's graph optimization level ("all", as users run it).
    device_id : int, default 0
    seed : int, default 0
        Seed of the inputs.

    Returns
    -------
    BenchResult
        Latency statistics, tokens/s, memory and what ran (``kind``, ``inputs``, ``note``).

    Raises
    ------
    fastopt.ModelError
        The model is malformed, ONNX Runtime refuses it, or inputs cannot be made for it.
    ValueError
        A bad option, or a provider that is not available.
    """
    return compare(
        [model],
        runs=runs,
        warmup=warmup,
        provider=provider,
        phase=phase,
        batch=batch,
        seq=seq,
        threads=threads,
        cuda_graph=cuda_graph,
        max_length=max_length,
        optimization=optimization,
        device_id=device_id,
        seed=seed,
    )[0]


@entry_point("bench")
def sweep(
    models: Sequence[ModelLike], seqs: Sequence[int], **options: Any
) -> list[list[BenchResult]]:
    """:func:`compare` at each sequence length in `seqs` (same options otherwise): one list of
    results per length."""
    return [compare(models, seq=s, **options) for s in seqs]
