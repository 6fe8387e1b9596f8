"""One differential run and its verdict.

The oracle: fastopt either refuses the mutant (a ModelError with a reason: fine) or its output
loads in ONNX Runtime (CPU, optimizations off) and computes what the mutant computes:

- no KV cache, no quantization: every output within the project's tolerances (float32
  1e-4 + 1e-4 |x|, float16 1e-2 + 1e-2 |x|; integers exactly; NaNs in the same places) on
  unpadded, right-padded and left-padded batches, logits compared where the mask keeps them;
- quantized: no NaN or inf where the mutant has none (a finding), and the quant_verify gates
  (cosine, max relative error, top-1) on the same batches. The gates were measured on the
  unmutated exports; a mutant can fail them with no fastopt bug (cast_chain_int's rounding
  steps flip under fp16), so a run below a gate with finite outputs is reported as "gate",
  counted and printed, but is not a finding; cosine below 0.9 is one (far below every gate);
- KV cache (standard, in place): greedy generation (tests/support/kv_generation.py, right-padded
  prompts of two lengths; for a standard cache the reference lays out the same holes,
  greedy_no_cache_as_cached) gives the same tokens as the mutant without a cache, logits within
  the tolerance (a flip between near-tied logits is no finding); quantized and cached: the
  quantization gates on the first (prefill) step.

Anything else is a finding: a foreign exception, an empty refusal, an output ORT refuses or
cannot run, a mismatch. (A crash, a signal, is seen by the worker's parent: worker.py.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from fastopt.quant.settings import QuantSettings
from fastopt.verify.quantized import THRESHOLDS, _accuracy

from .cases import Case, fixture_meta, load_fixture
from .mutations import apply

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kv_generation
from support import kv_generation as kg

ort.set_default_logger_severity(3)
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}
STEPS = 5


@dataclass
class Outcome:
    status: str  # ok | refused | n/a | invalid | gate | finding
    detail: str = ""
    stage: str = ""

    @property
    def finding(self) -> bool:
        return self.status == "finding"


class Finding(Exception):
    pass


class Invalid(Exception):
    pass


class BelowGate(Exception):
    """A quantized output within reach (finite, runs) but below the quant_verify gates."""


def mutant(case: Case) -> tuple[onnx.ModelProto, str | None]:
    model = load_fixture(case.fixture)
    return model, apply(model, case.mutation, case.seed)


def run_case(case: Case, stage: Callable[[str], None] = lambda s: None) -> Outcome:
    stage("mutate")
    model, what = mutant(case)
    if what is None:
        return Outcome("n/a", f"{case.mutation} has no site in {case.fixture}")
    return judge(model.SerializeToString(), case, stage)


def judge(data: bytes, case: Case, stage: Callable[[str], None] = lambda s: None) -> Outcome:
    """The verdict on mutant bytes `data` under case.mode (the fixture gives the feeds)."""
    mode = case.mode
    stage("optimize")
    try:
        report = fastopt.optimize(
            fastopt.load_bytes(data),
            preset=mode.preset,
            target=mode.target,  # type: ignore[arg-type]
            kv_cache=None if mode.kv == "none" else mode.kv,  # type: ignore[arg-type]
            quantize=None if mode.quant == "none" else QuantSettings(mode.quant, threads=1),
        )
    except fastopt.ModelError as e:
        if not str(e).strip():
            return Outcome("finding", "ModelError with an empty message", "optimize")
        return Outcome("refused", str(e).splitlines()[0][:300], "optimize")
    except Exception as e:  # a foreign exception: what the oracle looks for
        return Outcome("finding", f"{type(e).__name__}: {e}"[:500], "optimize")
    assert report.model is not None
    optimized = report.model.serialize()
    meta = fixture_meta(case.fixture)
    try:
        stage("original")
        ref = _session(data)
    except Exception as e:
        return Outcome("invalid", f"ORT refuses the mutant: {str(e).splitlines()[0][:200]}")
    try:
        # One run of the mutant first, so that a mutant ORT itself traps on (Div(INT64_MIN, -1)
        # kept unfolded) dies in this stage: invalid, not a finding.
        _run(ref, feeds(ref, meta, None), "original")
        stage("optimized")
        try:
            got = _session(optimized)
        except Exception as e:
            raise Finding(f"ORT refuses the output: {str(e).splitlines()[0][:300]}") from e
        if mode.kv == "none":
            _compare_batches(ref, got, meta, mode.quant)
        else:
            _compare_generation(ref, got, meta, mode)
    except Finding as f:
        return Outcome("finding", str(f), "compare")
    except BelowGate as g:
        return Outcome("gate", str(g), "compare")
    except Invalid as e:
        return Outcome("invalid", str(e), "original")
    return Outcome("ok", "")


def _session(data: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def feeds(sess: ort.InferenceSession, meta: dict, padding: str | None) -> dict[str, np.ndarray]:  # type: ignore[type-arg]
    """input_ids, attention_mask, position_ids as tests/llm_fixtures.feeds (batch 2, 11 tokens,
    the second row a third shorter), zeros for other integer inputs (token_type_ids)."""
    rng = np.random.default_rng(0)
    batch, seq = 2, 11
    vocab = int(meta["config"].get("vocab_size", 512))
    mask = np.ones((batch, seq), np.int64)
    short = seq // 3
    if padding == "right":
        mask[1, seq - short :] = 0
    elif padding == "left":
        mask[1, :short] = 0
    pos = np.cumsum(mask, axis=1) - 1
    pos[mask == 0] = 1
    out = {"input_ids": rng.integers(0, vocab, (batch, seq)), "attention_mask": mask}
    out["position_ids"] = pos
    result = {}
    for i in sess.get_inputs():
        result[i.name] = out.get(i.name, np.zeros((batch, seq), np.int64)).astype(np.int64)
    return result


def _run(sess: ort.InferenceSession, feed: dict[str, np.ndarray], who: str) -> dict[str, Any]:
    try:
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
    except Exception as e:
        msg = str(e).splitlines()[0][:300]
        if who == "original":
            raise Invalid(f"ORT cannot run the mutant: {msg}") from e
        raise Finding(f"ORT cannot run the output: {msg}") from e


def _compare_batches(
    ref: ort.InferenceSession,
    got: ort.InferenceSession,
    meta: dict,  # type: ignore[type-arg]
    quant: str,
) -> None:
    tol = TOLERANCE[meta["dtype"]]
    for padding in (None, "right", "left"):
        feed = feeds(ref, meta, padding)
        expected = _run(ref, feed, "original")
        names = {i.name for i in got.get_inputs()}
        actual = _run(got, {k: v for k, v in feed.items() if k in names}, "output")
        keep = feed["attention_mask"].astype(bool)
        for name, e in expected.items():
            if name not in actual:
                raise Finding(f"output {name} missing")
            e, a = np.asarray(e), np.asarray(actual[name])
            if e.shape != a.shape:
                raise Finding(f"{name}: shape {a.shape} != {e.shape} (padding {padding})")
            if e.ndim >= 3 and e.shape[:2] == keep.shape:  # per-position outputs: valid ones
                e, a = e[keep], a[keep]
            where = f"{name} (padding {padding})"
            if e.dtype.kind != "f":
                if not np.array_equal(e, a):
                    raise Finding(f"{where}: {a.ravel()[:8]} != {e.ravel()[:8]}")
            elif quant != "none":
                _quant_gate(where, e, a, quant)
            else:
                _close(where, e, a, tol)


def _close(where: str, e: np.ndarray, a: np.ndarray, tol: float) -> None:
    e64, a64 = e.astype(np.float64), a.astype(np.float64)
    if not np.array_equal(np.isnan(e64), np.isnan(a64)):
        raise Finding(
            f"{where}: NaN in {int(np.isnan(a64).sum())} places, mutant {int(np.isnan(e64).sum())}"
        )
    ok = np.isnan(e64) | (np.abs(a64 - e64) <= tol + tol * np.abs(e64)) | (a64 == e64)
    if not ok.all():
        diff = np.nan_to_num(np.abs(a64 - e64), nan=0.0, posinf=np.inf)
        raise Finding(f"{where}: max abs diff {float(diff.max()):.3g} > {tol} + {tol}|x|")


def _quant_gate(where: str, e: np.ndarray, a: np.ndarray, quant: str) -> None:
    if not np.isfinite(e).all():  # no gate measures a NaN reference (bloom's fp16 island)
        raise Invalid(f"{where}: the mutant itself gives {int((~np.isfinite(e)).sum())} NaN/inf")
    if not np.isfinite(a).all():
        raise Finding(f"{where}: {int((~np.isfinite(a)).sum())} NaN/inf values ({quant})")
    acc = _accuracy(where, e, a)
    cos, rel, top1 = THRESHOLDS[quant]
    if acc.cosine < 0.9:
        raise Finding(f"{where}: {quant} cosine {acc.cosine:.4f} < 0.9 (gate {cos})")
    if acc.cosine < cos or acc.max_rel_error > rel or (acc.top1_agreement or 1.0) < top1:
        raise BelowGate(
            f"{where}: {quant} cosine {acc.cosine:.5f} (>= {cos}), max rel err "
            f"{acc.max_rel_error:.4f} (<= {rel}), top-1 {acc.top1_agreement} (>= {top1})"
        )


def _compare_generation(
    ref: ort.InferenceSession,
    got: ort.InferenceSession,
    meta: dict,  # type: ignore[type-arg]
    mode: Any,
) -> None:
    if not any(i.name.startswith("past_key_values.") for i in got.get_inputs()):
        raise Finding("the output has no past_key_values inputs")
    vocab = int(meta["config"].get("vocab_size", 512))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in (7, 4)]
    try:
        if mode.kv == "standard":  # the no-cache model on the cache's layout (holes where a
            # short row's prompt padding sits): where a sliding window counts positions, holes
            # included (gemma2), only this reference matches a correct cache
            expected = kg.greedy_no_cache_as_cached(ref, prompts, STEPS)
        else:
            expected = kg.greedy_no_cache(ref, *kg.right_pad(prompts), STEPS)
    except Exception as e:
        raise Invalid(f"ORT cannot run the mutant: {str(e).splitlines()[0][:200]}") from e
    try:
        actual = kg.greedy_cached(got, prompts, STEPS, inplace=mode.kv == "inplace")
    except Exception as e:
        raise Finding(f"cached generation fails: {type(e).__name__}: {str(e)[:300]}") from e
    if mode.quant != "none":
        _quant_gate("prefill logits", expected.logits[0], actual.logits[0], mode.quant)
        return
    tol = TOLERANCE[meta["dtype"]] * 10  # a cache changes the accumulation order
    same, diff = kg.compare(expected, actual)
    if same < STEPS:
        margin, step_diff = kg.divergence(expected, actual, same)
        if not (margin < 2 * tol and step_diff <= tol):  # not a near-tie
            raise Finding(
                f"greedy tokens differ from step {same} ({actual.tokens.tolist()} vs "
                f"{expected.tokens.tolist()}); logits max abs diff {step_diff:.3g} there"
            )
    if diff > tol:
        raise Finding(f"greedy logits max abs diff {diff:.3g} > {tol} over {same} equal steps")
