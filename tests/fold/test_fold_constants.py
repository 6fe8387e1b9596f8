"""fold_constants (native, C++) and fold_constants_ort (ONNX Runtime fallback).

Every folding case checks that the op is gone and that ONNX Runtime (optimizations off) gives
bit-identical outputs on the original and the folded model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.folding_helpers import assert_parity, make_model, op_counts, optimize, out

I64_MAX = np.iinfo(np.int64).max
I64_MIN = np.iinfo(np.int64).min


def i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def f32(*v: float) -> np.ndarray:
    return np.array(v, dtype=np.float32)


def arange(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) - 3).astype(dtype).reshape(shape)


@dataclass
class Case:
    """Nodes computing "Y" from constants; the graph output Z = Identity(Y)."""

    id: str
    nodes: list[onnx.NodeProto]
    inits: dict[str, np.ndarray]
    elem_type: int
    opset: int = 17
    folded: list[str] = field(default_factory=list)  # op types that must be gone (default: all)


def node(op: str, inputs: list[str], outputs: list[str] | None = None, **attrs: object):
    return helper.make_node(op, inputs, outputs or ["Y"], **attrs)


F, INT, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
CASES = [
    Case("shape", [node("Shape", ["A"])], {"A": arange((2, 3, 4))}, INT),
    Case("shape_start_end", [node("Shape", ["A"], start=1, end=-1)], {"A": arange((2, 3, 4))}, INT),
    Case("size", [node("Size", ["A"])], {"A": arange((2, 3, 4))}, INT),
    Case("gather", [node("Gather", ["A", "i"])], {"A": i64(5, 6, 7, 8), "i": i64(0, -1, 2)}, INT),
    Case(
        "gather_2d_indices_axis1",
        [node("Gather", ["A", "i"], axis=1)],
        {"A": arange((3, 4)), "i": np.array([[0, -1], [2, 3]], np.int64)},
        F,
    ),
    Case(
        "gather_scalar_index",
        [node("Gather", ["A", "i"], axis=-1)],
        {"A": arange((3, 4)), "i": np.array(2, np.int32)},
        F,
    ),
    Case(
        "unsqueeze_attr_opset11",
        [node("Unsqueeze", ["A"], axes=[0, -1])],
        {"A": i64(1, 2, 3)},
        INT,
        opset=11,
    ),
    Case(
        "unsqueeze_input", [node("Unsqueeze", ["A", "ax"])], {"A": i64(1, 2), "ax": i64(1, -1)}, INT
    ),
    Case(
        "squeeze_attr_opset11",
        [node("Squeeze", ["A"], axes=[0])],
        {"A": arange((1, 3, 1))},
        F,
        opset=11,
    ),
    Case(
        "squeeze_input", [node("Squeeze", ["A", "ax"])], {"A": arange((1, 3, 1)), "ax": i64(-1)}, F
    ),
    Case("squeeze_all", [node("Squeeze", ["A"])], {"A": arange((1, 3, 1))}, F),
    Case("concat", [node("Concat", ["A", "B"], axis=0)], {"A": i64(1, 2), "B": i64(3, 4, 5)}, INT),
    Case(
        "concat_negative_axis",
        [node("Concat", ["A", "B", "A"], axis=-1)],
        {"A": arange((2, 1)), "B": arange((2, 3))},
        F,
    ),
    Case(
        "cast_float_to_int32",
        [node("Cast", ["A"], to=TensorProto.INT32)],
        {"A": f32(-2.7, 2.7, 0.5, -0.5, 1e9)},
        TensorProto.INT32,
    ),
    Case(
        "cast_int64_to_float_rounds",
        [node("Cast", ["A"], to=F)],
        {"A": i64(2**53 + 1, -3, 16777217, 2**62 + 2**38 + 1)},
        F,
    ),
    Case(
        "cast_int64_to_int8_wraps",
        [node("Cast", ["A"], to=TensorProto.INT8)],
        {"A": i64(300, -200, 127, -129)},
        TensorProto.INT8,
    ),
    Case(
        "cast_double_to_float",
        [node("Cast", ["A"], to=F)],
        {"A": np.array([0.1, 1e-40, 3.4e38, -0.0, 1 / 3], np.float64)},
        F,
    ),
    Case(
        "cast_float16_to_float",
        [node("Cast", ["A"], to=F)],
        {"A": np.array([0.1, 65504, 6e-8, -2.5], np.float16)},
        F,
    ),
    Case("cast_to_bool", [node("Cast", ["A"], to=B)], {"A": i64(0, 2, -1)}, B),
    Case("cast_bool_to_float", [node("Cast", ["A"], to=F)], {"A": np.array([True, False])}, F),
    Case("cast_same_type", [node("Cast", ["A"], to=INT)], {"A": i64(4, 5)}, INT),
    Case("castlike", [node("CastLike", ["A", "B"])], {"A": i64(3, -4), "B": f32(0)}, F),
    Case("reshape", [node("Reshape", ["A", "s"])], {"A": arange((2, 3, 4)), "s": i64(0, -1)}, F),
    Case(
        "reshape_allowzero",
        [node("Reshape", ["A", "s"], allowzero=1)],
        {"A": np.zeros((0, 4), np.float32), "s": i64(2, 0, 2)},
        F,
    ),
    Case("flatten", [node("Flatten", ["A"], axis=2)], {"A": arange((2, 3, 4))}, F),
    Case(
        "slice_steps_and_clamping",
        [node("Slice", ["A", "s", "e", "ax", "st"])],
        {
            "A": arange((4, 5)),
            "s": i64(1, 4),
            "e": i64(I64_MAX, 0),
            "ax": i64(0, -1),
            "st": i64(2, -2),
        },
        F,
    ),
    Case(
        "slice_reverse_all",
        [node("Slice", ["A", "s", "e", "ax", "st"])],
        {"A": i64(1, 2, 3, 4), "s": i64(-1), "e": i64(I64_MIN), "ax": i64(0), "st": i64(-1)},
        INT,
    ),
    Case(
        "slice_opset9_attributes",
        [node("Slice", ["A"], starts=[1], ends=[3], axes=[1])],
        {"A": arange((2, 4))},
        F,
        opset=9,
    ),
    Case("transpose", [node("Transpose", ["A"], perm=[2, 0, 1])], {"A": arange((2, 3, 4))}, F),
    Case("transpose_default", [node("Transpose", ["A"])], {"A": arange((2, 3))}, F),
    Case(
        "add_int64_broadcast",
        [node("Add", ["A", "B"])],
        {"A": np.array([[1], [2]], np.int64), "B": i64(10, 20, 30)},
        INT,
    ),
    Case("sub_float", [node("Sub", ["A", "B"])], {"A": f32(0.1, 1e30), "B": f32(0.2, 1e-30)}, F),
    Case(
        "mul_int32_wraps",
        [node("Mul", ["A", "B"])],
        {"A": np.array([2**30, 3], np.int32), "B": np.array([4, -5], np.int32)},
        TensorProto.INT32,
    ),
    Case(
        "div_int_truncates",
        [node("Div", ["A", "B"])],
        {"A": i64(-7, 7, -8), "B": i64(2, -2, 3)},
        INT,
    ),
    Case("div_float", [node("Div", ["A", "B"])], {"A": f32(1, 2, 3), "B": f32(3, 7, 9)}, F),
    Case(
        "div_double",
        [node("Div", ["A", "B"])],
        {"A": np.array([1.0, 2.0]), "B": np.array([3.0, 7.0])},
        TensorProto.DOUBLE,
    ),
    Case("neg_int", [node("Neg", ["A"])], {"A": i64(3, -4, I64_MIN)}, INT),
    Case("neg_float", [node("Neg", ["A"])], {"A": f32(0.0, -1.5)}, F),
    Case("abs_int32", [node("Abs", ["A"])], {"A": np.array([-3, 4], np.int32)}, TensorProto.INT32),
    Case("not", [node("Not", ["A"])], {"A": np.array([True, False])}, B),
    Case("equal", [node("Equal", ["A", "B"])], {"A": i64(1, 2, 3), "B": i64(2)}, B),
    Case("less_float", [node("Less", ["A", "B"])], {"A": f32(1, 2, 3), "B": f32(2)}, B),
    Case("greater", [node("Greater", ["A", "B"])], {"A": i64(1, 2, 3), "B": i64(2)}, B),
    Case("less_or_equal", [node("LessOrEqual", ["A", "B"])], {"A": f32(1, 2, 3), "B": f32(2)}, B),
    Case(
        "greater_or_equal",
        [node("GreaterOrEqual", ["A", "B"])],
        {"A": i64(1, 2, 3), "B": i64(2)},
        B,
    ),
    Case(
        "and_or_xor",
        [node("And", ["A", "B"], ["t"]), node("Or", ["t", "B"], ["u"]), node("Xor", ["u", "A"])],
        {"A": np.array([True, False, True]), "B": np.array([True, True, False])},
        B,
    ),
    Case(
        "where_broadcast",
        [node("Where", ["c", "A", "B"])],
        {"c": np.array([[True], [False]]), "A": arange((1, 3)), "B": f32(9)},
        F,
    ),
    Case(
        "range",
        [node("Range", ["a", "b", "d"])],
        {"a": i64(2)[0], "b": i64(11)[0], "d": i64(3)[0]},
        INT,
    ),
    Case(
        "range_negative_delta",
        [node("Range", ["a", "b", "d"])],
        {"a": np.array(10, np.int32), "b": np.array(4, np.int32), "d": np.array(-2, np.int32)},
        TensorProto.INT32,
    ),
    Case(
        "range_empty",
        [node("Range", ["a", "b", "d"])],
        {"a": np.array(5), "b": np.array(1), "d": np.array(1)},
        INT,
    ),
    Case("constant_of_shape", [node("ConstantOfShape", ["s"])], {"s": i64(2, 3)}, F),
    Case(
        "constant_of_shape_value",
        [node("ConstantOfShape", ["s"], value=numpy_helper.from_array(i64(7)))],
        {"s": i64(4)},
        INT,
    ),
    Case("expand", [node("Expand", ["A", "s"])], {"A": arange((3, 1)), "s": i64(2, 1, 4)}, F),
    Case(
        "one_hot_negative_and_out_of_range",
        [node("OneHot", ["I", "d", "v"])],
        {"I": i64(0, 3, -1, 7, -5), "d": i64(4)[0], "v": i64(0, 1)},
        INT,
    ),
    Case(
        "one_hot_axis0_float_values",
        [node("OneHot", ["I", "d", "v"], axis=0)],
        {"I": np.array([[1, 0], [2, 2]]), "d": i64(3), "v": f32(-0.5, 2.5)},
        F,
    ),
    Case(
        "one_hot_middle_axis_opset9",
        [node("OneHot", ["I", "d", "v"], axis=1)],
        {"I": np.array([[1, 0, 2], [2, 2, 0]]), "d": i64(3)[0], "v": i64(5, 9)},
        INT,
        opset=9,
    ),
    Case(
        "sqrt_float",
        [node("Sqrt", ["A"])],
        {"A": f32(0.0, 2.0, 1e-40, np.inf, 0.5, 3.0e38, 7.0)},
        F,
    ),
    Case(
        "sqrt_double",
        [node("Sqrt", ["A"])],
        {"A": np.array([2.0, 1e-310, 10.0])},
        TensorProto.DOUBLE,
    ),
    Case(
        "max_variadic",
        [node("Max", ["A", "B", "C"])],
        {"A": i64(1, 5), "B": i64(3), "C": i64(2, 2)},
        INT,
    ),
    Case("min", [node("Min", ["A", "B"])], {"A": f32(1, 5), "B": f32(3)}, F),
    Case(
        "constant_nodes",
        [
            helper.make_node("Constant", [], ["c1"], value=numpy_helper.from_array(i64(1, 2))),
            helper.make_node("Constant", [], ["c2"], value_ints=[3, 4]),
            helper.make_node("Constant", [], ["c3"], value_int=5),
            node("Concat", ["c1", "c2"], ["t"], axis=0),
            node("Add", ["t", "c3"]),
        ],
        {},
        INT,
    ),
    Case(
        "shape_chain",
        [
            node("Shape", ["A"], ["s"]),
            node("Gather", ["s", "i"], ["g"]),
            node("Unsqueeze", ["g", "zero"], ["u"]),
            node("Concat", ["u", "m1"], ["c"], axis=0),
            node("Cast", ["c"], ["f"], to=F),
            node("Reshape", ["A", "c"], ["r"]),
            node("Shape", ["r"], ["rs"]),
            node("Cast", ["rs"], ["rf"], to=F),
            node("Add", ["f", "rf"]),
        ],
        {"A": arange((2, 3, 4)), "i": i64(1)[0], "zero": i64(0), "m1": i64(-1)},
        F,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_folds_natively_with_parity(case: Case, tmp_path: Path) -> None:
    nodes = [*case.nodes, helper.make_node("Identity", ["Y"], ["Z"])]
    model = make_model(nodes, [], [out("Z", case.elem_type)], case.inits, case.opset)
    report, path = optimize(model, ["fold_constants"], tmp_path)
    assert op_counts(path) == {"Identity": 1}, report.passes[0].counters
    assert report.passes[0].rewrites >= 1
    assert_parity(model, path, tmp_path, feeds={})
    # Idempotent: nothing left to do.
    again = fastopt.optimize(fastopt.load(path), passes=["fold_constants"])
    assert again.rewrites == 0


def test_graph_output_keeps_its_name(tmp_path: Path) -> None:
    model = make_model(
        [node("Add", ["A", "B"])], [], [out("Y", INT, [2])], {"A": i64(1, 2), "B": i64(3, 4)}
    )
    report, path = optimize(model, ["fold_constants"], tmp_path)
    proto = onnx.load(str(path))
    assert [n.op_type for n in proto.graph.node] == ["Constant"]
    assert [o.name for o in proto.graph.output] == ["Y"]
    assert report.passes[0].counters == {"folded_Add": 1}
    assert_parity(model, path, tmp_path, feeds={})


def test_constant_becomes_initializer_without_copy(tmp_path: Path) -> None:
    value = arange((16, 16))
    model = make_model(
        [
            helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(value)),
            node("Add", ["X", "c"]),
        ],
        [out("X", F, [16, 16])],
        [out("Y", F, [16, 16])],
    )
    m = fastopt.from_onnx(model)
    attr = m.graph.nodes[0].attributes["value"]
    before = np.asarray(attr.raw_bytes()).__array_interface__["data"][0]
    report = fastopt.optimize(m, passes=["fold_constants"])
    assert report.ops_after == {"Add": 1}
    (init,) = m.graph.initializers
    assert np.asarray(init.raw_bytes()).__array_interface__["data"][0] == before
    np.testing.assert_array_equal(init.numpy(), value)


def test_reshape_of_a_weight_shares_its_bytes(tmp_path: Path) -> None:
    w = arange((512, 1024))  # 2 MB: over the size cap, but a view copies nothing
    model = make_model(
        [node("Reshape", ["W", "s"], ["r"]), node("Add", ["X", "r"])],
        [out("X", F, [1024, 512])],
        [out("Y", F, [1024, 512])],
        {"W": w, "s": i64(1024, 512)},
    )
    m = fastopt.from_onnx(model)
    address = np.asarray(m.graph.initializer("W").raw_bytes()).__array_interface__["data"][0]
    fastopt.optimize(m, passes=["fold_constants", "eliminate_dead_nodes"])
    assert m.op_counts() == {"Add": 1}
    (init,) = m.graph.initializers
    assert init.shape == (1024, 512)
    assert np.asarray(init.raw_bytes()).__array_interface__["data"][0] == address


def test_view_of_a_shared_big_weight_is_not_duplicated() -> None:
    w = arange((512, 1024))
    model = make_model(
        [
            node("Reshape", ["W", "s"], ["r"]),
            node("Add", ["X", "r"], ["y1"]),
            node("Add", ["W", "W"], ["Y"]),
        ],
        [out("X", F, [1024, 512])],
        [out("Y", F, [512, 1024]), out("y1", F, [1024, 512])],
        {"W": w, "s": i64(1024, 512)},
    )
    m = fastopt.from_onnx(model)
    report = fastopt.optimize(m, passes=["fold_constants"])
    assert report.ops_after["Reshape"] == 1


def test_in_subgraph(tmp_path: Path) -> None:
    then = helper.make_graph(
        [
            node("Add", ["A", "B"], ["t"]),
            node("Mul", ["t", "X"], ["t2"]),
            node("Sub", ["t2", "k"], ["o"]),
        ],
        "then",
        [],
        [out("o", F, [2])],
        [numpy_helper.from_array(f32(10, 20), "B")],
    )
    other = helper.make_graph([node("Identity", ["X"], ["e"])], "else", [], [out("e", F, [2])])
    model = make_model(
        [
            helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(f32(0.5, 2))),
            node("If", ["c"], ["Y"], then_branch=then, else_branch=other),
        ],
        [out("c", B, []), out("X", F, [2])],
        [out("Y", F, [2])],
        {"A": f32(1, 2)},
    )
    report, path = optimize(model, ["fold_constants"], tmp_path)
    assert report.passes[0].counters == {"folded_Add": 1, "lifted_Constant": 1}
    assert op_counts(path) == {"If": 1, "Mul": 1, "Sub": 1, "Identity": 1}
    for cond in (True, False):
        feeds = {"c": np.array(cond), "X": f32(3, 4)}
        assert_parity(model, path, tmp_path, feeds=feeds)


def test_in_function_body_constants_stay_nodes(tmp_path: Path) -> None:
    fn = helper.make_function(
        "local",
        "F",
        ["x"],
        ["y"],
        [
            helper.make_node("Constant", [], ["a"], value=numpy_helper.from_array(f32(1, 2))),
            helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(f32(3, 4))),
            node("Add", ["a", "b"], ["s"]),
            node("Mul", ["x", "s"], ["y"]),
        ],
        [helper.make_opsetid("", 17)],
    )
    model = make_model(
        [helper.make_node("F", ["X"], ["Y"], domain="local")],
        [out("X", F, [2])],
        [out("Y", F, [2])],
        functions=[fn],
        extra_opsets=[helper.make_opsetid("local", 1)],
    )
    report, path = optimize(model, ["fold_constants"], tmp_path)
    body = onnx.load(str(path)).functions[0]
    assert [n.op_type for n in body.node] == ["Constant", "Mul"]
    assert report.passes[0].counters == {"folded_Add": 1}
    assert_parity(model, path, tmp_path)


def test_ir_version_3_gets_constant_nodes(tmp_path: Path) -> None:
    # Before IR version 4 every initializer is also a graph input (overridable): folded values
    # and Constant nodes stay Constant nodes.
    model = make_model(
        [
            helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(f32(2, 3))),
            node("Mul", ["k", "k"], ["s"]),
            node("Add", ["X", "s"]),
        ],
        [out("X", F, [2])],
        [out("Y", F, [2])],
        opset=8,
    )
    model.ir_version = 3
    _, path = optimize(model, ["fold_constants"], tmp_path)
    assert op_counts(path) == {"Constant": 1, "Add": 1}
    assert not onnx.load(str(path)).graph.initializer
    assert_parity(model, path, tmp_path)


# ---- must not fold ----


def test_graph_inputs_and_overridable_initializers_are_not_constants(tmp_path: Path) -> None:
    model = make_model(
        [node("Add", ["X", "C"], ["a"]), node("Mul", ["W", "C"], ["Y"])],
        [out("X", INT, [2]), out("W", INT, [2])],
        [out("Y", INT, [2]), out("a", INT, [2])],
        {"C": i64(1, 2), "W": i64(5, 6)},  # W is an initializer and a graph input
    )
    report, path = optimize(model, ["fold_constants"], tmp_path)
    assert report.rewrites == 0
    assert op_counts(path) == {"Add": 1, "Mul": 1}


@pytest.mark.parametrize(
    ("nodes", "inits", "options", "folds"),
    [
        # 4 MB: over fold_max_bytes.
        ([node("ConstantOfShape", ["s"])], {"s": i64(1024, 1024)}, {}, False),
        # 66 KB from 16 bytes: a small constant is not expanded into a bigger one...
        ([node("ConstantOfShape", ["s"])], {"s": i64(129, 128)}, {}, False),
        # ...unless allowed; 64 KB is within the default.
        (
            [node("ConstantOfShape", ["s"])],
            {"s": i64(129, 128)},
            {"fold_max_expand_bytes": 1 << 20},
            True,
        ),
        ([node("ConstantOfShape", ["s"])], {"s": i64(128, 128)}, {}, True),
        ([node("Expand", ["A", "s"])], {"A": f32(1), "s": i64(1024, 1024)}, {}, False),
        (
            [node("Range", ["a", "b", "d"])],
            {"a": np.array(0), "b": np.array(1 << 20), "d": np.array(1)},
            {},
            False,
        ),
        # Not growing, but over an explicit cap.
        (
            [node("Concat", ["A", "A"], axis=0)],
            {"A": arange((64,))},
            {"fold_max_bytes": 256},
            False,
        ),
    ],
    ids=[
        "cos_4mb",
        "cos_66kb",
        "cos_66kb_allowed",
        "cos_64kb",
        "expand_4mb",
        "range_8mb",
        "concat_cap",
    ],
)
def test_size_limits(nodes: list, inits: dict, options: dict, folds: bool, tmp_path: Path) -> None:
    model = make_model([*nodes, node("Shape", ["Y"], ["Z"])], [], [out("Z", INT, [None])], inits)
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["fold_constants"], options=options)
    assert (nodes[0].op_type not in report.ops_after) == folds


@pytest.mark.parametrize(
    ("nodes", "inits"),
    [
        ([node("Div", ["A", "B"])], {"A": i64(1, 2), "B": i64(1, 0)}),  # integer division by 0
        ([node("Cast", ["A"], to=TensorProto.INT32)], {"A": f32(1, np.nan)}),  # undefined
        ([node("Cast", ["A"], to=TensorProto.INT32)], {"A": f32(3e9)}),  # out of range
        ([node("Add", ["A", "A"])], {"A": np.array([1, 2], np.float16)}),  # left to ORT
        ([node("Sqrt", ["A"])], {"A": np.array([2], np.float16)}),  # left to ORT
        (
            [node("OneHot", ["I", "d", "v"])],  # indices of rank 0: invalid
            {"I": i64(1)[0], "d": i64(2), "v": f32(0, 1)},
        ),
        (
            [node("OneHot", ["I", "d", "v"])],  # int32 indices: left to ORT
            {"I": np.array([1], np.int32), "d": i64(2), "v": f32(0, 1)},
        ),
        (
            [node("Range", ["a", "b", "d"])],
            {
                "a": np.array(0.0, np.float32),
                "b": np.array(1.0, np.float32),
                "d": np.array(0.1, np.float32),
            },
        ),
        ([node("RandomUniformLike", ["A"])], {"A": f32(1, 2)}),
        (
            [node("Slice", ["A", "s", "e", "ax", "st"])],
            {"A": i64(1, 2), "s": i64(0), "e": i64(1), "ax": i64(0), "st": i64(0)},
        ),
        ([helper.make_node("Add", ["A", "A"], ["Y"], domain="custom")], {"A": f32(1)}),
    ],
    ids=[
        "div_by_zero",
        "cast_nan",
        "cast_overflow",
        "float16_add",
        "float16_sqrt",
        "one_hot_scalar_indices",
        "one_hot_int32_indices",
        "float_range",
        "random",
        "slice_step0",
        "custom_domain",
    ],
)
def test_does_not_fold_natively(nodes: list, inits: dict) -> None:
    model = make_model(
        [*nodes, node("Identity", ["Y"], ["Z"])],
        [],
        [out("Z", F)],
        inits,
        extra_opsets=[helper.make_opsetid("custom", 1)],
    )
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["fold_constants"])
    assert report.rewrites == 0


def test_node_with_subgraph_is_not_folded() -> None:
    branch = helper.make_graph([node("Identity", ["A"], ["o"])], "b", [], [out("o", F, [1])])
    model = make_model(
        [node("If", ["c"], ["Y"], then_branch=branch, else_branch=branch)],
        [],
        [out("Y", F, [1])],
        {"c": np.array(True), "A": f32(1)},
    )
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=["fold_constants", "fold_constants_ort"]
    )
    assert report.ops_after["If"] == 1


# ---- the ONNX Runtime fallback ----


def test_ort_fallback_folds_what_native_folding_leaves(tmp_path: Path) -> None:
    nodes = [
        node("Pow", ["A", "A"], ["r"]),  # no native implementation
        node("Unsqueeze", ["r", "zero"], ["u"]),  # native, but downstream of Pow
        node("Split", ["B"], ["s1", "s2"], axis=0),  # two outputs
        node("Add", ["s1", "s2"], ["h"]),  # float16: left to ONNX Runtime
        node("Cast", ["h"], ["hc"], to=F),
        node("Range", ["a", "b", "d"], ["fr"]),  # float range
        node("Concat", ["u", "hc", "fr"], ["Y"], axis=0),
        node("Add", ["X", "Y"], ["Z"]),
    ]
    inits = {
        "A": np.array(2.0, np.float32),
        "zero": i64(0),
        "B": np.array([1.5, 2.25], np.float16),
        "a": np.array(0.0, np.float32),
        "b": np.array(1.0, np.float32),
        "d": np.array(0.3, np.float32),
    }
    model = make_model(nodes, [out("X", F, [6])], [out("Z", F, [6])], inits)
    report, path = optimize(model, ["fold_constants", "fold_constants_ort"], tmp_path)
    assert op_counts(path) == {"Add": 1}
    ort_pass = report.passes[1]
    assert ort_pass.counters["folded_Concat"] == 1
    assert_parity(model, path, tmp_path)
    again = fastopt.optimize(fastopt.load(path), passes=["fold_constants", "fold_constants_ort"])
    assert again.rewrites == 0


def test_ort_fallback_one_node_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastopt.passes import fold_constants_ort as mod

    real = mod._run
    calls: list[int] = []

    def run(nodes: list, outputs: list | None = None) -> dict:
        calls.append(len(nodes))
        if len(nodes) > 1:
            raise RuntimeError("batch refused")
        return real(nodes, outputs)

    monkeypatch.setattr(mod, "_run", run)
    model = make_model(
        [node("Log", ["A"], ["r"]), node("Exp", ["r"], ["Y"]), node("Add", ["X", "Y"], ["Z"])],
        [out("X", F, [2])],
        [out("Z", F, [2])],
        {"A": f32(4, 9)},
    )
    _, path = optimize(model, ["fold_constants_ort", "eliminate_dead_nodes"], tmp_path)
    assert calls == [2, 1, 1]
    assert op_counts(path) == {"Add": 1}
    assert_parity(model, path, tmp_path)


def test_ort_fallback_leaves_random_and_big_inputs() -> None:
    model = make_model(
        [
            node("RandomNormalLike", ["A"], ["r"]),
            node("Log", ["W"], ["w"]),
            node("Add", ["r", "w"], ["Y"]),
        ],
        [],
        [out("Y", F, [64])],
        {"A": f32(*range(64)), "W": f32(*range(1, 65))},
    )
    m = fastopt.from_onnx(model)
    report = fastopt.optimize(m, passes=["fold_constants_ort"], options={"fold_max_bytes": 128})
    assert report.rewrites == 0


def test_ort_fallback_size_rule(tmp_path: Path) -> None:
    # Log of a 256 KB constant: as big as what it comes from, so it folds; Tile of 16 bytes
    # into 128 KB: a small constant expanded into a big one, so it stays.
    w = np.arange(1, 65537, dtype=np.float32)
    model = make_model(
        [
            node("Log", ["W"], ["r"]),
            node("Mul", ["r", "two"], ["y1"]),  # downstream of Log: its origin is W
            node("Tile", ["S", "reps"], ["y2"]),
        ],
        [],
        [out("y1", F, [65536]), out("y2", F, [32768])],
        {"W": w, "two": f32(2), "S": f32(1, 2, 3, 4), "reps": i64(8192)},
    )
    report, path = optimize(model, ["fold_constants_ort"], tmp_path)
    assert op_counts(path) == {"Constant": 1, "Tile": 1}
    assert report.passes[0].counters == {"folded_Mul": 1}
    assert_parity(model, path, tmp_path, feeds={})


# ---- real exports ----


def test_registered() -> None:
    names = {p.name: p for p in fastopt.all_passes()}
    assert names["fold_constants"].language == "c++"
    assert names["fold_constants_ort"].language == "python"
    assert "fold_constants" in fastopt.PRESETS["default"]


@pytest.mark.slow
def test_onnx_node_cases_fold_bit_exactly(tmp_path: Path) -> None:
    """Every onnx backend node test case (generated by onnx's own case collectors), with its
    inputs turned into initializers: folding (native, then ONNX Runtime) must give the outputs
    ONNX Runtime computes from the unfolded model, bit for bit."""
    import warnings

    from conftest import assert_outputs_identical, run_ort
    from onnx.backend.test.case import node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases.collect_testcases(None)
    checked, failures = 0, []
    for case in cases:
        model, inputs = case.model, case.data_sets[0][0] if case.data_sets else []
        graph_inputs = list(model.graph.input)
        if len(inputs) != len(graph_inputs) or not all(
            isinstance(a, np.ndarray) and a.dtype != object for a in inputs
        ):
            continue
        if not all(o.type.HasField("tensor_type") for o in model.graph.output):
            continue
        constant = onnx.ModelProto()
        constant.CopyFrom(model)
        del constant.graph.input[:]
        for vi, a in zip(graph_inputs, inputs):
            constant.graph.initializer.append(numpy_helper.from_array(a, vi.name))
        src = tmp_path / f"{case.name}.onnx"
        onnx.save(constant, str(src))
        try:
            expected = run_ort(src, {})
        except Exception:
            continue  # ONNX Runtime cannot run it (unsupported op, type or attribute)
        checked += 1
        folded = tmp_path / f"{case.name}.folded.onnx"
        try:
            fastopt.optimize(
                src,
                passes=["fold_constants", "fold_constants_ort", "eliminate_dead_nodes"],
                output=folded,
            )
            assert_outputs_identical(expected, run_ort(folded, {}))
        except Exception as e:
            failures.append(f"{case.name}: {e}")
    assert checked > 1000
    assert not failures, "\n".join(failures)
