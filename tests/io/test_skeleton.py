"""Model.skeleton / _C.load_skeleton: the model's structure without its weights, handed to tools
that edit ModelProtos, and bound back to the original bytes without copying them."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from conftest import assert_outputs_identical, assert_proto_equal, run_ort
from fastopt import _C
from onnx import TensorProto, helper, numpy_helper

MARKER = "*fastopt-skeleton*"


def address(t: fastopt.Tensor) -> int:
    return int(np.asarray(t.raw_bytes()).__array_interface__["data"][0])


def build(tmp_path: Path) -> Path:
    """A model with every kind of tensor: big raw/external/typed initializers, small ones, a big
    Constant attribute, a subgraph initializer, a string tensor. Saved with external data."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 32)).astype(np.float32)  # 4 KB
    typed = helper.make_tensor("T", TensorProto.FLOAT, [512], rng.standard_normal(512).tolist())
    small = numpy_helper.from_array(np.array([1], np.int64), "S")
    strings = numpy_helper.from_array(np.array(["a", "bc"], dtype=object), "str")
    const = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32))  # 2 KB
    sub_w = numpy_helper.from_array(rng.standard_normal((4,)).astype(np.float32), "SW")
    sub_big = numpy_helper.from_array(np.ones((300, 1), np.float32), "SB")  # 1200 bytes
    then = helper.make_graph(
        [
            helper.make_node("Mul", ["m", "SW"], ["t1"]),
            helper.make_node("Add", ["t1", "SB"], ["t"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
        [sub_w, sub_big],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["m"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["a"]),
        helper.make_node("Constant", [], ["c"], value=const),
        helper.make_node("MatMul", ["c", "W"], ["cw"]),
        helper.make_node("ReduceSum", ["a", "S"], ["r"], keepdims=0),
        helper.make_node("Unsqueeze", ["r", "zero"], ["m"]),
        helper.make_node("If", ["cond"], ["Y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [4, 32]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, None]),
            helper.make_tensor_value_info("cw", TensorProto.FLOAT, [16, 32]),
        ],
        [
            numpy_helper.from_array(w, "W"),
            typed,
            small,
            strings,
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    src = tmp_path / "src.onnx"
    onnx.save(model, str(src))
    path = tmp_path / "model.onnx"
    fastopt.load(src).save(path, external_data=True, size_threshold=3000)  # W goes external
    return path


def tensors(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    found = list(graph.initializer)
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                found.append(a.t)
            if a.HasField("g"):
                found += tensors(a.g)
    return found


def test_big_payloads_become_placeholders(tmp_path: Path) -> None:
    m = fastopt.load(build(tmp_path))
    assert {t.name: t.storage for t in m.graph.initializers}["W"] == "external"
    skeleton = onnx.ModelProto.FromString(m.skeleton())
    original = m.to_onnx()
    by_index: dict[int, str] = {}
    for t, o in zip(tensors(skeleton.graph), tensors(original.graph)):
        nbytes = len(o.raw_data) or (4 * len(o.float_data))
        if o.data_type != TensorProto.STRING and nbytes >= 1024:
            entries = {e.key: e.value for e in t.external_data}
            assert t.data_location == TensorProto.EXTERNAL, t.name
            assert entries["location"] == MARKER
            assert int(entries["length"]) == nbytes
            assert not t.raw_data and not t.float_data
            by_index[int(entries["offset"])] = t.name
        else:
            assert t == o, t.name
    assert sorted(by_index) == list(range(4))  # W, T, the Constant's value, SB
    assert len(m.skeleton()) < 2500


def test_round_trip_is_exact_and_shares_bytes(tmp_path: Path) -> None:
    m = fastopt.load(build(tmp_path))
    again = _C.load_skeleton(m.skeleton(), m)
    assert_proto_equal(m.to_onnx(), again.to_onnx())
    again.verify()
    for t in m.graph.initializers:
        if t.dtype != TensorProto.STRING and t.nbytes >= 1024:
            twin = again.graph.initializer(t.name)
            assert twin.storage == t.storage
            assert address(twin) == address(t), t.name
    assert again.external_data_files() == m.external_data_files()
    assert again.path == m.path


def test_new_model_keeps_the_original_bytes_alive(tmp_path: Path) -> None:
    m = fastopt.load(build(tmp_path))
    expected = {t.name: t.numpy().copy() for t in m.graph.initializers if t.dtype != 8}
    again = _C.load_skeleton(m.skeleton(), m)
    del m
    gc.collect()
    for name, value in expected.items():
        np.testing.assert_array_equal(again.graph.initializer(name).numpy(), value)


def test_binds_back_after_onnx_edits(tmp_path: Path) -> None:
    m = fastopt.load(build(tmp_path))
    edited = onnx.shape_inference.infer_shapes(onnx.ModelProto.FromString(m.skeleton()))
    edited = onnx.version_converter.convert_version(edited, 18)
    again = _C.load_skeleton(edited.SerializeToString(), m)
    assert again.opset_imports[""] == 18
    assert address(again.graph.initializer("W")) == address(m.graph.initializer("W"))
    saved = tmp_path / "edited.onnx"
    again.save(saved)
    onnx.checker.check_model(str(saved))
    w = onnx.numpy_helper.to_array(
        next(t for t in onnx.load(str(saved)).graph.initializer if t.name == "W")
    )
    np.testing.assert_array_equal(w, m.graph.initializer("W").numpy())
    feeds = {"X": np.ones((4, 32), np.float32), "cond": np.array(True)}
    assert_outputs_identical(run_ort(m.path, feeds), run_ort(saved, feeds))


def test_threshold(tmp_path: Path) -> None:
    m = fastopt.load(build(tmp_path))
    everything = onnx.ModelProto.FromString(m.skeleton(threshold_bytes=0))
    for t in tensors(everything.graph):
        assert (t.data_location == TensorProto.EXTERNAL) == (t.data_type != TensorProto.STRING)
    assert_proto_equal(m.to_onnx(), _C.load_skeleton(m.skeleton(threshold_bytes=0), m).to_onnx())
    nothing = m.skeleton(threshold_bytes=1 << 40)
    assert nothing == m.serialize()


def test_indices_are_stable(tmp_path: Path) -> None:
    m = fastopt.load(build(tmp_path))
    first = m.skeleton()
    m.skeleton(threshold_bytes=0)  # adds the small tensors to the table
    assert m.skeleton() == first
    assert_proto_equal(m.to_onnx(), _C.load_skeleton(first, m).to_onnx())


def _edit_placeholder(data: bytes, name: str, **changes: object) -> bytes:
    proto = onnx.ModelProto.FromString(data)
    t = next(t for t in proto.graph.initializer if t.name == name)
    for key, value in changes.items():
        if key == "dims":
            del t.dims[:]
            t.dims.extend(value)  # type: ignore[arg-type]
        else:
            for e in t.external_data:
                if e.key == key:
                    e.value = str(value)
    return proto.SerializeToString()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"offset": 99}, "placeholder index '99'"),
        ({"offset": "x"}, "placeholder index 'x'"),
        ({"location": "weights.bin"}, "a skeleton holds only placeholders"),
        ({"dims": [16, 64]}, "but the original tensor 'W' is float[32,32]"),
    ],
)
def test_bad_placeholders_are_refused(tmp_path: Path, changes: dict, message: str) -> None:
    m = fastopt.load(build(tmp_path))
    data = _edit_placeholder(m.skeleton(), "W", **changes)
    with pytest.raises(fastopt.ModelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _C.load_skeleton(data, m)


def test_skeleton_of_another_model_is_refused(tmp_path: Path) -> None:
    m = fastopt.load(build(tmp_path))
    fresh = fastopt.load(m.path)
    with pytest.raises(fastopt.ModelError, match="placeholder index"):
        _C.load_skeleton(m.skeleton(), fresh)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sparse_initializers(tmp_path: Path) -> None:
    values = numpy_helper.from_array(np.arange(400, dtype=np.float32), "sp")
    indices = numpy_helper.from_array(np.arange(400, dtype=np.int64) * 2, "spi")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["sp"], ["Y"])],
        "g",
        [],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1000])],
        sparse_initializer=[helper.make_sparse_tensor(values, indices, [1000])],
    )
    m = fastopt.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    skeleton = m.skeleton()
    assert len(skeleton) < 300
    sparse = onnx.ModelProto.FromString(skeleton).graph.sparse_initializer[0]
    assert sparse.values.data_location == sparse.indices.data_location == TensorProto.EXTERNAL
    assert _C.load_skeleton(skeleton, m).serialize() == m.serialize()


@pytest.mark.parametrize(
    "layers",
    [30, pytest.param(300, marks=pytest.mark.slow)],
    ids=["300MB", "3GB"],
)
def test_skeleton_of_a_big_model_stays_small(tmp_path: Path, layers: int) -> None:
    """300 MB (or 3 GB) of weights in external data (a sparse file: nothing is written): the
    skeleton is a few KB, shape inference runs on it, and the bound-back model reads the
    original mapping."""
    rows = 2560  # 10 MB per layer
    data = tmp_path / "weights.bin"
    with open(data, "wb") as f:
        f.truncate(layers * rows * 1024 * 4)
    inits, nodes, prev = [], [], "X"
    for i in range(layers):
        t = onnx.TensorProto(name=f"W{i}", dims=[rows, 1024], data_type=TensorProto.FLOAT)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", data.name), ("offset", i * rows * 4096), ("length", rows * 4096)):
            e = t.external_data.add()
            e.key, e.value = k, str(v)
        inits.append(t)
        nodes.append(helper.make_node("Add", [prev, f"W{i}"], [f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [rows, 1024])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "big.onnx"
    path.write_bytes(model.SerializeToString())

    rss = _rss()
    m = fastopt.load(path)
    skeleton = m.skeleton()
    assert len(skeleton) < 200 * layers + 4096  # ~100 bytes per layer, for any weight size
    fastopt.infer_shapes(m)
    assert m.graph.value(prev).shape == (rows, 1024)
    again = _C.load_skeleton(skeleton, m)
    for i in range(layers):
        t = m.graph.initializer(f"W{i}")
        assert again.graph.initializer(f"W{i}").external_location == t.external_location
        assert address(again.graph.initializer(f"W{i}")) == address(t)
    assert _rss() - rss < 64 << 20  # the 300 MB were never read
