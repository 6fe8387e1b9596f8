"""``fastopt quantize``: the subcommand (the quantization flags it shares with ``fastopt optimize
--quantize MODE`` are in common.py)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.markup import escape

import fastopt
from fastopt.cli.common import (
    add_hf_config_flag,
    add_quant_flags,
    add_text_flags,
    files_size,
    parse_options,
    print_genai_notes,
    print_precision,
    print_quantization,
    work_progress,
)
from fastopt.cli.output import console
from fastopt.cli.progress import CommandProgress
from fastopt.cli.recipe_flags import add_recipe_flags, print_recipe, resolved_settings
from fastopt.pipeline.summary import human_bytes
from fastopt.quant.settings import MODES
from fastopt.verify.core import OutputRejectedError


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
        help="compare with the original: a causal LM on real text (perplexity ratio, KL, "
        "top-1; the built-in prose with the tokenizer.json beside the model, else text sampled "
        "from the original), other models by logits cosine, max relative error, top-1",
    )
    add_text_flags(qnt)
    qnt.add_argument(
        "--no-run-check",
        action="store_true",
        help="write the output without first loading it in ONNX Runtime (CPU; the session, and "
        "one run at batch 1 x 2 tokens where that reads or makes at most 256 MiB of weights)",
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
    add_hf_config_flag(qnt)
    add_quant_flags(qnt)
    add_recipe_flags(qnt)
    qnt.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    if os.path.abspath(args.output) == os.path.abspath(args.model):
        raise fastopt.ModelError(
            "the output path must differ from the input (it is never modified)"
        )
    settings = resolved_settings(args, args.mode, args.output)
    external = {"auto": None, "always": True, "never": False}[args.external_data]
    with CommandProgress("quantize") as progress:
        try:
            report = fastopt.quantize(
                args.model,
                args.output,
                mode=settings.mode,
                block_size=settings.block_size,
                symmetric=settings.symmetric,
                method=settings.method,
                importance=settings.importance or None,
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
                run_check=not args.no_run_check,
                verify_text=args.verify_text,
                tokenizer=args.tokenizer,
                options=parse_options(args.option),
                external_data=external,
                progress=work_progress(progress),
                hf_config=args.hf_config,
                calibration=settings.calibration,
                awq=settings.awq,
                bits_budget=settings.bits_budget,
                importance_output=settings.importance_output,
                recipe=args.recipe,
            )
        except OutputRejectedError as e:
            # ORT runs the original but not the output fastopt wrote: a failed verification (1).
            console(stderr=True).print(f"verification failed: {e}", markup=False, highlight=False)
            return 1
    out = console()
    print_quantization(report.weights, out, verbose=args.verbose)
    print_precision(report.range_check, report.passes, settings.mode, out, verbose=args.verbose)
    print_genai_notes(report.genai_notes, out)
    accuracy = f"; {report.verify.accuracy}" if report.verify and report.verify.accuracy else ""
    if report.recipe is not None:
        print_recipe(report.recipe, out, verbose=args.verbose or settings.bits_budget is not None)
    out.print(
        f"{escape(args.model)} -> {escape(args.output)} ({human_bytes(files_size(args.output))}) "
        f"in {report.seconds:.2f} s{escape(accuracy)}"
    )
    if report.run_check:
        out.print(f"run check: {report.run_check}", markup=False, highlight=False)
    code = 0
    if report.verify is not None:
        out.print(escape(str(report.verify)))
        # Not verified (ORT's CPU provider has no bf16 kernels): the line says why; not a failure.
        code = 0 if report.verify.ok or report.verify.skipped else 1
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report.to_dict(), f, indent=2, default=str)
    return code
