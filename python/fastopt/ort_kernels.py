"""What the installed ONNX Runtime's kernels accept, found by running them once.

``DynamicQuantizeMatMul`` with per-column scales: older CPU kernels refuse them ("Per-Channel is
not supported yet"); int8-dynamic with per_channel for target ort asks this first and refuses
clearly instead of writing a model that does not load (target onnx, MatMulInteger, takes
per-column zero points on every onnxruntime that runs it).
"""

from __future__ import annotations

import functools


@functools.cache
def dynamic_quantize_matmul_per_channel() -> str | None:
    """None when DynamicQuantizeMatMul runs per-column b_scale / b_zero_point on CPU and
    computes what the dequantized weights give; otherwise why not."""
    import numpy as np
    import onnx
    import onnxruntime as ort  # type: ignore[import-untyped]
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    k, n = 16, 4
    bq = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = np.array([0.01, 0.02, 0.03, 0.04], np.float32)
    zp = np.array([0, 1, -2, 3], np.int8)
    a = rng.standard_normal((3, k)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node(
                "DynamicQuantizeMatMul", ["a", "b", "s", "z"], ["y"], domain="com.microsoft"
            )
        ],
        "probe",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        [numpy_helper.from_array(x, nm) for x, nm in ((bq, "b"), (scale, "s"), (zp, "z"))],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = min(model.ir_version, onnx.IR_VERSION, 9)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        got = s.run(None, {"a": a})[0]
    except Exception as e:  # any refusal is the answer
        return str(e).strip().splitlines()[0][:200]
    want = a @ ((bq.astype(np.float32) - zp) * scale)
    # The activation is quantized to uint8 at run time: allow that error, not a wrong column.
    if not np.allclose(got, want, rtol=0.05, atol=0.05 * float(np.abs(want).max())):
        return "it runs but its results differ from the dequantized weights'"
    return None
