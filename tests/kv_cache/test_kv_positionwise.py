"""add_kv_cache proves the whole decoder (issue 25): positions may mix only in the attentions it
caches. Real fixture exports are mutated with onnx to mix positions elsewhere (a running sum,
a token shift, a mean over the tokens, a layer whose attention does not fuse, a convolution
over the tokens); each is refused, with the op and the layer named, where main converted them
and generated wrong tokens. A position-wise mutation still converts with greedy parity, and a
real conv/attention hybrid (LFM2, tests/fixtures/hybrid) is refused with the conv reason."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt.cli.main import main
from onnx import helper, numpy_helper
from support import kv_generation as kg
from support.llm_fixtures import fixtures
from support.paths import ROOT, TESTS

HYBRID = TESTS / "fixtures" / "hybrid"
MUTATED = ["llama_ts_float32", "qwen2_dynamo_float32"]

Build = Callable[[onnx.ModelProto, str, int], tuple[list[onnx.NodeProto], str]]


def _fixture(name: str) -> Path:
    (fx,) = [f for f in fixtures(cache_export=None) if f.name == name]
    return fx.path


def _hidden(model: onnx.ModelProto) -> int:
    emb = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    return int(min(emb.dims))


def _splice(model: onnx.ModelProto, value: str, build: Build) -> onnx.ModelProto:
    """Every reader of `value` reads build(value) instead; the new nodes go before the first
    reader (the graph stays sorted)."""
    nodes, out = build(model, value, _hidden(model))
    graph = model.graph
    readers = [i for i, n in enumerate(graph.node) if value in n.input]
    for i in readers:
        n = graph.node[i]
        n.input[:] = [out if x == value else x for x in n.input]
    at = readers[0]
    for k, n in enumerate(nodes):
        graph.node.insert(at + k, n)
    return model


def _const(model: onnx.ModelProto, name: str, array: np.ndarray) -> str:
    model.graph.initializer.append(numpy_helper.from_array(array, name))
    return name


def _layer1_norm_input(model: onnx.ModelProto) -> str:
    """The hidden states layer 1's input norm reads (B, S, H): the third RMSNorm Pow's input."""
    pows = [n for n in model.graph.node if n.op_type == "Pow"]
    return pows[2].input[0]


def _cumsum(model: onnx.ModelProto, x: str, hidden: int) -> tuple[list[onnx.NodeProto], str]:
    axis = _const(model, "mut_axis", np.array(1, np.int64))
    return [helper.make_node("CumSum", [x, axis], ["mut_y"], name="mut_cumsum")], "mut_y"


def _token_shift(model: onnx.ModelProto, x: str, hidden: int) -> tuple[list[onnx.NodeProto], str]:
    """x + 0.5 * (x shifted one token to the right): Slice(0:-1) then Pad one row in front."""
    c = lambda n, v: _const(model, n, np.array(v, np.int64))  # noqa: E731
    half = _const(model, "mut_half", np.array(0.5, np.float32))
    nodes = [
        helper.make_node(
            "Slice",
            [x, c("mut_s", [0]), c("mut_e", [-1]), c("mut_a", [1])],
            ["mut_prev"],
            name="mut_slice",
        ),
        helper.make_node(
            "Pad", ["mut_prev", c("mut_pads", [0, 1, 0, 0, 0, 0])], ["mut_shift"], name="mut_pad"
        ),
        helper.make_node("Mul", ["mut_shift", half], ["mut_half_shift"], name="mut_mul"),
        helper.make_node("Add", [x, "mut_half_shift"], ["mut_y"], name="mut_add"),
    ]
    return nodes, "mut_y"


def _mean(axis: int) -> Build:
    def build(model: onnx.ModelProto, x: str, hidden: int) -> tuple[list[onnx.NodeProto], str]:
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        if opset >= 18:
            axes = _const(model, "mut_axes", np.array([axis], np.int64))
            mean = helper.make_node("ReduceMean", [x, axes], ["mut_mean"], name="mut_mean")
        else:
            mean = helper.make_node("ReduceMean", [x], ["mut_mean"], axes=[axis], name="mut_mean")
        return [
            mean,
            helper.make_node("Add", [x, "mut_mean"], ["mut_y"], name="mut_add"),
        ], "mut_y"

    return build


def _causal_conv(model: onnx.ModelProto, x: str, hidden: int) -> tuple[list[onnx.NodeProto], str]:
    """x + depthwise Conv1d over the tokens (kernel 3, causal: two pads in front), as LFM2's."""
    rng = np.random.default_rng(0)
    w = _const(model, "mut_w", (0.3 * rng.standard_normal((hidden, 1, 3))).astype(np.float32))
    return [
        helper.make_node("Transpose", [x], ["mut_t"], perm=[0, 2, 1], name="mut_t"),
        helper.make_node(
            "Conv",
            ["mut_t", w],
            ["mut_c"],
            group=hidden,
            kernel_shape=[3],
            pads=[2, 0],
            name="mut_conv",
        ),
        helper.make_node("Transpose", ["mut_c"], ["mut_ct"], perm=[0, 2, 1], name="mut_ct"),
        helper.make_node("Add", [x, "mut_ct"], ["mut_y"], name="mut_add"),
    ], "mut_y"


def _scaled_probabilities(model: onnx.ModelProto) -> onnx.ModelProto:
    """Layer 1's attention probabilities times 0.9 after the Softmax: it no longer fuses."""
    soft = [n for n in model.graph.node if n.op_type == "Softmax"][1]
    scale = _const(model, "mut_scale", np.array(0.9, np.float32))

    def build(m: onnx.ModelProto, x: str, hidden: int) -> tuple[list[onnx.NodeProto], str]:
        return [helper.make_node("Mul", [x, scale], ["mut_y"], name="mut_scale")], "mut_y"

    return _splice(model, soft.output[0], build)


def _other_softcap(model: onnx.ModelProto) -> onnx.ModelProto:
    """gemma2's layer 1 caps its scores with c * tanh(s / c') (c = 0.8 c'): no soft-cap, so
    that attention does not fuse while layers 0 and 2 do."""
    (tanh,) = [
        n for n in model.graph.node if n.op_type == "Tanh" and "layers.1/self_attn" in n.name
    ]
    (mul,) = [n for n in model.graph.node if n.op_type == "Mul" and tanh.output[0] in n.input]
    consts = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    c = numpy_helper.to_array(consts[mul.input[1]].attribute[0].t)
    mul.input[1] = _const(model, "mut_cap", (0.8 * c).astype(c.dtype))
    return model


def _mutated(name: str, kind: str, tmp_path: Path) -> Path:
    model = onnx.load(_fixture(name))
    if kind == "unfused_attention":
        model = _scaled_probabilities(model)
    elif kind == "other_softcap":
        model = _other_softcap(model)
    else:
        build = {
            "cumsum": _cumsum,
            "token_shift": _token_shift,
            "sequence_mean": _mean(1),
            "conv": _causal_conv,
            "hidden_mean": _mean(-1),
        }[kind]
        model = _splice(model, _layer1_norm_input(model), build)
    onnx.checker.check_model(model)
    path = tmp_path / f"{name}_{kind}.onnx"
    onnx.save(model, path)
    return path


# kind -> (the op the refusal names, words of its reason)
REFUSED = {
    "cumsum": ("CumSum 'mut_cumsum'", "running sum"),
    "token_shift": ("Slice 'mut_slice'", "token shift"),
    "sequence_mean": ("ReduceMean 'mut_mean'", "reduces over the sequence axis"),
    "conv": ("Conv 'mut_conv'", "cached state of its own"),
    "unfused_attention": ("MatMul '", "attention that did not fuse"),
}


@pytest.mark.parametrize("mode", ["standard", "inplace"])
@pytest.mark.parametrize("kind", list(REFUSED))
@pytest.mark.parametrize("name", MUTATED)
def test_position_mixing_refused(name: str, kind: str, mode: str, tmp_path: Path) -> None:
    src = _mutated(name, kind, tmp_path)
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(fastopt.ModelError) as e:
        fastopt.optimize(src, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    msg = str(e.value)
    op, why = REFUSED[kind]
    assert op in msg and why in msg and "mixes the positions" in msg, msg
    if kind == "unfused_attention":  # the MatMul of layer 1's scores (names in ts exports)
        assert "layer 1" in msg or name.endswith("dynamo_float32"), msg
    assert not out.parent.exists()


@pytest.mark.parametrize("mode", ["standard", "inplace"])
def test_one_layer_with_another_softcap_refused(mode: str, tmp_path: Path) -> None:
    src = _mutated("gemma2_ts_float32", "other_softcap", tmp_path)
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(fastopt.ModelError) as e:
        fastopt.optimize(src, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "MatMul '/m/model/layers.1/self_attn/MatMul' (layer 1)" in msg, msg
    assert "attention that did not fuse" in msg, msg
    assert not out.parent.exists()


def test_cli_refusal_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _mutated("llama_ts_float32", "conv", tmp_path)
    out = tmp_path / "out" / "model.onnx"
    assert main(["optimize", str(src), "-o", str(out), "--kv-cache", "standard"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "Conv 'mut_conv' (layer 1)" in err or "Conv 'mut_conv'" in err, err
    assert not out.parent.exists()


@pytest.mark.parametrize("name", MUTATED)
def test_positionwise_mutation_converts(name: str, tmp_path: Path) -> None:
    """A mean over the hidden axis added back mixes no positions: converted, greedy parity
    (the proof refuses what mixes positions, not whatever it has not seen)."""
    src = _mutated(name, "hidden_mean", tmp_path)
    out = tmp_path / "out" / "model.onnx"
    fastopt.optimize(src, preset="llm", output=out, kv_cache="standard")
    prompts = [[5, 17, 33, 2, 9, 41, 7, 11, 3], [8, 21, 4, 60, 12]]
    ref = kg.greedy_no_cache(src, *kg.right_pad(prompts), 8)
    got = kg.greedy_cached(out, prompts, 8)
    assert kg.compare(ref, got)[0] == 8
    np.testing.assert_allclose(got.logits, ref.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("path", sorted(HYBRID.glob("*/model.onnx")), ids=lambda p: p.parent.name)
def test_lfm2_hybrid_refused(path: Path, tmp_path: Path) -> None:
    """A real LFM2 export (short causal convolutions between attention layers): refused with
    the conv reason (a convolution over the tokens needs a cached state of its own)."""
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(fastopt.ModelError, match="cached state of its own") as e:
        fastopt.optimize(path, preset="llm", output=out, kv_cache="standard")
    msg = str(e.value)
    assert "Conv '" in msg and ("layer 1" in msg or "between attentions 0 and 1" in msg), msg
    assert not out.parent.exists()


def test_lfm2_fixtures_present() -> None:
    assert len(list(HYBRID.glob("*/model.onnx"))) >= 1


@pytest.mark.parametrize("mode", ["standard", "inplace"])
def test_one_layer_with_another_cache_layout_refused(mode: str, tmp_path: Path) -> None:
    """One layer's repeat_kv groups the heads the other way (tests/difftest's
    repeat_kv_grouping): its attention fuses with the repeated K/V as its cache, 4 kv heads where
    the other layers keep 2. Position-wise, but one cache layout is what genai_config.json and
    the feeds describe: main wrote it, and a loop fed from the first layer's shape failed."""
    import sys

    sys.path.insert(0, str(ROOT))  # `tests.difftest`
    from tests.difftest.mutations import apply

    model = onnx.load(_fixture("llama_dynamo_float32"))
    assert apply(model, "repeat_kv_grouping", 0) is not None
    src = tmp_path / "grouping.onnx"
    onnx.save(model, src)
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(fastopt.ModelError, match="every layer's cache must have one layout") as e:
        fastopt.optimize(src, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    assert "4 kv heads" in str(e.value) and "2 kv heads" in str(e.value), str(e.value)
    assert not out.parent.exists()
