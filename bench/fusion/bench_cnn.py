#!/usr/bin/env python3
"""ONNX Runtime CPU latency of the onnx wheel's light_* CNNs before/after `preset default`.

The light models store their weights as ConstantOfShape nodes (IR version 3, initializers
listed as graph inputs). Both sides of the comparison start from the same materialized model:
every ConstantOfShape of a constant shape becomes an initializer (random values, seeded) and
initializers leave the graph inputs, as constant folding would make them. "before" is that
model; "after" is fastopt.optimize(before, preset="classic").

Each model runs in ONNX Runtime's CPU provider with its own graph optimizations ON
(ORT_ENABLE_ALL, as users run it) and, for reference, OFF (ORT_DISABLE_ALL, which shows what
the fusions buy where ORT does not do them itself). Runs of "before" and "after" alternate,
after warm-up; the median (and p10/p90) of --runs timings per side is reported. Input:
test_data_set_0's (arange(n) / n), batch 1.

    python bench/fusion/bench_cnn.py                    # all light models, 20 runs each
    python bench/fusion/bench_cnn.py --runs 50 --threads 1 --models resnet50,squeezenet
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH / "io"))
from bench_io import environment  # noqa: E402

LIGHT_DIR = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"
LEVELS = {
    "ORT_ENABLE_ALL": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "ORT_DISABLE_ALL": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


def materialize(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """ConstantOfShape(constant shape) -> random initializer; initializers leave the inputs."""
    g = model.graph
    rng = np.random.default_rng(seed)
    shapes = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    nodes = []
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in shapes:
            shape = tuple(int(d) for d in shapes[node.input[0]])
            if len(shape) >= 2:  # He-scaled weights
                value = rng.standard_normal(shape, np.float32) * np.sqrt(2 / np.prod(shape[1:]))
            else:  # vectors (biases, BN parameters: variances must be positive)
                value = rng.uniform(0.5, 1.5, shape)
            g.initializer.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
        else:
            nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    live = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(live)
    names = {t.name for t in live}
    inputs = [vi for vi in g.input if vi.name not in names and vi.name in used]
    del g.input[:]
    g.input.extend(inputs)
    model.ir_version = max(model.ir_version, 4)
    # Also output the class scores: the softmax hides differences in them.
    for node in g.node:
        if node.op_type == "Softmax":
            g.output.append(onnx.helper.make_tensor_value_info(node.input[0], 1, ["n", "c"]))
    return model


def feeds_for(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
        n = int(np.prod(shape))
        out[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return out


def session(model_bytes: bytes, level: str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = LEVELS[level]
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def time_pair(
    before: ort.InferenceSession,
    after: ort.InferenceSession,
    feeds: dict[str, np.ndarray],
    runs: int,
    warmup: int,
) -> tuple[list[float], list[float]]:
    for _ in range(warmup):
        before.run(None, feeds)
        after.run(None, feeds)
    tb, ta = [], []
    for i in range(runs):  # alternate, so that drift hits both sides alike
        order = ((before, tb), (after, ta)) if i % 2 == 0 else ((after, ta), (before, tb))
        for sess, times in order:
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
    return tb, ta


def stats(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "p10_ms": q[0] * 1e3,
        "p90_ms": q[-1] * 1e3,
    }


def bench_model(path: Path, runs: int, warmup: int, threads: int) -> dict[str, Any]:
    original = onnx.load(path)
    before = materialize(onnx.load(path))
    feeds = feeds_for(original)
    t0 = time.perf_counter()
    report = fastopt.optimize(fastopt.from_onnx(before), preset="classic")
    optimize_s = time.perf_counter() - t0
    assert report.model is not None
    after = report.model.to_onnx()
    before_bytes, after_bytes = before.SerializeToString(), after.SerializeToString()
    result: dict[str, Any] = {
        "model": path.stem.removeprefix("light_"),
        "nodes_before": report.nodes_before,
        "nodes_after": report.nodes_after,
        "op_delta": {k: list(v) for k, v in report.op_delta().items()},
        "optimize_s": optimize_s,
        "levels": {},
    }
    for level in LEVELS:
        sb = session(before_bytes, level, threads)
        sa = session(after_bytes, level, threads)
        if level == "ORT_DISABLE_ALL":
            e, a = sb.run(None, feeds), sa.run(None, feeds)
            scale = max(1.0, max(float(np.abs(x).max()) for x in e))
            result["max_rel_diff"] = max(float(np.abs(x - y).max()) for x, y in zip(e, a)) / scale
        tb, ta = time_pair(sb, sa, feeds, runs, warmup)
        result["levels"][level] = {"before": stats(tb), "after": stats(ta)}
        del sb, sa
    return result


def short_delta(delta: dict[str, list[int]]) -> str:
    parts = []
    for op, (b, a) in sorted(delta.items(), key=lambda kv: kv[0].split("::")[-1]):
        parts.append(f"{op.split('::')[-1]} {b}→{a}")
    return ", ".join(parts)


def to_markdown(env: dict[str, Any], args: argparse.Namespace, results: list[dict]) -> str:
    ram = env["ram_bytes"] / 2**20
    lines = [
        "# ONNX Runtime CPU latency of CNNs before/after `preset default`",
        "",
        f"- date: {env['date']}",
        f"- machine: {env['cpu']}, {env['cores']} cores, {ram:,.0f} MB RAM, {env['os']}",
        f"- versions: python {env['python']}, onnx {env['onnx']}, onnxruntime "
        f"{env['onnxruntime']}, numpy {env['numpy']}, fastopt {env['fastopt']} "
        f"(repo {env['fastopt_commit']})",
        "- models: the onnx wheel's `backend/test/data/light/light_*.onnx`, weights materialized "
        "from their ConstantOfShape nodes as initializers (random, seeded), batch 1, input = "
        "test_data_set_0's arange(n)/n",
        f"- method: CPUExecutionProvider, intra-op threads = "
        f"{args.threads or 'ORT default'}; {args.warmup} warm-up runs, then {args.runs} runs per "
        "side, before/after alternating; ms as median (min); speedup = before / after by median "
        "(by min: less sensitive to other load on the machine); p10/p90 in cnn.json. "
        '"ORT on" = ORT_ENABLE_ALL '
        "(how users run it: ORT does Conv+BN and Conv+activation fusion itself); "
        '"ORT off" = ORT_DISABLE_ALL (what the fusions buy where ORT does not).',
        f"- load average (1 min) at start / end: {env['load_average_1min'][0]:.1f} / "
        f"{env['load_average_1min'][1]:.1f} on {env['cores']} cores (other work on the machine "
        "is noise in these timings)",
        "- parity: max |after - before| / max(1, max |before|) over the outputs (class scores "
        "too), ORT off",
        "",
        "| model | nodes before → after | ORT on: before | after | speedup | ORT off: before "
        "| after | speedup | parity | what changed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        cells = [r["model"], f"{r['nodes_before']} → {r['nodes_after']}"]
        for level in LEVELS:
            b, a = r["levels"][level]["before"], r["levels"][level]["after"]
            cells += [
                f"{b['median_ms']:.2f} ({b['min_ms']:.2f})",
                f"{a['median_ms']:.2f} ({a['min_ms']:.2f})",
                f"{b['median_ms'] / a['median_ms']:.2f}x ({b['min_ms'] / a['min_ms']:.2f}x)",
            ]
        cells += [f"{r['max_rel_diff']:.1e}", short_delta(r["op_delta"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "The light models' weights: ConstantOfShape nodes, which need constant folding before "
        "any fusion can see them; this benchmark does that folding itself (see `materialize`).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="timed runs per side (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT default)")
    ap.add_argument("--models", default="", help="comma-separated names (default: all)")
    ap.add_argument("--no-results", action="store_true", help="print only, write nothing")
    args = ap.parse_args(argv)
    paths = sorted(LIGHT_DIR.glob("light_*.onnx"))
    if args.models:
        wanted = {m.strip().removeprefix("light_") for m in args.models.split(",")}
        paths = [p for p in paths if p.stem.removeprefix("light_") in wanted]
    if not paths:
        print(f"no light models found in {LIGHT_DIR}", file=sys.stderr)
        return 2
    env = environment()
    load_before = os.getloadavg()[0]
    results = []
    for p in paths:
        print(f"{p.stem} ...", file=sys.stderr, flush=True)
        results.append(bench_model(p, args.runs, args.warmup, args.threads))
    # Other work on the machine shows as noise: record how busy it was.
    env["load_average_1min"] = [load_before, os.getloadavg()[0]]
    text = to_markdown(env, args, results)
    print(text)
    if not args.no_results:
        out = BENCH / "results"
        out.mkdir(exist_ok=True)
        (out / "cnn.md").write_text(text)
        data = {"environment": env, "args": vars(args), "results": results}
        (out / "cnn.json").write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
