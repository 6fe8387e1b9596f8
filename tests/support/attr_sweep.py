"""Mistyped-attribute sweep over a real export: for each (op, attribute) pair of its graph, one
node at a time gets that attribute in another type (an INT as a STRING, a FLOAT as an INT, ...).
Where ONNX Runtime refuses the result, fastopt's optimized model must still be refused: a node
ORT refuses is never fused, folded or retyped away into a model it runs.

    python tests/support/attr_sweep.py tests/fixtures/models/llama_dynamo_float32/model.onnx
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import fastopt
import onnx
import onnxruntime as ort
from onnx import AttributeProto, helper


def wrong_type(a: AttributeProto) -> AttributeProto | None:
    """`a` as another type, or None for the types the sweep leaves alone (graphs, tensors)."""
    t = a.type
    if t == AttributeProto.INT:
        return helper.make_attribute(a.name, str(a.i))
    if t == AttributeProto.INTS:
        return helper.make_attribute(a.name, ",".join(map(str, a.ints)))
    if t == AttributeProto.FLOAT:
        return helper.make_attribute(a.name, int(a.f) if a.f == int(a.f) else str(a.f))
    if t == AttributeProto.FLOATS:
        return helper.make_attribute(a.name, [int(x) for x in a.floats])
    if t == AttributeProto.STRING:
        return helper.make_attribute(a.name, 1)
    return None


def mutants(model: onnx.ModelProto) -> Iterator[tuple[str, onnx.ModelProto]]:
    """One mutant per (domain, op, attribute) of the main graph: its first node retyped."""
    seen: set[tuple[str, str, str]] = set()
    for i, node in enumerate(model.graph.node):
        for j, a in enumerate(node.attribute):
            key = (node.domain, node.op_type, a.name)
            bad = wrong_type(a)
            if key in seen or bad is None:
                continue
            seen.add(key)
            m = onnx.ModelProto()
            m.CopyFrom(model)
            m.graph.node[i].attribute[j].CopyFrom(bad)
            yield f"{node.op_type}.{a.name} ({node.name or i})", m


def ort_refuses(data: bytes) -> bool:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    except Exception:  # ORT's Fail / InvalidGraph / InvalidArgument
        return True
    return False


def sweep(path: Path, **optimize_kw: object) -> tuple[int, list[str]]:
    """(mutants ORT refuses, the descriptions of those fastopt made ORT accept)."""
    model = onnx.load(str(path))
    refused, accepted = 0, []
    for what, m in mutants(model):
        if not ort_refuses(m.SerializeToString()):
            continue  # ORT reads the attribute leniently: nothing to preserve
        refused += 1
        try:
            report = fastopt.optimize(fastopt.from_onnx(m), **optimize_kw)  # type: ignore[arg-type]
        except fastopt.ModelError:
            continue  # refused with a reason: fine
        assert report.model is not None
        if not ort_refuses(report.model.serialize()):
            accepted.append(what)
    return refused, accepted


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for kw in ({"preset": "default"}, {"preset": "default", "kv_cache": "inplace"}):
            n, bad = sweep(Path(arg), **kw)
            print(f"{arg} {kw}: {n} mutants ORT refuses; fastopt made ORT accept {len(bad)}: {bad}")
