"""Issue 13's falcon, nemotron, modernbert and deberta-v2 items on their fixtures (both exporters,
fp32; tests/fixtures/make_fixtures.py):

- falcon TorchScript computes the attention scale 1/sqrt(head_dim) from Shape(q): the shape
  facts fold Shape to 16, and fold_constants_ort folds the float Div by the computed Sqrt
  (it refused any division by a computed divisor), so the attention fuses.
- nemotron: GroupQueryAttention with its partial rotary, both exporters, KV cache standard and
  in place (the "static head size" refusal does not occur on the current analysis).
- modernbert (encoder): rotary positions are Range(0, S) unsqueezed at axes {0, 2} in one node;
  they fuse with (1, S) positions, one cache pair per base (global and local). The local
  layers' bidirectional window is part of the mask the attention takes (a boolean mask /
  additive bias), so it stays exact.
- deberta-v2: the disentangled attention runs on heads folded into the batch; the content
  attention fuses with the c2p/p2c position terms as its attention bias (computed by the graph
  from the flat Q, K and the relative embeddings), any other read of Q or K is refused with
  the reason.

The generic per-fixture tests (test_llm_preset, test_fuse_rotary, test_kv_generation, ...) run
these fixtures too; this file checks what the issue asked for each family."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support import kv_generation as kg
from support.llm_fixtures import (
    Fixture,
    assert_parity,
    feeds,
    fixtures,
    ids,
    max_abs_diff,
    op_count,
    optimize,
)

TARGETS = ("ort", "onnx")
UNPADDED_AND_RIGHT = (None, "right")
DECOMPOSED = ("Softmax", "Sin", "Cos", "Neg", "ReduceMean", "Sqrt", "Erf")


def _left(out: onnx.ModelProto) -> dict[str, int]:
    return {t: op_count(out, t) for t in DECOMPOSED if op_count(out, t)}


def _attention_ops(out: onnx.ModelProto, target: str) -> int:
    if target == "onnx":
        return op_count(out, "Attention", "")
    return sum(
        op_count(out, t, "com.microsoft")
        for t in ("Attention", "MultiHeadAttention", "GroupQueryAttention")
    )


# ---- falcon: the scale computed from a Shape ----

FALCON = fixtures(arch="falcon")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fx", FALCON, ids=ids(FALCON))
def test_falcon_attention_fuses_with_parity(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="llm", target=target, explain="fuse_attention")
    fused = [line for line in report.explain if line.endswith("rewritten")]
    assert len(fused) == fx.layers, report.explain
    assert _attention_ops(out, target) == fx.layers
    assert op_count(out, "RotaryEmbedding") == 2 * fx.layers
    assert not _left(out), _left(out)
    assert_parity(fx, out, paddings=UNPADDED_AND_RIGHT)


def _scale_model() -> onnx.ModelProto:
    """y = x * Sqrt(1 / Sqrt(Cast(d))) as falcon's TorchScript export computes the scale, d a
    constant (what fold_shapes leaves of Shape(q)[-1:])."""
    nodes = [
        helper.make_node("Cast", ["d"], ["df"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["df"], ["sd"]),
        helper.make_node("Div", ["one", "sd"], ["inv"]),
        helper.make_node("Cast", ["inv"], ["invf"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["invf"], ["scale"]),
        helper.make_node("Mul", ["x", "scale"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        [
            numpy_helper.from_array(np.array([16], dtype=np.int64), "d"),
            numpy_helper.from_array(np.ones([1], dtype=np.float32), "one"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_float_division_by_a_computed_divisor_folds() -> None:
    model = _scale_model()
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=["infer_shapes", "fold_constants", "fold_constants_ort"]
    )
    assert report.model is not None
    out = report.model.to_onnx()
    assert [n.op_type for n in out.graph.node] == ["Mul"]
    scale = next(t for t in out.graph.initializer if t.name == out.graph.node[0].input[1])
    np.testing.assert_allclose(numpy_helper.to_array(scale), [0.5], rtol=1e-7)


def test_integer_division_by_a_computed_divisor_is_not_folded() -> None:
    """An int64 divisor that ONNX Runtime computes in the same batch (ReduceMax, no native
    folder) may be zero, which crashes the runtime: the Div is kept."""
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("ReduceMax", ["d"], ["m"], keepdims=1),
        helper.make_node("Div", ["one", "m"], ["q"]),
        helper.make_node("Add", ["x", "q"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "int_div",
        [helper.make_tensor_value_info("x", i64, [2])],
        [helper.make_tensor_value_info("y", i64, [2])],
        [
            numpy_helper.from_array(np.array([16], dtype=np.int64), "d"),
            numpy_helper.from_array(np.array([64], dtype=np.int64), "one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["fold_constants_ort"])
    assert report.model is not None
    ops = [n.op_type for n in report.model.to_onnx().graph.node]
    assert "Div" in ops and "ReduceMax" not in ops  # the ReduceMax itself folds


# ---- nemotron: grouped attention with a partial rotary, and its KV cache ----

NEMOTRON = fixtures(arch="nemotron")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fx", NEMOTRON, ids=ids(NEMOTRON))
def test_nemotron_fuses_with_parity(fx: Fixture, target: str) -> None:
    _, out = optimize(fx, preset="llm", target=target)
    if target == "ort":
        assert op_count(out, "GroupQueryAttention", "com.microsoft") == fx.layers
    else:
        assert op_count(out, "Attention", "") == fx.layers
    ropes = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 2 * fx.layers
    dims = {a.i for n in ropes for a in n.attribute if a.name == "rotary_embedding_dim"}
    assert dims == {8}  # partial_rotary_factor 0.5 of head 16
    assert not _left(out), _left(out)
    assert_parity(fx, out, paddings=UNPADDED_AND_RIGHT)


DECODER_TS = fixtures(arch=["falcon", "nemotron"], exporter="ts")
STEPS = 32


@pytest.mark.parametrize("mode", ["standard", "inplace"])
@pytest.mark.parametrize("fx", DECODER_TS, ids=ids(DECODER_TS))
def test_torchscript_decoders_generate_the_same_tokens(
    fx: Fixture, mode: str, tmp_path: Path
) -> None:
    """32 greedy tokens of a right-padded batch of two prompts equal the original's, with the
    cache in both forms (test_kv_generation covers both exporters and target onnx)."""
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    assert report.ops_after["com.microsoft::GroupQueryAttention"] == fx.layers
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 5))]
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), STEPS)
    got = kg.greedy_cached(out, prompts, STEPS, inplace=mode == "inplace")
    same, diff = kg.compare(ref, got)
    assert same == STEPS, f"first token mismatch at step {same}"
    assert diff <= 1e-4


# ---- modernbert: rotary from Range positions, local/global bases, windowed mask ----

MODERNBERT = fixtures(arch="modernbert")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fx", MODERNBERT, ids=ids(MODERNBERT))
def test_modernbert_rotary_and_attention_fuse(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="llm", target=target)
    assert op_count(out, "RotaryEmbedding") == 2 * fx.layers
    rotary = next(p for p in report.passes if p.name == "fuse_rotary")
    assert rotary.counters["caches"] == 2  # the global and the local base
    assert rotary.counters["expanded_positions"] == 2 * fx.layers  # (1, S) -> (B, S)
    assert _attention_ops(out, target) == fx.layers
    assert not _left(out), _left(out)
    assert_parity(fx, out, paddings=UNPADDED_AND_RIGHT)
    # Prompts much longer than the local window (4 keys each side): the window is kept.
    long = feeds(fx, batch=2, seq=40, padding="right")
    assert max_abs_diff(fx, out, long) <= 1e-4


def _range_rope_model(axes: list[int]) -> onnx.ModelProto:
    """rotate_half rotary on x (B, H, S, D) with angles Cast(Unsqueeze(Range(0, S), axes)) *
    inv_freq, as modernbert's export computes them."""
    d = 8
    inv = (1.0 / (10000.0 ** (np.arange(0, d, 2) / d))).astype(np.float32)
    c = numpy_helper.from_array
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["s"], axis=0),
        helper.make_node("Range", ["zero", "s", "one"], ["pos"]),
        helper.make_node("Unsqueeze", ["pos", "axes"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["posf", "inv_freq"], ["freqs"]),
        helper.make_node("Concat", ["freqs", "freqs"], ["angles"], axis=-1),
        helper.make_node("Cos", ["angles"], ["cos3"]),
        helper.make_node("Sin", ["angles"], ["sin3"]),
        helper.make_node("Unsqueeze", ["cos3", "ax1"], ["cos"]),
        helper.make_node("Unsqueeze", ["sin3", "ax1"], ["sin"]),
        helper.make_node("Slice", ["x", "z1", "half", "ax3"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "big", "ax3"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["nx2"]),
        helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
    ]
    i64 = np.int64
    inits = [
        c(inv, "inv_freq"),
        c(np.array(2, i64), "two"),
        c(np.array(0, i64), "zero"),
        c(np.array(1, i64), "one"),
        c(np.array(axes, i64), "axes"),
        c(np.array([1], i64), "ax1"),
        c(np.array([3], i64), "ax3"),
        c(np.array([0], i64), "z1"),
        c(np.array([d // 2], i64), "half"),
        c(np.array([np.iinfo(i64).max], i64), "big"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, "S", d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3, "S", d])
    graph = helper.make_graph(nodes, "range_rope", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("axes", [[0, 2], [2, 0], [0, -1]])
def test_range_positions_fuse_with_parity(axes: list[int]) -> None:
    model = _range_rope_model(axes)
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=["infer_shapes", "fuse_rotary", "eliminate_dead_nodes"]
    )
    assert report.model is not None
    report.model.verify()
    out = report.model.to_onnx()
    assert op_count(out, "RotaryEmbedding", "com.microsoft") == 1
    assert op_count(out, "Cos") == op_count(out, "Neg") == 0
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 8)).astype(np.float32)
    from support.llm_fixtures import run

    np.testing.assert_allclose(run(out, {"x": x})[0], run(model, {"x": x})[0], atol=1e-5)


def test_range_positions_on_another_axis_are_not_fused() -> None:
    """Unsqueeze(Range, [0, 1]) puts the positions on the frequency axis: not a rotary."""
    model = _range_rope_model([0, 1])
    model.graph.output[0].type.tensor_type.ClearField("shape")
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=["fuse_rotary"],
        explain="fuse_rotary",
    )
    assert report.passes[0].rewrites == 0
    assert any("Unsqueeze(axis 2)" in line for line in report.explain), report.explain


# ---- deberta-v2: disentangled attention, the position terms as the attention bias ----

DEBERTA = fixtures(arch="deberta_v2")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fx", DEBERTA, ids=ids(DEBERTA))
def test_deberta_disentangled_attention_fuses(fx: Fixture, target: str) -> None:
    """Content attention Q.K^T with scale 1/sqrt(head_dim * 3) (c2p and p2c: scale_factor 1 +
    2), the c2p + p2c terms the graph computes from the flat Q, K and the relative embeddings
    as the attention bias, masked_fill's mask around it: MultiHeadAttention's attention_bias
    (ort; fp16: GroupQueryAttention's, causal 0, as fp16 self-attention lowers) / Attention-23's
    attn_mask (onnx). The scale is the export's: 1 / sqrt(head_dim * 3) rounded to the dtype."""
    report, out = optimize(fx, preset="llm", target=target, explain="fuse_attention")
    fused = [line for line in report.explain if line.endswith("rewritten")]
    assert len(fused) == fx.layers, report.explain
    counters = next(p.counters for p in report.passes if p.name == "fuse_attention")
    assert counters["disentangled position terms"] == fx.layers, counters
    assert counters["flat heads"] == fx.layers
    ort_op = "GroupQueryAttention" if fx.dtype == "float16" else "MultiHeadAttention"
    op = ("Attention", "") if target == "onnx" else (ort_op, "com.microsoft")
    attention = [n for n in out.graph.node if n.op_type == op[0] and (n.domain or "") == op[1]]
    assert len(attention) == fx.layers == _attention_ops(out, target)
    head = int(fx.meta["config"]["hidden_size"]) // fx.heads
    for n in attention:
        scale = next(a.f for a in n.attribute if a.name == "scale")
        assert scale == pytest.approx(1 / float(np.sqrt(head * 3).astype(fx.dtype)), rel=1e-6)
        # MHA: (q, k, v, key_padding_mask, attention_bias); GQA: attention_bias at 10;
        # onnx: (q, k, v, attn_mask)
        bias = n.input[{"MultiHeadAttention": 5, "GroupQueryAttention": 10}.get(n.op_type, 3)]
        assert bias, "the position terms are dropped"
    assert op_count(out, "Softmax") == 0
    assert op_count(out, "GatherElements") == 2 * fx.layers  # c2p, p2c: computed as exported
    assert_parity(fx, out, paddings=UNPADDED_AND_RIGHT)


def _with_extra_reader(fx: Fixture, what: str) -> onnx.ModelProto:
    """The export with one more read in layer 0: "q" a ReduceSum of flat Q (the c2p MatMul's
    input), "term" the c2p GatherElements' output also a graph output."""
    model = onnx.load(fx.path)
    gather = next(n for n in model.graph.node if n.op_type == "GatherElements")
    c2p = next(n for n in model.graph.node if gather.input[0] in n.output)
    assert c2p.op_type == "MatMul"
    if what == "q":
        node = helper.make_node("ReduceSum", [c2p.input[0]], ["q_sum"], keepdims=0)
        model.graph.node.append(node)
        model.graph.output.append(helper.make_tensor_value_info("q_sum", TensorProto.FLOAT, []))
    else:
        model.graph.output.append(helper.make_empty_tensor_value_info(gather.output[0]))
    return model


@pytest.mark.parametrize("what", ["q", "term"])
def test_deberta_other_reads_are_refused(what: str) -> None:
    """A read of flat Q that is no position term, or a position term read outside the bias:
    that layer keeps the refusal with its reason; the other layer fuses."""
    fx = fixtures(arch="deberta_v2", dtype="float32")[0]
    report = fastopt.optimize(
        fastopt.from_onnx(_with_extra_reader(fx, what)), preset="llm", explain="fuse_attention"
    )
    assert report.model is not None
    refused = [line for line in report.explain if "disentangled attention) is not fused" in line]
    assert len(refused) == 1, report.explain
    assert ("(ReduceSum)" if what == "q" else "(MatMul)") in refused[0]
    assert report.ops_after.get("com.microsoft::MultiHeadAttention") == fx.layers - 1
