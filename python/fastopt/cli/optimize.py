"""``fastopt optimize``: the subcommand's arguments, its run and its summary."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import fastopt
from fastopt._io import check_output_path
from fastopt.cli.common import (
    add_hf_config_flag,
    add_quant_flags,
    add_text_flags,
    files_size,
    parse_options,
    parse_providers,
    print_genai_notes,
    print_precision,
    print_quantization,
    work_progress,
)
from fastopt.cli.output import console, print_table
from fastopt.cli.progress import CommandProgress
from fastopt.cli.recipe_flags import (
    RECIPE_FLAGS,
    add_recipe_flags,
    print_recipe,
    resolved_settings,
)
from fastopt.optimize import DEFAULT_PRESET, OptimizeReport
from fastopt.pipeline.registry import PRESET_DESCRIPTIONS, PRESETS, get_pass, preset
from fastopt.pipeline.summary import human_bytes
from fastopt.quant.settings import QuantSettings
from fastopt.verify.run_check import RunCheckError

# Ops whose appearance means a fusion happened: the summary names them.
_FUSED_DOMAINS = ("com.microsoft",)


def add_parser(sub: Any) -> None:
    opt = sub.add_parser("optimize", help="optimize a model (the input is never modified)")
    opt.add_argument("model", help="input .onnx file")
    opt.add_argument(
        "-o",
        "--output",
        help="output .onnx file (without it, a dry run: everything runs, nothing is written)",
    )
    add_optimize_flags(opt)
    opt.set_defaults(func=run_command)


def add_optimize_flags(opt: argparse.ArgumentParser) -> None:
    """Every optimize flag after the input and -o (``fastopt export`` takes them too)."""
    opt.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the passes, operators and weights tables (default: a short summary)",
    )
    opt.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=preset_help(),
    )
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
        "--no-fsync",
        action="store_true",
        help="write as cp does: return before the output reaches the disk (still complete or "
        "absent for readers; a power loss may leave it partial)",
    )
    opt.add_argument(
        "--no-run-check",
        action="store_true",
        help="write the output without first loading and running it once in ONNX Runtime "
        "(CPU, batch 1 x 2 tokens)",
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
        metavar="NAME",
        help="explain, per candidate node, why a pass's rules (or one rule) did or did not "
        "apply ('*': all); an unknown name is an error",
    )
    opt.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for the passes, e.g. --option opset=18 for convert_version "
        "(repeatable; `fastopt passes` lists them)",
    )
    opt.add_argument(
        "--kv-cache",
        choices=("standard", "inplace"),
        help="turn a decoder exported without a KV cache into one with a cache (preset llm): "
        "standard = growing past/present; inplace = one max-length buffer per layer shared by "
        "past and present (target ort); writes genai_config.json next to the output",
    )
    add_hf_config_flag(opt)
    from fastopt.quant.settings import MODES

    opt.add_argument(
        "--quantize",
        choices=tuple(MODES),
        metavar="MODE",
        help="quantize after the preset's passes (fusions, KV cache, packing): " + "|".join(MODES),
    )
    add_quant_flags(opt)
    add_recipe_flags(opt)
    add_text_flags(opt)


def quantize_settings(args: argparse.Namespace, output: str | None) -> QuantSettings | None:
    """--quantize and the recipe flags resolved (a recipe fills the flags not given) and checked,
    before any work; None without --quantize."""
    given = [f"--{f.replace('_', '-')}" for f in RECIPE_FLAGS if getattr(args, f)]
    if given and not args.quantize:
        raise fastopt.ModelError(f"{', '.join(given)}: only with --quantize int4|int8")
    return resolved_settings(args, args.quantize, output) if args.quantize else None


def preset_help() -> str:
    names = "; ".join(
        f"{n}: {PRESET_DESCRIPTIONS.get(n, ', '.join(p))}" for n, p in PRESETS.items()
    )
    return f"the pass list to run, one of {names} (default: {DEFAULT_PRESET})"


def run_command(args: argparse.Namespace) -> int:
    if args.output:
        check_output_path(args.model, args.output)  # by identity; Model.save checks data files
    if args.verify and not args.output:
        raise fastopt.ModelError("--verify needs -o/--output")
    # Every name and value before any work: a typo costs nothing.
    passes = [p for p in args.passes.split(",") if p] if args.passes else None
    for name in passes if passes is not None else preset(args.preset):
        get_pass(name)
    options = parse_options(args.option)
    providers = parse_providers(args.providers)
    external = {"auto": None, "always": True, "never": False}[args.external_data]

    quantize = quantize_settings(args, args.output)
    if args.tokenizer is None and args.hf_config is not None:  # the checkpoint's tokenizer
        args.tokenizer = args.hf_config
    if args.verify:  # a bad --verify-text file or tokenizer fails before any work
        from fastopt.verify.text_tokens import check_text_inputs

        check_text_inputs(args.verify_text, args.tokenizer)
    with CommandProgress("optimize") as progress:

        def on_pass(i: int, n: int, name: str) -> None:
            if name:
                progress.update(name, i, n, unit="pass")
            else:  # the passes are done
                progress.update("run check and save" if args.output else "finishing")

        try:
            report = fastopt.optimize(
                args.model,
                preset=args.preset,
                passes=passes,
                target=args.target,
                output=args.output,
                external_data=external,
                fsync=not args.no_fsync,
                explain=args.explain,
                progress=on_pass,
                options=options,
                kv_cache=args.kv_cache,
                quantize=quantize,
                work_progress=work_progress(progress),
                run_check=not args.no_run_check,
                hf_config=args.hf_config,
            )
        except RunCheckError as e:  # ORT cannot run fastopt's output: a failed check, exit 1
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
            return 1
    out = console()
    if args.explain:
        for line in report.explain:
            out.print(escape(line))
    if args.verbose:
        print_details(report, out)
    print_quantization(report.quantization, out, verbose=args.verbose)
    if quantize is not None:
        print_precision(report.range_check, report.passes, quantize.mode, out, verbose=args.verbose)
    if report.quant_recipe is not None:
        verbose = args.verbose or args.bits_budget is not None
        print_recipe(report.quant_recipe, out, verbose=verbose)
    print_genai_notes(report.genai_notes, out)
    print_summary(report, out, args.model)
    result: dict[str, object] = {"optimize": report.to_dict()}
    code = 0
    if args.verify:
        from fastopt.verify.core import InputRejectedError, VerifyError, verify
        from fastopt.verify.generation import verify_generation

        try:
            vreport: Any
            if args.quantize:
                # Quantization changes outputs by design: its own criteria (verify.quantized).
                from fastopt.verify.quantized import verify_quantized

                vreport = verify_quantized(
                    args.model,
                    args.output,
                    args.quantize,
                    tokenizer=args.tokenizer,
                    texts=args.verify_text,
                )
                if not vreport.ok and not vreport.skipped:
                    code = 1
            elif args.kv_cache:
                # The cached model takes past inputs the original lacks: compare generations.
                vreport = verify_generation(args.model, args.output)
            else:
                vreport = verify(args.model, args.output, providers=providers)
            out.print(escape(str(vreport)))
            result["verify"] = vreport.to_dict()
            if not args.quantize:  # a rewrite: the same language model on real text too
                text = verify_rewrite_on_text(args)
                if text is not None:
                    out.print(escape(str(text)))
                    result["verify_text"] = text.to_dict()
                    code = code if text.ok else 1
        except InputRejectedError:
            raise  # the input does not run: bad input, exit 2
        except VerifyError as e:
            out.print(f"[red]verification failed[/red]: {escape(str(e))}")
            result["verify"] = {"error": str(e)}
            code = 1
    if args.report:
        with open(args.report, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return code


def verify_rewrite_on_text(args: argparse.Namespace) -> Any:
    """optimize --verify without --quantize: the real-text check (fastopt.verify.real_text) at
    the rewrite's thresholds, for a causal LM; None (a line says why) for other models."""
    from fastopt.verify.real_text import ModelRunError, NotLanguageModel, evaluate_text

    try:
        return evaluate_text(
            args.model, args.output, "rewrite", tokenizer=args.tokenizer, texts=args.verify_text
        )
    except (NotLanguageModel, ModelRunError) as e:
        console().print(f"no real-text check: {escape(str(e))}", highlight=False)
        return None


def fused_ops(report: OptimizeReport) -> dict[str, int]:
    """Ops the run added (count after > before) that fuse a subgraph: contrib ops and the
    standard fused ops (attention, norms, rotary, Gelu...)."""
    standard = {
        "Attention",
        "RMSNormalization",
        "LayerNormalization",
        "RotaryEmbedding",
        "Gelu",
        "Gemm",
        "FusedConv",
        "SimplifiedLayerNormalization",
    }
    gained = {}
    for op, (before, after) in report.op_delta().items():
        domain, _, name = op.rpartition("::")
        if after > before and (domain in _FUSED_DOMAINS or name in standard):
            gained[name] = after - before
    return gained


def print_details(report: OptimizeReport, out: Console) -> None:
    """-v: the passes table (rewrites, time, nodes, counters), shape inference, and the
    operators whose counts changed."""
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
        details = (
            (p.skipped and f"skipped: {p.skipped}")
            or (p.unchanged and "not rerun: nothing changed since it ran")
            or ", ".join(f"{k} {v}" for k, v in sorted(p.counters.items()))
        )
        passes.add_row(
            escape(p.name),
            str(p.rewrites),
            f"{p.seconds * 1e3:.1f}",
            str(p.nodes_after),
            escape(details),
        )
    print_table(out, passes)
    for line in report.shape_inference:
        out.print(f"shape inference, {line}", markup=False, highlight=False)

    ops = Table(title="operators (changed)", show_edge=False)
    for col in ("op", "before", "after"):
        ops.add_column(col, justify="left" if col == "op" else "right")
    for op, (before, after) in report.op_delta().items():
        ops.add_row(escape(op), str(before), str(after))
    ops.add_row("all nodes", str(report.nodes_before), str(report.nodes_after))
    print_table(out, ops)


def print_summary(report: OptimizeReport, out: Console, input_path: str) -> None:
    """The short summary: what the passes did, skipped passes with their reasons, the run
    check, and the line that says what ran, what fused and what was written."""
    changed = [p for p in report.passes if p.rewrites]
    skipped = [p for p in report.passes if p.skipped]
    unchanged = [p for p in report.passes if p.unchanged]
    line = (
        f"passes: {len(report.passes) - len(skipped) - len(unchanged)} ran, {len(changed)} "
        f"changed the graph ({report.rewrites} rewrites)"
    )
    if unchanged:
        line += f", {len(unchanged)} not rerun (idempotent, nothing changed since they ran)"
    if skipped:
        line += "; skipped: " + ", ".join(f"{p.name} ({p.skipped})" for p in skipped)
    plain = {"markup": False, "highlight": False}
    out.print(line, **plain)  # type: ignore[arg-type]
    if report.run_check:
        out.print(f"run check: {report.run_check}", **plain)  # type: ignore[arg-type]
    ran = f"preset {report.preset}" if report.preset else f"{len(report.passes)} passes"
    if report.output:
        size = f"; wrote {report.output} ({human_bytes(files_size(report.output))})"
    else:
        size = "; nothing written (a dry run: give -o FILE to write the output)"
    fused = fused_ops(report)
    gained = ", ".join(f"{n} {op}" for op, n in sorted(fused.items())) or "no fused ops"
    out.print(
        f"{input_path}: {ran}, target {report.target}: {report.nodes_before} -> "
        f"{report.nodes_after} nodes ({gained}) in {report.seconds:.2f} s{size}",
        **plain,  # type: ignore[arg-type]
    )
