"""int8-dynamic: fastopt's quantize_dynamic pass against onnxruntime's quantize_dynamic (QInt8)
on the 2.4 GB Qwen2-0.5B-shaped export and on a ResNet-50-shaped CNN: time and peak RSS of
each tool (one fresh process each), byte identity of the quantized weights, output size, and
ONNX Runtime CPU latency of both outputs and of the fp32 original (prefill of 128 tokens for
the decoder, one 224x224 image for the CNN), interleaved in one process.

    python bench/quant/bench_quantize_dynamic.py                   # both models
    python bench/quant/bench_quantize_dynamic.py --skip-large      # the CNN only
    python bench/quant/bench_quantize_dynamic.py --threads 2 --runs 20

The decoder is the suite's export (bench/fusion/bench_llm_fusions.py makes
/tmp/fastopt-bench/qwen2_0.5b_ts when absent); the CNN is bench/models/make_resnet50.py's (random
weights, torchvision-free). Results: bench/results/quantize_dynamic.md (+ .json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
from _benchlib import (
    MB,
    RESULT_TAG,
    environment,
    error_text,
    fmt_mb,
    fmt_s,
    result_line,
    spawn,
    write_results,
)

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
LARGE = "/tmp/fastopt-bench/qwen2_0.5b_ts/model.onnx"


# ---- children ------------------------------------------------------------------------------
def _cpu_seconds() -> float:
    """User + system CPU of this process so far, all its threads (imports included)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def child_fastopt(src: str, out: str, per_channel: bool) -> dict[str, Any]:
    import time

    import fastopt

    t0 = time.perf_counter()
    r = fastopt.quantize(src, out, mode="int8-dynamic", per_channel=per_channel)
    return {
        "seconds": time.perf_counter() - t0,
        "quantized": r.summary.quantized,
        "pass_seconds": sum(p.seconds for p in r.passes),
        "cpu_seconds": _cpu_seconds(),
    }


def child_ort(src: str, out: str, per_channel: bool) -> dict[str, Any]:
    import logging
    import time

    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)
    t0 = time.perf_counter()
    quantize_dynamic(
        src, out, weight_type=QuantType.QInt8, per_channel=per_channel,
        use_external_data_format=True,
    )  # fmt: skip
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": _cpu_seconds()}


def child_compare(ours: str, theirs: str) -> dict[str, Any]:
    """Quantized weights, scales and zero points of fastopt's output against onnxruntime's."""
    import fastopt
    import numpy as np

    a = {t.name: t for t in fastopt.load(ours).graph.initializers}
    b = {t.name: t for t in fastopt.load(theirs).graph.initializers}
    same = differ = 0
    for name, t in a.items():
        if not name.endswith(("_quantized", "_scale", "_zero_point")):
            continue
        x, y = t.numpy(), b[name].numpy() if name in b else None
        if y is not None and x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y):
            same += 1
        else:
            differ += 1
    return {"identical": same, "different": differ}


def child_latency(
    paths: list[str], phase: str, seq: int, threads: int, runs: int
) -> dict[str, Any]:
    import fastopt.bench

    results = fastopt.bench.compare(paths, phase=phase, seq=seq, threads=threads, runs=runs)
    return {"median_ms": [r.stats.median * 1e3 for r in results]}


# ---- parent --------------------------------------------------------------------------------
def _run(args: list[str], timeout: float, max_rss: int = 0) -> dict[str, Any]:
    rc, wall, rss, out, err = spawn(
        [sys.executable, __file__, "--child", *args], timeout, max_rss=max_rss
    )
    res: dict[str, Any] = {"rc": rc, "process_wall_s": wall, "peak_rss": rss}
    if rc != 0:
        res["error"] = "killed (time or memory cap)" if rc == -9 else error_text(rc, err)
        return res
    res.update(result_line(out))
    return res


def _size(path: str) -> int:
    folder = Path(path).parent
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def bench_model(name: str, src: str, work: str, a: argparse.Namespace) -> dict[str, Any]:
    print(f"{name}: {src}", flush=True)
    os.makedirs(f"{work}/fastopt", exist_ok=True)
    os.makedirs(f"{work}/ort", exist_ok=True)
    ours, theirs = f"{work}/fastopt/model.onnx", f"{work}/ort/model.onnx"
    pc = ["--per-channel"] if a.per_channel else []
    row: dict[str, Any] = {"model": name, "source_bytes": _size(src)}
    row["fastopt"] = _run(["fastopt", src, ours, *pc], a.timeout)
    print(f"  fastopt  {fmt_s(row['fastopt'].get('seconds'))} "
          f"(process {fmt_s(row['fastopt']['process_wall_s'])}), "
          f"peak RSS {fmt_mb(row['fastopt']['peak_rss'])}", flush=True)  # fmt: skip
    row["ort"] = _run(["ort", src, theirs, *pc], a.timeout, max_rss=a.max_rss_gb * 1024 * MB)
    o = row["ort"]
    print(f"  ort      {fmt_s(o.get('seconds'))} (process {fmt_s(o['process_wall_s'])}), "
          f"peak RSS {fmt_mb(o['peak_rss'])} {o.get('error', '')}", flush=True)  # fmt: skip
    row["fastopt"]["bytes"] = _size(ours)
    if "error" not in row["ort"]:
        row["ort"]["bytes"] = _size(theirs)
        row["compare"] = _run(["compare", ours, theirs], a.timeout)
        print(f"  weights: {row['compare']}", flush=True)
    if a.no_latency:
        row["latency"] = {}
        return row
    paths = [src, ours] + ([theirs] if "error" not in row["ort"] else [])
    phase = "prefill"
    row["latency"] = _run(
        ["latency", phase, str(a.seq), str(a.threads), str(a.runs), *paths], a.timeout
    )
    print(f"  latency (ms, fp32 / fastopt / ort): {row['latency'].get('median_ms')}", flush=True)
    return row


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], a: argparse.Namespace) -> str:
    lines = [
        "# int8-dynamic: fastopt vs onnxruntime.quantization.quantize_dynamic",
        "",
        f"{env.get('date', '')}, {env.get('cpu', '')}, {a.threads} ORT threads; "
        f"onnxruntime {env.get('versions', {}).get('onnxruntime', '?')}. QInt8 weights, "
        f"{'per channel' if a.per_channel else 'per tensor'}, symmetric (both tools' default).",
        "",
        "Command: `python bench/quant/bench_quantize_dynamic.py "
        f"--threads {a.threads} --runs {a.runs}{' --per-channel' if a.per_channel else ''}"
        f"{' --no-latency' if a.no_latency else ''}`",
        "",
        f"Load average (1 min) at the start and the end: {env.get('load_start', '?')}, "
        f"{env.get('load_end', '?')} (a shared machine: CPU time is the tool's own work).",
        "",
        "| model | tool | time (process) | CPU (process) | peak RSS | output size "
        "| prefill/run latency | vs fp32 | weights identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lat = r["latency"].get("median_ms") or []
        base = lat[0] if lat else None
        lines.append(
            f"| {r['model']} | fp32 original | - | - | - | {fmt_mb(r['source_bytes'])} | "
            f"{base:.1f} ms | 1.00x | - |"
            if base
            else f"| {r['model']} | fp32 original | - | - | - | {fmt_mb(r['source_bytes'])} "
            "| - | - | - |"
        )
        for k, tool in enumerate(("fastopt", "ort"), start=1):
            t = r[tool]
            if "error" in t:
                lines.append(f"| {r['model']} | {tool} | {t['error']} | - "
                             f"| {fmt_mb(t['peak_rss'])} | - | - | - | - |")  # fmt: skip
                continue
            ms = lat[k] if len(lat) > k else None
            same = r.get("compare", {})
            ident = f"{same.get('identical')}/{same.get('identical', 0) + same.get('different', 0)}"
            lines.append(
                f"| {r['model']} | {'fastopt' if tool == 'fastopt' else 'quantize_dynamic'} | "
                f"{fmt_s(t['seconds'])} ({fmt_s(t['process_wall_s'])}) | "
                f"{fmt_s(t.get('cpu_seconds'))} | {fmt_mb(t['peak_rss'])} | "
                f"{fmt_mb(t.get('bytes'))} | "
                + (f"{ms:.1f} ms | {ms / base:.2f}x" if ms and base else "- | -")
                + f" | {ident if tool == 'fastopt' else ''} |"
            )
    lines += [
        "",
        "Time: the tool's own call (in parentheses: the whole process, Python and imports "
        "included); peak RSS of that process. Latency: median of interleaved runs in one "
        "process (fastopt.bench.compare, ORT optimizations on). quantize_dynamic also "
        "quantizes the embedding Gather (uint8 DequantizeLinear in front of it); fastopt keeps "
        "it in float (the size difference on the decoder).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child", nargs=argparse.REMAINDER)
    p.add_argument("--skip-large", action="store_true")
    p.add_argument("--per-channel", action="store_true")
    p.add_argument("--no-latency", action="store_true", help="time the quantizers only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--max-rss-gb", type=int, default=14)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "fastopt-bench-qdyn"))
    p.add_argument("--out", default=str(BENCH / "results" / "quantize_dynamic.md"))
    a = p.parse_args()
    if a.child:
        kind, rest = a.child[0], a.child[1:]
        if kind == "latency":
            res = child_latency(rest[4:], rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
        elif kind == "compare":
            res = child_compare(rest[0], rest[1])
        else:
            fn = child_fastopt if kind == "fastopt" else child_ort
            res = fn(rest[0], rest[1], "--per-channel" in rest)
        print(RESULT_TAG + json.dumps(res))
        return
    resnet = os.path.join(a.work, "resnet50", "model.onnx")
    if not os.path.exists(resnet):
        spawn([sys.executable, str(BENCH / "models/make_resnet50.py"), resnet], a.timeout)
    models = {"resnet50 (random weights)": resnet}
    if not a.skip_large:
        if not os.path.exists(LARGE):
            spawn([sys.executable, str(BENCH / "fusion/bench_llm_fusions.py"), "--make-large", "ts",
                   os.path.dirname(LARGE)], 3600)  # fmt: skip
        models["qwen2_0.5b_ts (2.4 GB)"] = LARGE
    rows = []
    load_start = round(os.getloadavg()[0], 1)
    for k, (name, src) in enumerate(models.items()):
        rows.append(bench_model(name, src, os.path.join(a.work, f"m{k}"), a))
    env = environment(["onnxruntime", "onnx", "numpy"])
    env["load_start"], env["load_end"] = load_start, round(os.getloadavg()[0], 1)
    write_results(markdown(rows, env, a), {"rows": rows, "env": env}, a.out)


if __name__ == "__main__":
    main()
