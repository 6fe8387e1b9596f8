"""Models and runs that more than one test file uses (from test_quantize_weights)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _matmul_model(k: int, n: int, dtype: int = TensorProto.FLOAT, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np_type)
    w[0, 0] = 0.3  # one outlier, so blocks differ in range
    b = rng.standard_normal(n).astype(np_type)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
            helper.make_node("Add", ["h", "b"], ["y"], name="bias"),
        ],
        "g",
        [helper.make_tensor_value_info("x", dtype, ["batch", k])],
        [helper.make_tensor_value_info("y", dtype, ["batch", n])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
