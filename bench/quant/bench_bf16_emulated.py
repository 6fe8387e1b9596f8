#!/usr/bin/env python3
"""bf16 accuracy measured on ONNX Runtime's CPU provider, which has no bfloat16 compute kernels:
the fp32 model with every value that fastopt's bf16 output holds in bfloat16 rounded to it
(a Cast to bfloat16 and back after its producer; weights rounded likewise), compute in float32,
as GPU kernels accumulate. Logits against fp32 on held-out prose (fastopt/verify/prose.txt).

python bench/quant/bench_bf16_emulated.py MODEL.onnx TOKENIZER_DIR OUT_DIR
    two variants: "angles float32" (fastopt's bf16 output as it is: fastopt.quant.angles keeps
    the ops computing Sin/Cos angles float32) and "angles bf16" (those ops' outputs and the
    weights they read rounded too: the conversion before the rule).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _bf16(a: Any) -> Any:
    import numpy as np

    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def _bf16_values(path: Path) -> set[str]:
    import onnx
    from onnx import TensorProto

    model = onnx.load(str(path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model)
    return {
        v.name
        for v in [*inferred.graph.value_info, *inferred.graph.output]
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16
    }


def _emulated(src: Path, rounded: set[str], weights: set[str] | None) -> Any:
    """The fp32 model with ``rounded`` values rounded to bf16 after their producers, and its
    float32 weights (those in ``weights``; every one when None) rounded."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    g = model.graph
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT and (weights is None or t.name in weights):
            t.CopyFrom(numpy_helper.from_array(_bf16(numpy_helper.to_array(t)), t.name))
    outputs = {o.name for o in g.output}
    nodes, renamed = [], {}
    for n in g.node:
        for i, x in enumerate(n.input):
            n.input[i] = renamed.get(x, x)
        if n.op_type == "Constant" and n.output[0] in rounded:
            n.attribute[0].t.CopyFrom(
                numpy_helper.from_array(_bf16(numpy_helper.to_array(n.attribute[0].t)))
            )
        nodes.append(n)
        for o in n.output:
            if o in rounded and o not in outputs and n.op_type != "Constant":
                nodes.append(helper.make_node("Cast", [o], [o + "/bf"], to=TensorProto.BFLOAT16))
                nodes.append(
                    helper.make_node("Cast", [o + "/bf"], [o + "/r"], to=TensorProto.FLOAT)
                )
                renamed[o] = o + "/r"
    del g.node[:]
    g.node.extend(nodes)
    return model


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__)
        return 2
    import fastopt
    import numpy as np
    import onnxruntime as ort
    import tokenizers
    from fastopt.verify.real_text import __file__ as real_text

    src, tokenizer_dir, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    dst = out / "bf16" / "model.onnx"
    report = fastopt.quantize(src, dst, mode="bf16", run_check=False)
    angles = report.range_check.kept if report.range_check else []
    bf16 = _bf16_values(dst)
    prose = (Path(real_text).parent / "prose.txt").read_text("utf-8")
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = np.array([tok.encode(prose).ids], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def log_probs(model: Any) -> Any:
        data = model if isinstance(model, str) else model.SerializeToString()
        sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        x = np.asarray(sess.run(["logits"], feeds)[0], np.float64)[0]
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    ref = log_probs(str(src))
    angle_values = {k.output for k in angles}
    # the weights the angle ops read (kept float32 by the pass with them)
    kept_weights = {t.name for t in fastopt.load(dst).graph.initializers if t.dtype == 1}
    for name, rounded, weights in (
        ("angles float32", bf16, {w for w in _all_weights(src) if w not in kept_weights}),
        ("angles bf16", bf16 | angle_values | _angle_constants(src, angle_values), None),
    ):
        got = log_probs(_emulated(src, rounded, weights))
        p = np.exp(ref)
        print(
            json.dumps(
                {
                    "variant": name,
                    "tokens": int(ids.shape[1]),
                    "angle_ops": [k.node for k in angles],
                    "kl": round(float((p * (ref - got)).sum(-1).mean()), 6),
                    "top1": round(float((ref.argmax(-1) == got.argmax(-1)).mean()), 4),
                }
            )
        )
    return 0


def _all_weights(src: Path) -> set[str]:
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    return {t.name for t in model.graph.initializer}


def _angle_constants(src: Path, angle_values: set[str]) -> set[str]:
    """Outputs of the Constant nodes the angle ops read (rounded with them before the rule)."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    constants = {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    return {
        x
        for n in model.graph.node
        if n.output and n.output[0] in angle_values
        for x in n.input
        if x in constants
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
