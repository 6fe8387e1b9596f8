"""Pass contracts read by the pass manager (issue 26): the facts a pass requires and ensures, and
``idempotent``, change what optimize() runs; tags are labels only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fastopt
import onnx
import pytest
from fastopt.cli.main import main
from fastopt.pipeline.registry import VALUE_TYPES, PassContext, get_pass, place
from onnx import TensorProto, helper


def _model(path: Path) -> str:
    """X -> Relu -> Neg -> Y with a dead Sigmoid; the intermediate value has no type."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("Relu", ["X"], ["a"]),
        helper.make_node("Neg", ["a"], ["Y"]),
        helper.make_node("Sigmoid", ["X"], ["dead"]),
    ]
    g = helper.make_graph(nodes, "g", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names of the test passes registered in a test, unregistered afterwards."""
    names: list[str] = []
    yield names
    for n in names:
        fastopt.unregister_pass(n)


def _register(names: list[str], name: str, rewrites: int = 0, **contract: object) -> list[str]:
    """A Python pass returning `rewrites`; returns the list of its runs."""
    calls: list[str] = []

    @fastopt.register_pass(name, "test pass", **contract)  # type: ignore[arg-type]
    def run(ctx: PassContext) -> int:
        calls.append(name)
        return rewrites

    names.append(name)
    return calls


def _inferred_for(report: fastopt.OptimizeReport) -> list[str]:
    """The passes a shape inference ran for (the infer_shapes pass or one that required it)."""
    return [line.split(":")[0] for line in report.shape_inference]


def test_required_value_types_come_from_the_contract(tmp_path: Path, registered: list[str]) -> None:
    path = _model(tmp_path / "m.onnx")
    _register(registered, "t_requires_types", requires_facts=(VALUE_TYPES,))
    _register(registered, "t_tagged_needs_shapes", tags=("needs_shapes",))
    report = fastopt.optimize(path, passes=["t_requires_types"])
    assert _inferred_for(report) == ["t_requires_types"]
    # the old tag alone is a label: no inference
    report = fastopt.optimize(path, passes=["t_tagged_needs_shapes"])
    assert _inferred_for(report) == []


def test_ensured_value_types_stay_fresh(tmp_path: Path, registered: list[str]) -> None:
    path = _model(tmp_path / "m.onnx")
    _register(registered, "t_requires_types", requires_facts=(VALUE_TYPES,))
    # a pass that reports a rewrite but ensures the value types (as infer_shapes does) ...
    _register(registered, "t_ensures_types", rewrites=1, ensures_facts=(VALUE_TYPES,))
    # ... and one only tagged "analysis", which used to keep them
    _register(registered, "t_tagged_analysis", rewrites=1, tags=("analysis",))
    passes = ["infer_shapes", "t_ensures_types", "t_requires_types"]
    assert _inferred_for(fastopt.optimize(path, passes=passes)) == ["infer_shapes"]
    passes = ["infer_shapes", "t_tagged_analysis", "t_requires_types"]
    inferred = _inferred_for(fastopt.optimize(path, passes=passes))
    assert inferred == ["infer_shapes", "t_requires_types"]


def test_builtin_passes_declare_their_contracts(tmp_path: Path) -> None:
    fold_shapes = get_pass("fold_shapes")
    assert fold_shapes.language == "c++" and VALUE_TYPES in fold_shapes.requires_facts
    assert "needs_shapes" not in fold_shapes.tags
    assert VALUE_TYPES in get_pass("infer_shapes").ensures_facts
    report = fastopt.optimize(_model(tmp_path / "m.onnx"), passes=["fold_shapes"])
    assert _inferred_for(report) == ["fold_shapes"]
    # the manager establishes the value types itself: placing such a pass needs no ensurer
    assert place(["eliminate_dead_nodes"], "fold_shapes") == ["fold_shapes", "eliminate_dead_nodes"]


def test_idempotent_pass_not_rerun_while_nothing_changed(
    tmp_path: Path, registered: list[str]
) -> None:
    path = _model(tmp_path / "m.onnx")
    idem = _register(registered, "t_idempotent")
    again = _register(registered, "t_not_idempotent", idempotent=False)
    change = _register(registered, "t_changes", rewrites=1)
    report = fastopt.optimize(path, passes=["t_idempotent", "t_not_idempotent"] * 2)
    assert len(idem) == 1 and len(again) == 2
    assert [p.unchanged for p in report.passes] == [False, False, True, False]
    # a rewrite in between: it runs again
    idem.clear()
    fastopt.optimize(path, passes=["t_idempotent", "t_changes", "t_idempotent"])
    assert len(idem) == 2 and len(change) == 1
    # a C++ pass: the second eliminate_dead_nodes has nothing new to see
    report = fastopt.optimize(path, passes=["eliminate_dead_nodes"] * 2)
    assert [(p.rewrites, p.unchanged) for p in report.passes] == [(1, False), (0, True)]


def test_cli_summary_counts_passes_not_rerun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _model(tmp_path / "m.onnx")
    argv = ["optimize", path, "--passes", "eliminate_dead_nodes,eliminate_dead_nodes", "-v"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "passes: 1 ran" in out and "1 not rerun" in out
    assert "not rerun: nothing changed since it ran" in out
