"""Generic forms of current families that fell through the fusions (issue 27), on real exports:

- cohere's LayerNorm (no bias, mean and variance in fp32, TorchScript's rsqrt = Div(1, Sqrt)):
  one LayerNormalization without a bias input; fuse_rms_norm no longer takes its variance half
  (tests/fixtures/forms/cohere_layer_norm_*, make_form_fixtures.py);
- DeepSeek-V3's even/odd rotary on the rope part of each multi-latent-attention head: one
  RotaryEmbedding per q and k, no Sin/Cos left (tests/fixtures/mla);
- partial rotary of 28 of 32 dims (not a multiple of 8): one RotaryEmbedding with
  rotary_embedding_dim 28 (tests/fixtures/forms/gpt_neox_rot09_*);
- a head split whose head count TorchScript computes (floor division's sign fix-up, numel()):
  the shape analysis derives (B, S, 4, 16), and the attention fuses
  (tests/fixtures/forms/attention_heads_*).

Every rewrite is checked against the export in ONNX Runtime, both targets.
"""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt import _C
from onnx import TensorProto, helper
from support.fusion_util import info, make_model, ort_run, tensor
from support.llm_fixtures import Fixture, assert_parity, op_count, optimize
from support.paths import TESTS

FIXTURES = TESTS / "fixtures"
FORMS = FIXTURES / "forms"
LAYER_NORMS = sorted(FORMS.glob("cohere_layer_norm_*/model.onnx"))
MLA = [Fixture(p) for p in sorted((FIXTURES / "mla").glob("*/model.onnx"))]
PARTIAL = [Fixture(p) for p in sorted(FORMS.glob("gpt_neox_rot09_*/model.onnx"))]
COMPUTED_HEADS = sorted(FORMS.glob("attention_heads_*/model.onnx"))
VAR_NORMS = sorted(FORMS.glob("var_layer_norm_*/model.onnx"))
TARGETS = ["ort", "onnx"]


def _ids(paths: list[Path]) -> list[str]:
    return [p.parent.name for p in paths]


def _run(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    proto = onnx.load(model) if isinstance(model, Path) else model
    return np.asarray(ort_run(proto, {"x": x})[0], dtype=np.float64)


# --- LayerNorm without bias, in fp32 -------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("path", LAYER_NORMS, ids=_ids(LAYER_NORMS))
def test_cohere_layer_norm_fuses_without_bias(path: Path, target: str) -> None:
    _, out = optimize(Fixture(path), preset="llm", target=target)
    norms = [n for n in out.graph.node if n.op_type == "LayerNormalization"]
    assert len(norms) == 1, [n.op_type for n in out.graph.node]
    assert len(norms[0].input) == 2  # x and the scale: no bias input
    for residue in (
        "ReduceMean",
        "Sqrt",
        "Pow",
        "SimplifiedLayerNormalization",
        "RMSNormalization",
    ):
        assert op_count(out, residue) == 0, (residue, [n.op_type for n in out.graph.node])
    dtype = np.float16 if "float16" in path.parent.name else np.float32
    x = np.random.default_rng(0).standard_normal((3, 7, 32)).astype(dtype)
    bound = 2e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(_run(out, x), _run(path, x), atol=bound, rtol=0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("path", VAR_NORMS, ids=_ids(VAR_NORMS))
def test_var_unbiased_false_layer_norm_fuses(path: Path, target: str) -> None:
    """`(x - mean) / sqrt(x.var(unbiased=False) + eps) * w + b`: dynamo writes the variance's
    mean without keepdims plus a Reshape that puts the axis back, and the norm's mean a second
    time (axes -1 and 2): one LayerNormalization with its bias, nothing left, ORT parity."""
    assert len(VAR_NORMS) == 2
    _, out = optimize(Fixture(path), preset="llm", target=target)
    ops = [n.op_type for n in out.graph.node]
    norms = [
        n for n in out.graph.node if n.op_type in ("LayerNormalization", "SkipLayerNormalization")
    ]
    assert len(norms) == 1 and len(norms[0].input) >= 3, ops
    for residue in ("ReduceMean", "Sqrt", "Reshape", "Sub", "Div"):
        assert residue not in ops, ops
    x = np.random.default_rng(0).standard_normal((3, 7, 32)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(path, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("target", TARGETS)
def test_rms_norm_leaves_a_layer_norms_variance(target: str) -> None:
    """fuse_rms_norm alone (before fuse_layer_norm, or without it) does not take the variance
    half of a LayerNorm: the whole stays for fuse_layer_norm, with the reason."""
    path = FORMS / "cohere_layer_norm_ts_float32" / "model.onnx"
    passes = fastopt.pipeline.registry.preset("cleanup")
    passes += ["convert_version", "fuse_rms_norm"] if target == "onnx" else ["fuse_rms_norm"]
    report = fastopt.optimize(path, passes=passes, target=target, explain="fuse_rms_norm")  # type: ignore[arg-type]
    assert report.model is not None
    out = report.model.to_onnx()
    assert op_count(out, "SimplifiedLayerNormalization") + op_count(out, "RMSNormalization") == 0
    assert any("a LayerNorm's variance" in line for line in report.explain), report.explain


def test_rms_norm_still_fuses_an_uncentered_input() -> None:
    """The check reads the Sub's mean: x - ReduceMean(y) of another y is no LayerNorm."""
    d = 8
    nodes = [
        helper.make_node("ReduceMean", ["y"], ["m"], axes=[-1]),
        helper.make_node("Sub", ["x", "m"], ["c"]),
        helper.make_node("Pow", ["c", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
        helper.make_node("Div", ["one", "s"], ["inv"]),
        helper.make_node("Mul", ["c", "inv"], ["n"]),
        helper.make_node("Mul", ["n", "w"], ["out"]),
    ]
    rng = np.random.default_rng(1)
    model = make_model(
        nodes,
        [info("x", TensorProto.FLOAT, [2, 3, d]), info("y", TensorProto.FLOAT, [2, 3, d])],
        [info("out", TensorProto.FLOAT, [2, 3, d])],
        [
            tensor("two", np.array(2.0, np.float32)),
            tensor("eps", np.array(1e-5, np.float32)),
            tensor("one", np.array(1.0, np.float32)),
            tensor("w", rng.standard_normal(d).astype(np.float32)),
        ],
    )
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=["infer_shapes", "fuse_rms_norm"], target="ort"
    )
    assert report.model is not None
    out = report.model.to_onnx()
    assert op_count(out, "SimplifiedLayerNormalization") == 1
    feeds = {k: rng.standard_normal((2, 3, d)).astype(np.float32) for k in ("x", "y")}
    np.testing.assert_allclose(ort_run(out, feeds)[0], ort_run(model, feeds)[0], atol=1e-5)


# --- DeepSeek-V3's even/odd rotary on the MLA rope part -----------------------------------------


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fx", MLA, ids=[fx.name for fx in MLA])
def test_mla_even_odd_rotary_fuses(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="llm", target=target)
    assert op_count(out, "Sin") == op_count(out, "Cos") == 0
    rotaries = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotaries) == 2 * fx.layers  # q and k of each layer
    for n in rotaries:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        assert attrs.get("interleaved", 0) == 0  # rotate_half's rotary of the halves
    counters = next(p.counters for p in report.passes if p.name == "fuse_rotary")
    assert counters.get("even_odd") == 2 * fx.layers
    assert_parity(fx, out)


def _even_odd_model(odd_start: int) -> onnx.ModelProto:
    """y = Concat(x1 c - x2 s, x2 c + x1 s), x1 = x[..., 0::2], x2 = x[..., odd_start::2];
    c, s = Cos/Sin(Concat(f, f))[..., :D/2] unsqueezed for the heads, f = positions * inv_freq."""
    d, half = 8, 4
    inv = (1.0 / 10000 ** (np.arange(half) / half)).astype(np.float32)
    nodes = [
        helper.make_node("Unsqueeze", ["pos", "ax2"], ["pu"]),
        helper.make_node("Cast", ["pu"], ["pf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["pf", "inv"], ["f"]),
        helper.make_node("Concat", ["f", "f"], ["ang"], axis=-1),
    ]
    for fn in ("Cos", "Sin"):
        low = fn.lower()
        nodes += [
            helper.make_node(fn, ["ang"], [f"{low}_full"]),
            helper.make_node("Slice", [f"{low}_full", "z", "h", "last"], [f"{low}_half"]),
            helper.make_node("Unsqueeze", [f"{low}_half", "ax1"], [low]),
        ]
    nodes += [
        helper.make_node("Slice", ["x", "z", "big", "last", "two"], ["x1"]),
        helper.make_node("Slice", ["x", "odd", "big", "last", "two"], ["x2"]),
        helper.make_node("Mul", ["x1", "cos"], ["a"]),
        helper.make_node("Mul", ["x2", "sin"], ["b"]),
        helper.make_node("Sub", ["a", "b"], ["lo"]),
        helper.make_node("Mul", ["x2", "cos"], ["c"]),
        helper.make_node("Mul", ["x1", "sin"], ["e"]),
        helper.make_node("Add", ["c", "e"], ["hi"]),
        helper.make_node("Concat", ["lo", "hi"], ["y"], axis=-1),
    ]
    ints = {"ax1": [1], "ax2": [2], "z": [0], "h": [half], "last": [-1], "two": [2]}
    ints.update({"odd": [odd_start], "big": [2**62]})
    inits = [tensor(k, np.array(v, np.int64)) for k, v in ints.items()]
    inits.append(tensor("inv", inv))
    return make_model(
        nodes,
        [
            info("x", TensorProto.FLOAT, ["B", 2, "S", d]),
            info("pos", TensorProto.INT64, ["B", "S"]),
        ],
        [info("y", TensorProto.FLOAT, ["B", 2, "S", d])],
        inits,
        opset=23,
    )


@pytest.mark.parametrize("target", TARGETS)
def test_even_odd_rotary_synthetic(target: str) -> None:
    model = _even_odd_model(1)
    report = fastopt.optimize(fastopt.from_onnx(model), passes=["fuse_rotary"], target=target)  # type: ignore[arg-type]
    assert report.model is not None
    report.model.verify()
    out = report.model.to_onnx()
    onnx.checker.check_model(out)
    assert op_count(out, "RotaryEmbedding") == 1
    rng = np.random.default_rng(2)
    feeds = {
        "x": rng.standard_normal((2, 2, 5, 8)).astype(np.float32),
        "pos": rng.integers(0, 100, (2, 5)).astype(np.int64),
    }
    np.testing.assert_allclose(ort_run(out, feeds)[0], ort_run(model, feeds)[0], atol=1e-5)


def test_even_odd_rotary_refuses_other_slices() -> None:
    """x[..., 0::2] twice is no rotation of pairs: kept, with the reason."""
    report = fastopt.optimize(
        fastopt.from_onnx(_even_odd_model(0)),
        passes=["fuse_rotary"],
        target="ort",
        explain="fuse_rotary_even_odd",
    )
    assert report.model is not None
    assert op_count(report.model.to_onnx(), "RotaryEmbedding") == 0
    assert any("x[..., 0::2] and x[..., 1::2]" in line for line in report.explain), report.explain


# --- partial rotary, 28 of 32 dims --------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fx", PARTIAL, ids=[fx.name for fx in PARTIAL])
def test_partial_rotary_not_a_multiple_of_8(fx: Fixture, target: str) -> None:
    _, out = optimize(fx, preset="llm", target=target)
    assert op_count(out, "Sin") == op_count(out, "Cos") == 0
    rotaries = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rotaries) == 2 * fx.layers
    for n in rotaries:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        rotated = attrs.get("rotary_embedding_dim", attrs.get("num_rotated"))
        assert rotated == 28, attrs
    assert_parity(fx, out)


# --- a head count behind a computed shape ------------------------------------------------------


@pytest.mark.parametrize("path", COMPUTED_HEADS, ids=_ids(COMPUTED_HEADS))
def test_computed_head_count_is_derived(path: Path) -> None:
    model = onnx.load(path)
    facts = dict(_C.shape_facts(fastopt.from_onnx(model)))
    splits = [n.output[0] for n in model.graph.node if n.op_type == "Reshape"][:3]
    assert len(splits) == 3
    for name in splits:
        assert facts[name][1] == ["batch", "sequence", 4, 16], (name, facts[name])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("path", COMPUTED_HEADS, ids=_ids(COMPUTED_HEADS))
def test_computed_head_count_attention_fuses(path: Path, target: str) -> None:
    _, out = optimize(Fixture(path), preset="llm", target=target)
    assert op_count(out, "Softmax") == 0, [n.op_type for n in out.graph.node]
    fused = sum(
        op_count(out, op) for op in ("Attention", "MultiHeadAttention", "GroupQueryAttention")
    )
    assert fused == 1
    x = np.random.default_rng(3).standard_normal((3, 7, 64)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(path, x), atol=1e-5, rtol=0)
