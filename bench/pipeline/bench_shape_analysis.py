#!/usr/bin/env python3
"""Graph work and node counts with the C++ shape analysis (issue 12), beside onnxslim.

For each model: `fastopt.optimize(path, preset=...)` in this process (load and save excluded:
the model is loaded first, no output), graph work = the sum of the report's per-pass times,
the `infer_shapes` pass's share, which shape engine ran (report counters), and the node count
after; onnxslim's node count on the same file (`onnxslim.slim(onnx.load(path))`, defaults).
The large TorchScript 0.5B export is run with --preset llm --kv-cache inplace (as the issue
measures it), and the fixtures / corpus with --preset default.

    python bench/pipeline/bench_shape_analysis.py                       # fixtures + corpus + 0.5B
    python bench/pipeline/bench_shape_analysis.py --no-large --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time
from pathlib import Path

import fastopt

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
CORPUS = REPO.parent / "shared" / "corpus"
LARGE = Path("/tmp/fastopt-bench/qwen2_0.5b_ts/model.onnx")


def graph_work(path: str, preset: str, kv_cache: str | None, repeat: int) -> dict[str, object]:
    times, shapes, engines, nodes = [], [], set(), 0
    for _ in range(repeat):
        model = fastopt.load(path)
        t0 = time.perf_counter()
        report = fastopt.optimize(model, preset=preset, kv_cache=kv_cache)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        times.append(sum(p.seconds for p in report.passes))
        shapes.append(sum(p.seconds for p in report.passes if p.name == "infer_shapes"))
        for p in report.passes:
            if p.name == "infer_shapes":
                engines.update(k for k in p.counters if k.startswith("engine:"))
        nodes = report.nodes_after
        del wall
    return {
        "work": statistics.median(times),
        "shapes": statistics.median(shapes),
        "engines": ",".join(sorted(e.removeprefix("engine:") for e in engines)) or "-",
        "nodes": nodes,
        "before": report.nodes_before,
    }


def slim_nodes(path: str) -> int | str:
    try:
        import onnx
        import onnxslim
    except ImportError:
        return "-"
    m = onnxslim.slim(onnx.load(path))
    return len(m.graph.node)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-large", action="store_true")
    ap.add_argument("--no-slim", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(BENCH / "results" / "shape_analysis.md"))
    a = ap.parse_args()
    rows = []
    paths = sorted(glob.glob(str(REPO / "tests/fixtures/models/*/model.onnx")))
    paths += sorted(glob.glob(str(CORPUS / "*/model.onnx")))
    for p in paths:
        r = graph_work(p, "default", None, a.repeat)
        r["slim"] = "-" if a.no_slim else slim_nodes(p)
        r["name"] = Path(p).parent.name + (" (corpus)" if str(CORPUS) in p else "")
        rows.append(r)
        print(r, flush=True)
    large = None
    if not a.no_large and LARGE.exists():
        large = graph_work(str(LARGE), "llm", "inplace", a.repeat)
        print("large", large, flush=True)
    lines = [
        f"# shape analysis: graph work and node counts {a.label}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; fastopt {fastopt.__file__}",
        f"- `python bench/pipeline/bench_shape_analysis.py`; median of {a.repeat}; "
        "graph work = sum of the report's pass times (load/save excluded)",
        "",
    ]
    if large:
        lines += [
            "## TorchScript Qwen2-0.5B export, --preset llm --kv-cache inplace",
            "",
            "| graph work | infer_shapes | engine | nodes before | nodes after |",
            "|---:|---:|---|---:|---:|",
            f"| {large['work'] * 1e3:.0f} ms | {large['shapes'] * 1e3:.0f} ms | "
            f"{large['engines']} | {large['before']} | {large['nodes']} |",
            "",
        ]
    lines += [
        "## fixtures and corpus, --preset default",
        "",
        "| model | nodes before | fastopt | onnxslim | graph work | infer_shapes | engine |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        work, shapes = float(r["work"]), float(r["shapes"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['name']} | {r['before']} | {r['nodes']} | {r['slim']} | "
            f"{work * 1e3:.1f} ms | {shapes * 1e3:.1f} ms | {r['engines']} |"
        )
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
