"""pack_matmuls: MatMuls sharing an input with constant weights -> one MatMul + Split, and a
Split feeding GroupQueryAttention's q/k/v -> GQA's packed-QKV input."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.fusion_util import (
    assert_close,
    info,
    make_model,
    ops,
    ort_run,
    out_info,
    random,
    tensor,
)
from support.llm_fixtures import assert_parity, fixtures, ids, op_count, optimize

F = TensorProto.FLOAT
MS = "com.microsoft"
FX = fixtures()


@pytest.mark.parametrize("fx", FX, ids=ids(FX))
def test_fixtures_pack_all(fx):
    base = fastopt.pipeline.registry.preset("classic")
    report, out = optimize(fx, passes=[*base, "pack_matmuls"], options={"pack_matmuls": 1})
    _, plain = optimize(fx, passes=base)
    n = fx.layers
    # Q/K/V (3 MatMuls) and gate/up (2) per layer pack into 2; bert, clip pack Q/K/V (biases too);
    # gpt2, gpt_neox and phi3 export packed projections already. Parallel blocks read one norm
    # for attention and MLP: gptj packs Q/K/V with fc_in (4 into 1), cohere Q/K/V with gate/up
    # (5 into 1); opt, glm and glm4 (gate_up exported packed) pack Q/K/V with their biases;
    # nemotron (no gate) and deberta_v2 (biases) pack Q/K/V; falcon packs its exported QKV
    # with the parallel MLP's up projection; modernbert exports both packed already.
    packed_per_layer = {"llama": 2, "mistral": 2, "qwen2": 2, "gemma": 2, "gemma3": 2}
    packed_per_layer |= {"gemma2": 2, "qwen3": 2}
    packed_per_layer |= {
        "bert": 1,
        "clip": 1,
        "gptj": 1,
        "cohere": 1,
        "opt": 1,
        "glm": 1,
        "glm4": 1,
        "nemotron": 1,
        "deberta_v2": 1,
        "falcon": 1,
    }
    removed_per_layer = {"llama": 3, "mistral": 3, "qwen2": 3, "gemma": 3, "gemma3": 3}
    removed_per_layer |= {"gemma2": 3, "qwen3": 3}
    removed_per_layer |= {
        "bert": 2,
        "clip": 2,
        "gptj": 3,
        "cohere": 4,
        "opt": 2,
        "glm": 2,
        "glm4": 2,
        "nemotron": 2,
        "deberta_v2": 2,
        "falcon": 1,
    }
    # MoE decoders pack Q/K/V (the experts' weights are gathered per token, not packable);
    # qwen2_moe TorchScript also packs the four MatMuls reading the MLP's norm (router, shared
    # expert's gate, up and sigmoid gate; dynamo writes those as Gemm on flattened tokens).
    packed_per_layer |= {"mixtral": 1, "olmoe": 1, "qwen2_moe": 1}
    removed_per_layer |= {"mixtral": 2, "olmoe": 2, "qwen2_moe": 2}
    if fx.arch == "qwen2_moe" and fx.exporter == "ts":
        packed_per_layer["qwen2_moe"], removed_per_layer["qwen2_moe"] = 2, 5
    packed = packed_per_layer.get(fx.arch, 0) * n
    removed = removed_per_layer.get(fx.arch, 0) * n
    assert op_count(out, "MatMul") == op_count(plain, "MatMul") - removed
    assert op_count(out, "Split") == op_count(plain, "Split") + packed
    assert report.passes[-1].rewrites == packed
    if fx.arch in ("qwen2", "bert", "deberta_v2", "qwen2_moe"):  # q/k/v biases packed too
        assert report.passes[-1].counters.get("packed_matmuls_with_bias") == n
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", FX[:4], ids=ids(FX[:4]))
def test_fixtures_default_mode_waits_for_gqa(fx):
    base = fastopt.pipeline.registry.preset("classic")
    report, _out = optimize(fx, passes=[*base, "pack_matmuls"])
    assert report.passes[-1].rewrites == 0


SEPARATE_QKV = fixtures(["llama", "qwen2", "mistral"], dtype="float32")


@pytest.mark.parametrize("fx", SEPARATE_QKV, ids=ids(SEPARATE_QKV))
def test_llm_preset_packs_qkv_into_gqa(fx):
    # In the preset, the attention subgraph the lowering replaced still reads Q/K/V until dead
    # nodes are removed; packing must see GroupQueryAttention as their only reader.
    report, out = optimize(fx, preset="llm", kv_cache="inplace")
    gqas = [n for n in out.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqas) == fx.layers
    assert all(list(n.input[1:3]) == ["", ""] for n in gqas)  # packed QKV, no Split
    assert op_count(out, "Split") == 0
    pack = [p for p in report.passes if p.name == "pack_matmuls"]
    assert pack[-1].counters.get("matmuls_packed") == 3 * fx.layers


# ---- GroupQueryAttention (hand-built; ORT CPU runs GQA fp32) ----

H, HKV, D, HID, S = 4, 2, 8, 32, 5


def gqa_model(split_sizes=None, num_heads=H, bias=False):
    N = helper.make_node
    inits = [
        tensor("Wq", random((HID, H * D), seed=1)),
        tensor("Wk", random((HID, HKV * D), seed=2)),
        tensor("Wv", random((HID, HKV * D), seed=3)),
    ]
    nodes = [N("MatMul", ["x", w], [o]) for w, o in (("Wq", "q"), ("Wk", "k"), ("Wv", "v"))]
    if bias:
        for name, n in (("q", H * D), ("k", HKV * D), ("v", HKV * D)):
            inits.append(tensor("b" + name, random((n,), seed=n)))
            nodes.append(N("Add", [name, "b" + name], [name + "b"]))
        qkv = ["qb", "kb", "vb"]
    else:
        qkv = ["q", "k", "v"]
    if split_sizes is not None:  # a Split of one packed tensor feeds GQA
        inits.append(tensor("Wqkv", random((HID, sum(split_sizes)), seed=4)))
        inits.append(tensor("sizes", np.array(split_sizes, np.int64)))
        nodes = [
            N("MatMul", ["x", "Wqkv"], ["qkv"]),
            N("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1),
        ]
        qkv = ["q", "k", "v"]
    nodes.append(
        N(
            "GroupQueryAttention",
            [*qkv, "", "", "seqlens_k", "total_len"],
            ["y", "present_key", "present_value"],
            domain=MS,
            num_heads=num_heads,
            kv_num_heads=HKV,
        )
    )
    return make_model(
        nodes,
        [
            info("x", F, [1, S, HID]),
            info("seqlens_k", TensorProto.INT32, [1]),
            info("total_len", TensorProto.INT32, []),
        ],
        [out_info("y", F, 3), out_info("present_key", F, 4), out_info("present_value", F, 4)],
        inits,
        extra_opsets=[helper.make_opsetid(MS, 1)],
    )


FEEDS = {
    "x": random((1, S, HID), seed=9),
    "seqlens_k": np.array([S - 1], np.int32),
    "total_len": np.array(S, np.int32),
}


def run_pack(model, **options):
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=["pack_matmuls"], options=options or None
    )
    assert report.model is not None
    report.model.verify()
    out = report.model.to_onnx()
    onnx.checker.check_model(out)
    return report, out


def gqa_inputs(out):
    (gqa,) = [n for n in out.graph.node if n.op_type == "GroupQueryAttention"]
    return list(gqa.input)


@pytest.mark.parametrize("bias", [False, True])
def test_gqa_separate_projections_pack(bias):
    model = gqa_model(bias=bias)
    report, out = run_pack(model)
    assert report.passes[0].counters["gqa_packed_qkv"] == 1
    expected = (
        ["MatMul", "Add", "GroupQueryAttention"] if bias else ["MatMul", "GroupQueryAttention"]
    )
    assert ops(out) == expected
    inputs = gqa_inputs(out)
    assert inputs[1:3] == ["", ""]
    assert_close(ort_run(model, FEEDS), ort_run(out, FEEDS), 1e-5)


def test_gqa_existing_split_unsplit():
    model = gqa_model(split_sizes=[H * D, HKV * D, HKV * D])
    _report, out = run_pack(model)
    assert ops(out) == ["MatMul", "GroupQueryAttention"]
    assert gqa_inputs(out)[:3] == ["qkv", "", ""]
    assert_close(ort_run(model, FEEDS), ort_run(out, FEEDS), 1e-5)


def test_gqa_wrong_sizes_stay():
    # Sizes that do not fit (H*D, Hkv*D, Hkv*D) for num_heads=2 (D would be 16 for q, 8 for k).
    model = gqa_model(split_sizes=[H * D, HKV * D, HKV * D], num_heads=2)
    report, out = run_pack(model)
    assert "Split" in ops(out) and report.passes[0].rewrites == 0


def shared_input_model(k2=HID, dtype2=np.float32, extra=False):
    N = helper.make_node
    inits = [tensor("W1", random((HID, 16), seed=1)), tensor("W2", random((k2, 8), dtype2, seed=2))]
    nodes = [N("MatMul", ["x", "W1"], ["y1"])]
    inputs = [info("x", F, [2, 3, HID])]
    if k2 == HID and dtype2 == np.float32:
        nodes.append(N("MatMul", ["x", "W2"], ["y2"]))
    else:  # a different K or dtype reads another input
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype2))
        inputs.append(info("x2", elem, [2, 3, k2]))
        nodes.append(N("MatMul", ["x2", "W2"], ["y2"]))
    if extra:  # a MatMul whose weight is a graph input is not packed
        inputs.append(info("Wdyn", F, [HID, 4]))
        nodes.append(N("MatMul", ["x", "Wdyn"], ["y3"]))
    outs = [
        out_info("y1", F, 3),
        out_info("y2", helper.np_dtype_to_tensor_dtype(np.dtype(dtype2)), 3),
    ]
    if extra:
        outs.append(out_info("y3", F, 3))
    return make_model(nodes, inputs, outs, inits)


def test_pack_all_option_and_outputs_keep_names():
    model = shared_input_model(extra=True)
    feeds = {"x": random((2, 3, HID), seed=5), "Wdyn": random((HID, 4), seed=6)}
    report, out = run_pack(model, pack_matmuls=1)
    assert report.passes[0].rewrites == 1
    assert ops(out) == ["MatMul", "Split", "MatMul"]
    assert [o.name for o in out.graph.output] == ["y1", "y2", "y3"]
    assert_close(ort_run(model, feeds), ort_run(out, feeds), 1e-5)
    report, out = run_pack(model, pack_matmuls=-1)
    assert report.passes[0].rewrites == 0


@pytest.mark.parametrize("kw", [{"k2": 16}, {"dtype2": np.float16}])
def test_different_k_or_dtype_not_packed(kw):
    report, _out = run_pack(shared_input_model(**kw), pack_matmuls=1)
    assert report.passes[0].rewrites == 0


def test_opset_12_not_packed():
    model = shared_input_model()
    model.opset_import[0].version = 12
    report, _out = run_pack(model, pack_matmuls=1)
    assert report.passes[0].rewrites == 0
