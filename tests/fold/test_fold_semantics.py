"""Folding agrees with ONNX Runtime on integer edge values, narrowing casts and Slice bounds.

Property: for every case (small graphs of constants: Add/Sub/Mul/Div/Neg/Abs, Cast chains,
Slice with extreme starts/ends/steps, Range, over a table of edge values) and every folding
pipeline, the optimized model run in ONNX Runtime (optimizations off) gives the original's
outputs bit for bit; where the original fails or crashes in ONNX Runtime (integer division by
zero, INT_MIN / -1), the optimized one fails too (nothing was folded away). Where ONNX's
reference and ONNX Runtime disagree (Slice with a negative step and end INT_MAX), folding is
refused and said (counters).

Every case runs in a forked child of one worker subprocess (tests/support/fold_semantics_worker.py),
so a crash (SIGFPE) fails that case instead of killing the test run.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import pytest
from support.fold_semantics_cases import CASES, PIPELINES, Case
from support.paths import TESTS

HERE = TESTS


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fold_semantics") / "results.pkl"
    proc = subprocess.run(
        [sys.executable, str(HERE / "support" / "fold_semantics_worker.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        return dict(pickle.load(f))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_folding_matches_onnx_runtime(case: Case, results: dict[str, Any]) -> None:
    ref = results[case.name]["reference"]
    for pipeline in PIPELINES:
        got = results[case.name][pipeline]
        assert got["stage"] == "done", f"{pipeline}: fastopt died in {got['stage']}: {got}"
        if ref["status"] != "ok":
            # ONNX Runtime has no answer (an error or a crash): folding must not invent one.
            assert got["status"] != "ok", (
                f"{pipeline}: the original fails in ONNX Runtime ({ref['detail']}), "
                f"the optimized model runs: something was folded away"
            )
            continue
        assert got["status"] == "ok", f"{pipeline}: the optimized model fails: {got['detail']}"
        wrong = [
            f"{name}: expected {ref['outputs'][name].tolist()} "
            f"({ref['outputs'][name].dtype}), got {value.tolist()} ({value.dtype})"
            for name, value in got["outputs"].items()
            if not same(ref["outputs"][name], value)
        ]
        assert not wrong, f"{pipeline}: " + "; ".join(wrong[:5])
        if case.keeps:
            assert case.keeps in got["ops"], f"{pipeline}: {case.keeps} folded, undefined in ORT"
        if case.folds and pipeline == "fold_constants":
            assert got["ops"] == {}, f"expected every node folded, left {got['ops']}"


def test_refusals_are_counted(results: dict[str, Any]) -> None:
    """A Slice on which ONNX and ONNX Runtime disagree is refused with a counter, not folded."""
    got = results["slice_negative_step_end_int_max"]
    assert got["fold_constants"]["ops"].get("Slice") == 2
    counters = got["fold_constants"]["counters"]
    assert counters.get("refused_Slice(onnx_and_ort_differ)") == 2, counters


def test_cli_keeps_int_min_by_minus_1(tmp_path: Path) -> None:
    """Div(INT64_MIN, -1) on constants: the CLI died of SIGFPE in shape inference (rc 136)."""
    case = next(c for c in CASES if c.name == "Div_int64_-9223372036854775808_by_minus_1")
    model = tmp_path / "div.onnx"
    model.write_bytes(case.model().SerializeToString())
    out = tmp_path / "out.onnx"
    args = [sys.executable, "-m", "fastopt", "optimize", str(model), "-o", str(out)]
    proc = subprocess.run([*args, "--explain", "fold_constants"], capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "fold_constants: Div: not folded: INT_MIN / -1" in proc.stdout
    # The run check runs ORT in a child: ORT's own SIGFPE on this graph is a note, not a death.
    assert "cannot run the original either: ONNX Runtime died of SIGFPE" in proc.stdout
    assert fastopt.load(out).op_counts().get("Div") == 1
