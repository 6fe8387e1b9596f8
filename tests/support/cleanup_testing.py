"""Helpers for the cleanup-pass tests: build small graphs, run a pass, check everything.

`check_pass` is the one call a rewrite test makes: it checks the input with onnx.checker, runs
the pass, runs `Model.verify()`, checks the output with onnx.checker, compares ONNX Runtime
outputs (ORT_DISABLE_ALL, same inputs) bit for bit, and checks that a second run rewrites
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from conftest import assert_outputs_identical, random_feeds
from onnx import helper

INT64_MAX = 2**63 - 1


def model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    value_info: Sequence[onnx.ValueInfoProto] = (),
    opset: int = 17,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "g", list(inputs), list(outputs), list(initializers), value_info=value_info
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def vi(name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def ints(name: str, values: Sequence[int]) -> onnx.TensorProto:
    """An int64 1-D initializer."""
    return helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], list(values))


def session(proto: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def optimize(proto: onnx.ModelProto, passes: Sequence[str]) -> fastopt.OptimizeReport:
    return fastopt.optimize(fastopt.from_onnx(proto), passes=list(passes))


def check_pass(
    proto: onnx.ModelProto,
    passes: str | Sequence[str],
    *,
    rewrites: int | None = None,
    feeds: dict[str, Any] | None = None,
    run_ort: bool = True,
) -> onnx.ModelProto:
    """Runs `passes` and checks the result (see the module docstring); returns the output."""
    names = [passes] if isinstance(passes, str) else list(passes)
    onnx.checker.check_model(proto)
    report = optimize(proto, names)
    assert report.model is not None
    report.model.verify()
    if rewrites is not None:
        assert report.rewrites == rewrites, [
            (p.name, p.rewrites, p.counters) for p in report.passes
        ]
    out = report.model.to_onnx()
    onnx.checker.check_model(out)
    assert [o.name for o in out.graph.output] == [o.name for o in proto.graph.output]
    assert [i.name for i in out.graph.input] == [i.name for i in proto.graph.input]
    again = fastopt.optimize(report.model, passes=names)
    assert again.rewrites == 0, [(p.name, p.rewrites, p.counters) for p in again.passes]
    if run_ort:
        feeds = feeds if feeds is not None else random_feeds(proto)
        expected = session(proto).run(None, feeds)
        assert_outputs_identical(expected, session(out).run(None, feeds))
    return out


def ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def node(proto: onnx.ModelProto, op_type: str) -> onnx.NodeProto:
    (found,) = [n for n in proto.graph.node if n.op_type == op_type]
    return found


def attr(n: onnx.NodeProto, name: str) -> Any:
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    raise KeyError(name)


def const_input(proto: onnx.ModelProto, n: onnx.NodeProto, index: int) -> np.ndarray:
    """The value of a node's constant input (initializer or Constant node)."""
    name = n.input[index]
    for t in proto.graph.initializer:
        if t.name == name:
            return onnx.numpy_helper.to_array(t)
    for c in proto.graph.node:
        if c.op_type == "Constant" and c.output[0] == name:
            return onnx.numpy_helper.to_array(attr(c, "value"))
    raise KeyError(name)
