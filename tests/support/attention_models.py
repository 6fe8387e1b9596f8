"""Attention models and runs that several tests use (test_add_kv_cache, test_fuse_attention)."""

from __future__ import annotations

from typing import Any

import fastopt
import numpy as np
import onnx
from onnx import TensorProto, helper

from support.fusion_util import make_model, tensor


def counters(report: fastopt.OptimizeReport, name: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in report.passes:
        if p.name == name:
            for k, v in p.counters.items():
                out[k] = out.get(k, 0) + v
    return out


B, H, S, D = 2, 2, 5, 8


def sdpa_model(
    scale_on: str = "scores",
    scale: Any = 0.35,
    axis: int = -1,
    perm: tuple[int, ...] = (0, 1, 3, 2),
    mask_neg: float = -np.inf,
    nan_zero: float = 0.0,
    scores_output: bool = False,
    opset: int = 17,
) -> onnx.ModelProto:
    """q, k, v (B,H,S,D), bool mask (B,1,S,S): softmax(scale q k^T + Where(mask, 0, mask_neg))
    with Where(IsNaN(p), 0, p), then @ v."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=list(perm))]
    inits = [
        tensor("zero", np.array(0.0, np.float32)),
        tensor("neg", np.array(mask_neg, np.float32)),
        tensor("nanzero", np.array(nan_zero, np.float32)),
    ]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, S, D]) for n in ("q", "k", "v")
    ]
    inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [B, 1, S, S]))
    if isinstance(scale, str):  # a graph input: not a constant
        inputs.append(helper.make_tensor_value_info(scale, TensorProto.FLOAT, []))
        factor = scale
    else:
        inits.append(tensor("scale", np.array(scale, np.float32)))
        factor = "scale"
    q = "q"
    if scale_on == "q":
        nodes.append(helper.make_node("Mul", ["q", factor], ["qs"]))
        q = "qs"
    nodes.append(helper.make_node("MatMul", [q, "kt"], ["mm"]))
    scores = "mm"
    if scale_on == "scores":
        nodes.append(helper.make_node("Mul", ["mm", factor], ["scaled"]))
        scores = "scaled"
    nodes += [
        helper.make_node("Where", ["mask", "zero", "neg"], ["bias"]),
        helper.make_node("Add", [scores, "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=axis),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "nanzero", "p"], ["p0"]),
        helper.make_node("MatMul", ["p0", "v"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, H, S, D])]
    if scores_output:
        outputs.append(helper.make_tensor_value_info("masked", TensorProto.FLOAT, [B, H, S, S]))
    return make_model(nodes, inputs, outputs, inits, opset=opset)


def sdpa_feeds(scale_input: str | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {n: rng.standard_normal((B, H, S, D)).astype(np.float32) for n in ("q", "k", "v")}
    mask = np.tril(np.ones((S, S), bool))[None, None].repeat(B, 0)
    mask[1, :, :, :2] = False  # left padding: query rows 0, 1 of batch 1 see no key
    out["mask"] = mask
    if scale_input:
        out[scale_input] = np.array(0.35, np.float32)
    return out


def run_sdpa(
    model: onnx.ModelProto, target: str = "ort", explain: str | None = None, **options: int
) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    passes = ["infer_shapes", "fuse_attention", "lower_attention"]
    if target == "onnx":
        passes = ["convert_version", *passes]
        options = {"opset": 23, **options}
    if target == "ort":
        options = {"attention_lowering": 0, **options}
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=passes,
        target=target,  # type: ignore[arg-type]
        options=options,
        explain=explain,
    )
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()
