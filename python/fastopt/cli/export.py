"""``fastopt export HF_DIR -o OUT``: a Hugging Face checkpoint folder exported with torch.onnx,
checked against PyTorch, then run through ``fastopt optimize`` (its flags, its run, its report)
into a new folder onnxruntime-genai opens."""

from __future__ import annotations

import argparse
import os
from contextlib import ExitStack
from typing import Any

from fastopt.cli.output import console
from fastopt.cli.progress import CommandProgress
from fastopt.pipeline.summary import human_bytes


class _Stopped(Exception):
    """optimize wrote no output (its run check failed): the scratch folder goes."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def add_parser(sub: Any) -> None:
    from fastopt.cli.optimize import add_optimize_flags
    from fastopt.export.exporter import EXPORTERS
    from fastopt.export.load import DTYPES

    exp = sub.add_parser(
        "export",
        help="export a Hugging Face checkpoint folder to ONNX (torch.onnx), check it against "
        "PyTorch, optimize it and write a folder onnxruntime-genai runs (needs fastopt[export])",
    )
    exp.add_argument("checkpoint", metavar="HF_DIR", help="folder written by save_pretrained")
    exp.add_argument(
        "-o", "--output", required=True, metavar="OUT", help="the folder to write (new or empty)"
    )
    exp.add_argument(
        "--exporter",
        choices=EXPORTERS,
        default="dynamo",
        help="torch.onnx exporter: dynamo (default; holds the weights once) or torchscript",
    )
    exp.add_argument("--dtype", choices=DTYPES, default="fp32", help="export dtype (fp32)")
    exp.add_argument(
        "--opset", type=int, help="the export's opset (default: dynamo's own; TorchScript 17)"
    )
    exp.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="leave a decoder without a KV cache (default: --kv-cache standard, which "
        "onnxruntime-genai needs)",
    )
    exp.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="export a decoder whose folder has no tokenizer (onnxruntime-genai then cannot "
        "turn text into tokens)",
    )
    add_optimize_flags(exp)
    exp.set_defaults(func=run_command, kv_cache="standard")


def run_command(args: argparse.Namespace) -> int:
    from fastopt.export.errors import require_extra

    require_extra()  # one line naming what to install, before anything else
    _check_flags(args)
    from fastopt.cli.optimize import run_command as optimize_command
    from fastopt.errors import ModelError
    from fastopt.export.pipeline import kv_refusal, require_genai_config, stage

    out = os.path.abspath(args.output)
    hf_dir = args.checkpoint
    report_path = args.report
    try:
        with ExitStack() as stack:
            with CommandProgress("export") as progress:
                staged = stack.enter_context(
                    stage(
                        hf_dir,
                        out,
                        exporter=args.exporter,
                        dtype=args.dtype,
                        opset=args.opset,
                        require_tokenizer=not args.no_tokenizer,
                        progress=progress.update,
                    )
                )
            con = console()
            for check in staged.report.checks:
                con.print(f"export check: {check.describe()}", markup=False, highlight=False)
            code = 0
            kind = staged.report.kind
            kv_cache = None if args.no_kv_cache or kind != "decoder" else args.kv_cache
            for name, path in staged.exported.items():
                args.model, args.output, args.kv_cache = path, staged.target(name), kv_cache
                if getattr(args, "hf_config", "absent") is None:
                    args.hf_config = hf_dir  # optimize's genai_config.json from the checkpoint
                if report_path and len(staged.exported) > 1:
                    stem, ext = os.path.splitext(report_path)
                    args.report = f"{stem}.{name}{ext or '.json'}"
                try:
                    code = max(code, optimize_command(args))
                except ModelError as e:
                    hinted = kv_refusal(e) if kv_cache is not None else None
                    if hinted is None:
                        raise
                    raise hinted from e
                if not os.path.exists(args.output):
                    raise _Stopped(code or 1)
                if kv_cache is not None:  # (the reason is optimize's genai line above)
                    require_genai_config(staged.folder, [])
    except _Stopped as e:
        return e.code
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    con.print(
        f"export: wrote {out} ({human_bytes(size)}): {', '.join(files)}",
        markup=False,
        highlight=False,
    )
    return code


def _check_flags(args: argparse.Namespace) -> None:
    """optimize's names and values, before the minutes of loading and exporting."""
    from fastopt.cli.common import parse_options
    from fastopt.cli.optimize import quantize_settings
    from fastopt.pipeline.registry import get_pass, preset

    passes = [p for p in args.passes.split(",") if p] if args.passes else preset(args.preset)
    for name in passes:
        get_pass(name)
    parse_options(args.option)
    quantize_settings(args, None)
    if args.opset is not None and not 7 <= args.opset <= 25:
        raise ValueError(f"--opset must be between 7 and 25, not {args.opset}")
