"""q4m + GPTQ calibrated on text the model samples itself, scored as bench_quant_recipes.py scores
its rows (the same 418 tokens and fp32 reference).

With ``calibration="sampled"`` the model writes its own calibration text
(fastopt.quant.sampled_text: 64 continuations of its BOS, 64 tokens each, through a KV cache):
the recipe that needs no user text.

    python bench/quant/probe_sampled_calibration.py FP32_MODEL FP16_MODEL [--work DIR]
        [--sequences N --tokens T]         # another sample size than sampled_text's
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from types import ModuleType

import numpy as np

HERE = Path(__file__).resolve().parent


def _recipes_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recipes", HERE / "bench_quant_recipes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fp32")
    ap.add_argument("fp16")
    ap.add_argument("--hf", default="/work/cache/smollm2", help="tokenizer of the scored text")
    ap.add_argument("--work", default="/tmp/sampled-calibration")
    ap.add_argument("--sequences", type=int, help="sequences sampled (default: sampled_text's)")
    ap.add_argument("--tokens", type=int, help="tokens per sequence, BOS included")
    args = ap.parse_args()
    import fastopt
    from fastopt.quant import sampled_text
    from fastopt.quant.recipe import recipe_settings
    from transformers import AutoTokenizer

    if args.sequences:
        sampled_text.SEQUENCES = args.sequences
    if args.tokens:
        sampled_text.TOKENS = args.tokens
    bench = _recipes_bench()
    tok = AutoTokenizer.from_pretrained(args.hf)
    ids = np.array([tok(bench.PROSE)["input_ids"]], dtype=np.int64)
    ref = bench.logits_of(Path(args.fp32), ids)
    out = Path(args.work) / "model.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    settings = recipe_settings("q4m", calibrated=True)
    settings.update(calibration="sampled", recipe="q4m", run_check=False)
    report = fastopt.quantize(args.fp16, out, mode="int4", **settings)
    seconds = time.perf_counter() - t0
    bpw, n8 = bench.bits_per_weight(out)
    m = bench.metrics(ref, bench.logits_of(out, ids).astype(np.float32), ids)
    print(
        f"q4m + GPTQ, sampled calibration {sampled_text.SEQUENCES} x {sampled_text.TOKENS}:"
        f" {bpw:.3f} bits/weight, {n8} int8, KL {m['kl']:.4f},"
        f" perplexity {m['ppl']:.2f}, top-1 {m['top1']:.3f}, {seconds:.1f} s ({bench.cost(report)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
