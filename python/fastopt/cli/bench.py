"""``fastopt bench MODEL [--against OTHER ...]``: latency of models on the same workload, as a
table with each one's speed-up over MODEL, optionally a JSON file and a latency-vs-sequence-length
plot.

Like for like: a decode step of a model with a KV cache computes one token; the "decode step"
of a model without one recomputes all ``seq + 1`` tokens. Compared in one table, their ratio
mixes the cache with everything else, so by default such a mix is timed on the prefill of
``seq`` tokens, which every model computes alike; ``--vs-recompute`` times each model's own decode
step instead (the table's "work" column says what each run computes)."""

from __future__ import annotations

import argparse
import importlib.util
import json
from typing import Any

from fastopt.bench.harness import RUNS, WARMUP, compare, sweep
from fastopt.bench.inputs import PHASES, Port, detect_kind
from fastopt.bench.report import document, same_work, short_labels, speedups, table, times, work
from fastopt.bench.session import DEVICES
from fastopt.cli.output import console as make_console
from fastopt.cli.output import print_table
from fastopt.cli.progress import CommandProgress


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
    p.add_argument(
        "model",
        nargs="?",
        help="the .onnx model (the speed-ups' reference); may also follow --against's list",
    )
    p.add_argument(
        "--against",
        nargs="+",
        default=[],
        metavar="OTHER",
        help="models to compare with MODEL on the same work",
    )
    p.add_argument("--provider", choices=DEVICES, default="auto", help="default: auto")
    p.add_argument(
        "--phase",
        choices=PHASES,
        default="prefill",
        help="prefill: seq new tokens; decode: one new token after seq (default prefill). A "
        "decode comparison of models with and without a KV cache times the prefill instead "
        "(see --vs-recompute)",
    )
    p.add_argument(
        "--vs-recompute",
        action="store_true",
        help="--phase decode: compare a cached model's decode step (one token) with an uncached "
        "model's recompute of all seq+1 tokens (the cost per generated token without a cache)",
    )
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


def model_kind(path: str) -> str:
    """The kind :mod:`fastopt.bench.inputs` takes `path` for (read from its graph; no session)."""
    import fastopt

    model = fastopt.load(path)
    ports = [
        [Port(v.name, "", tuple(v.shape or ())) for v in values if v is not None]
        for values in (model.graph.inputs, model.graph.outputs)
    ]
    return detect_kind(ports[0], ports[1])


def like_for_like_phase(models: list[str], phase: str) -> tuple[str, str]:
    """The phase to time `models` on, and a note when it is not the one asked for: a decode
    step of a model with a cache and one without are not the same work."""
    if phase != "decode" or len(models) < 2:
        return phase, ""
    kinds = [model_kind(m) for m in models]
    cached = [k in ("decoder_cache", "decoder_inplace") for k in kinds]
    if all(cached) or not any(cached):
        return phase, ""
    labels = short_labels(models)
    uncached = ", ".join(label for label, c in zip(labels, cached) if not c)
    return "prefill", (
        f"note: {uncached} has no KV cache: its decode step recomputes all seq+1 tokens, while "
        "a cached model's computes one, which is not the same work; timing the prefill of seq "
        "tokens instead, which every model computes alike (--vs-recompute times each model's "
        "own decode step)"
    )


def run_command(args: argparse.Namespace) -> int:
    if args.model is None:  # `bench --against A B MODEL`: the list took MODEL too
        if len(args.against) < 2:
            raise ValueError(
                "bench needs MODEL: fastopt bench MODEL --against OTHER (or --against OTHER MODEL)"
            )
        args.model = args.against.pop()
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'fastopt[bench]')"
        )
    models = [args.model, *args.against]
    console = make_console()
    phase, note = args.phase, ""
    if not args.vs_recompute:
        phase, note = like_for_like_phase(models, args.phase)
    if note:
        console.print(note, markup=False, highlight=False)
    options: dict[str, Any] = {
        "runs": args.runs,
        "warmup": args.warmup,
        "provider": args.provider,
        "phase": phase,
        "batch": args.batch,
        "threads": args.threads,
        "cuda_graph": args.cuda_graph,
        "max_length": args.max_length,
    }
    with CommandProgress("bench") as progress:
        results = compare(models, seq=args.seq, progress=progress.update, **options)
    first = results[0]
    console.print(
        f"{first.phase}, batch {first.batch}, seq {first.seq}: {first.stats.runs} timed runs "
        f"after {args.warmup} warm-up, on {first.provider}"
        + (" (IO binding)" if first.io_binding else ""),
        markup=False,
        highlight=False,
    )
    print_table(console, table(results))
    for r in results:
        if r.note:
            console.print(f"{r.model}: {r.note}", markup=False, highlight=False)
    labels = short_labels([r.model for r in results])
    for label, speedup, r in list(zip(labels, speedups(results), results))[1:]:
        if same_work(results):
            what = f"{work(first)} each, median latency"
        else:  # --vs-recompute: say what each side computed
            what = f"{work(r)} against {work(first)}, median latency"
        console.print(
            f"{label}: {times(speedup)} the speed of {labels[0]} ({first.phase}: {what})",
            markup=False,
            highlight=False,
        )
    swept = []
    if args.plot:
        from fastopt.bench.plot import plot_sweep

        with CommandProgress("bench --plot") as progress:
            swept = sweep(
                models, args.seqs or default_seqs(args.seq), progress=progress.update, **options
            )
        plot_sweep(swept, args.plot)
        console.print(f"wrote {args.plot}", markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document(results, swept), f, indent=2)
        console.print(f"wrote {args.json}", markup=False, highlight=False)
    return 0
