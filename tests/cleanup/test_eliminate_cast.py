"""eliminate_cast: Casts to the type a value has, and Cast chains through lossless types."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from support.cleanup_testing import check_pass, model, node, ops, optimize, vi

PASS = "eliminate_cast"


def cast(x: str, y: str, to: int) -> helper.NodeProto:
    return helper.make_node("Cast", [x], [y], to=to)


def chain(x_type: int, a: int, b: int, *, shared: bool = False) -> helper.ModelProto:
    """x:X -> Cast(a) -> Cast(b) -> Identity -> y (and the intermediate as an output if shared)."""
    nodes = [cast("x", "m", a), cast("m", "c", b), helper.make_node("Identity", ["c"], ["y"])]
    outputs = [vi("y", b, [2, 3])]
    if shared:
        nodes.append(helper.make_node("Identity", ["m"], ["m_out"]))
        outputs.append(vi("m_out", a, [2, 3]))
    return model(nodes, [vi("x", x_type, [2, 3])], outputs)


def test_cast_to_own_type_of_graph_input() -> None:
    m = model(
        [cast("x", "c", T.FLOAT), helper.make_node("Neg", ["c"], ["y"])],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [2, 3])],
    )
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == ["Neg"] and node(out, "Neg").input == ["x"]


def test_cast_to_own_type_from_value_info() -> None:
    m = model(
        [helper.make_node("Relu", ["x"], ["r"]), cast("r", "c", T.FLOAT16)],
        [vi("x", T.FLOAT16, [2])],
        [vi("c", T.FLOAT16, [2])],
        value_info=[vi("r", T.FLOAT16, None)],
    )
    out = check_pass(m, PASS, rewrites=1)
    # The graph output keeps its name: the Relu now writes it.
    assert ops(out) == ["Relu"] and node(out, "Relu").output == ["c"]


def test_cast_of_initializer_and_constant() -> None:
    w = numpy_helper.from_array(np.array([1, 2], dtype=np.int64), "w")
    k = helper.make_node(
        "Constant", [], ["k"], value=numpy_helper.from_array(np.array([3, 4], np.int32))
    )
    m = model(
        [
            k,
            cast("w", "wc", T.INT64),
            cast("k", "kc", T.INT32),
            helper.make_node("Add", ["x", "wc"], ["s"]),
            helper.make_node("Cast", ["kc"], ["kc64"], to=T.INT64),
            helper.make_node("Add", ["s", "kc64"], ["y"]),
        ],
        [vi("x", T.INT64, [2])],
        [vi("y", T.INT64, [2])],
        [w],
    )
    out = check_pass(m, PASS, rewrites=2)
    assert ops(out) == ["Constant", "Add", "Cast", "Add"]


def test_cast_like_same_type() -> None:
    m = model(
        [helper.make_node("CastLike", ["x", "z"], ["c"]), helper.make_node("Neg", ["c"], ["y"])],
        [vi("x", T.FLOAT, [2]), vi("z", T.FLOAT, [1])],
        [vi("y", T.FLOAT, [2])],
    )
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == ["Neg"]


@pytest.mark.parametrize(
    ("x_type", "a", "b", "left"),
    [
        (T.FLOAT16, T.FLOAT, T.FLOAT16, []),  # fp16 -> fp32 -> fp16 is x
        (T.BFLOAT16, T.FLOAT, T.BFLOAT16, []),
        (T.FLOAT, T.DOUBLE, T.FLOAT, []),
        (T.INT8, T.INT32, T.INT8, []),
        (T.BOOL, T.FLOAT, T.BOOL, []),
        (T.INT32, T.INT64, T.INT32, []),
        (T.INT8, T.FLOAT16, T.INT8, []),  # int8 fits fp16 exactly
        (T.FLOAT16, T.FLOAT, T.DOUBLE, ["Cast"]),
        (T.INT8, T.INT32, T.INT64, ["Cast"]),
        (T.UINT8, T.INT32, T.FLOAT, ["Cast"]),
        (T.INT8, T.FLOAT, T.INT32, ["Cast"]),  # int8 -> int32 directly is exact too
        (T.BOOL, T.INT32, T.FLOAT, ["Cast"]),
        (T.FLOAT16, T.FLOAT, T.INT32, ["Cast"]),
        (T.INT16, T.FLOAT, T.BOOL, ["Cast"]),
    ],
)
def test_cast_chain_folds(x_type: int, a: int, b: int, left: list[str]) -> None:
    # numpy cannot feed bfloat16 to ONNX Runtime: structure and checker only there.
    out = check_pass(chain(x_type, a, b), PASS, rewrites=1, run_ort=x_type != T.BFLOAT16)
    assert ops(out) == [*left, "Identity"]
    if left:
        assert node(out, "Cast").input == ["x"]


@pytest.mark.parametrize(
    ("x_type", "a", "b"),
    [
        (T.INT64, T.INT32, T.INT64),  # truncates
        (T.FLOAT, T.FLOAT16, T.FLOAT),  # rounds
        (T.FLOAT, T.BFLOAT16, T.FLOAT),
        (T.FLOAT, T.INT32, T.FLOAT),
        (T.INT32, T.FLOAT, T.INT32),  # int32 does not fit fp32
        (T.INT32, T.INT16, T.INT32),
        (T.UINT8, T.INT8, T.UINT8),
        (T.INT16, T.FLOAT16, T.INT16),  # int16 does not fit fp16
        (T.FLOAT16, T.BFLOAT16, T.FLOAT16),
        (T.INT32, T.BOOL, T.INT32),
        (T.INT32, T.DOUBLE, T.INT8),  # out of range: float->int is not int->int wrap-around
        (T.UINT8, T.FLOAT16, T.INT8),
    ],
)
def test_cast_chain_must_not_fold(x_type: int, a: int, b: int) -> None:
    m = chain(x_type, a, b)
    big = {T.INT64: 2**40 + 7, T.INT32: 2**30 + 3, T.UINT8: 200, T.INT16: 3001}.get(x_type, 1.1)
    feeds = {"x": np.full((2, 3), big, dtype=helper.tensor_dtype_to_np_dtype(x_type))}
    out = check_pass(m, PASS, rewrites=0, feeds=feeds)
    assert ops(out) == ["Cast", "Cast", "Identity"]


def test_cast_chain_with_shared_intermediate() -> None:
    out = check_pass(chain(T.FLOAT16, T.FLOAT, T.FLOAT16, shared=True), PASS, rewrites=1)
    # The inner Cast stays for its other user; the outer one is gone.
    assert ops(out) == ["Cast", "Identity", "Identity"]
    assert out.graph.node[1].input == ["x"]


def test_cast_chain_to_graph_output_from_graph_input() -> None:
    # y = Cast(Cast(x, fp32), fp16) is x, but y cannot be renamed onto the graph input x: one
    # Cast(x, fp16) remains (the inner one goes).
    m = model(
        [cast("x", "m", T.FLOAT), cast("m", "y", T.FLOAT16)],
        [vi("x", T.FLOAT16, [2])],
        [vi("y", T.FLOAT16, [2])],
    )
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == ["Cast"] and node(out, "Cast").input == ["x"]


def test_longer_chain_folds_completely() -> None:
    m = model(
        [
            cast("x", "a", T.FLOAT),
            cast("a", "b", T.DOUBLE),
            cast("b", "c", T.FLOAT16),
            helper.make_node("Neg", ["c"], ["y"]),
        ],
        [vi("x", T.FLOAT16, [2])],
        [vi("y", T.FLOAT16, [2])],
    )
    out = check_pass(m, PASS)
    assert ops(out) == ["Neg"]


def test_unknown_type_is_left_alone() -> None:
    m = model(
        [helper.make_node("Relu", ["x"], ["r"]), cast("r", "c", T.FLOAT)],
        [vi("x", T.FLOAT, [2])],
        [vi("c", T.FLOAT, [2])],
    )
    out = check_pass(m, PASS, rewrites=0)
    assert ops(out) == ["Relu", "Cast"]


def test_real_cast_and_graph_io_cast_stay() -> None:
    m = model(
        [cast("x", "y", T.FLOAT), cast("x", "z", T.FLOAT16)],
        [vi("x", T.FLOAT, [2])],
        [vi("y", T.FLOAT, [2]), vi("z", T.FLOAT16, [2])],
    )
    out = check_pass(m, PASS, rewrites=0)
    assert ops(out) == ["Cast", "Cast"]


def test_cast_like_different_type_stays() -> None:
    m = model(
        [helper.make_node("CastLike", ["x", "z"], ["c"]), helper.make_node("Neg", ["c"], ["y"])],
        [vi("x", T.FLOAT, [2]), vi("z", T.DOUBLE, [1])],
        [vi("y", T.DOUBLE, [2])],
    )
    check_pass(m, PASS, rewrites=0)


def test_cast_in_subgraph() -> None:
    body = helper.make_graph(
        [cast("x", "c", T.FLOAT), helper.make_node("Neg", ["c"], ["t"])],
        "then",
        [],
        [vi("t", T.FLOAT, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["e"])], "else", [], [vi("e", T.FLOAT, [2])]
    )
    m = model(
        [helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=other)],
        [vi("x", T.FLOAT, [2]), vi("cond", T.BOOL, [])],
        [vi("y", T.FLOAT, [2])],
    )
    out = check_pass(
        m, PASS, rewrites=1, feeds={"x": np.ones(2, np.float32), "cond": np.array(True)}
    )
    then = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in then.node] == ["Neg"]


def test_counters() -> None:
    report = optimize(chain(T.FLOAT16, T.FLOAT, T.FLOAT16), [PASS])
    assert report.passes[0].counters == {"fold_cast_chain": 1}
