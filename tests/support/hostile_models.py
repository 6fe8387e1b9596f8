"""A corpus of hostile models: files that fastopt's reader accepts (they are well-formed
protobuf) but that onnx, protobuf or ONNX Runtime refuse, each for another reason. Used by
tests/safety/test_foreign_errors.py to check that no entry point lets a foreign exception escape."""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto, helper

from support.wire import f_len

F = TensorProto.FLOAT
X = helper.make_tensor_value_info("x", F, [2, 3])
Y = helper.make_tensor_value_info("y", F, [2, 3])
OPSET = [helper.make_opsetid("", 17)]


def _model(nodes: list[onnx.NodeProto], **kw: object) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        kw.pop("inputs", [X]),  # type: ignore[arg-type]
        kw.pop("outputs", [Y]),  # type: ignore[arg-type]
        initializer=kw.pop("initializer", None),  # type: ignore[arg-type]
    )
    kw.setdefault("opset_imports", OPSET)
    kw.setdefault("ir_version", 9)
    return helper.make_model(graph, **kw)  # type: ignore[arg-type]


def missing_opset_import() -> bytes:
    """A node of domain com.example, which the model does not import: "No opset import for
    domain"."""
    return _model(
        [helper.make_node("Gadget", ["x"], ["y"], domain="com.example")]
    ).SerializeToString()


def _function(name: str, body: list[onnx.NodeProto]) -> onnx.FunctionProto:
    return helper.make_function("local", name, ["a"], ["b"], body, OPSET)


def recursive_function() -> bytes:
    """A model-local function that calls itself."""
    f = _function("Loopy", [helper.make_node("Loopy", ["a"], ["b"], domain="local")])
    return _model(
        [helper.make_node("Loopy", ["x"], ["y"], domain="local")],
        functions=[f],
        opset_imports=[*OPSET, helper.make_opsetid("local", 1)],
    ).SerializeToString()


def duplicate_functions() -> bytes:
    """Two model-local functions with the same domain and name."""
    f1 = _function("Twice", [helper.make_node("Relu", ["a"], ["b"])])
    f2 = _function("Twice", [helper.make_node("Neg", ["a"], ["b"])])
    return _model(
        [helper.make_node("Twice", ["x"], ["y"], domain="local")],
        functions=[f1, f2],
        opset_imports=[*OPSET, helper.make_opsetid("local", 1)],
    ).SerializeToString()


def matmul_without_inputs() -> bytes:
    """MatMul with no inputs: onnx's inference "MatMul input 0 out of bounds"."""
    return _model(
        [helper.make_node("MatMul", [], ["m"]), helper.make_node("Add", ["x", "m"], ["y"])]
    ).SerializeToString()


def matmul_shape_mismatch() -> bytes:
    """MatMul of [2, 3] by [4, 5]: inner dimensions differ."""
    w = helper.make_tensor("w", F, [4, 5], [0.0] * 20)
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        initializer=[w],
        outputs=[helper.make_tensor_value_info("y", F, [2, 5])],
    ).SerializeToString()


def _with_graph_fields(model: onnx.ModelProto, graph_fields: bytes) -> bytes:
    """`model`'s bytes with more GraphProto fields merged into its graph (protobuf merges a
    repeated message field into the one before). Written by hand: protobuf itself refuses to
    build messages nested past its depth limit."""
    return model.SerializeToString() + f_len(7, graph_fields)


def deep_if(depth: int = 34) -> bytes:
    """If nodes nested `depth` deep (each level is three protobuf messages): past protobuf's
    parse depth limit of 100, so onnx cannot read the file back."""
    leaf = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y0"])],
        "leaf",
        [],
        [helper.make_tensor_value_info("y0", F, [2, 3])],
    ).SerializeToString()
    graph, node = leaf, b""
    for i in range(depth):
        # NodeProto: input 1, output 2, op_type 4, attribute 5; AttributeProto: name 1, g 6,
        # type 20 (GRAPH = 5); GraphProto: node 1, name 2, output 12.
        attrs = b"".join(
            f_len(5, f_len(1, name.encode()) + f_len(6, g) + bytes([0xA0, 0x01, 5]))
            for name, g in (("then_branch", graph), ("else_branch", leaf))
        )
        node = f_len(1, b"c") + f_len(2, f"y{i + 1}".encode()) + f_len(4, b"If") + attrs
        out = helper.make_tensor_value_info(f"y{i + 1}", F, [2, 3]).SerializeToString()
        graph = f_len(1, node) + f_len(2, f"g{i}".encode()) + f_len(12, out)
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    top = helper.make_tensor_value_info(f"y{depth}", F, [2, 3])
    # The main graph holds the outermost If node.
    return _with_graph_fields(_model([], inputs=[X, cond], outputs=[top]), f_len(1, node))


def deep_type(depth: int = 52) -> bytes:
    """A graph input of type sequence(sequence(... tensor)) `depth` deep (each level is two
    protobuf messages): past protobuf's parse depth limit."""
    # TypeProto: tensor_type 1 (elem_type 1), sequence_type 4 (elem_type 1).
    t = f_len(1, bytes([0x08, F]))
    for _ in range(depth):
        t = f_len(4, f_len(1, t))
    value_info = f_len(1, b"s") + f_len(2, t)
    return _with_graph_fields(
        _model([helper.make_node("Relu", ["x"], ["y"])]), f_len(11, value_info)
    )


def invalid_tensor_dtype() -> bytes:
    """A graph input whose element type (99) is no ONNX type."""
    bad = helper.make_tensor_value_info("z", F, [2, 3])
    bad.type.tensor_type.elem_type = 99
    return _model([helper.make_node("Relu", ["x"], ["y"])], inputs=[X, bad]).SerializeToString()


def invalid_initializer_dtype() -> bytes:
    """An initializer whose data_type (99) is no ONNX type."""
    w = helper.make_tensor("w", F, [2, 3], [0.0] * 6)
    w.data_type = 99
    w.ClearField("float_data")
    w.raw_data = b"\0" * 24
    return _model([helper.make_node("Add", ["x", "w"], ["y"])], initializer=[w]).SerializeToString()


def wrong_attribute_type() -> bytes:
    """Softmax whose axis is a string: onnx and ORT refuse the model."""
    node = helper.make_node("Softmax", ["x"], ["y"])
    node.attribute.append(helper.make_attribute("axis", "minus one"))
    return _model([node]).SerializeToString()


def unknown_op() -> bytes:
    """An op the default domain does not have."""
    return _model([helper.make_node("NoSuchOp", ["x"], ["y"])]).SerializeToString()


def type_mismatch() -> bytes:
    """Add of a float and an int64 tensor."""
    i = helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3])
    return _model([helper.make_node("Add", ["x", "i"], ["y"])], inputs=[X, i]).SerializeToString()


HOSTILE: dict[str, Callable[[], bytes]] = {
    "missing_opset_import": missing_opset_import,
    "recursive_function": recursive_function,
    "duplicate_functions": duplicate_functions,
    "matmul_without_inputs": matmul_without_inputs,
    "matmul_shape_mismatch": matmul_shape_mismatch,
    "deep_if": deep_if,
    "deep_type": deep_type,
    "invalid_tensor_dtype": invalid_tensor_dtype,
    "invalid_initializer_dtype": invalid_initializer_dtype,
    "wrong_attribute_type": wrong_attribute_type,
    "unknown_op": unknown_op,
    "type_mismatch": type_mismatch,
}
