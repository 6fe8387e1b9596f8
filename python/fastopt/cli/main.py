"""The ``fastopt`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import fastopt
from fastopt.cli.bench import add_parser as add_bench_parser
from fastopt.cli.check import add_parser as add_check_parser
from fastopt.cli.export import add_parser as add_export_parser
from fastopt.cli.genai import add_parser as add_genai_parser
from fastopt.cli.info import add_parser as add_info_parser
from fastopt.cli.optimize import add_parser as add_optimize_parser
from fastopt.cli.passes import add_parser as add_passes_parser
from fastopt.cli.quantize import add_parser as add_quantize_parser


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

    add_info_parser(sub)
    add_optimize_parser(sub)
    add_quantize_parser(sub)
    add_export_parser(sub)
    add_check_parser(sub)
    add_passes_parser(sub)
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
