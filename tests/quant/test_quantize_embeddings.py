"""Quantized embeddings (quantize_weights with embeddings int4|int8): the table's bytes are
onnxruntime's MatMulNBits bytes of its transpose (GatherBlockQuantized reads them per row), target
onnx's DequantizeLinear(axis 1) + Gather holds the same codes unpadded, ONNX Runtime gives the
dequantized rows, a tied lm_head shares one quantized tensor with the embedding, refusals keep the
table with a reason, and onnxruntime-genai generates with the quantized embeddings."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.genai.config import write_genai_config
from fastopt.quant.settings import QuantSettings
from onnx import TensorProto, helper, numpy_helper
from support import kv_generation as kg
from support.paths import TESTS
from support.quant_reference import ort_quantize

try:
    import onnxruntime_genai as og
except ImportError:  # optional: the test extra installs it
    og = None

FIXTURES = TESTS / "fixtures" / "models"


def _gather_model(table: np.ndarray, axis: int = 0, name: str = "embed") -> onnx.ModelProto:
    dtype = helper.np_dtype_to_tensor_dtype(table.dtype)
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["h"], name=name, axis=axis)],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [
            helper.make_tensor_value_info(
                "h", dtype, ["b", "s", table.shape[1]] if axis == 0 else None
            )
        ],
        [numpy_helper.from_array(table, "table")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _table(vocab: int, hidden: int, dtype: type = np.float32, seed: int = 0) -> np.ndarray:
    t = np.random.default_rng(seed).standard_normal((vocab, hidden)).astype(dtype) * 0.05
    t[3, 5] = 0.4  # an outlier: blocks differ in range
    return t


def _dequantized(table: np.ndarray, bits: int, bs: int, sym: bool) -> np.ndarray:
    """The rows onnxruntime's quantization of table^T stands for, from its own kernel."""
    b, s, z = ort_quantize(np.ascontiguousarray(table.T), bits, bs, sym)
    vocab, hidden = table.shape
    if bits == 4:
        codes = np.stack([b & 15, b >> 4], axis=-1).reshape(vocab, -1)
    else:
        codes = b.reshape(vocab, -1)
    if sym:
        zp = np.full(s.shape, 1 << (bits - 1), np.float32)
    elif bits == 4:
        zp = np.stack([z & 15, z >> 4], axis=-1).reshape(vocab, -1)[:, : s.shape[1]]
    else:
        zp = z.astype(np.float32)
    deq = (codes.astype(np.float32) - np.repeat(zp, bs, 1)) * np.repeat(s.astype(np.float32), bs, 1)
    return deq[:, :hidden]


SETTINGS = list(itertools.product((4, 8), (16, 32, 128), (True, False)))


@pytest.mark.parametrize("hidden", [64, 40])  # 40: not a block multiple, rows padded
def test_bytes_and_rows_like_onnxruntime(tmp_path: Path, hidden: int) -> None:
    table = _table(50, hidden)
    src = tmp_path / "m.onnx"
    onnx.save(_gather_model(table), src)
    ids = np.array([[0, 3, 49, 3], [7, 7, 1, 2]], np.int64)
    for bits, bs, sym in SETTINGS:
        out = tmp_path / f"q{bits}_{bs}_{sym}.onnx"
        r = fastopt.quantize(
            src,
            out,
            mode="int4",
            embeddings=f"int{bits}",
            block_size=bs,
            symmetric=sym,
            method="rtn",
        )
        [w] = r.quantized
        assert (w.weight, w.op, w.dtype_after) == (
            "table",
            "GatherBlockQuantized",
            f"{'' if sym else 'u'}int{bits}",
        )
        m = onnx.load(out)
        inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        [node] = [n for n in m.graph.node if n.op_type == "GatherBlockQuantized"]
        attrs = {a.name: a.i for a in node.attribute}
        assert attrs == {"bits": bits, "block_size": bs, "gather_axis": 0, "quantize_axis": 1}
        assert "table" not in inits  # the float table is gone
        ref_b, ref_s, ref_z = ort_quantize(np.ascontiguousarray(table.T), bits, bs, sym)
        data, scales = inits[node.input[0]], inits[node.input[2]]
        assert np.array_equal(data, ref_b.reshape(50, -1))
        assert np.array_equal(scales.view(np.uint8), ref_s.view(np.uint8))
        if sym:
            assert len(node.input) == 3
        else:
            assert np.array_equal(inits[node.input[3]], ref_z)
        padded = hidden % bs != 0
        assert [n.op_type for n in m.graph.node] == (
            ["GatherBlockQuantized", "Slice"] if padded else ["GatherBlockQuantized"]
        )
        got = ort.InferenceSession(str(out)).run(None, {"ids": ids})[0]
        want = _dequantized(table, bits, bs, sym)[ids]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        err = np.abs(got - table[ids]).max()
        assert 0 < err < (0.05 if bits == 4 else 0.004)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_target_onnx_dequantize_linear_axis_1(tmp_path: Path, bits: int, sym: bool) -> None:
    table = _table(50, 96)
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(_gather_model(table), src)
    fastopt.quantize(
        src,
        out,
        mode="int4",
        embeddings=f"int{bits}",
        block_size=32,
        symmetric=sym,
        target="onnx",
        method="rtn",
    )
    m = onnx.load(out)
    onnx.checker.check_model(m, full_check=True)
    assert [n.op_type for n in m.graph.node] == ["DequantizeLinear", "Gather"]
    dq = m.graph.node[0]
    assert {a.name: a.i for a in dq.attribute} == {"axis": 1, "block_size": 32}
    inits = {t.name: t for t in m.graph.initializer}
    q = inits[dq.input[0]]
    want_type = {
        (4, True): TensorProto.INT4,
        (4, False): TensorProto.UINT4,
        (8, True): TensorProto.INT8,
        (8, False): TensorProto.UINT8,
    }[(bits, sym)]
    assert q.data_type == want_type and list(q.dims) == [50, 96]
    ref_b, ref_s, _ = ort_quantize(np.ascontiguousarray(table.T), bits, 32, sym)
    codes = (np.stack([ref_b & 15, ref_b >> 4], -1) if bits == 4 else ref_b).reshape(50, -1)
    mid = 1 << (bits - 1)
    want = codes.astype(np.int32) - (mid if sym else 0)
    assert np.array_equal(numpy_helper.to_array(q).astype(np.int32), want)
    scales = numpy_helper.to_array(inits[dq.input[1]])
    assert scales.shape == (50, 3) and np.array_equal(scales.view(np.uint8), ref_s.view(np.uint8))
    ids = np.array([[1, 3, 49]], np.int64)
    got = ort.InferenceSession(str(out)).run(None, {"ids": ids})[0]
    np.testing.assert_allclose(got, _dequantized(table, bits, 32, sym)[ids], rtol=0, atol=1e-6)


def _lm_head_model(table: np.ndarray, head: str, w: np.ndarray | None = None) -> onnx.ModelProto:
    """ids -> Gather(table) -> MatMul(., table^T) -> logits: the head reads a Transpose of the
    table ("transpose") or an initializer `w` ("copy")."""
    vocab = table.shape[0]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h"], name="embed")]
    inits = [numpy_helper.from_array(table, "table")]
    if head == "transpose":
        nodes.append(helper.make_node("Transpose", ["table"], ["wt"], perm=[1, 0]))
    else:
        inits.append(numpy_helper.from_array(table.T.copy() if w is None else w, "wt"))
    nodes.append(helper.make_node("MatMul", ["h", "wt"], ["logits"], name="lm_head"))
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("head", ["transpose", "copy"])
@pytest.mark.parametrize(
    "hidden, sym", [(64, True), (48, True), (64, False)]
)  # 48: rows padded to 64 (block 32)
def test_tied_lm_head_shares_one_tensor(tmp_path: Path, head: str, hidden: int, sym: bool) -> None:
    table = _table(40, hidden)
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(_lm_head_model(table, head), src)
    # accuracy level 0: float compute, so the logits are exactly the dequantized product
    r = fastopt.quantize(
        src, out, mode="int4", embeddings="int4", accuracy_level=0, symmetric=sym, method="rtn"
    )
    m = onnx.load(out)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    # one B (and zero points) and one scales; the float table and the copy are gone
    assert len([a for a in inits.values() if a.dtype == np.uint8]) == (1 if sym else 2)
    assert len([a for a in inits.values() if a.dtype == np.float32]) == 1
    nodes = {n.op_type: n for n in m.graph.node}
    gbq, mm, reshape = nodes["GatherBlockQuantized"], nodes["MatMulNBits"], nodes["Reshape"]
    assert reshape.input[0] == mm.input[1] and gbq.input[0] == reshape.output[0]
    assert gbq.input[2] == mm.input[2]  # the scales too
    assert list(gbq.input[3:]) == ([] if sym else [mm.input[3]])  # and the zero points
    emb = next(w for w in r.quantized if w.node == "embed")
    assert emb.op.startswith("GatherBlockQuantized (shares the lm_head's") and emb.bytes_after == 0
    ref_b, _, _ = ort_quantize(np.ascontiguousarray(table.T), 4, 32, sym)
    assert np.array_equal(inits[mm.input[1]], ref_b)
    ids = np.array([[0, 3, 39]], np.int64)
    got = ort.InferenceSession(str(out)).run(None, {"ids": ids})[0]
    deq = _dequantized(table, 4, 32, sym)
    np.testing.assert_allclose(got, deq[ids] @ deq.T, rtol=1e-5, atol=1e-6)
    base = ort.InferenceSession(str(src)).run(None, {"ids": ids})[0]
    assert np.abs(got - base).max() < 0.05 * np.abs(base).max()
    assert out.stat().st_size < table.nbytes * 0.4  # one int4 tensor (1/8 of fp32) + scales


def test_not_shared_when_different(tmp_path: Path) -> None:
    table = _table(40, 64)
    w = table.T.copy()
    w[10, 20] += 0.3  # a copy that is not the table's transpose: two tensors
    src = tmp_path / "m.onnx"
    onnx.save(_lm_head_model(table, "copy", w), src)
    r = fastopt.quantize(src, tmp_path / "q.onnx", mode="int4", embeddings="int4")
    emb = next(x for x in r.quantized if x.node == "embed")
    assert emb.op == "GatherBlockQuantized" and emb.bytes_after > 0
    assert r.model is not None and "Reshape" not in r.model.op_counts()
    # other settings for the head: not shared either
    for kwargs in ({"lm_head": "int8"}, {"lm_head": "keep"}, {"embeddings": "int8"}):
        onnx.save(_lm_head_model(table, "copy"), src)
        args: dict[str, object] = {"mode": "int4", "embeddings": "int4", **kwargs}
        r = fastopt.quantize(src, tmp_path / "q.onnx", **args)  # type: ignore[arg-type]
        emb = next(x for x in r.quantized if x.node == "embed")
        assert "shares" not in emb.op, kwargs


def test_kept_tables(tmp_path: Path) -> None:
    src = tmp_path / "m.onnx"
    cases = [
        (_gather_model(_table(50, 64), axis=1), {}, "embedding table gathered on axis 1, not 0"),
        (_gather_model(_table(50, 64)), {"exclude": ["emb*"]}, "excluded by 'emb*'"),
        (
            _gather_model(_table(50, 33)),
            {"target": "onnx"},
            "embedding table: target onnx needs whole bytes per row (hidden 33, int4)",
        ),
        (
            _gather_model(_table(50, 64)),
            {"embeddings": "keep"},
            "embedding table (embeddings=keep)",
        ),
    ]
    for model, kwargs, reason in cases:
        onnx.save(model, src)
        args: dict[str, object] = {"mode": "int4", "embeddings": "int4", **kwargs}
        r = fastopt.quantize(src, **args)  # type: ignore[arg-type]
        assert [w.reason for w in r.weights] == [reason]
        assert r.model is not None and r.model.op_counts() == {"Gather": 1}


def test_bfloat16_table_kept_on_cpu(tmp_path: Path) -> None:
    """onnxruntime's CPU provider cannot dequantize bfloat16 rows: kept unless cuda=1."""
    bits = (_table(50, 64).view(np.uint32) >> 16).astype(np.uint16)  # bfloat16, truncated
    init = helper.make_tensor("table", TensorProto.BFLOAT16, [50, 64], bits.tobytes(), raw=True)
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["h"], name="embed")],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("h", TensorProto.BFLOAT16, ["b", "s", 64])],
        [init],
    )
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), src)
    r = fastopt.quantize(src, mode="int4", embeddings="int4")
    assert [w.reason for w in r.weights] == [
        "embedding table is bfloat16: no CPU kernel dequantizes it (cuda=1 quantizes it)"
    ]
    r = fastopt.quantize(src, mode="int4", embeddings="int4", options={"cuda": 1})
    assert [w.op for w in r.quantized] == ["GatherBlockQuantized"]
    assert r.quantized[0].dtype_before == "bfloat16"


def test_overridable_table_kept(tmp_path: Path) -> None:
    """A table that is also a graph input (IR >= 4: the caller may feed another) is no constant."""
    model = _gather_model(_table(50, 64))
    model.graph.input.append(helper.make_tensor_value_info("table", TensorProto.FLOAT, [50, 64]))
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    r = fastopt.quantize(src, mode="int4", embeddings="int4")
    assert not r.quantized
    assert r.model is not None and r.model.op_counts() == {"Gather": 1}


@pytest.mark.parametrize("mode", ["int8-dynamic", "fp16"])
def test_embeddings_refused_for_other_modes(tmp_path: Path, mode: str) -> None:
    with pytest.raises(fastopt.ModelError, match=f"applies to weight-only int4/int8.*{mode}"):
        fastopt.quantize(FIXTURES / "llama_ts_float32" / "model.onnx", tmp_path / "q.onnx",
                         mode=mode, embeddings="int4")  # fmt: skip
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize(
    "fixture, shared",
    [
        ("llama_ts_float32", False),
        ("gemma_ts_float32", True),
        ("gemma_dynamo_float32", True),
        ("qwen2_dynamo_float16", False),
    ],
)
def test_decoders_verify(tmp_path: Path, fixture: str, shared: bool) -> None:
    """Tied (gemma: a copy under TorchScript, a Transpose under dynamo) and untied fixtures."""
    src = FIXTURES / fixture / "model.onnx"
    out = tmp_path / "q.onnx"
    r = fastopt.quantize(src, out, mode="int4", embeddings="int4", verify=True)
    assert r.verify is not None and r.verify.ok, str(r.verify)
    ops = r.model.op_counts() if r.model else {}
    assert ops["com.microsoft::GatherBlockQuantized"] == 1
    emb = [w for w in r.quantized if w.op.startswith("GatherBlockQuantized")]
    assert len(emb) == 1 and ("shares" in emb[0].op) == shared
    onnx.checker.check_model(str(out))
    fastopt.quantize(src, tmp_path / "p.onnx", mode="int4")
    assert out.stat().st_size < (tmp_path / "p.onnx").stat().st_size


@pytest.mark.skipif(og is None, reason="onnxruntime-genai not installed")
@pytest.mark.parametrize("fixture", ["gemma_ts_float32", "llama_dynamo_float32"])
def test_genai_generates_with_quantized_embeddings(tmp_path: Path, fixture: str) -> None:
    """optimize --preset llm --kv-cache inplace --quantize int4 --embeddings int4: genai's greedy
    tokens are ONNX Runtime's on the same folder."""
    out = tmp_path / "model.onnx"
    settings = QuantSettings(mode="int4", embeddings="int4")
    report = fastopt.optimize(
        FIXTURES / fixture / "model.onnx",
        preset="llm",
        output=out,
        kv_cache="inplace",
        quantize=settings,
    )
    assert any(w.op.startswith("GatherBlockQuantized") for w in report.quantization)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 500, 9)]
    ref = kg.greedy_cached(out, [prompt], 16, inplace=True, max_length=64)
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    used = set(prompt) | {int(t) for t in ref.tokens[0]}
    cfg["model"]["eos_token_id"] = min(set(range(len(used) + 1)) - used)
    write_genai_config(cfg, tmp_path / "genai_config.json")
    model = og.Model(str(tmp_path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 16, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], np.int32))
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    assert got == [int(t) for t in ref.tokens[0]]
