"""The native shape analysis through If / Loop / Scan (csrc/analysis/control_flow.cc): unit
graphs for each rule, the real control-flow exports of tests/fixtures/control_flow (made by
make_control_flow_fixtures.py) checked against onnx's inference and ORT's actual shapes, and
the optimize report saying which inference ran."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import assert_outputs_identical, run_ort
from fastopt import _C
from onnx import TensorProto, helper, numpy_helper
from support.paths import TESTS
from support.subgraph_models import BUILDERS, loop_with_if, nested_if

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
OPSET = [helper.make_opsetid("", 18)]
FIXTURES = TESTS / "fixtures" / "control_flow"
EXPORTS = sorted(FIXTURES.glob("*.onnx"))


def _vi(name: str, dtype: int, shape: list[Any] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _vis(names: str, dtype: int) -> list[onnx.ValueInfoProto]:
    return [_vi(n, dtype, None) for n in names.split()]


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    inits: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=OPSET, ir_version=9)


def _facts(model: onnx.ModelProto) -> dict[str, Any]:
    m = fastopt.from_onnx(model)
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {}
    return {k: (v[1], v[2]) for k, v in _C.shape_facts(m, subgraphs=True).items()}


def _fresh(d: Any) -> bool:
    return isinstance(d, str) and d.startswith("?")


def _if_model(cond: str, inits: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """then: X[B, 4] + 1 -> [B, 4]; else: Concat(X, X, axis 1) -> [B, 8]; and Shape(X) out of
    both branches (equal shape values)."""
    then_g = helper.make_graph(
        [
            helper.make_node("Add", ["X", "one"], ["t"]),
            helper.make_node("Shape", ["X"], ["ts"]),
        ],
        "then",
        [],
        [_vi("t", F, None), _vi("ts", I64, None)],
    )
    else_g = helper.make_graph(
        [
            helper.make_node("Concat", ["X", "X"], ["e"], axis=1),
            helper.make_node("Shape", ["X"], ["es"]),
        ],
        "else",
        [],
        [_vi("e", F, None), _vi("es", I64, None)],
    )
    nodes = [helper.make_node("If", [cond], ["Y", "S"], then_branch=then_g, else_branch=else_g)]
    inputs = [_vi("X", F, ["B", 4])]
    if cond == "c":
        inputs.append(_vi("c", B, []))
    inits = [numpy_helper.from_array(np.array(1, np.float32), "one"), *inits]
    return _model(nodes, inputs, [_vi("Y", F, None), _vi("S", I64, None)], inits)


def test_if_merges_the_branches() -> None:
    f = _facts(_if_model("c"))
    assert f["t"][0] == ["B", 4] and f["e"][0] == ["B", 8]  # branch values have facts
    dims, _ = f["Y"]
    assert dims[0] == "B" and _fresh(dims[1])  # equal dims kept, differing ones fresh
    assert f["S"] == ([2], ["B", 4])  # the branches' equal shape values survive the merge


@pytest.mark.parametrize("picked", [True, False])
def test_a_constant_condition_picks_the_branch(picked: bool) -> None:
    const = numpy_helper.from_array(np.array(picked), "k")
    f = _facts(_if_model("k", [const]))
    assert f["Y"][0] == (["B", 4] if picked else ["B", 8])


def _loop_model(trip: str, cond: str, inits: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """A Loop carrying state [B, 4] (invariant: state + W), grow (Concat on axis 1: grows
    every iteration), count (a counter from 0: its value changes), and a scan output
    state * i."""
    last_outs = [*_vis("count_next", I64), *_vis("scan", F)]
    body = helper.make_graph(
        [
            helper.make_node("Add", ["state", "W"], ["state_next"]),
            helper.make_node("Concat", ["grow", "state"], ["grow_next"], axis=1),
            helper.make_node("Add", ["count", "one_i"], ["count_next"]),
            helper.make_node("Cast", ["i"], ["i_f"], to=F),
            helper.make_node("Mul", ["state_next", "i_f"], ["scan"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [_vi("i", I64, []), _vi("cond_in", B, []), *_vis("state grow", F), *_vis("count", I64)],
        [_vi("cond_out", B, None), *_vis("state_next grow_next", F), *last_outs],
    )
    nodes = [
        helper.make_node("Shape", ["X"], ["xs"]),
        helper.make_node("Gather", ["xs", "zero_i"], ["n_rows"], axis=0),
        helper.make_node(
            "Loop",
            [trip, cond, "X", "X", "zero_i"],
            ["state_out", "grow_out", "count_out", "scans"],
            body=body,
        ),
        helper.make_node("Shape", ["count_out"], ["count_shape"]),
    ]
    inits = [
        numpy_helper.from_array(np.full(4, 0.5, np.float32), "W"),
        numpy_helper.from_array(np.array(0, np.int64), "zero_i"),
        numpy_helper.from_array(np.array(1, np.int64), "one_i"),
        *inits,
    ]
    inputs = [_vi("X", F, ["B", 4])]
    if cond == "go":
        inputs.append(_vi("go", B, []))
    outs = ["state_out", "grow_out", "count_out", "scans", "count_shape"]
    types = {"count_out": I64, "count_shape": I64}
    return _model(nodes, inputs, [_vi(o, types.get(o, F), None) for o in outs], inits)


def test_loop_proves_invariant_carried_shapes_and_widens_the_rest() -> None:
    trip = numpy_helper.from_array(np.array(3, np.int64), "three")
    f = _facts(_loop_model("three", "", [trip]))
    assert f["state"][0] == ["B", 4] and f["state_out"][0] == ["B", 4]
    # grow: [B, 4] then [B, 8], ...: the rank and B hold, the growing dim is unknown
    grow_in, grow_out = f["grow"][0], f["grow_out"][0]
    assert grow_in[0] == "B" and _fresh(grow_in[1])
    assert grow_out[0] == "B" and _fresh(grow_out[1]) and grow_out[1] != grow_in[1]
    # count starts at 0 but changes: its shape holds, its value is not claimed
    assert f["count"] == ([], None) and f["count_out"] == ([], None)
    assert f["count_shape"] == ([0], [])
    # a constant trip count and a condition that stays true: the scan output has 3 rows
    assert f["scans"][0] == [3, "B", 4]


def test_loop_trip_count_from_a_shape_value_and_an_early_exit() -> None:
    f = _facts(_loop_model("n_rows", ""))
    assert f["scans"][0] == ["B", "B", 4]  # trip count = X's dim 0, symbolically
    f = _facts(_loop_model("n_rows", "go"))  # a condition input: the loop may stop early
    dims = f["scans"][0]
    assert _fresh(dims[0]) and dims[1:] == ["B", 4]


def test_loop_matches_onnxruntime() -> None:
    trip = numpy_helper.from_array(np.array(3, np.int64), "three")
    model = _loop_model("three", "", [trip])
    f = _facts(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    got = dict(zip(names, sess.run(names, {"X": np.ones((5, 4), np.float32)})))
    assert got["state_out"].shape == (5, 4) and got["scans"].shape == (3, 5, 4)
    assert got["grow_out"].shape == (5, 16) and f["grow_out"][0][0] == "B"
    assert got["count_out"] == 3  # not the initial 0: a fold of it would be wrong


def _scan_model(in_axis: int, out_axis: int) -> onnx.ModelProto:
    """Scan over X [S, B, 4] (or [B, S, 4]): a running sum [B, 4] and a scan output sum * 2."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["acc", "row"], ["acc_next"]),
            helper.make_node("Mul", ["acc_next", "two"], ["out"]),
        ],
        "body",
        [_vi("acc", F, None), _vi("row", F, None)],
        [_vi("acc_next", F, None), _vi("out", F, None)],
    )
    x = ["S", "B", 4] if in_axis == 0 else ["B", "S", 4]
    node = helper.make_node(
        "Scan",
        ["acc0", "X"],
        ["acc_final", "outs"],
        body=body,
        num_scan_inputs=1,
        scan_input_axes=[in_axis],
        scan_output_axes=[out_axis],
    )
    return _model(
        [node],
        [_vi("acc0", F, ["B", 4]), _vi("X", F, x)],
        [_vi("acc_final", F, None), _vi("outs", F, None)],
        [numpy_helper.from_array(np.array(2, np.float32), "two")],
    )


@pytest.mark.parametrize(
    ("in_axis", "out_axis", "want"), [(0, 0, ["S", "B", 4]), (1, -1, ["B", 4, "S"])]
)
def test_scan(in_axis: int, out_axis: int, want: list[Any]) -> None:
    model = _scan_model(in_axis, out_axis)
    f = _facts(model)
    assert f["row"][0] == ["B", 4] and f["acc_final"][0] == ["B", 4]
    assert f["outs"][0] == want
    x = np.ones((3, 2, 4) if in_axis == 0 else (2, 3, 4), np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"acc0": np.zeros((2, 4), np.float32), "X": x})
    assert list(got[1].shape) == [{"S": 3, "B": 2}.get(d, d) for d in want]


def test_nested_bodies_and_outer_scope_values() -> None:
    model, _ = loop_with_if()
    f = _facts(model)
    assert f["acc_new"][0] == [2] and f["b"][0] == [2] and f["b2"][0] == [2]  # If in a Loop
    assert f["scans"][0][1:] == [2]
    model, _ = nested_if()
    f = _facts(model)
    assert f["ie"][0] == [3] and f["it"][0] == [3] and f["Y"][0] == [3]  # X two levels up


def test_deeply_nested_loops_stay_one_sweep_per_level() -> None:
    """24 Loops inside each other, each carrying a value that grows (Concat with itself): a
    fixpoint at every level would take 2^24 sweeps; below depth 2 the carried values claim
    nothing, so this returns at once. The outermost levels are still proven."""
    depth = 24
    inner: onnx.GraphProto | None = None
    for level in reversed(range(depth)):
        x, nxt = f"x{level}", f"x{level}_next"
        nodes = [helper.make_node("Concat", [x, x], [nxt], axis=0)]
        if inner is not None:
            nodes.append(helper.make_node("Loop", ["n", "", nxt], [f"r{level}"], body=inner))
        inner = helper.make_graph(
            nodes,
            f"body{level}",
            [_vi(f"i{level}", I64, []), _vi(f"c{level}", B, []), _vi(x, F, None)],
            [_vi(f"c{level}_out", B, None), _vi(nxt, F, None)],
        )
        inner.node.append(helper.make_node("Identity", [f"c{level}"], [f"c{level}_out"]))
    model = _model(
        [helper.make_node("Loop", ["n", "", "X"], ["Y"], body=inner)],
        [_vi("n", I64, []), _vi("X", F, [2, 3])],
        [_vi("Y", F, None)],
    )
    m = fastopt.from_onnx(model)
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {} and _C.shape_analysis_summary(m)[1] == depth
    facts = _C.shape_facts(m, subgraphs=True)
    assert _fresh(facts["Y"][1][0]) and facts["Y"][1][1] == 3  # level 0: rank and dim 1 proven
    assert facts["x1"][1][1] == 3  # level 1 too
    assert facts["x3"][1] is None  # deeper: nothing claimed


# --- the real exports ------------------------------------------------------------------------


def _onnx_types(model: onnx.ModelProto) -> dict[str, tuple[int, list[Any] | None]]:
    out: dict[str, tuple[int, list[Any] | None]] = {}

    def walk(g: onnx.GraphProto) -> None:
        for vi in [*g.value_info, *g.output]:
            t = vi.type.tensor_type
            dims = None
            if t.HasField("shape"):
                dims = [
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in t.shape.dim
                ]
            out[vi.name] = (t.elem_type, dims)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)

    walk(model.graph)
    return out


def test_there_are_control_flow_exports() -> None:
    assert {p.stem for p in EXPORTS} >= {"ts_loop_if", "ts_nested", "dynamo_cond"}


def _agreement(model: onnx.ModelProto) -> tuple[int, int]:
    """Checks the facts (bodies included) against onnx's inference: the same element types,
    ranks and numbers wherever onnx has them; returns (dims compared, dims only the analysis
    knows)."""
    m = fastopt.from_onnx(model)
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {}, "If, Loop, Scan and every op of their bodies have rules"
    assert _C.shape_analysis_summary(m)[1] >= 1  # bodies analysed
    facts = _C.shape_facts(m, subgraphs=True)
    theirs = _onnx_types(onnx.shape_inference.infer_shapes(model, data_prop=True))
    compared = more_precise = 0
    for name, (dtype, dims) in theirs.items():
        if name not in facts:
            continue
        ours_dtype, ours, _ = facts[name]
        if dtype:
            assert ours_dtype == dtype, name
        if dims is None:
            more_precise += ours is not None
            continue
        assert ours is not None and len(ours) == len(dims), (name, ours, dims)
        for t, mine in zip(dims, ours):
            compared += 1
            if isinstance(t, int):
                assert mine == t, (name, ours, dims)  # never less precise, never different
            elif not _fresh(mine) and (t is None or t.startswith("unk__")):
                more_precise += 1
    return compared, more_precise


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.stem)
def test_export_facts_agree_with_onnx_inference(path: Path) -> None:
    compared, more_precise = _agreement(onnx.load(path))
    assert compared > 0
    if path.stem.startswith("ts_"):
        # TorchScript's own declared types lose loop-carried and reshaped dims.
        assert more_precise > 0, (compared, more_precise)


@pytest.mark.parametrize("name", ["nested_if", "loop_with_if", "scan_outer_scope"])
def test_subgraph_models_agree_with_onnx_and_onnxruntime(name: str) -> None:
    model, feeds = BUILDERS[name]()
    assert _agreement(model)[0] > 0
    facts = _C.shape_facts(fastopt.from_onnx(model))
    names = [o.name for o in model.graph.output]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for feed in feeds:
        for out, arr in zip(names, sess.run(names, feed)):
            dims = facts[out][1]
            assert dims is not None and len(dims) == arr.ndim
            assert all(_fresh(d) or d == a for d, a in zip(dims, arr.shape)), (out, dims)


def _evaluate(expr: Any, bindings: dict[str, int]) -> int | None:
    if isinstance(expr, int):
        return expr
    try:
        return int(eval(expr, {"__builtins__": {}}, dict(bindings)))  # products / sums
    except (NameError, SyntaxError):  # a fresh symbol or an exporter's own dim name
        return None


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.stem)
@pytest.mark.parametrize(("batch", "seq"), [(2, 5), (3, 1)])
def test_export_facts_match_onnxruntime_shapes(path: Path, batch: int, seq: int) -> None:
    model = onnx.load(path)
    facts = _C.shape_facts(fastopt.from_onnx(model))
    names = [n for n in dict.fromkeys(o for node in model.graph.node for o in node.output) if n]
    del model.graph.output[:]
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    x = np.random.default_rng(seq).standard_normal((batch, seq, 16)).astype(np.float32)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    bindings = {"batch": batch, "seq": seq}
    symbols: dict[str, int] = {}
    checked = 0
    for name, arr in zip(names, sess.run(names, {"x": x})):
        _, dims, value = facts[name]
        if dims is None:
            continue
        assert len(dims) == arr.ndim, (name, dims, arr.shape)
        for d, actual in zip(dims, arr.shape):
            want = _evaluate(d, bindings)
            if want is None:  # unknown, but the same symbol is the same size everywhere
                assert symbols.setdefault(str(d), actual) == actual, (name, dims, arr.shape)
            else:
                assert want == actual, (name, dims, arr.shape)
                checked += 1
        if value is not None:
            for v, actual in zip(value, np.asarray(arr).reshape(-1)):
                if (want := _evaluate(v, bindings)) is not None:
                    assert want == actual, (name, value, arr)
    assert checked > 0


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.stem)
def test_optimized_exports_match_and_report_the_inference(path: Path, tmp_path: Path) -> None:
    out = tmp_path / "opt.onnx"
    report = fastopt.optimize(path, output=out)
    assert report.shape_inference, "the report says which inference ran"
    assert all("native for" in line and "onnx" not in line for line in report.shape_inference)
    rng = np.random.default_rng(0)
    for batch, seq in ((2, 5), (1, 3)):
        feeds = {"x": rng.standard_normal((batch, seq, 16)).astype(np.float32)}
        assert_outputs_identical(run_ort(path, feeds), run_ort(out, feeds))


def test_report_names_the_fallback_op_types() -> None:
    """An op the analysis has no rule for, inside a Loop body: onnx's inference runs, and the
    report says for what."""
    body = helper.make_graph(
        [
            helper.make_node("Det", ["m"], ["d"]),  # no native rule
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["m"], ["m_next"]),
        ],
        "body",
        [_vi("i", I64, []), _vi("cond_in", B, []), _vi("m", F, None)],
        [_vi("cond_out", B, None), _vi("m_next", F, None), _vi("d", F, None)],
    )
    model = _model(
        [helper.make_node("Loop", ["n", "", "M"], ["m_out", "ds"], body=body)],
        [_vi("n", I64, []), _vi("M", F, [3, 3])],
        [_vi("m_out", F, None), _vi("ds", F, None)],
    )
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["infer_shapes"])
    (line,) = report.shape_inference
    assert line.startswith("infer_shapes: native for 3 nodes (1 bodies); onnx fallback for Det x1")
    counters = report.passes[0].counters
    assert counters["native_nodes"] == 3 and counters["native_unknown:Det"] == 1
    assert counters["engine:onnx"] == 1


def test_folds_reach_past_if_and_loop_outputs() -> None:
    """ts_nested ends in out.reshape(out.size(0), out.size(1), -1) of an If output: with the
    If's dims known ([batch, 16, seq]) the Reshape is the identity and its Shape -> Gather ->
    Concat chain dies (without them, 26 nodes stay)."""
    report = fastopt.optimize(FIXTURES / "ts_nested.onnx")
    assert report.model is not None
    main_ops = {n.op_type for n in report.model.graph.nodes}
    assert "Reshape" not in main_ops and "Concat" not in main_ops, main_ops
    assert report.nodes_after == 19
