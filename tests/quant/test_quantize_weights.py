"""quantize_weights (weight-only int4/int8): bytes equal to onnxruntime's quantizer per setting,
the outputs run in ONNX Runtime within the quantization accuracy criteria, selection and
reporting (excluded names, lm_head, embeddings, non-constant weights), odd K, refusals, CLI."""

from __future__ import annotations

import itertools
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.cli.main import main
from onnx import TensorProto, helper, numpy_helper
from support.paths import TESTS
from support.quant_models import _matmul_model
from support.quant_reference import ort_quantize

FIXTURES = TESTS / "fixtures" / "models"
SETTINGS = list(itertools.product((4, 8), (16, 32, 64, 128, 256), (True, False)))


def _check_bytes(src: Path | str, report: fastopt.QuantizeReport, bits: int, bs: int, sym: bool):
    weights = {t.name: t.numpy() for t in fastopt.load(str(src)).graph.initializers}
    assert report.model is not None
    checked = 0
    for node in report.model.graph.nodes:
        if node.op_type != "MatMulNBits":
            continue
        name = node.inputs[1].name.removesuffix(f"_Q{bits}")
        ref_b, ref_s, ref_z = ort_quantize(np.ascontiguousarray(weights[name]), bits, bs, sym)
        got_b = node.inputs[1].initializer.numpy()
        got_s = node.inputs[2].initializer.numpy()
        assert got_b.shape == ref_b.shape and np.array_equal(got_b, ref_b), name
        assert got_s.dtype == ref_s.dtype and got_s.shape == ref_s.shape, name
        assert np.array_equal(got_s.view(np.uint8), ref_s.view(np.uint8)), name
        if sym:
            assert len(node.inputs) == 3 or node.inputs[3] is None  # no zero points
        else:
            got_z = node.inputs[3].initializer.numpy()
            assert ref_z is not None and np.array_equal(got_z, ref_z), name
        checked += 1
    return checked


@pytest.mark.parametrize("fixture", ["qwen2_ts_float32", "llama_dynamo_float16"])
def test_bytes_equal_onnxruntime_every_setting(fixture: str) -> None:
    src = FIXTURES / fixture / "model.onnx"
    for bits, bs, sym in SETTINGS:
        r = fastopt.quantize(src, mode=f"int{bits}", block_size=bs, symmetric=sym, method="rtn")
        assert _check_bytes(src, r, bits, bs, sym) == r.summary.quantized > 0


@pytest.mark.parametrize("k", [19, 33, 100, 257])
def test_odd_k_pads_like_onnxruntime(tmp_path: Path, k: int) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_matmul_model(k, 24), src)
    for bits, bs, sym in [
        (4, 16, True),
        (4, 16, False),
        (4, 32, True),
        (8, 16, False),
        (8, 64, True),
    ]:
        r = fastopt.quantize(src, mode=f"int{bits}", block_size=bs, symmetric=sym, method="rtn")
        assert _check_bytes(src, r, bits, bs, sym) == 1


def test_bias_folded_and_runs(tmp_path: Path) -> None:
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(_matmul_model(64, 48), src)
    r = fastopt.quantize(src, out, mode="int8")
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops == ["MatMulNBits"]  # the bias Add went into MatMulNBits' bias input
    node = onnx.load(out).graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"K": 64, "N": 48, "bits": 8, "block_size": 32, "accuracy_level": 4}
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    want = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out)).run(None, {"x": x})[0]
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    w = r.weights[0]
    assert (w.action, w.dtype_before, w.dtype_after, w.op) == (
        "quantized",
        "float",
        "int8",
        "MatMulNBits",
    )
    assert w.bytes_before == 64 * 48 * 4 and w.bytes_after == 48 * 2 * 32 + 48 * 2 * 4
    assert 0 < w.max_rel_error < 0.01 and 0 < w.mean_rel_error < 0.01


def test_accuracy_level_zero_with_cuda_option(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    onnx.save(_matmul_model(64, 32), src)
    r = fastopt.quantize(src, mode="int4", options={"cuda": 1})
    assert r.model is not None
    node = next(n for n in r.model.graph.nodes if n.op_type == "MatMulNBits")
    assert "accuracy_level" not in node.attributes  # ORT's tool omits 0


DECODERS = ["qwen2_ts_float32", "llama_dynamo_float16", "phi3_ts_float16", "gemma_dynamo_float32"]


@pytest.mark.parametrize("fixture", DECODERS)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_decoder_runs_within_accuracy_criteria(tmp_path: Path, fixture: str, mode: str) -> None:
    out = tmp_path / "q.onnx"
    r = fastopt.quantize(FIXTURES / fixture / "model.onnx", out, mode=mode, verify=True)
    assert r.verify is not None and r.verify.ok, str(r.verify)
    q = r.quantized
    assert q and sum(w.bytes_after for w in q) < 0.6 * sum(w.bytes_before for w in q)
    onnx.checker.check_model(str(out))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_target_onnx_blocked_dequantize_linear(tmp_path: Path, bits: int, sym: bool) -> None:
    src = FIXTURES / "llama_ts_float32" / "model.onnx"
    out = tmp_path / "q.onnx"
    r = fastopt.quantize(src, out, mode=f"int{bits}", symmetric=sym, target="onnx", verify=True)
    assert r.verify is not None and r.verify.ok, str(r.verify)
    m = onnx.load(out)
    assert max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) >= 21
    dq = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == r.summary.quantized > 0
    assert not any(n.domain == "com.microsoft" for n in m.graph.node)
    inits = {t.name: t for t in m.graph.initializer}
    want = {(4, True): TensorProto.INT4, (4, False): TensorProto.UINT4}.get(
        (bits, sym), TensorProto.INT8 if sym else TensorProto.UINT8
    )
    assert inits[dq[0].input[0]].data_type == want
    # Same values as the MatMulNBits form: DQ(q) == dequantized MatMulNBits weight.
    ref = fastopt.quantize(src, mode=f"int{bits}", symmetric=sym)
    assert ref.model is not None
    node = next(n for n in ref.model.graph.nodes if n.op_type == "MatMulNBits")
    name = node.inputs[1].name.removesuffix(f"_Q{bits}")
    dq0 = next(n for n in dq if n.input[0] == name + f"_DQ_Q{bits}")
    sess_in = helper.make_graph(
        [dq0],
        "dq",
        [],
        [helper.make_tensor_value_info(dq0.output[0], 1, None)],
        [inits[i] for i in dq0.input],
    )
    got = ort.InferenceSession(
        helper.make_model(sess_in, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    ).run(None, {})[0]
    b = node.inputs[1].initializer.numpy()  # [N, k_blocks, blob]
    s = node.inputs[2].initializer.numpy().astype(np.float32)
    codes = (
        b.reshape(b.shape[0], -1)
        if bits == 8
        else np.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)
    )
    zp = np.full(s.shape, 2 ** (bits - 1), np.float32)
    if not sym:
        z = node.inputs[3].initializer.numpy()
        zp = (z if bits == 8 else np.stack([z & 15, z >> 4], -1).reshape(z.shape[0], -1))[
            :, : s.shape[1]
        ]
    bs = 32
    deq = (
        codes[:, : got.shape[0]].astype(np.float32) - np.repeat(zp, bs, 1)[:, : got.shape[0]]
    ) * np.repeat(s, bs, 1)[:, : got.shape[0]]
    assert np.array_equal(got, deq.T)


def test_selection_report(tmp_path: Path) -> None:
    src = FIXTURES / "qwen2_ts_float32" / "model.onnx"
    r = fastopt.quantize(src, mode="int4", exclude=["*mlp/down_proj*"], lm_head="keep")
    by_reason: dict[str, list[fastopt.WeightQuantization]] = {}
    for w in r.kept:
        by_reason.setdefault(w.reason, []).append(w)
    assert [w.node for w in by_reason["excluded by '*mlp/down_proj*'"]] == [
        "/m/model/layers.0/mlp/down_proj/MatMul",
        "/m/model/layers.1/mlp/down_proj/MatMul",
    ]
    assert [w.node for w in by_reason["lm_head (lm_head=keep)"]] == ["/m/lm_head/MatMul"]
    assert len(by_reason["embedding table (embeddings=keep)"]) == 1
    assert len(by_reason["weight is not a constant initializer"]) == 4  # attention's Q.K, P.V
    assert r.model is not None
    ops = r.model.op_counts()
    assert ops["com.microsoft::MatMulNBits"] == r.summary.quantized == 12
    assert ops["MatMul"] == 4 + 2 + 1
    # lm_head in int8 while the rest is int4
    r8 = fastopt.quantize(src, mode="int4", lm_head="int8")
    head = next(w for w in r8.weights if w.node == "/m/lm_head/MatMul")
    assert head.dtype_after == "int8"
    assert {w.dtype_after for w in r8.quantized} == {"int4", "int8"}


def test_shared_weight_quantized_once(tmp_path: Path) -> None:
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32), "w"
    )
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["a"]),
            helper.make_node("MatMul", ["a2", "w"], ["b"]),
            helper.make_node("Identity", ["x"], ["a2"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", 1, [2, 32])],
        [
            helper.make_tensor_value_info("a", 1, [2, 16]),
            helper.make_tensor_value_info("b", 1, [2, 16]),
        ],
        [w],
    )
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    r = fastopt.quantize(src, out, mode="int4")
    m = onnx.load(out)
    assert [t.name for t in m.graph.initializer] == ["w_Q4", "w_scales"]
    assert len(r.quantized) == 1
    x = np.ones((2, 32), np.float32)
    ort.InferenceSession(str(out)).run(None, {"x": x})


def test_kept_weights_and_bad_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w3 = numpy_helper.from_array(rng.standard_normal((1, 8, 4)).astype(np.float32), "w3")
    wi = numpy_helper.from_array(rng.integers(0, 3, (8, 4)).astype(np.int32), "wi")
    wn = rng.standard_normal((8, 4)).astype(np.float32)
    wn[3, 1] = np.nan
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w3"], ["a"], name="rank3"),
            helper.make_node("MatMul", ["xi", "wi"], ["b"], name="ints"),
            helper.make_node("MatMul", ["x2", "wn"], ["c"], name="nan"),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", 1, [2, 8]),
            helper.make_tensor_value_info("xi", 6, [2, 8]),
            helper.make_tensor_value_info("x2", 1, [2, 8]),
        ],
        [helper.make_tensor_value_info(n, t, None) for n, t in (("a", 1), ("b", 6), ("c", 1))],
        [w3, wi, numpy_helper.from_array(wn, "wn")],
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    r = fastopt.quantize(src, mode="int4", block_size=16)
    reasons = {w.node: w.reason for w in r.weights}
    assert reasons == {
        "rank3": "weight is not 2-D (rank 3)",
        "ints": "weight type int32 (only float32, float16 and bfloat16 are quantized)",
        "nan": "weight holds NaN or infinite values",
    }
    assert r.model is not None and r.model.op_counts() == {"MatMul": 3}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 48}, "block size must be a power of two in 16..256"),
        ({"block_size": 512}, "block size must be a power of two in 16..256"),
        ({"accuracy_level": 7}, "accuracy level must be 0"),
        ({"lm_head": "int2"}, "lm_head must be keep, int4 or int8"),
        ({"embeddings": "int2"}, "embeddings must be keep, int4 or int8"),
        ({"per_channel": True}, "per_channel applies to int8-dynamic"),
        ({"mode": "int3"}, "unknown quantization mode"),
    ],
)
def test_refusals(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    src = FIXTURES / "qwen2_ts_float32" / "model.onnx"
    args: dict[str, object] = {"mode": "int4", **kwargs}
    with pytest.raises(fastopt.ModelError, match=message):
        fastopt.quantize(src, tmp_path / "q.onnx", **args)  # type: ignore[arg-type]
    assert not (tmp_path / "q.onnx").exists()


def test_pass_option_checked_in_cpp() -> None:
    m = fastopt.load(str(FIXTURES / "qwen2_ts_float32" / "model.onnx"))
    with pytest.raises(fastopt.ModelError, match="quant_bits must be 4"):
        fastopt.optimize(m, passes=["quantize_weights"], options={"quant_bits": 3})
    # the C++ pass checks too, when called without the Python layer
    with pytest.raises(fastopt.ModelError, match="block size must be a power of two"):
        fastopt._C.run_pass(m, "quantize_weights", "ort", 10, "", {"quant_block_size": 48})


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(FIXTURES / "llama_ts_float32" / "model.onnx")
    out = str(tmp_path / "q.onnx")
    assert (
        main(
            [
                "quantize",
                src,
                "-o",
                out,
                "--mode",
                "int8",
                "--verify",
                "--exclude",
                "*lm_head*",
                "--report",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "quantization accuracy (int8" in text and "excluded by" in text
    assert main(["quantize", src, "-o", out, "--mode", "int4", "--block-size", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: block size must be") and err.count("\n") == 1
    assert main(["quantize", src, "-o", src, "--mode", "int4"]) == 2
    assert (
        main(["optimize", src, "-o", out, "--preset", "llm", "--quantize", "int4", "--asymmetric"])
        == 0
    )
    m = onnx.load(out)
    assert sum(n.op_type == "MatMulNBits" for n in m.graph.node) > 0
    capsys.readouterr()
    # optimize --verify with --quantize uses the quantization criteria (a cache added too)
    args = ["optimize", src, "-o", out, "--preset", "llm", "--kv-cache", "standard"]
    assert main([*args, "--quantize", "int8", "--verify"]) == 0
    assert "quantization accuracy (int8" in capsys.readouterr().out


def test_same_logits_as_matmul_nbits_quantizer(tmp_path: Path) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    src = FIXTURES / "llama_ts_float32" / "model.onnx"
    q = MatMulNBitsQuantizer(onnx.load(src), block_size=32, is_symmetric=True, accuracy_level=4)
    q.process()
    theirs, ours = tmp_path / "ort.onnx", tmp_path / "fastopt.onnx"
    q.model.save_model_to_file(str(theirs))
    fastopt.quantize(src, ours, mode="int4", method="rtn")
    feeds = fastopt.make_inputs(str(src), {"sequence_length": 8})
    want = ort.InferenceSession(str(theirs)).run(None, feeds)
    got = ort.InferenceSession(str(ours)).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))
    t_inits = {t.name: t for t in onnx.load(theirs).graph.initializer}
    for t in onnx.load(ours).graph.initializer:
        if t.name.endswith(("_Q4", "_scales")):
            assert t.raw_data == t_inits[t.name].raw_data and t.dims == t_inits[t.name].dims


def test_bfloat16_weights_like_onnxruntime(tmp_path: Path) -> None:
    """onnxruntime quantizes bf16 weights as fp32 and casts the scales to bf16 afterwards."""
    import ml_dtypes

    w32 = (np.random.default_rng(3).standard_normal((80, 24)) * 0.05).astype(np.float32)
    w = w32.astype(ml_dtypes.bfloat16)
    t = helper.make_tensor(
        "w", TensorProto.BFLOAT16, w.shape, w.view(np.uint16).tobytes(), raw=True
    )
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 80])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 24])],
        [t],
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    for bits, sym in [(4, True), (4, False), (8, True)]:
        r = fastopt.quantize(src, mode=f"int{bits}", block_size=16, symmetric=sym, method="rtn")
        assert r.model is not None
        node = next(n for n in r.model.graph.nodes if n.op_type == "MatMulNBits")
        ref_b, ref_s, ref_z = ort_quantize(w.astype(np.float32), bits, 16, sym)
        assert np.array_equal(node.inputs[1].initializer.numpy(), ref_b)
        got_s = node.inputs[2].initializer
        assert got_s.dtype == TensorProto.BFLOAT16
        assert np.array_equal(
            got_s.numpy().view(np.uint16).ravel(),
            ref_s.astype(ml_dtypes.bfloat16).view(np.uint16).ravel(),
        )
        if not sym:
            assert ref_z is not None and np.array_equal(node.inputs[3].initializer.numpy(), ref_z)


def test_thread_count_does_not_change_bytes() -> None:
    src = FIXTURES / "qwen2_ts_float32" / "model.onnx"
    outs = []
    for threads in (1, 3):
        r = fastopt.quantize(src, mode="int4", symmetric=False, threads=threads)
        assert r.model is not None
        outs.append(
            {
                t.name: bytes(t.numpy().data)
                for t in r.model.graph.initializers
                if t.name.endswith(("_Q4", "_scales", "_zero_points"))
            }
        )
    assert outs[0] == outs[1] and len(outs[0]) == 3 * 15
