"""Greedy decoding of gemma2/3's cached exports after `--preset default` / `llm`, right-padded.

Their sliding layers cache only the last window - 1 rows, which for the short row of a padded
batch are pad rows the export's next step reads: the optimized model decodes as the export only
when its pad queries (every key masked) give what the export gives (masked_rows.h). Prints one
Markdown row per export: tokens equal out of 32 and the max step-logit difference, for
default/llm x ort/onnx (bench/results/cached_exports.md).

    python bench/kv_cache/bench_cached_padded.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import fastopt  # noqa: E402
from support import kv_generation as kg  # noqa: E402

EXPORTS = [
    "gemma2_ts_float32_cache",
    "gemma2_dynamo_float32_cache",
    "gemma3_ts_float32_cache",
    "gemma3_dynamo_float32_cache",
]
STEPS = 32


def main() -> None:
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 5))]
    print("| export | default ort | default onnx | llm ort | llm onnx |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in EXPORTS:
            src = ROOT / "tests" / "fixtures" / "models" / name / "model.onnx"
            ref = kg.greedy_cached(src, prompts, STEPS)
            cells = []
            for preset in ("default", "llm"):
                for target in ("ort", "onnx"):
                    out = Path(tmp) / f"{name}_{preset}_{target}.onnx"
                    fastopt.optimize(src, preset=preset, target=target, output=out)  # type: ignore[arg-type]
                    same, diff = kg.compare(ref, kg.greedy_cached(out, prompts, STEPS))
                    cells.append(f"{same}/{STEPS} ({diff:.2g})")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
