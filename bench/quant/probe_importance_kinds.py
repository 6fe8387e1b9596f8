"""Which weights' data-free importance costs q4m the most KL? ``--recipe q4m`` with the
``--importance norms`` estimate, and with one kind of weight (q/k/v, o, gate/up, down, lm_head)
at a time given calibration's measured importance instead (the budget and the search both read
it, as the recipe does). The kind whose measured vector closes most of the gap is where the
estimate is worst: on SmolLM2 the MLP down projections (bench/results/quantize_accuracy.md,
"Super rows").

    fastopt quantize FP16 -o /tmp/x.onnx --mode int4 --recipe q4m --calibration builtin \\
        --method search --hf-config /work/cache/smollm2 --save-importance MEASURED.onnx
    nice python bench/quant/probe_importance_kinds.py FP32 FP16 MEASURED.onnx \
        [--text python/fastopt/verify/prose.txt] [--only none]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).parent))

KINDS = {
    "q/k/v": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate/up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
    "lm_head": ("lm_head",),
}


def main() -> None:
    import fastopt
    import fastopt.quant.recipe as recipe
    from bench_quantize_accuracy import PROSE, logits_of, metrics
    from fastopt.quant.norm_importance import norm_importance
    from tokenizers import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fp32", type=Path, help="the float32 reference")
    ap.add_argument("fp16", type=Path, help="the model quantized (its fp16 conversion)")
    ap.add_argument("measured", type=Path, help="calibration's importance (--save-importance)")
    ap.add_argument("--tokenizer", default="/work/cache/smollm2/tokenizer.json")
    ap.add_argument("--text", type=Path, help="score on this text (default: the bench's prose)")
    ap.add_argument("--only", action="append", default=[], help="rows of this name")
    args = ap.parse_args()
    text = args.text.read_text() if args.text else PROSE
    ids = np.array([Tokenizer.from_file(args.tokenizer).encode(text).ids], np.int64)
    measured = {
        t.name: numpy_helper.to_array(t).astype(np.float32)
        for t in onnx.load(str(args.measured)).graph.initializer
    }
    graph = onnx.load(str(args.fp16), load_external_data=False).graph
    node_of = {n.input[1]: n.name for n in graph.node if n.op_type == "MatMul"}
    estimate = norm_importance(fastopt.load(args.fp16))
    ref = logits_of(args.fp32, ids)
    rows = [("none", ()), *KINDS.items(), ("all", ("",))]
    rows = [r for r in rows if not args.only or r[0] in args.only]
    with tempfile.TemporaryDirectory() as tmp:
        for name, parts in rows:
            imp = dict(estimate)
            for weight, vector in measured.items():
                if any(p in node_of.get(weight, weight) for p in parts):
                    imp[weight] = vector
            # the recipe's importance step, answered with this mix
            recipe.norm_importance = lambda model, keep=None, imp=imp: imp  # type: ignore[misc]
            out = Path(tmp) / "q.onnx"
            fastopt.quantize(args.fp16, out, mode="int4", recipe="q4m", run_check=False)
            m = metrics(ref, logits_of(out, ids), ids)
            print(f"measured {name}: KL {m['kl']:.4f}  ppl {m['ppl']:.2f}  top-1 {m['top1']:.3f}")


if __name__ == "__main__":
    main()
