"""Matcher benchmark: a synthetic graph of N nodes holding M copies of a 6-op pattern.

The pattern is the decomposed RMSNorm that exporters emit,

    x ─ Pow(2) ─ ReduceMean ─ Add(eps) ─ Sqrt ─ Div(1, ·) ─ Mul(x, ·) → y

rewritten into one SimplifiedLayerNormalization node; the rest of the graph is filler
(Relu/Neg chains) the driver must skip. Reports matching + rewriting time (the apply_rules call,
fixed point included) and load time. Target: under 1 s for 1M nodes / 100k matches.

    python bench/pipeline/bench_matcher.py [--nodes 1000000] [--matches 100000]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

import fastopt
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(nodes: int, matches: int) -> onnx.ModelProto:
    """Blocks of [6-op RMSNorm pattern + filler] chained one after another."""
    filler = max(0, (nodes - 6 * matches) // max(matches, 1))
    out: list[onnx.NodeProto] = []
    prev = "X"
    for b in range(matches):
        p = f"b{b}_"
        out += [
            helper.make_node("Pow", [prev, "two"], [p + "pw"]),
            helper.make_node("ReduceMean", [p + "pw"], [p + "rm"], axes=[-1], keepdims=1),
            helper.make_node("Add", [p + "rm", "eps"], [p + "ad"]),
            helper.make_node("Sqrt", [p + "ad"], [p + "sq"]),
            helper.make_node("Div", ["one", p + "sq"], [p + "dv"]),
            helper.make_node("Mul", [prev, p + "dv"], [p + "y"]),
        ]
        prev = p + "y"
        for f in range(filler):
            op = "Relu" if f % 2 == 0 else "Neg"
            out.append(helper.make_node(op, [prev], [f"{p}f{f}"]))
            prev = f"{p}f{f}"
    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2, 8])
    g = helper.make_graph(out, "synthetic", [x], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def rms_rule() -> fastopt.Rule:
    p = fastopt.Pattern("rms_norm")
    x = p.var("x")
    ms = p.op("ReduceMean", [p.op("Pow", [x, p.scalar("two", 2.0)])]).attr("axes", [-1])
    inv = p.op(
        "Div",
        [p.scalar("one", 1.0), p.op("Sqrt", [p.op("Add", [ms, p.constant("eps")]).commutative()])],
    )
    p.root(p.op("Mul", [x, inv]).commutative())
    return fastopt.Rule(
        "rms_norm", p, replace=("SimplifiedLayerNormalization", ["x"], {"epsilon": "$eps"})
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--matches", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--out",
        default=str(Path(__file__).resolve().parents[1] / "results" / "matcher.md"),
        help="Markdown results file ('' to skip)",
    )
    args = ap.parse_args()

    load_avg = os.getloadavg()[0]
    t0 = time.perf_counter()
    proto = build(args.nodes, args.matches)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "synthetic.onnx")
        onnx.save(proto, path)
        n_nodes = len(proto.graph.node)
        del proto
        print(f"built {n_nodes} nodes in {time.perf_counter() - t0:.1f} s")
        rule = rms_rule()
        times, loads = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            m = fastopt.load(path)
            loads.append(time.perf_counter() - t)
            t = time.perf_counter()
            rewrites, _, _ = fastopt.apply_rules(m, [rule])
            times.append(time.perf_counter() - t)
            assert rewrites == args.matches, rewrites
            m.verify()
            del m
    med = float(np.median(times))
    table = (
        "| nodes | matches | load (s) | match+rewrite (s) | per match (us) | target |\n"
        "|---:|---:|---:|---:|---:|---|\n"
        f"| {n_nodes} | {args.matches} | {np.median(loads):.3f} | {med:.3f} | "
        f"{med / args.matches * 1e6:.2f} | < 1 s: {'PASS' if med < 1.0 else 'MISS'} |\n"
    )
    print(table)
    if args.out:
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        header = (
            "# fastopt matcher benchmark\n\n"
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n"
            f"- machine: {cpu}, {os.cpu_count()} cores; load average at start {load_avg:.2f}\n"
            f"- versions: python {platform.python_version()}, onnx {onnx.__version__}, "
            f"fastopt {fastopt.__version__}\n"
            "- graph: decomposed RMSNorm (Pow, ReduceMean, Add, Sqrt, Div, Mul) x matches, "
            "chained, with Relu/Neg filler; the constants 2, 1 and eps are shared by every "
            "match (as after CSE), so their use lists hold `matches` entries\n"
            "- measured: `fastopt.apply_rules(model, [rule])` to the fixed point "
            f"(median of {args.repeat}, fresh load each); "
            "`python bench/pipeline/bench_matcher.py`\n\n"
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(header + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
