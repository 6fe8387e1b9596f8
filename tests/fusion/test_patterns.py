"""The pattern engine: patterns declared from Python, matched in C++, on small graphs.

Each test checks what fires and what must not, that the graph stays valid (verify), and that
ONNX Runtime gives the same outputs before and after."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT


def _run(model: onnx.ModelProto | fastopt.Model, feeds: dict[str, np.ndarray]) -> list:
    if isinstance(model, fastopt.Model):
        model = model.to_onnx()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )


def _vi(name: str, shape=(2, 4), dtype=F):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def _silu_rule() -> fastopt.Rule:
    """x * Sigmoid(x) -> QuickGelu(x, alpha=1): Mul is commutative."""
    p = fastopt.Pattern("silu")
    x = p.var("x")
    p.root(p.op("Mul", [x, p.op("Sigmoid", [x])]).commutative())
    return fastopt.Rule("silu", p, replace=("QuickGelu", ["x"], {"alpha": 1.0}, "com.microsoft"))


X = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)


@pytest.mark.parametrize("order", [["X", "s"], ["s", "X"]])
def test_commutative_inputs_match_in_either_order(order: list[str]) -> None:
    proto = _model(
        [helper.make_node("Sigmoid", ["X"], ["s"]), helper.make_node("Mul", order, ["Y"])],
        [_vi("X")],
        [_vi("Y")],
    )
    m = fastopt.from_onnx(proto)
    rewrites, per_rule, _ = fastopt.apply_rules(m, [_silu_rule()])
    assert rewrites == 1 and per_rule == {"silu": 1}
    m.verify()
    assert m.op_counts() == {"com.microsoft::QuickGelu": 1}
    assert [o.name for o in m.graph.outputs] == ["Y"]  # the interface keeps its names
    np.testing.assert_allclose(_run(m, {"X": X})[0], _run(proto, {"X": X})[0], atol=1e-6)


def test_different_vars_do_not_match() -> None:
    """x * Sigmoid(z) is not SiLU: the var x must bind to one value."""
    proto = _model(
        [helper.make_node("Sigmoid", ["Z"], ["s"]), helper.make_node("Mul", ["X", "s"], ["Y"])],
        [_vi("X"), _vi("Z")],
        [_vi("Y")],
    )
    m = fastopt.from_onnx(proto)
    assert fastopt.apply_rules(m, [_silu_rule()])[0] == 0
    assert m.op_counts() == {"Sigmoid": 1, "Mul": 1}


def test_intermediate_with_other_uses_blocks_the_match() -> None:
    proto = _model(
        [
            helper.make_node("Sigmoid", ["X"], ["s"]),
            helper.make_node("Mul", ["X", "s"], ["Y"]),
            helper.make_node("Neg", ["s"], ["W"]),
        ],
        [_vi("X")],
        [_vi("Y"), _vi("W")],
    )
    m = fastopt.from_onnx(proto)
    rewrites, _, lines = fastopt.apply_rules(m, [_silu_rule()], explain_rule="silu")
    assert rewrites == 0
    assert any("uses outside the match" in line for line in lines), lines


def test_shared_node_allows_other_uses() -> None:
    p = fastopt.Pattern("silu_shared")
    x = p.var("x")
    p.root(p.op("Mul", [x, p.op("Sigmoid", [x]).shared()]).commutative())
    rule = fastopt.Rule(
        "silu_shared", p, replace=("QuickGelu", ["x"], {"alpha": 1.0}, "com.microsoft")
    )
    proto = _model(
        [
            helper.make_node("Sigmoid", ["X"], ["s"]),
            helper.make_node("Mul", ["X", "s"], ["Y"]),
            helper.make_node("Neg", ["s"], ["W"]),
        ],
        [_vi("X")],
        [_vi("Y"), _vi("W")],
    )
    m = fastopt.from_onnx(proto)
    assert fastopt.apply_rules(m, [rule])[0] == 1
    m.verify()
    assert m.op_counts() == {"com.microsoft::QuickGelu": 1, "Sigmoid": 1, "Neg": 1}
    for a, b in zip(_run(m, {"X": X}), _run(proto, {"X": X})):
        np.testing.assert_allclose(a, b, atol=1e-6)


def _gelu_model(with_cast: bool, half: float = 0.5) -> onnx.ModelProto:
    """Gelu (erf form): 0.5 * x * (1 + erf(x / sqrt(2))), optionally through a Cast."""
    nodes = []
    src = "X"
    if with_cast:
        nodes.append(helper.make_node("Cast", ["X"], ["xc"], to=F))
        src = "xc"
    nodes += [
        helper.make_node("Div", [src, "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", [src, "a"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["Y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(v, np.float32), n)
        for n, v in (("sqrt2", 1.4142135), ("one", 1.0), ("half", half))
    ]
    return _model(nodes, [_vi("X")], [_vi("Y")], inits)


def _gelu_rule() -> fastopt.Rule:
    p = fastopt.Pattern("gelu")
    x = p.optional(p.op("Cast", [p.var("x")]))
    erf = p.op("Erf", [p.op("Div", [x, p.scalar("sqrt2", 1.4142135, 1e-4)])])
    inner = p.op("Mul", [x, p.op("Add", [erf, p.scalar("one", 1.0)]).commutative()]).commutative()
    p.root(p.op("Mul", [inner, p.scalar("half", 0.5)]).commutative())
    return fastopt.Rule("gelu", p, replace=("Gelu", ["x"], {}, "com.microsoft"))


@pytest.mark.parametrize("with_cast", [False, True])
def test_optional_node_and_constants(with_cast: bool) -> None:
    proto = _gelu_model(with_cast)
    m = fastopt.from_onnx(proto)
    assert fastopt.apply_rules(m, [_gelu_rule()])[0] == 1
    fastopt.optimize(m, passes=["eliminate_dead_nodes"])
    m.verify()
    assert m.op_counts() == {"com.microsoft::Gelu": 1}
    np.testing.assert_allclose(_run(m, {"X": X})[0], _run(proto, {"X": X})[0], atol=1e-5)


def test_constant_value_constraint_rejects_other_values() -> None:
    m = fastopt.from_onnx(_gelu_model(False, half=0.25))
    rewrites, _, lines = fastopt.apply_rules(m, [_gelu_rule()], explain_rule="*")
    assert rewrites == 0
    assert any("constant value constraint failed" in line for line in lines), lines


def test_alternatives_and_attribute_constraints() -> None:
    p = fastopt.Pattern("relu_or_clip")
    x = p.var("x")
    act = p.alt("act", [p.op("Relu", [x]), p.op("LeakyRelu", [x]).attr("alpha", 0.0)])
    p.root(p.op("Neg", [act]))
    rule = fastopt.Rule("relu_or_clip", p, replace=("Neg", ["act"], {}))

    def model(op: str, **attrs: float) -> fastopt.Model:
        return fastopt.from_onnx(
            _model(
                [
                    helper.make_node(op, ["X"], ["r"], **attrs),
                    helper.make_node("Neg", ["r"], ["Y"]),
                ],
                [_vi("X")],
                [_vi("Y")],
            )
        )

    # The replacement reads "act" itself: a no-op rewrite that still proves binding; what
    # matters is which graphs match at all.
    for op, attrs, expected in (
        ("Relu", {}, 1),
        ("LeakyRelu", {"alpha": 0.0}, 1),
        ("LeakyRelu", {"alpha": 0.1}, 0),
        ("Sigmoid", {}, 0),
    ):
        m = model(op, **attrs)
        got = fastopt.apply_rules(m, [rule], max_iterations=1)[0]
        assert got == expected, (op, attrs)
        m.verify()


def test_python_rewrite_and_transactional_failure() -> None:
    calls: list[str] = []

    def rewrite(match: fastopt.Match, rw: fastopt.Rewriter):
        calls.append(match.root.op_type)
        x = match["x"]
        # Build something, then decline: the graph must stay untouched.
        rw.op("Relu", [x])
        return rw.fail("declined on purpose")

    p = fastopt.Pattern("decline")
    x = p.var("x")
    p.root(p.op("Mul", [x, p.op("Sigmoid", [x])]).commutative())
    proto = _model(
        [helper.make_node("Sigmoid", ["X"], ["s"]), helper.make_node("Mul", ["X", "s"], ["Y"])],
        [_vi("X")],
        [_vi("Y")],
    )
    m = fastopt.from_onnx(proto)
    rewrites, _, lines = fastopt.apply_rules(
        m, [fastopt.Rule("decline", p, rewrite=rewrite)], explain_rule="decline"
    )
    assert rewrites == 0 and calls == ["Mul"]
    assert any("declined on purpose" in line for line in lines)
    m.verify()
    assert m.to_onnx() == proto


def test_python_rewrite_builds_initializers() -> None:
    """x * Sigmoid(x) -> x * Sigmoid(x * 1.0): exercises Rewriter.op and .initializer."""

    def rewrite(match: fastopt.Match, rw: fastopt.Rewriter):
        one = rw.initializer("one", np.ones((1,), np.float32))
        scaled = rw.op("Mul", [match["x"], one])[0]
        sig = rw.op("Sigmoid", [scaled])[0]
        return [rw.op("Mul", [match["x"], sig])[0]]

    p = fastopt.Pattern("rebuild")
    x = p.var("x")
    p.root(p.op("Mul", [x, p.op("Sigmoid", [x])]).commutative())
    proto = _model(
        [helper.make_node("Sigmoid", ["X"], ["s"]), helper.make_node("Mul", ["X", "s"], ["Y"])],
        [_vi("X")],
        [_vi("Y")],
    )
    m = fastopt.from_onnx(proto)
    assert (
        fastopt.apply_rules(m, [fastopt.Rule("rebuild", p, rewrite=rewrite)], max_iterations=1)[0]
        == 1
    )
    m.verify()
    assert m.op_counts() == {"Mul": 2, "Sigmoid": 1}
    np.testing.assert_allclose(_run(m, {"X": X})[0], _run(proto, {"X": X})[0], atol=1e-6)


def test_template_takes_scalar_attribute_from_match() -> None:
    """Mul(x, c) with scalar c -> com.microsoft-free rewrite via attribute from "$c"."""
    p = fastopt.Pattern("leaky")
    x = p.var("x")
    c = p.constant("c")
    p.root(p.op("Max", [x, p.op("Mul", [x, c]).commutative()]).commutative())
    rule = fastopt.Rule("leaky", p, replace=("LeakyRelu", ["x"], {"alpha": "$c"}))
    proto = _model(
        [helper.make_node("Mul", ["X", "c"], ["m"]), helper.make_node("Max", ["X", "m"], ["Y"])],
        [_vi("X")],
        [_vi("Y")],
        [numpy_helper.from_array(np.array(0.2, np.float32), "c")],
    )
    m = fastopt.from_onnx(proto)
    assert fastopt.apply_rules(m, [rule])[0] == 1
    (node,) = [n for n in m.graph.nodes if n.op_type == "LeakyRelu"]
    assert node.attributes["alpha"] == pytest.approx(0.2)
    np.testing.assert_allclose(_run(m, {"X": X})[0], _run(proto, {"X": X})[0], atol=1e-6)


def test_larger_pattern_wins_over_its_subpattern() -> None:
    """Both rules are rooted at the final Mul; the 7-op gelu pattern is tried before the 1-op
    one, whatever the order the rules are given in."""
    small = fastopt.Pattern("mul_by_half")
    small.root(small.op("Mul", [small.var("v"), small.scalar("half", 0.5)]).commutative())
    small_rule = fastopt.Rule("mul_by_half", small, replace=("Mul", ["v", "half"]))
    for rules in ([small_rule, _gelu_rule()], [_gelu_rule(), small_rule]):
        m = fastopt.from_onnx(_gelu_model(False))
        _, per_rule, _ = fastopt.apply_rules(m, rules, max_iterations=1)
        assert per_rule == {"gelu": 1}


def test_subgraphs_are_visited() -> None:
    body = helper.make_graph(
        [helper.make_node("Sigmoid", ["X"], ["s"]), helper.make_node("Mul", ["X", "s"], ["t"])],
        "then",
        [],
        [_vi("t")],
    )
    other = helper.make_graph([helper.make_node("Neg", ["X"], ["e"])], "else", [], [_vi("e")])
    proto = _model(
        [helper.make_node("If", ["C"], ["Y"], then_branch=body, else_branch=other)],
        [_vi("X"), helper.make_tensor_value_info("C", TensorProto.BOOL, [])],
        [_vi("Y")],
    )
    m = fastopt.from_onnx(proto)
    assert fastopt.apply_rules(m, [_silu_rule()])[0] == 1
    m.verify()
    feeds = {"X": X, "C": np.array(True)}
    np.testing.assert_allclose(_run(m, feeds)[0], _run(proto, feeds)[0], atol=1e-6)


def test_registered_rules_run_through_optimize(tmp_path: Path) -> None:
    fastopt.register_rules("test_fuse_silu", "SiLU to QuickGelu (test)", [_silu_rule()])
    try:
        proto = _model(
            [helper.make_node("Sigmoid", ["X"], ["s"]), helper.make_node("Mul", ["s", "X"], ["Y"])],
            [_vi("X")],
            [_vi("Y")],
        )
        path = tmp_path / "in.onnx"
        onnx.save(proto, path)
        report = fastopt.optimize(
            path,
            passes=["test_fuse_silu", "eliminate_dead_nodes"],
            output=tmp_path / "out.onnx",
            explain="*",
        )
        assert report.passes[0].rewrites == 1
        assert report.passes[0].counters == {"silu": 1}
        assert report.ops_after == {"com.microsoft::QuickGelu": 1}
        assert any("rewritten" in line for line in report.explain)
        onnx.checker.check_model(str(tmp_path / "out.onnx"))
        out = onnx.load(tmp_path / "out.onnx")
        np.testing.assert_allclose(_run(out, {"X": X})[0], _run(proto, {"X": X})[0], atol=1e-6)
        assert onnx.load(path) == proto  # the input is untouched
    finally:
        fastopt.unregister_pass("test_fuse_silu")


def test_rule_needs_exactly_one_rewrite() -> None:
    p = fastopt.Pattern("x")
    p.root(p.op("Relu", [p.var("x")]))
    with pytest.raises(fastopt.ModelError, match="exactly one"):
        fastopt.Rule("x", p)


def _add_model(x_shape: list, b_shape: list) -> onnx.ModelProto:
    return _model(
        [helper.make_node("Add", ["X", "B"], ["s"]), helper.make_node("Relu", ["s"], ["Y"])],
        [_vi("X", x_shape), _vi("B", b_shape)],
        [_vi("Y", x_shape)],
    )


@pytest.mark.parametrize(
    ("x_shape", "b_shape", "fires"),
    [
        (["batch", 4], [4], True),  # last dims equal (numbers)
        (["batch", "h"], ["h"], True),  # last dims equal (same symbol)
        (["batch", 4], [3], False),  # differ
        (["batch", "h"], ["w"], False),  # different symbols: not provably equal
        (["batch", None], [4], False),  # unknown dim: cannot prove
    ],
)
def test_symbolic_dims_bind_once_per_match(x_shape: list, b_shape: list, fires: bool) -> None:
    p = fastopt.Pattern("bias_relu")
    x = p.var("x").dim(-1, "H")
    b = p.var("b").dim(0, "H").rank(1)
    p.root(p.op("Relu", [p.op("Add", [x, b]).commutative()]))
    rule = fastopt.Rule("bias_relu", p, replace=("Relu", ["x"]))  # what fires is what matters
    proto = _add_model(x_shape, b_shape)
    m = fastopt.from_onnx(proto)
    rewrites, _, lines = fastopt.apply_rules(m, [rule], max_iterations=1, explain_rule="*")
    assert rewrites == int(fires), lines
    m.verify()


def test_rewrite_that_would_make_a_cycle_is_rolled_back() -> None:
    """A rewrite whose replacement depends on a reader of the value it replaces (here
    Relu(X) -> Identity(Neg(Relu(X)))) would close a cycle: the driver declines it with the
    reason, and the graph is left as it was."""
    proto = _model(
        [
            helper.make_node("Relu", ["X"], ["r"]),
            helper.make_node("Neg", ["r"], ["n"]),
            helper.make_node("Add", ["n", "X"], ["Y"]),
        ],
        [_vi("X")],
        [_vi("Y")],
    )
    m = fastopt.from_onnx(proto)
    p = fastopt.Pattern("relu_from_downstream")
    p.root(p.op("Relu", [p.var("x")]))

    def rewrite(match: fastopt.Match, rw: fastopt.Rewriter) -> list[fastopt.Value | None]:
        downstream = m.graph.value("n")
        assert downstream is not None
        return rw.op("Identity", [downstream])

    rule = fastopt.Rule("relu_from_downstream", p, rewrite)
    rewrites, _, lines = fastopt.apply_rules(m, [rule], explain_rule="relu_from_downstream")
    assert rewrites == 0
    assert any(
        "matched, but the rewrite declined: the replacement of 'r' depends on node" in line
        and "(Neg), which reads it: rewriting would make a cycle" in line
        for line in lines
    ), lines
    m.verify()
    assert m.op_counts() == {"Relu": 1, "Neg": 1, "Add": 1}
    np.testing.assert_allclose(_run(m, {"X": X})[0], _run(proto, {"X": X})[0])
