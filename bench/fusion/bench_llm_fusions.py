#!/usr/bin/env python3
"""LLM fusions: fastopt `--preset llm` against ONNX Runtime's transformers optimizer, onnxscript's
ORT fusions, onnxslim, onnxoptimizer and ORT's own offline optimization, in one run.

Models: the fixtures in tests/fixtures/models (2 layers, hidden 64) and a 0.5B-sized Qwen2
export (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864, vocab 151936, untied
lm_head: ~2.4 GB fp32, random weights) from both exporters, generated once into --models-dir
with tests/fixtures/make_fixtures.py's export() (skipped when present).

Tools (each in a fresh process; time = the whole optimize + save, imports excluded; peak RSS =
the child's ru_maxrss from wait4, imports included):

  fastopt           `fastopt optimize SRC -o DST --preset llm --target ort` (the CLI's main)
  fastopt_onnx      the same with --target onnx (standard ops only)
  ort_transformers  onnxruntime.transformers.optimizer.optimize_model(SRC, model_type=...,
                    num_heads, hidden_size, use_gpu=False, opt_level default) + save
  onnxscript        onnx_ir.load + onnxscript.optimizer.optimize +
                    onnxscript.rewriter.ort_fusions.optimize_for_ort + onnx_ir.save
  onnxslim          onnxslim.slim(SRC, DST) (its defaults; external data past 2 GB)
  onnxoptimizer     onnx.load + onnxoptimizer.optimize (default fuse-and-eliminate passes) +
                    onnx.save; past 2 GB optimize() fails (protobuf's EncodeError escapes its
                    temp-file fallback), so there its fallback's call, C.optimize_from_path
  ort_offline       InferenceSession(SRC, ORT_ENABLE_EXTENDED, optimized_model_filepath=DST)

Then, per model: fused-op counts of every output, onnx.checker (full check), whether ONNX Runtime
loads it, and its logits against the original's (ORT optimizations off, batch 1, 16 tokens);
and ORT CPU latency (optimizations ON, as users run it; intra_op threads 2) of the original and
every output: prefill, batch 1, 128 tokens, --runs timed runs after warm-up, the models
interleaved round by round so machine noise hits all alike; median.

A tool that crashes, times out, outgrows --max-rss-gb or writes an invalid model is recorded
as such; the benchmark goes on. The parent imports only the standard library (see
bench/_benchlib.py).

    nice -n 10 python bench/fusion/bench_llm_fusions.py                      # everything
    python bench/fusion/bench_llm_fusions.py --skip-large --runs 20          # fixtures only
    python bench/fusion/bench_llm_fusions.py --models qwen2_0.5b_ts,qwen2_0.5b_dynamo \\
        --tools fastopt,onnxscript --skip-latency --out /tmp/large.md
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
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
    op_histogram,
    ort_session,
    peer_optimize,
    proc_status,
    result_line,
    snapshot_fastopt,
    spawn,
    write_results,
)

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
FIXTURES = REPO / "tests" / "fixtures" / "models"
DEFAULT_OUT = BENCH / "results" / "llm_fusions.md"
DEFAULT_MODELS_DIR = "/tmp/fastopt-bench"
DISTS = [
    "fastopt",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "onnx-ir",
    "onnxslim",
    "onnxoptimizer",
    "torch",
    "transformers",
]
LARGE_BYTES = 2 * 1024**3 - 64 * MB  # past this, outputs need external data (protobuf limit)

TOOLS: dict[str, str] = {
    "fastopt": "fastopt llm (ort)",
    "fastopt_onnx": "fastopt llm (onnx)",
    "ort_transformers": "ORT transformers",
    "onnxscript": "onnxscript + ort_fusions",
    "onnxslim": "onnxslim",
    "onnxoptimizer": "onnxoptimizer",
    "ort_offline": "ORT offline (extended)",
}
PEERS = ["ort_transformers", "onnxscript", "onnxslim", "onnxoptimizer", "ort_offline"]

# The 0.5B-sized export: Qwen2-0.5B's shape with an untied lm_head (transformers config keys).
QWEN2_05B: dict[str, Any] = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,  # the fixtures' wider 0.1 would overflow through 24 layers
}
LARGE_EXPORTERS = ("ts", "dynamo")

# ORT transformers model_type per architecture, as a user would pick it. There is no llama
# type: for the llama-like decoders (and qwen2/mistral/phi3/gemma) "gpt2" fuses as much as any
# other type (qwen3, gpt_neox give the same fused ops on the fixtures, but default to
# opt_level 0, so fewer nodes folded; "phi" expects the dynamo exporter's function-based
# export of Phi-2 and crashes on these). modernbert and deberta_v2 have no type of their own:
# "bert", as a user would pick.
ORT_MODEL_TYPE = {
    "gpt_neox": "gpt_neox",
    "bert": "bert",
    "clip": "clip",
    "modernbert": "bert",
    "deberta_v2": "bert",
}
ORT_MODEL_TYPE_DEFAULT = "gpt2"

# Counted ops: (column, op_type, domain or None for any). ORT registers
# SimplifiedLayerNormalization in the ai.onnx domain, the Skip* and Gelu ops in com.microsoft.
FUSED: list[tuple[str, str, str | None]] = [
    ("SimplifiedLayerNormalization", "SimplifiedLayerNormalization", None),
    ("SkipSimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", None),
    ("LayerNormalization", "LayerNormalization", None),
    ("SkipLayerNormalization", "SkipLayerNormalization", None),
    ("RMSNormalization", "RMSNormalization", None),
    ("RotaryEmbedding", "RotaryEmbedding", "com.microsoft"),
    ("RotaryEmbedding (ai.onnx)", "RotaryEmbedding", ""),
    ("MultiHeadAttention", "MultiHeadAttention", None),
    ("GroupQueryAttention", "GroupQueryAttention", None),
    ("Attention (com.microsoft)", "Attention", "com.microsoft"),
    ("Attention (ai.onnx)", "Attention", ""),
    ("Gelu", "Gelu", None),
    ("FastGelu", "FastGelu", None),
    ("BiasGelu", "BiasGelu", None),
    ("QuickGelu", "QuickGelu", None),
]
SHORT = {
    "SimplifiedLayerNormalization": "SLN",
    "SkipSimplifiedLayerNormalization": "SkipSLN",
    "LayerNormalization": "LN",
    "SkipLayerNormalization": "SkipLN",
    "RMSNormalization": "RMSNorm",
    "RotaryEmbedding": "Rotary",
    "RotaryEmbedding (ai.onnx)": "Rotary/onnx",
    "MultiHeadAttention": "MHA",
    "GroupQueryAttention": "GQA",
    "Attention (com.microsoft)": "Attn/ms",
    "Attention (ai.onnx)": "Attn/onnx",
    "Gelu": "Gelu",
    "FastGelu": "FastGelu",
    "BiasGelu": "BiasGelu",
    "QuickGelu": "QuickGelu",
}
# Residue: the decomposed ops a fusion would have consumed (attention's Softmax, a norm's
# ReduceMean/Pow/Sqrt, an activation's Erf/Tanh/Sigmoid, rotary's Sin/Cos/Neg). Not all are
# defects (MoE routing has a Softmax, gemma2's final logit cap a Tanh): the table says what is
# left, the fused-op table what it became.
RESIDUE = ("Softmax", "ReduceMean", "Pow", "Sqrt", "Erf", "Tanh", "Sigmoid", "Sin", "Cos", "Neg")
CHECK_SEQ = 16
PARITY_TOL = {"float32": 1e-4, "float16": 2e-2}


# ---------------------------------------------------------------------------------------------
# model metadata (parent side: json only)


def _meta(src: str) -> dict[str, Any]:
    try:
        with open(os.path.join(os.path.dirname(src), "meta.json")) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


def _cfg(meta: dict[str, Any], *keys: str) -> int | None:
    cfg = meta.get("config", {})
    for k in keys:
        if isinstance(cfg.get(k), int):
            return int(cfg[k])
    return None


def _layers(meta: dict[str, Any]) -> int | None:
    return _cfg(meta, "num_hidden_layers", "n_layer", "num_layers")


def _model_bytes(src: str) -> int:
    folder = os.path.dirname(src)
    return os.path.getsize(src) + sum(
        os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".data")
    )


# ---------------------------------------------------------------------------------------------
# child: one tool on one model


def _run_tool(tool: str, src: str, dst: str, meta: dict[str, Any], large: bool) -> dict[str, Any]:
    res: dict[str, Any] = {}
    data_name = os.path.basename(dst) + ".data"
    if tool in ("fastopt", "fastopt_onnx"):
        import fastopt.cli.main

        res["rss_after_import"] = proc_status()["VmRSS"]
        report = dst + ".report.json"
        target = "onnx" if tool == "fastopt_onnx" else "ort"
        t0 = time.perf_counter()
        rc = fastopt.cli.main.main(
            ["optimize", src, "-o", dst, "--preset", "llm", "--target", target, "--report", report]
        )
        res["optimize_s"] = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"fastopt exited with {rc}")
        with open(report) as f:
            passes = json.load(f)["optimize"].get("passes", [])
        res["passes"] = [
            {k: p.get(k) for k in ("name", "rewrites", "seconds", "skipped")} for p in passes
        ]
        res["preset"] = list(fastopt.PRESETS["llm"])
    elif tool == "ort_transformers":
        import logging

        from onnxruntime.transformers.optimizer import optimize_model

        logging.disable(logging.WARNING)  # its fusion chatter
        res["rss_after_import"] = proc_status()["VmRSS"]
        arch = meta.get("arch", "")
        model_type = ORT_MODEL_TYPE.get(arch, ORT_MODEL_TYPE_DEFAULT)
        heads = _cfg(meta, "num_attention_heads", "n_head") or 0
        hidden = _cfg(meta, "hidden_size", "n_embd") or 0
        res["settings"] = f"model_type={model_type}, num_heads={heads}, hidden_size={hidden}"
        t0 = time.perf_counter()
        m = optimize_model(
            src, model_type=model_type, num_heads=heads, hidden_size=hidden, use_gpu=False
        )
        m.save_model_to_file(dst, use_external_data_format=large)
        res["optimize_s"] = time.perf_counter() - t0
    elif tool == "onnxscript":
        import onnx_ir as ir
        import onnxscript.optimizer
        from onnxscript.rewriter import ort_fusions

        res["rss_after_import"] = proc_status()["VmRSS"]
        t0 = time.perf_counter()
        model = ir.load(src)
        onnxscript.optimizer.optimize(model)
        model, counts = ort_fusions.optimize_for_ort(model)
        ir.save(model, dst, external_data=data_name if large else None)
        res["optimize_s"] = time.perf_counter() - t0
        res["fusions"] = {k: v for k, v in counts.items() if v}
    elif tool == "onnxslim":
        import onnxslim

        res["rss_after_import"] = proc_status()["VmRSS"]
        t0 = time.perf_counter()
        # the documented path-to-path call; it writes external data itself past 2 GB
        onnxslim.slim(src, dst)
        res["optimize_s"] = time.perf_counter() - t0
    elif tool == "onnxoptimizer":
        import onnx
        import onnxoptimizer

        res["rss_after_import"] = proc_status()["VmRSS"]
        t0 = time.perf_counter()
        if large:
            # Past 2 GB, optimize(ModelProto) fails: protobuf raises EncodeError serializing
            # the proto, and its temp-file fallback catches only ValueError. This is that
            # fallback's own file-to-file call, with the same default passes.
            passes = onnxoptimizer.get_fuse_and_elimination_passes()
            onnxoptimizer.C.optimize_from_path(src, dst, passes, data_name)
            res["route"] = "onnxoptimizer.C.optimize_from_path"
        else:
            onnx.save(peer_optimize(tool, onnx.load(src)), dst)
        res["optimize_s"] = time.perf_counter() - t0
    elif tool == "ort_offline":
        import onnxruntime as ort

        res["rss_after_import"] = proc_status()["VmRSS"]
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = dst
        if large:
            so.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", data_name
            )
            so.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
            )
        t0 = time.perf_counter()
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
        res["optimize_s"] = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown tool {tool!r}")
    res["status_end"] = proc_status()
    return res


# ---------------------------------------------------------------------------------------------
# child: counts and checks of every output of one model


def _feeds(meta: dict[str, Any], seq: int, seed: int) -> dict[str, Any]:
    import numpy as np

    vocab = _cfg(meta, "vocab_size") or 512
    rng = np.random.default_rng(seed)
    feeds = {
        "input_ids": rng.integers(0, vocab, (1, seq)).astype(np.int64),
        "attention_mask": np.ones((1, seq), np.int64),
        "position_ids": np.arange(seq, dtype=np.int64)[None, :],
    }
    return {k: v for k, v in feeds.items() if k in meta.get("inputs", list(feeds))}


def _session(path: str, optimize: bool, threads: int = 0) -> Any:
    # Several sessions share one process (interleaved rounds): quiet pools.
    return ort_session(path, optimize, threads, quiet_pool=True)


def _run(sess: Any, feeds: dict[str, Any]) -> Any:
    wanted = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in wanted})[0]


def _fused(hist: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for col, op, domain in FUSED:
        n = 0
        for key, count in hist.items():
            dom, _, name = key.rpartition("::")
            if name == op and (domain is None or dom == domain):
                n += count
        if n:
            out[col] = n
    return out


def run_check(src: str, outputs_json: str) -> dict[str, Any]:
    import numpy as np
    import onnx

    meta = _meta(src)
    outputs: dict[str, str] = json.loads(outputs_json)
    feeds = _feeds(meta, CHECK_SEQ, seed=1)
    original = onnx.load(src, load_external_data=False)
    hist = op_histogram(original)
    res: dict[str, Any] = {
        "original": {"nodes": sum(hist.values()), "fused": _fused(hist), "ops": hist},
        "tools": {},
    }
    ref = np.asarray(_run(_session(src, optimize=False), feeds), np.float64)
    for tool, path in outputs.items():
        r: dict[str, Any] = {}
        res["tools"][tool] = r
        try:
            model = onnx.load(path, load_external_data=False)
            hist = op_histogram(model)
            r.update(nodes=sum(hist.values()), fused=_fused(hist), ops=hist)
            r["opset"] = next(
                (o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None
            )
            del model
        except Exception as e:  # an unreadable output is a result, not a benchmark failure
            r["load_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            continue
        try:
            onnx.checker.check_model(path, full_check=True)
            r["checker"] = "ok"
        except Exception as e:
            r["checker"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        try:
            sess = _session(path, optimize=False)
        except Exception as e:
            r["ort"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            continue
        r["ort"] = "ok"
        try:
            got = np.asarray(_run(sess, feeds), np.float64)
            if got.shape != ref.shape:
                r["parity_note"] = f"logits shape {list(got.shape)} != {list(ref.shape)}"
            else:
                r["max_abs"] = float(np.max(np.abs(got - ref)))
        except Exception as e:  # loads but does not run: as unusable as not loading
            r["ort"] = f"run fails: {type(e).__name__}: {e}".splitlines()[0][:300]
        del sess
    return res


# ---------------------------------------------------------------------------------------------
# child: interleaved latency of several models


def run_latency(src: str, paths_json: str, runs: int, warmup: int, seq: int) -> dict[str, Any]:
    paths: dict[str, str] = json.loads(paths_json)
    feeds = _feeds(_meta(src), seq, seed=2)
    sessions: dict[str, Any] = {}
    res: dict[str, Any] = {"ms": {}, "errors": {}}
    for label, path in paths.items():
        try:
            sessions[label] = _session(path, optimize=True, threads=2)
            _run(sessions[label], feeds)
        except Exception as e:
            res["errors"][label] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            sessions.pop(label, None)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    labels = list(sessions)
    for rnd in range(warmup + runs):
        # rotate the order each round: no model always runs right after the same one
        for label in labels[rnd % len(labels) :] + labels[: rnd % len(labels)]:
            t0 = time.perf_counter()
            _run(sessions[label], feeds)
            if rnd >= warmup:
                times[label].append((time.perf_counter() - t0) * 1000)
    for label, ts in times.items():
        res["ms"][label] = {
            "median": statistics.median(ts),
            "p10": sorted(ts)[len(ts) // 10],
            "p90": sorted(ts)[(len(ts) * 9) // 10],
            "runs": len(ts),
        }
    return res


# ---------------------------------------------------------------------------------------------
# child: the 0.5B-sized export


def run_make_large(exporter: str, out_dir: str) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    import make_fixtures

    tmp = out_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    meta = make_fixtures.export(
        "qwen2",
        exporter,
        "float32",
        Path(tmp),
        config_overrides=QWEN2_05B,
        external_data=True,
        check=False,  # ORT vs torch would hold two more copies of the weights
    )
    os.replace(tmp, out_dir)  # only complete exports count as present
    return {"export_s": meta["export_s"], "bytes": meta["bytes"]}


# ---------------------------------------------------------------------------------------------
# parent


def _self_cmd(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def _child(
    args: list[str], timeout: float, env: dict[str, str], max_rss: int = 0
) -> dict[str, Any]:
    """One child; its result, or {"error": ...}; always wall time and peak RSS."""
    rc, wall, peak, out, err = spawn(_self_cmd(*args), timeout, env, max_rss)
    res: dict[str, Any] = {"rc": rc, "process_wall_s": wall, "peak_rss": peak}
    if rc != 0:
        if rc == -9 and wall >= timeout:
            res["error"] = f"timed out after {timeout:.0f} s"
        elif rc == -9 and max_rss and peak > max_rss:
            res["error"] = f"stopped: RSS over {fmt_mb(max_rss)} after {fmt_s(wall)}"
        else:
            res["error"] = error_text(rc, err)
        res["stderr_tail"] = err[-3000:]
        return res
    try:
        res.update(result_line(out))
    except ValueError:
        res.update(rc=-1, error="child printed no result", stderr_tail=err[-3000:])
    return res


def _mem_available() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * 1024**3


def ensure_large(models_dir: str, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for exporter in LARGE_EXPORTERS:
        out = os.path.join(models_dir, f"qwen2_0.5b_{exporter}")
        if os.path.exists(os.path.join(out, "model.onnx")):
            info[exporter] = {"cached": True, **_meta(os.path.join(out, "model.onnx"))}
            continue
        os.makedirs(models_dir, exist_ok=True)
        print(f"exporting qwen2_0.5b_{exporter} into {out} ...", flush=True)
        r = _child(["--make-large", exporter, out], timeout, env)
        info[exporter] = {"cached": False, **r}
        shown = r.get("error") or f"{r.get('export_s')} s export, {fmt_mb(r.get('bytes'))}"
        print(f"  {shown}; process {fmt_s(r['process_wall_s'])}, peak RSS {fmt_mb(r['peak_rss'])}")
    return info


def select_models(args: argparse.Namespace) -> dict[str, str]:
    # exports WITH a cache (*_cache) take other feeds: bench_cached_exports.py measures them
    found = {
        p.parent.name: str(p)
        for p in sorted(FIXTURES.glob("*/model.onnx"))
        if not p.parent.name.endswith("_cache")
    }
    if not args.skip_large:
        for exporter in LARGE_EXPORTERS:
            path = os.path.join(args.models_dir, f"qwen2_0.5b_{exporter}", "model.onnx")
            found[f"qwen2_0.5b_{exporter}"] = path
    if args.models:
        pats = [p.strip() for p in args.models.split(",") if p.strip()]
        found = {
            k: v for k, v in found.items() if any(fnmatch.fnmatch(k, p) or p == k for p in pats)
        }
    return found


def bench_model(
    name: str, src: str, tools: list[str], args: argparse.Namespace, env: dict[str, str], work: str
) -> dict[str, Any]:
    out_dir = os.path.join(work, name)
    os.makedirs(out_dir, exist_ok=True)
    meta = _meta(src)
    size = _model_bytes(src)
    large = size > LARGE_BYTES
    m: dict[str, Any] = {"path": src, "bytes": size, "layers": _layers(meta), "meta": meta}
    m["dtype"] = meta.get("dtype", "float32")
    with open(src, "rb") as f:  # warm the page cache: no tool pays for the first read
        while f.read(64 * MB):
            pass
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in tools}
    dst = {t: os.path.join(out_dir, t, "model.onnx") for t in tools}
    for rep in range(args.repeat):
        for t in tools:  # interleaved: drift hits every tool alike
            shutil.rmtree(os.path.dirname(dst[t]), ignore_errors=True)
            os.makedirs(os.path.dirname(dst[t]))
            r = _child(
                ["--tool", t, src, dst[t], "1" if large else "0"],
                args.timeout,
                env,
                int(args.max_rss_gb * 1024**3),
            )
            runs[t].append(r)
            shown = fmt_s(r.get("optimize_s")) if r["rc"] == 0 else f"FAILED: {r['error']}"
            rss = fmt_mb(r["peak_rss"])
            print(f"  [{rep + 1}/{args.repeat}] {t:17s} {shown:>10s}  peak RSS {rss}", flush=True)
    m["timing"] = {t: _summarize(rs) for t, rs in runs.items()}
    outputs = {t: dst[t] for t in tools if runs[t][-1]["rc"] == 0 and os.path.exists(dst[t])}
    m["check"] = _child(["--check", src, json.dumps(outputs)], args.timeout * 2, env)
    for t, v in m["check"].get("tools", {}).items():
        print(
            f"  {t:17s} {_fused_cell(v)}; checker {v.get('checker', '-')[:40]}, ORT "
            f"{v.get('ort', '-')[:40]}, max abs {v.get('max_abs', '-')}",
            flush=True,
        )
    if not args.skip_latency:
        loadable = {"original": src}
        loadable.update(
            {
                t: p
                for t, p in outputs.items()
                if m["check"].get("tools", {}).get(t, {}).get("ort") == "ok"
            }
        )
        m["latency"] = measure_latency(src, loadable, size, args, env)
    shutil.rmtree(out_dir, ignore_errors=True)
    return m


def measure_latency(
    src: str, paths: dict[str, str], size: int, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """All models in one process when they fit in memory; otherwise groups, each with the
    original, so that every ratio compares runs of the same process."""
    per_session = max(1, int(size * 1.3))  # seen: ~0.9x the model per session, + arena
    fit = max(2, int(_mem_available() * 0.7 // per_session))
    others = [k for k in paths if k != "original"]
    groups = [others[i : i + fit - 1] for i in range(0, len(others), fit - 1)] or [[]]
    res: dict[str, Any] = {"ms": {}, "errors": {}, "groups": len(groups), "ratio": {}}
    res["original_ms_per_group"] = []
    for group in groups:
        sel = {"original": src, **{k: paths[k] for k in group}}
        r = _child(
            ["--latency", src, json.dumps(sel), str(args.runs), str(args.warmup), str(args.seq)],
            args.timeout * 4,
            env,
        )
        if r["rc"] != 0:
            for k in sel:
                res["errors"].setdefault(k, r["error"])
            continue
        res["errors"].update(r.get("errors", {}))
        orig = r["ms"].get("original", {}).get("median")
        res["original_ms_per_group"].append(orig)
        for k, v in r["ms"].items():
            if k == "original" and "original" in res["ms"]:
                continue  # the first group's original is reported
            res["ms"][k] = v
            if orig and k != "original":
                res["ratio"][k] = v["median"] / orig
    shown = ", ".join(f"{k} {v['median']:.2f} ms" for k, v in res["ms"].items())
    print(f"  latency: {shown}", flush=True)
    for k, e in res["errors"].items():
        print(f"  latency {k}: {e}", flush=True)
    return res


def _summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r["rc"] == 0]
    s: dict[str, Any] = {"runs": len(ok), "failed": len(runs) - len(ok)}
    if len(ok) < len(runs):
        s["error"] = next(r["error"] for r in runs if r["rc"] != 0)
        s["peak_rss_failed"] = max(r["peak_rss"] for r in runs if r["rc"] != 0)
    if not ok:
        return s
    s["optimize_s"] = statistics.median(r["optimize_s"] for r in ok)
    s["process_wall_s"] = statistics.median(r["process_wall_s"] for r in ok)
    s["peak_rss"] = max(r["peak_rss"] for r in ok)
    for key in ("passes", "preset", "settings", "fusions", "route", "rss_after_import"):
        if key in ok[-1]:
            s[key] = ok[-1][key]
    return s


# ---------------------------------------------------------------------------------------------
# report


def _fused_cell(v: dict[str, Any] | None) -> str:
    if not v:
        return "-"
    if "load_error" in v:
        return "unreadable"
    fused = v.get("fused", {})
    text = ", ".join(f"{SHORT[c]} {fused[c]}" for c, _, _ in FUSED if c in fused) or "none"
    if v.get("checker", "ok") != "ok":
        text += " x"
    if v.get("ort", "ok") != "ok":
        text += " !"
    return text


def _residue_cell(v: dict[str, Any] | None) -> str:
    if not v or "ops" not in v:
        return "-"
    left: dict[str, int] = {}
    for key, count in v["ops"].items():
        dom, _, name = key.rpartition("::")
        if name in RESIDUE and dom in ("", "ai.onnx"):
            left[name] = left.get(name, 0) + count
    return ", ".join(f"{op} {left[op]}" for op in RESIDUE if op in left) or "none"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def render_markdown(report: dict[str, Any]) -> str:
    env, models, tools = report["environment"], report["models"], report["tools"]
    vers = env["versions"]
    preset = next(
        (
            m["timing"][t].get("preset")
            for m in models.values()
            for t in ("fastopt", "fastopt_onnx")
            if m.get("timing", {}).get(t, {}).get("preset")
        ),
        None,
    )
    lines = [
        "# LLM fusions: fastopt `--preset llm` vs peers",
        "",
        f"- date: {env['date']}",
        f"- machine: {env['cpu']}, {env['cores']} cores, {fmt_mb(env['ram_bytes'])} RAM, "
        f"{env['os']} (shared with other jobs; run at `nice -n 10`)",
        f"- versions: python {env['python']}, "
        + ", ".join(f"{d} {vers.get(d, '?')}" for d in DISTS)
        + f" (fastopt repo {env['fastopt_commit']})",
        (
            f"- commands (runs merged with --merge): {report['command']} (took "
            if report.get("merged")
            else f"- command: `{report['command']}` (took "
        )
        + f"{report['total_s'] / 60:.1f} min)",
        f"- fastopt `llm` preset at run time: {', '.join(preset) if preset else 'unknown'}",
        "- tools: "
        + "; ".join(f"`{t}` = {TOOLS[t]}" for t in tools)
        + ". ORT transformers: `optimize_model(path, model_type, num_heads, hidden_size, "
        "use_gpu=False)` with its default opt_level (1 for gpt2/bert, 0 for gpt_neox); model_type "
        f"{ORT_MODEL_TYPE_DEFAULT!r} for the llama-like decoders and gpt2, 'gpt_neox', 'bert' "
        "(no llama type exists; qwen3/gpt_neox fuse the same on llama-like fixtures but fold "
        "less, phi crashes). onnxscript: `optimizer.optimize` then "
        "`rewriter.ort_fusions.optimize_for_ort` on an `onnx_ir` model. onnxslim: "
        "`onnxslim.slim(src, dst)` (defaults; it writes external data past 2 GB). onnxoptimizer: "
        "`onnx.load`, `onnxoptimizer.optimize(model)` (default fuse-and-eliminate passes), "
        "`onnx.save`; past 2 GB `optimize()` fails (protobuf raises EncodeError serializing the "
        "proto, and its temp-file fallback catches only ValueError), so there the benchmark "
        "calls that fallback's file-to-file function, `onnxoptimizer.C.optimize_from_path(src, "
        "dst, default passes, data file)`. ORT offline: session at "
        "ORT_ENABLE_EXTENDED with `optimized_model_filepath`.",
        "",
        "## Fused ops",
        "",
        "Per output: "
        + ", ".join(f"{v} = {k}" for k, v in SHORT.items())
        + ". `x`: fails `onnx.checker.check_model(full_check=True)` (expected for "
        "SimplifiedLayerNormalization and other ORT contrib ops that ORT registers in the "
        "ai.onnx domain: the checker does not know them); `!`: ONNX Runtime does not load or "
        "run it; `failed`: the tool crashed or timed out (see Failures).",
        "",
        "| model | layers | original | " + " | ".join(TOOLS[t] for t in tools) + " |",
        "|---|---:|---|" + "---|" * len(tools),
    ]
    for name, m in models.items():
        chk = m.get("check", {})
        cells = []
        for t in tools:
            if m["timing"].get(t, {}).get("error") and not m["timing"][t].get("runs"):
                cells.append("failed")
            else:
                cells.append(_fused_cell(chk.get("tools", {}).get(t)))
        orig = _fused_cell(chk.get("original")) if "original" in chk else "-"
        lines.append(f"| {name} | {m.get('layers') or '?'} | {orig} | " + " | ".join(cells) + " |")

    lines.extend(
        [
            "",
            "## Residue",
            "",
            "Decomposed ops left per output (standard domain): "
            + ", ".join(RESIDUE)
            + ". Not every one is a missed fusion: MoE routing keeps a Softmax, gemma2's final "
            "logit soft-cap a Tanh, a rotary table computed from position ids its Sin/Cos.",
            "",
            "| model | original | " + " | ".join(TOOLS[t] for t in tools) + " |",
            "|---|---|" + "---|" * len(tools),
        ]
    )
    for name, m in models.items():
        chk = m.get("check", {})
        cells = [_residue_cell(chk.get("tools", {}).get(t)) for t in tools]
        orig = _residue_cell(chk.get("original"))
        lines.append(f"| {name} | {orig} | " + " | ".join(cells) + " |")

    lines.extend(
        [
            "",
            "## Checks",
            "",
            f"Nodes after / opset / logits max abs diff against the original ({CHECK_SEQ} tokens, "
            "ORT optimizations off on both; tolerance "
            + ", ".join(f"{k} {v:g}" for k, v in PARITY_TOL.items())
            + ", marked `(!)` above it).",
            "",
            "| model | original nodes | " + " | ".join(TOOLS[t] for t in tools) + " |",
            "|---|---:|" + "---|" * len(tools),
        ]
    )
    for name, m in models.items():
        chk = m.get("check", {})
        tol = PARITY_TOL.get(m.get("dtype", "float32"), 1e-4)
        cells = []
        for t in tools:
            v = chk.get("tools", {}).get(t)
            if not v or "nodes" not in v:
                cells.append("-")
                continue
            diff = v.get("max_abs")
            d = "-" if diff is None else f"{diff:.1e}" + (" (!)" if diff > tol else "")
            cells.append(f"{v['nodes']} / {v.get('opset')} / {d}")
        lines.append(
            f"| {name} | {chk.get('original', {}).get('nodes', '?')} | " + " | ".join(cells) + " |"
        )

    if any("latency" in m for m in models.values()):
        lines.extend(
            [
                "",
                "## ORT CPU latency (prefill)",
                "",
                f"Batch 1, {report['seq']} tokens, ORT_ENABLE_ALL, intra_op threads 2; median of "
                f"{report['runs']} runs after {report['warmup']} warm-up rounds, models "
                "interleaved round by round in one process (per group of models when they do "
                "not fit in memory together; the original is in every group, and the `original` "
                "column is the first group's). Each cell: ms (ratio to the original of the same "
                "group). Last columns: fastopt's ratio over the best peer's ratio.",
                "",
                "| model | original | "
                + " | ".join(TOOLS[t] for t in tools)
                + " | fastopt (ort) / best peer | fastopt (onnx) / best peer |",
                "|---|---:|" + "---:|" * (len(tools) + 2),
            ]
        )
        for name, m in models.items():
            lat = m.get("latency")
            if not lat:
                continue
            ms = lat["ms"]
            orig = ms.get("original", {}).get("median")
            cells = [f"{orig:.2f}" if orig else "-"]
            for t in tools:
                if t in ms:
                    cells.append(f"{ms[t]['median']:.2f} ({_ratio(lat['ratio'].get(t))})")
                else:
                    cells.append("error" if t in lat["errors"] else "-")
            # through the ratios to the original: with several groups, each tool's ms comes
            # from another process (another moment), its ratio from the same one
            rat = lat["ratio"]
            peers = [rat[p] for p in PEERS if p in rat]
            best = min(peers) if peers else None
            for t in ("fastopt", "fastopt_onnx"):
                cells.append(_ratio(rat[t] / best) if best and t in rat else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")

    lines.extend(
        [
            "",
            "## Optimization time and peak RSS",
            "",
            f"Each tool in a fresh process, median of {report['repeat']} run(s) (see the "
            "commands above for each model's); time = the "
            "whole optimize + save call (imports excluded), peak RSS = the child's ru_maxrss "
            "(imports included). Timeout "
            f"{report['timeout']:.0f} s per run"
            + (f", RSS limit {report['max_rss_gb']:g} GiB." if report.get("max_rss_gb") else "."),
            "",
            "| model | size | " + " | ".join(TOOLS[t] for t in tools) + " |",
            "|---|---:|" + "---:|" * len(tools),
        ]
    )
    for name, m in models.items():
        cells = []
        for t in tools:
            s = m["timing"].get(t, {})
            if s.get("optimize_s") is not None:
                cells.append(f"{fmt_s(s['optimize_s'])} / {fmt_mb(s['peak_rss'])}")
            elif s.get("error"):
                cells.append(f"failed ({s['error'][:40]}) / {fmt_mb(s.get('peak_rss_failed'))}")
            else:
                cells.append("-")
        lines.append(f"| {name} | {fmt_mb(m['bytes'])} | " + " | ".join(cells) + " |")

    large = {n: m for n, m in models.items() if n.startswith("qwen2_0.5b")}
    if large:
        lines.extend(
            ["", "Targets (issue) on the 0.5B export: fastopt <= 2.5 s, peak RSS < 150 MB."]
        )
        for name, m in large.items():
            s = m["timing"].get("fastopt", {})
            if s.get("optimize_s") is None:
                lines.append(f"- {name}: fastopt did not finish ({s.get('error', 'not run')})")
                continue
            ok_t = s["optimize_s"] <= 2.5
            ok_m = s["peak_rss"] < 150 * MB
            lines.append(
                f"- {name}: {fmt_s(s['optimize_s'])} ({'met' if ok_t else 'MISSED'}), "
                f"{fmt_mb(s['peak_rss'])} ({'met' if ok_m else 'MISSED'})"
            )
    gen = report.get("large_export")
    if gen:
        lines.extend(["", "The 0.5B export (make_fixtures.export, float32, external data):"])
        for exporter, g in gen.items():
            if g.get("cached"):
                lines.append(f"- {exporter}: cached ({g.get('export_s', '?')} s export when made)")
            else:
                done = g.get("error") or f"{g.get('export_s')} s export"
                wall, rss = fmt_s(g.get("process_wall_s")), fmt_mb(g.get("peak_rss"))
                lines.append(f"- {exporter}: {done}; process {wall}, peak RSS {rss}")

    problems = []
    for name, m in models.items():
        for t in tools:
            s = m["timing"].get(t, {})
            if s.get("error"):
                problems.append(f"- {name} / {t}: {s['failed']} run(s) failed: {s['error']}")
        chk = m.get("check", {})
        if chk.get("error"):
            problems.append(f"- {name}: check failed: {chk['error']}")
        for t, v in chk.get("tools", {}).items():
            for key in ("load_error", "parity_note"):
                if v.get(key):
                    problems.append(f"- {name} / {t}: {v[key]}")
            if v.get("checker", "ok") != "ok":
                problems.append(f"- {name} / {t}: checker: {v['checker']}")
            if v.get("ort", "ok") != "ok":
                problems.append(f"- {name} / {t}: ORT: {v['ort']}")
        for t, e in m.get("latency", {}).get("errors", {}).items():
            problems.append(f"- {name} / {t}: latency: {e}")
    lines.extend(["", "## Failures", ""])
    lines.extend(problems or ["None."])
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    mode = argv[:1]
    if mode == ["--tool"]:
        tool, src, dst, large = argv[1:5]
        print(RESULT_TAG + json.dumps(_run_tool(tool, src, dst, _meta(src), large == "1")))
        return 0
    if mode == ["--check"]:
        print(RESULT_TAG + json.dumps(run_check(*argv[1:3])))
        return 0
    if mode == ["--latency"]:
        src, paths, runs, warmup, seq = argv[1:6]
        print(RESULT_TAG + json.dumps(run_latency(src, paths, int(runs), int(warmup), int(seq))))
        return 0
    if mode == ["--make-large"]:
        print(RESULT_TAG + json.dumps(run_make_large(*argv[1:3])))
        return 0

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--models",
        help="comma-separated names or globs (fixture folder names, "
        "qwen2_0.5b_ts, qwen2_0.5b_dynamo); default all",
    )
    ap.add_argument(
        "--tools", default=",".join(TOOLS), help="comma-separated subset of: " + ", ".join(TOOLS)
    )
    ap.add_argument("--skip-latency", action="store_true", help="no ORT latency measurement")
    ap.add_argument("--skip-large", action="store_true", help="no 0.5B export (nor generating it)")
    ap.add_argument("--models-dir", default=DEFAULT_MODELS_DIR, help="cache of the 0.5B exports")
    ap.add_argument("--runs", type=int, default=20, help="timed latency runs per model (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed latency rounds first")
    ap.add_argument("--seq", type=int, default=128, help="prefill tokens for latency")
    ap.add_argument("--repeat", type=int, default=1, help="optimize runs per tool and model")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per tool run")
    ap.add_argument(
        "--max-rss-gb",
        type=float,
        default=0,
        help="stop a tool run whose RSS exceeds this (GiB; recorded as a failure); 0: no limit",
    )
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown file; JSON goes beside it")
    ap.add_argument(
        "--merge",
        metavar="JSON,JSON",
        help="measure nothing: one report from the JSON files of earlier runs (e.g. the "
        "fixtures and the 0.5B exports run apart); later files win for a model in both",
    )
    args = ap.parse_args(argv)
    if args.merge:
        return write_report(merge_reports(args.merge.split(",")), args.out)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    if set(tools) - set(TOOLS):
        ap.error(f"unknown tools: {sorted(set(tools) - set(TOOLS))} (known: {', '.join(TOOLS)})")
    if args.runs < 1 or args.repeat < 1:
        ap.error("--runs and --repeat must be at least 1")

    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "environment": environment(DISTS),
        "command": shlex.join(["python", "bench/fusion/bench_llm_fusions.py", *argv]),
        "tools": tools,
        "runs": args.runs,
        "warmup": args.warmup,
        "seq": args.seq,
        "repeat": args.repeat,
        "timeout": args.timeout,
        "max_rss_gb": args.max_rss_gb,
        "models": {},
    }
    work = tempfile.mkdtemp(
        prefix="fastopt-llm-bench-", dir=args.models_dir if os.path.isdir(args.models_dir) else None
    )
    try:
        # children import the build as it was at the start, not a reinstall made meanwhile
        site = snapshot_fastopt(os.path.join(work, "site"))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
        models = select_models(args)
        wanted_large = [n for n in models if n.startswith("qwen2_0.5b")]
        if wanted_large:
            report["large_export"] = ensure_large(args.models_dir, 3600, env)
        for name, src in models.items():
            if not os.path.exists(src):
                print(f"== {name}: {src} missing, skipped", flush=True)
                continue
            print(f"== {name}", flush=True)
            report["models"][name] = bench_model(name, src, tools, args, env, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["total_s"] = time.perf_counter() - t_start
    return write_report(report, args.out)


def _merge_model(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """One model measured in two runs: the later run's figures win for the tools it ran, the
    earlier run's stay for the others. Latency ratios stay valid: each is to the original
    measured in the same process."""
    m = {**old, **{k: v for k, v in new.items() if k not in ("timing", "check", "latency")}}
    m["timing"] = {**old.get("timing", {}), **new.get("timing", {})}
    chk_old, chk_new = old.get("check", {}), new.get("check", {})
    m["check"] = {**chk_old, **{k: v for k, v in chk_new.items() if k != "tools"}}
    m["check"]["tools"] = {**chk_old.get("tools", {}), **chk_new.get("tools", {})}
    if "latency" in old and "latency" in new:
        lo, ln = old["latency"], new["latency"]
        m["latency"] = {
            "ms": {**lo["ms"], **{k: v for k, v in ln["ms"].items() if k != "original"}},
            "ratio": {**lo["ratio"], **ln["ratio"]},
            "errors": {**lo["errors"], **ln["errors"]},
            "groups": lo["groups"] + ln["groups"],
            "original_ms_per_group": lo["original_ms_per_group"] + ln["original_ms_per_group"],
        }
    elif "latency" in new:
        m["latency"] = new["latency"]
    return m


def merge_reports(paths: list[str]) -> dict[str, Any]:
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = dict(reports[0])
    merged["models"] = {}
    # versions of tools an earlier run did not record come from the later runs
    merged["environment"] = {**reports[0]["environment"], "versions": {}}
    for r in reports:
        for dist, v in r["environment"]["versions"].items():
            merged["environment"]["versions"].setdefault(dist, v)
        for name, m in r["models"].items():
            old = merged["models"].get(name)
            merged["models"][name] = _merge_model(old, m) if old else m
        merged["large_export"] = r.get("large_export") or merged.get("large_export")
        seen = {*merged["tools"], *r["tools"]}
        merged["tools"] = [t for t in TOOLS if t in seen]
        for key in ("runs", "warmup", "seq"):
            if r[key] != merged[key]:
                raise SystemExit(f"cannot merge: {key} differs ({r[key]} vs {merged[key]})")
        # repeat and limits may differ (e.g. more optimize runs on the big models): the
        # largest is shown
        for key in ("repeat", "timeout", "max_rss_gb"):
            merged[key] = max(merged.get(key, 0), r.get(key, 0))
    merged["command"] = "; ".join(f"`{r['command']}` ({r['environment']['date']})" for r in reports)
    merged["merged"] = True
    merged["total_s"] = sum(r["total_s"] for r in reports)
    return merged


def write_report(report: dict[str, Any], out: str) -> int:
    md = render_markdown(report)
    write_results(md, report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
