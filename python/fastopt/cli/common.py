"""What ``fastopt optimize`` and ``fastopt quantize`` share: ``-o/--option`` and provider parsing,
the quantization flags and settings, their report tables, the size of a written model."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from rich.markup import escape
from rich.table import Table

import fastopt
from fastopt import _C
from fastopt.cli.output import console, print_table
from fastopt.cli.progress import CommandProgress
from fastopt.optimize import PassReport
from fastopt.pipeline.options import OPTIONS, check_options
from fastopt.pipeline.summary import human_bytes
from fastopt.quant.fp16_ranges import RangeCheck
from fastopt.quant.settings import (
    METHODS,
    Mode,
    QuantSettings,
    QuantSummary,
    WeightQuantization,
)

# Internal options and the flags that set them: `--option` takes what `fastopt passes` lists.
_FLAG_OF_OPTION = {"kv_cache": "--kv-cache", "quant_bits": "--quantize/--mode"}


def parse_options(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` items, checked against the declared options (values stay text until then).
    Internal options (set by optimize itself from flags) are refused, as `fastopt passes`
    does not list them."""
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fastopt.OptionError(f"--option takes KEY=VALUE, not {item!r}")
        spec = OPTIONS.get(key)
        if spec is not None and spec.internal:
            flag = _FLAG_OF_OPTION.get(key, "the quantization flags" if "quant" in key else "")
            raise fastopt.OptionError(
                f"--option {key} is set by fastopt itself"
                + (f" (use {flag})" if flag else "")
                + "; `fastopt passes` lists the options --option takes"
            )
        options[key] = value
    return dict(check_options(options))


def parse_providers(text: str | None) -> list[str] | None:
    """``cpu,cuda`` -> ["cpu", "cuda"]; None when not given."""
    if not text:
        return None
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--providers takes comma-separated names, not {text!r}")
    return names


def files_size(model_path: str) -> int:
    total = os.path.getsize(model_path)
    folder = os.path.dirname(os.path.abspath(model_path))
    base = os.path.basename(model_path) + ".data"
    for name in os.listdir(folder):
        if name == base or name.startswith(base + "."):
            total += os.path.getsize(os.path.join(folder, name))
    return total


def add_hf_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hf-config",
        metavar="DIR",
        help="the Hugging Face checkpoint folder (config.json, generation_config.json, tokenizer "
        "files) that genai_config.json takes token ids, model type, context length and search "
        "defaults from, and whose tokenizer files are copied beside the output (default: those "
        "beside the input model)",
    )


def print_genai_notes(notes: list[str], out: Any) -> None:
    """Where genai_config.json's values came from and which fell back to genai's defaults."""
    for line in notes:
        out.print(line, markup=False, highlight=False)


def add_text_flags(p: argparse.ArgumentParser) -> None:
    """--verify's real-text inputs (fastopt.verify.real_text), shared by optimize and quantize."""
    p.add_argument(
        "--verify-text",
        action="append",
        default=[],
        metavar="FILE",
        help="with --verify: a UTF-8 text file scored besides the built-in prose (repeatable)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="with --verify: tokenizer.json or a folder with one (default: beside the model)",
    )


def add_quant_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--block-size",
        type=int,
        default=32,
        help=f"int4/int8: power of two in {_C.QUANT_BLOCK_SIZE_MIN}..{_C.QUANT_BLOCK_SIZE_MAX} "
        "(32)",
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
        "--method",
        choices=METHODS,
        default=None,
        help="int4/int8 rounding: rtn rounds to nearest (onnxruntime's bytes; the default); search "
        "picks each block's scale and zero point for the least weighted squared error (the "
        "default with --calibration, whose importance it weights); gptq (int4, needs "
        "--calibration) feeds each row's rounding error into the rows after it along K through "
        "the calibration's X^T X",
    )
    p.add_argument(
        "--importance",
        metavar="FILE|norms",
        help="int4/int8 --method search: an ONNX file of float32 [K] initializers named as the "
        "weights (mean x^2 per input channel) weighting each weight's squared errors; norms: "
        "estimated from the weights (norm gains and the residual stream), without data",
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
        method=args.method,
        importance=args.importance or "",
        accuracy_level=args.accuracy_level,
        exclude=tuple(args.exclude),
        lm_head=args.lm_head,
        embeddings=args.embeddings,
        per_channel=args.per_channel,
        keep_io_types=args.keep_io_types,
        fp16_ranges=args.fp16_ranges == "on",
        threads=args.threads,
        tmpdir=os.path.dirname(os.path.abspath(output)) if output else "",
        # the recipe flags (cli/recipe_flags.py)
        calibration=getattr(args, "calibration", None),
        hf_config=getattr(args, "hf_config", None),
        awq=getattr(args, "awq", False),
        bits_budget=getattr(args, "bits_budget", None),
        importance_output=getattr(args, "save_importance", None),
        recipe=getattr(args, "recipe", None),
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
            ("rel mse", "right"),
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
                f"{w.rel_mse:.3g}" if w.action == "quantized" else "",
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
            table = Table(title="ops that stay float32 (range, angles)", show_edge=False)
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
