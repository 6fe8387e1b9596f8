#!/usr/bin/env python3
"""KV cache: per-token decode latency at context 512 of a cached decoder against full recompute
with the no-cache model, and memory allocated per decode step, standard vs in-place cache.

Models: a decoder exported WITHOUT a cache, and its cached forms made by
`fastopt.optimize(..., preset="llm", kv_cache="standard" | "inplace")` (target ort). The no-cache
model is generated with tests/fixtures/make_fixtures.py's export() into --models-dir: --quick a
4-layer Qwen2 (hidden 256, 4 heads, 2 kv heads, vocab 8192), otherwise the 0.5B-sized Qwen2 of
bench_llm_fusions (hidden 896, 24 layers). --nocache/--cached/--inplace take models made
elsewhere (e.g. the reference corpus llama_ts_nocache / llama_ts_cache, which share weights); a
form fastopt refuses to make (kv_cache="inplace" without an in-place lowering) is n/a.

Latency (fastopt.bench's decode step: ORT CPU, graph optimizations ON, intra-op threads
--threads, batch 1, median of --runs after warm-up):
  recompute   one full forward of the no-cache model over 512 tokens: what every generated token
              costs without a cache;
  standard    one decode step (1 new token, past of 511 tokens: context 512), pasts fed as numpy;
  inplace     the same step with one (1, Hkv, 576, D) buffer per layer bound once as past and
              present (IO binding), attention_mask of width 512.
The same step is repeated (same past) so every timed run is exactly at context 512.

Memory per decode step (ORT's CPU arena off, so its allocations are plain malloc/free):
  outputs     bytes of the output tensors ORT allocates for the step (logits and, for the
              standard cache, every present: the whole cache is reallocated and copied each
              step; in-place presents are the bound buffers: nothing allocated);
  heap growth glibc mallinfo2 in-use bytes (uordblks + hblkhd) at the step boundaries over 8
              steps, max minus before: what the steps leave allocated (the outputs held until
              the next step), not the transient peak inside run() (approximate; Linux/glibc).

    python bench/kv_cache/bench_kv_cache.py --quick
    python bench/kv_cache/bench_kv_cache.py \\
        --nocache ../shared/corpus/llama_ts_nocache/model.onnx \\
        --cached ../shared/corpus/llama_ts_cache/model.onnx --out bench/results/kv_cache.md
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from fastopt.bench import Runner
from fastopt.bench.timing import measure

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 512


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use() -> int | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    mi = libc.mallinfo2()
    return int(mi.uordblks + mi.hblkhd)


def _session(path: str, threads: int, arena: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.enable_cpu_mem_arena = arena
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _median_ms(step: Any, runs: int, warmup: int) -> float:
    return statistics.median(measure(step, runs, warmup)) * 1e3


def bench_recompute(path: str, threads: int, runs: int, warmup: int) -> float:
    # fastopt.bench's decode step of a no-cache decoder: one forward over context tokens
    with Runner(path, provider="cpu", phase="decode", seq=CONTEXT - 1, threads=threads) as r:
        return _median_ms(r.step, runs, warmup)


def bench_standard(path: str, threads: int, runs: int, warmup: int) -> dict[str, Any]:
    with Runner(path, provider="cpu", phase="decode", seq=CONTEXT - 1, threads=threads) as r:
        ms = _median_ms(r.step, runs, warmup)
        feed = r.workload.feeds
    return {"ms": ms, **_memory(path, feed, None, threads)}


def bench_inplace(path: str, threads: int, runs: int, warmup: int) -> dict[str, Any]:
    # the step binds the (1, Hkv, CONTEXT + 64, D) buffers once, as past and present
    with Runner(
        path,
        provider="cpu",
        phase="decode",
        seq=CONTEXT - 1,
        threads=threads,
        max_length=CONTEXT + 64,
    ) as r:
        ms = _median_ms(r.step, runs, warmup)
        feeds = r.workload.feeds
    feed, bufs = {}, {}
    for name, array in feeds.items():
        if name.startswith("past_key_values."):  # past_key_values.{i}.{kv}
            _, i, kv = name.split(".")
            bufs[(int(i), kv)] = ort.OrtValue.ortvalue_from_numpy(array)
        else:
            feed[name] = array
    return {"ms": ms, **_memory(path, feed, bufs, threads)}


def _memory(path: str, feed: dict[str, np.ndarray], bufs: Any, threads: int) -> dict[str, Any]:
    """Output bytes ORT allocates per step, and heap in-use growth over 8 steps, arena off."""
    sess = _session(path, threads, arena=False)
    io = sess.io_binding()
    before = _heap_in_use()
    peak = before or 0
    out_bytes = 0
    for _ in range(8):
        io = sess.io_binding()
        for k, v in feed.items():
            io.bind_cpu_input(k, v)
        for o in sess.get_outputs():
            name = o.name
            if bufs is not None and name.startswith("present."):
                i, kv = name.split(".")[1:]
                io.bind_ortvalue_input(f"past_key_values.{i}.{kv}", bufs[(int(i), kv)])
                io.bind_ortvalue_output(name, bufs[(int(i), kv)])
            else:
                io.bind_output(name)  # ORT allocates it
        sess.run_with_iobinding(io)
        if bufs is None:
            out_bytes = sum(_nbytes(v) for v in io.get_outputs())
        else:
            out_bytes = sum(
                _nbytes(v)
                for o, v in zip(sess.get_outputs(), io.get_outputs())
                if not o.name.startswith("present.")
            )
        now = _heap_in_use()
        if now is not None:
            peak = max(peak, now)
    return {"out_bytes": out_bytes, "heap_growth": None if before is None else peak - before}


def _nbytes(v: ort.OrtValue) -> int:
    size = 2 if v.data_type() == "tensor(float16)" else 4
    return int(np.prod(v.shape())) * size


def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.2f} MB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small generated Qwen2 (4 layers)")
    ap.add_argument(
        "--models-dir",
        default="/tmp/fastopt-bench",
        help="generated models (shared with bench_llm_fusions)",
    )
    ap.add_argument("--nocache", help="no-cache decoder (default: generated)")
    ap.add_argument("--cached", help="standard-cache decoder (default: fastopt kv_cache=standard)")
    ap.add_argument("--inplace", help="in-place decoder (default: fastopt kv_cache=inplace)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the markdown table here (e.g. bench/results/kv_cache.md)")
    args = ap.parse_args(argv)

    nocache = args.nocache or _generated(args)
    cached, inplace = args.cached, args.inplace
    if cached is None or inplace is None:
        made = _fastopt_cached(nocache, Path(args.models_dir))
        cached = cached or made.get("standard")
        inplace = inplace or made.get("inplace")
    rec = bench_recompute(nocache, args.threads, args.runs, args.warmup)
    std = bench_standard(cached, args.threads, args.runs, args.warmup) if cached else None
    inp = bench_inplace(inplace, args.threads, args.runs, args.warmup) if inplace else None

    def row(name: str, model: str | None, r: dict[str, Any] | None) -> str:
        if r is None:
            return f"| {name} | n/a (fastopt made no such model in this build) | | | | |"
        return (
            f"| {name} | `{model}` | {r['ms']:.2f} | {rec / r['ms']:.1f}x | "
            f"{_mb(r['out_bytes'])} | {_mb(r['heap_growth'])} |"
        )

    lines = [
        "# KV cache: decode latency at context 512 and memory per decode step",
        "",
        f"{platform.processor() or platform.machine()}, ORT {ort.__version__}, "
        f"intra-op threads {args.threads}, batch 1, median of {args.runs} runs "
        "(method: bench/kv_cache/bench_kv_cache.py docstring).",
        "",
        "| model | file | ms / token | speed-up vs recompute | outputs allocated / step "
        "| heap growth over 8 steps |",
        "|---|---|---|---|---|---|",
        f"| recompute (no cache, 512 tokens) | `{nocache}` | {rec:.2f} | 1.0x | | |",
        row("standard cache", cached, std),
        row("in-place cache", inplace, inp),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _generated(args: argparse.Namespace) -> str:
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from make_fixtures import export  # type: ignore[import-not-found]

    name = "qwen2_kv_quick" if args.quick else "qwen2_0.5b_ts"
    out = Path(args.models_dir) / name
    if not (out / "model.onnx").exists():
        overrides: dict[str, Any] = (
            {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 8192,
             "max_position_embeddings": 1024}
            if args.quick
            else {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                  "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                  "max_position_embeddings": 1024}
        )  # fmt: skip
        export("qwen2", "ts", "float32", out, config_overrides=overrides,
               external_data=not args.quick, check=False)  # fmt: skip
    return str(out / "model.onnx")


def _fastopt_cached(nocache: str, models_dir: Path) -> dict[str, str]:
    import fastopt
    from fastopt.pipeline.kv_cache import KV_CACHE_PASS
    from fastopt.pipeline.registry import all_passes

    if not any(p.name == KV_CACHE_PASS for p in all_passes()):
        return {}
    out = {}
    for mode in ("standard", "inplace"):
        dst = models_dir / f"{Path(nocache).parent.name}_{mode}" / "model.onnx"
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            fastopt.optimize(nocache, preset="llm", target="ort", output=dst, kv_cache=mode)  # type: ignore[arg-type]
        except ValueError as e:  # e.g. no in-place lowering for this model in this build
            print(f"kv_cache={mode}: {e}", file=sys.stderr)
            continue
        out[mode] = str(dst)
    return out


if __name__ == "__main__":
    sys.exit(main())
