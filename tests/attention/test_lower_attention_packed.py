"""lower_attention for target ort, packed QKV: self-attention whose Q, K, V are projections of
one 3-D input by constant weights becomes com.microsoft Attention with one packed weight and
bias (option packed_attention: 0 off, 1 non-causal (default), 2 causal too). Anything else keeps
MultiHeadAttention / GroupQueryAttention."""

from __future__ import annotations

import fastopt
import fastopt.pipeline.registry
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.fusion_util import ort_run
from support.llm_fixtures import Fixture, assert_parity, fixtures, ids, op_count, optimize

INTERNAL = "ai.fastopt.internal"
MS = "com.microsoft"
PASSES = ["infer_shapes", "lower_attention", "fold_transposes", "fold_reshapes", "eliminate_noop",
          "eliminate_dead_nodes"]  # fmt: skip
BERT = fixtures(arch="bert")


def config_heads(fx: Fixture) -> tuple[int, int]:
    cfg = fx.meta["config"]
    return int(cfg["hidden_size"]), int(cfg["num_attention_heads"])


# fp16 dynamo bert masks with finfo(fp16).min: its rows with no visible key average V, which
# fp16 kernels only reproduce by a mean read from V (masked_rows.h), so it is not packed.
UNPACKED = [fx for fx in BERT if fx.exporter == "dynamo" and fx.dtype == "float16"]
PACKED = [fx for fx in BERT if fx not in UNPACKED]


@pytest.mark.parametrize("fx", PACKED, ids=ids(PACKED))
def test_bert_packed(fx: Fixture) -> None:
    _, out = optimize(fx, preset="llm", target="ort")
    assert op_count(out, "Attention", MS) == fx.layers
    assert op_count(out, "MultiHeadAttention") == 0 and op_count(out, "GroupQueryAttention") == 0
    assert op_count(out, "Softmax") == 0
    # Per layer: the output projection and the MLP's two; Q/K/V are inside Attention.
    assert op_count(out, "MatMul") == 3 * fx.layers
    hidden, heads = config_heads(fx)
    inits = {i.name: i for i in out.graph.initializer}
    for n in out.graph.node:
        if n.op_type == "Attention":
            assert list(inits[n.input[1]].dims) == [hidden, 3 * hidden]
            assert list(inits[n.input[2]].dims) == [3 * hidden]
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["num_heads"] == heads and "unidirectional" not in attrs
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", UNPACKED, ids=ids(UNPACKED))
def test_bert_fp16_finfo_mask_not_packed(fx: Fixture) -> None:
    report, out = optimize(fx, preset="llm", target="ort", explain="lower_attention")
    assert op_count(out, "Attention", MS) == 0
    assert op_count(out, "GroupQueryAttention", MS) == fx.layers
    assert any(
        "not packed into Attention: rows whose every key is masked" in line
        for line in report.explain
    ), report.explain
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", BERT, ids=ids(BERT))
def test_bert_packed_off(fx: Fixture) -> None:
    _, out = optimize(fx, preset="llm", target="ort", options={"packed_attention": 0})
    assert op_count(out, "Attention", MS) == 0
    expect = "GroupQueryAttention" if fx.dtype == "float16" else "MultiHeadAttention"
    assert op_count(out, expect, MS) == fx.layers


def test_decoders_not_packed() -> None:
    """Causal self-attention keeps MHA/GQA by default."""
    fx = fixtures(arch="gpt2", exporter="dynamo", dtype="float32")[0]
    _, out = optimize(fx, preset="llm", target="ort")
    assert op_count(out, "Attention", MS) == 0
    assert op_count(out, "MultiHeadAttention", MS) == fx.layers


# ---- hand-built graphs: x (B,S,32) -> projections -> head split -> internal Attention ----

D, HEADS = 8, 4


def encoder(
    variant: str = "ok", causal: int = 0, mask: bool = True, domain: str = INTERNAL
) -> onnx.ModelProto:
    """q = x Wq + bq, k = x Wk (no bias), v = bv + x Wv; heads split by Reshape(0, 0, H, D) +
    Transpose; a bool key mask (B, 1, 1, T). Variants: "cross" (K/V from y), "weight_input" (Wk
    a graph input), "gqa" (2 kv heads), "extra_use" (Q's projection also a graph output),
    "bias_2d" (bq of shape [1, 32])."""
    f, rng = TensorProto.FLOAT, np.random.default_rng(0)
    hkv = 2 if variant == "gqa" else HEADS
    kv_width = hkv * D
    inputs = [helper.make_tensor_value_info("x", f, ["B", "S", 32])]
    outputs = [helper.make_tensor_value_info("out", f, ["B", "S", HEADS * D])]
    inits = [
        numpy_helper.from_array((rng.standard_normal((32, w)) / 4).astype(np.float32), n)
        for n, w in (("wq", 32), ("wk", kv_width), ("wv", kv_width))
    ]
    bq = rng.standard_normal((1, 32) if variant == "bias_2d" else (32,)).astype(np.float32)
    inits.append(numpy_helper.from_array(bq, "bq"))
    inits.append(numpy_helper.from_array(rng.standard_normal(kv_width).astype(np.float32), "bv"))
    if variant == "weight_input":
        inits = [i for i in inits if i.name != "wk"]
        inputs.append(helper.make_tensor_value_info("wk", f, [32, kv_width]))
    kv_src = "x"
    if variant == "cross":
        inputs.append(helper.make_tensor_value_info("y", f, ["B", "S", 32]))
        kv_src = "y"
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["qm"]),
        helper.make_node("Add", ["qm", "bq"], ["q3"]),
        helper.make_node("MatMul", [kv_src, "wk"], ["k3"]),
        helper.make_node("MatMul", [kv_src, "wv"], ["vm"]),
        helper.make_node("Add", ["bv", "vm"], ["v3"]),
    ]
    if variant == "extra_use":
        outputs.append(helper.make_tensor_value_info("q3", f, ["B", "S", 32]))
    for name, heads in (("q", HEADS), ("k", hkv), ("v", hkv)):
        inits.append(helper.make_tensor(f"{name}_shape", TensorProto.INT64, [4], [0, 0, heads, D]))
        nodes.append(helper.make_node("Reshape", [f"{name}3", f"{name}_shape"], [f"{name}r"]))
        nodes.append(helper.make_node("Transpose", [f"{name}r"], [name], perm=[0, 2, 1, 3]))
    att_in = ["q", "k", "v"]
    if mask:
        rows = 1 if domain else "S"  # Attention-23 (the reference) in ORT takes (B, 1, S, T)
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, ["B", 1, rows, "S"]))
        att_in.append("mask")
    attrs: dict = {"is_causal": causal}
    if domain == INTERNAL:
        attrs.update(q_num_heads=HEADS, kv_num_heads=hkv, scale=0.3)
    else:
        attrs["scale"] = 0.3
    nodes.append(helper.make_node("Attention", att_in, ["y4"], domain=domain, **attrs))
    nodes.append(helper.make_node("Transpose", ["y4"], ["yt"], perm=[0, 2, 1, 3]))
    inits.append(helper.make_tensor("y_shape", TensorProto.INT64, [3], [0, 0, -1]))
    nodes.append(helper.make_node("Reshape", ["yt", "y_shape"], ["out"]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 23 if domain == "" else 18)]
    if domain == INTERNAL:
        opsets.append(helper.make_opsetid(INTERNAL, 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def lower(model: onnx.ModelProto, **kwargs) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:  # type: ignore[no-untyped-def]
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=PASSES, target="ort", explain="lower_attention", **kwargs
    )
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()


def encoder_feeds(b: int = 2, s: int = 6) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    keys = np.ones((b, s), bool)
    keys[-1, s - 2 :] = False  # right padding on the last row
    return {
        "x": rng.standard_normal((b, s, 32)).astype(np.float32),
        "mask": keys[:, None, None, :],
    }


@pytest.mark.parametrize(("causal", "mask"), [(0, True), (0, False), (1, True)])
def test_packed_parity(causal: int, mask: bool) -> None:
    options = {"packed_attention": 2} if causal else {}
    _, out = lower(encoder(causal=causal, mask=mask), options=options)
    got = [n.op_type for n in out.graph.node]
    assert got.count("Attention") == 1 and "MatMul" not in got and "Softmax" not in got, got
    (att,) = [n for n in out.graph.node if n.op_type == "Attention"]
    attrs = {a.name: helper.get_attribute_value(a) for a in att.attribute}
    assert attrs.get("unidirectional", 0) == causal
    assert list(att.input[:1]) == ["x"]
    bias = next(i for i in out.graph.initializer if i.name == att.input[2])
    # K had no bias: zeros in the middle third.
    assert not numpy_helper.to_array(bias)[32:64].any()
    onnx.checker.check_model(out)
    x = encoder_feeds()
    if not mask:
        x.pop("mask")
    ref_x = dict(x)
    if mask:
        ref_x["mask"] = np.broadcast_to(x["mask"], (2, 1, 6, 6)).copy()
    (ref,) = ort_run(encoder(causal=causal, mask=mask, domain=""), ref_x)
    (y,) = ort_run(out, x)
    valid = x["mask"][:, 0, 0, :] if mask else np.ones(y.shape[:2], bool)
    assert np.abs(y - ref)[valid].max() <= 1e-5


def test_causal_not_packed_by_default() -> None:
    _, out = lower(encoder(causal=1))
    got = [n.op_type for n in out.graph.node]
    assert "MultiHeadAttention" in got and "Attention" not in got, got


@pytest.mark.parametrize(
    ("variant", "why"),
    [
        ("cross", "different inputs"),
        ("weight_input", "not a constant 2-D tensor"),
        ("extra_use", "readers besides the attention"),
        ("bias_2d", "bias is not 1-D"),
    ],
)
def test_not_packed(variant: str, why: str) -> None:
    report, out = lower(encoder(variant))
    got = [n.op_type for n in out.graph.node]
    assert "Attention" not in got and "MultiHeadAttention" in got, got
    assert any("not packed" in line and why in line for line in report.explain), report.explain


def test_gqa_not_packed() -> None:
    """Hkv < Hq: com.microsoft Attention has one head count; GroupQueryAttention stays."""
    _, out = lower(encoder("gqa"))
    got = [n.op_type for n in out.graph.node]
    assert "Attention" not in got and "GroupQueryAttention" in got, got


def test_option_off() -> None:
    _, out = lower(encoder(), options={"packed_attention": 0})
    got = [n.op_type for n in out.graph.node]
    assert "Attention" not in got and "MultiHeadAttention" in got, got
