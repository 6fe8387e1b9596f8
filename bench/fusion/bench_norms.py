"""Does fusing the norms pay off on ONNX Runtime CPU?

Generates a llama-like decoder (bench/models/make_llm_model.py: decomposed RMSNorm before
attention and MLP, residual Adds), optimizes it with fastopt in three ways, and times ONNX
Runtime CPU sessions on each, with ORT's own graph optimizations ON (ORT_ENABLE_ALL, what
users run: ORT fuses some norms itself at session load) and OFF:

    original      the generated model
    cleanup       the default preset (no norm fusion)
    rms           default + fuse_rms_norm                 (SimplifiedLayerNormalization)
    skip_rms      default + fuse_rms_norm + fuse_skip_norm (SkipSimplifiedLayerNormalization)

Runs are interleaved round-robin over the sessions (machine drift hits every variant alike);
the figure is the median. Usage:

    python bench/fusion/bench_norms.py                   # hidden 896, 4 layers, batch 1, seq 128
    python bench/fusion/bench_norms.py --runs 300 --threads 1
    python bench/fusion/bench_norms.py --micro 16 --runs 500  # the norms alone (no MatMuls)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # make_llm_model
import fastopt
from _benchlib import ort_session
from make_llm_model import LLMConfig, make_from_config

VARIANTS: dict[str, list[str] | None] = {
    "original": None,
    "cleanup": [],
    "rms": ["fuse_rms_norm", "eliminate_dead_nodes"],
    "skip_rms": ["fuse_rms_norm", "fuse_skip_norm", "eliminate_dead_nodes"],
}


def session(path: Path, optimize: bool, threads: int) -> ort.InferenceSession:
    return ort_session(str(path), optimize, threads)


NORM_OPS = (
    "Add",
    "Pow",
    "ReduceMean",
    "Sqrt",
    "Div",
    "Mul",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
)


def profile(path: Path, feeds: dict[str, np.ndarray], runs: int, threads: int, tmp: str) -> dict:
    """Mean microseconds per run spent in each op type (ORT's profiler, optimizations ON)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tmp) / f"prof_{path.parent.name}")
    if threads:
        so.intra_op_num_threads = threads
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        s.run(None, feeds)
    events = json.loads(Path(s.end_profiling()).read_text())
    per_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"]["op_name"]
            per_op[op] = per_op.get(op, 0.0) + e["dur"] / runs
    return per_op


def micro_model(hidden: int, blocks: int, path: Path) -> Path:
    """Only the norms: `blocks` pre-norm residual steps s = s + norm(s) * w (decomposed RMSNorm,
    the Mul(x, 1 / Sqrt) form), no MatMuls, so the norm and residual-Add costs are all there is."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    nodes = []
    s, d = "h", "d"
    for i in range(blocks):
        w = f"w{i}"
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), w))
        p = f"b{i}/"
        nodes += [
            helper.make_node("Add", [s, d], [p + "s"]),
            helper.make_node("Pow", [p + "s", "two"], [p + "sq"]),
            helper.make_node("ReduceMean", [p + "sq"], [p + "m"], axes=[-1], keepdims=1),
            helper.make_node("Add", [p + "m", "eps"], [p + "v"]),
            helper.make_node("Sqrt", [p + "v"], [p + "r"]),
            helper.make_node("Div", ["one", p + "r"], [p + "i"]),
            helper.make_node("Mul", [p + "s", p + "i"], [p + "n"]),
            helper.make_node("Mul", [p + "n", w], [p + "y"]),
        ]
        s, d = p + "s", p + "y"
    nodes.append(helper.make_node("Add", [s, d], ["out"]))
    x = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "norms",
        [
            x("h", TensorProto.FLOAT, ["B", "S", hidden]),
            x("d", TensorProto.FLOAT, ["B", "S", hidden]),
        ],
        [x("out", TensorProto.FLOAT, ["B", "S", hidden])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT default)")
    ap.add_argument(
        "--micro", type=int, default=0, help="norm-only model with this many blocks instead"
    )
    ap.add_argument("--profile", type=int, default=20, help="profiled runs (0: none)")
    args = ap.parse_args(argv)

    cfg = LLMConfig(args.hidden, args.layers, args.vocab, args.intermediate, args.heads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.micro:
            original = micro_model(args.hidden, args.micro, Path(tmp) / "original" / "model.onnx")
        else:
            original = Path(make_from_config(cfg, Path(tmp) / "original", check=False))
        paths = {"original": original}
        for name, extra in VARIANTS.items():
            if extra is None:
                continue
            out = Path(tmp) / name / "model.onnx"
            out.parent.mkdir()
            passes = fastopt.pipeline.registry.preset("classic") + extra
            report = fastopt.optimize(original, passes=passes, target="ort", output=out)
            counts = report.model.op_counts() if report.model is not None else {}
            fused = {k: v for k, v in counts.items() if "Normalization" in k}
            print(f"{name:9s} {fused}")
            paths[name] = out

        if args.micro:
            rng = np.random.default_rng(0)
            shape = (args.batch, args.seq, args.hidden)
            feeds = {k: rng.standard_normal(shape).astype(np.float32) for k in ("h", "d")}
        else:
            ids = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq))
            feeds = {"input_ids": ids.astype(np.int64)}
        print(
            f"\n{f'micro ({args.micro} blocks)' if args.micro else 'decoder'}: "
            f"hidden {args.hidden}, {args.layers} layers, batch {args.batch}, seq {args.seq}, "
            f"{args.runs} runs, threads {args.threads or 'default'}: median ms (p10-p90)"
        )
        reference = None
        for optimize in (True, False):
            sessions = {k: session(p, optimize, args.threads) for k, p in paths.items()}
            times: dict[str, list[float]] = {k: [] for k in sessions}
            for k, s in sessions.items():
                (logits,) = s.run(None, feeds)
                if reference is None:
                    reference = logits
                diff = float(np.max(np.abs(logits - reference)))
                assert diff < 1e-2, f"{k}: outputs differ by {diff}"
                for _ in range(args.warmup):
                    s.run(None, feeds)
            for _ in range(args.runs):
                for k, s in sessions.items():
                    t = time.perf_counter()
                    s.run(None, feeds)
                    times[k].append((time.perf_counter() - t) * 1e3)
            label = "ORT optimizations ON " if optimize else "ORT optimizations OFF"
            base = statistics.median(times["original"])
            for k, ts in times.items():
                q = statistics.quantiles(ts, n=10)
                med = statistics.median(ts)
                print(
                    f"  {label} {k:9s} {med:8.2f} ms  ({q[0]:.2f}-{q[-1]:.2f})  "
                    f"x{base / med:.3f} vs original"
                )
        if args.profile:
            print("\nORT profiler, optimizations ON: mean us per run in norm-related ops")
            for k, p in paths.items():
                per_op = profile(p, feeds, args.profile, args.threads, tmp)
                norm = {op: round(per_op[op]) for op in NORM_OPS if op in per_op}
                total = sum(per_op.values())
                print(f"  {k:9s} norm ops {sum(norm.values()):7.0f} us of {total:9.0f} us  {norm}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
