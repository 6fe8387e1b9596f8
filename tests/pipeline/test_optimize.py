"""fastopt.optimize, the pass registry and presets, and the `fastopt optimize` / `passes` CLI."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper


def _model_with_identities(opset: int = 17) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])
    nodes = [
        helper.make_node("Identity", ["X"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("Identity", ["b"], ["c"]),
        helper.make_node("Neg", ["c"], ["Y"]),
        helper.make_node("Sigmoid", ["X"], ["unused"]),  # dead
    ]
    g = helper.make_graph(nodes, "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    p = tmp_path / "in.onnx"
    onnx.save(_model_with_identities(), p)
    return p


def test_report_counts_rewrites_and_ops(model_path: Path, tmp_path: Path) -> None:
    before = hashlib.sha256(model_path.read_bytes()).hexdigest()
    report = fastopt.optimize(
        model_path,
        passes=["eliminate_identity", "eliminate_dead_nodes"],
        output=tmp_path / "out.onnx",
    )
    assert [p.name for p in report.passes] == ["eliminate_identity", "eliminate_dead_nodes"]
    assert report.passes[0].rewrites == 2
    assert report.passes[0].counters == {"eliminate_identity": 2}
    assert report.passes[1].rewrites == 1
    assert report.nodes_before == 5 and report.nodes_after == 2
    assert report.op_delta() == {"Identity": (2, 0), "Sigmoid": (1, 0)}
    json.dumps(report.to_dict())  # JSON-able, without the model handle
    assert hashlib.sha256(model_path.read_bytes()).hexdigest() == before
    out = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(out, full_check=True)
    fastopt.verify(model_path, tmp_path / "out.onnx")


def test_python_pass_registration_and_opset_range(model_path: Path) -> None:
    seen: list[int] = []

    @fastopt.register_pass("test_count_nodes", "counts nodes (test)", tags=("test",), min_opset=18)
    def count_nodes(ctx: fastopt.PassContext) -> int:
        seen.append(ctx.model.graph.node_count)
        return 0

    try:
        spec = fastopt.get_pass("test_count_nodes")
        assert spec.language == "python" and spec.min_opset == 18
        assert "test_count_nodes" in [p.name for p in fastopt.all_passes()]
        with pytest.raises(ValueError, match="already registered"):
            fastopt.register_pass("test_count_nodes", "again")(count_nodes)
        # opset 17 model: skipped, with the reason in the report
        report = fastopt.optimize(model_path, passes=["test_count_nodes"])
        assert report.passes[0].skipped == "opset 17" and seen == []
        m = fastopt.from_onnx(_model_with_identities(opset=18))
        fastopt.optimize(m, passes=["test_count_nodes"])
        assert seen == [5]
    finally:
        fastopt.unregister_pass("test_count_nodes")


def test_unknown_pass_and_preset_are_errors(model_path: Path) -> None:
    with pytest.raises(KeyError, match="no pass named 'nope'"):
        fastopt.optimize(model_path, passes=["nope"])
    with pytest.raises(KeyError, match="no preset named 'nope'"):
        fastopt.optimize(model_path, preset="nope")
    with pytest.raises(ValueError, match="target"):
        fastopt.optimize(model_path, target="tensorrt")  # type: ignore[arg-type]


def test_presets_name_registered_passes() -> None:
    known = {p.name for p in fastopt.all_passes()}
    for name, passes in fastopt.PRESETS.items():
        assert passes, name
        assert set(passes) <= known, (name, set(passes) - known)


def test_default_preset_keeps_outputs(model_path: Path, tmp_path: Path) -> None:
    report = fastopt.optimize(model_path, preset="default", output=tmp_path / "o.onnx")
    assert report.nodes_after < report.nodes_before
    fastopt.verify(model_path, tmp_path / "o.onnx")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastopt", *args], capture_output=True, text=True, check=False
    )


def test_cli_optimize_report_and_explain(model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    rep = tmp_path / "report.json"
    r = _cli(
        "optimize",
        str(model_path),
        "-o",
        str(out),
        "--passes",
        "eliminate_identity,eliminate_dead_nodes",
        "--verify",
        "--report",
        str(rep),
        "--explain",
        "eliminate_identity",
    )
    assert r.returncode == 0, r.stderr
    assert "eliminate_identity @ node" in r.stdout
    assert "verify passed" in r.stdout
    data = json.loads(rep.read_text())
    assert data["optimize"]["nodes_after"] == 2
    assert data["verify"]["ok"] is True
    x = np.ones((2, 3), np.float32)
    import onnxruntime as ort

    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {"X": x})[0], -np.maximum(x, 0))


def test_cli_optimize_no_fsync(model_path: Path, tmp_path: Path) -> None:
    """--no-fsync (Model.save(fsync=False)): the same output, written without waiting for the
    disk (tests/io/test_external_data.py counts the calls it skips)."""
    outs = []
    for flags in ([], ["--no-fsync"]):
        out = tmp_path / f"out{len(outs)}.onnx"
        r = _cli("optimize", str(model_path), "-o", str(out), "--verify", *flags)
        assert r.returncode == 0, r.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_cli_errors(model_path: Path, tmp_path: Path) -> None:
    r = _cli("optimize", str(model_path), "-o", str(model_path))
    assert r.returncode == 2 and "must differ" in r.stderr
    r = _cli("optimize", str(model_path), "--passes", "nope")
    assert r.returncode == 2 and r.stderr.startswith("error: ")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08")
    r = _cli("optimize", str(bad), "-o", str(tmp_path / "o.onnx"))
    assert r.returncode == 2 and "error:" in r.stderr and not (tmp_path / "o.onnx").exists()


def test_cli_passes_lists_everything() -> None:
    r = _cli("passes")
    assert r.returncode == 0
    for p in fastopt.all_passes():
        assert p.name[:12] in r.stdout


def test_cli_options_reach_the_passes(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_model_with_identities(opset=13), src)
    out = tmp_path / "o.onnx"
    r = _cli(
        "optimize", str(src), "-o", str(out), "--passes", "convert_version", "--option", "opset=18"
    )
    assert r.returncode == 0, r.stderr
    assert [o.version for o in onnx.load(out).opset_import if o.domain == ""] == [18]
    r = _cli("optimize", str(src), "--passes", "convert_version", "--option", "opset")
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr
