"""Calibration of ``--verify``'s real-text check (fastopt.verify.real_text): per mode, what the
check measures on a real trained model and on the random-weight fixtures, next to what the
random-id judging (fastopt.verify.quantized's logits cosine / top-1 on 16 uniform ids) measured.

    python bench/verify/bench_verify_real_text.py --model DIR/model.onnx [--variants int8,int4,...]
    python bench/verify/bench_verify_real_text.py --fixtures llama_ts_float32,qwen2_ts_float32

--model: an export with its tokenizer.json beside it (tests/fixtures/export_causal_lm.py makes
one from /work/shared/realmodels/make-smollm2.sh's SmolLM2 folder). --fixtures: each fixture
twice, with no tokenizer (sequences sampled from the model) and with a WordLevel tokenizer over
the built-in prose. Prints one JSON line per variant; bench/results/verify_real_text.md tables
them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fastopt
from fastopt.verify.quantized import verify_quantized
from fastopt.verify.real_text import evaluate_text

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
VARIANTS = ["rewrite", "kv", "fp16", "int8", "int8-dynamic", "int4", "int4-asym", "int4-b128"]


def make(variant: str, src: Path, out: Path) -> str:
    """Writes `variant` of `src` to `out`; returns the check's mode."""
    if variant == "rewrite":
        fastopt.optimize(src, preset="llm", output=out)
        return "fp32"
    if variant == "kv":
        fastopt.optimize(src, preset="llm", output=out, kv_cache="standard")
        return "fp32"
    if variant == "int4-asym":
        fastopt.quantize(src, out, mode="int4", symmetric=False)
        return "int4"
    if variant == "int4-b128":
        fastopt.quantize(src, out, mode="int4", block_size=128)
        return "int4"
    fastopt.quantize(src, out, mode=variant)  # type: ignore[arg-type]
    return variant


def measure(name: str, src: Path, variant: str, work: Path) -> dict[str, Any]:
    out = work / f"{variant}.onnx"
    t0 = time.perf_counter()
    mode = make(variant, src, out)
    t1 = time.perf_counter()
    c0 = time.process_time()
    text = evaluate_text(src, out, mode)
    row: dict[str, Any] = {"model": name, "variant": variant, **text.to_dict()}
    row["make_s"], row["eval_cpu_s"] = t1 - t0, time.process_time() - c0
    if mode not in ("fp32",):
        ids = verify_quantized(src, out, mode).outputs[0]  # the random-id measures, as before
        row["random_ids"] = {"cosine": ids.cosine, "top1": ids.top1_agreement}
    for f in work.iterdir():
        if f.name.startswith(variant) or f.name == "genai_config.json":
            f.unlink()
    return row


def word_tokenizer(folder: Path) -> None:
    from fastopt.verify.text_tokens import prose
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0}
    for w, _ in Whitespace().pre_tokenize_str(prose()):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--fixtures", default="")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    with tempfile.TemporaryDirectory(prefix="fastopt-verify-text-") as tmp:
        work = Path(tmp)
        if args.model:
            for v in variants:
                print(json.dumps(measure(args.model.parent.name, args.model, v, work)), flush=True)
        for name in filter(None, args.fixtures.split(",")):
            for tokenizer in (False, True):
                folder = work / f"{name}-{'tok' if tokenizer else 'sampled'}"
                folder.mkdir()
                shutil.copy(FIXTURES / name / "model.onnx", folder / "model.onnx")
                shutil.copy(FIXTURES / name / "meta.json", folder / "meta.json")
                if tokenizer:
                    word_tokenizer(folder)
                for v in variants:
                    row = measure(name, folder / "model.onnx", v, folder)
                    print(json.dumps(row), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
