"""fuse_norm_casts: Cast(fp16->fp32) -> LayerNormalization / SimplifiedLayerNormalization ->
Cast(fp32->fp16) becomes the norm on the fp16 value (target ort), bit-identical in ORT."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from support.cleanup_testing import model, ops, session, vi
from support.llm_fixtures import FIXTURE_DIR

PASS = "fuse_norm_casts"
D = 64


def island(
    op: str = "LayerNormalization",
    bias: bool = True,
    gamma: np.ndarray | None = None,
    in_type: int = T.FLOAT16,
    mean_output: bool = False,
) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    g = gamma if gamma is not None else rng.standard_normal(D).astype(np.float16).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float16).astype(np.float32)
    inits = [numpy_helper.from_array(g, "g")] + ([numpy_helper.from_array(b, "b")] if bias else [])
    norm_out = ["y32", "mean"] if mean_output else ["y32"]
    nodes = [
        helper.make_node("Cast", ["x"], ["x32"], to=T.FLOAT),
        helper.make_node(
            op, ["x32", "g", *(["b"] if bias else [])], norm_out, axis=-1, epsilon=1e-5
        ),
        helper.make_node("Cast", ["y32"], ["y"], to=T.FLOAT16),
    ]
    outputs = [vi("y", T.FLOAT16, ["n", D])]
    if mean_output:
        outputs.append(vi("mean", T.FLOAT, None))
    return model(nodes, [vi("x", in_type, ["n", D])], outputs, inits)


def wide_feeds() -> dict[str, np.ndarray]:
    # Rows of very different magnitudes: fp16 overflow of the variance would show.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((512, D)) * rng.uniform(0.01, 200, (512, 1))
    return {"x": x.astype(np.float16)}


@pytest.mark.parametrize(
    ("op", "bias"),
    [
        ("LayerNormalization", True),
        ("LayerNormalization", False),
        ("SimplifiedLayerNormalization", False),
    ],
)
def test_island_becomes_fp16_norm_bit_identical(op: str, bias: bool) -> None:
    src = island(op, bias)
    report = fastopt.optimize(fastopt.from_onnx(src), passes=[PASS, "eliminate_dead_nodes"])
    assert report.passes[0].rewrites == 1
    report.model.verify()
    out = report.model.to_onnx()
    assert ops(out) == [op]
    (n,) = out.graph.node
    assert n.input[0] == "x"
    assert {a.name: a.i for a in n.attribute}["stash_type"] == 1
    assert {i.name: i.data_type for i in out.graph.initializer} == dict.fromkeys(
        n.input[1:], T.FLOAT16
    )
    feeds = wide_feeds()
    want = session(src).run(None, feeds)[0]
    got = session(out).run(None, feeds)[0]
    assert got.dtype == np.float16 and np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_target_onnx_keeps_the_casts() -> None:
    # The ONNX spec applies scale and bias in fp16 after the fp32 stash: not ORT's arithmetic.
    report = fastopt.optimize(fastopt.from_onnx(island()), passes=[PASS], target="onnx")
    assert report.rewrites == 0


def test_scale_fp16_cannot_hold_stays() -> None:
    g = np.full(D, 1.0 + 2.0**-20, np.float32)
    report = fastopt.optimize(fastopt.from_onnx(island(gamma=g)), passes=[PASS])
    assert report.rewrites == 0


def test_used_mean_output_stays() -> None:
    report = fastopt.optimize(fastopt.from_onnx(island(mean_output=True)), passes=[PASS])
    assert report.rewrites == 0


def test_fp32_input_is_not_an_island() -> None:
    m = model(
        [
            helper.make_node("Cast", ["x"], ["x32"], to=T.FLOAT),
            helper.make_node("LayerNormalization", ["x32", "g"], ["y32"], axis=-1),
            helper.make_node("Cast", ["y32"], ["y"], to=T.FLOAT16),
        ],
        [vi("x", T.BFLOAT16, ["n", D])],
        [vi("y", T.FLOAT16, ["n", D])],
        [numpy_helper.from_array(np.ones(D, np.float32), "g")],
    )
    assert fastopt.optimize(fastopt.from_onnx(m), passes=[PASS]).rewrites == 0


def test_cohere_fp16_norms_fuse_with_their_residuals() -> None:
    # Cohere upcasts every LayerNorm (and its q/k rotary) to fp32: the norms fold into fp16
    # SkipLayerNormalization, and the q/k Casts move onto the 3-D projection around the rotary.
    src = FIXTURE_DIR / "cohere_dynamo_float16" / "model.onnx"
    report = fastopt.optimize(str(src), preset="llm")
    counts = {p.name: p.counters for p in report.passes}
    assert counts["fuse_norm_casts"].get("layer_norm") == 3
    out = report.model.to_onnx()
    hist: dict[str, int] = {}
    for n in out.graph.node:
        hist[n.op_type] = hist.get(n.op_type, 0) + 1
    assert hist.get("SkipLayerNormalization") == 2
    assert hist.get("Transpose", 0) == 0
