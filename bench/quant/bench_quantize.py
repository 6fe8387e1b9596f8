"""fastopt int4 quantization vs onnxruntime's MatMulNBitsQuantizer on the same model, in one run:
time and peak RSS (each tool in a fresh child process), output size, and byte identity of every
quantized weight (B, scales). Settings: int4, block 32, symmetric, accuracy level 4 (the model
builder's CPU defaults).

    python bench/quant/bench_quantize.py [--model /tmp/fastopt-bench/qwen2_0.5b_ts/model.onnx]
                                   [--out bench/results/quantize.md]

The default model is the 2.4 GB Qwen2-0.5B-shaped TorchScript export made by
``python bench/models/make_llm_model.py`` (see bench/README.md); it is made when absent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
import _benchlib as bl

DEFAULT_MODEL = "/tmp/fastopt-bench/qwen2_0.5b_ts/model.onnx"


def _child(tool: str, src: str, dst: str) -> None:
    if tool in ("fastopt", "fastopt-external"):
        import fastopt

        r = fastopt.quantize(
            src,
            dst,
            mode="int4",
            block_size=32,
            symmetric=True,
            accuracy_level=4,
            # external: the quantized bytes are written once, into the output's data file
            external_data=True if tool == "fastopt-external" else None,
        )
        info = {
            "quantized": r.summary.quantized,
            "kept": r.summary.kept,
            "call_seconds": r.seconds,
            "pass_seconds": sum(p.seconds for p in r.passes),
        }
    elif tool == "ort":
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        q = MatMulNBitsQuantizer(onnx.load(src), block_size=32, is_symmetric=True, accuracy_level=4)
        q.process()
        q.model.save_model_to_file(dst, use_external_data_format=True)
        info = {}
    else:  # compare: byte identity of the quantized weights of the two outputs
        import fastopt

        ours, theirs = src, dst
        a = {t.name: t for t in fastopt.load(ours).graph.initializers}
        b = {t.name: t for t in fastopt.load(theirs).graph.initializers}
        names = [n for n in a if n.endswith(("_Q4", "_scales", "_zero_points"))]
        same = sum(
            1 for n in names if n in b and bytes(a[n].numpy().data) == bytes(b[n].numpy().data)
        )
        info = {"compared": len(names), "identical": same}
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    info["cpu_seconds"] = ru.ru_utime + ru.ru_stime
    print(bl.RESULT_TAG + json.dumps(info), flush=True)


def _warm(path: str) -> None:
    """Reads the model's files once (1 MB at a time), so each tool starts with them in the page
    cache: otherwise whoever runs first pays the disk (measured: 16 s of a 19 s run)."""
    folder = Path(path).parent
    for p in folder.iterdir():
        if p.name.startswith(Path(path).name) and p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass


def _size(path: str) -> int:
    folder = Path(path).parent
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith(Path(path).name))


def _decode(model: str, work: str) -> list[str]:
    """Optimizes the model to the in-place form in fp32 and int4 and times one decode step of
    each, interleaved in one fastopt bench process."""
    with tempfile.TemporaryDirectory(prefix="bench-quant-decode-", dir=work) as tmp:
        outs = {}
        lines = [
            "| model | optimize time | median step | p90 | ratio |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        times = {}
        for name, extra in (("fp32", []), ("int4", ["--quantize", "int4"])):
            out = os.path.join(tmp, name, "model.onnx")
            os.makedirs(os.path.dirname(out))
            cmd = [
                sys.executable,
                "-m",
                "fastopt",
                "optimize",
                model,
                "-o",
                out,
                "--preset",
                "llm",
                "--kv-cache",
                "inplace",
                *extra,
            ]
            rc, wall, _, _, err = bl.spawn(cmd, timeout=900)
            if rc != 0:
                return [f"optimize {name} failed: {bl.error_text(rc, err)}"]
            outs[name], times[name] = out, wall
        js = os.path.join(tmp, "bench.json")
        cmd = [
            sys.executable,
            "-m",
            "fastopt",
            "bench",
            outs["fp32"],
            "--against",
            outs["int4"],
            "--phase",
            "decode",
            "--seq",
            "256",
            "--threads",
            "2",
            "--runs",
            "30",
            "--json",
            js,
        ]
        rc, _, _, _, err = bl.spawn(cmd, timeout=1200)
        if rc != 0:
            return [f"fastopt bench failed: {bl.error_text(rc, err)}"]
        results = json.loads(Path(js).read_text())
        runs = results["results"] if isinstance(results, dict) and "results" in results else results
        base = None
        for name, r in zip(("fp32", "int4"), runs):
            med = r["stats"]["median"]
            base = base or med
            lines.append(
                f"| {name} | {bl.fmt_s(times[name])} | {med * 1e3:.1f} ms | "
                f"{r['stats']['p90'] * 1e3:.1f} ms | {med / base:.2f} |"
            )
        lines += [
            "",
            "Commands: `fastopt optimize MODEL -o OUT --preset llm --kv-cache inplace "
            "[--quantize int4]`; `fastopt bench FP32 --against INT4 --phase decode --seq 256 "
            "--threads 2 --runs 30`.",
        ]
        return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=str(bl.REPO / "bench" / "results" / "quantize.md"))
    ap.add_argument(
        "--decode",
        action="store_true",
        help="also: decode latency (context 256, 2 threads) of `optimize --preset llm "
        "--kv-cache inplace` with and without --quantize int4, interleaved by fastopt bench",
    )
    ap.add_argument(
        "--work",
        default=None,
        help="folder for the outputs (default: beside the model; one filesystem keeps the save's "
        "copies in the kernel)",
    )
    ap.add_argument("--child", nargs=3, metavar=("TOOL", "SRC", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    if not os.path.exists(args.model):
        folder = str(Path(args.model).parent)
        subprocess.run(
            [sys.executable, str(bl.REPO / "bench/models/make_llm_model.py"), folder], check=True
        )
    env = bl.environment(["onnx", "onnxruntime", "numpy"])
    env["load_average"] = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    work = args.work or str(Path(args.model).parent)
    os.makedirs(work, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-quant-", dir=work) as tmp:
        outs = {}
        for tool in ("fastopt", "fastopt-external", "ort"):
            dst = os.path.join(tmp, tool, "model.onnx")
            os.makedirs(os.path.dirname(dst))
            _warm(args.model)
            load_before = os.getloadavg()[0]
            rc, wall, rss, out, err = bl.spawn(
                [sys.executable, __file__, "--child", tool, args.model, dst],
                timeout=1800,
                max_rss=16 << 30,
            )
            row: dict[str, Any] = {
                "rc": rc,
                "seconds": wall,
                "peak_rss": rss,
                "load": (load_before, os.getloadavg()[0]),
            }
            if rc == 0:
                row.update(bl.result_line(out))
                row["output_bytes"] = _size(dst)
                outs[tool] = dst
            else:
                row["error"] = bl.error_text(rc, err)
            rows[tool] = row
            print(tool, row, flush=True)
        identity: dict[str, Any] = {}
        if len(outs) == 3:
            for ours in ("fastopt", "fastopt-external"):
                rc, _, _, out, err = bl.spawn(
                    [sys.executable, __file__, "--child", "compare", outs[ours], outs["ort"]],
                    timeout=600,
                )
                got = bl.result_line(out) if rc == 0 else {"error": bl.error_text(rc, err)}
                got = {k: v for k, v in got.items() if k != "cpu_seconds"}
                identity = identity or got
                if got != identity:  # both outputs hold the same tensors
                    identity = {**identity, "error": f"{ours}: {got}"}
    decode = _decode(args.model, work) if args.decode else None
    f, o = rows["fastopt"], rows["ort"]
    fx = rows["fastopt-external"]
    md = [
        "# int4 quantization: fastopt vs onnxruntime's MatMulNBitsQuantizer",
        "",
        f"{env['date']}; {env['cpu']}, {env['cores']} cores, "
        f"{env['ram_bytes'] / bl.MB / 1024:.0f} GiB; "
        f"onnxruntime {env['versions']['onnxruntime']}; fastopt {env['fastopt_commit']}",
        "",
        f"Model: `{args.model}` ({_size(args.model) / bl.MB:,.0f} MB). Settings: int4, block 32, "
        "symmetric, accuracy_level 4. Each tool runs in a fresh process, the model's files read "
        "into the page cache before each; time is the child's wall time (Python start and "
        "imports included), RSS its peak (wait4).",
        "",
        "| tool | time | CPU (user+sys) | peak RSS | output | load avg (start, end) | notes |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    named = (
        ("fastopt.quantize", f),
        ("fastopt.quantize, external data", fx),
        ("MatMulNBitsQuantizer", o),
    )
    for name, r in named:
        note = r.get("error", "")
        if "quantized" in r:
            note = (
                f"{r['quantized']} weights quantized, {r['kept']} kept; quantize() "
                f"{bl.fmt_s(r['call_seconds'])} (the pass {bl.fmt_s(r['pass_seconds'])})"
            )
        md.append(
            f"| {name} | {bl.fmt_s(r['seconds'])} | {bl.fmt_s(r.get('cpu_seconds'))} | "
            f"{bl.fmt_mb(r['peak_rss'])} | "
            f"{bl.fmt_mb(r.get('output_bytes'))} | "
            f"{r['load'][0]:.1f}, {r['load'][1]:.1f} | {note} |"
        )
    for label, r in (("fastopt", f), ("fastopt, external data", fx)):
        if r.get("rc") == 0 and o.get("rc") == 0:
            md += [
                "",
                f"Ratios (MatMulNBitsQuantizer / {label}): time "
                f"{o['seconds'] / r['seconds']:.1f}x, "
                f"CPU {o['cpu_seconds'] / r['cpu_seconds']:.1f}x, "
                f"peak RSS {o['peak_rss'] / r['peak_rss']:.1f}x.",
            ]
    if identity:
        md += [
            "",
            f"Byte identity of the quantized initializers (B and scales): "
            f"{identity.get('identical', '?')} of {identity.get('compared', '?')} identical"
            + (f" ({identity['error']})" if "error" in identity else "")
            + ".",
        ]
    if decode is not None:
        md += ["", "## Decode latency, in place KV cache, ORT CPU 2 threads, context 256", ""]
        md += decode
    md += [
        "",
        "The machine is shared (2 cores, other sessions' jobs running: see the load in the "
        "JSON); CPU time is the part that does not depend on the neighbours. The 49 kept "
        "weights are the attention MatMuls of two activations (48) and the embedding table.",
        "",
        "Command: `python bench/quant/bench_quantize.py --model "
        + args.model
        + (" --decode" if args.decode else "")
        + "`",
        "",
    ]
    bl.write_results("\n".join(md), {"env": env, "rows": rows, "identity": identity}, args.out)


if __name__ == "__main__":
    main()
