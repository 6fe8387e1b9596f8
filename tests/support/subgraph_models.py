"""Models and runs that more than one test file uses (from test_subgraphs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


OPSET = [helper.make_opsetid("", 18)]


def _vi(name: str, shape: list[Any] | None, dtype: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(graph: onnx.GraphProto, **kwargs: Any) -> onnx.ModelProto:
    kwargs.setdefault("opset_imports", OPSET)
    return helper.make_model(graph, ir_version=9, **kwargs)


def nested_if() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """If whose branches read X and W from the parent; the else branch holds another If that
    reads X (two levels up), W, and a value computed in the else branch."""
    inner_then = helper.make_graph(
        [helper.make_node("Add", ["X", "e1"], ["it"], name="inner_then_add")],
        "inner_then",
        [],
        [_vi("it", [3])],
    )
    inner_else = helper.make_graph(
        [helper.make_node("Sub", ["W", "X"], ["ie"], name="inner_else_sub")],
        "inner_else",
        [],
        [_vi("ie", [3])],
    )
    then_g = helper.make_graph(
        [helper.make_node("Add", ["X", "W"], ["t"], name="then_add")], "then", [], [_vi("t", [3])]
    )
    else_g = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "W"], ["e1"], name="else_mul"),
            helper.make_node("ReduceMax", ["e1"], ["m"], name="else_max", keepdims=0),
            helper.make_node("Greater", ["m", "zero"], ["c2"], name="else_gt"),
            helper.make_node(
                "If", ["c2"], ["e"], name="inner_if", then_branch=inner_then, else_branch=inner_else
            ),
        ],
        "else",
        [],
        [_vi("e", [3])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["X"], ["s"], name="sum", keepdims=0),
            helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
            helper.make_node(
                "If", ["c"], ["Y"], name="outer_if", then_branch=then_g, else_branch=else_g
            ),
        ],
        "nested_if",
        [_vi("X", [3])],
        [_vi("Y", [3])],
        [
            numpy_helper.from_array(np.array([0.5, -2.0, 4.0], np.float32), "W"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ],
    )
    feeds = [{"X": np.array(x, np.float32)} for x in ([1, 2, 3], [-1, -2, 0.5], [-5, 1, 1])]
    return _model(graph), feeds


def loop_with_if() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """Loop: carried `acc`, a scan output, outer-scope X and W; its body holds an If reading X."""
    branch_then = helper.make_graph(
        [helper.make_node("Add", ["acc_new", "X"], ["b"], name="body_then_add")],
        "body_then",
        [],
        [_vi("b", [2])],
    )
    branch_else = helper.make_graph(
        [helper.make_node("Neg", ["acc_new"], ["b2"], name="body_else_neg")],
        "body_else",
        [],
        [_vi("b2", [2])],
    )
    body = helper.make_graph(
        [
            helper.make_node("Add", ["acc", "W"], ["acc_new"], name="body_add"),
            helper.make_node("Cast", ["i"], ["i_f"], name="body_cast", to=F),
            helper.make_node("Mod", ["i", "two"], ["parity"], name="body_mod"),
            helper.make_node("Equal", ["parity", "zero_i"], ["even"], name="body_eq"),
            helper.make_node(
                "If",
                ["even"],
                ["branch"],
                name="body_if",
                then_branch=branch_then,
                else_branch=branch_else,
            ),
            helper.make_node("Mul", ["branch", "i_f"], ["scan_out"], name="body_mul"),
            helper.make_node("Identity", ["cond"], ["cond_out"], name="body_cond"),
        ],
        "loop_body",
        [_vi("i", [], TensorProto.INT64), _vi("cond", [], TensorProto.BOOL), _vi("acc", [2])],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_new", [2]), _vi("scan_out", [2])],
        [numpy_helper.from_array(np.array(2, np.int64), "two")],
    )  # an initializer in the body
    graph = helper.make_graph(
        [
            helper.make_node(
                "Loop", ["M", "", "acc0"], ["acc_final", "scans"], name="loop", body=body
            )
        ],
        "loop",
        [_vi("M", [], TensorProto.INT64), _vi("acc0", [2]), _vi("X", [2])],
        [_vi("acc_final", [2]), _vi("scans", [None, 2])],
        [
            numpy_helper.from_array(np.array([1.0, -0.5], np.float32), "W"),
            numpy_helper.from_array(np.array(0, np.int64), "zero_i"),
        ],
    )
    feeds = [
        {
            "M": np.array(m, np.int64),
            "acc0": np.array([0.25, 1], np.float32),
            "X": np.array([3, -3], np.float32),
        }
        for m in (0, 1, 5)
    ]
    return _model(graph), feeds


def scan_outer_scope() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """Scan (running sum) whose body multiplies by V from the parent graph."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s", "x_t"], ["s_new"], name="scan_add"),
            helper.make_node("Mul", ["s_new", "V"], ["y_t"], name="scan_mul"),
        ],
        "scan_body",
        [_vi("s", [2]), _vi("x_t", [2])],
        [_vi("s_new", [2]), _vi("y_t", [2])],
    )
    graph = helper.make_graph(
        [
            helper.make_node(
                "Scan", ["s0", "xs"], ["s_final", "ys"], name="scan", body=body, num_scan_inputs=1
            )
        ],
        "scan",
        [_vi("s0", [2]), _vi("xs", [4, 2]), _vi("V", [2])],
        [_vi("s_final", [2]), _vi("ys", [4, 2])],
    )
    rng = np.random.default_rng(0)
    feeds = [
        {
            "s0": rng.standard_normal(2).astype(np.float32),
            "xs": rng.standard_normal((4, 2)).astype(np.float32),
            "V": np.array([2, -1], np.float32),
        }
    ]
    return _model(graph), feeds


def functions() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """ScaledAdd(a, b; alpha, beta=1) = alpha*a + beta*b through ref_attr_name (beta has a default);
    Outer calls ScaledAdd (a function calling a function) and holds an If in its body."""

    def ref_attr(name: str, ref: str) -> AttributeProto:
        return helper.make_attribute_ref(name, AttributeProto.FLOAT, ref_attr_name=ref)

    const_alpha = helper.make_node("Constant", [], ["alpha_t"], name="c_alpha")
    const_alpha.attribute.append(ref_attr("value_float", "alpha"))
    const_beta = helper.make_node("Constant", [], ["beta_t"], name="c_beta")
    const_beta.attribute.append(ref_attr("value_float", "beta"))
    scaled_add = helper.make_function(
        "custom.fn",
        "ScaledAdd",
        ["a", "b"],
        ["c"],
        [
            const_alpha,
            const_beta,
            helper.make_node("Mul", ["a", "alpha_t"], ["t1"], name="fa_mul"),
            helper.make_node("Mul", ["b", "beta_t"], ["t2"], name="fb_mul"),
            helper.make_node("Add", ["t1", "t2"], ["c"], name="f_add"),
        ],
        OPSET,
        attributes=["alpha"],
        attribute_protos=[helper.make_attribute("beta", 1.0)],
    )
    call_inner = helper.make_node(
        "ScaledAdd", ["x", "x"], ["y0"], name="outer_call", domain="custom.fn"
    )
    call_inner.attribute.append(ref_attr("alpha", "gain"))
    pos = helper.make_graph(
        [helper.make_node("Identity", ["y0"], ["p"], name="o_id")],
        "outer_then",
        [],
        [_vi("p", None)],
    )
    neg = helper.make_graph(
        [helper.make_node("Neg", ["y0"], ["n"], name="o_neg")], "outer_else", [], [_vi("n", None)]
    )
    outer = helper.make_function(
        "custom.fn",
        "Outer",
        ["x", "flag"],
        ["y"],
        [
            call_inner,
            helper.make_node("If", ["flag"], ["y"], name="o_if", then_branch=pos, else_branch=neg),
        ],
        [*OPSET, helper.make_opsetid("custom.fn", 1)],
        attributes=["gain"],
    )
    graph = helper.make_graph(
        [
            helper.make_node(
                "ScaledAdd", ["A", "B"], ["Y1"], name="call1", domain="custom.fn", alpha=2.0
            ),
            helper.make_node(
                "ScaledAdd",
                ["A", "B"],
                ["Y2"],
                name="call2",
                domain="custom.fn",
                alpha=-0.5,
                beta=3.0,
            ),
            helper.make_node(
                "Outer", ["A", "flag"], ["Y3"], name="call3", domain="custom.fn", gain=1.5
            ),
        ],
        "functions",
        [_vi("A", [3]), _vi("B", [3]), _vi("flag", [], TensorProto.BOOL)],
        [_vi("Y1", [3]), _vi("Y2", [3]), _vi("Y3", [3])],
    )
    model = _model(
        graph,
        opset_imports=[*OPSET, helper.make_opsetid("custom.fn", 1)],
        functions=[scaled_add, outer],
    )
    feeds = [
        {
            "A": np.array([1, 2, 3], np.float32),
            "B": np.array([0.5, 0, -1], np.float32),
            "flag": np.array(f),
        }
        for f in (True, False)
    ]
    return model, feeds


BUILDERS: dict[str, Callable[[], tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]]] = {
    "nested_if": nested_if,
    "loop_with_if": loop_with_if,
    "scan_outer_scope": scan_outer_scope,
    "functions": functions,
}
