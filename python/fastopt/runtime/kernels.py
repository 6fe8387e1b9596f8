"""What the installed ONNX Runtime's kernels accept on this machine, found by running them once.

- ``int8_matmul_saturates``: ORT's uint8 x int8 GEMM (MLAS, behind MatMulInteger,
  DynamicQuantizeMatMul, MatMulIntegerToFloat, ConvInteger) on x86 CPUs without VNNI adds each
  pair of products along K into an int16 with saturation (VPMADDUBSW): full-range int8 weights
  then lose the large sums. int8-dynamic with per-channel scales (whose every column reaches
  +-127) turns on 7-bit weights there by default (quant_reduce_range; fastopt.quant.checks).
- ``dynamic_quantize_matmul_per_channel``: older CPU kernels refuse per-column scales ("Per-
  Channel is not supported yet"); int8-dynamic with per_channel for target ort asks this first and
  refuses clearly instead of writing a model that does not load (target onnx, MatMulInteger,
  takes per-column zero points on every onnxruntime that runs it).

Both are cached per process; tests replace them (monkeypatch the module attribute) to take the
other branch of what depends on them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from fastopt._lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap


def saturation_probe() -> tuple[np.ndarray, np.ndarray]:
    """(A uint8 (4, 64), B int8 (64, 8)) whose every pair of products along K exceeds int16
    (2 * 200 * 100 > 32767): a saturating kernel's sums differ from the exact ones."""
    rng = np.random.default_rng(0)
    return (
        rng.integers(200, 256, (4, 64)).astype(np.uint8),
        rng.integers(100, 128, (64, 8)).astype(np.int8),
    )


@functools.cache
def int8_matmul_saturates() -> bool:
    """True when ONNX Runtime's CPU MatMulInteger (uint8 x int8 constant weights, the kernel
    the int8-dynamic ops share) does not compute the exact int32 products of saturation_probe's
    matrices; False when it does, or when it does not run at all (nothing to avoid then)."""
    import onnx
    import onnxruntime as ort  # type: ignore[import-untyped]
    from onnx import TensorProto, helper, numpy_helper

    a, b = saturation_probe()
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape))],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [a.shape[0], b.shape[1]])],
        [numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, onnx.IR_VERSION, 9)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        got = s.run(None, {"a": a})[0]
    except Exception:
        return False
    return not np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


@functools.cache
def dynamic_quantize_matmul_per_channel() -> str | None:
    """None when DynamicQuantizeMatMul runs per-column b_scale / b_zero_point on CPU and
    computes what the dequantized weights give; otherwise why not. The weights are 7-bit, so a
    kernel that saturates full-range pairs (int8_matmul_saturates) is not taken for one that
    refuses per-column scales."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    k, n = 16, 4
    bq = rng.integers(-63, 64, (k, n)).astype(np.int8)
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
