"""Findings kept as regressions: ``minimize`` looks for the smallest model that still shows the
finding at the same stage (the same mutation on the bare pseudo-fixture, for the folding
probes a model of a few hundred bytes, then on smaller exports, smallest first); then
``save_regression`` writes that mutant (one mutation at one site, doc strings and value_info
dropped) and a JSON recipe beside it (the case key, what the mutation did, the symptom).
tests/verify/test_difftest.py replays every recipe in tests/difftest/regressions/ (a recipe
regenerates its mutant, so the repository keeps recipes, and models only where they are small:
the bare ones)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .cases import BARE, FIXTURE_DIR, Case, fixtures, modes_for
from .oracle import Outcome, mutant

REGRESSION_DIR = Path(__file__).resolve().parent / "regressions"


def slug(case: Case) -> str:
    mode = str(case.mode).replace("/", "-").replace("=", "")
    return f"{case.mutation}-{case.fixture}-{mode}-{case.seed}"


def minimize(
    case: Case, outcome: Outcome, run: Callable[[Case], Outcome], tries: int = 8
) -> tuple[Case, Outcome]:
    """The smallest case (by model bytes) with a finding at `outcome`'s stage: the bare
    pseudo-fixture, then exports smaller than case.fixture; `case` itself when none is."""
    size = _size(case.fixture)
    smaller = sorted((f for f in fixtures(None) if _size(f) < size), key=_size)
    for fixture in [BARE, *smaller][:tries]:
        if fixture != BARE and case.mode not in modes_for(fixture):
            continue
        if fixture == BARE and case.mode.kv != "none":
            continue
        candidate = Case(fixture, case.mutation, case.mode, case.seed)
        if mutant(candidate)[1] is None:
            continue
        got = run(candidate)
        if got.finding and got.stage == outcome.stage:
            return candidate, got
    return case, outcome


def _size(fixture: str) -> int:
    return 0 if fixture == BARE else (FIXTURE_DIR / fixture / "model.onnx").stat().st_size


def save_regression(case: Case, outcome: Outcome, folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, what = mutant(case)
    model.doc_string = ""
    for n in model.graph.node:
        n.doc_string = ""
    del model.graph.value_info[:]
    del model.metadata_props[:]
    path = folder / f"{slug(case)}.onnx"
    path.write_bytes(model.SerializeToString())
    recipe = {
        "case": case.key,
        "mutation": what,
        "stage": outcome.stage,
        "symptom": outcome.detail,
        "rerun": case.command,
    }
    path.with_suffix(".json").write_text(json.dumps(recipe, indent=1) + "\n")
    return path


def recipes() -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(p.read_text()) for p in sorted(REGRESSION_DIR.glob("*.json"))]
