"""Rotary variants of issue 13: interleaved pairs (gptj, cohere, glm: RotaryEmbedding
interleaved=1), LongRoPE's two tables (phi3: one stacked cache, the positions offset when the
graph switches), and the in-place cache of exports whose head split infers S (opt). The fixtures'
fusion, parity and greedy generation run in test_fuse_rotary.py, test_llm_preset.py and
test_kv_generation.py; this file covers what those do not: hand-built must-not-fire cases, a
LongRoPE prompt past the switch, and the KV rewrites that must be refused."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.llm_fixtures import assert_parity, feeds, fixtures, max_abs_diff, op_count, optimize

F, I64 = TensorProto.FLOAT, TensorProto.INT64
B, H, S, D = 2, 3, 5, 8
INV_FREQ = (1.0 / (10000.0 ** (np.arange(0, D, 2) / D))).astype(np.float32)
BIG = np.iinfo(np.int64).max


def _const(name: str, values: list[int] | np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def interleaved_model(neg_on_even: bool = False, opset: int = 23) -> onnx.ModelProto:
    """cohere's form on x (B, H, S, D): angles repeat_interleave(pos * inv_freq) -> Cos / Sin ->
    Unsqueeze(1); rotate_every_two(x) = stack(-x[..., 1::2], x[..., 0::2]).flatten(-2).
    neg_on_even: stack(-x[..., 0::2], x[..., 1::2]), not a rotation the op computes."""
    first, second = ("even", "odd") if neg_on_even else ("odd", "even")
    nodes = [
        helper.make_node("Unsqueeze", ["position_ids", "ax2"], ["pos3"]),
        helper.make_node("Cast", ["pos3"], ["posf"], to=F),
        helper.make_node("Mul", ["posf", "inv_freq"], ["freqs"]),
        helper.make_node("Unsqueeze", ["freqs", "ax3"], ["freqs4"]),
        helper.make_node("Tile", ["freqs4", "reps"], ["tiled"]),
        helper.make_node("Reshape", ["tiled", "flat3"], ["angles"]),
        helper.make_node("Cos", ["angles"], ["cos3"]),
        helper.make_node("Sin", ["angles"], ["sin3"]),
        helper.make_node("Unsqueeze", ["cos3", "ax1"], ["cos"]),
        helper.make_node("Unsqueeze", ["sin3", "ax1"], ["sin"]),
        helper.make_node("Slice", ["x", "one", "big", "ax3", "two"], ["odd"]),
        helper.make_node("Slice", ["x", "zero", "big", "ax3", "two"], ["even"]),
        helper.make_node("Neg", [first], ["neg"]),
        helper.make_node("Unsqueeze", ["neg", "last"], ["a"]),
        helper.make_node("Unsqueeze", [second, "last"], ["b"]),
        helper.make_node("Concat", ["a", "b"], ["pairs"], axis=-1),
        helper.make_node("Reshape", ["pairs", "flat4"], ["rot"]),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(INV_FREQ, "inv_freq"),
        _const("ax1", [1]),
        _const("ax2", [2]),
        _const("ax3", [3]),
        _const("last", [-1]),
        _const("reps", [1, 1, 1, 2]),
        _const("flat3", [0, 0, -1]),
        _const("flat4", [0, 0, 0, D]),
        _const("zero", [0]),
        _const("one", [1]),
        _const("two", [2]),
        _const("big", [BIG]),
    ]
    graph = helper.make_graph(
        nodes,
        "interleaved",
        [
            helper.make_tensor_value_info("x", F, [B, H, S, D]),
            helper.make_tensor_value_info("position_ids", I64, [B, S]),
        ],
        [helper.make_tensor_value_info("y", F, [B, H, S, D])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    from support.llm_fixtures import run

    return np.asarray(run(model, feed)[0])


def _feed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    pos = np.stack([np.arange(S), np.arange(3, 3 + S)]).astype(np.int64)
    return {"x": rng.standard_normal((B, H, S, D)).astype(np.float32), "position_ids": pos}


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_interleaved_fuses_with_parity(target: str) -> None:
    model = interleaved_model()
    report = fastopt.optimize(
        fastopt.load_bytes(model.SerializeToString()),
        passes=["fuse_rotary", "eliminate_dead_nodes"],
        target=target,  # type: ignore[arg-type]
    )
    assert report.model is not None
    report.model.verify()
    out = report.model.to_onnx()
    (rope,) = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert rope.domain == ("com.microsoft" if target == "ort" else "")
    attrs = {a.name: helper.get_attribute_value(a) for a in rope.attribute}
    assert attrs["interleaved"] == 1
    for op in ("Cos", "Sin", "Neg", "Tile"):
        assert op_count(out, op) == 0, op
    onnx.checker.check_model(out, full_check=True)
    feed = _feed()
    np.testing.assert_allclose(_run(out, feed), _run(model, feed), atol=1e-5)


def table_model() -> onnx.ModelProto:
    """gptj's form on x (B, S, H, D): a (M, D) table [sin | cos] gathered by the positions, its
    halves sliced, Unsqueeze(2), repeat_interleave by Unsqueeze(-1) -> Tile -> Reshape."""
    m = 16
    angles = np.arange(m)[:, None] * INV_FREQ[None]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "position_ids"], ["rows"])]
    for fn, start, end in (("sin", "zero", "half"), ("cos", "half", "full")):
        nodes += [
            helper.make_node("Slice", ["rows", start, end, "last"], [f"{fn}3"]),
            helper.make_node("Unsqueeze", [f"{fn}3", "ax2"], [f"{fn}4"]),
            helper.make_node("Unsqueeze", [f"{fn}4", "ax4"], [f"{fn}5"]),
            helper.make_node("Tile", [f"{fn}5", "reps"], [f"{fn}t"]),
            helper.make_node("Reshape", [f"{fn}t", "flat4"], [fn]),
        ]
    base = interleaved_model()
    nodes += [n for n in base.graph.node if n.output[0] in ("odd", "even", "neg", "a", "b")]
    nodes += [n for n in base.graph.node if n.output[0] in ("pairs", "rot", "xc", "rs", "y")]
    inits = [
        numpy_helper.from_array(table, "table"),
        _const("ax2", [2]),
        _const("ax3", [3]),
        _const("ax4", [4]),
        _const("last", [-1]),
        _const("reps", [1, 1, 1, 1, 2]),
        _const("flat4", [0, 0, 0, -1]),
        _const("zero", [0]),
        _const("one", [1]),
        _const("two", [2]),
        _const("half", [D // 2]),
        _const("full", [D]),
        _const("big", [BIG]),
    ]
    graph = helper.make_graph(
        nodes,
        "table",
        [
            helper.make_tensor_value_info("x", F, [B, S, H, D]),
            helper.make_tensor_value_info("position_ids", I64, [B, S]),
        ],
        [helper.make_tensor_value_info("y", F, [B, S, H, D])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_table_columns_on_bshd_fuse_with_parity() -> None:
    """The sin and cos columns of one table become the caches; x (B, S, H, D) goes through
    Transposes to the 4-D form."""
    model = table_model()
    report = fastopt.optimize(
        fastopt.load_bytes(model.SerializeToString()),
        passes=["fuse_rotary", "eliminate_dead_nodes"],
        target="ort",
    )
    assert report.model is not None
    out = report.model.to_onnx()
    (rope,) = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert {a.name: helper.get_attribute_value(a) for a in rope.attribute}["interleaved"] == 1
    assert op_count(out, "Gather") == op_count(out, "Tile") == 0
    feed = _feed()
    feed["x"] = np.ascontiguousarray(feed["x"].transpose(0, 2, 1, 3))
    np.testing.assert_allclose(_run(out, feed), _run(model, feed), atol=1e-5)


def test_swapped_pairs_are_not_fused() -> None:
    """(-x_even, x_odd) is the opposite rotation: refused with the reason."""
    model = interleaved_model(neg_on_even=True)
    report = fastopt.optimize(
        fastopt.load_bytes(model.SerializeToString()),
        passes=["fuse_rotary"],
        target="ort",
        explain="fuse_rotary_interleaved",
    )
    assert report.passes[0].rewrites == 0
    assert any("x[..., 1::2] and x[..., 0::2]" in line for line in report.explain)


# ---- LongRoPE (phi3): the table switches at original_max_position_embeddings ----

LONGROPE = fixtures(arch="phi3_longrope")


@pytest.mark.parametrize("fx", LONGROPE, ids=[fx.name for fx in LONGROPE])
def test_longrope_switches_tables_exactly(fx) -> None:  # type: ignore[no-untyped-def]
    """One stacked cache (short rows, then long rows) for both targets; the logits agree on
    prompts below the switch (13 tokens) and past it (40 > 32: the long factors everywhere)."""
    switch = int(fx.meta["config"]["original_max_position_embeddings"])
    for target in ("ort", "onnx"):
        report, out = optimize(fx, preset="llm", target=target)
        rotary = next(p for p in report.passes if p.name == "fuse_rotary")
        assert rotary.counters["switched_tables"] == 2 * fx.layers
        assert op_count(out, "Cos") == op_count(out, "Sin") == 0
        assert_parity(fx, out, paddings=(None, "right"))
        long = feeds(fx, batch=2, seq=switch + 8, padding="right")
        assert max_abs_diff(fx, out, long) <= 1e-4


@pytest.mark.parametrize("mode", ["standard", "inplace"])
@pytest.mark.parametrize("fx", LONGROPE, ids=[fx.name for fx in LONGROPE])
def test_longrope_kv_cache_is_refused(fx, mode: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Past the switch the full recompute re-rotates every key with the long factors; a cache
    keeps each key's rotation: never a cached model that decodes differently."""
    out = tmp_path / "model.onnx"
    with pytest.raises(fastopt.ModelError, match="LongRoPE switch of rotary tables"):
        fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    assert not out.exists()


# ---- in place where it was refused before (gptj, opt TorchScript) ----

INPLACE = fixtures(arch=["gptj", "opt"], exporter="ts")


@pytest.mark.parametrize("fx", INPLACE, ids=[fx.name for fx in INPLACE])
def test_torchscript_inplace_lowers_to_gqa(fx, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """opt's head split Reshape(x, [B, -1, H, D]) infers S; gptj's partial (16 of 32),
    interleaved rotary goes into GroupQueryAttention (do_rotary, rotary_interleaved: a cache
    width of 8, the kernels' multiple). Generation parity is test_kv_generation's."""
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="inplace")
    assert report.ops_after["com.microsoft::GroupQueryAttention"] == fx.layers
    model = onnx.load(out)
    presents = [v.name for v in model.graph.output if v.name.startswith("present.")]
    producers = {o: n.op_type for n in model.graph.node for o in n.output}
    assert {producers[p] for p in presents} == {"GroupQueryAttention"}
    if fx.arch == "gptj":
        assert op_count(model, "RotaryEmbedding") == 0
        for n in model.graph.node:
            if n.op_type == "GroupQueryAttention":
                attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
                assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 1
                cos = next(t for t in model.graph.initializer if t.name == n.input[7])
                assert list(cos.dims)[1] == 8  # rotary_dim 16 of head 32
