"""fuse_layer_norm, fuse_rms_norm, fuse_skip_norm: decomposed LayerNorm / RMSNorm -> fused norms,
residual Add + norm -> com.microsoft Skip norms."""

from __future__ import annotations

from collections.abc import Sequence

import fastopt
import numpy as np
import onnx
import pytest
from onnx import helper
from support.fusion_util import info, ort_run, random, tensor
from support.llm_fixtures import (
    MOE_ARCHS,
    Fixture,
    assert_parity,
    fixtures,
    ids,
    op_count,
    optimize,
)
from support.norm_models import D, F, H, ort_model, rms_model, rms_nodes, run

RMS_ARCHS = ("llama", "mistral", "qwen2", "phi3", "gemma", "gemma3", "glm", "glm4", "phi3_longrope")
RMS_ARCHS += ("gemma2", "qwen3", *MOE_ARCHS)
# Norms per layer: gemma3 has four around its blocks and q/k norms; gptj and cohere one (attention
# and MLP in parallel); gemma2 four around its blocks; olmoe and qwen3 q/k norms besides their
# two; the others two.
NORMS_PER_LAYER = {
    "gemma3": 6,
    "glm4": 4,
    "gptj": 1,
    "cohere": 1,
    "gemma2": 4,
    "falcon": 1,
    "olmoe": 4,
    "qwen3": 4,
}
DEFAULT = fastopt.pipeline.registry.preset("classic")
ORT_PASSES = [
    *DEFAULT,
    "fuse_layer_norm",
    "fuse_rms_norm",
    "fuse_skip_norm",
    "eliminate_dead_nodes",
]
ONNX_PASSES = [
    *DEFAULT,
    "convert_version",
    "fuse_layer_norm",
    "fuse_rms_norm",
    "eliminate_dead_nodes",
]
DECOMPOSED = ("ReduceMean", "Sqrt", "Reciprocal")


# ---- fixtures: every norm fused, both targets, ORT parity ----


def expected_ort(fx: Fixture) -> dict[str, int]:
    n = fx.layers
    if fx.arch == "gemma3":  # post-norms end each block: only the pre-norms take the residual
        return {
            "SimplifiedLayerNormalization": 4 * n + 1,
            "SkipSimplifiedLayerNormalization": 2 * n,
        }
    # glm4, gemma2: post-norms end each block, pre-norms take the residual; olmoe: q/k norms
    # (over the whole projection), qwen3: q/k norms (per head), read no residual
    if fx.arch in ("glm4", "gemma2", "olmoe", "qwen3"):
        return {
            "SimplifiedLayerNormalization": 2 * n + 1,
            "SkipSimplifiedLayerNormalization": 2 * n,
        }
    if fx.arch in RMS_ARCHS:  # first layer's norm reads the embedding Gather: no residual Add
        return {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2 * n}
    if fx.arch == "gpt_neox":  # parallel residual: two norms read one sum, one can take it
        return {"LayerNormalization": n + 1, "SkipLayerNormalization": n}
    if fx.arch == "cohere" and fx.dtype == "float16":  # fp32 norms: a Cast after each residual
        return {"LayerNormalization": n + 1, "SkipLayerNormalization": 0}
    if fx.arch in ("nemotron", "modernbert", "deberta_v2"):  # the first reads the embeddings
        return {"LayerNormalization": 1, "SkipLayerNormalization": 2 * n}
    if fx.arch in ("gptj", "cohere", "falcon"):  # one norm per layer, the embeddings' first
        return {"LayerNormalization": 1, "SkipLayerNormalization": n}
    if fx.arch == "bloom":  # the embeddings' norm, then layer 0's norm of it: no residual Add
        return {"LayerNormalization": 2, "SkipLayerNormalization": 2 * n}
    if fx.arch == "mpt":  # the first norm reads the embedding Gather
        return {"LayerNormalization": 1, "SkipLayerNormalization": 2 * n}
    if fx.arch == "opt":  # the MLP runs on (B*S, H) rows: its norm reads a Reshape of the sum
        return {"LayerNormalization": 2 * n, "SkipLayerNormalization": 1}
    # gpt2 (token + position embedding Add), bert (embedding sum): every norm follows an Add
    return {"LayerNormalization": 0, "SkipLayerNormalization": 2 * n + 1}


@pytest.mark.parametrize("fx", fixtures(), ids=ids(fixtures()))
def test_fixture_ort(fx: Fixture) -> None:
    report, out = optimize(fx, passes=ORT_PASSES, target="ort")
    for op, count in expected_ort(fx).items():
        assert op_count(out, op) == count, (op, report.passes)
    for op in DECOMPOSED:
        assert op_count(out, op) == 0, op
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", fixtures(), ids=ids(fixtures()))
def test_fixture_onnx(fx: Fixture) -> None:
    _, out = optimize(fx, passes=ONNX_PASSES, target="onnx", options={"opset": 23})
    norms = NORMS_PER_LAYER.get(fx.arch, 2) * fx.layers + 1
    norms += 1 if fx.arch == "bloom" else 0  # bloom normalizes the embeddings too
    op = "RMSNormalization" if fx.arch in RMS_ARCHS else "LayerNormalization"
    assert op_count(out, op) == norms
    for dec in DECOMPOSED:
        assert op_count(out, dec) == 0, dec
    assert not any(n.domain == "com.microsoft" for n in out.graph.node)
    onnx.checker.check_model(out, full_check=True)
    assert_parity(fx, out, paddings=("left",))


# ---- hand-built models ----


def count(model: onnx.ModelProto, op: str) -> int:
    return sum(n.op_type == op for n in model.graph.node)


def parity(
    model: onnx.ModelProto, out: onnx.ModelProto, tol: float = 1e-5, dtype=np.float32
) -> None:
    feeds = {"x": random((2, 5, D), dtype, seed=1)}
    if any(i.name == "skip" for i in model.graph.input):
        feeds["skip"] = random((2, 5, D), dtype, seed=2)
    for e, a in zip(ort_run(model, feeds), ort_run(out, feeds)):
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"square": "mul", "recip": "reciprocal"},
        {"weight": False},
        {"axes": (2,)},
        {"opset": 18, "axes_input": True},
        {"recip": "direct"},
        {"recip": "direct", "weight": False},
    ],
    ids=[
        "pow_div",
        "mul_reciprocal",
        "no_weight",
        "axis_2",
        "axes_input",
        "x_div_sqrt",
        "x_div_sqrt_no_weight",
    ],
)
def test_rms_norm_variants(kw) -> None:  # type: ignore[no-untyped-def]
    model = rms_model(**kw)
    _, out = run(model, ["fuse_rms_norm", "eliminate_dead_nodes"])
    assert [n.op_type for n in out.graph.node] == ["SimplifiedLayerNormalization"]
    (node,) = out.graph.node
    eps = [a.f for a in node.attribute if a.name == "epsilon"]
    assert eps == [pytest.approx(1e-6, rel=1e-6)]
    parity(model, out)


def test_rms_norm_fp16_casts() -> None:
    """fp16 input cast up, the norm in fp32, cast back before the weight Mul (llama): the fused op
    takes the fp16 input and an fp16 scale; both Casts go."""
    nodes, inits = rms_nodes(x="xf")
    nodes.insert(0, helper.make_node("Cast", ["x"], ["xf"], to=F))
    nodes += [
        helper.make_node("Cast", ["n"], ["nh"], to=H),
        helper.make_node("Mul", ["w", "nh"], ["y"]),
    ]
    inits.append(tensor("w", random((D,), np.float16, seed=3)))
    model = ort_model(nodes, [info("x", H, ["B", "S", D])], [info("y", H, ["B", "S", D])], inits)
    _, out = run(model, ["fuse_rms_norm", "eliminate_dead_nodes"])
    assert [n.op_type for n in out.graph.node] == ["SimplifiedLayerNormalization"]
    assert list(out.graph.node[0].input) == ["x", "w"]
    parity(model, out, tol=2e-2, dtype=np.float16)


def test_rms_norm_fp32_weight_after_cast_out() -> None:
    """fp32 residual, norm, Cast to fp16, fp16 weight: the weight is converted to fp32, the
    fused op runs in fp32 and a Cast follows."""
    nodes, inits = rms_nodes()
    nodes += [
        helper.make_node("Cast", ["n"], ["nh"], to=H),
        helper.make_node("Mul", ["nh", "w"], ["y"]),
    ]
    inits.append(tensor("w", random((D,), np.float16, seed=3)))
    model = ort_model(nodes, [info("x", F, ["B", "S", D])], [info("y", H, ["B", "S", D])], inits)
    report, out = run(model, ["fuse_rms_norm", "eliminate_dead_nodes"])
    assert [n.op_type for n in out.graph.node] == ["SimplifiedLayerNormalization", "Cast"]
    assert report.passes[1].counters["rms_norm_scale_converted"] == 1
    parity(model, out, tol=2e-2)


def test_rms_norm_down_cast_input_kept() -> None:
    """fp32 input cast down to fp16, the norm in fp16, cast back up: the fused op takes the
    rounded fp16 value (what the model normalizes), not the fp32 input."""
    nodes, _ = rms_nodes(x="xh")
    inits = [tensor(k, np.array(v, np.float16)) for k, v in (("two", 2), ("eps", 1e-6), ("one", 1))]
    nodes.insert(0, helper.make_node("Cast", ["x"], ["xh"], to=H))
    nodes.append(helper.make_node("Cast", ["n"], ["y"], to=F))
    model = ort_model(nodes, [info("x", F, ["B", "S", D])], [info("y", F, ["B", "S", D])], inits)
    _, out = run(model, ["fuse_rms_norm", "eliminate_dead_nodes"])
    assert [n.op_type for n in out.graph.node] == ["Cast", "SimplifiedLayerNormalization", "Cast"]
    assert out.graph.node[1].input[0] == "xh"
    parity(model, out, tol=2e-2)


def rms_negative_cases() -> dict[str, onnx.ModelProto]:
    cases = {
        "axis_1": rms_model(axes=(1,)),
        "two_axes": rms_model(axes=(1, 2)),
        "keepdims_0": rms_model(keepdims=0),
    }
    m = rms_model()
    m.graph.initializer[0].CopyFrom(tensor("two", np.array(3.0, np.float32)))
    cases["pow_3"] = m
    m = rms_model()
    m.graph.initializer[2].CopyFrom(tensor("one", np.array(2.0, np.float32)))
    cases["numerator_2"] = m
    m = rms_model()
    m.graph.output.append(info("var", F, ["B", "S", 1]))
    cases["extra_use"] = m
    m = rms_model()
    m.graph.initializer[-1].CopyFrom(tensor("w", random((1, D), seed=3)))
    # The core still fuses (no weight): the 2-D weight Mul stays after it.
    cases["weight_2d"] = m
    return cases


@pytest.mark.parametrize("case", list(rms_negative_cases()))
def test_rms_norm_negative(case: str) -> None:
    model = rms_negative_cases()[case]
    _, out = run(model, ["fuse_rms_norm", "eliminate_dead_nodes"])
    if case == "weight_2d":
        assert [n.op_type for n in out.graph.node] == ["SimplifiedLayerNormalization", "Mul"]
        parity(model, out)
        return
    assert count(out, "SimplifiedLayerNormalization") == 0
    assert count(out, "Sqrt") == 1


def test_rms_norm_onnx_target() -> None:
    model = rms_model()
    _, out = run(model, ["fuse_rms_norm"], target="onnx")
    assert count(out, "RMSNormalization") == 0  # opset 17: RMSNormalization needs 23
    _, out = run(
        model,
        ["convert_version", "fuse_rms_norm", "eliminate_dead_nodes"],
        target="onnx",
        options={"opset": 23},
    )
    assert [n.op_type for n in out.graph.node] == ["RMSNormalization"]
    onnx.checker.check_model(out, full_check=True)
    parity(model, out)


def test_rms_norm_explain() -> None:
    report = fastopt.optimize(
        fastopt.from_onnx(rms_model(axes=(1,))), passes=["fuse_rms_norm"], explain="fuse_rms_norm"
    )
    assert any("ReduceMean's axis is not the last one" in line for line in report.explain), (
        report.explain
    )


# ---- LayerNorm ----


def ln_model(
    beta: bool = True,
    recip: bool = False,
    dup_sub: bool = False,
    square: str = "pow",
    eps: float = 1e-5,
    axes: Sequence[int] = (-1,),
    gamma_size: int = D,
    opset: int = 17,
) -> onnx.ModelProto:
    inits = [
        tensor("two", np.array(2.0, np.float32)),
        tensor("eps", np.array(eps, np.float32)),
        tensor("gamma", random((gamma_size,), seed=3)),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=list(axes)),
        helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["sq"])
        if square == "pow"
        else helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["v"], axes=list(axes)),
        helper.make_node("Add", ["v", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
    ]
    d2 = "d"
    if dup_sub:
        nodes.append(helper.make_node("Sub", ["x", "m"], ["d2"]))
        d2 = "d2"
    if recip:
        nodes += [
            helper.make_node("Reciprocal", ["s"], ["r"]),
            helper.make_node("Mul", [d2, "r"], ["nrm"]),
        ]
    else:
        nodes.append(helper.make_node("Div", [d2, "s"], ["nrm"]))
    nodes.append(helper.make_node("Mul", ["gamma", "nrm"], ["g" if beta else "y"]))
    if beta:
        inits.append(tensor("beta", random((D,), seed=4)))
        nodes.append(helper.make_node("Add", ["g", "beta"], ["y"]))
    return ort_model(
        nodes, [info("x", F, ["B", "S", D])], [info("y", F, ["B", "S", D])], inits, opset
    )


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"beta": False}, {"recip": True, "square": "mul"}, {"dup_sub": True}],
    ids=["div", "no_beta", "reciprocal", "duplicated_sub"],
)
def test_layer_norm_variants(kw, target: str) -> None:  # type: ignore[no-untyped-def]
    model = ln_model(**kw)
    _, out = run(model, ["fuse_layer_norm", "eliminate_dead_nodes"], target=target)
    assert [n.op_type for n in out.graph.node] == ["LayerNormalization"]
    assert len(out.graph.node[0].input) == (2 if kw.get("beta") is False else 3)
    onnx.checker.check_model(out, full_check=True)
    parity(model, out)


def test_layer_norm_fp16_casts() -> None:
    """fp16: the centered value cast up for the variance, the root cast back (ORT's
    fusion_layernorm.py form)."""
    inits = [
        tensor("two", np.array(2.0, np.float32)),
        tensor("eps", np.array(1e-5, np.float32)),
        tensor("gamma", random((D,), np.float16, seed=3)),
        tensor("beta", random((D,), np.float16, seed=4)),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]),
        helper.make_node("Sub", ["x", "m"], ["d"]),
        helper.make_node("Cast", ["d"], ["df"], to=F),
        helper.make_node("Pow", ["df", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["v"], axes=[-1]),
        helper.make_node("Add", ["v", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["s"]),
        helper.make_node("Cast", ["s"], ["sh"], to=H),
        helper.make_node("Div", ["d", "sh"], ["nrm"]),
        helper.make_node("Mul", ["nrm", "gamma"], ["g"]),
        helper.make_node("Add", ["g", "beta"], ["y"]),
    ]
    model = ort_model(nodes, [info("x", H, ["B", "S", D])], [info("y", H, ["B", "S", D])], inits)
    _, out = run(model, ["fuse_layer_norm", "eliminate_dead_nodes"])
    assert [n.op_type for n in out.graph.node] == ["LayerNormalization"]
    onnx.checker.check_model(out, full_check=True)
    parity(model, out, tol=2e-2, dtype=np.float16)


@pytest.mark.parametrize(
    "kw",
    [{"axes": (1,)}, {"gamma_size": 1}, {"eps": 5.0}, {"opset": 13}],
    ids=["axis_1", "gamma_size_1", "eps_5", "opset_13"],
)
def test_layer_norm_negative(kw) -> None:  # type: ignore[no-untyped-def]
    _, out = run(ln_model(**kw), ["fuse_layer_norm"])
    assert count(out, "LayerNormalization") == 0


def test_layer_norm_explain() -> None:
    report = fastopt.optimize(
        fastopt.from_onnx(ln_model(eps=5.0)), passes=["fuse_layer_norm"], explain="fuse_layer_norm"
    )
    assert any("epsilon outside" in line for line in report.explain), report.explain


# ---- Skip norms ----


def skip_model(
    norm: str = "ln",
    bias: str | None = None,
    skip_shape: Sequence[int | str] = ("B", "S", D),
    reader: bool = True,
) -> onnx.ModelProto:
    """x + skip [+ bias] -> LayerNormalization (or a decomposed RMSNorm); with `reader`, the sum
    is also the next residual (a second output)."""
    inits = [tensor("gamma", random((D,), seed=3)), tensor("beta", random((D,), seed=4))]
    nodes = []
    a = "x"
    if bias == "input":
        inits.append(tensor("bias", random((D,), seed=5)))
        nodes.append(helper.make_node("Add", ["bias", "x"], ["xb"]))
        a = "xb"
    nodes.append(helper.make_node("Add", [a, "skip"], ["s0" if bias == "sum" else "s"]))
    if bias == "sum":
        inits.append(tensor("bias", random((D,), seed=5)))
        nodes.append(helper.make_node("Add", ["s0", "bias"], ["s"]))
    if norm == "ln":
        nodes.append(
            helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], epsilon=1e-6)
        )
    else:
        more, more_inits = rms_nodes(x="s")
        nodes += more
        inits += more_inits
        nodes.append(helper.make_node("Mul", ["n", "gamma"], ["y"]))
    outputs = [info("y", F, ["B", "S", D])]
    if reader:
        nodes.append(helper.make_node("Add", ["s", "y"], ["z"]))
        outputs.append(info("z", F, ["B", "S", D]))
    return ort_model(
        nodes, [info("x", F, ["B", "S", D]), info("skip", F, list(skip_shape))], outputs, inits
    )


SKIP_PASSES = ["fuse_rms_norm", "fuse_skip_norm", "eliminate_dead_nodes"]


@pytest.mark.parametrize("norm", ["ln", "rms"])
@pytest.mark.parametrize("bias", [None, "input", "sum"])
@pytest.mark.parametrize("reader", [True, False])
def test_skip_norm(norm: str, bias: str | None, reader: bool) -> None:
    model = skip_model(norm, bias, reader=reader)
    _, out = run(model, SKIP_PASSES)
    op = "SkipLayerNormalization" if norm == "ln" else "SkipSimplifiedLayerNormalization"
    assert [n.op_type for n in out.graph.node] == [op] + (["Add"] * reader)
    node = out.graph.node[0]
    assert node.domain == "com.microsoft"
    # input, skip, gamma (+ beta for LayerNorm) (+ the folded bias)
    assert len(node.input) == (4 if norm == "ln" else 3) + (bias is not None)
    assert len(node.output) == (4 if reader else 1)
    if reader:
        assert out.graph.node[1].input[0] == node.output[3]
    eps = [a.f for a in node.attribute if a.name == "epsilon"]
    assert eps == [pytest.approx(1e-6, rel=1e-6)]
    parity(model, out)


@pytest.mark.parametrize("norm", ["ln", "rms"])
def test_skip_norm_broadcast_skip(norm: str) -> None:
    """A (1, S, D) skip is what the kernels broadcast; a (B, 1, D) one is not."""
    model = skip_model(norm, skip_shape=(1, "S", D))
    _, out = run(model, SKIP_PASSES)
    assert count(out, "Add") == 1 and out.graph.node[0].op_type.startswith("Skip")
    model = skip_model(norm, skip_shape=(2, 1, D))
    model.graph.input[0].CopyFrom(info("x", F, [2, 5, D]))
    _, out = run(model, SKIP_PASSES)
    assert not any(n.op_type.startswith("Skip") for n in out.graph.node)


def test_skip_norm_onnx_target_and_explain() -> None:
    _, out = run(skip_model(), SKIP_PASSES, target="onnx")
    assert not any(n.op_type.startswith("Skip") for n in out.graph.node)
    model = skip_model(skip_shape=(2, 1, D))
    model.graph.input[0].CopyFrom(info("x", F, [2, 5, D]))
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=["infer_shapes", "fuse_skip_norm"],
        explain="fuse_skip_norm",
    )
    assert any("input and skip shapes differ" in line for line in report.explain), report.explain
