"""fold_shapes: Shape/Size, and Gather/Slice of Shape, over dims known from value types; and the
folding pipeline (infer_shapes + fold_shapes + fold_constants + DCE) on the reference corpus."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from conftest import corpus_models, model_id, random_feeds, run_ort
from onnx import TensorProto, helper
from support.folding_helpers import assert_parity, make_model, op_counts, optimize, out

F, INT = TensorProto.FLOAT, TensorProto.INT64
I64_MAX = np.iinfo(np.int64).max
FOLDING = ["infer_shapes", "fold_shapes", "fold_constants", "eliminate_dead_nodes"]


def n(op: str, inputs: list[str], output: str, **attrs: object) -> onnx.NodeProto:
    return helper.make_node(op, inputs, [output], **attrs)


def reshape_chain(x_shape: list[int | str]) -> onnx.ModelProto:
    """Y = Reshape(X, [X.shape[0], X.shape[1] * X.shape[2]]), the way TorchScript exports it."""
    nodes = [
        n("Shape", ["X"], "s"),
        n("Gather", ["s", "i0"], "d0"),
        n("Gather", ["s", "i1"], "d1"),
        n("Gather", ["s", "i2"], "d2"),
        n("Mul", ["d1", "d2"], "d12"),
        n("Unsqueeze", ["d0", "zero"], "u0"),
        n("Unsqueeze", ["d12", "zero"], "u1"),
        n("Concat", ["u0", "u1"], "shape", axis=0),
        n("Reshape", ["X", "shape"], "Y"),
    ]
    inits = {
        "i0": np.array(0, np.int64),
        "i1": np.array(1, np.int64),
        "i2": np.array(-1, np.int64),
        "zero": np.array([0], np.int64),
    }
    return make_model(nodes, [out("X", F, x_shape)], [out("Y", F, [x_shape[0], None])], inits)


def test_static_shape_chain_collapses(tmp_path: Path) -> None:
    model = reshape_chain([2, 3, 4])
    report, path = optimize(model, FOLDING, tmp_path)
    assert op_counts(path) == {"Reshape": 1}
    # The shape analysis proves the whole target [2, 12]: one constant, the chain dies.
    assert report.passes[1].counters == {"shape_value(Concat)": 1}
    assert_parity(model, path, tmp_path)


def test_partially_static_chain_folds_the_static_dims(tmp_path: Path) -> None:
    model = reshape_chain(["batch", 3, 4])
    report, path = optimize(model, FOLDING, tmp_path)
    # The shape analysis proves the target is [batch, 12] with batch = X's dim 0:
    # Reshape(X, [0, 12]), and the chain dies.
    assert report.passes[1].counters == {"shape_value(Unsqueeze)": 1, "Reshape(target)": 1}
    assert op_counts(path) == {"Reshape": 1}
    proto = onnx.load(str(path))
    reshape = next(x for x in proto.graph.node if x.op_type == "Reshape")
    init = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert init[reshape.input[1]].tolist() == [0, 12]
    for batch in (1, 5):
        feeds = {"X": np.random.default_rng(batch).standard_normal((batch, 3, 4), np.float32)}
        assert_parity(model, path, tmp_path, feeds=feeds)


@pytest.mark.parametrize(
    ("nodes", "inits", "folded", "value"),
    [
        ([n("Shape", ["X"], "Y", start=1)], {}, True, [3, 4]),
        ([n("Shape", ["X"], "Y", start=-1, end=8)], {}, True, [4]),
        ([n("Shape", ["X"], "Y", end=1)], {}, False, None),  # the batch dim
        (
            [n("Shape", ["X"], "s"), n("Slice", ["s", "a", "b"], "Y")],
            {"a": [1], "b": [I64_MAX]},
            True,
            [3, 4],
        ),
        (
            [n("Shape", ["X"], "s"), n("Slice", ["s", "a", "b", "ax", "st"], "Y")],
            {"a": [-1], "b": [0], "ax": [0], "st": [-1]},
            True,
            [4, 3],
        ),
        (
            [n("Shape", ["X"], "s"), n("Slice", ["s", "a", "b"], "Y")],
            {"a": [0], "b": [2]},
            False,
            None,
        ),
        ([n("Shape", ["X"], "s"), n("Gather", ["s", "i"], "Y")], {"i": [2, 1]}, True, [4, 3]),
        ([n("Shape", ["X"], "s"), n("Gather", ["s", "i"], "Y")], {"i": [1, 0]}, False, None),
        (
            [
                n(
                    "Shape",
                    [
                        "X",
                    ],
                    "s",
                    start=1,
                ),
                n("Gather", ["s", "i"], "Y"),
            ],
            {"i": [-1]},
            True,
            [4],
        ),
    ],
    ids=[
        "start",
        "negative_start",
        "dynamic_end",
        "slice",
        "slice_reversed",
        "slice_dynamic",
        "gather",
        "gather_dynamic",
        "gather_after_start",
    ],
)
def test_shape_folds_where_selected_dims_are_static(
    nodes: list, inits: dict, folded: bool, value: list | None, tmp_path: Path
) -> None:
    arrays = {k: np.array(v, np.int64) for k, v in inits.items()}
    model = make_model(
        [*nodes, n("Cast", ["Y"], "Z", to=F)],
        [out("X", F, ["batch", 3, 4])],
        [out("Z", F, [None])],
        arrays,
        opset=18,
    )
    report, path = optimize(
        model, ["fold_shapes", "fold_constants", "eliminate_dead_nodes"], tmp_path
    )
    assert (report.passes[0].rewrites > 0) == folded
    if folded:
        assert op_counts(path) == {"Cast": 1} or op_counts(path) == {"Constant": 1}
        proto = onnx.load(str(path))
        (z,) = run_ort(path, {"X": np.zeros((2, 3, 4), np.float32)})
        assert z.tolist() == value
        assert not any(x.op_type == "Shape" for x in proto.graph.node)
    assert_parity(model, path, tmp_path, feeds={"X": np.zeros((5, 3, 4), np.float32)})


def test_size(tmp_path: Path) -> None:
    model = make_model(
        [n("Size", ["X"], "a"), n("Size", ["D"], "b"), n("Add", ["a", "b"], "Y")],
        [out("X", F, [2, 3]), out("D", F, ["n", 3])],
        [out("Y", INT, [])],
    )
    report, path = optimize(model, ["fold_shapes"], tmp_path)
    assert report.passes[0].counters == {"Size": 1}
    assert op_counts(path) == {"Size": 1, "Add": 1}
    assert_parity(model, path, tmp_path)


def test_types_come_from_shape_inference_when_missing(tmp_path: Path) -> None:
    # Shape(Transpose(X)): only inference knows the transposed dims; fold_shapes asks for it.
    model = make_model(
        [
            n("Transpose", ["X"], "t", perm=[1, 0]),
            n("Shape", ["t"], "s"),
            n("Reshape", ["X", "s"], "Y"),
        ],
        [out("X", F, [2, 3])],
        [out("Y", F, [3, 2])],
    )
    report, path = optimize(model, ["fold_shapes"], tmp_path)
    assert report.passes[0].counters == {"Shape": 1}
    assert_parity(model, path, tmp_path)


def test_does_not_fold_dynamic_or_unknown(tmp_path: Path) -> None:
    model = make_model(
        [
            n("Shape", ["X"], "s"),
            n("Gather", ["s", "i"], "g"),  # index is a graph input
            n("Gather", ["s", "j"], "h", axis=0),
            n("Add", ["g", "h"], "Y"),
        ],
        [out("X", F, ["b", 3]), out("i", INT, [])],
        [out("Y", INT, [])],
        {"j": np.array(0, np.int64)},  # the dynamic dim
    )
    report, _ = optimize(model, ["fold_shapes", "fold_constants"], tmp_path)
    assert report.rewrites == 0


def test_idempotent(tmp_path: Path) -> None:
    model = reshape_chain(["batch", 3, 4])
    _, path = optimize(model, FOLDING, tmp_path)
    again = fastopt.optimize(fastopt.load(path), passes=FOLDING)
    assert [p.rewrites for p in again.passes][1:] == [0, 0, 0]


def test_registered_and_in_the_default_preset() -> None:
    spec = fastopt.get_pass("fold_shapes")
    assert spec.language == "c++" and fastopt._C.FACT_VALUE_TYPES in spec.requires_facts
    preset = fastopt.PRESETS["default"]
    order = [
        preset.index(p)
        for p in ("infer_shapes", "fold_shapes", "fold_constants", "eliminate_dead_nodes")
    ]
    assert order == sorted(order)


# ---- real exports ----

CORPUS = corpus_models()


@pytest.mark.skipif(not CORPUS, reason="reference corpus (../shared/corpus) not present")
@pytest.mark.parametrize("path", CORPUS, ids=[model_id(p) for p in CORPUS])
def test_corpus_folding_parity(path: Path, tmp_path: Path) -> None:
    proto = onnx.load(str(path))
    meta = json.loads((path.parent / "meta.json").read_text())
    feeds = random_feeds(proto, meta)
    report, optimized = optimize(fastopt.load(path), FOLDING, tmp_path)
    assert report.nodes_after < report.nodes_before
    expected = run_ort(path, feeds)
    actual = run_ort(optimized, feeds)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=0, atol=1e-5)
    # A second run finds nothing left to fold.
    again = fastopt.optimize(fastopt.load(optimized), passes=FOLDING)
    assert [p.rewrites for p in again.passes][1:] == [0, 0, 0]


@pytest.mark.skipif(not CORPUS, reason="reference corpus (../shared/corpus) not present")
def test_corpus_default_preset(tmp_path: Path) -> None:
    path = (
        next(p for p in CORPUS if p.parent.name == "llama_ts_cache")
        if any(p.parent.name == "llama_ts_cache" for p in CORPUS)
        else CORPUS[0]
    )
    proto = onnx.load(str(path))
    meta = json.loads((path.parent / "meta.json").read_text())
    feeds = random_feeds(proto, meta)
    out_path = tmp_path / "model.onnx"
    report = fastopt.optimize(path, preset="classic", output=out_path)  # standard ops only
    assert report.nodes_after < report.nodes_before
    onnx.checker.check_model(str(out_path))
    for e, a in zip(run_ort(path, feeds), run_ort(out_path, feeds)):
        np.testing.assert_allclose(a, e, rtol=0, atol=1e-5)


def test_symbolic_shape_chains_fold_with_the_shape_analysis(tmp_path: Path) -> None:
    """TorchScript's head split and Expand target over symbolic dims: the Reshape target
    becomes [0, 0, 2, 4], Where(Equal(s, -1), ones, s) becomes s (and the Expand of a value to
    its own dims disappears)."""
    nodes = [
        n("Shape", ["X"], "s"),
        n("Gather", ["s", "i0"], "d0"),
        n("Gather", ["s", "i1"], "d1"),
        n("Unsqueeze", ["d0", "zero"], "u0"),
        n("Unsqueeze", ["d1", "zero"], "u1"),
        n("Concat", ["u0", "u1", "heads", "dims"], "target", axis=0),
        n("Reshape", ["X", "target"], "Y"),
        n("Equal", ["s", "minus_one"], "eq"),
        n("Where", ["eq", "ones", "s"], "w"),
        n("Expand", ["X", "w"], "Z"),
        n("Neg", ["Z"], "W"),
    ]
    inits = {
        "i0": np.array(0, np.int64),
        "i1": np.array(1, np.int64),
        "zero": np.array([0], np.int64),
        "heads": np.array([2], np.int64),
        "dims": np.array([-1], np.int64),
        "minus_one": np.array(-1, np.int64),
        "ones": np.ones(3, np.int64),
    }
    model = make_model(
        nodes,
        [out("X", F, ["batch", "seq", 8])],
        [out("Y", F, None), out("W", F, None)],
        inits,
    )
    report, path = optimize(model, FOLDING, tmp_path)
    counters = report.passes[1].counters
    assert counters["Reshape(target)"] == 1 and counters["Where(input 2)"] == 1
    assert counters["Expand(identity)"] == 1
    assert op_counts(path) == {"Reshape": 1, "Neg": 1}
    proto = onnx.load(str(path))
    init = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    reshape = next(x for x in proto.graph.node if x.op_type == "Reshape")
    assert init[reshape.input[1]].tolist() == [0, 0, 2, 4]
    for batch, seq in ((1, 3), (2, 5)):
        feeds = {"X": np.random.default_rng(batch).standard_normal((batch, seq, 8), np.float32)}
        assert_parity(model, path, tmp_path, feeds=feeds)


@pytest.mark.parametrize("shape_inputs", [[], [""]])
def test_a_shape_of_nothing_behind_a_gather_is_left_alone(shape_inputs: list[str]) -> None:
    """Found by fuzz_pipeline (tests/fuzz/regressions/pipeline-shape-without-input.onnx): the
    Gather(Shape) fold read input 0 of a Shape that has none (UBSan: a reference to null)."""
    g = helper.make_graph(
        [
            helper.make_node("Shape", shape_inputs, ["s"]),
            helper.make_node("Gather", ["s", "i"], ["y"], axis=0),
        ],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [])],
        [helper.make_tensor("i", TensorProto.INT64, [], [0])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    report = fastopt.optimize(fastopt.from_onnx(m), passes=["fold_shapes"])
    assert report.ops_after == {"Shape": 1, "Gather": 1}
