"""Models and runs that more than one test file uses (from test_bad_input, test_file_safety)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from support.wire import (
    EGROUP_WT,
    LEN_WT,
    SGROUP_WT,
    f_len,
    f_str,
    f_varint,
    key,
    varint,
)

OPSET = f_len(8, f_varint(2, 21))  # ModelProto.opset_import { version: 21 }


def model_from_graph(graph: bytes) -> bytes:
    """ModelProto{ir_version: 10, graph, opset_import} with `graph` as its encoded payload."""
    return f_varint(1, 10) + f_len(7, graph) + OPSET


def wire_node(op: str, inputs: list[str], outputs: list[str], extra: bytes = b"") -> bytes:
    body = b"".join(f_str(1, i) for i in inputs) + b"".join(f_str(2, o) for o in outputs)
    return body + f_str(4, op) + extra


def add_model(*initializers: TensorProto) -> onnx.ModelProto:
    """Y = X + W, X and W float [2, 3]; W is the given initializer or a raw_data one."""
    inits = list(initializers) or [
        numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "W")
    ]
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["Y"], name="add")],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])],
        inits,
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def nested_graph_model(depth: int) -> bytes:
    """graph{node{attribute{g: graph{node{attribute{g: ...}}}}}} `depth` levels deep."""
    inner = b""
    prefixes: list[bytes] = []
    length = 0
    for _ in range(depth):
        a_pre = f_str(1, "g") + f_varint(20, 5) + key(6, LEN_WT) + varint(length)
        attr_len = len(a_pre) + length
        n_pre = f_str(4, "If") + key(5, LEN_WT) + varint(attr_len)
        node_len = len(n_pre) + attr_len
        g_pre = key(1, LEN_WT) + varint(node_len)
        length = len(g_pre) + node_len
        prefixes.append(g_pre + n_pre + a_pre)
    graph = b"".join(reversed(prefixes)) + inner
    assert len(graph) == length
    return f_varint(1, 10) + f_len(7, graph) + OPSET


def nested_type_model(depth: int) -> bytes:
    """A graph input of type sequence(sequence(...(tensor)))."""
    t = f_len(1, f_varint(1, TensorProto.FLOAT))  # TypeProto{tensor_type{elem_type}}
    prefixes: list[bytes] = []
    length = len(t)
    for _ in range(depth):
        pre = key(4, LEN_WT) + varint(length + len(key(1, LEN_WT) + varint(length)))
        pre += key(1, LEN_WT) + varint(length)
        length += len(pre)
        prefixes.append(pre)
    typ = b"".join(reversed(prefixes)) + t
    g = (
        f_len(1, wire_node("Identity", ["S"], ["Y"]))
        + f_len(11, f_str(1, "S") + f_len(2, typ))
        + f_len(12, f_str(1, "Y") + f_len(2, typ))
    )
    return model_from_graph(g)


def nested_group_model(depth: int) -> bytes:
    return (
        add_model().SerializeToString() + key(900, SGROUP_WT) * depth + key(900, EGROUP_WT) * depth
    )


def weights(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal(64).astype(
        np.float32
    )


def make_model(folder: Path, seed: int = 0, name: str = "model.onnx") -> Path:
    """folder/model.onnx with W [64, 64] and B [64] in folder/model.onnx.data."""
    w, b = weights(seed)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "B"], ["Y"]),
        ],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        m, str(folder / name), save_as_external_data=True, location=name + ".data", size_threshold=0
    )
    return folder / name
