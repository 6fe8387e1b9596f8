"""Calibration, AWQ and --bits-budget on a real trained model: KL against fp32, perplexity ratio
and top-1 agreement on English prose (bench/data/eval_prose.txt, written for this bench; the
calibration text is fastopt's built-in one, a different text), per recipe, with the quantize
time and the calibration's time against its ONNX Runtime forward passes.

    python bench/quant/bench_quant_calibration.py --hf /work/cache/smollm2 --workdir /tmp/qcal \
        [--out bench/results/quantize_calibration.md]

The model (SmolLM2-135M-Instruct by default) is exported once with torch.onnx (TorchScript,
no cache, logits output) into --workdir. Caveat printed with the table: SmolLM2's linear weights
came from a Q4_1 GGUF (asymmetric int4, blocks of 32), so asymmetric int4 b32 reproduces them
almost exactly; judge the recipes on symmetric and on block 128 too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parents[1]
EVAL_TEXT = BENCH / "data" / "eval_prose.txt"
CHUNK = 256
CAVEAT = (
    "SmolLM2's linear weights came from a Q4_1 GGUF (asymmetric int4, blocks of 32): asymmetric "
    "int4 b32 reproduces them almost exactly, so judge the recipes on symmetric and on block 128."
)


def export(hf: str, out: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.m(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).logits

    ids = torch.randint(0, 1000, (1, 16))
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            Logits(model),
            (ids, torch.ones_like(ids)),
            str(out),
            input_names=["input_ids", "attention_mask"],
            output_names=["logits"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                "logits": {0: "batch", 1: "sequence"},
            },
            opset_version=17,
            dynamo=False,
        )


def chunks(ids: list[int]) -> list[np.ndarray]:
    return [np.array([ids[i : i + CHUNK]], np.int64) for i in range(0, len(ids), CHUNK)]


def logits_of(path: Path, batches: list[np.ndarray]) -> tuple[list[np.ndarray], float]:
    import onnxruntime as ort

    t0 = time.perf_counter()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = [
        sess.run(["logits"], {"input_ids": b, "attention_mask": np.ones_like(b)})[0][0]
        for b in batches
    ]
    return out, time.perf_counter() - t0


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def metrics(ref: list[np.ndarray], got: list[np.ndarray], batches: list[np.ndarray]) -> dict:
    nll_r, nll_g, kl, agree, n = 0.0, 0.0, 0.0, 0, 0
    for r, g, b in zip(ref, got, batches):
        lr, lg = log_softmax(r), log_softmax(g)
        nxt = b[0, 1:]
        nll_r -= lr[np.arange(len(nxt)), nxt].sum()
        nll_g -= lg[np.arange(len(nxt)), nxt].sum()
        kl += float((np.exp(lr) * (lr - lg)).sum())
        agree += int((lr.argmax(-1) == lg.argmax(-1)).sum())
        n += len(nxt)
    positions = sum(b.shape[1] for b in batches)
    return {
        "ppl_ratio": float(np.exp((nll_g - nll_r) / n)),
        "ppl_fp32": float(np.exp(nll_r / n)),
        "kl": kl / positions,
        "top1": agree / positions,
    }


RECIPES: list[tuple[str, dict[str, Any]]] = [
    ("rtn sym b32", {}),
    ("rtn asym b32", {"symmetric": False}),
    ("rtn sym b128", {"block_size": 128}),
    ("+calibration sym b32 (importance file only)", {"calibration": "builtin"}),
    ("+AWQ sym b32", {"calibration": "builtin", "awq": True}),
    ("+AWQ asym b32", {"calibration": "builtin", "awq": True, "symmetric": False}),
    ("+AWQ sym b128", {"calibration": "builtin", "awq": True, "block_size": 128}),
    ("budget 5.5 sym b32 (unweighted)", {"bits_budget": 5.5}),
    ("budget 6 sym b32 (unweighted)", {"bits_budget": 6.0}),
    ("budget 5.5 sym b32 +calibration", {"bits_budget": 5.5, "calibration": "builtin"}),
    ("budget 5.5 sym b32 +AWQ", {"bits_budget": 5.5, "calibration": "builtin", "awq": True}),
    ("budget 6 sym b32 +calibration", {"bits_budget": 6.0, "calibration": "builtin"}),
    ("budget 6 sym b32 +AWQ", {"bits_budget": 6.0, "calibration": "builtin", "awq": True}),
    ("budget 4.75 sym b128", {"bits_budget": 4.75, "block_size": 128}),
    ("budget 5 sym b128", {"bits_budget": 5.0, "block_size": 128}),
    ("budget 6 sym b128", {"bits_budget": 6.0, "block_size": 128}),
    (
        "budget 5 sym b128 +AWQ",
        {"bits_budget": 5.0, "block_size": 128, "calibration": "builtin", "awq": True},
    ),
    ("int8 sym b32", {"mode": "int8"}),
]


def main(argv: list[str] | None = None) -> int:
    import fastopt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", default="/work/cache/smollm2", help="the transformers folder")
    p.add_argument("--workdir", default="/tmp/fastopt-qcal", help="export and outputs")
    p.add_argument("--only", action="append", default=[], help="recipes whose name has this")
    p.add_argument("--out", help="append the markdown table here")
    args = p.parse_args(argv)
    work = Path(args.workdir)
    onnx_path = work / "model" / "model.onnx"
    if not onnx_path.exists():
        export(args.hf, onnx_path)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(os.path.join(args.hf, "tokenizer.json"))
    batches = chunks(tok.encode(EVAL_TEXT.read_text()).ids)
    ref, fp32_seconds = logits_of(onnx_path, batches)
    # The calibration's own tokens through the plain model (session creation included): what
    # the calibration's time compares with.
    from fastopt.quant.calibration import SEQUENCE, builtin_text

    cal_ids = tok.encode(builtin_text()).ids
    cal_batches = [np.array([cal_ids[i : i + SEQUENCE]]) for i in range(0, len(cal_ids), SEQUENCE)]
    _, plain_seconds = logits_of(onnx_path, cal_batches)
    rows = []
    for name, kw in RECIPES:
        if args.only and not any(o in name for o in args.only):
            continue
        kw = dict(kw)
        mode = kw.pop("mode", "int4")
        out = work / "q.onnx"
        t0 = time.perf_counter()
        r = fastopt.quantize(onnx_path, out, mode=mode, hf_config=args.hf, **kw)
        seconds = time.perf_counter() - t0
        got, _ = logits_of(out, batches)
        m = metrics(ref, got, batches)
        recipe = r.recipe
        mm = [w for w in r.quantized if w.op == "MatMulNBits"]
        bits = 8 * sum(w.bytes_after for w in mm) / sum(w.bytes_before // 4 for w in mm)
        cal = recipe.calibration if recipe else None
        awq = recipe.awq if recipe else None
        rows.append(
            {
                "name": name,
                "bits": bits,
                **m,
                "seconds": seconds,
                "cal": f"{cal.seconds:.1f} / {cal.forward_seconds:.1f}" if cal else "",
                "awq": f"{len(awq.scaled)}/{len(awq.groups)}" if awq else "",
                "int8": len(recipe.allocation.int8_weights) if recipe and recipe.allocation else 0,
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    lines = [
        f"SmolLM2-135M-Instruct fp32, {sum(b.shape[1] for b in batches)} tokens of "
        f"bench/data/eval_prose.txt; fp32 perplexity {m['ppl_fp32']:.2f}; fp32 logits in "
        f"{fp32_seconds:.1f} s. The calibration's {len(cal_ids)} tokens through the plain fp32 "
        f"model in ONNX Runtime (session included): {plain_seconds:.1f} s. {CAVEAT}",
        "",
        "| recipe | bits/weight (MatMuls) | perplexity vs fp32 | KL | top-1 | int8 tensors "
        "| AWQ groups scaled | calibration s / its ORT runs s | quantize s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['bits']:.3f} | {100 * (r['ppl_ratio'] - 1):+.1f} % | "
            f"{r['kl']:.4f} | {r['top1']:.3f} | {r['int8']} | {r['awq']} | {r['cal']} | "
            f"{r['seconds']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
