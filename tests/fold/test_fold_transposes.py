"""fold_transposes: Transpose(Transpose(x, p1), p2) -> Transpose(x, p1[p2]) or x."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper
from support.cleanup_testing import attr, check_pass, model, node, ops, vi

PASS = "fold_transposes"


def pair(
    p1: list[int] | None, p2: list[int] | None, shape: list | None = None
) -> helper.ModelProto:
    shape = shape or [2, 3, 4, 5]
    k1 = {} if p1 is None else {"perm": p1}
    k2 = {} if p2 is None else {"perm": p2}
    return model(
        [
            helper.make_node("Transpose", ["x"], ["a"], **k1),
            helper.make_node("Transpose", ["a"], ["b"], **k2),
            helper.make_node("Neg", ["b"], ["y"]),
        ],
        [vi("x", T.FLOAT, shape)],
        [vi("y", T.FLOAT, ["n"])],
    )


def test_inverse_pair_cancels() -> None:
    out = check_pass(pair([0, 2, 1, 3], [0, 2, 1, 3]), PASS, rewrites=1)
    assert ops(out) == ["Neg"] and node(out, "Neg").input == ["x"]


@pytest.mark.parametrize(
    ("p1", "p2"),
    [([1, 0, 2, 3], [0, 2, 1, 3]), ([0, 2, 3, 1], [0, 2, 3, 1]), ([3, 2, 1, 0], [1, 2, 3, 0])],
)
def test_pair_composes(p1: list[int], p2: list[int]) -> None:
    out = check_pass(pair(p1, p2), PASS, rewrites=1)
    assert ops(out) == ["Transpose", "Neg"]
    t = node(out, "Transpose")
    assert t.input == ["x"] and attr(t, "perm") == [p1[j] for j in p2]


def test_default_perms_cancel_with_known_rank() -> None:
    out = check_pass(pair(None, None), PASS, rewrites=1)
    assert ops(out) == ["Neg"]


def test_default_perm_with_unknown_rank_stays() -> None:
    m = model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Transpose", ["r"], ["a"]),
            helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
            helper.make_node("Neg", ["b"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [2, 3])],
    )
    check_pass(m, PASS, rewrites=0)


def test_shared_first_transpose_stays_for_its_other_user() -> None:
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0]),
            helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
            helper.make_node("Add", ["b", "x"], ["y"]),
            helper.make_node("Neg", ["a"], ["z"]),
        ],
        [vi("x", T.FLOAT, [3, 3])],
        [vi("y", T.FLOAT, [3, 3]), vi("z", T.FLOAT, [3, 3])],
    )
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == ["Transpose", "Add", "Neg"]
    assert node(out, "Add").input == ["x", "x"]


def test_chain_of_three() -> None:
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[1, 2, 0]),
            helper.make_node("Transpose", ["a"], ["b"], perm=[1, 2, 0]),
            helper.make_node("Transpose", ["b"], ["c"], perm=[1, 2, 0]),
            helper.make_node("Neg", ["c"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2, 3, 4])],
        [vi("y", T.FLOAT, [2, 3, 4])],
    )
    out = check_pass(m, PASS)
    assert ops(out) == ["Neg"]


def test_cancelling_pair_between_graph_input_and_output() -> None:
    # y = x, but y cannot be renamed onto the graph input: one identity Transpose is left (and
    # eliminate_noop cannot remove it either).
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0]),
            helper.make_node("Transpose", ["a"], ["y"], perm=[1, 0]),
        ],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [2, 3])],
    )
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == ["Transpose"] and attr(node(out, "Transpose"), "perm") == [0, 1]


def test_single_transpose_and_mismatched_ranks_stay() -> None:
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0]),
            helper.make_node("Neg", ["a"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [3, 2])],
    )
    check_pass(m, PASS, rewrites=0)


def test_in_subgraph() -> None:
    body = helper.make_graph(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0]),
            helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
            helper.make_node("Neg", ["b"], ["t"]),
        ],
        "then",
        [],
        [vi("t", T.FLOAT, [2, 3])],
    )
    other = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["e"])], "else", [], [vi("e", T.FLOAT, [2, 3])]
    )
    m = model(
        [helper.make_node("If", ["cond"], ["y"], then_branch=body, else_branch=other)],
        [vi("x", T.FLOAT, [2, 3]), vi("cond", T.BOOL, [])],
        [vi("y", T.FLOAT, [2, 3])],
    )
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "cond": np.array(True)}
    out = check_pass(m, PASS, rewrites=1, feeds=feeds)
    then = next(a.g for a in out.graph.node[0].attribute if a.name == "then_branch")
    assert [n.op_type for n in then.node] == ["Neg"]


def test_perm_referring_to_a_function_attribute_is_left_alone() -> None:
    body = [
        helper.make_node("Transpose", ["fx"], ["t"], perm=[1, 0]),
        helper.make_node("Transpose", ["t"], ["fy"]),
    ]
    body[1].attribute.append(helper.make_attribute_ref("perm", onnx.AttributeProto.INTS))
    f = helper.make_function(
        "local", "T2", ["fx"], ["fy"], body, [helper.make_opsetid("", 17)], ["perm"]
    )
    m = model(
        [helper.make_node("T2", ["x"], ["y"], domain="local", perm=[1, 0])],
        [vi("x", T.FLOAT, [2, 3])],
        [vi("y", T.FLOAT, [2, 3])],
    )
    m.functions.append(f)
    m.opset_import.append(helper.make_opsetid("local", 1))
    out = check_pass(m, PASS, rewrites=0)
    assert [n.op_type for n in out.functions[0].node] == ["Transpose", "Transpose"]


@pytest.mark.parametrize(("p2", "left"), [([0, 2, 1, 3], ["Cast", "Neg"]), ([1, 0, 2, 3], None)])
def test_pair_folds_through_a_precision_cast(p2: list[int], left: list[str] | None) -> None:
    # fp16 exports that rotate in fp32: Transpose -> Cast -> Transpose around the rotary.
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1, 3]),
            helper.make_node("Cast", ["a"], ["c"], to=T.FLOAT16),
            helper.make_node("Transpose", ["c"], ["b"], perm=p2),
            helper.make_node("Neg", ["b"], ["y"]),
        ],
        [vi("x", T.FLOAT, [2, 3, 4, 5])],
        [vi("y", T.FLOAT16, ["n"])],
    )
    out = check_pass(m, PASS, rewrites=1)
    assert ops(out) == (left or ["Transpose", "Cast", "Neg"])
    if left is None:
        t = node(out, "Transpose")
        assert t.input == ["x"] and attr(t, "perm") == [[0, 2, 1, 3][j] for j in p2]


def test_cast_with_other_users_stays() -> None:
    m = model(
        [
            helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1, 3]),
            helper.make_node("Cast", ["a"], ["c"], to=T.FLOAT16),
            helper.make_node("Transpose", ["c"], ["b"], perm=[0, 2, 1, 3]),
            helper.make_node("Neg", ["b"], ["y"]),
            helper.make_node("Neg", ["c"], ["z"]),
        ],
        [vi("x", T.FLOAT, [2, 3, 4, 5])],
        [vi("y", T.FLOAT16, ["n"]), vi("z", T.FLOAT16, ["n"])],
    )
    check_pass(m, PASS, rewrites=0)
