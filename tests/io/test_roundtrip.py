"""Round trip: load -> save gives an equal model (exact protobuf equality) that runs the same.

Models: every model of the onnx wheel's backend test data (light, pytorch-converted,
pytorch-operator, simple, real when present) and every model of ../shared/corpus (skipped when
absent), plus hand-made models with unknown fields, explicit default-valued fields and rarely used
proto fields.
"""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from conftest import (
    assert_outputs_identical,
    assert_proto_equal,
    backend_models,
    corpus_models,
    model_feeds,
    model_id,
    ort_session,
    run_ort,
    tensor_protos,
    without_weights,
)
from onnx import TensorProto, helper, numpy_helper
from support.wire import varint

MODELS = backend_models() + corpus_models()


@pytest.fixture(params=MODELS, ids=[model_id(p) for p in MODELS])
def model_path(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_model_sets_found() -> None:
    kinds = {model_id(p).split("/")[0] for p in backend_models()}
    assert {"light", "pytorch-converted", "pytorch-operator", "simple"} <= kinds


def test_save_roundtrip(model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.onnx"
    m = fastopt.load(str(model_path))
    m.save(str(out))
    assert_proto_equal(onnx.load(str(model_path)), onnx.load(str(out)))
    # Small model, default settings: self-contained, and nothing else left in the folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]
    assert fastopt.load(str(out)).external_data_files() == []


def test_save_is_deterministic(model_path: Path, tmp_path: Path) -> None:
    m = fastopt.load(str(model_path))
    m.save(str(tmp_path / "a.onnx"))
    m.save(str(tmp_path / "b.onnx"))
    first = (tmp_path / "a.onnx").read_bytes()
    assert (tmp_path / "b.onnx").read_bytes() == first
    fastopt.load(str(tmp_path / "a.onnx")).save(str(tmp_path / "c.onnx"))
    assert (tmp_path / "c.onnx").read_bytes() == first


def test_proto_roundtrip(model_path: Path) -> None:
    proto = onnx.load(str(model_path))
    assert_proto_equal(proto, fastopt.from_onnx(proto).to_onnx())


def test_ort_parity(model_path: Path, tmp_path: Path) -> None:
    try:
        session = ort_session(model_path)
    except Exception as e:  # old opsets, training ops, locale-dependent kernels...
        pytest.skip(f"ONNX Runtime cannot run the original: {str(e).splitlines()[0][:160]}")
    feeds = model_feeds(model_path, onnx.load(str(model_path)))
    expected = session.run(None, feeds)
    out = tmp_path / "out.onnx"
    fastopt.load(str(model_path)).save(str(out))
    assert_outputs_identical(expected, run_ort(out, feeds))


def _assert_same_model(original: onnx.ModelProto, saved: onnx.ModelProto) -> None:
    """Equal up to where each tensor's bytes live (raw/typed field, external file)."""
    assert_proto_equal(without_weights(original), without_weights(saved))
    for a, b in zip(tensor_protos(original.graph), tensor_protos(saved.graph)):
        x, y = numpy_helper.to_array(a), numpy_helper.to_array(b)
        assert x.dtype == y.dtype, a.name
        np.testing.assert_array_equal(y, x, strict=True, err_msg=a.name)


def test_external_data_roundtrip(model_path: Path, tmp_path: Path) -> None:
    """Every model through external data and back inline: same graph, same values, same outputs."""
    ext, back = tmp_path / "ext" / "model.onnx", tmp_path / "back.onnx"
    ext.parent.mkdir()
    fastopt.load(str(model_path)).save(str(ext), external_data=True, size_threshold=256)
    original = onnx.load(str(model_path))
    _assert_same_model(original, onnx.load(str(ext)))
    fastopt.load(str(ext)).save(str(back))
    _assert_same_model(original, onnx.load(str(back)))
    try:
        session = ort_session(model_path)
    except Exception:
        return  # test_ort_parity reports why
    feeds = model_feeds(model_path, original)
    expected = session.run(None, feeds)
    assert_outputs_identical(expected, run_ort(ext, feeds))
    assert_outputs_identical(expected, run_ort(back, feeds))


# --- hand-made models: unknown fields, field presence, rarely used fields -----------------------


def _unknown_fields(first: int) -> bytes:
    """Four fields this onnx version does not know: varint, fixed64, length-delimited, fixed32."""
    return (
        varint(first << 3 | 0)
        + varint(150)
        + varint((first + 1) << 3 | 1)
        + bytes(range(8))
        + varint((first + 2) << 3 | 2)
        + varint(5)
        + b"hello"
        + varint((first + 3) << 3 | 5)
        + bytes(range(4))
    )


def _small_model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "W")
    then_g = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["t"], name="then_add")],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Sub", ["X", "W"], ["e"], name="else_sub")],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3])],
    )
    nodes = [
        helper.make_node("Relu", ["X"], ["r"], name="relu"),
        helper.make_node("ReduceSum", ["r"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
        helper.make_node("If", ["c"], ["Y"], name="if", then_branch=then_g, else_branch=else_g),
    ]
    graph = helper.make_graph(
        nodes,
        "small",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
        [w, numpy_helper.from_array(np.array(0, dtype=np.float32), "zero")],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, ["a", 3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _roundtrip_file(proto_bytes: bytes, tmp_path: Path) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    src.write_bytes(proto_bytes)
    fastopt.load(str(src)).save(str(out))
    return onnx.load(str(src)), onnx.load(str(out))


def test_unknown_fields_preserved(tmp_path: Path) -> None:
    model = _small_model()
    g = model.graph
    targets = [
        model,
        g,
        g.node[0],
        g.node[1].attribute[0],
        g.node[3].attribute[0].g,
        g.node[3].attribute[0].g.node[0],
        g.initializer[0],
        g.input[0],
        g.input[0].type,
        g.input[0].type.tensor_type.shape.dim[0],
        g.value_info[0],
        model.opset_import[0],
    ]
    for i, msg in enumerate(targets):
        msg.MergeFromString(_unknown_fields(1000 + 10 * i))
    original, saved = _roundtrip_file(model.SerializeToString(), tmp_path)
    assert original == model  # onnx keeps them too
    assert_proto_equal(original, saved)
    assert_proto_equal(model, fastopt.from_onnx(model).to_onnx())
    assert_outputs_identical(
        run_ort(tmp_path / "in.onnx", {"X": np.ones((2, 3), np.float32)}),
        run_ort(tmp_path / "out.onnx", {"X": np.ones((2, 3), np.float32)}),
    )


def test_explicit_default_fields_preserved(tmp_path: Path) -> None:
    """Fields set to their default value are present in the file and must stay present."""
    model = _small_model()
    g = model.graph
    model.domain = ""
    model.model_version = 0
    model.doc_string = ""
    g.doc_string = ""
    g.node[0].domain = ""
    g.node[0].doc_string = ""
    g.node[1].attribute[0].doc_string = ""
    g.initializer[0].data_location = TensorProto.DEFAULT
    g.initializer[0].doc_string = ""
    g.input[0].doc_string = ""
    g.input[0].type.denotation = ""
    dim = g.input[0].type.tensor_type.shape.dim.add()
    dim.dim_value = 0  # a dim with dim_value set to 0 ...
    g.input[0].type.tensor_type.shape.dim.add()  # ... and one with neither value nor param
    original, saved = _roundtrip_file(model.SerializeToString(), tmp_path)
    assert original.graph.node[0].HasField("domain")
    assert_proto_equal(original, saved)
    assert_proto_equal(model, fastopt.from_onnx(model).to_onnx())


def test_rare_fields_preserved(tmp_path: Path) -> None:
    """Sparse initializers, training info, metadata everywhere, every attribute kind, overloads."""
    model = _small_model()
    model.ir_version = 10
    g = model.graph
    helper.set_model_props(model, {"author": "fastopt", "empty": ""})
    helper.set_metadata_props(g, {"graph_key": "v"})
    helper.set_metadata_props(g.node[0], {"node_key": "v"})
    g.node[0].doc_string = "relu doc"
    g.input[0].type.denotation = "TENSOR"
    g.input[0].type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([1.5, 2.5], np.float32), "sp"),
        numpy_helper.from_array(np.array([1, 4], np.int64), "sp_idx"),
        [2, 3],
    )
    g.sparse_initializer.append(sparse)
    g.quantization_annotation.add(tensor_name="r").quant_parameter_tensor_names.add(
        key="SCALE_TENSOR", value="zero"
    )
    seq_type = helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT16, ["n"])
    )
    g.value_info.append(helper.make_value_info("unused_seq", seq_type))
    g.value_info.append(
        helper.make_value_info(
            "unused_map",
            helper.make_map_type_proto(
                TensorProto.INT64,
                helper.make_optional_type_proto(
                    helper.make_tensor_type_proto(TensorProto.BFLOAT16, [])
                ),
            ),
        )
    )
    odd = helper.make_node(
        "OddOp",
        [],
        [],
        name="odd",
        domain="custom.domain",
        f=0.5,
        i=-7,
        s=b"\x00bytes\xff",
        floats=[1.0, -0.0, float("inf")],
        ints=[0, -1, 2**62],
        strings=[b"a", b""],
        t=numpy_helper.from_array(np.array([1, 2], np.int8)),
        tensors=[numpy_helper.from_array(np.array(True))],
        sparse_tensor=sparse,
        sparse_tensors=[sparse],
        g=g.node[3].attribute[0].g,
        graphs=[g.node[3].attribute[1].g],
        tp=seq_type,
        tps=[seq_type],
    )
    # Not wired into the main graph (ORT would reject it); it lives in the training info instead.
    training = model.training_info.add()
    training.initialization.CopyFrom(helper.make_graph([odd], "init", [], []))
    training.algorithm.CopyFrom(helper.make_graph([], "algo", [], []))
    training.update_binding.add(key="W", value="W_new")
    fn = helper.make_function(
        "custom.domain",
        "Fn",
        ["a"],
        ["b"],
        [helper.make_node("Neg", ["a"], ["b"])],
        [helper.make_opsetid("", 17)],
        attributes=["unused"],
    )
    fn.overload = "v2"
    fn.doc_string = "a function"
    fn.value_info.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, None))
    helper.set_metadata_props(fn, {"fn_key": "v"})
    model.functions.append(fn)
    model.opset_import.append(helper.make_opsetid("custom.domain", 1))
    original, saved = _roundtrip_file(model.SerializeToString(), tmp_path)
    assert_proto_equal(original, saved)
    assert_proto_equal(model, fastopt.from_onnx(model).to_onnx())


# --- other valid wire encodings of the same model ----------------------------------------------


def _len_field(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def _tensor_bytes(variant: str) -> bytes:
    """W = [[0, 1, 2], [3, 4, 5]] as a TensorProto with float_data, encoded by hand."""
    dims = [2, 3]
    floats = np.arange(6, dtype=np.float32)
    if variant == "packed":  # dims packed (onnx writes it unpacked), float_data unpacked
        dims_field = _len_field(1, b"".join(varint(d) for d in dims))
        floats_field = b"".join(varint(4 << 3 | 5) + f.tobytes() for f in floats)
    else:
        dims_field = b"".join(varint(1 << 3) + varint(d) for d in dims)
        floats_field = _len_field(4, floats.tobytes())
    data_type = varint(2 << 3) + (b"\x81\x80\x00" if variant == "overlong" else varint(1))
    name = _len_field(8, b"W")
    if variant == "reordered":
        return name + floats_field + data_type + dims_field
    return dims_field + data_type + floats_field + name


def _wire_model(variant: str) -> bytes:
    vi = helper.make_tensor_value_info
    head = helper.make_model(
        helper.make_graph([], "unused", [], []),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    head.ClearField("graph")
    graph_a = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["Y"], name="add")],
        "g",
        [vi("X", TensorProto.FLOAT, [2, 3])],
        [],
    ).SerializeToString()
    graph_b = onnx.GraphProto(output=[vi("Y", TensorProto.FLOAT, [2, 3])]).SerializeToString()
    initializer = _len_field(5, _tensor_bytes(variant))
    if variant == "split_graph":  # the graph field twice: the two halves merge
        second = _len_field(7, graph_b + initializer)
        return head.SerializeToString() + _len_field(7, graph_a) + second
    if variant == "last_wins":  # scalar fields twice: the last value counts
        graph = _len_field(2, b"old name") + graph_a + graph_b + initializer
        return varint(1 << 3) + varint(3) + head.SerializeToString() + _len_field(7, graph)
    if variant == "reordered":
        return _len_field(7, initializer + graph_b + graph_a) + head.SerializeToString()
    return head.SerializeToString() + _len_field(7, graph_a + graph_b + initializer)


@pytest.mark.parametrize(
    "variant", ["plain", "packed", "overlong", "reordered", "split_graph", "last_wins"]
)
def test_wire_encoding_variants(variant: str, tmp_path: Path) -> None:
    """Encodings any protobuf parser accepts: packed/unpacked repeated scalars, overlong varints,
    fields in any order, a message field given twice (merged), a scalar given twice (last wins)."""
    original, saved = _roundtrip_file(_wire_model(variant), tmp_path)
    reference = onnx.load_from_string(_wire_model("plain"))
    assert original == reference  # same model for protobuf, whatever the encoding
    assert_proto_equal(original, saved)
    feeds = {"X": np.ones((2, 3), np.float32)}
    expected = run_ort(tmp_path / "in.onnx", feeds)
    assert_outputs_identical(expected, run_ort(tmp_path / "out.onnx", feeds))
    t = fastopt.load(str(tmp_path / "in.onnx")).graph.initializer("W")
    np.testing.assert_array_equal(t.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
