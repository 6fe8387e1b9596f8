"""eliminate_noop: shape ops that provably leave their input unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from onnx import AttributeProto, helper
from onnx import TensorProto as T
from support.cleanup_testing import INT64_MAX, check_pass, ints, model, ops, vi

PASS = "eliminate_noop"


def unary(
    op: str,
    x_shape: Sequence[int | str | None] | None,
    const_inputs: Sequence[Sequence[int] | None] = (),
    opset: int = 17,
    **attrs: object,
) -> helper.ModelProto:
    """x -> op(x, *const_inputs) -> Neg -> y; a None entry is an omitted input.

    y is declared as ["n"]: declared output shapes play no part here (ONNX Runtime ignores
    mismatches), only the value types of x do.
    """
    names, inits = ["x"], []
    for i, values in enumerate(const_inputs):
        if values is None:
            names.append("")
            continue
        names.append(f"c{i}")
        inits.append(ints(f"c{i}", values))
    empty = [k for k, v in attrs.items() if v == []]  # make_node cannot infer their type
    n = helper.make_node(op, names, ["t"], **{k: v for k, v in attrs.items() if k not in empty})
    n.attribute.extend(helper.make_attribute(k, [], attr_type=AttributeProto.INTS) for k in empty)
    nodes = [n, helper.make_node("Neg", ["t"], ["y"])]
    # An unknown input shape: x comes from a Relu whose output has no value_info.
    if x_shape is None:
        nodes.insert(0, helper.make_node("Relu", ["x0"], ["x"]))
        inputs = [vi("x0", T.FLOAT, [2, 3, 4])]
    else:
        inputs = [vi("x", T.FLOAT, x_shape)]
    return model(nodes, inputs, [vi("y", T.FLOAT, ["n"])], inits, opset=opset)


def fires(m: helper.ModelProto, **kw: object) -> None:
    out = check_pass(m, PASS, rewrites=1, **kw)  # type: ignore[arg-type]
    assert ops(out) == [*ops(m)[:-2], "Neg"]  # the op before the final Neg is gone


def stays(m: helper.ModelProto, **kw: object) -> None:
    out = check_pass(m, PASS, rewrites=0, **kw)  # type: ignore[arg-type]
    assert ops(out) == ops(m)


# --- Reshape ---


@pytest.mark.parametrize(
    ("x_shape", "target", "allowzero"),
    [
        ([2, 3, 4], [2, 3, 4], 0),
        ([2, 3, 4], [0, 0, 0], 0),
        ([2, 3, 4], [0, 3, -1], 0),
        ([2, 3, 4], [-1, 3, 4], 0),
        (["batch", "seq", 4], [0, 0, 4], 0),  # 0 copies symbolic dims
        ([2, 3, 4], [2, 3, 4], 1),
        ([2, 0, 4], [2, 0, 4], 1),
    ],
)
def test_reshape_noop(x_shape: list, target: list[int], allowzero: int) -> None:
    fires(unary("Reshape", x_shape, [target], allowzero=allowzero))


@pytest.mark.parametrize(
    ("x_shape", "target", "allowzero"),
    [
        ([2, 3, 4], [3, 2, 4], 0),
        ([2, 3, 4], [6, 4], 0),
        ([2, 3, 4], [2, 3, 4, 1], 0),
        (["batch", 3, 4], [2, 3, 4], 0),
        # -1 = numel / (batch * 3) is the input dim unless batch is 0, where ONNX Runtime fails
        (["batch", 3, 4], [0, 3, -1], 0),
        ([2, 3, 4], [2, -1, -1], 0),  # invalid: left for ONNX Runtime to reject
        (None, [2, 3, 4], 0),
    ],
)
def test_reshape_not_noop(x_shape: list | None, target: list[int], allowzero: int) -> None:
    runnable = target.count(-1) < 2 and (x_shape is None or "batch" not in x_shape)
    stays(unary("Reshape", x_shape, [target], allowzero=allowzero), run_ort=runnable)


def test_reshape_allowzero_literal_zero_stays() -> None:
    m = unary("Reshape", [0, 3], [[0, 3]], allowzero=1)  # fires: dims equal, 0 == 0
    fires(m)
    m = unary("Reshape", [2, 0], [[0, 2]], allowzero=1)
    stays(m)


def test_reshape_with_non_constant_shape_stays() -> None:
    m = model(
        [helper.make_node("Reshape", ["x", "s"], ["t"]), helper.make_node("Neg", ["t"], ["y"])],
        [vi("x", T.FLOAT, [2, 3]), vi("s", T.INT64, [2])],
        [vi("y", T.FLOAT, [2, 3])],
    )
    stays(m, feeds={"x": np.ones((2, 3), np.float32), "s": np.array([2, 3])})


# --- Expand ---


@pytest.mark.parametrize(
    ("x_shape", "shape"),
    [
        ([2, 3], [1]),
        ([2, 3], [1, 1]),
        ([2, 3], [2, 3]),
        ([2, 3], [3]),
        (["b", 3], [1, 3]),
        ([], []),
    ],
)
def test_expand_noop(x_shape: list, shape: list[int]) -> None:
    fires(unary("Expand", x_shape, [shape]))


@pytest.mark.parametrize(
    ("x_shape", "shape"), [([2, 3], [1, 2, 3]), ([2, 1], [2, 3]), (["b", 3], [2, 3]), (None, [1])]
)
def test_expand_not_noop(x_shape: list | None, shape: list[int]) -> None:
    stays(unary("Expand", x_shape, [shape]))


# --- Transpose ---


def test_transpose_identity_perm() -> None:
    fires(unary("Transpose", [2, 3, 4], perm=[0, 1, 2]))


def test_transpose_without_perm_rank_1() -> None:
    fires(unary("Transpose", [5]))


@pytest.mark.parametrize(
    ("x_shape", "perm"), [([2, 3, 4], [0, 2, 1]), ([2, 3], None), (None, None)]
)
def test_transpose_not_noop(x_shape: list | None, perm: list[int] | None) -> None:
    stays(unary("Transpose", x_shape, **({} if perm is None else {"perm": perm})))


# --- Slice ---


@pytest.mark.parametrize(
    ("x_shape", "consts"),
    [
        ([2, 3], [[0], [INT64_MAX], [1]]),
        (["b", "s"], [[0, 0], [INT64_MAX, INT64_MAX], [0, -1], [1, 1]]),
        ([2, 3], [[0], [3], [1], [1]]),
        ([2, 3], [[0], [100], [-1]]),
        ([2, 3], [[-3], [3], [1]]),  # clamps to 0
        ([2, 3], [[0, 0], [2, 3]]),  # no axes: 0, 1
        ([2, 3], [[0], [INT64_MAX], None, [1]]),  # omitted axes
    ],
)
def test_slice_noop(x_shape: list, consts: list) -> None:
    fires(unary("Slice", x_shape, consts))


@pytest.mark.parametrize(
    ("x_shape", "consts"),
    [
        ([2, 3], [[0], [2], [1]]),
        ([2, 3], [[1], [INT64_MAX], [1]]),
        ([2, 3], [[0], [INT64_MAX], [1], [2]]),
        ([2, 3], [[-1], [-INT64_MAX], [1], [-1]]),  # reversal
        (["b", "s"], [[0], [2**31 - 1], [1]]),  # INT32_MAX: a dim could be larger
        (None, [[0], [INT64_MAX], [-1]]),  # negative axis, unknown rank
    ],
)
def test_slice_not_noop(x_shape: list | None, consts: list) -> None:
    stays(unary("Slice", x_shape, consts))


def test_slice_opset_9_attributes() -> None:
    fires(unary("Slice", [2, 3], opset=9, starts=[0], ends=[INT64_MAX], axes=[0]))
    stays(unary("Slice", [2, 3], opset=9, starts=[1], ends=[INT64_MAX], axes=[0]))


# --- Pad ---


def test_pad_zero() -> None:
    fires(unary("Pad", [2, 3], [[0, 0, 0, 0]]))
    fires(unary("Pad", [2, 3], opset=10, pads=[0, 0, 0, 0]))


@pytest.mark.parametrize("mode", ["reflect", "edge"])
def test_pad_zero_other_modes_stay(mode: str) -> None:
    stays(unary("Pad", [2, 3], [[0, 0, 0, 0]], mode=mode))


def test_pad_nonzero_stays() -> None:
    stays(unary("Pad", [2, 3], [[0, 0, 0, 1]]))


# --- Squeeze / Unsqueeze ---


def test_squeeze_without_axes_and_no_unit_dims() -> None:
    fires(unary("Squeeze", [2, 3], opset=13))
    fires(unary("Squeeze", [2, 3], [[]], opset=13))
    fires(unary("Squeeze", [2, 3], opset=11, axes=[]))


@pytest.mark.parametrize(
    ("x_shape", "axes"),
    [
        ([2, 1, 3], None),  # squeezes every 1-dim
        ([2, 1, 3], []),  # empty axes: the same in ONNX Runtime
        (["b", 3], None),  # b may be 1
        ([2, 1, 3], [1]),
        (None, None),
    ],
)
def test_squeeze_not_noop(x_shape: list | None, axes: list | None) -> None:
    stays(unary("Squeeze", x_shape, [axes] if axes is not None else [], opset=13))


def test_unsqueeze_empty_axes() -> None:
    fires(unary("Unsqueeze", [2, 3], [[]], opset=13))
    fires(unary("Unsqueeze", ["b", 1], [[]], opset=13))


def test_unsqueeze_stays() -> None:
    stays(unary("Unsqueeze", [2, 3], [[0]], opset=13))
    stays(unary("Unsqueeze", [2, 3], opset=11, axes=[0]))


# --- Concat / Split ---


def test_concat_single_input() -> None:
    fires(unary("Concat", [2, 3], axis=0))
    fires(unary("Concat", None, axis=1))


def test_concat_two_inputs_stays() -> None:
    m = model(
        [
            helper.make_node("Concat", ["x", "x"], ["t"], axis=0),
            helper.make_node("Neg", ["t"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2])],
        [vi("y", T.FLOAT, [4])],
    )
    stays(m)


def test_split_single_output() -> None:
    fires(unary("Split", [2, 3], axis=1))
    fires(unary("Split", None, axis=1))
    fires(unary("Split", [2, 3], [[3]], axis=1))
    fires(unary("Split", [2, 3], opset=18, axis=-1, num_outputs=1))
    fires(unary("Split", [2, 3], opset=11, axis=1, split=[3]))


def test_split_stays() -> None:
    stays(unary("Split", ["b", "s"], [[3]], axis=1), run_ort=False)  # s may not be 3
    m = model(
        [
            helper.make_node("Split", ["x"], ["a", "b"], axis=0),
            helper.make_node("Add", ["a", "b"], ["y"]),
        ],
        [vi("x", T.FLOAT, [4])],
        [vi("y", T.FLOAT, [2])],
    )
    stays(m)


# --- interface, subgraphs ---


def test_noop_between_graph_input_and_output_stays() -> None:
    m = model(
        [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 1])],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [2, 3])],
    )
    check_pass(m, PASS, rewrites=0)


def test_noop_feeding_graph_output_keeps_the_name() -> None:
    m = model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Unsqueeze", ["r", "ax"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [2, 3])],
        [ints("ax", [])],
    )
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == ["Relu"] and out.graph.node[0].output == ["y"]
    assert out.graph.output[0] == m.graph.output[0]  # name and declared type kept


def test_noop_in_subgraph_reading_outer_value() -> None:
    body = helper.make_graph(
        [
            helper.make_node("Transpose", ["r"], ["t0"], perm=[0, 1]),
            helper.make_node("Neg", ["t0"], ["t"]),
        ],
        "then",
        [],
        [vi("t", T.FLOAT, [2, 3])],
    )
    other = helper.make_graph(
        [helper.make_node("Abs", ["r"], ["e"])], "else", [], [vi("e", T.FLOAT, [2, 3])]
    )
    m = model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=other),
        ],
        [vi("x", T.FLOAT, [2, 3]), vi("cond", T.BOOL, [])],
        [vi("y", T.FLOAT, [2, 3])],
        value_info=[vi("r", T.FLOAT, [2, 3])],
    )
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 3, "cond": np.array(True)}
    out = check_pass(m, PASS, rewrites=1, feeds=feeds)
    then = next(a.g for a in out.graph.node[1].attribute if a.name == "then_branch")
    assert [n.op_type for n in then.node] == ["Neg"] and then.node[0].input == ["r"]
