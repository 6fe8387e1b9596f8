"""bf16 keeps the ops computing Sin/Cos angles float32 (fastopt.quant.angles): a rotary
embedding's angle is position x frequency, and bfloat16 spaces values 2 apart from 256 to 512, so
in bf16 the angle of position 500 is off by up to a radian (SmolLM2: KL 0.114 against fp32 on 488
tokens, 0.00074 with the angles float32; bench/results/fp16_ranges.md)."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from support.llm_fixtures import fixtures

LLAMA = fixtures(arch="llama", exporter="ts", dtype="float32")[0]


def _rope_model(path: Path) -> None:
    """positions (int64) -> Cast -> Mul(inv_freq) -> Concat -> Sin / Cos: a rotary table."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["pos"], ["pos_f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pos_f", "axis"], ["pos_col"], name="unsqueeze"),
        helper.make_node("Mul", ["pos_col", "inv_freq"], ["freqs"], name="mul"),
        helper.make_node("Concat", ["freqs", "freqs"], ["angles"], name="concat", axis=-1),
        helper.make_node("Sin", ["angles"], ["sin"], name="sin"),
        helper.make_node("Cos", ["angles"], ["cos"], name="cos"),
    ]
    graph = helper.make_graph(
        nodes,
        "rope",
        [helper.make_tensor_value_info("pos", TensorProto.INT64, ["n"])],
        [
            helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["n", 8]),
            helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["n", 8]),
        ],
        [
            numpy_helper.from_array(inv_freq[None], "inv_freq"),
            numpy_helper.from_array(np.array([1], np.int64), "axis"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))


def test_bf16_rotary_angles_stay_float32(tmp_path: Path) -> None:
    src, out = tmp_path / "rope.onnx", tmp_path / "bf16.onnx"
    _rope_model(src)
    r = fastopt.quantize(src, out, mode="bf16", keep_io_types=True)
    check = r.range_check
    assert check is not None and not check.measured and check.angles == 4
    assert [k.node for k in check.kept] == ["cast", "unsqueeze", "mul", "concat"]
    assert check.summary().startswith("4 ops computing Sin/Cos angles")
    assert r.passes[-1].counters["nodes_kept_range"] == 4
    # What runs: the angles in float32, exact to float32 rounding at positions up to 511 (in
    # bfloat16, position 501 alone would read 500 or 502).
    pos = np.arange(512, dtype=np.int64)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    sin, cos = sess.run(["sin", "cos"], {"pos": pos})
    inv_freq = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)
    angles = np.concatenate([pos[:, None] * inv_freq] * 2, axis=-1)
    # outputs in [-1, 1] through bfloat16 Casts at the boundary: 2^-8 at most
    assert np.abs(sin - np.sin(angles)).max() <= 2**-8
    assert np.abs(cos - np.cos(angles)).max() <= 2**-8


def test_bf16_real_export_keeps_the_rotary_chain(tmp_path: Path) -> None:
    out = tmp_path / "bf16.onnx"
    r = fastopt.quantize(LLAMA.path, out, mode="bf16", run_check=False)
    check = r.range_check
    assert check is not None and check.angles >= 3
    kept = {k.op for k in check.kept}
    assert {"Cast", "Mul"} <= kept or {"Cast", "MatMul"} <= kept, kept
    model = onnx.load(str(out))
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    for k in check.kept:
        assert types.get(k.output, TensorProto.FLOAT) == TensorProto.FLOAT, k
    # The rest is bfloat16: the layers' MatMuls compute in it.
    matmuls = [n.output[0] for n in model.graph.node if n.op_type == "MatMul"]
    assert sum(types.get(m) == TensorProto.BFLOAT16 for m in matmuls) > len(matmuls) // 2


def test_fp16_does_not_apply_the_angle_rule(tmp_path: Path) -> None:
    r = fastopt.quantize(LLAMA.path, tmp_path / "fp16.onnx", mode="fp16")
    assert r.range_check is not None and r.range_check.angles == 0
