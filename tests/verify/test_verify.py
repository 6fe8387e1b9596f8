"""fastopt.verify.core and fastopt.make_inputs: same inputs, both models in ONNX Runtime, outputs
compared by name within dtype-aware tolerances."""

from __future__ import annotations

import importlib
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastopt
import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.paths import ROOT
from support.wire import varint

CORPUS_DIR = ROOT.parent / "shared" / "corpus"
CORPUS = sorted(CORPUS_DIR.glob("*/model.onnx")) if CORPUS_DIR.is_dir() else []
needs_corpus = pytest.mark.skipif(not CORPUS, reason="../shared/corpus is absent")
# `fastopt.verify.check` is the function; the module of the same name is reached through importlib.
check_module = importlib.import_module("fastopt.verify.check")

F = TensorProto.FLOAT


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opsets: Sequence[tuple[str, int]] = (("", 17),),
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=8
    )


def vi(name: str, elem: int = F, shape: Any = ("batch", 16)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def unary(op: str, elem: int = F, **attrs: Any) -> onnx.ModelProto:
    return make_model(
        [helper.make_node(op, ["x"], ["y"], **attrs)], [vi("x", elem)], [vi("y", elem)]
    )


def times_two(as_add: bool, elem: int = F) -> onnx.ModelProto:
    """y = x * 2, or the rewrite y = x + x."""
    if as_add:
        nodes = [helper.make_node("Add", ["x", "x"], ["y"])]
        inits: list[onnx.TensorProto] = []
    else:
        two = numpy_helper.from_array(np.array(2, dtype=helper.tensor_dtype_to_np_dtype(elem)))
        two.name = "two"
        nodes, inits = [helper.make_node("Mul", ["x", "two"], ["y"])], [two]
    return make_model(nodes, [vi("x", elem)], [vi("y", elem)], inits)


def WEIGHT() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((16, 8)).astype(np.float32)


def linear(
    weight: np.ndarray, bias: np.ndarray | None = None, *, gemm: bool = False
) -> onnx.ModelProto:
    """y = x @ W (+ b), as MatMul(+Add) or as one Gemm."""
    inits = [numpy_helper.from_array(weight, "w")]
    bias_name = []
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "b"))
        bias_name = ["b"]
    if gemm:
        nodes = [helper.make_node("Gemm", ["x", "w", *bias_name], ["y"])]
        out = vi("y", shape=[2, 8])
        return make_model(nodes, [vi("x", shape=[2, 16])], [out], inits)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h" if bias is not None else "y"])]
    if bias is not None:
        nodes.append(helper.make_node("Add", ["h", "b"], ["y"]))
    return make_model(nodes, [vi("x", shape=[2, 16])], [vi("y", shape=[2, 8])], inits)


def verify_fails(original: Any, optimized: Any, **kwargs: Any) -> fastopt.VerifyError:
    with pytest.raises(fastopt.VerifyError) as info:
        fastopt.verify(original, optimized, **kwargs)
    return info.value


# --- verify passes ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["path", "model", "proto"])
def test_identical_models_pass(tmp_path: Path, form: str) -> None:
    proto = linear(WEIGHT(), np.ones(8, np.float32))
    onnx.save(proto, tmp_path / "m.onnx")
    given: Any = {
        "path": tmp_path / "m.onnx",
        "model": fastopt.load(tmp_path / "m.onnx"),
        "proto": proto,
    }[form]
    report = fastopt.verify(given, given)
    assert report.ok and [o.name for o in report.outputs] == ["y"]
    y = report.output("y")
    assert y.ok and y.max_abs_err == 0 and y.shape == [2, 8] and y.dtype == "float32"
    assert report.inputs == {"x": "float32[2, 16]"}
    text = str(report)
    assert text.startswith("verify passed") and "float32" in text and "[2, 8]" in text
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_mul_by_two_rewritten_as_add_passes() -> None:
    report = fastopt.verify(times_two(False), times_two(True))
    assert report.ok and report.output("y").shape == [2, 16]


def test_matmul_add_fused_into_gemm_passes_within_tolerance() -> None:
    w, b = WEIGHT(), np.random.default_rng(8).standard_normal(8).astype(np.float32)
    report = fastopt.verify(linear(w, b), linear(w, b, gemm=True))
    y = report.output("y")
    assert y.ok and y.max_abs_err < 1e-5 and (y.atol, y.rtol) == (1e-4, 1e-4)


# --- verify fails -----------------------------------------------------------------------------


def test_a_weight_off_by_1e3_fails() -> None:
    w = WEIGHT()
    off = w.copy()
    off[3, 5] += 1e-3  # one element of one weight
    err = verify_fails(linear(w), linear(off))
    assert isinstance(err, fastopt.ModelError)
    y = err.report.output("y")
    assert not y.ok and 1e-4 < y.max_abs_err < 1e-2
    assert 0 < y.mismatches <= 2  # only column 5 moved
    message = str(err)
    assert "differs from" in message and "1 of 1 outputs fail" in message
    assert "\ny " in message and "FAIL" in message and "[2, 8]" in message
    # a looser tolerance accepts it: the verdict is the tolerance's, not a constant
    assert fastopt.verify(linear(w), linear(off), atol=1e-2).ok
    assert fastopt.verify(linear(w), linear(off), atol={"y": 1e-2}).ok


def test_the_default_tolerance_follows_the_dtype() -> None:
    """The same relative error of 1e-3 fails in float32 and passes in float16."""
    scale = np.array(1.001, dtype=np.float32)

    def scaled(elem: int, factor: np.ndarray | None) -> onnx.ModelProto:
        if factor is None:
            return unary("Identity", elem)
        c = numpy_helper.from_array(factor.astype(helper.tensor_dtype_to_np_dtype(elem)), "c")
        nodes = [helper.make_node("Mul", ["x", "c"], ["y"])]
        return make_model(nodes, [vi("x", elem)], [vi("y", elem)], [c])

    f32 = verify_fails(scaled(F, None), scaled(F, scale)).report.output("y")
    assert (f32.atol, f32.rtol) == (1e-4, 1e-4)
    f16 = fastopt.verify(scaled(TensorProto.FLOAT16, None), scaled(TensorProto.FLOAT16, scale))
    assert f16.output("y").dtype == "float16" and (f16.output("y").atol, f16.output("y").rtol) == (
        1e-2,
        1e-2,
    )
    assert fastopt.verify(scaled(F, None), scaled(F, scale), rtol=1e-2).ok


def bf16_model(factor: float) -> onnx.ModelProto:
    """bfloat16 in and out (ORT's numpy bridge has no bfloat16), scaled in float32, plus a scalar
    bfloat16 input."""
    c = numpy_helper.from_array(np.array(factor, np.float32), "c")
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=F),
        helper.make_node("Cast", ["s"], ["sf"], to=F),
        helper.make_node("Mul", ["xf", "c"], ["xc"]),
        helper.make_node("Add", ["xc", "sf"], ["yf"]),
        helper.make_node("Cast", ["yf"], ["y"], to=TensorProto.BFLOAT16),
    ]
    bf = TensorProto.BFLOAT16
    return make_model(nodes, [vi("x", bf), vi("s", bf, [])], [vi("y", bf)], [c])


def test_bfloat16_models_are_compared_as_numbers() -> None:
    feeds = fastopt.make_inputs(bf16_model(2.0))
    assert feeds["x"].dtype == ml_dtypes.bfloat16 and feeds["s"].shape == ()
    report = fastopt.verify(bf16_model(2.0), bf16_model(2.0))
    assert report.output("y").dtype == "bfloat16" and report.ok
    err = verify_fails(bf16_model(2.0), bf16_model(2.1))
    assert err.report.output("y").max_abs_err > 0.05


def test_integer_outputs_must_match_exactly() -> None:
    def argmax(offset: int) -> onnx.ModelProto:
        c = numpy_helper.from_array(np.array(offset, np.int64), "c")
        nodes = [
            helper.make_node("ArgMax", ["x"], ["a"], axis=1),
            helper.make_node("Add", ["a", "c"], ["y"]),
        ]
        return make_model(nodes, [vi("x")], [vi("y", TensorProto.INT64, ["batch", 1])], [c])

    assert fastopt.verify(argmax(0), argmax(0)).ok
    err = verify_fails(argmax(0), argmax(1), atol=10.0, rtol=10.0)  # float tolerances only
    y = err.report.output("y")
    assert y.dtype == "int64" and y.max_abs_err == 1 and (y.atol, y.rtol) == (0, 0)


def test_nans_must_sit_in_the_same_places() -> None:
    log = unary("Log")  # NaN for the negative half of normal inputs
    assert fastopt.verify(log, log).ok
    abs_log = make_model(
        [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Log", ["a"], ["y"])],
        [vi("x")],
        [vi("y")],
    )
    err = verify_fails(log, abs_log)
    assert err.report.output("y").mismatches > 0


def test_renamed_output_fails() -> None:
    renamed = times_two(True)
    renamed.graph.node[0].output[0] = "z"
    renamed.graph.output[0].name = "z"
    err = verify_fails(times_two(False), renamed)
    notes = {o.name: o.message for o in err.report.failed}
    assert notes == {"y": "missing from optimized", "z": "not in the original"}
    assert "2 of 2 outputs fail" in str(err)


def test_changed_shape_and_dtype_fail() -> None:
    flat = make_model(
        [helper.make_node("Flatten", ["x"], ["y"], axis=0)], [vi("x")], [vi("y", shape=None)]
    )
    assert "shapes differ" in verify_fails(unary("Identity"), flat).report.output("y").message
    wide = unary("Cast", to=TensorProto.DOUBLE)
    wide.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    message = verify_fails(unary("Identity"), wide).report.output("y").message
    assert message == "dtype float64, expected float32"


def test_an_optimized_model_that_cannot_run_fails() -> None:
    broken = make_model(
        [helper.make_node("NoSuchContribOp", ["x"], ["y"], domain="com.microsoft")],
        [vi("x")],
        [vi("y")],
        opsets=[("", 17), ("com.microsoft", 1)],
    )
    err = verify_fails(unary("Identity"), broken)
    assert "could not run the optimized model" in str(err) and "NoSuchContribOp" in str(err)
    assert err.report.error and not err.report.ok


def test_an_optimized_model_with_a_new_input_fails() -> None:
    extra = make_model(
        [helper.make_node("Add", ["x", "bias"], ["y"])], [vi("x"), vi("bias")], [vi("y")]
    )
    err = verify_fails(unary("Identity"), extra)
    assert "takes inputs the original does not: bias" in str(err)


def test_an_optimized_model_that_drops_an_input_fails() -> None:
    """Callers feed every input of the original; ORT refuses names a model does not take."""
    two = make_model([helper.make_node("Add", ["x", "z"], ["y"])], [vi("x"), vi("z")], [vi("y")])
    times_one = make_model([helper.make_node("Add", ["x", "x"], ["y"])], [vi("x")], [vi("y")])
    err = verify_fails(two, times_one)
    assert err.report.error == "the optimized model no longer takes input(s) z"
    assert "no longer takes input(s) z; 1 of 1 outputs fail" in str(err)


def test_given_inputs_are_used_and_the_rest_synthesized() -> None:
    two = make_model([helper.make_node("Add", ["x", "z"], ["y"])], [vi("x"), vi("z")], [vi("y")])
    x = np.zeros((5, 16), np.float32)
    report = fastopt.verify(two, two, inputs={"x": x}, dims={"batch": 5})
    assert report.inputs == {"x": "float32[5, 16]", "z": "float32[5, 16]"}
    with pytest.raises(ValueError, match="not available"):
        fastopt.verify(two, two, providers=["NoSuchExecutionProvider"])


def test_large_models_go_through_external_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the inline limit at 0 every in-memory model is saved to a temporary folder with
    external data and run by path; the verdicts are the same and the folders are gone."""
    monkeypatch.setattr(check_module, "_INLINE_LIMIT", 0)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    w = WEIGHT()
    off = w.copy()
    off[0, 0] += 1e-3
    saved: list[str] = []
    save_external = check_module._save_external

    def spy(model: fastopt.Model, stack: Any) -> str:
        saved.append(save_external(model, stack))
        return saved[-1]

    monkeypatch.setattr(check_module, "_save_external", spy)
    original, same, wrong = (fastopt.from_onnx(linear(a)) for a in (w, w.copy(), off))
    assert fastopt.verify(original, same).ok
    verify_fails(original, wrong)
    assert len(saved) == 4 and all(p.startswith(str(scratch)) for p in saved)
    assert list(scratch.iterdir()) == []


# --- make_inputs ------------------------------------------------------------------------------

VOCAB = 50


def llm_like(past: bool = True) -> onnx.ModelProto:
    """The inputs of a decoder export with a KV cache, plus the odd ones an optimized model has;
    input_ids reaches a [VOCAB, 4] embedding through a Reshape, as GPT-2's export does."""
    i64, i32 = TensorProto.INT64, TensorProto.INT32
    inputs = [
        vi("input_ids", i64, ["batch_size", "sequence_length"]),
        vi("attention_mask", i64, ["batch_size", "total_sequence_length"]),
        vi("position_ids", i64, ["batch_size", "sequence_length"]),
        vi("token_type_ids", i64, ["batch_size", "sequence_length"]),
        vi("seqlens_k", i32, ["batch_size"]),
        vi("total_sequence_length", i32, []),
        vi("flags", TensorProto.BOOL, [3, "mystery"]),
        vi("cache_mask", TensorProto.BOOL, [2]),
    ]
    if past:
        inputs += [
            vi("past_key_values.0.key", F, ["batch_size", 2, "past_sequence_length", 4]),
            vi("kv", TensorProto.FLOAT16, ["batch_size", "past_sequence_length + sequence_length"]),
        ]
    embed = numpy_helper.from_array(np.zeros((VOCAB, 4), np.float32), "embed")
    flat = numpy_helper.from_array(np.array([-1], np.int64), "flat")
    # an earlier, smaller table that the token ids do not index: "the first Gather" is wrong
    other = numpy_helper.from_array(np.zeros((3, 4), np.float32), "other")
    one = numpy_helper.from_array(np.array([1], np.int64), "one")
    nodes = [
        helper.make_node("Gather", ["other", "one"], ["row"]),
        helper.make_node("Reshape", ["input_ids", "flat"], ["ids"]),
        helper.make_node("Gather", ["embed", "ids"], ["hidden"]),
    ]
    outputs = [vi("hidden", shape=None), vi("row", shape=None)]
    return make_model(nodes, inputs, outputs, [embed, flat, other, one])


def test_make_inputs_for_a_decoder_with_cache() -> None:
    feeds = fastopt.make_inputs(llm_like())
    shapes = {k: v.shape for k, v in feeds.items()}
    assert shapes == {
        "input_ids": (2, 8),
        "attention_mask": (2, 12),  # total = past 4 + sequence 8
        "position_ids": (2, 8),
        "token_type_ids": (2, 8),
        "seqlens_k": (2,),
        "total_sequence_length": (),
        "flags": (3, 4),  # an unknown name gets 4
        "cache_mask": (2,),
        "past_key_values.0.key": (2, 2, 4, 4),
        "kv": (2, 12),  # dynamo's arithmetic dims are evaluated
    }
    ids = feeds["input_ids"]
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < VOCAB
    assert ids.max() >= 2  # the vocabulary came from the embedding, not a safe [0, 2)
    assert feeds["attention_mask"].dtype == np.int64 and (feeds["attention_mask"] == 1).all()
    np.testing.assert_array_equal(feeds["position_ids"], np.tile(np.arange(4, 12), (2, 1)))
    assert (feeds["token_type_ids"] == 0).all()
    assert feeds["seqlens_k"].dtype == np.int32 and (feeds["seqlens_k"] == 11).all()
    assert feeds["total_sequence_length"] == 12
    assert feeds["flags"].dtype == np.bool_ and feeds["cache_mask"].all()
    assert feeds["kv"].dtype == np.float16 and feeds["past_key_values.0.key"].std() > 0.5


def test_make_inputs_dims_and_seed() -> None:
    model = llm_like()
    a, b = fastopt.make_inputs(model, seed=3), fastopt.make_inputs(model, seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = fastopt.make_inputs(model, seed=4)
    assert not np.array_equal(a["input_ids"], c["input_ids"])

    small = fastopt.make_inputs(model, dims={"batch_size": 1, "sequence_length": 3})
    assert small["input_ids"].shape == (1, 3) and small["attention_mask"].shape == (1, 7)
    np.testing.assert_array_equal(small["position_ids"], [[4, 5, 6]])

    # given total and sequence, the past follows
    derived = fastopt.make_inputs(model, dims={"total_sequence_length": 10, "sequence_length": 3})
    assert derived["past_key_values.0.key"].shape[2] == 7
    np.testing.assert_array_equal(derived["position_ids"][0], [7, 8, 9])
    assert fastopt.make_inputs(model, dims={"mystery": 6})["flags"].shape == (3, 6)
    with pytest.raises(ValueError, match="shorter than its parts"):
        fastopt.make_inputs(model, dims={"total_sequence_length": 2, "sequence_length": 3})


def test_make_inputs_without_a_cache_has_no_past() -> None:
    feeds = fastopt.make_inputs(llm_like(past=False))
    assert feeds["attention_mask"].shape == (2, 8)  # total = sequence
    np.testing.assert_array_equal(feeds["position_ids"][1], np.arange(8))


def test_make_inputs_needs_a_declared_type() -> None:
    shapeless = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [vi("x", shape=None)], [vi("y")]
    )
    with pytest.raises(ValueError, match="'x' has no shape"):
        fastopt.make_inputs(shapeless)


# --- the reference corpus ---------------------------------------------------------------------

SMALL = {"batch_size": 1, "sequence_length": 4, "past_sequence_length": 2}


@needs_corpus
@pytest.mark.parametrize("path", CORPUS, ids=[p.parent.name for p in CORPUS])
def test_corpus_inputs_are_valid_and_verify_passes(path: Path) -> None:
    meta = json.loads((path.parent / "meta.json").read_text())
    vocab = meta["config"]["vocab_size"]
    feeds = fastopt.make_inputs(path, dims=SMALL)
    assert set(feeds) == set(meta["io"]["inputs"])
    ids = feeds["input_ids"]
    assert ids.shape == (1, 4) and ids.min() >= 0 and ids.max() < vocab and ids.max() >= 2
    mask = feeds["attention_mask"]
    assert (mask == 1).all()
    has_past = any(name.startswith("past_key_values") for name in feeds)
    assert mask.shape == (1, 6 if has_past else 4)
    if "position_ids" in feeds:
        start = 2 if has_past else 0
        np.testing.assert_array_equal(feeds["position_ids"], [np.arange(start, start + 4)])
    if "token_type_ids" in feeds:
        assert (feeds["token_type_ids"] == 0).all()
    for name, array in feeds.items():
        if name.startswith("past_key_values"):
            assert array.shape[0] == 1 and array.shape[2] == 2 and array.dtype == np.float32

    report = fastopt.verify(path, path, dims=SMALL)
    assert report.ok and [o.name for o in report.outputs] == meta["io"]["outputs"]


def _corpus_model(name: str) -> Path:
    path = CORPUS_DIR / name / "model.onnx"
    if not path.is_file():
        pytest.skip(f"{name} is not in the corpus")
    return path


@needs_corpus
@pytest.mark.parametrize("name", ["gpt2_ts_nocache", "llama_ts_cache"])
def test_corpus_rewrite_by_onnxruntime_verifies(tmp_path: Path, name: str) -> None:
    """A real rewrite: ORT's extended fusions (FusedMatMul, FastGelu, SimplifiedLayerNorm...)
    saved as a model, checked against the export."""
    path = _corpus_model(name)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    assert fastopt.load(tmp_path / "opt.onnx").op_counts() != fastopt.load(path).op_counts()
    assert fastopt.verify(path, tmp_path / "opt.onnx", dims=SMALL).ok


@needs_corpus
def test_corpus_model_with_a_perturbed_weight_fails() -> None:
    """The LM head's weight scaled by 1 + 1e-3: the logits move past the tolerance."""
    path = _corpus_model("llama_ts_nocache")
    proto = onnx.load(str(path))
    inits = {t.name: t for t in proto.graph.initializer}
    matmuls = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    node = matmuls[-1]
    weight = inits[node.input[1]]
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.001, weight.name))
    err = verify_fails(path, proto, dims=SMALL)
    assert "logits" in {o.name for o in err.report.failed}


# --- over 2 GB (opt-in: pytest -m slow) -------------------------------------------------------

COLS = 256


def _field(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited protobuf field; the payload follows."""
    return varint(number << 3 | 2) + varint(length)


def _write_rows(f: Any, n_rows: int) -> None:
    for r0 in range(0, n_rows, 1 << 16):
        r = np.arange(r0, min(r0 + (1 << 16), n_rows), dtype=np.float32) % 8191
        f.write((r[:, None] + np.arange(COLS, dtype=np.float32) / 256).tobytes())


@pytest.mark.slow
def test_over_2gb_never_goes_through_protobuf(tmp_path: Path) -> None:
    """One 2.1 GB weight behind Gather, as a single file (which onnx and ORT cannot parse) and as
    an in-memory Model: check and verify take it by path with external data, and verify still
    catches a changed row."""
    import shutil

    n_rows = 2_100_000
    assert n_rows * COLS * 4 > 2**31
    idx = vi("idx", TensorProto.INT64, ["n"])
    out = vi("y", F, ["n", COLS])
    model = make_model([helper.make_node("Gather", ["w", "idx"], ["y"])], [idx], [out])
    graph = model.graph.SerializeToString()
    model.ClearField("graph")
    head = onnx.TensorProto(name="w", data_type=F, dims=[n_rows, COLS]).SerializeToString()
    n_bytes = n_rows * COLS * 4
    tensor_len = len(head) + len(_field(9, n_bytes)) + n_bytes
    graph_len = len(graph) + len(_field(5, tensor_len)) + tensor_len
    single = tmp_path / "single.onnx"
    try:
        with open(single, "wb") as f:
            f.write(model.SerializeToString() + _field(7, graph_len) + graph)
            f.write(_field(5, tensor_len) + head + _field(9, n_bytes))
            _write_rows(f, n_rows)
        big = fastopt.load(single)
        assert big.self_contained_size() > 2**31
        assert fastopt.check(single).ok
        assert fastopt.check(big).ok
        feeds = fastopt.make_inputs(big)
        assert feeds["idx"].max() < n_rows and feeds["idx"].max() > 8191  # the whole table
        assert fastopt.verify(single, big).ok

        # the same weight with one row changed, as external data
        other = tmp_path / "other"
        other.mkdir()
        big.save(other / "model.onnx", external_data=True)
        location = fastopt.load(other / "model.onnx").graph.initializer("w").external_location
        assert location is not None
        with open(location[0], "r+b") as f:
            f.seek(location[1] + int(feeds["idx"][0]) * COLS * 4)
            f.write(np.full(COLS, 1e-3, np.float32).tobytes())
        err = verify_fails(big, other / "model.onnx")
        assert err.report.output("y").mismatches >= 1
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
