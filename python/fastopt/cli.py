"""The ``fastopt`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import fastopt
from fastopt.bench.command import add_parser as add_bench_parser
from fastopt.optimize import OptimizeReport
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
    console.print(io)

    ops = Table(title="operators", show_edge=False)
    ops.add_column("op")
    ops.add_column("count", justify="right")
    items = list(s.op_histogram.items())
    for op, n in items[:top]:
        ops.add_row(escape(op), str(n))
    if len(items) > top:
        ops.add_row(f"... {len(items) - top} more", str(sum(n for _, n in items[top:])))
    console.print(ops)


def _cmd_info(args: argparse.Namespace) -> int:
    model = fastopt.load(args.model)
    s = summarize(model)
    if args.json:
        print(json.dumps(s.to_dict(), indent=2))
    else:
        _print_info(s, Console(), args.top)
    return 0


def _print_optimize(report: OptimizeReport, console: Console, input_path: str) -> None:
    passes = Table(title="passes", show_edge=False)
    for col, justify in (
        ("pass", "left"),
        ("rewrites", "right"),
        ("ms", "right"),
        ("nodes after", "right"),
        ("details", "left"),
    ):
        passes.add_column(col, justify=justify)  # type: ignore[arg-type]
    for p in report.passes:
        details = (p.skipped and f"skipped: {p.skipped}") or ", ".join(
            f"{k} {v}" for k, v in sorted(p.counters.items())
        )
        passes.add_row(
            escape(p.name),
            str(p.rewrites),
            f"{p.seconds * 1e3:.1f}",
            str(p.nodes_after),
            escape(details),
        )
    console.print(passes)

    ops = Table(title="operators (changed)", show_edge=False)
    for col in ("op", "before", "after"):
        ops.add_column(col, justify="left" if col == "op" else "right")
    for op, (before, after) in report.op_delta().items():
        ops.add_row(escape(op), str(before), str(after))
    ops.add_row("[bold]all nodes[/bold]", str(report.nodes_before), str(report.nodes_after))
    console.print(ops)
    size = ""
    if report.output:
        size = f"; wrote {escape(report.output)} ({human_bytes(_files_size(report.output))})"
    console.print(
        f"{escape(input_path)}: {report.nodes_before} -> {report.nodes_after} nodes "
        f"in {report.seconds:.2f} s{size}"
    )


def _files_size(model_path: str) -> int:
    import os

    total = os.path.getsize(model_path)
    folder = os.path.dirname(os.path.abspath(model_path))
    base = os.path.basename(model_path) + ".data"
    for name in os.listdir(folder):
        if name == base or name.startswith(base + "."):
            total += os.path.getsize(os.path.join(folder, name))
    return total


def _parse_options(items: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option takes KEY=VALUE, not {item!r}")
        try:
            options[key] = int(value)
        except ValueError:
            options[key] = value
    return options


def _cmd_optimize(args: argparse.Namespace) -> int:
    import os

    if args.output and os.path.abspath(args.output) == os.path.abspath(args.model):
        raise fastopt.ModelError(
            "the output path must differ from the input (it is never modified)"
        )
    passes = [p for p in args.passes.split(",") if p] if args.passes else None
    external = {"auto": None, "always": True, "never": False}[args.external_data]
    console = Console(stderr=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("optimizing", total=None)

        def on_pass(i: int, n: int, name: str) -> None:
            progress.update(task, total=n, completed=i, description=name or "saving")

        report = fastopt.optimize(
            args.model,
            preset=args.preset,
            passes=passes,
            target=args.target,
            output=args.output,
            external_data=external,
            explain=args.explain,
            progress=on_pass,
            options=_parse_options(args.option),
            kv_cache=args.kv_cache,
        )
    out = Console()
    if args.explain:
        for line in report.explain:
            out.print(escape(line))
    _print_optimize(report, out, args.model)
    result: dict[str, object] = {"optimize": report.to_dict()}
    code = 0
    if args.verify:
        if not args.output:
            raise fastopt.ModelError("--verify needs -o/--output")
        from fastopt.verify import VerifyError, verify

        try:
            vreport = verify(args.model, args.output, providers=_parse_providers(args.providers))
            out.print(str(vreport))
            result["verify"] = vreport.to_dict()
        except VerifyError as e:
            out.print(f"[red]verification failed[/red]: {escape(str(e))}")
            result["verify"] = {"error": str(e)}
            code = 1
    if args.report:
        with open(args.report, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return code


def _parse_providers(text: str | None) -> list[str] | None:
    """``cpu,cuda`` -> ["cpu", "cuda"]; None when not given."""
    if not text:
        return None
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--providers takes comma-separated names, not {text!r}")
    return names


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

    providers = _parse_providers(args.providers)
    if providers:
        check_providers(providers)  # an unavailable provider is bad input, before any work
    dims = _parse_dims(args.dims)
    result: dict[str, object] = {}
    code = 0
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
    table = Table(show_edge=False)
    for col in ("pass", "lang", "opsets", "idempotent", "tags", "description"):
        table.add_column(col)
    for p in fastopt.all_passes():
        opsets = f"{p.min_opset}+" if p.max_opset is None else f"{p.min_opset}-{p.max_opset}"
        table.add_row(
            p.name,
            p.language,
            opsets,
            "yes" if p.idempotent else "no",
            ",".join(p.tags),
            escape(p.description),
        )
    Console().print(table)
    presets = Table(title="presets", show_edge=False)
    presets.add_column("preset")
    presets.add_column("passes")
    for name, names in fastopt.PRESETS.items():
        presets.add_row(name, ", ".join(names))
    Console().print(presets)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastopt", description="Fast ONNX graph optimizer for large language models."
    )
    parser.add_argument("--version", action="version", version=f"fastopt {fastopt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="summarize a model: opsets, ops, parameters, inputs")
    info.add_argument("model", help="path to an .onnx file")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--top", type=int, default=40, help="operators to list (default 40)")
    info.set_defaults(func=_cmd_info)

    opt = sub.add_parser("optimize", help="optimize a model (the input is never modified)")
    opt.add_argument("model", help="input .onnx file")
    opt.add_argument("-o", "--output", help="output .onnx file")
    opt.add_argument("--preset", default="default", help="pass list to run (default: default)")
    opt.add_argument("--passes", help="comma-separated pass names (overrides --preset)")
    opt.add_argument(
        "--target",
        choices=("ort", "onnx"),
        default="ort",
        help="ort: ONNX Runtime contrib ops allowed; onnx: standard ops only",
    )
    opt.add_argument(
        "--external-data",
        choices=("auto", "always", "never"),
        default="auto",
        help="auto: external data only when the model is over 2 GB",
    )
    opt.add_argument(
        "--verify", action="store_true", help="compare outputs of input and output in ONNX Runtime"
    )
    opt.add_argument(
        "--providers",
        metavar="LIST",
        help="with --verify: comma-separated execution providers (cpu, cuda, ...); several "
        "compare across providers too",
    )
    opt.add_argument("--report", help="write a JSON report here")
    opt.add_argument(
        "--explain",
        metavar="RULE",
        help="explain, per candidate node, why RULE did or did not apply ('*': all)",
    )
    opt.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the passes, e.g. --option opset=18 for convert_version "
        "(repeatable; integers are parsed as integers)",
    )
    opt.add_argument(
        "--kv-cache",
        choices=("standard", "inplace"),
        help="turn a decoder exported without a KV cache into one with a cache (preset llm): "
        "standard = growing past/present; inplace = one max-length buffer per layer shared by "
        "past and present (target ort); writes genai_config.json next to the output",
    )
    opt.set_defaults(func=_cmd_optimize)

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

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except fastopt.ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, KeyError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
