"""Encoder-decoder decoding cost in ONNX Runtime CPU: greedy generation of N tokens with the
exported decoder (recompute every step), fastopt's fused decoder (--preset llm, no cache) and
fastopt's cached decoders (--preset llm --kv-cache standard, and --kv-cache inplace: the
self-attention cache in one max-length buffer per layer bound as past and present), on the
seq2seq fixtures
(tests/fixtures/models/*/decoder.onnx, made by tests/fixtures/make_seq2seq_fixtures.py).

    python bench/kv_cache/bench_seq2seq.py [--steps 32] [--repeats 5] [--threads 2] [--out FILE.md]
        [--dtype float32|float16]
    python bench/kv_cache/bench_seq2seq.py --peers [--dtype ...]  # fused ops, residue vs ORT's

Each row: the median of `repeats` generations (batch 2, the encoder run once outside the
timing), per generated token, and the tokens' agreement with the exported decoder's. ORT's own
graph optimizations are on (what a user runs).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fastopt
import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support import seq2seq_generation as sg


def _session(path: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _time(gen, sess, args, repeats: int) -> tuple[float, np.ndarray]:  # type: ignore[no-untyped-def]
    times, tokens = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = gen(sess, *args).tokens
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.asarray(tokens)


RESIDUE = ("Softmax", "ReduceMean", "Pow", "Sqrt", "Erf", "Tanh")
ATTENTION = ("Attention", "MultiHeadAttention", "GroupQueryAttention")
NORMS = (
    "LayerNormalization",
    "SkipLayerNormalization",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
)


def _summary(ops: dict[str, int]) -> str:
    def count(names: tuple[str, ...]) -> int:
        return sum(ops.get(n, 0) for n in names)

    return f"{count(ATTENTION)} | {count(NORMS)} | {count(RESIDUE)}"


def peers(dtype: str | None = None) -> str:
    """Fused attention / norm ops and residue, fastopt vs onnxruntime.transformers.optimizer."""
    import collections
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    logging.disable(logging.WARNING)
    model_type = {"bart": "bart", "marian": "bart", "whisper": "bart", "t5": "t5"}
    lines = [
        f"ORT {ort.__version__} transformers optimizer: optimize_model(path, model_type=bart|t5 "
        "(whisper and marian as bart), num_heads=4, hidden_size=64, opt_level=0); fastopt: "
        "optimize(path, preset='llm').",
        "",
        "| graph | fastopt attention ops | fastopt norms | fastopt residue | ORT attention ops | "
        "ORT norms | ORT residue |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for fx in sg.seq2seq_fixtures(dtype=dtype):
        for part, src in (("encoder", fx.encoder), ("decoder", fx.decoder)):
            try:
                m = optimize_model(
                    str(src),
                    model_type=model_type[fx.arch],
                    num_heads=4,
                    hidden_size=64,
                    opt_level=0,
                )
                theirs = _summary(collections.Counter(n.op_type for n in m.model.graph.node))
            except Exception as e:  # a peer failing on an export is a result too
                theirs = f"failed: {type(e).__name__} | | "
            ours = {
                k.split("::")[-1]: v
                for k, v in fastopt.optimize(str(src), preset="llm").ops_after.items()
            }
            lines.append(f"| {fx.name} {part} | {_summary(ours)} | {theirs} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--peers", action="store_true", help="the fused-op table vs ORT's optimizer")
    ap.add_argument("--dtype", default=None, help="only the fixtures of this dtype")
    args = ap.parse_args()
    if args.peers:
        print(peers(args.dtype))
        return 0
    lines = [
        f"ORT {ort.__version__}, {platform.machine()}, {args.threads} threads, batch 2, "
        f"{args.steps} greedy tokens, median of {args.repeats}",
        "",
        "| fixture | exported (recompute) ms/token | fused, no cache | fused + cache | "
        "fused + in-place cache | cache speed-up | in place vs standard | tokens equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for fx in sg.seq2seq_fixtures(dtype=args.dtype):
            if fx.arch not in ("bart", "marian", "whisper", "t5"):
                continue
            fused, cached = Path(tmp) / f"{fx.name}_fused.onnx", Path(tmp) / f"{fx.name}_kv.onnx"
            inplace = Path(tmp) / f"{fx.name}_inplace.onnx"
            fastopt.optimize(str(fx.decoder), output=str(fused), preset="llm")
            fastopt.optimize(str(fx.decoder), output=str(cached), preset="llm", kv_cache="standard")
            fastopt.optimize(str(fx.decoder), output=str(inplace), preset="llm", kv_cache="inplace")
            feeds = sg.encoder_feeds(fx)
            hidden = sg.encode(fx, feeds)
            mask = feeds.get("attention_mask")
            start = int(fx.meta["decoder_start_token_id"])
            runs = {}
            for label, path, gen in (
                ("exported", fx.decoder, sg.greedy_no_cache),
                ("fused", fused, sg.greedy_no_cache),
                ("cached", cached, sg.greedy_cached),
                ("inplace", inplace, sg.greedy_inplace),
            ):
                sess = _session(path, args.threads)
                runs[label] = _time(gen, sess, (hidden, mask, start, args.steps), args.repeats)
            ms = {k: 1e3 * v[0] / args.steps for k, v in runs.items()}
            equal = all(np.array_equal(runs[k][1], runs["exported"][1]) for k in runs)
            lines.append(
                f"| {fx.name} | {ms['exported']:.2f} | {ms['fused']:.2f} | {ms['cached']:.2f} | "
                f"{ms['inplace']:.2f} | {ms['exported'] / ms['cached']:.2f}x | "
                f"{ms['cached'] / ms['inplace']:.2f}x | {equal} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
