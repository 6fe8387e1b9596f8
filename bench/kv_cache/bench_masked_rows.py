"""The decode step of a decoder exported WITH a cache, optimized by `--preset llm` (target ort)
with and without the emulation of all-masked rows (masked_rows.h: a ReduceMean over each
layer's whole value cache, then Unsqueeze / Expand / Reshape / Transpose / Reshape / Where, to
give pad queries the export's mean of V). `pad_rows=0` keeps it; the default leaves it out
where those rows are proven unread (kv_cache_mask.cc mark_unread_masked_rows).

One new token after a past of CONTEXT - 1 (random keys and values, attention_mask all ones),
batch 1, ORT CPU (default graph optimizations, --threads intra-op threads); the two models'
runs interleaved, median ms per step over --runs.

    python bench/kv_cache/bench_masked_rows.py                      # the committed fixture (tiny)
    python bench/kv_cache/bench_masked_rows.py --hidden 512 --layers 8 --heads 8 --kv-heads 2 \
        --save /tmp/llama512   # a larger llama exported with a cache (dynamo, random weights)
    python bench/kv_cache/bench_masked_rows.py --model /tmp/llama512/model.onnx
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "fixtures"))

import fastopt  # noqa: E402

FIXTURE = REPO / "tests/fixtures/cached_gqa/llama_dynamo_float32_cache/model.onnx"


def _export(args: argparse.Namespace, folder: Path) -> Path:
    import make_fixtures as mf

    overrides = {
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": 4 * args.hidden,
        "max_position_embeddings": 4096,
    }
    mf.export("llama", "dynamo", "float32", folder, config_overrides=overrides, cache=True)
    return folder / "model.onnx"


def _feed(sess: ort.InferenceSession, context: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    past = context - 1
    feed: dict[str, np.ndarray] = {
        "input_ids": np.array([[7]], np.int64),
        "attention_mask": np.ones((1, context), np.int64),
        "position_ids": np.array([[past]], np.int64),
    }
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            _, heads, _, dim = i.shape
            feed[i.name] = rng.standard_normal((1, heads, past, dim)).astype(np.float32)
    names = {i.name for i in sess.get_inputs()}
    return {k: v for k, v in feed.items() if k in names}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a decoder exported with a cache")
    ap.add_argument("--hidden", type=int, help="export a llama of this size instead")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--save", type=Path, help="keep the export there (rerun with --model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = args.model or FIXTURE
        if args.hidden:
            src = _export(args, args.save or Path(tmp) / "export")
        models = {}
        for label, options in (("emulated (pad_rows=0)", {"pad_rows": 0}), ("left out", {})):
            out = Path(tmp) / label.split()[0] / "model.onnx"
            fastopt.optimize(src, preset="llm", output=out, options=options)
            ops = [n.op_type for n in onnx.load(out).graph.node]
            models[label] = (out, ops.count("ReduceMean"), len(ops))
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        sessions = {
            k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
            for k, (p, _, _) in models.items()
        }
        feeds = {k: _feed(s, args.context) for k, s in sessions.items()}
        times: dict[str, list[float]] = {k: [] for k in sessions}
        outs = {}
        for k, s in sessions.items():  # warm-up
            outs[k] = s.run(["logits"], feeds[k])[0]
        for _ in range(args.runs):
            for k, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, feeds[k])
                times[k].append(time.perf_counter() - t0)
        a, b = outs.values()
        print(f"model: {src if not args.hidden else f'llama dynamo, hidden {args.hidden}'}")
        print(
            f"context {args.context} (past {args.context - 1} + 1 new token), batch 1, "
            f"{args.threads} thread(s), median of {args.runs} interleaved runs; logits max abs "
            f"diff {float(np.abs(a - b).max()):.2e}"
        )
        print("| model | ReduceMean | nodes | decode step ms (median) | p10 | p90 |")
        print("|---|---|---|---|---|---|")
        med = {}
        for k, (_, means, nodes) in models.items():
            t = sorted(times[k])
            med[k] = statistics.median(t)
            p10, p90 = t[len(t) // 10], t[9 * len(t) // 10]
            ms = " | ".join(f"{1e3 * x:.3f}" for x in (med[k], p10, p90))
            print(f"| {k} | {means} | {nodes} | {ms} |")
        e, f = med.values()
        print(f"speed-up without the emulation: {e / f:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
