"""``fastopt.verify``: does an optimized model compute what the original computes?

Both models run in ONNX Runtime with graph optimizations off (so ORT's own rewrites neither hide
nor cause differences) on the same inputs, and every output is compared by name.

Inputs come from :func:`make_inputs`, which builds valid inputs from the graph inputs' types:

* symbolic dims from ``dims`` (name -> int), else by what the name means: batch-like names 2,
  sequence-like names 8, past-like names (``past_sequence_length``, ...) 4 when the model has any
  (0 otherwise), total-like names (``total_sequence_length``) past + sequence, arithmetic names as
  dynamo writes them (``past_sequence_length + sequence_length``) evaluated, anything else 4.
  Given some of sequence / past / total in ``dims``, the others follow from total = past + seq.
* token ids uniform in [0, vocab), where vocab is the first dimension of the embedding table the
  input reaches (through Gather, GatherBlockQuantized or EmbedLayerNormalization, past reshapes
  and casts); attention masks all ones; position ids counting on from the past length;
  token type ids zeros; ``seqlens_k`` total - 1; integer scalars named like a dim that dim's
  value; other integers in [0, 2); booleans random; floats standard normal.

Interface: outputs are matched by name (missing or extra outputs fail, so do changed dtypes or
shapes), and the optimized model must take no input the original lacks and drop none it has.
A past length in ``dims`` is ignored for a model without past-like dims, so one ``dims`` serves
models with and without a KV cache.

Tolerances (``|opt - orig| <= atol + rtol * |orig|`` elementwise, NaNs in the same places, infs
equal) default by the output's type: float32 1e-4/1e-4, float16 and bfloat16 1e-2/1e-2, float64
1e-7/1e-7, other small floats twice their epsilon; integers, booleans and strings exactly.
When either side of a comparison ran on an accelerator (any provider but CPU), float results
legitimately differ more (other kernels and accumulation orders, TF32 matmuls on NVIDIA GPUs), so
the defaults there are float32 1e-3/1e-3, float16 2e-2/2e-2, bfloat16 5e-2/5e-2. ``atol`` and
``rtol`` override either.

Providers (``providers=``, short names such as "cpu", "cuda", "tensorrt", "dml" or ORT's names,
optionally as ``(name, options)``; see :mod:`fastopt.runtime.providers`):

* none or one entry: both models run on that provider (CPU by default) and are compared, as
  always.
* several entries: each is a run of its own (ORT adds CPU behind any accelerator by itself, so a
  priority list such as ["CUDAExecutionProvider", "CPUExecutionProvider"] is two runs, CUDA and
  CPU). Both models run on every provider, and the report holds three kinds of comparison:
  "optimization" (optimized vs original on the same provider: did fastopt change results),
  "provider" (the original on each further provider vs the original on the first: did the
  provider change results) and "end-to-end" (optimized on each further provider vs the
  original on the first). ``report.outputs`` stays the optimization comparison on the first
  provider.

Every run on an accelerator, and every run of a several-provider check, is profiled once to
record which nodes ORT placed on CPU instead (``report.runs[i].placement``).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from fastopt._lazy import lazy_module
from fastopt._numpy import numpy_dtype
from fastopt.errors import entry_point
from fastopt.runtime.providers import Placement, is_accelerator, labels, provider_name, read_profile
from fastopt.verify.check import (
    ModelLike,
    Source,
    check_providers,
    onnxruntime,
    open_source,
    ort_session,
    summarize_error,
)
from fastopt.verify.compare import (
    _ACCELERATOR_TOLERANCES,
    _TOLERANCES,
    Tolerance,
    _compare_outputs,
    _describe,
    _label,
)
from fastopt.verify.inputs import (
    BATCH,
    PAST,
    SEQUENCE,
    UNKNOWN_DIM,
    _as_model,
    _synthesize,
    make_inputs,
)
from fastopt.verify.report import (
    InputRejectedError,
    OutputComparison,
    OutputRejectedError,
    ProviderComparison,
    ProviderRun,
    VerifyError,
    VerifyReport,
    _failure_text,
)

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

__all__ = [
    "BATCH",
    "PAST",
    "SEQUENCE",
    "UNKNOWN_DIM",
    "InputRejectedError",
    "OutputComparison",
    "OutputRejectedError",
    "ProviderComparison",
    "ProviderRun",
    "Tolerance",
    "VerifyError",
    "VerifyReport",
    "compare_providers",
    "make_inputs",
    "verify",
]


# ONNX element types ORT's numpy bridge cannot carry: they travel as raw OrtValues.
_ORT_RAW_TYPES = {
    "tensor(bfloat16)": 16,
    "tensor(float8e4m3fn)": 17,
    "tensor(float8e4m3fnuz)": 18,
    "tensor(float8e5m2)": 19,
    "tensor(float8e5m2fnuz)": 20,
}


# --- running in ONNX Runtime and comparing -------------------------------------------------------


def _ort_feed(array: np.ndarray, ort_type: str) -> Any:
    ort = onnxruntime()
    # not np.ascontiguousarray: it makes scalars 1-D
    array = array if array.flags.c_contiguous else array.copy(order="C")
    if ort_type in _ORT_RAW_TYPES:
        bits = array.view(np.uint8 if array.itemsize == 1 else np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            bits, onnx_element_type=_ORT_RAW_TYPES[ort_type]
        )
    return ort.OrtValue.ortvalue_from_numpy(array)


def _ort_fetch(value: Any, ort_type: str) -> Any:
    if ort_type in _ORT_RAW_TYPES:
        # numpy has no such dtype in ORT's bridge: copy the bytes of the (CPU) tensor.
        raw = ctypes.string_at(value.data_ptr(), value.tensor_size_in_bytes())
        dtype = numpy_dtype(_ORT_RAW_TYPES[ort_type])
        return np.frombuffer(raw, dtype=dtype).reshape(value.shape()).copy()
    return value.numpy()


def _run(
    source: Source,
    feeds: Mapping[str, np.ndarray],
    provider: Any,
    profile_prefix: str | None = None,
) -> tuple[list[str], dict[str, Any], Placement | None]:
    """Runs a model on `feeds` (only the inputs it declares) with one provider entry (None: CPU):
    its input names, its outputs by name in its order, and, with `profile_prefix`, where ORT
    placed its nodes."""
    sess = ort_session(
        source, None if provider is None else [provider], profile_prefix=profile_prefix
    )
    wanted = sess.get_inputs()
    missing = [i.name for i in wanted if i.name not in feeds]
    if missing:
        raise ValueError(f"it takes inputs the original does not: {', '.join(missing)}")
    outputs = sess.get_outputs()
    names = [o.name for o in outputs]
    if any(i.type in _ORT_RAW_TYPES for i in [*wanted, *outputs]):
        ort_feeds = {i.name: _ort_feed(feeds[i.name], i.type) for i in wanted}
        values = sess.run_with_ort_values(names, ort_feeds)
        fetched = {o.name: _ort_fetch(v, o.type) for o, v in zip(outputs, values)}
    else:
        results = sess.run(names, {i.name: feeds[i.name] for i in wanted})
        fetched = dict(zip(names, results))
    placement = None
    if profile_prefix is not None:
        requested = "cpu" if provider is None else provider_name(provider)
        placement = read_profile(sess.end_profiling(), requested)
    return [i.name for i in wanted], fetched, placement


def _verify(
    original: ModelLike,
    optimized: ModelLike | None,
    inputs: Mapping[str, np.ndarray] | None,
    dims: Mapping[str, int] | None,
    rtol: Tolerance,
    atol: Tolerance,
    seed: int,
    providers: Sequence[Any] | None,
) -> VerifyReport:
    """verify() and compare_providers(): `optimized` None runs only the original."""
    start = time.perf_counter()
    entries: list[Any] = check_providers(providers) if providers else [None]
    names = labels(entries) if providers else ["cpu"]
    several = len(entries) > 1
    given = {k: np.asarray(v) for k, v in (inputs or {}).items()}
    feeds = {**_synthesize(_as_model(original), dims, seed, skip=set(given)), **given}
    report = VerifyReport(
        _label(original),
        "" if optimized is None else _label(optimized),
        {k: _describe(np.asarray(v)) for k, v in feeds.items()},
        providers=names,
    )
    models = [("original", original)]
    if optimized is not None:
        models.append(("optimized", optimized))
    results: dict[tuple[str, str], dict[str, Any]] = {}
    declared: dict[str, list[str]] = {}
    with ExitStack() as stack:
        sources = {role: open_source(m, stack, in_memory="bytes") for role, m in models}
        profiles = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastopt-profile-"))
        for entry, label in zip(entries, names):
            profile = several or (entry is not None and is_accelerator(provider_name(entry)))
            for role, _ in models:
                t = time.perf_counter()
                try:
                    prefix = os.path.join(profiles, f"{role}-{len(report.runs)}")
                    got = _run(sources[role], feeds, entry, prefix if profile else None)
                except (FileNotFoundError, TypeError):
                    raise
                except Exception as e:
                    where = f" on {label}" if several else ""
                    report.error = (
                        f"ONNX Runtime could not run the {role} model{where}: "
                        f"{summarize_error(str(e))}"
                    )
                    report.seconds["total"] = time.perf_counter() - start
                    if role == "original":
                        report.error += " (choose inputs with `inputs=` or `dims=`)"
                        raise InputRejectedError(report.error, report) from e
                    report.error += " (the original runs: a fastopt bug, please report it)"
                    raise OutputRejectedError(report.error, report) from e
                declared.setdefault(role, got[0])
                results[role, label] = got[1]
                seconds = time.perf_counter() - t
                report.runs.append(ProviderRun(role, label, seconds, got[2]))
                report.seconds[f"{role}@{label}" if several else role] = seconds
    _fill_comparisons(report, results, entries, names, optimized is not None, rtol, atol)
    if optimized is not None:
        dropped = [n for n in declared["original"] if n not in declared["optimized"]]
        if dropped:
            # ORT refuses feeds it does not know: callers of the original would break.
            report.error = f"the optimized model no longer takes input(s) {', '.join(dropped)}"
    report.seconds["total"] = time.perf_counter() - start
    if not report.ok:
        raise VerifyError(_failure_text(report), report)
    return report


def _fill_comparisons(
    report: VerifyReport,
    results: Mapping[tuple[str, str], Mapping[str, Any]],
    entries: Sequence[Any],
    names: Sequence[str],
    has_optimized: bool,
    rtol: Tolerance,
    atol: Tolerance,
) -> None:
    """The optimization comparison on the first provider into ``report.outputs``; with several
    providers, every comparison of the module docstring into ``report.comparisons``."""

    def table(*labels_: str) -> Mapping[str, tuple[float, float]]:
        accelerated = any(
            e is not None and is_accelerator(provider_name(e))
            for e, n in zip(entries, names)
            if n in labels_
        )
        return _ACCELERATOR_TOLERANCES if accelerated else _TOLERANCES

    def compare(kind: str, subject: tuple[str, str], reference: tuple[str, str]) -> None:
        outputs = _compare_outputs(
            results[reference],
            results[subject],
            rtol,
            atol,
            table(subject[1], reference[1]),
            subject[0],
        )
        report.comparisons.append(
            ProviderComparison(kind, "@".join(reference), "@".join(subject), outputs)
        )

    first = names[0]
    for label in names:
        if has_optimized:
            compare("optimization", ("optimized", label), ("original", label))
        if label != first:
            compare("provider", ("original", label), ("original", first))
            if has_optimized:
                compare("end-to-end", ("optimized", label), ("original", first))
    if has_optimized:
        report.outputs = report.comparisons[0].outputs
    if len(names) == 1:
        report.comparisons = []  # one provider: the classic report, nothing across providers


@entry_point("verify")
def verify(
    original: ModelLike,
    optimized: ModelLike,
    inputs: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    rtol: Tolerance = None,
    atol: Tolerance = None,
    seed: int = 0,
    providers: Sequence[Any] | None = None,
) -> VerifyReport:
    """Run `original` and `optimized` on the same inputs and compare every output by name.

    Parameters
    ----------
    original, optimized : str, os.PathLike, fastopt.Model or onnx.ModelProto
        Large in-memory models are saved to a temporary folder with external data, never
        serialized in memory.
    inputs : mapping of str to numpy.ndarray, optional
        Arrays for some or all graph inputs; the rest come from :func:`make_inputs` on the
        original with `dims` and `seed`.
    dims : mapping of str to int, optional
        Values of symbolic dims, e.g. ``{"batch_size": 1, "sequence_length": 16}``.
    rtol, atol : float or mapping of str to float, optional
        One value for every floating-point output or one per output name; None takes the
        dtype's default (see the module docstring).
    seed : int, default 0
    providers : sequence, optional
        None (CPU) or one entry runs both models there; several compare across providers too
        (see the module docstring).

    Returns
    -------
    VerifyReport
        When every output matches.

    Raises
    ------
    VerifyError
        An output differs (the message tables the failing ones), or output names, dtypes or
        shapes differ; :class:`InputRejectedError` when ONNX Runtime cannot run the original,
        :class:`OutputRejectedError` when it runs the original but not the optimized model.
    ValueError
        A provider is not available (the message names the available ones).
    """
    return _verify(original, optimized, inputs, dims, rtol, atol, seed, providers)


@entry_point("compare_providers")
def compare_providers(
    model: ModelLike,
    providers: Sequence[Any],
    inputs: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    *,
    rtol: Tolerance = None,
    atol: Tolerance = None,
    seed: int = 0,
) -> VerifyReport:
    """Runs one model on every provider in `providers` and compares each run to the first
    ("provider" comparisons only; ``report.optimized`` is empty and ``report.outputs`` too).

    Arguments as for :func:`verify`. Returns the report, with every run's node placement, when
    all runs agree; raises :class:`VerifyError` otherwise.
    """
    if not providers:
        raise ValueError("compare_providers needs at least one provider")
    return _verify(model, None, inputs, dims, rtol, atol, seed, providers)
