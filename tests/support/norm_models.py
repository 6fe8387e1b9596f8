"""Models and runs that more than one test file uses (from test_fuse_norms)."""

from __future__ import annotations

from collections.abc import Sequence

import fastopt
import numpy as np
import onnx
from onnx import TensorProto, helper

from support.fusion_util import info, make_model, random, tensor

F, H = TensorProto.FLOAT, TensorProto.FLOAT16


D = 8


def ort_model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    return make_model(nodes, inputs, outputs, inits, opset)


def run(model: onnx.ModelProto, passes: Sequence[str], target: str = "ort", **kw):  # type: ignore[no-untyped-def]
    """Runs infer_shapes (as the default preset does: the passes read dtypes and dims) and
    `passes`."""
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=["infer_shapes", *passes], target=target, **kw
    )
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()


def rms_nodes(
    x: str = "x",
    square: str = "pow",
    recip: str = "div",
    axes: Sequence[int] = (-1,),
    keepdims: int = 1,
    axes_input: bool = False,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """x -> ... -> n = x / sqrt(mean(x^2) + eps) (no weight)."""
    inits = [
        tensor("two", np.array(2.0, np.float32)),
        tensor("eps", np.array(1e-6, np.float32)),
        tensor("one", np.array(1.0, np.float32)),
    ]
    nodes = []
    if square == "pow":
        nodes.append(helper.make_node("Pow", [x, "two"], ["sq"]))
    else:
        nodes.append(helper.make_node("Mul", [x, x], ["sq"]))
    if axes_input:
        inits.append(tensor("axes", np.array(list(axes), np.int64)))
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=keepdims))
    else:
        nodes.append(
            helper.make_node("ReduceMean", ["sq"], ["ms"], axes=list(axes), keepdims=keepdims)
        )
    nodes += [
        helper.make_node("Add", ["ms", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["rms"]),
    ]
    if recip == "direct":  # x / sqrt(...), as hand-written norms do
        nodes.append(helper.make_node("Div", [x, "rms"], ["n"]))
        return nodes, inits
    if recip == "div":
        nodes.append(helper.make_node("Div", ["one", "rms"], ["inv"]))
    else:
        nodes.append(helper.make_node("Reciprocal", ["rms"], ["inv"]))
    nodes.append(helper.make_node("Mul", [x, "inv"], ["n"]))
    return nodes, inits


def rms_model(weight: bool = True, opset: int = 17, **kw) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    nodes, inits = rms_nodes(**kw)
    if weight:
        inits.append(tensor("w", random((D,), seed=3)))
        nodes.append(helper.make_node("Mul", ["n", "w"], ["y"]))
    else:
        nodes[-1].output[0] = "y"
    return ort_model(
        nodes, [info("x", F, ["B", "S", D])], [info("y", F, ["B", "S", D])], inits, opset
    )
