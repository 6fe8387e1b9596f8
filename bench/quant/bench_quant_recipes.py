"""int4 recipes under a size limit on a real model: KL against fp32, perplexity, top-1 and the
average bits per weight as written (codes, scales and zero points of every MatMulNBits weight,
from the output file), per recipe, on the fp32 export and on its fp16 conversion (whose scales
are fp16: what a deployed fp16 model stores).

    nice python bench/quant/bench_quant_recipes.py --src /tmp/qsearch-smollm2/fp32/model.onnx \
        --work /tmp/q1-recipes [--only NAME ...]

Evaluation: bench_quantize_accuracy.py's 418 tokens of prose, one sequence, fp32 logits as the
reference. Recipes are ``name: source kwargs`` lines below (fastopt.quantize's arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize_accuracy import PROSE, logits_of, metrics
from fastopt.quant.recipe import recipe_settings

# (name, source "fp32"|"fp16", fastopt.quantize kwargs)
RECIPES: list[tuple[str, str, dict]] = [
    ("rtn b32 sym", "fp32", dict(method="rtn")),
    ("rtn b32 sym fp16", "fp16", dict(method="rtn")),
    ("search b32 asym fp16", "fp16", dict(method="search", symmetric=False)),
    ("search b64 asym fp16", "fp16", dict(method="search", symmetric=False, block_size=64)),
    ("search b64 sym fp16", "fp16", dict(method="search", block_size=64)),
    ("rtn b64 asym fp16", "fp16", dict(method="rtn", symmetric=False, block_size=64)),
    ("search b128 asym fp16", "fp16", dict(method="search", symmetric=False, block_size=128)),
    (
        "search b64 asym fp16 budget 4.6",
        "fp16",
        dict(method="search", symmetric=False, block_size=64, bits_budget=4.6),
    ),
    (
        "search b128 asym fp16 budget 4.6",
        "fp16",
        dict(method="search", symmetric=False, block_size=128, bits_budget=4.6),
    ),
    (
        "search b64 asym fp16 budget 4.6 lm_head int4",
        "fp16",
        dict(method="search", symmetric=False, block_size=64, bits_budget=4.6, lm_head="int4"),
    ),
    ("search b32 sym fp16", "fp16", dict(method="search")),
    ("rtn b32 sym fp16 budget 4.6", "fp16", dict(method="rtn", bits_budget=4.6)),
    ("search b32 sym fp16 budget 4.6", "fp16", dict(method="search", bits_budget=4.6)),
    (
        "search b32 asym fp16 lm_head int8",
        "fp16",
        dict(method="search", symmetric=False, lm_head="int8"),
    ),
    (
        "search b64 asym budget 4.6",
        "fp32",
        dict(method="search", symmetric=False, block_size=64, bits_budget=4.6),
    ),
    ("search b64 sym budget 4.6", "fp32", dict(method="search", block_size=64, bits_budget=4.6)),
    (
        "search b32 asym fp16 awq",
        "fp16",
        dict(method="search", symmetric=False, calibration="builtin", awq=True),
    ),
    (
        "search b32 sym fp16 awq",
        "fp16",
        dict(method="search", calibration="builtin", awq=True),
    ),
    (
        "search b64 asym fp16 awq budget 4.6",
        "fp16",
        dict(
            method="search",
            symmetric=False,
            block_size=64,
            calibration="builtin",
            awq=True,
            bits_budget=4.6,
        ),
    ),
    (
        "search b32 sym fp16 awq budget 4.6",
        "fp16",
        dict(method="search", calibration="builtin", awq=True, bits_budget=4.6),
    ),
    # part Q4: q4m with and without its data-free importance (importance="norms")
    ("q4m fp16", "fp16", dict(recipe="q4m", **recipe_settings("q4m"))),
    (
        "q4m fp16 no importance",
        "fp16",
        dict(recipe="q4m", **{**recipe_settings("q4m"), "importance": ""}),
    ),
    (
        "search b64 asym fp16 norms",
        "fp16",
        dict(method="search", symmetric=False, block_size=64, importance="norms"),
    ),
    ("search b32 sym fp16 norms", "fp16", dict(method="search", importance="norms")),
    (
        "search b32 sym fp16 norms budget 4.6",
        "fp16",
        dict(method="search", importance="norms", bits_budget=4.6),
    ),
    (
        "search b32 asym fp16 norms",
        "fp16",
        dict(method="search", symmetric=False, importance="norms"),
    ),
    # GPTQ (--method gptq, part Q3): error feedback along K from the calibration's X^T X
    (
        "gptq b64 asym fp16 budget 4.6",
        "fp16",
        dict(method="gptq", symmetric=False, block_size=64, calibration="builtin", bits_budget=4.6),
    ),
    (
        "gptq b64 asym fp16 awq budget 4.6",
        "fp16",
        dict(
            method="gptq",
            symmetric=False,
            block_size=64,
            calibration="builtin",
            awq=True,
            bits_budget=4.6,
        ),
    ),
    (
        "gptq b32 sym fp16 budget 4.6",
        "fp16",
        dict(method="gptq", calibration="builtin", bits_budget=4.6),
    ),
    (
        "gptq b32 sym fp16 awq budget 4.6",
        "fp16",
        dict(method="gptq", calibration="builtin", awq=True, bits_budget=4.6),
    ),
    (
        "gptq b128 asym fp16 budget 4.6",
        "fp16",
        dict(
            method="gptq", symmetric=False, block_size=128, calibration="builtin", bits_budget=4.6
        ),
    ),
]


def cost(report: object) -> str:
    """Where a calibrated recipe's time went: the whole calibration, ONNX Runtime's runs in it,
    the GPTQ factors, and the quantization pass."""
    rec = getattr(report, "recipe", None)
    if rec is None or rec.calibration is None:
        return ""
    cal = rec.calibration
    parts = [f"calibration {cal.seconds:.1f} s (ORT runs {cal.forward_seconds:.1f} s)"]
    if cal.sampling_seconds:
        parts.append(f"of which sampling its text {cal.sampling_seconds:.1f} s")
    if rec.gptq is not None:
        parts.append(f"factors {rec.gptq.seconds:.1f} s ({rec.gptq.bytes / 2**20:.0f} MiB)")
    parts.append(f"recipe {rec.seconds:.1f} s")
    for p in getattr(report, "passes", []):
        if p.name == "quantize_weights":
            parts.append(f"pass {p.seconds:.1f} s")
    return "; ".join(parts)


def bits_per_weight(path: Path) -> tuple[float, int]:
    """Average bits per weight of the MatMulNBits weights (B, scales, zero points as stored),
    and how many are int8."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    inits = {i.name: i for i in m.graph.initializer}

    def nbytes(name: str) -> int:
        return numpy_helper.to_array(inits[name]).nbytes if name in inits else 0

    bits = weights = int8 = 0
    for n in m.graph.node:
        if n.op_type != "MatMulNBits":
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        k, nn = a["K"], a["N"]
        weights += k * nn
        int8 += a["bits"] == 8
        bits += 8 * sum(nbytes(x) for x in list(n.input)[1:4] if x)
    return bits / weights, int8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="/tmp/qsearch-smollm2/fp32/model.onnx")
    ap.add_argument("--hf", default="/work/cache/smollm2")
    ap.add_argument("--work", default="/tmp/q1-recipes")
    ap.add_argument("--only", action="append", default=[], help="recipes whose name has this")
    ap.add_argument("--name", action="append", default=[], help="recipes of exactly this name")
    ap.add_argument("--json", help="append rows as JSON lines here")
    args = ap.parse_args()
    import fastopt
    from transformers import AutoTokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    srcs = {"fp32": Path(args.src), "fp16": work / "fp16" / "model.onnx"}
    if not srcs["fp16"].exists():
        srcs["fp16"].parent.mkdir(exist_ok=True)
        fastopt.quantize(args.src, srcs["fp16"], mode="fp16", run_check=False)
    tok = AutoTokenizer.from_pretrained(args.hf)
    ids = np.array([tok(PROSE)["input_ids"]], dtype=np.int64)
    ref = logits_of(srcs["fp32"], ids)
    base = metrics(ref, ref, ids)
    print(f"{ids.shape[1]} tokens; fp32 perplexity {base['ppl']:.3f}", flush=True)
    print("| recipe | bits/weight | int8 | KL | perplexity | top-1 | quantize s |")
    print("|---|---|---|---|---|---|---|")
    for name, src, kw in RECIPES:
        if (args.only or args.name) and not (
            any(o in name for o in args.only) or name in args.name
        ):
            continue
        out = work / name.replace(" ", "_") / "model.onnx"
        out.parent.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        try:
            rep = fastopt.quantize(
                srcs[src], out, mode="int4", run_check=False, hf_config=args.hf, **kw
            )
        except Exception as e:  # a recipe that fails is a row saying so
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:100]} |", flush=True)
            continue
        dt = time.perf_counter() - t0
        bpw, n8 = bits_per_weight(out)
        got = logits_of(out, ids).astype(np.float32)
        m = metrics(ref, got, ids)
        rise = 100 * (m["ppl"] / base["ppl"] - 1)
        print(
            f"| {name} | {bpw:.3f} | {n8} | {m['kl']:.4f} | {m['ppl']:.2f} ({rise:+.1f} %)"
            f" | {m['top1']:.3f} | {dt:.1f} |",
            flush=True,
        )
        if where := cost(rep):
            print(f"    ({name}: {where})", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                row = dict(
                    name=name, bpw=bpw, int8=n8, seconds=dt, **m, kw=kw, src=src, cost=cost(rep)
                )
                f.write(json.dumps(row) + "\n")
        for f in out.parent.iterdir():
            f.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
