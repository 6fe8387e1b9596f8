"""``fastopt quantize``: the subcommand, and the quantization flags ``fastopt optimize
--quantize MODE`` shares with it."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from rich.markup import escape
from rich.table import Table

import fastopt
from fastopt.cli_optimize import _files_size, parse_options
from fastopt.cli_output import console, print_table
from fastopt.cli_progress import CommandProgress
from fastopt.fp16_ranges import RangeCheck
from fastopt.optimize import PassReport
from fastopt.quant_settings import MODES, Mode, QuantSettings, QuantSummary, WeightQuantization
from fastopt.summary import human_bytes
from fastopt.verify import OutputRejectedError


def add_parser(sub: Any) -> None:
    qnt = sub.add_parser(
        "quantize",
        help="quantize a model: weight-only int4/int8, int8 dynamic, fp16/bf16 (the input is "
        "never modified)",
    )
    qnt.add_argument("model", help="input .onnx file")
    qnt.add_argument("-o", "--output", required=True, help="output .onnx file")
    qnt.add_argument(
        "--mode", required=True, choices=tuple(MODES), help="the quantization: " + "|".join(MODES)
    )
    qnt.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the table of weights (and of ops kept float32); default: a summary line",
    )
    qnt.add_argument(
        "--target",
        choices=("ort", "onnx"),
        default="ort",
        help="ort: com.microsoft ops (MatMulNBits, ...); onnx: standard ops (opset 21 QDQ)",
    )
    qnt.add_argument(
        "--verify",
        action="store_true",
        help="compare with the original: logits cosine, max error relative to the logit "
        "scale, top-1 agreement",
    )
    qnt.add_argument("--report", help="write a JSON report here")
    qnt.add_argument(
        "--external-data",
        choices=("auto", "always", "never"),
        default="auto",
        help="auto: external data only when the model is over 2 GB",
    )
    qnt.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the passes (repeatable; `fastopt passes` lists them)",
    )
    add_quant_flags(qnt)
    qnt.set_defaults(func=run_command)


def add_quant_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--block-size", type=int, default=32, help="int4/int8: power of two in 16..256 (32)"
    )
    sym = p.add_mutually_exclusive_group()
    sym.add_argument(
        "--symmetric", dest="symmetric", action="store_true", default=True, help="(default)"
    )
    sym.add_argument(
        "--asymmetric",
        dest="symmetric",
        action="store_false",
        help="int4/int8: a zero point per block (uses the full range of lopsided weights)",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        help="MatMulNBits accuracy_level 0..4 (default 4; 0 with --option cuda=1)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="node or weight names kept in float (repeatable)",
    )
    p.add_argument("--lm-head", choices=("keep", "int4", "int8"), help="default: as the rest")
    p.add_argument(
        "--embeddings",
        choices=("keep", "int4", "int8"),
        default="keep",
        help="the token embedding table (a Gather): keep in float (default) or quantize it "
        "(GatherBlockQuantized, target ort)",
    )
    p.add_argument("--per-channel", action="store_true", help="int8-dynamic: per-column scales")
    p.add_argument("--keep-io-types", action="store_true", help="fp16/bf16: float32 inputs/outputs")
    p.add_argument(
        "--fp16-ranges",
        choices=("on", "off"),
        default="on",
        help="fp16: run the float model on sample inputs first and keep the ops whose values "
        "overflow fp16 (reach 65504/4) float32 (default on)",
    )
    p.add_argument("--threads", type=int, default=0, help="quantizing threads (0: all cores)")


def quant_settings(args: argparse.Namespace, mode: Mode, output: str | None) -> QuantSettings:
    return QuantSettings(
        mode=mode,
        block_size=args.block_size,
        symmetric=args.symmetric,
        accuracy_level=args.accuracy_level,
        exclude=tuple(args.exclude),
        lm_head=args.lm_head,
        embeddings=args.embeddings,
        per_channel=args.per_channel,
        keep_io_types=args.keep_io_types,
        fp16_ranges=args.fp16_ranges == "on",
        threads=args.threads,
        tmpdir=os.path.dirname(os.path.abspath(output)) if output else "",
    )


def print_quantization(weights: list[WeightQuantization], out: Any, verbose: bool = False) -> None:
    """The summary line of a quantization; with `verbose` first the table of weights (plain
    text in pipes, no name truncated: cli_output.print_table)."""
    if not weights:
        return
    s = QuantSummary.of(weights)
    if verbose:
        table = Table(title="weights", show_edge=False)
        # The action (with a kept weight's reason) last: print_table wraps the last column.
        for col, justify in (
            ("weight", "left"),
            ("type", "left"),
            ("bytes", "right"),
            ("max rel err", "right"),
            ("mean rel err", "right"),
            ("action", "left"),
        ):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for w in (w for w in weights if w.bytes_before):
            action = w.action if w.action == "quantized" else f"kept: {w.reason}"
            table.add_row(
                escape(w.weight),
                escape(f"{w.dtype_before} -> {w.dtype_after}" if w.dtype_after else w.dtype_before),
                f"{human_bytes(w.bytes_before)} -> {human_bytes(w.bytes_after)}",
                f"{w.max_rel_error:.4f}" if w.action == "quantized" else "",
                f"{w.mean_rel_error:.4f}" if w.action == "quantized" else "",
                escape(action),
            )
        print_table(out, table)
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(s.kept_reasons.items()))
    out.print(
        f"quantized {s.quantized} weights, kept {s.kept}"
        + (f" ({reasons})" if reasons else "")
        + f"; {human_bytes(s.bytes_before)} -> {human_bytes(s.bytes_after)}",
        markup=False,
        highlight=False,
    )


def print_precision(
    check: RangeCheck | None,
    passes: list[PassReport],
    mode: str,
    out: Any,
    verbose: bool = False,
) -> None:
    """fp16/bf16: the range check's summary (with `verbose`, first the ops it kept float32 with
    the magnitudes that decided), and a warning line for values clamped to the new type's
    range."""
    if check is not None:
        if check.kept and verbose:
            table = Table(title="ops that stay float32 (values near fp16's limit)", show_edge=False)
            for col in ("node", "op", "why"):
                table.add_column(col)
            for k in check.kept:
                table.add_row(escape(k.node), escape(k.op), escape(k.reason))
            print_table(out, table)
        if check.skipped:
            console(stderr=True).print(f"warning: {check.summary()}", markup=False, highlight=False)
        else:
            out.print(escape(check.summary()), highlight=False)
    clamped = sum(p.counters.get("values_clamped", 0) for p in passes)
    if clamped:
        err = console(stderr=True)
        limit = "±65504" if mode == "fp16" else "±3.39e38"
        values = f"{clamped} value{'s' if clamped != 1 else ''}"
        err.print(
            f"warning: {values} of weights or constants beyond {mode}'s range clamped to "
            f"{limit} (the weights' reasons in the report name them)",
            markup=False,
            highlight=False,
        )


def work_progress(progress: CommandProgress) -> Callable[[int, int, str], None]:
    """A quantization pass's (done, total, what) reports, shown as a percentage."""

    def on_work(done: int, total: int, what: str) -> None:
        if total and done >= total:  # what follows (saving, checks) gives no news
            progress.update("quantized; saving and checking")
        else:
            progress.update(what or "quantizing", done, total)

    return on_work


def run_command(args: argparse.Namespace) -> int:
    if os.path.abspath(args.output) == os.path.abspath(args.model):
        raise fastopt.ModelError(
            "the output path must differ from the input (it is never modified)"
        )
    settings = quant_settings(args, args.mode, args.output)
    settings.validate()
    external = {"auto": None, "always": True, "never": False}[args.external_data]
    with CommandProgress("quantize") as progress:
        try:
            report = fastopt.quantize(
                args.model,
                args.output,
                mode=settings.mode,
                block_size=settings.block_size,
                symmetric=settings.symmetric,
                accuracy_level=settings.accuracy_level,
                exclude=settings.exclude,
                lm_head=settings.lm_head,
                embeddings=settings.embeddings,
                per_channel=settings.per_channel,
                keep_io_types=settings.keep_io_types,
                fp16_ranges=settings.fp16_ranges,
                target=args.target,
                threads=settings.threads,
                verify=args.verify,
                options=parse_options(args.option),
                external_data=external,
                progress=work_progress(progress),
            )
        except OutputRejectedError as e:
            # ORT runs the original but not the output fastopt wrote: a failed verification (1).
            console(stderr=True).print(f"verification failed: {e}", markup=False, highlight=False)
            return 1
    out = console()
    print_quantization(report.weights, out, verbose=args.verbose)
    print_precision(report.range_check, report.passes, settings.mode, out, verbose=args.verbose)
    out.print(
        f"{escape(args.model)} -> {escape(args.output)} ({human_bytes(_files_size(args.output))}) "
        f"in {report.seconds:.2f} s"
    )
    code = 0
    if report.verify is not None:
        out.print(escape(str(report.verify)))
        # Not verified (ORT's CPU provider has no bf16 kernels): the line says why; not a failure.
        code = 0 if report.verify.ok or report.verify.skipped else 1
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report.to_dict(), f, indent=2, default=str)
    return code
