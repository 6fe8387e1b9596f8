"""Decoders exported WITH a cache (tests/fixtures/models/*_cache): each converted by
`--kv-cache standard|inplace` against the original cached export driven with its own
past/present. Per fixture and form: greedy tokens equal (right-padded batch of prompts of 9 and
4 tokens; in place against each row alone, the layout an in-place cache holds), the max
step-logit difference, and the decode time per token (batch 1, prompt of 9, the median over
`--repeats` runs of the time of the single-token steps; ORT CPU, 1 thread), original vs
converted. Sliding-window exports (gemma2/gemma3) are listed with their refusal.

    python bench/kv_cache/bench_cached_exports.py [--steps 32] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import fastopt  # noqa: E402
from support import kv_generation as kg  # noqa: E402
from support.llm_fixtures import fixtures  # noqa: E402


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 4))]


def _original(path: Path, prompts: list[list[int]], steps: int, inplace: bool) -> kg.Generation:
    if not inplace:
        return kg.greedy_cached(path, prompts, steps)
    rows = [kg.greedy_cached(path, [p], steps) for p in prompts]
    return kg.Generation(
        np.concatenate([r.tokens for r in rows]), np.concatenate([r.logits for r in rows], axis=1)
    )


def _decode_ms(sess: ort.InferenceSession, prompt: list[int], steps: int, inplace: bool) -> float:
    """Median ms of the single-token steps (the prefill excluded), timed inside the harness
    by wrapping the session's run calls."""
    times: list[float] = []
    run_name = "run_with_iobinding" if inplace else "run"
    inner = getattr(sess, run_name)

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out

    setattr(sess, run_name, timed)
    try:
        kg.greedy_cached(sess, [prompt], steps, inplace=inplace)
    finally:
        delattr(sess, run_name)
    return 1e3 * statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [
        "| fixture | --kv-cache | attention op | tokens equal | max step-logit diff "
        "| decode ms/token original | converted | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    refusals = []
    prompts = _prompts()
    with tempfile.TemporaryDirectory() as tmp:
        for fx in fixtures(cache_export=True):
            for mode in ("standard", "inplace"):
                out = Path(tmp) / f"{fx.name}-{mode}" / "model.onnx"
                try:
                    report = fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
                except fastopt.ModelError as e:
                    if mode == "standard":
                        refusals.append(f"- {fx.name}: {e}")
                    continue
                inplace = mode == "inplace"
                ref = _original(fx.path, prompts, args.steps, inplace)
                got = kg.greedy_cached(out, prompts, args.steps, inplace=inplace)
                same, diff = kg.compare(ref, got)
                op = next(
                    k.split("::")[-1]
                    for k in report.ops_after
                    if k.endswith(("GroupQueryAttention", "MultiHeadAttention"))
                )
                orig_s, conv_s = _session(fx.path), _session(out)
                o = statistics.median(
                    _decode_ms(orig_s, prompts[0], args.steps, False) for _ in range(args.repeats)
                )
                c = statistics.median(
                    _decode_ms(conv_s, prompts[0], args.steps, inplace) for _ in range(args.repeats)
                )
                rows.append(
                    f"| {fx.name} | {mode} | {op} | {same} / {args.steps} | {diff:.2g} "
                    f"| {o:.3f} | {c:.3f} | {o / c:.2f}x |"
                )
                print(rows[-1], flush=True)
    text = "\n".join([*rows, "", "Refused (standard and inplace alike):", *refusals]) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
