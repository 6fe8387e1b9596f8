"""The differential tester (tests/difftest/, issue 25): semantic mutations of the real exports,
each optimized under a mode (preset x target x KV mode x quantization) and judged in ONNX
Runtime against the mutant. Findings the other parts of issue 25 are fixing are strict xfails
from tests/difftest/known.py; any other finding fails with its one-command rerun.

- default run: DEFAULT_RUNS cases from DEFAULT_SEED, every mutation kind, drawn over a few
  fixtures whose sites most kinds find, and over every mode family (see ``_default_cases``);
- ``-m slow``: SLOW_RUNS cases from another seed over every float32 export;
- the saved regressions (tests/difftest/regressions/*.json) replayed;
- the oracle itself: a planted wrong answer, crash and foreign exception are findings.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.paths import ROOT

sys.path.insert(0, str(ROOT))  # `tests.difftest`
from support.paths import ROOT

from tests.difftest import oracle
from tests.difftest.cases import FIXTURE_DIR, Case, Mode, sample
from tests.difftest.known import known_reason
from tests.difftest.mutations import MUTATIONS, TAGS, apply
from tests.difftest.regressions import recipes
from tests.difftest.worker import Worker

DEFAULT_SEED = 25
SLOW_SEED = 2025
SLOW_RUNS = 600
# Fixtures of the default run: llama (both exporters), gemma2 (soft-cap), gpt2 (LayerNorm, tanh
# GELU, learned positions), qwen2 (biases), bert (an encoder).
DEFAULT_FIXTURES = (
    "llama_dynamo_float32",
    "llama_ts_float32",
    "gemma2_dynamo_float32",
    "gpt2_ts_float32",
    "qwen2_dynamo_float32",
    "bert_dynamo_float32",
)
# Modes of the default run, in turn: fusions exact (both targets), each KV form, each
# quantization, the presets without fusions.
DEFAULT_MODES = tuple(
    Mode.parse(m)
    for m in (
        "llm/ort/kv=none/q=none",
        "default/onnx/kv=none/q=none",
        "llm/ort/kv=standard/q=none",
        "default/ort/kv=inplace/q=none",
        "llm/onnx/kv=standard/q=none",
        "cleanup/ort/kv=none/q=none",
        "llm/ort/kv=none/q=int4",
        "default/onnx/kv=none/q=int8",
        "llm/ort/kv=none/q=int8-dynamic",
        "llm/ort/kv=none/q=fp16",
        "classic/onnx/kv=none/q=none",
        "llm/ort/kv=standard/q=int4",
    )
)


@functools.cache
def _fixture_bytes(fixture: str) -> bytes:
    return (FIXTURE_DIR / fixture / "model.onnx").read_bytes()


KV_MODES = tuple(
    Mode.parse(m) for m in ("llm/ort/kv=standard/q=none", "default/ort/kv=inplace/q=none")
)


def _applies(fixture: str, kind: str) -> bool:
    return apply(onnx.ModelProto.FromString(_fixture_bytes(fixture)), kind, 0) is not None


def _default_cases() -> list[Case]:
    """Each mutation kind once, on a default fixture where it has a site (drawn), under the
    modes of DEFAULT_MODES in turn (KV modes only on decoders)."""
    rng = np.random.default_rng(DEFAULT_SEED)
    cases = []
    for turn, kind in enumerate(sorted(MUTATIONS)):
        where = [f for f in DEFAULT_FIXTURES if _applies(f, kind)]
        fixture = where[int(rng.integers(len(where)))]
        mode = DEFAULT_MODES[turn % len(DEFAULT_MODES)]
        if TAGS[kind] in ("mixing", "attention") and not fixture.startswith("bert"):
            mode = KV_MODES[turn % len(KV_MODES)]  # what the KV rewrite must carry or refuse
        elif TAGS[kind] == "probe":
            mode = DEFAULT_MODES[turn % 2]  # folding: no cache, no quantization
        if mode.kv != "none" and fixture.startswith("bert"):
            mode = DEFAULT_MODES[0]
        cases.append(Case(fixture, kind, mode, int(rng.integers(1 << 31))))
    return cases


def _params(cases: list[Case], strict: bool = True) -> Iterator[object]:
    for case in cases:
        known = known_reason(case)
        marks = []
        if known:
            reason, strict_entry = known
            marks = [pytest.mark.xfail(strict=strict and strict_entry, reason=reason)]
        yield pytest.param(case, id=case.key, marks=marks)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker(timeout=240)
    yield w
    w.close()


def _check(worker: Worker, case: Case) -> oracle.Outcome:
    outcome = worker.run(case)
    assert outcome.status != "error", f"the tester failed: {outcome.detail}"
    assert not outcome.finding, (
        f"finding: {case.key} [{outcome.stage}] {outcome.detail}\n  rerun: {case.command}"
    )
    return outcome


@pytest.mark.parametrize("case", list(_params(_default_cases())))
def test_difftest_default(worker: Worker, case: Case) -> None:
    _check(worker, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_params(sample(SLOW_SEED, SLOW_RUNS), strict=False)))
def test_difftest_long(worker: Worker, case: Case) -> None:
    _check(worker, case)


@pytest.mark.parametrize("recipe", recipes(), ids=[r["case"] for r in recipes()])
def test_difftest_regression(worker: Worker, recipe: dict) -> None:  # type: ignore[type-arg]
    """A saved finding: fixed (no finding), or still one of the KNOWN classes (xfail)."""
    case = Case.parse(recipe["case"])
    outcome = worker.run(case)
    known = known_reason(case)
    if outcome.finding and known:
        pytest.xfail(f"{known[0]}: {outcome.detail}")
    assert outcome.status != "error", f"the tester failed: {outcome.detail}"
    assert not outcome.finding, f"{case.key} [{outcome.stage}] {outcome.detail}"


def test_default_run_covers_every_kind_and_mode_family() -> None:
    cases = _default_cases()
    assert {c.mutation for c in cases} == set(MUTATIONS)
    assert len(MUTATIONS) >= 30
    assert {c.mode.kv for c in cases} == {"none", "standard", "inplace"}
    assert {c.mode.quant for c in cases} == {"none", "int4", "int8", "int8-dynamic", "fp16"}
    assert {c.mode.target for c in cases} == {"ort", "onnx"}


def test_case_key_round_trips() -> None:
    case = Case("llama_ts_float32", "token_shift", Mode("llm", "ort", "inplace", "int4"), 7)
    assert Case.parse(case.key) == case
    assert case.key in case.command


# --- the oracle itself: what it must call a finding --------------------------------------------


def _planted(monkeypatch: pytest.MonkeyPatch, bug: str) -> oracle.Outcome:
    """The oracle's verdict on the unmutated llama export when fastopt.optimize has `bug`."""
    import fastopt

    real = fastopt.optimize

    def buggy(model: object, **kw: object) -> object:
        report = real(model, **kw)  # type: ignore[arg-type]
        if bug == "wrong":  # logits scaled by 1.001: a silent wrong answer
            proto = report.model.to_onnx()
            out = proto.graph.output[0].name
            last = next(n for n in proto.graph.node if out in n.output)
            last.output[list(last.output).index(out)] = out + "_pre"
            proto.graph.node.append(onnx.helper.make_node("Mul", [out + "_pre", "k"], [out]))
            proto.graph.initializer.append(
                onnx.numpy_helper.from_array(np.array(1.001, np.float32), "k")
            )
            report.model = fastopt.from_onnx(proto)
        elif bug == "foreign":
            raise KeyError("planted")
        return report

    monkeypatch.setattr(fastopt, "optimize", buggy)
    data = onnx.load(str(FIXTURE_DIR / "llama_ts_float32" / "model.onnx"))
    case = Case("llama_ts_float32", "none", Mode(), 0)
    return oracle.judge(data.SerializeToString(), case)


def test_oracle_flags_a_silent_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = _planted(monkeypatch, "wrong")
    assert outcome.finding and "max abs diff" in outcome.detail, outcome


def test_oracle_flags_a_foreign_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    outcome = _planted(monkeypatch, "foreign")
    assert outcome.finding and outcome.detail.startswith("KeyError"), outcome


def test_oracle_passes_the_unmutated_export(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _planted(monkeypatch, "none").status == "ok"


def test_worker_reports_a_crash_with_its_stage() -> None:
    """A mutant whose optimization kills the process (SIGFPE in Div(INT64_MIN, -1) on main)
    comes back as a finding naming the signal, and the next case runs in a new child."""
    w = Worker(timeout=120)
    try:
        crash = w.run(Case.parse("llama_ts_float32:probe_div_int_min:cleanup/ort/kv=none/q=none:1"))
        after = w.run(Case.parse("llama_ts_float32:swap_commutative:cleanup/ort/kv=none/q=none:1"))
    finally:
        w.close()
    if crash.status == "finding":
        assert crash.detail.startswith("crash (signal") and crash.stage == "optimize", crash
    else:  # part B's fix: not folded (ORT itself traps on the mutant: not a finding)
        assert crash.status in ("invalid", "refused", "ok"), crash
    assert after.status == "ok", after


def test_minimize_moves_a_probe_finding_to_the_bare_model(tmp_path: Path) -> None:
    """A folding-probe finding minimizes to the bare pseudo-fixture (a model of about 1 kB),
    which save_regression writes with its recipe; a finding that only the export shows stays."""
    from tests.difftest.regressions import minimize, save_regression

    case = Case.parse("llama_ts_float32:probe_narrowing_cast:cleanup/ort/kv=none/q=none:1")
    found = oracle.Outcome("finding", "difftest_probe: shape (6,) != (5,)", "compare")
    small, outcome = minimize(case, found, lambda c: found)
    assert small.fixture == "bare" and outcome is found
    path = save_regression(small, outcome, tmp_path)
    assert path.stat().st_size < 4096 and path.with_suffix(".json").is_file()
    onnx.checker.check_model(onnx.load(str(path)))
    clean = oracle.Outcome("ok")
    assert minimize(case, found, lambda c: clean) == (case, found)
