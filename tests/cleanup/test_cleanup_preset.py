"""The "classic" preset (cleanup + the classic fusions: the "default" preset of earlier versions,
which now adds the LLM fusions, tested in test_llm_preset.py and test_cli_errors.py) end to end on
real models: the onnx wheel's backend test models
(pytorch-converted, pytorch-operator, simple, light) that ONNX Runtime can run, and the exports
of ../shared/corpus (skipped when absent).

For each: outputs within 1e-5 of the original (ONNX Runtime, its own optimizations off, same
inputs), onnx.checker passes on the saved result, Model.verify() holds, the node count does not
grow, and a second run of the preset rewrites nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import pytest
from conftest import BACKEND_DATA, corpus_models, model_feeds, model_id, ort_session, run_ort

KINDS = ("pytorch-converted", "pytorch-operator", "simple", "light")
BACKEND = [
    p
    for kind in KINDS
    for p in sorted((BACKEND_DATA / kind).glob("*/model.onnx"))
    + sorted((BACKEND_DATA / kind).glob("*.onnx"))
]
MODELS = BACKEND + corpus_models()


def assert_close(expected: list[Any], actual: list[Any], tol: float = 1e-5) -> None:
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, (list, tuple)):
            assert_close(list(e), list(a), tol)
            continue
        e, a = np.asarray(e), np.asarray(a)
        assert e.dtype == a.dtype and e.shape == a.shape, f"output {i}"
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(a, e, rtol=tol, atol=tol, err_msg=f"output {i}")
        else:
            np.testing.assert_array_equal(a, e, err_msg=f"output {i}")


def test_model_sets_found() -> None:
    assert len(BACKEND) > 100


@pytest.mark.parametrize("path", MODELS, ids=[model_id(p) for p in MODELS])
def test_classic_preset(path: Path, tmp_path: Path) -> None:
    try:
        session = ort_session(path)
    except Exception as e:  # old opsets, training ops...
        pytest.skip(f"ONNX Runtime cannot run the original: {str(e).splitlines()[0][:160]}")
    original = onnx.load(str(path))
    feeds = model_feeds(path, original)
    expected = session.run(None, feeds)

    report = fastopt.optimize(str(path), preset="classic")
    assert report.model is not None
    report.model.verify()
    assert report.nodes_after <= report.nodes_before
    out = tmp_path / "out.onnx"
    report.model.save(str(out))
    onnx.checker.check_model(str(out))
    saved = onnx.load(str(out))
    assert [o.name for o in saved.graph.output] == [o.name for o in original.graph.output]
    assert_close(expected, run_ort(out, feeds))

    again = fastopt.optimize(report.model, preset="classic")
    assert again.rewrites == 0, [(p.name, p.counters) for p in again.passes if p.rewrites]
