#!/usr/bin/env python3
"""I/O scale benchmark: fastopt.load / load+save vs onnx.load+save vs cp on a multi-GB model.

Generates (once, cached in --workdir) an LLM-shaped model with external data, warms the page
cache, then runs every measurement in a fresh subprocess, --repeat times, interleaved:

  fastopt_load       fastopt.load(model)
  fastopt_load_save  fastopt.load(model) + Model.save(out, external_data=True)
  onnx_load          onnx.load(model)                    (loads the external data)
  onnx_load_save     onnx.load + onnx.save(save_as_external_data=True, all_tensors_to_one_file)
  cp                 cp model.onnx model.onnx.data OUTDIR/

Time is measured inside the child around the operation (interpreter start and imports are
excluded; cp is timed as a whole process). Peak RSS is the child's ru_maxrss from wait4().
fastopt's output is then checked against the input: graph structure via protos loaded without
external data, weights byte-compared through numpy memmaps.

This parent process deliberately imports only the standard library: on Linux a child's
ru_maxrss starts at the parent's peak RSS (exec keeps the old mm's high-water mark), so a fat
parent would inflate every measured RSS. Generation and verification run in subprocesses too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from _benchlib import (
    MB,  # shared with the other benchmarks
    spawn,
)
from _benchlib import cpu_model as _cpu_model
from _benchlib import fmt_mb as _fmt_mb
from _benchlib import fmt_s as _fmt_s
from _benchlib import mem_total as _mem_total

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"

MODES: dict[str, str] = {
    "fastopt_load": "fastopt.load",
    "fastopt_load_save": "fastopt.load + Model.save(external_data=True)",
    "onnx_load": "onnx.load (with external data)",
    "onnx_load_save": "onnx.load + onnx.save(external data, one file)",
    "cp": "cp model.onnx model.onnx.data",
}
LOAD_TARGET_S = 1.0
RSS_TARGET_BYTES = 300 * 1024 * 1024
SAVE_VS_CP_TARGET = 1.5


# ---------------------------------------------------------------------------------------------
# child side: one measured operation per process


def _proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile / RssShmem of this process, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def run_child(mode: str, src: str, dst: str) -> dict[str, Any]:
    res: dict[str, Any] = {"mode": mode}
    if mode.startswith("fastopt"):
        import fastopt

        res["status_after_import"] = _proc_status()
        t0 = time.perf_counter()
        m = fastopt.load(src)
        t1 = time.perf_counter()
        res["load_s"] = t1 - t0
        if mode == "fastopt_load_save":
            m.save(dst, external_data=True)
            res["save_s"] = time.perf_counter() - t1
        res["time_s"] = time.perf_counter() - t0
        res["status_after_load" if mode == "fastopt_load" else "status_end"] = _proc_status()
        # sanity, outside the timing: the model really is there
        res["nodes"] = len(m.graph.nodes)
        res["initializers"] = len(m.graph.initializers)
    elif mode.startswith("onnx"):
        import onnx

        res["status_after_import"] = _proc_status()
        t0 = time.perf_counter()
        model = onnx.load(src)
        t1 = time.perf_counter()
        res["load_s"] = t1 - t0
        if mode == "onnx_load_save":
            onnx.save(
                model,
                dst,
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=os.path.basename(dst) + ".data",
            )
            res["save_s"] = time.perf_counter() - t1
        res["time_s"] = time.perf_counter() - t0
        res["status_end"] = _proc_status()
        res["nodes"] = len(model.graph.node)
        res["initializers"] = len(model.graph.initializer)
    else:
        raise SystemExit(f"unknown child mode {mode!r}")
    return res


# ---------------------------------------------------------------------------------------------
# verification (runs in a subprocess: it maps GBs of data)


def _tensor_bytes(tensor: Any, base_dir: str, maps: dict[str, Any]) -> Any:
    """The tensor's payload as a flat uint8 array; external data through a shared memmap."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    if tensor.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in tensor.external_data}
        path = os.path.join(base_dir, info["location"])
        if path not in maps:
            size = os.path.getsize(path)
            maps[path] = np.memmap(path, np.uint8, "r") if size else np.zeros(0, np.uint8)
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else maps[path].size - offset
        if offset + length > maps[path].size:
            raise ValueError(f"{tensor.name}: external data past end of {path}")
        return maps[path][offset : offset + length]
    if tensor.HasField("raw_data"):
        return np.frombuffer(tensor.raw_data, np.uint8)
    # typed fields (float_data, ...): compare the canonical little-endian bytes
    return np.frombuffer(numpy_helper.to_array(tensor).tobytes(), np.uint8)


def _value_info_key(vi: Any) -> tuple[Any, ...]:
    tt = vi.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim)
    return (vi.name, tt.elem_type, dims if tt.HasField("shape") else None)


def _node_key(node: Any) -> tuple[Any, ...]:
    from onnx import helper

    attrs = sorted((a.name, repr(helper.get_attribute_value(a))) for a in node.attribute)
    return (node.op_type, node.domain, tuple(node.input), tuple(node.output), tuple(attrs))


def compare_models(src: str, dst: str, chunk: int = 64 * MB) -> dict[str, Any]:
    """Structural + byte-level comparison of two ONNX models; weights never go through protobuf.

    Node names are compared separately (reported, but a rename is not a failure).
    """
    import numpy as np
    import onnx

    a = onnx.load(src, load_external_data=False)
    b = onnx.load(dst, load_external_data=False)
    diffs: list[str] = []

    def check(what: str, x: object, y: object) -> None:
        if x != y:
            diffs.append(f"{what}: {str(x)[:200]} != {str(y)[:200]}")

    check("ir_version", a.ir_version, b.ir_version)
    check(
        "opset_import",
        sorted((o.domain, o.version) for o in a.opset_import),
        sorted((o.domain, o.version) for o in b.opset_import),
    )
    ga, gb = a.graph, b.graph
    check("inputs", [_value_info_key(v) for v in ga.input], [_value_info_key(v) for v in gb.input])
    check(
        "outputs", [_value_info_key(v) for v in ga.output], [_value_info_key(v) for v in gb.output]
    )
    check("node count", len(ga.node), len(gb.node))
    for i, (na, nb) in enumerate(zip(ga.node, gb.node)):
        if _node_key(na) != _node_key(nb):
            diffs.append(f"node {i} ({na.name}): {_node_key(na)} != {_node_key(nb)}")
            if len(diffs) > 20:
                break
    renamed = sum(na.name != nb.name for na, nb in zip(ga.node, gb.node))

    ta = {t.name: t for t in ga.initializer}
    tb = {t.name: t for t in gb.initializer}
    check("initializer names", sorted(ta), sorted(tb))
    dir_a, dir_b = os.path.dirname(os.path.abspath(src)), os.path.dirname(os.path.abspath(dst))
    maps_a: dict[str, Any] = {}
    maps_b: dict[str, Any] = {}
    compared = 0
    external_b = 0
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        check(f"{name} dtype", x.data_type, y.data_type)
        check(f"{name} dims", list(x.dims), list(y.dims))
        bx, by = _tensor_bytes(x, dir_a, maps_a), _tensor_bytes(y, dir_b, maps_b)
        external_b += y.data_location == onnx.TensorProto.EXTERNAL
        if bx.size != by.size:
            diffs.append(f"{name}: {bx.size} bytes != {by.size} bytes")
            continue
        for off in range(0, bx.size, chunk):
            if not np.array_equal(bx[off : off + chunk], by[off : off + chunk]):
                diffs.append(f"{name}: bytes differ in [{off}, {off + chunk})")
                break
        compared += bx.size
    data_files = sorted(os.path.relpath(p, dir_b) for p in maps_b)
    return {
        "equal": not diffs,
        "diffs": diffs[:50],
        "nodes": len(ga.node),
        "renamed_nodes": renamed,
        "initializers": len(ta),
        "external_initializers_in_output": external_b,
        "output_data_files": data_files,
        "bytes_compared": compared,
    }


def run_verify(src: str, dst: str) -> dict[str, Any]:
    import onnx

    t0 = time.perf_counter()
    res = compare_models(src, dst)
    try:
        onnx.checker.check_model(dst)  # by path: validates the external-data references too
        res["check_model"] = "ok"
    except Exception as e:  # report, don't crash the benchmark
        res["check_model"] = f"{type(e).__name__}: {e}"[:500]
    res["verify_s"] = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------------------------
# parent side


def _self_cmd(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def warm_cache(paths: list[str], bufsize: int = 4 * MB) -> float:
    """Read the files once so every measurement sees a warm page cache (small buffer: lean RSS)."""
    t0 = time.perf_counter()
    buf = bytearray(bufsize)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def measure(mode: str, model_dir: str, out_dir: str) -> dict[str, Any]:
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    os.sync()  # start without dirty pages from the previous run
    src = os.path.join(model_dir, MODEL_FILE)
    warm_cache([src, os.path.join(model_dir, DATA_FILE)])
    if mode == "cp":
        cmd = ["cp", src, os.path.join(model_dir, DATA_FILE), out_dir + os.sep]
    else:
        cmd = _self_cmd("--child", mode, src, os.path.join(out_dir, MODEL_FILE))
    rc, wall, peak, out, err = spawn(cmd, timeout=float("inf"))
    res: dict[str, Any] = {"mode": mode, "rc": rc, "process_wall_s": wall, "peak_rss": peak}
    if rc != 0:
        res["error"] = (err.strip().splitlines() or [f"exit code {rc}"])[-1][:300]
        res["stderr_tail"] = err[-3000:]
        return res
    if mode == "cp":
        res["time_s"] = wall
    else:
        res.update(json.loads(out.strip().splitlines()[-1]))
    res["out_bytes"] = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    return res


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    # importable without dist metadata (e.g. PYTHONPATH): ask it, in a child to stay lean
    code = f"import {dist}; print(getattr({dist}, '__version__', 'unknown version'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else "not installed"


def _git_commit() -> str:
    res = subprocess.run(
        ["git", "-C", HERE, "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return res.stdout.strip() if res.returncode == 0 else "unknown"


def environment() -> dict[str, Any]:
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": _mem_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "onnx": _version("onnx"),
        "onnxruntime": _version("onnxruntime"),
        "numpy": _version("numpy"),
        "fastopt": _version("fastopt"),
        "fastopt_commit": _git_commit(),
    }


@contextlib.contextmanager
def _cleanup(path: str) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


def ensure_model(workdir: str, sizes: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Generate the model into workdir/model-<config>/ unless an identical one is cached there."""
    tag = "-".join(f"{k[0]}{v}" for k, v in sizes.items())
    model_dir = os.path.join(workdir, f"model-{tag}")
    marker = os.path.join(model_dir, "config.json")
    with contextlib.suppress(OSError, ValueError), open(marker) as f:
        info = json.load(f)
        if info.get("sizes") == sizes and os.path.getsize(
            os.path.join(model_dir, DATA_FILE)
        ) == info.get("data_bytes"):
            print(f"reusing cached model in {model_dir}", flush=True)
            return model_dir, info
    shutil.rmtree(model_dir, ignore_errors=True)
    cmd = [sys.executable, os.path.join(BENCH, "models", "make_llm_model.py"), model_dir]
    for key, value in sizes.items():
        cmd += [f"--{key}", str(value)]
    print(f"generating model: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    info = {
        "sizes": sizes,
        "data_bytes": os.path.getsize(os.path.join(model_dir, DATA_FILE)),
        "model_bytes": os.path.getsize(os.path.join(model_dir, MODEL_FILE)),
        "generate_s": time.perf_counter() - t0,
    }
    with open(marker, "w") as f:  # written last: marks a complete model
        json.dump(info, f)
    return model_dir, info


def _fmt_ratio(x: float) -> str:
    return f"{x:.2g}x" if x < 0.1 else f"{x:.2f}x"


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    runs = [r for r in runs if r.get("repeat", 0) >= 0]  # drop warm-up rounds
    for mode in modes:
        ok = [r for r in runs if r["mode"] == mode and r["rc"] == 0]
        failed = [r for r in runs if r["mode"] == mode and r["rc"] != 0]
        s: dict[str, Any] = {"runs": len(ok), "failed": len(failed)}
        if failed:
            s["error"] = failed[0].get("error")
        if ok:
            times = [r["time_s"] for r in ok]
            s.update(
                time_s=statistics.median(times),
                min_s=min(times),
                max_s=max(times),
                process_wall_s=statistics.median(r["process_wall_s"] for r in ok),
                peak_rss=max(r["peak_rss"] for r in ok),
            )
            after_import = [
                r["status_after_import"]["VmRSS"] for r in ok if "status_after_import" in r
            ]
            if after_import:
                s["rss_after_import"] = max(after_import)
            # anon vs file-backed split at the end of the op: tells copies from touched mmaps
            ends = [r.get("status_end") or r.get("status_after_load") for r in ok]
            if all(ends):
                s["rss_end"] = {k: max(e[k] for e in ends) for k in ("VmHWM", "RssAnon", "RssFile")}
            for part in ("load_s", "save_s"):
                if all(part in r for r in ok):
                    s[part] = statistics.median(r[part] for r in ok)
        summary[mode] = s
    cp = summary.get("cp", {}).get("time_s")
    for s in summary.values():
        if cp and "time_s" in s:
            s["vs_cp"] = s["time_s"] / cp
    return summary


def targets(summary: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """mode -> (target text, PASS/FAIL/n.a. with the reason)."""
    out: dict[str, tuple[str, str]] = {}

    def verdict(checks: list[tuple[bool, str]]) -> str:
        failed = [why for ok, why in checks if not ok]
        return "PASS" if not failed else "FAIL (" + "; ".join(failed) + ")"

    load = summary.get("fastopt_load", {})
    text = f"< {LOAD_TARGET_S:g} s, peak RSS < {_fmt_mb(RSS_TARGET_BYTES)}"
    if "time_s" in load:
        out["fastopt_load"] = (
            text,
            verdict(
                [
                    (load["time_s"] < LOAD_TARGET_S, "time"),
                    (load["peak_rss"] < RSS_TARGET_BYTES, "RSS"),
                ]
            ),
        )
    else:
        out["fastopt_load"] = (text, "n.a. (did not run)")
    ls = summary.get("fastopt_load_save", {})
    text = f"<= {SAVE_VS_CP_TARGET:g}x cp, peak RSS < {_fmt_mb(RSS_TARGET_BYTES)}"
    if "time_s" in ls and "vs_cp" in ls:
        out["fastopt_load_save"] = (
            text,
            verdict(
                [
                    (ls["vs_cp"] <= SAVE_VS_CP_TARGET, "time"),
                    (ls["peak_rss"] < RSS_TARGET_BYTES, "RSS"),
                ]
            ),
        )
    else:
        out["fastopt_load_save"] = (text, "n.a. (did not run)")
    return out


def render_markdown(report: dict[str, Any]) -> str:
    env, model, summary = report["environment"], report["model"], report["summary"]
    tgt = report["targets"]
    sizes = model["sizes"]
    lines = [
        "# fastopt I/O benchmark",
        "",
        f"- date: {env['date']}",
        f"- machine: {env['cpu']}, {env['cores']} cores, {_fmt_mb(env['ram_bytes'])} RAM, "
        f"{env['os']}",
        f"- versions: python {env['python']}, onnx {env['onnx']}, onnxruntime "
        f"{env['onnxruntime']}, numpy {env['numpy']}, fastopt {env['fastopt']} "
        f"(repo {env['fastopt_commit']})",
        f"- model: generated llama-like decoder ({', '.join(f'{k}={v}' for k, v in sizes.items())})"
        f"; model.onnx {model['model_bytes']:,} B + model.onnx.data {model['data_bytes']:,} B "
        f"({model['data_bytes'] / 1e9:.2f} GB)",
        f"- method: warm page cache; each run in a fresh process; {report['warmup']} untimed "
        f"warm-up round(s) of every mode, then median of {report['repeat']} "
        "runs (min/max shown); time excludes interpreter start and imports (cp: whole process); "
        "peak RSS = child ru_maxrss (max over runs; includes the benchmark parent's "
        f"{_fmt_mb(report['parent_peak_rss'])} high-water mark, which exec inherits); "
        "`sync` before each run, no fsync inside",
        "",
        "| Measurement | Median time | Min / max | vs cp | Peak RSS | RSS after imports "
        "| Target | Result |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for mode, label in MODES.items():
        if mode not in summary:
            continue
        s = summary[mode]
        target, result = tgt.get(mode, ("", ""))
        if "time_s" not in s:
            lines.append(f"| {label} | error | | | | | {target} | {s.get('error', 'failed')} |")
            continue
        timing = _fmt_s(s["time_s"])
        if "save_s" in s:
            timing += f" (load {_fmt_s(s['load_s'])} + save {_fmt_s(s['save_s'])})"
        lines.append(
            f"| {label} | {timing} | {_fmt_s(s['min_s'])} / {_fmt_s(s['max_s'])} "
            f"| {_fmt_ratio(s.get('vs_cp', 0))} | {_fmt_mb(s['peak_rss'])} "
            f"| {_fmt_mb(s['rss_after_import']) if 'rss_after_import' in s else '-'} "
            f"| {target} | {result} |"
        )
    ends = [(MODES[m], s["rss_end"]) for m, s in summary.items() if "rss_end" in s]
    if ends:
        lines += ["", "RSS of the Python children at the end of the operation (max over runs):", ""]
        lines += [
            f"- {label}: VmHWM {_fmt_mb(e['VmHWM'])}, anonymous {_fmt_mb(e['RssAnon'])}, "
            f"file-backed {_fmt_mb(e['RssFile'])}"
            for label, e in ends
        ]
    v = report.get("verify")
    lines.append("")
    if v is None:
        lines.append("Output check: not run.")
    elif "error" in v:
        lines.append(f"Output check: could not run ({v['error']}).")
    else:
        state = "EQUAL" if v["equal"] else "DIFFERENT"
        lines.append(
            f"Output check (fastopt save vs original): **{state}** - {v['nodes']} nodes "
            f"({v['renamed_nodes']} renamed), {v['initializers']} initializers "
            f"({v['external_initializers_in_output']} external in output, files "
            f"{', '.join(v['output_data_files']) or '-'}), {v['bytes_compared']:,} bytes "
            f"byte-compared; onnx.checker on output: {v['check_model']}."
        )
        lines += [f"- {d}" for d in v["diffs"][:10]]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        print(json.dumps(run_child(*argv[1:4])))
        return 0
    if argv[:1] == ["--verify"]:
        print(json.dumps(run_verify(*argv[1:3])))
        return 0

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/fastopt-bench", help="model cache + scratch dir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds of every mode first")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of modes")
    ap.add_argument("--results-dir", default=os.path.join(BENCH, "results"))
    ap.add_argument("--no-results", action="store_true", help="print only, write no files")
    ap.add_argument("--no-verify", action="store_true", help="skip the output comparison")
    ap.add_argument("--clean", action="store_true", help="also delete the cached model at the end")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes: {sorted(unknown)}")

    sizes = {
        "hidden": args.hidden,
        "layers": args.layers,
        "vocab": args.vocab,
        "intermediate": args.intermediate,
        "dtype": args.dtype,
    }
    os.makedirs(args.workdir, exist_ok=True)
    model_dir, model_info = ensure_model(args.workdir, sizes)
    src = os.path.join(model_dir, MODEL_FILE)
    need = 1.2 * model_info["data_bytes"]
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        print(f"not enough disk: {free / 1e9:.1f} GB free, need ~{need / 1e9:.1f} GB", flush=True)
        return 1

    out_dir = os.path.join(args.workdir, "out")
    runs: list[dict[str, Any]] = []
    verify: dict[str, Any] | None = None
    with _cleanup(out_dir):
        print(f"warming page cache ({model_info['data_bytes'] / 1e9:.2f} GB)...", flush=True)
        warm_cache([src, os.path.join(model_dir, DATA_FILE)])
        # warm-up rounds (rep < 0) are recorded but not summarised: the first writes of GBs
        # into fresh page-cache memory can be several times slower on VMs (host faults)
        for rep in range(-args.warmup, args.repeat):
            for mode in modes:  # interleaved, so drift hits every mode alike
                r = measure(mode, model_dir, out_dir)
                r["repeat"] = rep
                runs.append(r)
                shown = _fmt_s(r["time_s"]) if "time_s" in r else f"FAILED: {r.get('error')}"
                tag = "warm-up" if rep < 0 else f"{rep + 1}/{args.repeat}"
                print(
                    f"[{tag}] {mode:18s} {shown:>10s}  peak RSS {_fmt_mb(r['peak_rss'])}",
                    flush=True,
                )
                if (
                    mode == "fastopt_load_save"
                    and verify is None
                    and not args.no_verify
                    and r["rc"] == 0
                ):
                    print("verifying fastopt output against the original...", flush=True)
                    out_model = os.path.join(out_dir, MODEL_FILE)
                    rc, _, _, out, err = spawn(
                        _self_cmd("--verify", src, out_model), timeout=float("inf")
                    )
                    verify = (
                        json.loads(out.strip().splitlines()[-1])
                        if rc == 0
                        else {"error": (err.strip().splitlines() or ["?"])[-1][:300]}
                    )
                    print(f"  -> {verify.get('equal', verify.get('error'))}", flush=True)
                shutil.rmtree(out_dir, ignore_errors=True)  # outputs are GBs: drop right away

    summary = summarize(runs, modes)
    report: dict[str, Any] = {
        "environment": environment(),
        "model": {**model_info, "path": src},
        "repeat": args.repeat,
        "warmup": args.warmup,
        "summary": summary,
        "targets": targets(summary),
        "verify": verify,
        "runs": runs,
        "parent_peak_rss": _proc_status().get("VmHWM", 0),
    }
    md = render_markdown(report)
    print()
    print(md)
    if not args.no_results:
        os.makedirs(args.results_dir, exist_ok=True)
        with open(os.path.join(args.results_dir, "io.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.results_dir, "io.json"), "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.results_dir}/io.md and io.json")
    if args.clean:
        shutil.rmtree(model_dir, ignore_errors=True)
    else:
        print(f"cached model kept in {model_dir} (--clean to remove)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
