"""``fastopt bench MODEL [--against OTHER ...]``: latency of models on the same workload, as a
table with ratios to MODEL, optionally a JSON file and a latency-vs-sequence-length plot."""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from rich.markup import escape

from fastopt.bench.harness import RUNS, WARMUP, compare, sweep
from fastopt.bench.inputs import PHASES
from fastopt.bench.report import document, ratios, short_labels, table
from fastopt.bench.session import DEVICES
from fastopt.cli_output import console as make_console
from fastopt.cli_output import print_table


def default_seqs(seq: int) -> list[int]:
    """Sequence lengths for the plot when --seqs is not given: seq/8, seq/4, seq/2, seq."""
    return sorted({s for s in (seq >> 3, seq >> 2, seq >> 1, seq) if s >= 1})


def _seqs(text: str) -> list[int]:
    try:
        values = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"--seqs takes integers like 32,64,128, not {text!r}"
        ) from e
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("--seqs needs positive lengths")
    return values


def add_parser(sub: Any) -> None:
    """Adds the ``bench`` subcommand to the CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="latency, tokens/s and memory in ONNX Runtime; compare models",
        description="Benchmark MODEL (and each --against model on the same inputs, runs "
        "interleaved) in ONNX Runtime: CUDA when available (IO binding), else CPU.",
    )
    p.add_argument("model", help="the .onnx model (the ratios' reference)")
    p.add_argument("--against", nargs="+", default=[], metavar="OTHER", help="models to compare")
    p.add_argument("--provider", choices=DEVICES, default="auto", help="default: auto")
    p.add_argument("--phase", choices=PHASES, default="prefill", help="default: prefill")
    p.add_argument("--batch", type=int, default=1, help="default: 1")
    p.add_argument(
        "--seq", type=int, default=128, help="prefill: new tokens; decode: context (default 128)"
    )
    p.add_argument("--runs", type=int, default=RUNS, help=f"timed runs (default {RUNS})")
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed runs (default {WARMUP})")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: ORT's)")
    p.add_argument("--max-length", type=int, help="positions of an in-place KV-cache buffer")
    p.add_argument("--cuda-graph", action="store_true", help="CUDA graphs (provider cuda)")
    p.add_argument("--json", metavar="FILE", help="write results and environment here")
    p.add_argument("--plot", metavar="FILE.png", help="plot latency against sequence length")
    p.add_argument(
        "--seqs", type=_seqs, help="lengths for --plot, e.g. 32,64,128 (default seq/8 .. seq)"
    )
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'fastopt[bench]')"
        )
    models = [args.model, *args.against]
    options: dict[str, Any] = {
        "runs": args.runs,
        "warmup": args.warmup,
        "provider": args.provider,
        "phase": args.phase,
        "batch": args.batch,
        "threads": args.threads,
        "cuda_graph": args.cuda_graph,
        "max_length": args.max_length,
    }
    console = make_console()
    results = compare(models, seq=args.seq, **options)
    first = results[0]
    console.print(
        f"{first.phase}, batch {first.batch}, seq {first.seq}: {first.stats.runs} timed runs "
        f"after {args.warmup} warm-up, on {first.provider}"
        + (" (IO binding)" if first.io_binding else "")
    )
    print_table(console, table(results))
    for r in results:
        if r.note:
            console.print(f"{escape(r.model)}: {escape(r.note)}")
    labels = short_labels([r.model for r in results])
    for label, ratio in list(zip(labels, ratios(results)))[1:]:
        if ratio > 0:
            console.print(
                f"{escape(label)}: {1 / ratio:.2f}x the speed of {escape(labels[0])} "
                f"({first.phase}, median latency)"
            )
    swept = []
    if args.plot:
        from fastopt.bench.plot import plot_sweep

        swept = sweep(models, args.seqs or default_seqs(args.seq), **options)
        plot_sweep(swept, args.plot)
        console.print(f"wrote {escape(args.plot)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document(results, swept), f, indent=2)
        console.print(f"wrote {escape(args.json)}")
    return 0
