"""The C++ shape analysis (csrc/analysis, `_C.ShapeFacts`, `_C.analyze_shapes`): checked
against onnx's shape inference (same or more precise, never contradicting) on every fixture
and corpus model, against ONNX Runtime's actual shapes (graph outputs and a sample of
intermediates) on real inputs, and on unit graphs: Reshape with -1 / 0 / allowzero, Slice
with negative and clamped bounds, Concat of shape values, broadcasting with symbols, and
recomputation after a graph edit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import corpus_models
from fastopt import _C
from onnx import TensorProto, helper
from support.llm_fixtures import fixtures

F, I64 = TensorProto.FLOAT, TensorProto.INT64
MODELS = [fx.path for fx in fixtures()] + corpus_models()
DIMS = {"batch_size": 2, "sequence_length": 7, "past_sequence_length": 3}


def _id(p: Path) -> str:
    return ("corpus/" if "corpus" in p.parts else "") + p.parent.name


def _facts(model: onnx.ModelProto) -> dict[str, Any]:
    return dict(_C.shape_facts(fastopt.from_onnx(model)))


def _onnx_dims(vi: onnx.ValueInfoProto) -> tuple[int, list[Any] | None]:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return t.elem_type, None
    dims: list[Any] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param") and not d.dim_param.startswith("unk__"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return t.elem_type, dims


@pytest.mark.parametrize("path", MODELS, ids=_id)
def test_facts_agree_with_onnx_inference(path: Path) -> None:
    model = onnx.load(path)
    m = fastopt.from_onnx(model)
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {}, "every op of the real exports has a rule"
    facts = dict(_C.shape_facts(m))
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    compared = more_precise = 0
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        if vi.name not in facts or not vi.type.HasField("tensor_type"):
            continue
        dtype, dims = _onnx_dims(vi)
        ours_dtype, ours, _ = facts[vi.name]
        if dtype:
            assert ours_dtype == dtype, vi.name
        if dims is None:
            continue
        assert ours is not None, f"{vi.name}: onnx knows the rank, the analysis does not"
        assert len(ours) == len(dims), vi.name
        for theirs, mine in zip(dims, ours):
            compared += 1
            if isinstance(theirs, int):
                assert mine == theirs, f"{vi.name}: {ours} vs onnx {dims}"
            elif isinstance(theirs, str):
                # A named dim: the analysis has a number or an expression of named symbols.
                assert isinstance(mine, int) or not mine.startswith("?"), (vi.name, ours, dims)
            elif isinstance(mine, int) or not str(mine).startswith("?"):
                more_precise += 1
    assert compared > 0
    if "_ts_" in path.parent.name and "bert" not in path.parent.name:
        # TorchScript head splits: onnx loses dims the analysis resolves (Reshape(-1), shape
        # values through Shape -> Gather -> Concat).
        assert more_precise > 0


def _evaluate(expr: Any, bindings: dict[str, int]) -> int | None:
    if isinstance(expr, int):
        return expr
    if "?" in expr:
        return None
    return int(eval(expr, {"__builtins__": {}}, dict(bindings)))  # products / sums of symbols


SAMPLED = [
    fx.path
    for fx in fixtures()
    if fx.name
    in {
        "llama_ts_float32",
        "qwen2_dynamo_float32",
        "gpt2_ts_float32",
        "phi3_ts_float16",
        "bert_ts_float32",
        "gemma3_ts_float32",
        "mixtral_ts_float32",  # TopK, OneHot
    }
] + [p for p in corpus_models() if p.parent.name in {"llama_ts_cache", "llama_dynamo_cache"}]


@pytest.mark.parametrize("path", SAMPLED, ids=_id)
def test_facts_match_onnxruntime_shapes(path: Path) -> None:
    model = onnx.load(path)
    facts = _facts(model)
    names = [o.name for o in model.graph.output]
    outputs = [o for n in model.graph.node for o in n.output if o and facts.get(o, (0, None))[1]]
    names += [o for o in outputs[:: max(1, len(outputs) // 60)] if o not in names]
    del model.graph.output[:]
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    inputs = fastopt.make_inputs(path, dims=DIMS)
    bindings: dict[str, int] = {}
    for i in model.graph.input:
        if i.name in inputs:
            for k, d in enumerate(i.type.tensor_type.shape.dim):
                if d.HasField("dim_param"):
                    bindings[d.dim_param] = int(inputs[i.name].shape[k])
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    results = sess.run(names, inputs)
    fresh: dict[str, int] = {}
    checked = 0
    for name, arr in zip(names, results):
        _, dims, value = facts[name]
        if dims is None:
            continue
        assert len(dims) == arr.ndim, f"{name}: {dims} vs {arr.shape}"
        for d, actual in zip(dims, arr.shape):
            want = _evaluate(d, bindings)
            if want is None:  # a fresh symbol: the same one is the same size everywhere
                assert fresh.setdefault(str(d), actual) == actual, name
            else:
                assert want == actual, f"{name}: {dims} vs {arr.shape}"
                checked += 1
        if value is not None:
            for v, actual in zip(value, np.asarray(arr).reshape(-1)):
                if (want := _evaluate(v, bindings)) is not None:
                    assert want == actual, f"{name}: value {value} vs {arr}"
    assert checked > 0


# --- unit graphs ---------------------------------------------------------------------------


def _graph(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], inits=()) -> Any:  # type: ignore[no-untyped-def]
    outs = [helper.make_empty_tensor_value_info(nodes[-1].output[0])]
    g = helper.make_graph(nodes, "g", inputs, outs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _ints(name: str, v: list[int]) -> onnx.TensorProto:
    return helper.make_tensor(name, I64, [len(v)], v)


def _x(shape: list[Any]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("x", F, shape)


def test_reshape_minus_one_resolves_symbolically() -> None:
    # x[B, S, 896] -> Reshape([0, 0, 14, -1]) -> [B, S, 14, 64]; then [-1, 64] -> [B*S*14, 64]
    m = _graph(
        [
            helper.make_node("Reshape", ["x", "s1"], ["y"]),
            helper.make_node("Reshape", ["y", "s2"], ["z"]),
        ],
        [_x(["B", "S", 896])],
        [_ints("s1", [0, 0, 14, -1]), _ints("s2", [-1, 64])],
    )
    f = _facts(m)
    assert f["y"][1] == ["B", "S", 14, 64]
    assert f["z"][1] == ["14*B*S", 64] or f["z"][1] == ["14*S*B", 64]


def test_reshape_zero_copies_and_allowzero_does_not() -> None:
    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=0)]
    f = _facts(_graph(nodes, [_x(["B", 4])], [_ints("s", [0, 2, 2])]))
    assert f["y"][1] == ["B", 2, 2]
    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"], allowzero=1)]
    f = _facts(_graph(nodes, [_x([0, 4])], [_ints("s", [0, 2, -1])]))
    assert f["y"][1][:2] == [0, 2] and str(f["y"][1][2]).startswith("?")  # 0 / 0: unknown


def test_reshape_target_from_a_shape_chain() -> None:
    # TorchScript's head split: Concat(Unsqueeze(Gather(Shape(x), 0)), Unsqueeze(...1), 14, 64)
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["sh", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax"], ["ub"]),
        helper.make_node("Unsqueeze", ["s", "ax"], ["us"]),
        helper.make_node("Concat", ["ub", "us", "h", "d"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [
        helper.make_tensor("i0", I64, [], [0]),
        helper.make_tensor("i1", I64, [], [1]),
        _ints("ax", [0]),
        _ints("h", [14]),
        _ints("d", [-1]),
    ]
    f = _facts(_graph(nodes, [_x(["B", "S", 896])], inits))
    assert f["target"][2] == ["B", "S", 14, -1]
    assert f["y"][1] == ["B", "S", 14, 64]


@pytest.mark.parametrize(
    ("starts", "ends", "steps", "dims", "value"),
    [
        ([-2], [1000], [1], [2], ["S", 896]),  # negative start, end clamped to the length
        ([0], [-1], [1], [2], ["B", "S"]),
        ([-1], [-1000], [-1], [3], [896, "S", "B"]),  # reversed, end clamped to before 0
        ([-10], [-1000], [-1], [1], ["B"]),  # reversed, start clamped to 0 (the spec)
        ([5], [9], [1], [0], []),  # past the end: empty
        ([0], [3], [2], [2], ["B", 896]),
    ],
)
def test_slice_bounds(
    starts: list[int], ends: list[int], steps: list[int], dims: list[int], value: list[Any]
) -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Slice", ["sh", "st", "en", "ax", "sp"], ["y"]),
    ]
    inits = [_ints("st", starts), _ints("en", ends), _ints("ax", [0]), _ints("sp", steps)]
    f = _facts(_graph(nodes, [_x(["B", "S", 896])], inits))
    assert f["y"][1] == dims and f["y"][2] == value


def test_slice_of_a_symbolic_dim() -> None:
    nodes = [helper.make_node("Slice", ["x", "st", "en", "ax"], ["y"])]
    inits = [_ints("st", [0]), _ints("en", [2**63 - 1]), _ints("ax", [1])]
    assert _facts(_graph(nodes, [_x(["B", "S", 4])], inits))["y"][1] == ["B", "S", 4]
    inits = [_ints("st", [1]), _ints("en", [2**63 - 1]), _ints("ax", [1])]
    dims = _facts(_graph(nodes, [_x(["B", "S", 4])], inits))["y"][1]
    assert dims[0] == "B" and str(dims[1]).startswith("?")  # S - 1 only if S >= 1: unknown


def test_concat_of_shape_values_and_arithmetic() -> None:
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "i"], ["s"], axis=0),
        helper.make_node("Mul", ["s", "two"], ["s2"]),
        helper.make_node("Unsqueeze", ["s2", "ax"], ["us"]),
        helper.make_node("Concat", ["sh", "us"], ["c"], axis=0),
        helper.make_node("Equal", ["c", "neg"], ["eq"]),
        helper.make_node("Where", ["eq", "one", "c"], ["w"]),
        helper.make_node("Expand", ["x1", "w"], ["y"]),
    ]
    inits = [
        helper.make_tensor("i", I64, [], [1]),
        helper.make_tensor("two", I64, [], [2]),
        _ints("ax", [0]),
        helper.make_tensor("neg", I64, [], [-1]),
        helper.make_tensor("one", I64, [], [1]),
    ]
    x1 = helper.make_tensor_value_info("x1", F, [1, 1, 1, 1])
    f = _facts(_graph(nodes, [_x(["B", "S", 8]), x1], inits))
    assert f["c"][1] == [4] and f["c"][2] == ["B", "S", 8, "2*S"]
    assert f["eq"][2] == [0, 0, 0, 0]  # sizes are never -1
    assert f["y"][1] == ["B", "S", 8, "2*S"]


def test_broadcast_with_symbols() -> None:
    nodes = [
        helper.make_node("Add", ["x", "z"], ["y"]),
        helper.make_node("Mul", ["y", "w"], ["v"]),
    ]
    z = helper.make_tensor_value_info("z", F, [1, "S", 1])
    w = helper.make_tensor_value_info("w", F, ["T", 1, 1, 64])
    f = _facts(_graph(nodes, [_x(["B", 1, 64]), z, w]))
    assert f["y"][1] == ["B", "S", 64]
    assert f["v"][1] == ["T", "B", "S", 64]
    # Two different symbols: unknown, never one of them.
    nodes = [helper.make_node("Add", ["x", "z"], ["y"])]
    z = helper.make_tensor_value_info("z", F, ["C", 64])
    assert str(_facts(_graph(nodes, [_x(["B", 64]), z]))["y"][1][0]).startswith("?")


def test_matmul_and_fresh_symbols_flow() -> None:
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"]),  # (rank, n): n depends on the data
        helper.make_node("Transpose", ["nz"], ["t"]),
        helper.make_node("Cast", ["t"], ["tf"], to=F),
        helper.make_node("MatMul", ["tf", "w"], ["y"]),
    ]
    w = helper.make_tensor_value_info("w", F, [2, 5])
    m = fastopt.from_onnx(_graph(nodes, [_x(["B", 3]), w]))
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {}
    f = dict(_C.shape_facts(m))
    n = f["nz"][1][1]
    assert f["nz"][1][0] == 2 and str(n).startswith("?")  # a fresh symbol, not a size
    assert f["t"][1] == [n, 2] and f["y"][1] == [n, 5]  # the same symbol where it flows


def test_a_graph_edit_invalidates_memoized_facts() -> None:
    nodes = [helper.make_node("Reshape", ["x", "s"], ["y"])]
    m = fastopt.from_onnx(_graph(nodes, [_x([2, 6])], [_ints("s", [3, 4])]))
    facts = _C.ShapeFacts(m)
    assert facts.facts("y")[1] == [3, 4]
    assert facts.facts("y")[1] == [3, 4] and facts.computations == 1  # memoized
    g = m.graph
    reshape = g.nodes[0]
    shape = g.add_node("Shape", [g.value("x")], ["x_shape"], before=reshape)
    reshape.set_input(1, shape.outputs[0])
    assert facts.facts("y")[1] == [2, 6] and facts.computations == 2


def test_infer_shapes_reports_the_engine() -> None:
    path = fixtures("llama", "ts", "float32")[0].path
    report = fastopt.optimize(fastopt.load(path), passes=["infer_shapes"])
    counters = report.passes[0].counters
    assert counters.get("engine:native") == 1 and "engine:onnx" not in counters
    # An op without a rule: onnx's inference runs too, and says why.
    m = _graph([helper.make_node("Compress", ["x", "c"], ["y"], axis=1)], [_x([2, 3]), _cond()])
    report = fastopt.optimize(fastopt.from_onnx(m), passes=["infer_shapes"])
    counters = report.passes[0].counters
    assert counters["engine:onnx"] == 1 and counters["native_unknown:Compress"] == 1
    assert report.shape_inference == [
        "infer_shapes: native for 0 nodes; onnx fallback for Compress x1"
    ]
    assert report.model is not None and report.model.graph.value("y").shape == (2, None)


def _cond() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("c", TensorProto.BOOL, [3])


def test_rewriter_types_the_outputs_it_creates() -> None:
    """Intermediate values a rewrite builds (not only the replacement) get types."""
    seen: dict[str, Any] = {}

    def rewrite(match: fastopt.Match, rw: fastopt.Rewriter):  # type: ignore[no-untyped-def]
        x = match["x"]
        t = rw.op("Transpose", [x], {"perm": [1, 0]})[0]
        shape = rw.op("Shape", [t])[0]
        seen.update(t=(t.dtype, t.shape), shape=(shape.dtype, shape.shape))
        back = rw.op("Transpose", [t], {"perm": [1, 0]})[0]
        return [rw.op("Relu", [back])[0]]

    p = fastopt.Pattern("relu_twice")
    p.root(p.op("Relu", [p.op("Relu", [p.var("x")])]))
    m = _graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Relu", ["r"], ["y"])],
        [_x(["B", 5])],
    )
    model = fastopt.from_onnx(m)
    assert fastopt.apply_rules(model, [fastopt.Rule("relu_twice", p, rewrite=rewrite)])[0] == 1
    assert seen["t"] == (F, (5, "B"))
    assert seen["shape"] == (I64, (2,))


def test_a_node_missing_a_required_input_is_left_to_onnx() -> None:
    m = _graph([helper.make_node("MatMul", ["x"], ["y"])], [_x([2, 3])])
    _, unknown = _C.analyze_shapes(fastopt.from_onnx(m), apply=False)
    assert dict(unknown) == {"MatMul": 1}


# --- routing ops (mixture-of-experts decoders): TopK, OneHot, scatters, NonZero --------------


def _routing_model() -> onnx.ModelProto:
    """A router as MoE exports write it, and the scatter / NonZero forms of dispatching:
    logits (N, E) -> Softmax -> TopK(k) -> OneHot(depth E) expert masks; ScatterElements and
    ScatterND of the weights back into (N, E); NonZero of the tokens an expert takes."""
    nodes = [
        helper.make_node("Softmax", ["x"], ["p"], axis=-1),
        helper.make_node("TopK", ["p", "k"], ["w", "idx"], axis=-1),
        helper.make_node("OneHot", ["idx", "depth", "onoff"], ["hot"], axis=-1),
        helper.make_node("OneHot", ["idx", "depth", "onoff"], ["hot0"], axis=0),
        helper.make_node("TopK", ["p", "k"], ["w1", "idx1"], axis=0),
        helper.make_node("ScatterElements", ["zeros", "idx", "w"], ["dense"], axis=1),
        helper.make_node("Unsqueeze", ["idx", "ax2"], ["idx3"]),
        helper.make_node("ScatterND", ["zeros3", "nd_idx", "nd_upd"], ["dense3"]),
        helper.make_node("Greater", ["dense", "half"], ["chosen"]),
        helper.make_node("NonZero", ["chosen"], ["nz"]),
        helper.make_node("Transpose", ["nz"], ["nzt"], perm=[1, 0]),
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Gather", ["sh", "one"], ["e"], axis=0),
        helper.make_node("OneHot", ["idx", "e", "onoff"], ["hot_e"], axis=-1),
    ]
    inits = [
        _ints("k", [2]),
        helper.make_tensor("depth", I64, [], [4]),
        helper.make_tensor("onoff", F, [2], [0.0, 1.0]),
        helper.make_tensor("one", I64, [], [1]),
        _ints("ax2", [2]),
        helper.make_tensor("half", F, [], [0.2]),
    ]
    inputs = [
        _x(["N", 4]),
        helper.make_tensor_value_info("zeros", F, ["N", 4]),
        helper.make_tensor_value_info("zeros3", F, ["N", 4, 3]),
        helper.make_tensor_value_info("nd_idx", I64, ["M", 2]),
        helper.make_tensor_value_info("nd_upd", F, ["M", 3]),
    ]
    outs = ["w", "idx", "hot", "hot0", "w1", "dense", "idx3", "dense3", "nz", "nzt", "hot_e"]
    g = helper.make_graph(
        nodes, "router", inputs, [helper.make_empty_tensor_value_info(o) for o in outs], inits
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_routing_rules() -> None:
    model = _routing_model()
    m = fastopt.from_onnx(model)
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {}
    f = dict(_C.shape_facts(m))
    assert f["w"][:2] == (F, ["N", 2]) and f["idx"][:2] == (I64, ["N", 2])
    assert f["w1"][1] == [2, 4]
    assert f["hot"][:2] == (F, ["N", 2, 4]) and f["hot0"][1] == [4, "N", 2]  # values' dtype
    assert f["hot_e"][1] == ["N", 2, 4]  # depth from the shape value
    assert f["dense"][:2] == (F, ["N", 4]) and f["dense3"][1] == ["N", 4, 3]
    n = f["nz"][1][1]
    assert f["nz"][:2] == (I64, [2, n]) and str(n).startswith("?")
    assert f["nzt"][1] == [n, 2]
    # Never contradicting onnx's inference (more precise where it knows less).
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    for vi in inferred.graph.output:
        dtype, dims = _onnx_dims(vi)
        assert f[vi.name][0] == dtype, vi.name
        for theirs, mine in zip(dims or [], f[vi.name][1]):
            if isinstance(theirs, (int, str)):
                assert mine == theirs, (vi.name, f[vi.name][1], dims)


def test_routing_rules_match_onnxruntime() -> None:
    model = _routing_model()
    f = _facts(model)
    rng = np.random.default_rng(0)
    for n, m in ((5, 3), (9, 1)):
        feeds = {
            "x": rng.standard_normal((n, 4)).astype(np.float32),
            "zeros": np.zeros((n, 4), np.float32),
            "zeros3": np.zeros((n, 4, 3), np.float32),
            "nd_idx": np.stack([np.arange(m) % n, np.arange(m) % 4], axis=1).astype(np.int64),
            "nd_upd": np.ones((m, 3), np.float32),
        }
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        fresh: dict[str, int] = {}
        for name, arr in zip(names, sess.run(None, feeds)):
            dims = f[name][1]
            assert len(dims) == arr.ndim, name
            for d, actual in zip(dims, arr.shape):
                want = _evaluate(d, {"N": n, "M": m})
                if want is None:
                    assert fresh.setdefault(str(d), actual) == actual, name
                else:
                    assert want == actual, (name, dims, arr.shape)
        assert fresh, "NonZero's count was compared"


# --- attention ops and equality facts (what the attention passes ask) ------------------------


def _attention_model(domain: str = "") -> onnx.ModelProto:
    """Q (B, 4, S, 8), K (B, 2, T, 8), V (B, 2, T, 6) -> Attention -> Y."""
    inputs = [
        helper.make_tensor_value_info("q", F, ["B", 4, "S", 8]),
        helper.make_tensor_value_info("k", F, ["B", 2, "T", 8]),
        helper.make_tensor_value_info("v", F, ["B", 2, "T", 6]),
    ]
    attrs = {"q_num_heads": 4, "kv_num_heads": 2} if domain else {}
    if domain:
        attrs.update(is_causal=0, scale=0.35)
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], domain=domain, **attrs)
    g = helper.make_graph([node], "g", inputs, [helper.make_empty_tensor_value_info("y")])
    opsets = [helper.make_opsetid("", 23)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 10
    return m


def test_attention_rules_match_onnx_and_onnxruntime() -> None:
    model = _attention_model()
    m = fastopt.from_onnx(model)
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {}
    dims = _facts(model)["y"][1]
    assert [str(d) for d in dims] == ["B", "4", "S", "6"]
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    out = {vi.name: vi for vi in inferred.graph.output}["y"]
    _, onnx_dims = _onnx_dims(out)
    if onnx_dims is not None:  # never contradicting onnx where it knows the dim
        for ours, theirs in zip(dims, onnx_dims):
            assert theirs is None or str(ours) == str(theirs)
    rng = np.random.default_rng(0)
    feeds = {
        "q": rng.standard_normal((3, 4, 5, 8)).astype(np.float32),
        "k": rng.standard_normal((3, 2, 7, 8)).astype(np.float32),
        "v": rng.standard_normal((3, 2, 7, 6)).astype(np.float32),
    }
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, feeds)
    assert [_evaluate(d, {"B": 3, "S": 5, "T": 7}) for d in dims] == list(y.shape)
    # fastopt's internal op (the fusion's output, never saved) has the same facts.
    assert _facts(_attention_model(_C.INTERNAL_DOMAIN))["y"][1] == dims


def test_declared_dims_become_equality_facts() -> None:
    # present = Concat(past (B, 2, P, 8), new (B, 2, S, 8)) is P+S to the analysis; its declared
    # type says T, which makes P+S and T one size for every value (the mask's (S, T) too).
    inputs = [
        helper.make_tensor_value_info("past", F, ["B", 2, "P", 8]),
        helper.make_tensor_value_info("new", F, ["B", 2, "S", 8]),
        helper.make_tensor_value_info("mask", F, ["B", 1, "S", "T"]),
        helper.make_tensor_value_info("other", F, ["B", 1, "S", "U"]),
    ]
    node = helper.make_node("Concat", ["past", "new"], ["present"], axis=2)
    g = helper.make_graph(
        [node],
        "g",
        inputs,
        [helper.make_tensor_value_info("present", F, ["B", 2, "T", 8])],
    )
    m = fastopt.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    facts = _C.ShapeFacts(m)
    assert [str(d) for d in facts.facts("present")[1]] == ["B", "2", "P+S", "8"]
    assert facts.same_dim("present", 2, "mask", 3)
    assert facts.same_dim("new", 2, "mask", 2)
    assert not facts.same_dim("present", 2, "other", 3)
    assert not facts.same_dim("past", 2, "new", 2)
    # ORT runs it with T = P + S: the fact the declared type stated.
    sess = ort.InferenceSession(m.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    zeros = {"past": (3, 2, 4, 8), "new": (3, 2, 5, 8), "mask": (3, 1, 5, 9), "other": (3, 1, 5, 1)}
    (present,) = sess.run(None, {k: np.zeros(s, np.float32) for k, s in zeros.items()})
    assert present.shape[2] == 9


def test_default_domain_simplified_layer_norm() -> None:
    # fuse_rms_norm writes SimplifiedLayerNormalization in the default domain (ORT registers it
    # there too); its output, untyped when a fusion made it, has the input's facts.
    w = helper.make_tensor("w", F, [8], [1.0] * 8)
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1)
    model = _graph([node], [_x(["B", "S", 8])], [w])
    m = fastopt.from_onnx(model)
    _, unknown = _C.analyze_shapes(m, apply=False)
    assert dict(unknown) == {}
    assert _facts(model)["y"][:2] == (F, ["B", "S", 8])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": np.ones((2, 3, 8), np.float32)})
    assert y.shape == (2, 3, 8)
