"""Helpers for the folding tests: small models from onnx.helper, passes run through
fastopt.optimize, ONNX Runtime parity (optimizations off) on the original and the result."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
from conftest import assert_outputs_identical, random_feeds, run_ort
from onnx import helper, numpy_helper


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto] = (),
    outputs: Sequence[onnx.ValueInfoProto] = (),
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 17,
    functions: Sequence[onnx.FunctionProto] = (),
    extra_opsets: Sequence[onnx.OperatorSetIdProto] = (),
) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(a, name) for name, a in (initializers or {}).items()]
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
        functions=list(functions),
    )
    model.ir_version = 8 if opset <= 17 else 10
    # The checker wants a shape on every graph output: fill missing ones from shape inference.
    missing = [o for o in model.graph.output if not o.type.tensor_type.HasField("shape")]
    if missing:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True).graph.output
        by_name = {o.name: o for o in inferred}
        for o in missing:
            shape = by_name[o.name].type.tensor_type.shape
            o.type.tensor_type.shape.CopyFrom(shape)
            if not o.type.tensor_type.HasField("shape"):
                o.type.tensor_type.shape.dim.add().dim_param = "n"
    return model


def out(name: str, elem_type: int, shape: Sequence[int | str | None] | None = None):
    return helper.make_tensor_value_info(name, elem_type, shape)


def optimize(
    model: onnx.ModelProto | fastopt.Model,
    passes: Sequence[str],
    tmp_path: Path,
    options: dict[str, object] | None = None,
    name: str = "optimized.onnx",
) -> tuple[fastopt.OptimizeReport, Path]:
    """Runs `passes`, verifies the IR, saves the result and runs the onnx checker on it."""
    m = model if isinstance(model, fastopt.Model) else fastopt.from_onnx(model)
    path = tmp_path / name
    report = fastopt.optimize(m, passes=list(passes), output=path, options=options)
    assert report.model is not None
    report.model.verify()
    onnx.checker.check_model(str(path), full_check=True)
    return report, path


def assert_parity(
    original: onnx.ModelProto | Path,
    optimized: Path,
    tmp_path: Path,
    feeds: dict[str, Any] | None = None,
) -> list[Any]:
    """Bit-identical outputs of the original and the optimized model in ONNX Runtime."""
    if isinstance(original, onnx.ModelProto):
        path = tmp_path / "original.onnx"
        onnx.save(original, str(path))
        proto = original
    else:
        path = original
        proto = onnx.load(str(path))
    if feeds is None:
        feeds = random_feeds(proto)
    expected = run_ort(path, feeds)
    actual = run_ort(optimized, feeds)
    assert_outputs_identical(expected, actual)
    return actual


def op_counts(path: Path) -> dict[str, int]:
    return fastopt.load(path).op_counts()
