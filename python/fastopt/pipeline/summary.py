"""A model's vital statistics: what ``fastopt info`` prints."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Union

from fastopt import _C

Dim = Union[int, str, None]


@dataclass
class ValueSummary:
    name: str
    dtype: str
    shape: list[Dim] | None


@dataclass
class ModelSummary:
    path: str | None
    ir_version: int
    opsets: dict[str, int]
    producer: str
    nodes: int  # all graphs, subgraphs and functions included
    op_histogram: dict[str, int]
    parameters: int
    parameter_bytes: int
    initializers: int
    external_initializers: int
    inputs: list[ValueSummary]
    outputs: list[ValueSummary]
    external_data_files: list[str]
    functions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _value_summary(v: _C.Value) -> ValueSummary:
    shape = v.shape
    return ValueSummary(
        name=v.name,
        dtype=_C.dtype_name(v.dtype) if v.dtype else "unknown",
        shape=list(shape) if shape is not None else None,
    )


def summarize(model: _C.Model) -> ModelSummary:
    """Collects what ``fastopt info`` reports; reads no tensor bytes."""
    # Totals come from C++; only the initializer lists are walked here, never the nodes.
    initializers = [t for g in model.graphs() for t in g.initializers]
    count = len(initializers)
    external = sum(t.is_external for t in initializers)
    histogram = dict(sorted(model.op_counts().items(), key=lambda kv: (-kv[1], kv[0])))
    return ModelSummary(
        path=model.path,
        ir_version=model.ir_version,
        opsets=dict(model.opset_imports),
        producer=" ".join(p for p in (model.producer_name, model.producer_version) if p),
        nodes=sum(histogram.values()),
        op_histogram=histogram,
        parameters=model.num_parameters(),
        parameter_bytes=model.parameter_bytes(),
        initializers=count,
        external_initializers=external,
        inputs=[_value_summary(v) for v in model.graph.inputs if v is not None],
        outputs=[_value_summary(v) for v in model.graph.outputs if v is not None],
        external_data_files=[
            os.path.relpath(p, model.base_dir) if model.base_dir else p
            for p in model.external_data_files()
        ],
        functions=[f"{f.domain}::{f.name}" if f.domain else f.name for f in model.functions],
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
