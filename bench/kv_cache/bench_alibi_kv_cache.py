#!/usr/bin/env python3
"""ALiBi decoders' KV caches (bloom, mpt fixtures): greedy parity of every cached form.

    python bench/kv_cache/bench_alibi_kv_cache.py      # a markdown table on stdout (about 15 s)

For each bloom_* / mpt_* fixture, target (ort, onnx) and --kv-cache form (standard; inplace for
ort), the cached model made by fastopt.optimize(preset="llm") decodes 32 greedy tokens from a
right-padded batch of two prompts (9 and 4 tokens) with tests/support/kv_generation.py's harness,
and is compared with the no-cache original: full recompute on the layout the cache holds (contiguous
rows; for mpt's standard cache the holed layout, since its bias counts key indices, holes
included, as the original does on the same attention_mask). Columns: the attention op the cache
lowered to, tokens equal before the first mismatch, and the largest step-logit difference over
those steps.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import fastopt
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from support import kv_generation as kg  # noqa: E402
from support.llm_fixtures import ALIBI_ARCHS, fixtures  # noqa: E402

STEPS = 32


def main() -> None:
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 4))]
    print("| fixture | target | --kv-cache | attention op | tokens equal | max step-logit diff |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for fx in fixtures(arch=ALIBI_ARCHS):
            for target, mode in (("ort", "standard"), ("ort", "inplace"), ("onnx", "standard")):
                out = Path(tmp) / f"{fx}_{target}_{mode}" / "model.onnx"
                report = fastopt.optimize(
                    fx.path, preset="llm", target=target, output=out, kv_cache=mode
                )  # type: ignore[arg-type]
                lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
                ops = [k for k in lowered if "Attention" in k and "lowered" not in k]
                if mode == "standard" and fx.arch == "mpt":
                    ref = kg.greedy_no_cache_as_cached(fx.path, prompts, STEPS)
                else:
                    ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), STEPS)
                got = kg.greedy_cached(out, prompts, STEPS, inplace=mode == "inplace")
                same, diff = kg.compare(ref, got)
                print(
                    f"| {fx} | {target} | {mode} | {', '.join(ops)} | {same} / {STEPS} "
                    f"| {diff:.2g} |"
                )


if __name__ == "__main__":
    main()
