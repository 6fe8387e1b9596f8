"""Findings kept as regressions: ``save_regression`` writes the mutant model (one mutation at
one site of a 2-layer export, doc strings and value_info dropped) and a JSON recipe beside it
(the case key, what the mutation did, the symptom). tests/test_difftest.py replays every recipe
in tests/difftest/regressions/ (the recipe regenerates the mutant from the fixture, so the
repository keeps the few-hundred-byte recipes, not the models)."""

from __future__ import annotations

import json
from pathlib import Path

from .cases import Case
from .oracle import Outcome, mutant

REGRESSION_DIR = Path(__file__).resolve().parent / "regressions"


def slug(case: Case) -> str:
    mode = str(case.mode).replace("/", "-").replace("=", "")
    return f"{case.mutation}-{case.fixture}-{mode}-{case.seed}"


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
