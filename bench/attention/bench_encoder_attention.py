"""Encoder attention lowering for target ort: fastopt `--preset llm` with packed-QKV
com.microsoft Attention (the default for non-causal self-attention) against option
packed_attention=0 (MultiHeadAttention / GroupQueryAttention) and onnxscript's ORT fusions.

    python bench/attention/bench_encoder_attention.py MODEL_DIR [--runs 30] [--seq 128,512]

MODEL_DIR holds model.onnx (a bert export: a fixture folder, or one made with
tests/fixtures/make_fixtures.py's export(); see --make). Outputs go to MODEL_DIR + "_out" (made
once, reused). Prints the parity of each output against the original (ORT optimizations off,
batch 2, 16 tokens, right padding) and the median ORT CPU latency (optimizations on, 2 intra-op
threads, batch 1), the models interleaved run by run.

    python bench/attention/bench_encoder_attention.py /tmp/bert_base --make dynamo  # BERT-base:
        hidden 768, 12 layers, 12 heads, intermediate 3072, 512 positions, random weights
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def make(out_dir: str, exporter: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "fixtures"))
    from make_fixtures import export  # type: ignore[import-not-found]

    overrides = {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "max_position_embeddings": 512,
    }
    export("bert", exporter, "float32", Path(out_dir), config_overrides=overrides,
           external_data=True, check=False)  # fmt: skip


def outputs(src: str, work: str) -> dict[str, str]:
    import fastopt

    os.makedirs(work, exist_ok=True)
    outs = {}
    for name, opts in (("fastopt_mha", {"packed_attention": 0}), ("fastopt_packed", {})):
        path = os.path.join(work, name + ".onnx")
        if not os.path.exists(path):
            report = fastopt.optimize(src, preset="llm", target="ort", options=opts)  # type: ignore[arg-type]
            assert report.model is not None
            report.model.save(path, external_data=True)
        outs[name] = path
    path = os.path.join(work, "onnxscript.onnx")
    if not os.path.exists(path):
        import onnx_ir as ir
        import onnxscript.optimizer
        from onnxscript.rewriter import ort_fusions

        model = ir.load(src)
        onnxscript.optimizer.optimize(model)
        ort_fusions.optimize_for_ort(model)
        ir.save(model, path, external_data="onnxscript.onnx.data")
    outs["onnxscript"] = path
    return outs


def session(path: str, optimize: bool = True) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = {i.name for i in s.get_inputs()}
    return lambda feeds: s.run(None, {k: v for k, v in feeds.items() if k in names})


def feeds(rng: np.random.Generator, b: int, s: int, pad: bool = False) -> dict[str, np.ndarray]:
    mask = np.ones((b, s), np.int64)
    if pad:
        mask[-1, s - s // 3 :] = 0
    ids = rng.integers(0, 512, (b, s))
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seq", default="128")
    ap.add_argument("--make", choices=["dynamo", "ts"], help="export a BERT-base-sized model first")
    args = ap.parse_args()
    src = os.path.join(args.model_dir, "model.onnx")
    if args.make and not os.path.exists(src):
        make(args.model_dir, args.make)
    outs = outputs(src, args.model_dir.rstrip("/") + "_out")
    rng = np.random.default_rng(0)
    x = feeds(rng, 2, 16, pad=True)
    keep = x["attention_mask"].astype(bool)
    ref = session(src, False)(x)[0]
    for name, path in outs.items():
        print(f"parity {name}: {np.abs(session(path, False)(x)[0] - ref)[keep].max():.2e}")
    runs = {"original": session(src), **{n: session(p) for n, p in outs.items()}}
    for seq in (int(s) for s in args.seq.split(",")):
        x = feeds(rng, 1, seq)
        for run in runs.values():
            run(x), run(x)
        times: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(args.runs):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run(x)
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {n: float(np.median(t)) for n, t in times.items()}
        print(f"seq {seq}: " + "  ".join(f"{n} {v:.3f} ms" for n, v in med.items()))
        print(f"  packed/mha {med['fastopt_packed'] / med['fastopt_mha']:.3f}"
              f"  packed/onnxscript {med['fastopt_packed'] / med['onnxscript']:.3f}"
              f"  mha/onnxscript {med['fastopt_mha'] / med['onnxscript']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
