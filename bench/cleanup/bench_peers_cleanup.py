#!/usr/bin/env python3
"""fastopt's `classic` preset (cleanup, no fusions) vs peer ONNX optimizers, in one run.

For every model matched by --models (default: ../shared/corpus/*/model.onnx beside the repo;
the benchmark skips cleanly when there is none), each tool runs in a fresh subprocess,
--repeat times, interleaved:

  fastopt         fastopt.optimize(path, preset="classic", output=out)   (loads + saves itself)
  fastopt_load    fastopt.load(path) alone, so load can be told apart from the passes
  onnxscript      onnx.load + onnxscript.optimizer.optimize(proto) + onnx.save
  onnxslim        onnx.load + onnxslim.slim(proto) + onnx.save
  onnxoptimizer   onnx.load + onnxoptimizer.optimize(proto) (default passes) + onnx.save
  ort_basic       onnxruntime.InferenceSession(path) with ORT_ENABLE_BASIC and
                  optimized_model_filepath=out (CPU provider)
  ort_extended    the same with ORT_ENABLE_EXTENDED

Times are measured inside the child around the calls (interpreter start and imports excluded):
"optimize call" is the tool's own call (for fastopt and ORT that includes load and save, since
their APIs take a path), "file to file" is load + optimize + save. Medians over --repeat runs.
Peak RSS is the child's ru_maxrss from wait4() (imports included).

Each tool's output is then checked once, in another subprocess: node count and op histogram
(subgraphs included), onnx.checker.check_model(path, full_check=True), and an ONNX Runtime run
(its own optimizations off) compared with the original's outputs: pass when every output has
the same name, dtype and shape and max |optimized - original| <= 1e-4 (integers exactly).
Inputs come from fastopt.make_inputs(path, dims={"batch_size": 1, "sequence_length": 16}).

The parent imports only the standard library: Linux carries the parent's RSS high-water mark
into an exec'd child's ru_maxrss, so a fat parent would inflate every measurement.

    python bench/cleanup/bench_peers_cleanup.py                      # all corpus models, 3 repeats
    python bench/cleanup/bench_peers_cleanup.py --repeat 5 --models '/path/*/model.onnx'
    python bench/cleanup/bench_peers_cleanup.py --tools fastopt,onnxscript --out /tmp/peers.md
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
from _benchlib import (  # shared with the other benchmarks
    RESULT_TAG,
    op_histogram,
    snapshot_fastopt,
    write_results,
)
from _benchlib import environment as _environment
from _benchlib import error_text as _error_text
from _benchlib import fmt_mb as _fmt_mb
from _benchlib import fmt_s as _fmt_s
from _benchlib import peer_optimize as _peer_optimize
from _benchlib import proc_status as _proc_status
from _benchlib import result_line as _result_line
from _benchlib import spawn as _spawn

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
CORPUS_DIR = REPO.parent / "shared" / "corpus"
DEFAULT_OUT = BENCH / "results" / "cleanup_peers.md"
DIMS = {"batch_size": 1, "sequence_length": 16}
ATOL = 1e-4

# tool -> (label, module the tool needs)
TOOLS: dict[str, tuple[str, str]] = {
    "fastopt": ("fastopt (classic preset)", "fastopt"),
    "onnxscript": ("onnxscript.optimizer", "onnxscript"),
    "onnxslim": ("onnxslim", "onnxslim"),
    "onnxoptimizer": ("onnxoptimizer", "onnxoptimizer"),
    "ort_basic": ("ORT basic", "onnxruntime"),
    "ort_extended": ("ORT extended", "onnxruntime"),
}
# measured like a tool, reported in fastopt's row
EXTRA_MODES = {"fastopt_load": "fastopt"}
DISTS = ["fastopt", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "onnxslim", "onnxoptimizer"]


# ---------------------------------------------------------------------------------------------
# child side: one tool on one model per process


def _with_onnx(tool: str, src: str, dst: str) -> dict[str, float]:
    """onnx.load -> tool(proto) -> onnx.save, each step timed."""
    import onnx

    if tool == "onnxscript":
        import onnxscript.optimizer

        def fn(m: onnx.ModelProto) -> onnx.ModelProto:
            # documented default: ModelProto in, ModelProto out (converted to onnx_ir inside)
            return onnxscript.optimizer.optimize(m)

    elif tool in ("onnxslim", "onnxoptimizer"):
        importlib.import_module(tool)  # imports are not timed

        def fn(m: onnx.ModelProto) -> onnx.ModelProto:
            return _peer_optimize(tool, m)

    else:
        raise SystemExit(f"unknown tool {tool!r}")
    after_import = _proc_status()
    t0 = time.perf_counter()
    model = onnx.load(src)
    t1 = time.perf_counter()
    model = fn(model)
    t2 = time.perf_counter()
    onnx.save(model, dst)
    t3 = time.perf_counter()
    return {
        "load_s": t1 - t0,
        "optimize_s": t2 - t1,
        "save_s": t3 - t2,
        "total_s": t3 - t0,
        "rss_after_import": after_import["VmRSS"],
    }


def run_child(tool: str, src: str, dst: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if tool in ("fastopt", "fastopt_load"):
        import fastopt

        res["rss_after_import"] = _proc_status()["VmRSS"]
        t0 = time.perf_counter()
        if tool == "fastopt_load":
            model = fastopt.load(src)
            res["load_s"] = time.perf_counter() - t0
            res["nodes"] = len(model.graph.nodes)  # touch it: the load really happened
            return res
        report = fastopt.optimize(src, preset="classic", output=dst)
        res["optimize_s"] = res["total_s"] = time.perf_counter() - t0
        # the passes alone, without load, verify and save
        res["passes_s"] = sum(p.seconds for p in report.passes)
        res["passes"] = [
            {"name": p.name, "rewrites": p.rewrites, "seconds": p.seconds, "skipped": p.skipped}
            for p in report.passes
        ]
        res["preset"] = list(fastopt.PRESETS["classic"])
        res["fastopt_file"] = fastopt.__file__  # the run's snapshot, not the live install
    elif tool in ("ort_basic", "ort_extended"):
        import onnxruntime as ort

        res["rss_after_import"] = _proc_status()["VmRSS"]
        so = ort.SessionOptions()
        so.graph_optimization_level = (
            ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            if tool == "ort_basic"
            else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        )
        so.optimized_model_filepath = dst
        t0 = time.perf_counter()
        # session creation = load + optimize + save (+ kernel set-up, which cannot be split off)
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
        res["optimize_s"] = res["total_s"] = time.perf_counter() - t0
    else:
        res.update(_with_onnx(tool, src, dst))
    res["status_end"] = _proc_status()
    return res


# ---------------------------------------------------------------------------------------------
# verification child: every output of one model, checked against the original


def _histogram(model: Any) -> dict[str, int]:
    """op -> count over the main graph, subgraphs and local functions, most frequent first."""
    return dict(sorted(op_histogram(model).items(), key=lambda kv: (-kv[1], kv[0])))


def _identity_weight_nodes(model: Any) -> dict[str, int]:
    """Mul/Div by an all-ones weight and Add/Sub of an all-zeros weight (tensors of more than
    one element), by op. Randomly initialised exports have these (norm weights are ones, biases
    zeros); a tool that drops them gains nodes a trained model would keep."""
    import numpy as np
    from onnx import numpy_helper

    neutral = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}
    weights = {t.name: t for t in model.graph.initializer if np.prod(t.dims) > 1}
    # TorchScript exports reach shared weights through Identity nodes
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in weights:
            weights[node.output[0]] = weights[node.input[0]]
    out: dict[str, int] = {}
    for node in model.graph.node:
        value = neutral.get(node.op_type)
        if value is None or node.domain not in ("", "ai.onnx"):
            continue
        # Div and Sub are neutral only with the weight on the right
        slots = node.input[1:2] if node.op_type in ("Div", "Sub") else node.input[:2]
        for name in slots:
            if name in weights and np.all(numpy_helper.to_array(weights[name]) == value):
                out[node.op_type] = out.get(node.op_type, 0) + 1
                break
    return out


def _fallback_inputs(src: str, dims: dict[str, int]) -> dict[str, Any]:
    """Inputs for a corpus LLM when fastopt.make_inputs is unavailable: token ids < vocab from
    meta.json, masks of ones, position ids counting up, floats (past KV) standard normal."""
    import numpy as np
    import onnx

    meta_path = os.path.join(os.path.dirname(src), "meta.json")
    vocab = 1000
    with contextlib.suppress(OSError, ValueError, KeyError), open(meta_path) as f:
        vocab = int(json.load(f)["config"]["vocab_size"])
    seq = dims["sequence_length"]
    past = dims.get("past_sequence_length", 4)
    named = {**dims, "past_sequence_length": past, "total_sequence_length": past + seq}
    model = onnx.load(src, load_external_data=False)
    has_past = any(i.name.startswith("past") for i in model.graph.input)
    rng = np.random.default_rng(0)
    feeds: dict[str, Any] = {}
    for inp in model.graph.input:
        tt = inp.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else named.get(d.dim_param, 1)
            for d in tt.shape.dim
        ]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if inp.name == "attention_mask":
            shape[-1] = seq + (past if has_past else 0)
            feeds[inp.name] = np.ones(shape, dtype)
        elif inp.name == "position_ids":
            start = past if has_past else 0
            feeds[inp.name] = np.broadcast_to(np.arange(start, start + seq, dtype=dtype), shape)
        elif inp.name == "input_ids":
            feeds[inp.name] = rng.integers(0, vocab, shape).astype(dtype)
        elif np.issubdtype(dtype, np.integer):
            feeds[inp.name] = np.zeros(shape, dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _run_ort(path: str, feeds: dict[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    # ORT's own rewrites off: they would hide (or cause) differences between the graphs
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in wanted})))


def _compare(ref: dict[str, Any], got: dict[str, Any]) -> tuple[bool, float, str]:
    import numpy as np

    if set(ref) != set(got):
        return False, float("nan"), f"outputs {sorted(got)} != {sorted(ref)}"
    worst = 0.0
    for name, a in ref.items():
        b = got[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            return (
                False,
                float("nan"),
                f"{name}: {b.dtype}{list(b.shape)} != {a.dtype}{list(a.shape)}",
            )
        if a.size == 0:
            continue
        if not np.issubdtype(a.dtype, np.inexact):
            if not np.array_equal(a, b):
                return False, float("nan"), f"{name}: integer values differ"
            continue
        if not np.array_equal(np.isnan(a), np.isnan(b)):
            return False, float("nan"), f"{name}: NaNs in different places"
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        err = float(np.nanmax(diff)) if np.isfinite(diff).any() else 0.0
        worst = max(worst, err)
        if err > ATOL:
            return False, worst, f"{name}: max abs err {err:.3g} > {ATOL:g}"
    return True, worst, ""


def run_verify(src: str, outputs_json: str) -> dict[str, Any]:
    import onnx

    outputs: dict[str, str] = json.loads(outputs_json)
    try:
        import fastopt

        feeds = fastopt.make_inputs(src, dims=DIMS)
        input_source = "fastopt.make_inputs"
    except (ImportError, AttributeError):
        feeds = _fallback_inputs(src, DIMS)
        input_source = "fallback generator"
    original = onnx.load(src)
    res: dict[str, Any] = {
        "inputs": {k: f"{v.dtype}{list(v.shape)}" for k, v in feeds.items()},
        "input_source": input_source,
        "original": {
            "ops": _histogram(original),
            "identity_weight_nodes": _identity_weight_nodes(original),
        },
        "tools": {},
    }
    ref = _run_ort(src, feeds)
    for tool, path in outputs.items():
        r: dict[str, Any] = {}
        try:
            model = onnx.load(path)
            r["ops"] = _histogram(model)
            r["nodes"] = sum(r["ops"].values())
            r["bytes"] = os.path.getsize(path)
        except Exception as e:  # report, don't crash the benchmark
            r["load_error"] = f"{type(e).__name__}: {e}"[:400]
            res["tools"][tool] = r
            continue
        try:
            onnx.checker.check_model(path, full_check=True)
            r["checker"] = "ok"
        except Exception as e:
            r["checker"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        dropped = sorted(
            {i.name for i in original.graph.input} - {i.name for i in model.graph.input}
        )
        if dropped:  # a changed interface is worth knowing even when the outputs match
            r["inputs_dropped"] = dropped
        try:
            ok, err, why = _compare(ref, _run_ort(path, feeds))
            r.update(parity=ok, max_abs_err=err, parity_note=why)
        except Exception as e:
            r.update(parity=False, max_abs_err=float("nan"))
            r["parity_note"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        res["tools"][tool] = r
    return res


# ---------------------------------------------------------------------------------------------
# parent side


def _self_cmd(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def measure(
    tool: str, src: str, dst: str, timeout: float, env: dict[str, str] | None = None
) -> dict[str, Any]:
    with contextlib.suppress(FileNotFoundError):
        os.remove(dst)
    with open(src, "rb") as f:  # warm page cache: no run pays for the first read
        f.read()
    rc, wall, peak, out, err = _spawn(_self_cmd("--child", tool, src, dst), timeout, env)
    res: dict[str, Any] = {"tool": tool, "rc": rc, "process_wall_s": wall, "peak_rss": peak}
    if rc != 0:
        res["error"] = _error_text(rc, err)
        res["stderr_tail"] = err[-3000:]
        return res
    try:
        res.update(_result_line(out))
    except ValueError:
        res.update(rc=-1, error="child printed no result", stderr_tail=err[-3000:])
    return res


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r["rc"] == 0]
    s: dict[str, Any] = {"runs": len(ok), "failed": len(runs) - len(ok)}
    if len(ok) < len(runs):
        s["error"] = next(r["error"] for r in runs if r["rc"] != 0)
    if not ok:
        return s
    for key in ("load_s", "optimize_s", "save_s", "total_s", "passes_s"):
        if all(key in r for r in ok):
            s[key] = statistics.median(r[key] for r in ok)
            if key in ("optimize_s", "load_s"):
                s[key.replace("_s", "_min_s")] = min(r[key] for r in ok)
                s[key.replace("_s", "_max_s")] = max(r[key] for r in ok)
    s["peak_rss"] = max(r["peak_rss"] for r in ok)
    if all("rss_after_import" in r for r in ok):
        s["rss_after_import"] = max(r["rss_after_import"] for r in ok)
    for key in ("passes", "preset"):
        if key in ok[-1]:
            s[key] = ok[-1][key]
    return s


def _valid(v: dict[str, Any]) -> bool:
    return bool(v.get("parity")) and v.get("checker") == "ok"


def _cell_nodes(v: dict[str, Any] | None, best: int | None) -> str:
    """Node count, bold when fewest among valid outputs; marks: x checker fails, ! parity fails."""
    if not v or "nodes" not in v:
        return "error" if v else "-"
    text = f"**{v['nodes']}**" if v["nodes"] == best and _valid(v) else str(v["nodes"])
    if v.get("checker") != "ok":
        text += " x"
    if not v.get("parity"):
        text += " !"
    return text


def largest_gap(report: dict[str, Any]) -> dict[str, Any] | None:
    """The model where a peer with a valid output (parity ok) beats fastopt by most nodes."""
    best: dict[str, Any] | None = None
    for name, m in report["models"].items():
        tools = m["verify"].get("tools", {})
        fo = tools.get("fastopt", {}).get("nodes")
        if fo is None:
            continue
        for tool, v in tools.items():
            if tool == "fastopt" or "nodes" not in v or not v.get("parity"):
                continue
            gap = fo - v["nodes"]
            if gap > 0 and (best is None or gap > best["gap"]):
                best = {"model": name, "peer": tool, "gap": gap}
    return best


def render_markdown(report: dict[str, Any]) -> str:
    env, models, tools = report["environment"], report["models"], report["tools"]
    vers = env["versions"]
    preset = next(
        (
            m["timing"]["fastopt"].get("preset")
            for m in models.values()
            if m["timing"].get("fastopt", {}).get("preset") is not None
        ),
        None,
    )
    lines = [
        "# fastopt `classic` preset (cleanup, no fusions) vs peer ONNX optimizers",
        "",
        f"- date: {env['date']}",
        f"- machine: {env['cpu']}, {env['cores']} cores, {_fmt_mb(env['ram_bytes'])} RAM, "
        f"{env['os']}",
        f"- versions: python {env['python']}, "
        + ", ".join(f"{d} {vers[d]}" for d in DISTS)
        + f" (fastopt repo {env['fastopt_commit']})",
        f"- fastopt `classic` preset: {', '.join(preset) if preset else 'unknown'} (the "
        "installed build, copied aside at the start so that a reinstall cannot change it "
        "mid-run)",
        '- tools: fastopt `optimize(path, preset="classic", output=...)`; onnxscript '
        "`optimizer.optimize(ModelProto)` (defaults); onnxslim `slim(ModelProto)` (defaults); "
        "onnxoptimizer `optimize(ModelProto)` (default fuse-and-eliminate passes); ONNX Runtime "
        "CPU `InferenceSession` with `optimized_model_filepath` at ORT_ENABLE_BASIC / "
        "ORT_ENABLE_EXTENDED",
        f"- method: each tool in a fresh process per run, tools interleaved, median of "
        f"{report['repeat']} runs; times exclude interpreter start and imports; peak RSS = child "
        f"ru_maxrss, max over runs, imports included (parent high-water mark "
        f"{_fmt_mb(report['parent_peak_rss'])} inherited); checks on one output per tool: "
        f"`onnx.checker.check_model(full_check=True)`, ONNX Runtime CPU (optimizations off) "
        f"vs the original, max abs err <= {ATOL:g}, inputs from {report.get('input_source', '?')}"
        f" with {json.dumps(DIMS)} (past length 4 for KV-cache models)",
        "",
        "## Nodes after optimization",
        "",
        "Fewest nodes among outputs that pass both checks in bold. `x`: fails "
        "`onnx.checker` (full check); `!`: fails the ONNX Runtime comparison.",
        "",
        "| model | original | " + " | ".join(TOOLS[t][0] for t in tools) + " |",
        "|---|---:|" + "---:|" * len(tools),
    ]
    for name, m in models.items():
        vt = m["verify"].get("tools", {})
        valid = [v["nodes"] for v in vt.values() if "nodes" in v and _valid(v)]
        best = min(valid) if valid else None
        orig = sum(m["verify"].get("original", {}).get("ops", {}).values()) or "?"
        cells = [_cell_nodes(vt.get(t) if t in vt else m["timing"].get(t), best) for t in tools]
        lines.append(f"| {name} | {orig} | " + " | ".join(cells) + " |")

    neutral = {
        name: sum(n.values())
        for name, m in models.items()
        if (n := m["verify"].get("original", {}).get("identity_weight_nodes"))
    }
    if neutral:
        lines.extend(
            [
                "",
                "Caveat: these exports have random weights with norm weights all ones and biases "
                "all zeros, so `Mul`/`Add` nodes by those weights are no-ops here (not in a "
                "trained model); a tool that drops them gets up to that many nodes for free: "
                + ", ".join(f"{k} {v}" for k, v in neutral.items())
                + ".",
            ]
        )

    # Lifting Constant nodes into initializers shrinks the count without changing any
    # computation, so the same counts without Constant nodes tell real removal apart.
    lines.extend(
        [
            "",
            "The same without `Constant` nodes (peers lift them into initializers, which changes "
            "the count but not the computation):",
            "",
            "| model | original | " + " | ".join(TOOLS[t][0] for t in tools) + " |",
            "|---|---:|" + "---:|" * len(tools),
        ]
    )
    for name, m in models.items():
        vt = m["verify"].get("tools", {})
        orig_ops = m["verify"].get("original", {}).get("ops", {})
        cells = []
        for t in tools:
            ops = vt.get(t, {}).get("ops")
            cells.append("-" if ops is None else str(sum(ops.values()) - ops.get("Constant", 0)))
        orig = sum(orig_ops.values()) - orig_ops.get("Constant", 0)
        lines.append(f"| {name} | {orig} | " + " | ".join(cells) + " |")

    def time_table(title: str, key: str, note: str, fastopt_parts: bool) -> None:
        lines.extend(["", f"## {title}", "", note, ""])
        head = ["model"]
        for t in tools:
            head.append(TOOLS[t][0])
            if t == "fastopt" and fastopt_parts:
                head += ["fastopt.load", "fastopt passes"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---|" + "---:|" * (len(head) - 1))
        for name, m in models.items():
            cells = [name]
            for t in tools:
                s = m["timing"].get(t, {})
                cells.append(_fmt_s(s.get(key)) if key in s else s.get("error", "-")[:60])
                if t == "fastopt" and fastopt_parts:
                    cells.append(_fmt_s(m["timing"].get("fastopt_load", {}).get("load_s")))
                    cells.append(_fmt_s(s.get("passes_s")))
            lines.append("| " + " | ".join(cells) + " |")

    time_table(
        "Time: the optimize call (median)",
        "optimize_s",
        "The tool's own call, imports excluded. fastopt's call and ORT's session creation take a "
        "path, so they include load and save; the others get an in-memory ModelProto. "
        "Beside fastopt: `fastopt.load` alone (its own process) and the preset's passes alone "
        "(sum of the report's per-pass times).",
        True,
    )
    time_table(
        "Time: file to file (median)",
        "total_s",
        "Load + optimize + save (`onnx.load` / `onnx.save` for the ModelProto tools).",
        False,
    )
    lines.extend(["", "## Peak RSS (imports included)", ""])
    lines.append("| model | " + " | ".join(TOOLS[t][0] for t in tools) + " |")
    lines.append("|---|" + "---:|" * len(tools))
    for name, m in models.items():
        cells = [_fmt_mb(m["timing"].get(t, {}).get("peak_rss")) for t in tools]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    problems = []
    for name, m in models.items():
        for t, v in m["verify"].get("tools", {}).items():
            if v.get("load_error"):
                problems.append(f"- {name} / {t}: output does not load: {v['load_error']}")
                continue
            if v.get("checker") != "ok":
                problems.append(f"- {name} / {t}: checker: {v.get('checker')}")
            if not v.get("parity"):
                problems.append(f"- {name} / {t}: ORT comparison: {v.get('parity_note')}")
        for t in tools:
            err = m["timing"].get(t, {}).get("error")
            if err:
                problems.append(f"- {name} / {t}: run failed: {err}")
        if m["verify"].get("error"):
            problems.append(f"- {name}: verification failed: {m['verify']['error']}")
    lines.extend(["", "## Check failures", ""])
    lines.extend(problems or ["None."])

    gap = report.get("largest_gap")
    lines.extend(["", "## Where peers remove more than fastopt", ""])
    if gap is None:
        lines.append(
            "No peer output that passes the ORT comparison has fewer nodes than fastopt's."
        )
    else:
        m = models[gap["model"]]
        vt = m["verify"]["tools"]
        orig_ops = m["verify"]["original"]["ops"]
        fo_ops = vt["fastopt"]["ops"]
        peers = [t for t in tools if t != "fastopt" and "ops" in vt.get(t, {})]
        peer_constants = vt[gap["peer"]]["ops"].get("Constant", 0)
        lines.append(
            f"Largest gap: **{gap['model']}**, {TOOLS[gap['peer']][0]} leaves {gap['gap']} nodes "
            f"fewer than fastopt ({gap['gap'] - fo_ops.get('Constant', 0) + peer_constants} "
            "without `Constant` nodes). Op counts that differ from fastopt's (peer minus fastopt "
            "in parentheses):"
        )
        lines.extend(
            [
                "",
                "| op | original | fastopt | " + " | ".join(TOOLS[t][0] for t in peers) + " |",
                "|---|---:|---:|" + "---:|" * len(peers),
            ]
        )
        ops = set(orig_ops) | set(fo_ops)
        for t in peers:
            ops |= set(vt[t]["ops"])
        rows = []
        for op in ops:
            f = fo_ops.get(op, 0)
            counts = [vt[t]["ops"].get(op, 0) for t in peers]
            if all(c == f for c in counts):
                continue
            cells = [f"{c} ({c - f:+d})" if c != f else str(c) for c in counts]
            key_peer = vt[gap["peer"]]["ops"].get(op, 0) - f
            rows.append(
                (
                    key_peer,
                    op,
                    f"| {op} | {orig_ops.get(op, 0)} | {f} | " + " | ".join(cells) + " |",
                )
            )
        lines.extend(r[2] for r in sorted(rows, key=lambda r: (r[0], r[1])))
    # Rewrites per pass and model: shows which of the preset's passes did the work.
    if preset:
        names = list(dict.fromkeys(preset))
        lines.extend(
            [
                "",
                "## fastopt rewrites per pass",
                "",
                "Rewrites / time of each pass (summed for a pass the preset lists twice), "
                "last run.",
                "",
                "| model | " + " | ".join(names) + " |",
                "|---|" + "---:|" * len(names),
            ]
        )
        for name, m in models.items():
            done: dict[str, int] = {}
            secs: dict[str, float] = {}
            skipped: dict[str, str] = {}
            for p in m["timing"].get("fastopt", {}).get("passes", []):
                done[p["name"]] = done.get(p["name"], 0) + p["rewrites"]
                secs[p["name"]] = secs.get(p["name"], 0.0) + p.get("seconds", 0.0)
                if p["skipped"]:
                    skipped[p["name"]] = p["skipped"]
            cells = [
                f"skipped ({skipped[n]})"
                if n in skipped
                else (f"{done[n]} / {_fmt_s(secs[n])}" if n in done else "-")
                for n in names
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        print(RESULT_TAG + json.dumps(run_child(*argv[1:4])), flush=True)
        return 0
    if argv[:1] == ["--verify"]:
        print(RESULT_TAG + json.dumps(run_verify(*argv[1:3])), flush=True)
        return 0

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool and model (median)")
    ap.add_argument("--models", default=str(CORPUS_DIR / "*" / "model.onnx"), help="glob")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown file; JSON goes beside it")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per child process")
    args = ap.parse_args(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        ap.error(f"unknown tools: {sorted(unknown)} (known: {', '.join(TOOLS)})")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")

    paths = sorted(glob.glob(args.models))
    if not paths:
        print(f"no models match {args.models}: nothing to benchmark (skipped)")
        return 0
    # find_spec does not import: the parent stays lean (see the module docstring)
    missing = [t for t in tools if importlib.util.find_spec(TOOLS[t][1]) is None]
    for t in missing:
        print(f"{t}: {TOOLS[t][1]} is not installed, skipped")
    tools = [t for t in tools if t not in missing]
    if "fastopt" not in tools:
        print("fastopt is not importable or not selected: nothing to compare against")
        return 1
    modes = [*tools, *(m for m, base in EXTRA_MODES.items() if base in tools)]

    report: dict[str, Any] = {
        "environment": _environment(DISTS),
        "repeat": args.repeat,
        "tools": tools,
        "missing_tools": missing,
        "models": {},
    }
    work = tempfile.mkdtemp(prefix="fastopt-peers-")
    try:
        site = snapshot_fastopt(os.path.join(work, "site"))
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (site, os.environ.get("PYTHONPATH", "")) if p
        )
        for src in paths:
            name = os.path.basename(os.path.dirname(src)) or src
            stem = os.path.splitext(os.path.basename(src))[0]
            if stem != "model":  # encoder.onnx / decoder.onnx of one seq2seq fixture
                name = f"{name}/{stem}"
            out_dir = os.path.join(work, name)
            os.makedirs(out_dir)
            dst = {t: os.path.join(out_dir, f"{t}.onnx") for t in modes}
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in modes}
            print(f"== {name}", flush=True)
            for rep in range(args.repeat):
                for t in modes:  # interleaved, so drift hits every tool alike
                    r = measure(t, src, dst[t], args.timeout, child_env)
                    r["repeat"] = rep
                    runs[t].append(r)
                    key = "load_s" if t == "fastopt_load" else "optimize_s"
                    shown = _fmt_s(r.get(key)) if r["rc"] == 0 else f"FAILED: {r['error']}"
                    print(
                        f"  [{rep + 1}/{args.repeat}] {t:14s} {shown:>10s}  "
                        f"peak RSS {_fmt_mb(r['peak_rss'])}",
                        flush=True,
                    )
            # the last run's outputs are the ones checked
            outputs = {
                t: dst[t] for t in tools if runs[t][-1]["rc"] == 0 and os.path.exists(dst[t])
            }
            rc, _, _, out, err = _spawn(
                _self_cmd("--verify", src, json.dumps(outputs)), args.timeout, child_env
            )
            verify: dict[str, Any]
            try:
                verify = _result_line(out) if rc == 0 else {"error": _error_text(rc, err)}
            except ValueError:
                verify = {"error": _error_text(rc, err)}
            report["input_source"] = verify.get("input_source", report.get("input_source"))
            verified: dict[str, dict[str, Any]] = verify.get("tools", {})
            for t, v in verified.items():
                print(
                    f"  {t:14s} nodes {v.get('nodes', '?')}, checker {v.get('checker')}, "
                    f"parity {v.get('parity')} ({v.get('max_abs_err', float('nan')):.2g})",
                    flush=True,
                )
            report["models"][name] = {
                "path": src,
                "bytes": os.path.getsize(src),
                "timing": {t: summarize(rs) for t, rs in runs.items()},
                "verify": verify,
                "runs": runs,
            }
            shutil.rmtree(out_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report["largest_gap"] = largest_gap(report)
    report["parent_peak_rss"] = _proc_status().get("VmHWM", 0)
    md = render_markdown(report)
    write_results(md, report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
