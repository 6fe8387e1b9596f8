"""IR version < 4: every initializer is also listed as a graph input. Those are weights (ONNX
Runtime treats them as constants too): passes may fold them, new initializers must be listed
as inputs again, and unused ones go away with their input entries."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _ir3_model() -> onnx.ModelProto:
    # Y = X * (a + b): a + b folds into a new initializer.
    a = numpy_helper.from_array(np.full((3,), 2.0, np.float32), "a")
    b = numpy_helper.from_array(np.full((3,), 0.5, np.float32), "b")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("X", "a", "b")]
    g = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["X", "s"], ["Y"])],
        "g",
        inputs,
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3])],
        [a, b],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 8)])
    m.ir_version = 3
    return m


def test_ir3_weights_fold_and_stay_listed_as_inputs(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save(_ir3_model(), src)
    out = tmp_path / "out.onnx"
    report = fastopt.optimize(src, passes=["fold_constants", "eliminate_dead_nodes"], output=out)
    # In IR < 4 the folded value stays a Constant node: an initializer would be a new input.
    assert report.ops_after == {"Constant": 1, "Mul": 1}
    saved = onnx.load(out)
    onnx.checker.check_model(saved, full_check=True)  # IR 3: initializers must be inputs
    inits = {t.name for t in saved.graph.initializer}
    inputs = {i.name for i in saved.graph.input}
    assert inits <= inputs and "a" not in inits and "b" not in inits
    assert inputs == {"X"} | inits
    fastopt.verify(src, out, inputs={"X": np.arange(3, dtype=np.float32)})


def test_ir3_new_initializers_are_listed_as_inputs(tmp_path: Path) -> None:
    """A pass that adds an initializer (here: through a Python rewrite) lists it as an input."""
    p = fastopt.Pattern("mul_to_mul")
    x = p.var("x")
    p.root(p.op("Mul", [x, p.var("s")]))

    def rewrite(match: fastopt.Match, rw: fastopt.Rewriter):  # X * s -> X * 2.5 (s == 2.5)
        w = rw.initializer("w", np.full((3,), 2.5, np.float32))
        return [rw.op("Mul", [match["x"], w])[0]]

    m = fastopt.from_onnx(_ir3_model())
    assert fastopt.apply_rules(m, [fastopt.Rule("r", p, rewrite=rewrite)], max_iterations=1)[0]
    fastopt.optimize(m, passes=["eliminate_dead_nodes"])
    out = tmp_path / "o.onnx"
    m.save(out)
    saved = onnx.load(out)
    onnx.checker.check_model(saved, full_check=True)
    assert {i.name for i in saved.graph.input} == {"X"} | {t.name for t in saved.graph.initializer}
    fastopt.verify(_write(tmp_path), out, inputs={"X": np.arange(3, dtype=np.float32)})


def _write(tmp_path: Path) -> Path:
    p = tmp_path / "orig.onnx"
    onnx.save(_ir3_model(), p)
    return p


def test_ir4_initializer_inputs_stay_overridable(tmp_path: Path) -> None:
    proto = _ir3_model()
    proto.ir_version = 4  # now a and b are real, overridable inputs with defaults
    m = fastopt.from_onnx(proto)
    report = fastopt.optimize(m, passes=["fold_constants", "eliminate_dead_nodes"])
    assert report.ops_after == {"Add": 1, "Mul": 1}
    assert [v.name for v in m.graph.inputs] == ["X", "a", "b"]
