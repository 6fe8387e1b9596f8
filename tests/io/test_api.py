"""The Python API surface (notes/api.md) checked against onnx's own view of the same models."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import pytest
from conftest import assert_proto_equal, backend_models, corpus_models, model_id
from onnx import TensorProto, helper, numpy_helper

MODELS = backend_models() + corpus_models()
IDS = [model_id(p) for p in MODELS]


def onnx_op_counts(graph: onnx.GraphProto) -> Counter[str]:
    """Op histogram the way the API keys it ("Op" for ai.onnx, "domain::Op" otherwise),
    subgraphs included."""
    counts: Counter[str] = Counter()
    for node in graph.node:
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        counts[f"{domain}::{node.op_type}" if domain else node.op_type] += 1
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                counts += onnx_op_counts(g)
    return counts


@pytest.mark.parametrize("path", MODELS, ids=IDS)
def test_model_properties_and_op_counts(path: Path) -> None:
    proto = onnx.load(str(path))
    m = fastopt.load(str(path))
    assert Path(m.path).resolve() == path.resolve()
    assert m.ir_version == proto.ir_version
    assert m.producer_name == proto.producer_name
    assert m.producer_version == proto.producer_version
    assert m.domain == proto.domain
    assert m.model_version == proto.model_version
    assert m.opset_imports == {
        ("" if o.domain == "ai.onnx" else o.domain): o.version for o in proto.opset_import
    }
    assert m.metadata_props == {p.key: p.value for p in proto.metadata_props}
    assert m.op_counts() == dict(onnx_op_counts(proto.graph))
    assert m.external_data_files() == []
    m.verify()
    meta = path.parent / "meta.json"
    if meta.is_file():  # the corpus records the exporter's own histogram
        assert m.op_counts() == json.loads(meta.read_text())["op_hist"]


def _shape(vi: onnx.ValueInfoProto) -> tuple[int | str | None, ...] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return tuple(
        d.dim_value if d.HasField("dim_value") else d.dim_param if d.HasField("dim_param") else None
        for d in tt.shape.dim
    )


def _node_key(node: Any) -> tuple[str, str, str]:
    return (node.name, node.op_type, node.domain)


@pytest.mark.parametrize("path", MODELS, ids=IDS)
def test_graph_walk_consistency(path: Path) -> None:
    proto = onnx.load(str(path))
    g = fastopt.load(str(path)).graph
    gp = proto.graph
    assert g.name == gp.name
    nodes = g.nodes
    assert [_node_key(n) for n in nodes] == [(n.name, n.op_type, n.domain) for n in gp.node]
    expected_uses: dict[str, Counter] = {}
    for node, np_ in zip(nodes, gp.node):
        assert [v.name if v is not None else "" for v in node.inputs] == list(np_.input)
        assert [v.name if v is not None else "" for v in node.outputs] == list(np_.output)
        for i, v in enumerate(node.inputs):
            if v is not None:
                expected_uses.setdefault(v.name, Counter())[(*_node_key(node), i)] += 1
        for v in node.outputs:
            if v is not None:
                assert v.producer is not None and _node_key(v.producer) == _node_key(node)
                assert any(o is not None and o.name == v.name for o in v.producer.outputs)
    names = {n for node in gp.node for n in [*node.input, *node.output] if n}
    names |= {vi.name for vi in [*gp.input, *gp.output]} | {t.name for t in gp.initializer}
    inputs, outputs = {vi.name for vi in gp.input}, {vi.name for vi in gp.output}
    initializers = {t.name for t in gp.initializer}
    produced = {n for node in gp.node for n in node.output if n}
    for name in names:
        v = g.value(name)
        assert v is not None and v.name == name
        uses = Counter((*_node_key(u), idx) for u, idx in v.uses)
        assert uses == expected_uses.get(name, Counter()), name
        for u, idx in v.uses:  # each use points at a node whose input slot holds this value
            assert u.inputs[idx] is not None and u.inputs[idx].name == name
        assert v.is_graph_input == (name in inputs)
        assert v.is_graph_output == (name in outputs)
        assert (v.initializer is not None) == (name in initializers)
        if v.initializer is not None:
            assert v.initializer.name == name
        if name not in produced:
            assert v.producer is None
    assert [v.name for v in g.inputs] == [vi.name for vi in gp.input]
    assert [v.name for v in g.outputs] == [vi.name for vi in gp.output]
    for vi in [*gp.input, *gp.output, *gp.value_info]:
        v = g.value(vi.name)
        assert v is not None
        assert v.dtype == vi.type.tensor_type.elem_type
        assert v.shape == _shape(vi)
    assert g.value("definitely not a value name") is None
    assert g.initializer("definitely not a value name") is None


def assert_tensor_matches(t: Any, proto: TensorProto) -> None:
    expected = numpy_helper.to_array(proto)
    arr = t.numpy()
    assert t.name == proto.name
    assert t.dtype == proto.data_type
    assert tuple(t.shape) == tuple(proto.dims)
    assert arr.dtype == expected.dtype, proto.name
    assert arr.shape == expected.shape, proto.name
    np.testing.assert_array_equal(arr, expected, strict=True, err_msg=proto.name)
    if proto.data_type != TensorProto.STRING:
        assert t.nbytes == expected.nbytes
    assert not t.is_external
    if proto.HasField("raw_data") and expected.size:  # zero copy into the mapped file
        assert not arr.flags.owndata and not arr.flags.writeable


@pytest.mark.parametrize("path", MODELS, ids=IDS)
def test_tensor_values(path: Path) -> None:
    """Every initializer and every tensor attribute decodes to what onnx.numpy_helper decodes."""
    proto = onnx.load(str(path))
    m = fastopt.load(str(path))
    by_name = {t.name: t for t in proto.graph.initializer}
    assert [t.name for t in m.graph.initializers] == [t.name for t in proto.graph.initializer]
    for t in m.graph.initializers:
        assert_tensor_matches(t, by_name[t.name])
        assert_tensor_matches(m.graph.initializer(t.name), by_name[t.name])
    for node, node_proto in zip(m.graph.nodes, proto.graph.node):
        for a in node_proto.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                assert_tensor_matches(node.attributes[a.name], a.t)


def _typed_tensors() -> list[TensorProto]:
    """Tensors stored in every typed field, plus raw_data for the narrow types."""
    rng = np.random.default_rng(0)
    out = [
        helper.make_tensor("f32_float_data", TensorProto.FLOAT, [2, 3], rng.standard_normal(6)),
        helper.make_tensor("f64_double_data", TensorProto.DOUBLE, [4], [1.5, -0.0, math.inf, 1e9]),
        helper.make_tensor("i64_int64_data", TensorProto.INT64, [3], [-(2**62), 0, 2**62]),
        helper.make_tensor("i32_int32_data", TensorProto.INT32, [3], [-(2**31), 2**31 - 1, 0]),
        helper.make_tensor("i16_int32_data", TensorProto.INT16, [3], [-32768, 32767, 1]),
        helper.make_tensor("u16_int32_data", TensorProto.UINT16, [2], [65535, 0]),
        helper.make_tensor("i8_int32_data", TensorProto.INT8, [3], [-128, 127, 0]),
        helper.make_tensor("u8_int32_data", TensorProto.UINT8, [2], [255, 3]),
        helper.make_tensor("bool_int32_data", TensorProto.BOOL, [4], [True, False, True, True]),
        helper.make_tensor(
            "f16_int32_data", TensorProto.FLOAT16, [3], np.array([1.0, -2.5, 65504], np.float16)
        ),
        helper.make_tensor("u32_uint64_data", TensorProto.UINT32, [2], [2**32 - 1, 1]),
        helper.make_tensor("u64_uint64_data", TensorProto.UINT64, [2], [2**64 - 1, 1]),
        helper.make_tensor(
            "str_string_data", TensorProto.STRING, [3], [b"a", b"", "\u00e9\u4e2d".encode()]
        ),
        helper.make_tensor("scalar_float_data", TensorProto.FLOAT, [], [4.0]),
        helper.make_tensor("empty_float_data", TensorProto.FLOAT, [0, 3], []),
        helper.make_tensor("nan_float_data", TensorProto.FLOAT, [2], [math.nan, -math.inf]),
    ]
    for name, arr in {
        "f16_raw": np.array([[0.5, -1], [np.inf, 3]], np.float16),
        "bool_raw": np.array([True, False, False]),
        "f64_raw": np.array([1e-300, -2.0]),
        "u64_raw": np.array([2**64 - 1], np.uint64),
        "i8_raw": np.array([-1, 2, -3], np.int8),
        "scalar_raw": np.array(7, np.int32),
        "empty_raw": np.zeros((2, 0), np.float32),
    }.items():
        out.append(numpy_helper.from_array(arr, name))
    return out


def test_typed_field_tensors(tmp_path: Path) -> None:
    tensors = _typed_tensors()
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], [f"c_{t.name}"], name=f"c_{t.name}", value=t)
            for t in tensors
        ],
        "typed",
        [],
        [helper.make_tensor_value_info("c_f32_float_data", TensorProto.FLOAT, [2, 3])],
        tensors,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "typed.onnx"
    onnx.save_model(model, str(path))
    for m in (fastopt.load(str(path)), fastopt.from_onnx(model)):
        assert len(m.graph.initializers) == len(tensors)
        for t in tensors:
            assert_tensor_matches(m.graph.initializer(t.name), t)
        for node, t in zip(m.graph.nodes, tensors):
            assert_tensor_matches(node.attributes["value"], t)
    out = tmp_path / "out.onnx"
    fastopt.load(str(path)).save(str(out))
    assert_proto_equal(model, onnx.load(str(out)))


def test_attributes() -> None:
    sub = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])],
        "sub",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    node = helper.make_node(
        "Custom",
        ["a", "", "b"],
        ["c", ""],
        name="n",
        domain="my.domain",
        i=3,
        f=0.25,
        s="text",
        ints=[1, -2],
        floats=[0.5],
        strings=["x", "y"],
        t=numpy_helper.from_array(np.array([1, 2], np.int64), "t"),
        g=sub,
        graphs=[sub, sub],
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("a", "b")],
        [],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)]
    )
    n = fastopt.from_onnx(model).graph.nodes[0]
    assert (n.name, n.op_type, n.domain) == ("n", "Custom", "my.domain")
    assert [v.name if v else None for v in n.inputs] == ["a", None, "b"]
    assert [v.name if v else None for v in n.outputs] == ["c", None]
    a = n.attributes
    assert sorted(a) == sorted(["i", "f", "s", "ints", "floats", "strings", "t", "g", "graphs"])
    assert a["i"] == 3 and isinstance(a["i"], int)
    assert a["f"] == 0.25 and isinstance(a["f"], float)
    assert a["s"] in ("text", b"text")
    assert list(a["ints"]) == [1, -2] and list(a["floats"]) == [0.5]
    assert [s.decode() if isinstance(s, bytes) else s for s in a["strings"]] == ["x", "y"]
    np.testing.assert_array_equal(a["t"].numpy(), np.array([1, 2], np.int64))
    assert a["g"].name == "sub" and [s.name for s in a["graphs"]] == ["sub", "sub"]
    assert len(n.subgraphs) == 3
    assert [x.op_type for x in a["g"].nodes] == ["Neg"]


def test_parameter_totals(tmp_path: Path) -> None:
    weights = {"w1": np.ones((3, 4), np.float32), "w2": np.ones(5, np.float16)}
    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_o"]) for n in weights],
        "p",
        [],
        [helper.make_tensor_value_info(f"{n}_o", TensorProto.FLOAT, None) for n in weights],
        [numpy_helper.from_array(a, n) for n, a in weights.items()],
    )
    m = fastopt.from_onnx(helper.make_model(graph))
    assert m.path is None
    assert m.num_parameters() == 17
    assert m.parameter_bytes() == 12 * 4 + 5 * 2


@pytest.mark.parametrize("content", [b"\xff" * 64, b"not a model at all"], ids=["ff", "text"])
def test_load_bad_input_raises(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(fastopt.ModelError):
        fastopt.load(str(path))


def test_load_truncated_and_missing(tmp_path: Path) -> None:
    src = next(p for p in MODELS if p.parent.name == "test_operator_conv")
    data = src.read_bytes()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(fastopt.ModelError):
        fastopt.load(str(path))
    with pytest.raises(fastopt.ModelError):
        fastopt.load(str(tmp_path / "missing.onnx"))
    assert issubclass(fastopt.ModelError, Exception)


# --- CLI ------------------------------------------------------------------------------------------

CLI_MODEL = (corpus_models() or [p for p in MODELS if p.parent.name == "test_operator_conv"])[0]
CLI_COMMANDS = {"module": [sys.executable, "-m", "fastopt"], "script": ["fastopt"]}


def _cli(kind: str, *args: str) -> subprocess.CompletedProcess[str]:
    if kind == "script" and shutil.which("fastopt") is None:
        pytest.skip("the `fastopt` console script is not on PATH")
    return subprocess.run([*CLI_COMMANDS[kind], *args], capture_output=True, text=True, timeout=120)


def _contains(obj: Any, wanted: Any) -> bool:
    if obj == wanted:
        return True
    if isinstance(obj, dict):
        return any(_contains(v, wanted) for v in obj.values())
    if isinstance(obj, list):
        return any(_contains(v, wanted) for v in obj)
    return False


@pytest.mark.parametrize("kind", list(CLI_COMMANDS))
def test_cli_info(kind: str) -> None:
    proc = _cli(kind, "info", str(CLI_MODEL))
    assert proc.returncode == 0, proc.stderr
    counts = fastopt.load(str(CLI_MODEL)).op_counts()
    n_nodes = len(onnx.load(str(CLI_MODEL)).graph.node)
    assert str(n_nodes) in proc.stdout
    lines = proc.stdout.splitlines()
    for op, count in counts.items():
        assert any(op in line and str(count) in line.replace(op, "") for line in lines), op


@pytest.mark.parametrize("kind", list(CLI_COMMANDS))
def test_cli_info_json(kind: str) -> None:
    proc = _cli(kind, "info", "--json", str(CLI_MODEL))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert isinstance(info, dict)
    assert _contains(info, fastopt.load(str(CLI_MODEL)).op_counts()), "op histogram"
    assert _contains(info, len(onnx.load(str(CLI_MODEL)).graph.node)), "node count"


@pytest.mark.parametrize("kind", list(CLI_COMMANDS))
def test_cli_bad_input(kind: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\xff" * 64)
    for target in (bad, tmp_path / "missing.onnx"):
        proc = _cli(kind, "info", str(target))
        assert proc.returncode != 0
        assert proc.stderr.startswith("error: "), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
