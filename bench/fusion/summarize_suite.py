#!/usr/bin/env python3
"""The suite summary: one Markdown page (results/suite.md) of what bench_llm_fusions.py measured,
fastopt against every peer, from the JSON reports of its runs (fixtures and 0.5B exports are
usually run apart; the reports are merged as `bench_llm_fusions.py --merge` does).

Per tool: (a) optimize time and peak RSS, on the fixtures as the median over fixtures with the
median of the per-fixture ratios tool/fastopt, and on each 0.5B export; (b) ORT CPU prefill
latency of its output against the original; (c) validity: onnx.checker, ORT load and run,
logits against the original. Header: dates, machine, versions, the exact commands.

    python bench/fusion/summarize_suite.py results/llm_fusions.json results/llm_fusions_0.5b.json \\
        --out results/suite.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # _benchlib
from _benchlib import fmt_mb, fmt_s  # noqa: E402
from bench_llm_fusions import DISTS, PARITY_TOL, TOOLS, merge_reports  # noqa: E402

DEFAULT_OUT = BENCH / "results" / "suite.md"
LARGE_PREFIX = "qwen2_0.5b"
BASELINE = "fastopt"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _range(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "-"


def _cost(m: dict[str, Any], tool: str) -> tuple[float, int] | None:
    """(seconds, peak RSS bytes) of a tool that finished on this model."""
    s = m.get("timing", {}).get(tool, {})
    if s.get("optimize_s") is None:
        return None
    return float(s["optimize_s"]), int(s["peak_rss"])


def _failure(m: dict[str, Any], tool: str) -> str | None:
    s = m.get("timing", {}).get(tool)
    if s is None:
        return None
    return str(s["error"]) if s.get("error") and s.get("optimize_s") is None else None


def _valid(m: dict[str, Any], tool: str) -> dict[str, bool] | None:
    """checker / ort / parity of one output; None when the tool was not run or failed."""
    v = m.get("check", {}).get("tools", {}).get(tool)
    if not v or "nodes" not in v:
        return None
    tol = PARITY_TOL.get(m.get("dtype", "float32"), 1e-4)
    diff = v.get("max_abs")
    return {
        "checker": v.get("checker") == "ok",
        "ort": v.get("ort") == "ok",
        "parity": diff is not None and diff <= tol,
    }


def fixture_cost_table(models: dict[str, Any], tools: list[str]) -> list[str]:
    lines = [
        "| tool | fixtures run | median time | time / fastopt (median, range) | median peak RSS "
        "| RSS / fastopt (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in tools:
        costs = [(n, c) for n, m in models.items() if (c := _cost(m, t))]
        base = {n: c for n, m in models.items() if (c := _cost(m, BASELINE))}
        t_ratio = [c[0] / base[n][0] for n, c in costs if n in base]
        m_ratio = [c[1] / base[n][1] for n, c in costs if n in base]
        failed = sum(1 for m in models.values() if _failure(m, t))
        ran = f"{len(costs)}" + (f" ({failed} failed)" if failed else "")
        lines.append(
            f"| {TOOLS[t]} | {ran} | {fmt_s(_median([c[0] for _, c in costs]))} | "
            f"{_x(_median(t_ratio))} ({_range(t_ratio)}) | "
            f"{fmt_mb(_median([c[1] for _, c in costs]))} | {_x(_median(m_ratio))} |"
        )
    return lines


def large_cost_table(models: dict[str, Any], tools: list[str]) -> list[str]:
    names = list(models)
    heads = [f"{n}: time (/ fastopt) | {n}: peak RSS (/ fastopt)" for n in names]
    lines = [
        "| tool | " + " | ".join(heads) + " |",
        "|---|" + "---:|---:|" * len(names),
    ]
    for t in tools:
        cells = []
        for m in models.values():
            c, base, err = _cost(m, t), _cost(m, BASELINE), _failure(m, t)
            if c is None:
                cells += [f"failed: {err}" if err else "not run", "-"]
                continue
            runs = m["timing"][t].get("runs", 1)
            n = f", {runs} runs" if runs > 1 else ""
            cells.append(f"{fmt_s(c[0])} ({_x(c[0] / base[0]) if base else '-'}{n})")
            cells.append(f"{fmt_mb(c[1])} ({_x(c[1] / base[1]) if base else '-'})")
        lines.append(f"| {TOOLS[t]} | " + " | ".join(cells) + " |")
    return lines


def fixture_latency_table(models: dict[str, Any], tools: list[str]) -> list[str]:
    lines = [
        "| tool | fixtures timed | latency / original (median) | range | median ms "
        "(original: {}) |",
        "|---|---:|---:|---:|---:|",
    ]
    orig = [m["latency"]["ms"]["original"]["median"] for m in models.values() if _has_lat(m)]
    lines[0] = lines[0].format(f"{_median(orig):.2f} ms" if orig else "-")
    for t in tools:
        ratios = [m["latency"]["ratio"][t] for m in models.values() if _has_lat(m, t)]
        ms = [m["latency"]["ms"][t]["median"] for m in models.values() if _has_lat(m, t)]
        med = _median(ms)
        lines.append(
            f"| {TOOLS[t]} | {len(ratios)} | {_x(_median(ratios))} | {_range(ratios)} | "
            f"{'-' if med is None else f'{med:.2f}'} |"
        )
    return lines


def _has_lat(m: dict[str, Any], tool: str = "original") -> bool:
    lat = m.get("latency", {})
    if tool == "original":
        return "original" in lat.get("ms", {})
    return tool in lat.get("ratio", {})


def large_latency_table(models: dict[str, Any], tools: list[str]) -> list[str]:
    """Ratio first: runs of different processes (merged runs) can be minutes apart on a shared
    machine, so only a tool's ms against the original's of the same process compare."""
    names = list(models)
    lines = [
        "| tool | " + " | ".join(f"{n}: / original (tool ms / original ms)" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for t in tools:
        cells = []
        for m in models.values():
            if _has_lat(m, t):
                ms, ratio = m["latency"]["ms"][t]["median"], m["latency"]["ratio"][t]
                cells.append(f"{_x(ratio)} ({ms:.0f} / {ms / ratio:.0f} ms)")
            else:
                cells.append("-")
        lines.append(f"| {TOOLS[t]} | " + " | ".join(cells) + " |")
    return lines


def validity_table(models: dict[str, Any], tools: list[str]) -> list[str]:
    lines = [
        "| tool | optimize failed | passes onnx.checker | loads and runs in ORT "
        "| logits match the original |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in tools:
        ran = [m for m in models.values() if t in m.get("timing", {})]
        vs = [v for m in ran if (v := _valid(m, t)) is not None]
        failed = sum(1 for m in ran if _failure(m, t))
        n = len(ran)
        lines.append(
            f"| {TOOLS[t]} | {failed}/{n} | {sum(v['checker'] for v in vs)}/{n} | "
            f"{sum(v['ort'] for v in vs)}/{n} | {sum(v['parity'] for v in vs)}/{n} |"
        )
    return lines


def problems(models: dict[str, Any], tools: list[str]) -> list[str]:
    """Every failure other than the checker rejecting ORT contrib ops (expected, see above)."""
    out = []
    for name, m in models.items():
        for t in tools:
            err = _failure(m, t)
            if err:
                out.append(f"- {name} / {TOOLS[t]}: optimize failed: {err}")
            v = m.get("check", {}).get("tools", {}).get(t, {})
            checker = v.get("checker", "ok")
            if checker != "ok" and "No Op registered for" not in checker:
                out.append(f"- {name} / {TOOLS[t]}: checker: {checker}")
            if v.get("ort", "ok") != "ok":
                out.append(f"- {name} / {TOOLS[t]}: ORT: {v['ort']}")
            val = _valid(m, t)
            if val and val["ort"] and not val["parity"]:
                diff = v.get("max_abs")
                out.append(f"- {name} / {TOOLS[t]}: logits differ (max abs {diff})")
    return out


def render(reports: list[dict[str, Any]], merged: dict[str, Any]) -> str:
    env = reports[0]["environment"]
    tools = [t for t in TOOLS if t in merged["tools"]]
    fixtures = {n: m for n, m in merged["models"].items() if not n.startswith(LARGE_PREFIX)}
    large = {n: m for n, m in merged["models"].items() if n.startswith(LARGE_PREFIX)}
    dates = sorted({r["environment"]["date"] for r in reports})
    versions: dict[str, set[str]] = {d: set() for d in DISTS}
    for r in reports:  # earlier runs may not have recorded every peer's version
        for d in DISTS:
            if d in r["environment"]["versions"]:
                versions[d].add(r["environment"]["versions"][d])
    lines = [
        "# Benchmark suite: fastopt against the peer ONNX optimizers",
        "",
        "What optimizing an LLM export costs with each tool, how fast ONNX Runtime runs each "
        "tool's output, and whether the output is valid. Full tables per model (fused ops, node "
        "counts, every failure): [llm_fusions.md](llm_fusions.md) (fixtures) and "
        "[llm_fusions_0.5b.md](llm_fusions_0.5b.md) (0.5B exports); method in "
        "[bench/README.md](../README.md#bench_llm_fusionspy-llm-fusions-against-the-peers).",
        "",
        f"- dates: {', '.join(dates)}",
        f"- machine: {env['cpu']}, {env['cores']} cores, {fmt_mb(env['ram_bytes'])} RAM, "
        f"{env['os']}; shared with other jobs, runs at `nice -n 10`",
        "- versions: python "
        + env["python"]
        + ", "
        + ", ".join(f"{d} {' / '.join(sorted(v)) or '?'}" for d, v in versions.items())
        + " (fastopt repo "
        + ", ".join(sorted({r["environment"]["fastopt_commit"] for r in reports}))
        + ")",
        "- tools: " + "; ".join(f"{TOOLS[t]} (`{t}`)" for t in tools),
        "- models: "
        + f"{len(fixtures)} fixtures (tests/fixtures/models: 8 architectures, TorchScript and "
        "dynamo exports, float32/float16, 2 layers, hidden 64); "
        + (
            ", ".join(f"{n} ({fmt_mb(m['bytes'])})" for n, m in large.items())
            + " (Qwen2-0.5B shape, 24 layers, float32, external data)"
            if large
            else "no 0.5B export"
        ),
        "- commands (results merged by `bench/fusion/summarize_suite.py`):",
        *(
            # a merged report's command already lists its runs, quoted, with their dates
            f"  - {r['command']} ({r['total_s'] / 60:.1f} min in all)"
            if r.get("merged")
            else f"  - `{r['command']}` ({r['environment']['date']}, {r['total_s'] / 60:.1f} min)"
            for r in reports
        ),
        "",
        "## Optimization time and peak RSS",
        "",
        "Each tool in a fresh process; time = load + optimize + save (imports excluded); peak "
        "RSS = the process's ru_maxrss (imports included). Ratios are tool / fastopt "
        "`--preset llm --target ort` on the same model (below 1.00x: the tool took less). "
        "The tools do different amounts of work: see the fused ops and node counts in the "
        "full tables.",
        "",
    ]
    if fixtures:
        lines += ["Fixtures:", "", *fixture_cost_table(fixtures, tools), ""]
    if large:
        lines += ["0.5B exports:", "", *large_cost_table(large, tools), ""]
    lines += [
        "## ORT CPU prefill latency of each tool's output",
        "",
        f"ORT_ENABLE_ALL (as users run it), intra_op threads 2, batch 1, {merged['seq']} "
        f"tokens, median of {merged['runs']} runs, the original and the outputs interleaved in "
        "one process; ratio to the original measured in the same process. Runs merged from "
        "different times can differ 2x in ms on a shared machine (other jobs' load): compare "
        "ratios. The fixtures run in ~1 ms, mostly ORT's per-run overhead: there ratios within "
        "+-10 % are noise.",
        "",
    ]
    if fixtures:
        lines += ["Fixtures:", "", *fixture_latency_table(fixtures, tools), ""]
    if large:
        lines += ["0.5B exports:", "", *large_latency_table(large, tools), ""]
    lines += [
        "## Validity",
        "",
        "Outputs counted per model: `onnx.checker.check_model(full_check=True)`; ONNX Runtime "
        "(optimizations off) loads and runs it; logits within "
        + ", ".join(f"{k} {v:g}" for k, v in PARITY_TOL.items())
        + " (max abs) of the original's, 16 tokens. The checker rejects every output that "
        "holds ORT contrib ops registered in the ai.onnx domain (SimplifiedLayerNormalization): "
        "expected for ORT-targeted outputs, which ORT runs.",
        "",
    ]
    if fixtures:
        lines += ["Fixtures:", "", *validity_table(fixtures, tools), ""]
    if large:
        lines += ["0.5B exports:", "", *validity_table(large, tools), ""]
    lines += ["## Failures (other than the expected checker rejections)", ""]
    lines += problems(merged["models"], tools) or ["None."]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("reports", nargs="+", help="JSON reports of bench_llm_fusions.py runs")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown file")
    args = ap.parse_args(argv)
    reports = [json.loads(Path(p).read_text()) for p in args.reports]
    md = render(reports, merge_reports(args.reports))
    Path(args.out).write_text(md)
    print(md)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
