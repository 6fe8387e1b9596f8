"""``fastopt quantize``: the subcommand (the quantization flags it shares with ``fastopt optimize
--quantize MODE`` are in common.py)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from rich.markup import escape
from rich.table import Table

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
    quant_settings,
    work_progress,
)
from fastopt.cli.output import console, print_table
from fastopt.cli.progress import CommandProgress
from fastopt.pipeline.summary import human_bytes
from fastopt.quant.recipe import RECIPES, RecipeReport, recipe_settings
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
    # None: not given, so a --recipe may set it (apply_recipe fills the usual defaults after)
    qnt.set_defaults(func=run_command, block_size=None, symmetric=None)


def add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """Calibration, AWQ and the bits budget (fastopt quantize only)."""
    p.add_argument(
        "--calibration",
        metavar="FILE|builtin|sampled",
        help="int4/int8: run the float model on this text (or fastopt's built-in prose, or "
        "'sampled': text the model writes itself, no data needed) to measure each weight's "
        "input importance (mean x^2 per channel); fp16: the range check runs on this text too "
        "(real tokens and lengths)",
    )
    p.add_argument(
        "--awq",
        action="store_true",
        help="with --calibration: AWQ per-channel scales folded into the preceding norms",
    )
    p.add_argument(
        "--bits-budget",
        type=float,
        metavar="BITS",
        help="int4: average bits per weight (scales included); the weights that gain most move "
        "to int8",
    )
    p.add_argument("--save-importance", metavar="PATH", help="keep the importance file here")
    p.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        help="int4: settings that go together (flags given explicitly win); q4m: at most 4.6 "
        "bits per weight, scales included, asymmetric blocks of 64 rounded by the search "
        "weighted by --importance norms, int8 for attention V and MLP down projections (with "
        "--calibration: --method gptq)",
    )


# What the quantize flags default to when neither they nor a recipe set them.
_FLAG_DEFAULTS = {"block_size": 32, "symmetric": True}


def apply_recipe(args: argparse.Namespace) -> None:
    """Fills the flags the user did not give (None) from --recipe, then from their defaults."""
    given = recipe_settings(args.recipe, bool(args.calibration)) if args.recipe else {}
    if given and args.mode != "int4":
        raise fastopt.ModelError(f"recipe {args.recipe} is an int4 recipe, not {args.mode}")
    for key, value in given.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key, value in _FLAG_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def print_recipe(recipe: RecipeReport, out: Any, verbose: bool = False) -> None:
    """Calibration, AWQ and the bits allocation: a line each; the allocation's table (each
    weight's bits and error at int4 / int8) when `verbose`."""
    cal = recipe.calibration
    if cal is not None:
        out.print(
            f"calibration: {cal.tokens} tokens from {cal.source}; {len(cal.vectors)} importance "
            f"vectors in {cal.seconds:.2f} s (ONNX Runtime runs {cal.forward_seconds:.2f} s"
            + (
                f", sampling the text {cal.sampling_seconds:.2f} s)"
                if cal.sampling_seconds
                else ")"
            ),
            markup=False,
            highlight=False,
        )
    if recipe.awq is not None:
        scaled = recipe.awq.scaled
        if not recipe.awq.groups:
            out.print(
                "awq: no norm or scale feeds float32 weight MatMuls (it rewrites float32 only)",
                markup=False,
                highlight=False,
            )
        before = sum(g.error_before for g in scaled)
        after = sum(g.error_after for g in scaled)
        drop = f", estimated error {after / before:.2f}x" if before else ""
        if recipe.awq.groups:
            out.print(
                f"awq: {len(scaled)} of {len(recipe.awq.groups)} scale groups scaled{drop}",
                markup=False,
                highlight=False,
            )
    if recipe.norm_importance:
        out.print(
            f"importance: estimated from the weights for {recipe.norm_importance} weights (norms)",
            markup=False,
            highlight=False,
        )
    for note in recipe.notes:
        out.print(note, markup=False, highlight=False)
    if recipe.gptq is not None:
        g = recipe.gptq
        out.print(
            f"gptq: X^T X factors for {g.weights} weights ({g.factors} distinct, "
            f"{g.bytes / 2**20:.0f} MiB) in {g.seconds:.2f} s",
            markup=False,
            highlight=False,
        )
    alloc = recipe.allocation
    if alloc is None:
        return
    if verbose:
        table = Table(title="bits per weight", show_edge=False)
        for col in ("weight", "shape", "bits", "bits/weight", "error int4", "error int8"):
            table.add_column(col, justify="left" if col == "weight" else "right")
        for t in alloc.tensors:
            table.add_row(
                escape(t.weight + (" (lm_head)" if t.lm_head else "")),
                f"{t.shape[0]}x{t.shape[1]}",
                str(t.bits),
                f"{t.bits_per_weight:.3f}",
                f"{t.error_int4:.4g}",
                f"{t.error_int8:.4g}",
            )
        print_table(out, table)
    budget = f" (budget {alloc.budget:g})" if alloc.budget is not None else ""
    if alloc.budget is not None and alloc.average_bits > alloc.budget:  # a recipe's budget
        budget = f" (budget {alloc.budget:g}: int4 alone is over it here)"
    out.print(
        f"bits: {len(alloc.int8_weights)} of {len(alloc.tensors)} weights int8, average "
        f"{alloc.average_bits:.3f} bits per weight{budget}; errors "
        f"{'weighted by importance' if alloc.weighted else 'unweighted'}",
        markup=False,
        highlight=False,
    )


def run_command(args: argparse.Namespace) -> int:
    if os.path.abspath(args.output) == os.path.abspath(args.model):
        raise fastopt.ModelError(
            "the output path must differ from the input (it is never modified)"
        )
    apply_recipe(args)
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
