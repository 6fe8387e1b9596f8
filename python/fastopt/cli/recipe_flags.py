"""The weight-quantization recipe flags ``fastopt quantize`` and ``fastopt optimize --quantize``
share (calibration, AWQ, the bits budget, --recipe), how a recipe fills the flags not given,
and the lines that report what the recipe did."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.table import Table

import fastopt
from fastopt.cli.common import quant_settings
from fastopt.cli.output import print_table
from fastopt.quant.recipe import RECIPES, RecipeReport, recipe_settings
from fastopt.quant.settings import QuantSettings

# The flags add_recipe_flags adds, by their dest.
RECIPE_FLAGS = ("recipe", "calibration", "awq", "bits_budget", "save_importance")


def add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """Calibration, AWQ, the bits budget and --recipe (fastopt quantize, and optimize / export
    with --quantize)."""
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
    # None: not given, so a --recipe may set it (apply_recipe fills the usual defaults after)
    p.set_defaults(block_size=None, symmetric=None)


# What the quantize flags default to when neither they nor a recipe set them.
_FLAG_DEFAULTS = {"block_size": 32, "symmetric": True}


def apply_recipe(args: argparse.Namespace, mode: str | None) -> None:
    """Fills the flags the user did not give (None) from --recipe, then from their defaults."""
    given = recipe_settings(args.recipe, bool(args.calibration)) if args.recipe else {}
    if given and mode != "int4":
        raise fastopt.ModelError(f"recipe {args.recipe} is an int4 recipe, not {mode}")
    for key, value in given.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key, value in _FLAG_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def resolved_settings(args: argparse.Namespace, mode: str, output: str | None) -> QuantSettings:
    """The quantization flags with --recipe applied, checked before any work."""
    apply_recipe(args, mode)
    settings = quant_settings(args, mode, output)  # type: ignore[arg-type]
    settings.validate()
    return settings


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
        passes = recipe.calibration.hessian_passes if recipe.calibration else 1
        grouped = (
            f", the X^T X collected in {passes} calibration passes under the limit"
            if passes > 1
            else ""
        )
        out.print(
            f"gptq: X^T X factors for {g.weights} weights ({g.factors} distinct, "
            f"{g.bytes / 2**20:.0f} MiB) in {g.seconds:.2f} s{grouped}",
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
