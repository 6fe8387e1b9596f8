"""A copy of a model with its int4 grid broken: each MatMul weight (K x N, K-blocks of 32, as
SmolLM2's Q4_1 GGUF stored them) gets uniform noise of +-half a Q4_1 step of its block, so no int4
grid fits it exactly (the lm_head, from Q8_0, gets the same at its own step). Recipes are then
judged on weights that did not come from a GGUF (bench/results/quantize_accuracy.md).

    python bench/quant/dither_weights.py MODEL.onnx OUT.onnx
"""

import sys

import numpy as np
import onnx
from onnx import numpy_helper


def main(src: str, out: str) -> None:
    m = onnx.load(src)
    rng = np.random.default_rng(0)
    mm_inputs = {n.input[1] for n in m.graph.node if n.op_type == "MatMul"}
    n = 0
    for i, init in enumerate(m.graph.initializer):
        if init.name not in mm_inputs or len(init.dims) != 2:
            continue
        w = numpy_helper.to_array(init).astype(np.float32)
        k, cols = w.shape
        kb = k // 32
        b = w[: kb * 32].reshape(kb, 32, cols)
        step = (b.max(1) - b.min(1)) / 15.0
        noise = rng.uniform(-0.5, 0.5, b.shape).astype(np.float32) * step[:, None, :]
        w[: kb * 32] = (b + noise).reshape(kb * 32, cols)
        m.graph.initializer[i].CopyFrom(numpy_helper.from_array(w, init.name))
        n += 1
    print("dithered", n, "weights")
    onnx.save(m, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
