"""The ``fastopt`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import fastopt
from fastopt.bench.command import add_parser as add_bench_parser
from fastopt.cli_genai import add_parser as add_genai_parser
from fastopt.cli_optimize import add_parser as add_optimize_parser
from fastopt.cli_optimize import parse_providers
from fastopt.cli_output import console, print_table
from fastopt.cli_progress import CommandProgress
from fastopt.cli_quantize import add_parser as add_quantize_parser
from fastopt.options import OPTIONS
from fastopt.registry import PRESET_DESCRIPTIONS
from fastopt.summary import ModelSummary, human_bytes, human_count, summarize


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


def _parse_dims(items: list[str]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            dims[key] = int(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise ValueError(f"--dims takes NAME=INTEGER, not {item!r}")
    return dims


def _cmd_check(args: argparse.Namespace) -> int:
    from fastopt.check import CheckError, check_providers
    from fastopt.verify import VerifyError, VerifyReport, compare_providers, verify

    providers = parse_providers(args.providers)
    if providers:
        check_providers(providers)  # an unavailable provider is bad input, before any work
    dims = _parse_dims(args.dims)
    result: dict[str, object] = {}
    code = 0
    with CommandProgress("check") as progress:
        progress.update("onnx.checker, shape inference, ONNX Runtime load")
        try:
            creport = fastopt.check(args.model, providers=providers[:1] if providers else None)
        except CheckError as e:
            creport, code = e.report, 1
    print(creport)
    result["check"] = creport.to_dict()
    # A checker complaint (e.g. ORT's SimplifiedLayerNormalization in the default domain) does
    # not stop ORT from running the model: compare unless ORT could not load it.
    runs = creport.stage("onnxruntime").status == "ok"
    if runs and (providers or args.against):
        vreport: VerifyReport
        try:
            with CommandProgress("check") as progress:
                progress.update("comparing outputs")
                if args.against:
                    vreport = verify(args.against, args.model, dims=dims, providers=providers)
                else:
                    assert providers is not None
                    vreport = compare_providers(args.model, providers, dims=dims)
        except VerifyError as e:
            vreport, code = e.report, 1
        print()
        print(vreport)
        result["verify"] = vreport.to_dict()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return code


def _cmd_passes(args: argparse.Namespace) -> int:
    out = console()
    table = Table(show_edge=False)
    for col in ("pass", "lang", "opsets", "idempotent", "tags", "description"):
        table.add_column(col)
    for p in fastopt.all_passes():
        opsets = f"{p.min_opset}+" if p.max_opset is None else f"{p.min_opset}-{p.max_opset}"
        rules = [r for r in p.rule_names if r != p.name]  # --explain takes these too
        table.add_row(
            escape(p.name),
            p.language,
            opsets,
            "yes" if p.idempotent else "no",
            ",".join(p.tags),
            escape(p.description + (f" (rules: {', '.join(rules)})" if rules else "")),
        )
    print_table(out, table)
    out.print()
    presets = Table(title="presets", show_edge=False)
    presets.add_column("preset")
    presets.add_column("passes")
    for name, names in fastopt.PRESETS.items():
        what = PRESET_DESCRIPTIONS.get(name, "")
        presets.add_row(
            escape(name), escape(f"{what}: {', '.join(names)}" if what else ", ".join(names))
        )
    print_table(out, presets)
    out.print()
    options = Table(title="options (--option KEY=VALUE)", show_edge=False)
    for col in ("option", "passes", "default", "values, meaning"):
        options.add_column(col)
    for spec in OPTIONS.values():
        if spec.internal:
            continue
        default = "-" if spec.default is None else str(spec.default)
        options.add_row(
            escape(spec.name),
            escape(",".join(spec.passes)),
            default,
            escape(f"{spec.values_text()}: {spec.help}"),
        )
    print_table(out, options)
    return 0


def versions() -> str:
    """fastopt's version and those of the libraries it runs with (what a bug report needs)."""

    def version(module: str) -> str:
        try:
            return str(__import__(module).__version__)
        except ImportError:
            return "not installed"

    return (
        f"fastopt {fastopt.__version__}, onnxruntime {version('onnxruntime')}, onnx "
        f"{version('onnx')} (Python {sys.version.split()[0]})"
    )


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(versions())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastopt", description="Fast ONNX graph optimizer for large language models."
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="print the versions of fastopt, ONNX Runtime and onnx, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="summarize a model: opsets, ops, parameters, inputs")
    info.add_argument("model", help="path to an .onnx file")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--top", type=int, default=40, help="operators to list (default 40)")
    info.set_defaults(func=_cmd_info)

    add_optimize_parser(sub)
    add_quantize_parser(sub)

    chk = sub.add_parser(
        "check",
        help="check a model (onnx.checker, strict shape inference, ONNX Runtime load) and "
        "compare its outputs across execution providers",
    )
    chk.add_argument("model", help=".onnx file to check")
    chk.add_argument(
        "--providers",
        metavar="LIST",
        help="comma-separated execution providers (cpu, cuda, tensorrt, dml, ... or ORT names): "
        "run MODEL on each, compare with the first, and report nodes placed on CPU",
    )
    chk.add_argument(
        "--against",
        metavar="ORIGINAL",
        help="also verify MODEL against ORIGINAL (on every provider with --providers)",
    )
    chk.add_argument("--json", metavar="FILE", help="write a JSON report here")
    chk.add_argument(
        "--dims",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=VALUE",
        help="values for symbolic input dims, e.g. --dims batch_size=1 sequence_length=16",
    )
    chk.set_defaults(func=_cmd_check)

    lp = sub.add_parser("passes", help="list the registered passes and presets")
    lp.set_defaults(func=_cmd_passes)

    add_genai_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line. Exit status: 0 success, 1 a failed check or verification, 2 bad
    input (one line ``error: ...`` on stderr, never a traceback), 130 interrupted."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _check_utf8(argv)
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (fastopt.ModelError, OSError, KeyError, ValueError) as e:
        # KeyError is a bad name (fastopt's own say which); ValueError a bad argument value.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {_one_line(str(msg))}", file=sys.stderr)
        return 2


def _check_utf8(argv: Sequence[str]) -> None:
    """Refuses an argument that is not UTF-8 (a file name's undecodable bytes reach Python as
    lone surrogates): paths and names are text for fastopt, onnx and ONNX Runtime alike, and
    each failed on them with its own traceback."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raise fastopt.ModelError(
                f"argument {os.fsencode(arg)!r} is not valid UTF-8; fastopt takes UTF-8 file "
                "names and values (rename the file or folder)"
            ) from None


def _one_line(text: str) -> str:
    """`text` with its line breaks folded: a table in a message stays readable on one line."""
    return " ".join(text.split()) or "unknown error"


if __name__ == "__main__":
    sys.exit(main())
