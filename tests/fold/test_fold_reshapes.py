"""fold_reshapes: Reshape/Flatten/Squeeze/Unsqueeze chains collapse, or cancel."""

from __future__ import annotations

from collections.abc import Sequence

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper
from support.cleanup_testing import attr, check_pass, const_input, ints, model, node, ops, vi

PASS = "fold_reshapes"


def chain(
    first: tuple[str, Sequence[int] | None, dict],
    second: tuple[str, Sequence[int] | None, dict],
    x_shape: Sequence[int | str] | None = (2, 3, 4),
    opset: int = 17,
    shared: bool = False,
) -> helper.ModelProto:
    """x -> first -> second -> Neg -> y; (op, constant second input or None, attributes).

    x_shape None: x comes through a Relu whose output has no value_info (rank unknown).
    """
    nodes, inits = [], []
    src = "x"
    if x_shape is None:
        nodes.append(helper.make_node("Relu", ["x0"], ["x"]))
    for i, (op, const, attrs) in enumerate([first, second]):
        ins = [src]
        if const is not None:
            inits.append(ints(f"c{i}", const))
            ins.append(f"c{i}")
        nodes.append(helper.make_node(op, ins, [f"t{i}"], **attrs))
        src = f"t{i}"
    nodes.append(helper.make_node("Neg", [src], ["y"]))
    outputs = [vi("y", T.FLOAT, ["n"])]
    if shared:
        nodes.append(helper.make_node("Abs", ["t0"], ["z"]))
        outputs.append(vi("z", T.FLOAT, ["n"]))
    x_in = vi("x0" if x_shape is None else "x", T.FLOAT, list(x_shape or [2, 3, 4]))
    return model(nodes, [x_in], outputs, inits, opset=opset)


def reshape(s: Sequence[int], allowzero: int = 0) -> tuple[str, Sequence[int], dict]:
    return ("Reshape", s, {"allowzero": allowzero} if allowzero else {})


# --- Reshape chains ---


@pytest.mark.parametrize(
    "first",
    [
        reshape([6, 4]),
        reshape([0, -1]),  # the inner may copy dims: only the outer's 0s matter
        ("Flatten", None, {"axis": 2}),
        ("Unsqueeze", [1], {}),
        ("Squeeze", None, {}),
    ],
)
def test_reshape_of_reshape_like(first: tuple) -> None:
    x_shape = [2, 1, 12] if first[0] == "Squeeze" else [2, 3, 4]
    out = check_pass(chain(first, reshape([4, -1]), x_shape), PASS, rewrites=1)
    assert ops(out) == ["Reshape", "Neg"]
    r = node(out, "Reshape")
    assert r.input[0] == "x" and const_input(out, r, 1).tolist() == [4, -1]


def test_reshape_outer_zero_must_not_fold() -> None:
    # Reshape(Reshape(x:[2,3,4], [6,4]), [0,-1]) is [6,4]; Reshape(x, [0,-1]) would be [2,12].
    out = check_pass(chain(reshape([6, 4]), reshape([0, -1])), PASS, rewrites=0)
    assert ops(out) == ["Reshape", "Reshape", "Neg"]


def test_reshape_outer_zero_with_allowzero_folds() -> None:
    m = chain(reshape([3, 0], allowzero=1), reshape([0, 5], allowzero=1), x_shape=[0, 3])
    out = check_pass(m, PASS, rewrites=1, feeds={"x": np.zeros((0, 3), np.float32)})
    assert ops(out) == ["Reshape", "Neg"]


def test_reshape_with_non_constant_outer_shape_stays() -> None:
    m = model(
        [
            helper.make_node("Reshape", ["x", "s1"], ["a"]),
            helper.make_node("Reshape", ["a", "s2"], ["b"]),
            helper.make_node("Neg", ["b"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2, 3]), vi("s2", T.INT64, [1])],
        [vi("y", T.FLOAT, [6])],
        [ints("s1", [3, 2])],
    )
    check_pass(m, PASS, rewrites=0, feeds={"x": np.ones((2, 3), np.float32), "s2": np.array([6])})


def test_shared_inner_reshape_stays() -> None:
    out = check_pass(chain(reshape([6, 4]), reshape([24]), shared=True), PASS, rewrites=1)
    assert ops(out) == ["Reshape", "Reshape", "Neg", "Abs"]
    assert out.graph.node[1].input[0] == "x"


# --- Squeeze / Unsqueeze ---


@pytest.mark.parametrize(
    ("a", "b", "x_shape", "merged"),
    [
        ([0], [3], [2, 3], [0, 3]),
        ([1], [0], [2, 3], [0, 2]),
        ([0, 1], [0, 1], [2, 3], [0, 1, 2, 3]),
        ([-1], [-1], [2, 3], [2, 3]),  # [2,3] -> [2,3,1] -> [2,3,1,1]
        ([2], [0, 4], [2, 3], [0, 3, 4]),
        ([0], [1], None, [0, 1]),  # non-negative axes need no rank
    ],
)
@pytest.mark.parametrize("opset", [11, 13])
def test_unsqueeze_chain(a: list, b: list, x_shape: list | None, merged: list, opset: int) -> None:
    def op(axes: list) -> tuple:
        return ("Unsqueeze", axes, {}) if opset >= 13 else ("Unsqueeze", None, {"axes": axes})

    out = check_pass(chain(op(a), op(b), x_shape, opset=opset), PASS, rewrites=1)
    assert ops(out) == (["Relu"] if x_shape is None else []) + ["Unsqueeze", "Neg"]
    u = node(out, "Unsqueeze")
    got = const_input(out, u, 1).tolist() if opset >= 13 else attr(u, "axes")
    assert sorted(got) == merged


@pytest.mark.parametrize(
    ("x_shape", "a", "b", "merged"),
    [
        ([1, 2, 1, 3], [0], [1], [0, 2]),
        ([1, 2, 1, 3], [2], [0], [0, 2]),
        ([2, 1, 1, 1], [-1], [-1], [2, 3]),
        ([1, 1, 2, 1], [0, 1], [1], [0, 1, 3]),
    ],
)
def test_squeeze_chain(x_shape: list, a: list, b: list, merged: list) -> None:
    out = check_pass(
        chain(("Squeeze", a, {}), ("Squeeze", b, {}), x_shape, opset=13), PASS, rewrites=1
    )
    assert ops(out) == ["Squeeze", "Neg"]
    assert sorted(const_input(out, node(out, "Squeeze"), 1).tolist()) == merged


def test_squeeze_chain_without_axes_stays() -> None:
    m = chain(("Squeeze", None, {}), ("Squeeze", [0], {}), [1, 2, 1, 3], opset=13)
    check_pass(
        m, PASS, rewrites=0, run_ort=False
    )  # the second Squeeze is invalid: x has no 1s left


def test_negative_axes_with_unknown_rank_stay() -> None:
    m = chain(("Unsqueeze", [-1], {}), ("Unsqueeze", [0], {}), None, opset=13)
    check_pass(m, PASS, rewrites=0)


@pytest.mark.parametrize(("a", "b"), [([1], [1]), ([0, 3], [3, 0]), ([-1], [3]), ([0], [-4])])
def test_unsqueeze_then_squeeze_cancels(a: list, b: list) -> None:
    out = check_pass(
        chain(("Unsqueeze", a, {}), ("Squeeze", b, {}), [2, 3, 4], opset=13), PASS, rewrites=1
    )
    assert ops(out) == ["Neg"]


@pytest.mark.parametrize(("a", "b"), [([1], [1]), ([-1], [2])])
def test_squeeze_then_unsqueeze_cancels(a: list, b: list) -> None:
    out = check_pass(
        chain(("Squeeze", a, {}), ("Unsqueeze", b, {}), [2, 1, 1], opset=13), PASS, rewrites=1
    )
    assert ops(out) == ["Neg"]


def test_mismatched_pairs_stay() -> None:
    check_pass(
        chain(("Unsqueeze", [1], {}), ("Squeeze", [2], {}), [2, 1, 4], opset=13), PASS, rewrites=0
    )
    # Squeeze without axes also drops x's own 1-dims.
    check_pass(
        chain(("Unsqueeze", [0], {}), ("Squeeze", None, {}), [2, 1], opset=13), PASS, rewrites=0
    )
    # Squeeze of a dim known not to be 1 (invalid, ONNX Runtime would reject it): left alone.
    m = chain(("Squeeze", [0], {}), ("Unsqueeze", [0], {}), [2, 3], opset=13)
    check_pass(m, PASS, rewrites=0, run_ort=False)


def test_cancelling_pair_at_graph_output_from_graph_input_stays() -> None:
    m = model(
        [
            helper.make_node("Unsqueeze", ["x", "a"], ["t"]),
            helper.make_node("Squeeze", ["t", "a"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2])],
        [vi("y", T.FLOAT, [2])],
        [ints("a", [0])],
        opset=13,
    )
    check_pass(m, PASS, rewrites=0)


# --- Flatten ---


@pytest.mark.parametrize(
    ("s", "axis", "expected"),
    [
        ([2, 3, 4], 2, [6, 4]),
        ([2, 3, 4], 0, [1, 24]),
        ([-1, 3, 4], 1, [-1, 12]),
        ([2, 3, -1], 2, [6, -1]),
        ([2, 3, 4], -1, [6, 4]),
    ],
)
def test_flatten_of_reshape(s: list, axis: int, expected: list) -> None:
    out = check_pass(chain(reshape(s), ("Flatten", None, {"axis": axis}), [4, 6]), PASS, rewrites=1)
    assert ops(out) == ["Reshape", "Neg"]
    r = node(out, "Reshape")
    assert r.input[0] == "x" and const_input(out, r, 1).tolist() == expected


def test_flatten_of_reshape_with_zero_or_shared_stays() -> None:
    check_pass(
        chain(reshape([0, 3, -1]), ("Flatten", None, {"axis": 2}), [2, 12]), PASS, rewrites=0
    )
    m = chain(reshape([2, 3, 4]), ("Flatten", None, {"axis": 2}), [4, 6], shared=True)
    check_pass(m, PASS, rewrites=0)


@pytest.mark.parametrize(
    ("k1", "k2", "expected"), [(2, 1, 2), (2, 0, 0), (-1, 1, -1), (3, -1, 3), (1, -2, 0)]
)
def test_flatten_of_flatten(k1: int, k2: int, expected: int) -> None:
    m = chain(("Flatten", None, {"axis": k1}), ("Flatten", None, {"axis": k2}), [2, 3, 4, 5])
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == ["Flatten", "Neg"]
    assert attr(node(out, "Flatten"), "axis") == expected


def test_flatten_of_flatten_axis_2_stays() -> None:
    m = chain(("Flatten", None, {"axis": 1}), ("Flatten", None, {"axis": 2}), [2, 3, 4])
    check_pass(m, PASS, rewrites=0)


def test_in_function_body_new_axes_are_a_constant_node() -> None:
    # FunctionProto has no initializers: the merged axes become a Constant node there.
    body = [
        helper.make_node("Constant", [], ["a0"], value=ints("a0", [0])),
        helper.make_node("Unsqueeze", ["fx", "a0"], ["u"]),
        helper.make_node("Unsqueeze", ["u", "a0"], ["fy"]),
    ]
    f = helper.make_function("local", "Unsq2", ["fx"], ["fy"], body, [helper.make_opsetid("", 13)])
    m = model(
        [helper.make_node("Unsq2", ["x"], ["y"], domain="local")],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [1, 1, 2, 3])],
        opset=13,
    )
    m.functions.append(f)
    m.opset_import.append(helper.make_opsetid("local", 1))
    out = check_pass(m, PASS, rewrites=1)
    fn = out.functions[0]
    assert [n.op_type for n in fn.node] == ["Constant", "Constant", "Unsqueeze"]
    merged = onnx.numpy_helper.to_array(fn.node[1].attribute[0].t).tolist()
    assert fn.node[2].input == ["fx", fn.node[1].output[0]] and merged == [0, 1]


@pytest.mark.parametrize("op", ["Unsqueeze", "Squeeze"])
def test_a_huge_axis_with_unknown_rank_does_not_hang(op: str) -> None:
    """Found by fuzz_pipeline (tests/fuzz/regressions/pipeline-unsqueeze-axis-2e44.onnx): the
    merge walked every position up to the largest axis, 2^44 of them. Now it merges in a few
    steps (or not at all: such a model is invalid; no ORT check)."""
    m = chain((op, [0], {}), (op, [2**44], {}), None, opset=13)
    report = fastopt.optimize(fastopt.from_onnx(m), passes=[PASS])
    assert report.ops_after.get("Neg") == 1


# --- a precision Cast between two reshapes ---


def cast_between(
    second: Sequence[int], cast_users: int = 1, first: Sequence[int] = (2, 3, 2, 2)
) -> helper.ModelProto:
    nodes = [
        helper.make_node("Reshape", ["x", "c0"], ["a"]),
        helper.make_node("Cast", ["a"], ["c"], to=T.FLOAT16),
        helper.make_node("Reshape", ["c", "c1"], ["b"]),
        helper.make_node("Neg", ["b"], ["y"]),
    ]
    outputs = [vi("y", T.FLOAT16, ["n"])]
    if cast_users > 1:
        nodes.append(helper.make_node("Abs", ["c"], ["z"]))
        outputs.append(vi("z", T.FLOAT16, ["n"]))
    inits = [ints("c0", list(first)), ints("c1", list(second))]
    return model(nodes, [vi("x", T.FLOAT, [2, 3, 4])], outputs, inits)


def test_cast_between_reshapes_moves_below_and_the_chain_folds() -> None:
    out = check_pass(cast_between([6, 4]), PASS, rewrites=2)
    assert ops(out) == ["Reshape", "Cast", "Neg"]
    r = node(out, "Reshape")
    assert r.input[0] == "x" and const_input(out, r, 1).tolist() == [6, 4]


def test_cast_between_reshapes_keeps_the_outer_zero_rule() -> None:
    # The Cast moves (exact), but [0, -1] still copies the intermediate's dim 0 (3), which is
    # not x's (2): no fold.
    out = check_pass(cast_between([0, -1], first=[3, 2, 2, 2]), PASS, rewrites=1)
    assert ops(out) == ["Reshape", "Reshape", "Cast", "Neg"]


def test_cast_between_reshapes_zero_copying_the_same_dim_folds() -> None:
    # [0, -1] copies the intermediate's dim 0, 2, which is x's dim 0 too: Reshape(x, [0, -1]).
    out = check_pass(cast_between([0, -1]), PASS, rewrites=2)
    assert ops(out) == ["Reshape", "Cast", "Neg"]
    r = node(out, "Reshape")
    assert r.input[0] == "x" and const_input(out, r, 1).tolist() == [0, -1]


def test_cast_with_other_users_between_reshapes_stays() -> None:
    check_pass(cast_between([6, 4], cast_users=2), PASS, rewrites=0)


def head_split_merge(batch_from: str) -> helper.ModelProto:
    """x (B, S, 64) -> Reshape(Concat(Shape(batch_from)[0], Shape(x)[1], 4, 16)) -> Reshape([0,
    0, 64]): the intermediate's type is unknown; shape facts tell its dims 0 and 1."""
    nodes = [
        helper.make_node("Shape", [batch_from], ["sb"]),
        helper.make_node("Gather", ["sb", "i0"], ["b"]),
        helper.make_node("Shape", ["x"], ["sx"]),
        helper.make_node("Gather", ["sx", "i1"], ["s"]),
        helper.make_node("Concat", ["b", "s", "heads"], ["split"], axis=0),
        helper.make_node("Reshape", ["x", "split"], ["x4"]),
        helper.make_node("Reshape", ["x4", "merge"], ["x3"]),
        helper.make_node("Neg", ["x3"], ["y"]),
    ]
    inits = [ints("i0", [0]), ints("i1", [1]), ints("heads", [4, 16]), ints("merge", [0, 0, 64])]
    inputs = [vi("x", T.FLOAT, ["B", "S", 64]), vi("other", T.FLOAT, ["C", "S", 64])]
    return model(nodes, inputs, [vi("y", T.FLOAT, ["B", "S", 64])], inits)


def test_zero_copies_proven_by_shape_facts_fold() -> None:
    # The intermediate's (B, S) are x's: Reshape(x, [0, 0, 64]), a no-op that eliminate_noop
    # removes with the split and its shape computation.
    feeds = {
        "x": np.random.rand(2, 3, 64).astype(np.float32),
        "other": np.zeros((2, 3, 64), np.float32),
    }
    out = check_pass(
        head_split_merge("x"), [PASS, "eliminate_noop", "eliminate_dead_nodes"], feeds=feeds
    )
    assert ops(out) == ["Neg"] and out.graph.node[0].input == ["x"]


def test_zero_copies_of_another_batch_stay() -> None:
    # dim 0 of the intermediate comes from `other` (C): not proven to be x's B, no fold (at run
    # time C == B or the Reshape fails; the fold would hide the failure).
    feeds = {
        "x": np.random.rand(2, 3, 64).astype(np.float32),
        "other": np.zeros((2, 3, 64), np.float32),
    }
    out = check_pass(head_split_merge("other"), PASS, rewrites=0, feeds=feeds)
    assert ops(out).count("Reshape") == 2
