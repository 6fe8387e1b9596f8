"""``fastopt info``: a summary of a model (opsets, ops, parameters, inputs)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import fastopt
from fastopt.cli.output import console, print_table
from fastopt.pipeline.summary import ModelSummary, human_bytes, human_count, summarize


def _shape_text(shape: Sequence[object] | None) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _print_info(s: ModelSummary, console: Console, top: int) -> None:
    console.print(f"[bold]{escape(s.path or '<memory>')}[/bold]")
    opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in s.opsets.items())
    console.print(f"IR version {s.ir_version}; opsets: {opsets}")
    console.print(f"producer: {s.producer or '-'}")
    console.print(
        f"nodes: {s.nodes}; parameters: {human_count(s.parameters)} ({s.parameters}) in "
        f"{s.initializers} initializers, {human_bytes(s.parameter_bytes)}"
        + (f", {s.external_initializers} external" if s.external_initializers else "")
    )
    if s.external_data_files:
        console.print("external data: " + ", ".join(s.external_data_files))
    if s.functions:
        console.print("functions: " + ", ".join(s.functions))

    io = Table(title="inputs / outputs", show_edge=False)
    for col in ("", "name", "dtype", "shape"):
        io.add_column(col)
    for kind, values in (("in", s.inputs), ("out", s.outputs)):
        for v in values:
            io.add_row(kind, escape(v.name), v.dtype, escape(_shape_text(v.shape)))
    print_table(console, io)

    ops = Table(title="operators", show_edge=False)
    ops.add_column("op")
    ops.add_column("count", justify="right")
    items = list(s.op_histogram.items())
    for op, n in items[:top]:
        ops.add_row(escape(op), str(n))
    if len(items) > top:
        ops.add_row(f"... {len(items) - top} more", str(sum(n for _, n in items[top:])))
    print_table(console, ops)


def _cmd_info(args: argparse.Namespace) -> int:
    model = fastopt.load(args.model)
    s = summarize(model)
    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
    else:
        _print_info(s, console(), args.top)
    return 0


def add_parser(sub: Any) -> None:
    info = sub.add_parser("info", help="summarize a model: opsets, ops, parameters, inputs")
    info.add_argument("model", help="path to an .onnx file")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--top", type=int, default=40, help="operators to list (default 40)")
    info.set_defaults(func=_cmd_info)
