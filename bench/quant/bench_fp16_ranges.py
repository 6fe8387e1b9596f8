#!/usr/bin/env python3
"""The fp16 range check (fastopt.quant.fp16_ranges): its cost, and what it does on a real model.

python bench/quant/bench_fp16_ranges.py cost MODEL.onnx [MODEL.onnx ...]
    per model, in a child process each: the range pass alone (fastopt.quant.fp16_ranges.check_ranges
    on the loaded model: 4 input sets of --verify's shape), wall time and the child's peak
    RSS, beside the same child's peak RSS after importing onnx/onnxruntime and loading.
python bench/quant/bench_fp16_ranges.py real HF_DIR OUT_DIR
    a transformers folder (e.g. SmolLM2-135M from /work/shared/realmodels/make-smollm2.sh)
    exported with torch.onnx (TorchScript, opset 17), converted to fp16 with the range
    check on and off, the logits of both compared with fp32 on a real prompt: cosine, max
    |diff|, top-1 agreement, NaN/inf count, ops kept float32.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _anon_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssAnon:")[1].split()[0]) / 1024


def _cost_child(path: str) -> None:
    import fastopt
    import numpy  # noqa: F401  (imports apart: the range pass's own cost is what is measured)
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    from fastopt.quant.fp16_ranges import check_ranges

    t = time.perf_counter()
    model = fastopt.load(path)
    load_s, load_rss = time.perf_counter() - t, _peak_rss_mb()
    t = time.perf_counter()
    check = check_ranges(model)
    print(
        json.dumps(
            {
                "model": path,
                "nodes": model.graph.node_count,
                "load_s": round(load_s, 3),
                "peak_rss_after_load_mb": round(load_rss),
                "range_s": round(time.perf_counter() - t, 3),
                "peak_rss_mb": round(_peak_rss_mb()),
                # what of it is not the weights' file pages (mapped, reclaimable)
                "rss_anon_after_mb": round(_anon_mb()),
                "values": check.observed,
                "kept": len(check.kept),
                "skipped": check.skipped,
            }
        )
    )


def _calibrated_child(path: str, calibration: str, tokenizer_dir: str) -> None:
    import fastopt
    import numpy  # noqa: F401
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    from fastopt.quant.fp16_ranges import check_ranges

    model = fastopt.load(path)
    t = time.perf_counter()
    check = check_ranges(
        model, calibration=calibration if calibration != "-" else None, hf_config=tokenizer_dir
    )
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "source": check.inputs(),
                "range_s": round(time.perf_counter() - t, 2),
                # the ORT run happens in a forked child (fastopt.forked)
                "peak_rss_mb": round(max(_peak_rss_mb(), children)),
                "values": check.observed,
                "kept": len(check.kept),
                "kept_ops": [
                    {"node": k.node, "op": k.op, "max": k.max_abs, "by_source": k.by_source}
                    for k in check.kept
                ],
            }
        )
    )


def _prose_feeds(model_path: Path, tokenizer_dir: str) -> dict[str, Any]:
    import numpy as np
    import onnx
    import tokenizers
    from fastopt.verify.real_text import __file__ as real_text

    prose = (Path(real_text).parent / "prose.txt").read_text("utf-8")
    tok = tokenizers.Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = np.array([tok.encode(prose).ids], np.int64)
    names = {i.name for i in onnx.load(str(model_path), load_external_data=False).graph.input}
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None]
    return feeds


def calibrated(path: str, tokenizer_dir: str, out_dir: str, text: str = "builtin") -> None:
    import fastopt
    import numpy as np
    import onnxruntime as ort

    for calibration in ("-", text):
        out = subprocess.run(
            [sys.executable, __file__, "_calibrated", path, calibration, tokenizer_dir],
            capture_output=True,
            text=True,
            check=False,
        )
        print(out.stdout.strip() or out.stderr[-2000:])
    feeds = _prose_feeds(Path(path), tokenizer_dir)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def logits(p: Path | str) -> np.ndarray:
        sess = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
        return np.asarray(sess.run(["logits"], feeds)[0], np.float64)[0]

    ref = logits(path)
    for calibration in (None, text):
        dst = Path(out_dir) / f"fp16_{'calibrated' if calibration else 'random'}" / "model.onnx"
        # (a checkpoint folder; a tokenizer beside the model is found without it)
        hf = tokenizer_dir if (Path(tokenizer_dir) / "config.json").exists() else None
        r = fastopt.quantize(path, dst, mode="fp16", calibration=calibration, hf_config=hf)
        got = logits(dst)
        finite = np.isfinite(got).all(-1)
        a, b = ref[finite], got[finite]
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        lp = (
            a
            - np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - a.max(-1, keepdims=True)
        )
        lq = (
            b
            - np.log(np.exp(b - b.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - b.max(-1, keepdims=True)
        )
        check = r.range_check
        print(
            json.dumps(
                {
                    "check": check.inputs() if check else None,
                    "prose_tokens": int(feeds["input_ids"].shape[1]),
                    "kept_ops": len(check.kept) if check else 0,
                    "kept_by_the_check": check.newly_kept if check else 0,
                    "positions_with_nan_inf": int((~finite).sum()),
                    "min_cosine": round(float(cos.min()), 6) if cos.size else None,
                    "top1_agreement": round(float((a.argmax(-1) == b.argmax(-1)).mean()), 4)
                    if cos.size
                    else None,
                    "kl": round(float((np.exp(lp) * (lp - lq)).sum(-1).mean()), 6)
                    if cos.size
                    else None,
                }
            )
        )


def cost(paths: list[str]) -> None:
    for p in paths:
        out = subprocess.run(
            [sys.executable, __file__, "_cost", p], capture_output=True, text=True, check=False
        )
        print(out.stdout.strip() or out.stderr[-2000:])


def _export(hf_dir: str, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids, attention_mask):  # type: ignore[no-untyped-def]
            return self.m(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).logits

    path = out / "fp32" / "model.onnx"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.ones((1, 8), dtype=torch.int64)
    axes = {n: {0: "batch_size", 1: "sequence_length"} for n in ("input_ids", "attention_mask")}
    axes["logits"] = {0: "batch_size", 1: "sequence_length"}
    with torch.no_grad():
        torch.onnx.export(
            Wrapper(),
            (ids, torch.ones_like(ids)),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    return path


def real(hf_dir: str, out_dir: str) -> None:
    import fastopt
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoTokenizer

    out = Path(out_dir)
    src = _export(hf_dir, out)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    text = "The capital of France is Paris. The tallest mountain in the world is"
    ids = np.asarray([tok(text)["input_ids"]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def logits(p: Path) -> np.ndarray:
        sess = ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
        return np.asarray(sess.run(["logits"], feeds)[0], np.float64)[0]

    ref = logits(src)
    for ranges in (True, False):
        dst = out / f"fp16_ranges_{'on' if ranges else 'off'}" / "model.onnx"
        t = time.perf_counter()
        r = fastopt.quantize(src, dst, mode="fp16", fp16_ranges=ranges)
        seconds = time.perf_counter() - t
        got = logits(dst)
        finite = np.isfinite(got)
        a, b = ref, np.where(finite, got, 0.0)
        cos = (
            (a * b).sum(-1)
            / np.linalg.norm(a, axis=-1)
            / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)
        )
        check = r.range_check
        print(
            json.dumps(
                {
                    "fp16_ranges": ranges,
                    "prompt_tokens": int(ids.shape[1]),
                    "convert_s": round(seconds, 2),
                    "range_s": round(check.seconds, 2) if check else None,
                    "kept_ops": len(check.kept) if check else 0,
                    "kept_by_the_check": check.newly_kept if check else 0,
                    "output_mb": round(
                        sum(f.stat().st_size for f in dst.parent.iterdir()) / 2**20, 1
                    ),
                    "max_abs_fp32_value": max((k.max_abs for k in check.kept), default=None)
                    if check
                    else None,
                    "nonfinite_logits": int((~finite).sum()),
                    "min_cosine": round(float(cos.min()), 6),
                    "max_abs_diff": float(np.abs(ref - b).max()),
                    "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
                    "clamped": sum(p.counters.get("values_clamped", 0) for p in r.passes),
                }
            )
        )
    if check is not None:
        print(check.summary())


def main(argv: list[str]) -> int:
    if argv[:1] == ["_cost"]:
        _cost_child(argv[1])
    elif argv[:1] == ["cost"] and len(argv) > 1:
        cost(argv[1:])
    elif argv[:1] == ["real"] and len(argv) == 3:
        real(argv[1], argv[2])
    elif argv[:1] == ["_calibrated"]:
        _calibrated_child(argv[1], argv[2], argv[3])
    elif argv[:1] == ["calibrated"] and len(argv) in (4, 5):
        calibrated(*argv[1:])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
