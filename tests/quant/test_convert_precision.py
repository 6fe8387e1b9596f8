"""fp16 / bf16 (convert_precision pass): weight bytes as numpy / ml_dtypes convert them, fp16
decoders (plain exports and --preset llm outputs with fused ops) run in ONNX Runtime CPU and
agree with the fp32 original, keep_io_types, fp32 islands, clamping, exclusions, refusals.

bf16: ONNX Runtime 1.32's CPU provider has no bfloat16 kernels for Add, Mul, MatMul and the
other compute ops (tests/ort_behaviour/test_bf16_cpu_kernels.py), so a bf16 decoder cannot run
there; its bytes and onnx.checker are tested, and a graph of the ops that do run in bf16 on CPU
(Gather, the norms, data movement) is run."""

from __future__ import annotations

from pathlib import Path

import fastopt
import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.llm_fixtures import Fixture, feeds, fixtures
from support.paths import TESTS

DECODERS = fixtures(dtype="float32", decoder=True)
LLAMA = fixtures(arch="llama", exporter="ts", dtype="float32")[0]
CNN = TESTS / "fixtures" / "cnn" / "model.onnx"


def _session(path: Path | str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _logits_agree(fx: Fixture, ref_path: Path, out: Path, min_cos: float = 0.999) -> None:
    inputs = feeds(fx)
    ref = _session(ref_path).run(None, inputs)[0].astype(np.float64)
    got = _session(out).run(None, inputs)[0].astype(np.float64)
    mask = inputs["attention_mask"].astype(bool)
    a, b = ref[mask], got[mask]
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    assert cos.min() >= min_cos and top1 >= 0.9, (cos.min(), top1)


def _io_types(path: Path) -> tuple[list[int], list[int]]:
    g = onnx.load(str(path)).graph
    return [v.type.tensor_type.elem_type for v in g.input], [
        v.type.tensor_type.elem_type for v in g.output
    ]


@pytest.mark.parametrize("fx", DECODERS, ids=lambda f: f.name)
def test_fp16_decoders_run_and_agree(fx: Fixture, tmp_path: Path) -> None:
    out = tmp_path / "fp16.onnx"
    r = fastopt.quantize(fx.path, out, mode="fp16")
    assert r.summary.quantized > 0
    # gemma3's and gemma2's norms multiply their weight inside the fp32 island the exporter writes
    # between Cast(to=FLOAT)s: those weights stay fp32 on purpose; any other kept is a defect.
    kept = {k.reason for k in r.kept}
    islands = fx.arch in ("gemma3", "gemma2")
    assert kept <= ({"read by float32 ops only"} if islands else set()), r.kept
    outputs = _io_types(out)[1]
    assert outputs == [TensorProto.FLOAT16] * len(outputs)
    inits = onnx.load(str(out)).graph.initializer
    assert {t.name for t in inits if t.data_type == TensorProto.FLOAT} <= {k.weight for k in r.kept}
    onnx.checker.check_model(str(out))
    _logits_agree(fx, fx.path, out)


@pytest.mark.parametrize("fx", fixtures(arch=["llama", "qwen2", "gpt2"], dtype="float32"))
def test_fp16_after_llm_preset(fx: Fixture, tmp_path: Path) -> None:
    fused = tmp_path / "fused.onnx"
    fastopt.optimize(fx.path, preset="llm", output=fused)
    out = tmp_path / "fp16.onnx"
    fastopt.quantize(fused, out, mode="fp16", keep_io_types=True)
    ops = [(n.domain, n.op_type) for n in onnx.load(str(out)).graph.node]
    fused_ops = {"GroupQueryAttention", "MultiHeadAttention", "SkipSimplifiedLayerNormalization"}
    assert fused_ops & {op for _, op in ops}
    assert _io_types(out)[1] == [TensorProto.FLOAT]
    _logits_agree(fx, fx.path, out)


def test_fp16_bytes_are_numpy_float16(tmp_path: Path) -> None:
    out = tmp_path / "fp16.onnx"
    r = fastopt.quantize(LLAMA.path, out, mode="fp16")
    src = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(LLAMA.path)).graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    checked = 0
    for w in r.quantized:
        expect = np.clip(src[w.weight], -65504, 65504).astype(np.float16)
        assert got[w.weight].dtype == np.float16
        assert got[w.weight].tobytes() == expect.tobytes(), w.weight
        assert w.bytes_after * 2 == w.bytes_before
        checked += 1
    assert checked == len(r.quantized) > 10


def test_bf16_bytes_checker_and_cpu_ops(tmp_path: Path) -> None:
    out = tmp_path / "bf16.onnx"
    r = fastopt.quantize(LLAMA.path, out, mode="bf16")
    onnx.checker.check_model(str(out), full_check=True)
    src = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(LLAMA.path)).graph.initializer}
    model = onnx.load(str(out))
    got = {t.name: t for t in model.graph.initializer}
    for w in r.quantized:
        assert got[w.weight].data_type == TensorProto.BFLOAT16
        expect = src[w.weight].astype(ml_dtypes.bfloat16).view(np.uint16)
        assert got[w.weight].raw_data == expect.tobytes(), w.weight
    # No Sin/Cos in bfloat16 before opset 22 (the schemas): those stay float32, and so do the
    # angles they read (fastopt.quant.angles), which no Cast then comes between.
    assert r.range_check is not None
    angles = {k.output for k in r.range_check.kept}
    for n in model.graph.node:
        if n.op_type in ("Sin", "Cos"):
            assert n.input[0] in angles


def test_bf16_runs_the_ops_ort_cpu_has(tmp_path: Path) -> None:
    """Gather + SimplifiedLayerNormalization + Reshape + Transpose: bf16 kernels exist on CPU."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 16)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["e"]),
            helper.make_node("SimplifiedLayerNormalization", ["e", "scale"], ["n"], axis=-1),
            helper.make_node("Reshape", ["n", "shape"], ["r"]),
            helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3]),
        ],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 5, 4])],
        [
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(scale, "scale"),
            numpy_helper.from_array(np.array([2, 5, 4, 4], np.int64), "shape"),
        ],
    )
    src = tmp_path / "small.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "bf16.onnx"
    fastopt.quantize(src, out, mode="bf16", keep_io_types=True)
    ids = rng.integers(0, 50, (2, 5)).astype(np.int64)
    ref = _session(src).run(None, {"ids": ids})[0]
    got = _session(out).run(None, {"ids": ids})[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)
    assert [n.op_type for n in onnx.load(str(out)).graph.node].count("Cast") == 1  # the output


def test_keep_io_types(tmp_path: Path) -> None:
    out = tmp_path / "fp16.onnx"
    r = fastopt.quantize(CNN, out, mode="fp16", keep_io_types=True)
    assert _io_types(out) == ([TensorProto.FLOAT], [TensorProto.FLOAT])
    casts = [n for n in onnx.load(str(out)).graph.node if n.op_type == "Cast"]
    assert len(casts) == 2 and r.passes[-1].counters["casts_inserted"] == 2
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    ref = _session(CNN).run(None, {"pixel_values": x})[0]
    got = _session(out).run(None, {"pixel_values": x})[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=0, atol=5e-3 * np.abs(ref).max())


def test_exporter_fp32_islands_are_kept(tmp_path: Path) -> None:
    """llama's RMSNorm upcasts (`x.to(torch.float32)`): the norm stays float32 between its
    Casts; the Cast after it goes to float16."""
    out = tmp_path / "fp16.onnx"
    r = fastopt.quantize(LLAMA.path, out, mode="fp16")
    assert r.passes[-1].counters["fp32_islands"] >= 2
    model = onnx.load(str(out))
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    by_name = {n.name: n for n in model.graph.node}
    up = by_name["/m/model/layers.0/input_layernorm/Cast"]
    down = by_name["/m/model/layers.0/input_layernorm/Cast_1"]
    assert up.attribute[0].i == TensorProto.FLOAT and down.attribute[0].i == TensorProto.FLOAT16
    pow_in = by_name["/m/model/layers.0/input_layernorm/Pow"].input[0]
    assert pow_in == up.output[0]
    assert types.get(pow_in, TensorProto.FLOAT) == TensorProto.FLOAT


def test_values_beyond_fp16_are_clamped_and_counted(tmp_path: Path) -> None:
    big = np.array([1e6, -3.0e38, 70000.0, 1.0], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(big, "c")],
    )
    src = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    # (the range check would keep the Add float32, its output reaching 3e38: off, to clamp)
    r = fastopt.quantize(src, tmp_path / "fp16.onnx", mode="fp16", fp16_ranges=False)
    assert r.passes[-1].counters["values_clamped"] == 3
    assert r.quantized[0].reason == "3 values clamped to the range"
    c = numpy_helper.to_array(onnx.load(str(tmp_path / "fp16.onnx")).graph.initializer[0])
    assert c.tolist() == [65504.0, -65504.0, 65504.0, 1.0]


def test_excluded_nodes_stay_fp32(tmp_path: Path) -> None:
    out = tmp_path / "fp16.onnx"
    r = fastopt.quantize(LLAMA.path, out, mode="fp16", exclude=["/m/lm_head/MatMul"])
    model = onnx.load(str(out))
    lm = next(n for n in model.graph.node if n.name == "/m/lm_head/MatMul")
    assert lm.input[0].endswith("_to_fp32")
    inits = {t.name: t.data_type for t in model.graph.initializer}
    assert inits[lm.input[1]] == TensorProto.FLOAT
    assert r.passes[-1].counters["nodes_excluded"] == 1
    assert _io_types(out)[1] == [TensorProto.FLOAT]  # the lm_head's output
    _logits_agree(LLAMA, LLAMA.path, out)


def test_int8_dynamic_then_fp16_keeps_dynamic_quantize_matmul_fp32(tmp_path: Path) -> None:
    q = tmp_path / "q.onnx"
    fastopt.quantize(LLAMA.path, q, mode="int8-dynamic")
    out = tmp_path / "fp16.onnx"
    r = fastopt.quantize(q, out, mode="fp16", keep_io_types=True)
    # 5 DynamicQuantizeMatMul, 10 MatMulIntegerToFloat and their 4 DynamicQuantizeLinear
    assert r.passes[-1].counters["nodes_kept_f32_only"] == 19
    # fp16 activations move the run-time uint8 quantization of A a little
    _logits_agree(LLAMA, q, out, min_cos=0.99)


def test_control_flow_is_refused(tmp_path: Path) -> None:
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])],
        "b",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)],
        "g",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    src = tmp_path / "if.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    with pytest.raises(fastopt.ModelError, match="control flow"):
        fastopt.quantize(src, tmp_path / "fp16.onnx", mode="fp16")
    assert not (tmp_path / "fp16.onnx").exists()


def test_local_functions_are_refused(tmp_path: Path) -> None:
    fn = helper.make_function(
        "local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
        [helper.make_opsetid("", 17)],
    )  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("Twice", ["x"], ["y"], domain="local")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(
        graph,
        functions=[fn],
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
    )
    src = tmp_path / "fn.onnx"
    onnx.save(model, str(src))
    with pytest.raises(fastopt.ModelError, match="local functions"):
        fastopt.quantize(src, tmp_path / "fp16.onnx", mode="fp16")
