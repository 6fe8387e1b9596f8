"""lower_attention on THE CACHED INTERNAL FORM (csrc/passes/attention/internal_op.h; issue 5): K/V =
Concat(past graph input, new rows) feeding a graph output `present`, a bool (B,1,S,T) mask built
from attention_mask. The lowerings hand past/present to the fused op (Attention-23 for onnx,
GroupQueryAttention / MultiHeadAttention for ort; GQA on one shared buffer with kv_cache=2).
Reference: the same graph with attention_lowering=0 (standard ops), run by ORT CPU."""

from __future__ import annotations

from dataclasses import dataclass

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

INTERNAL = "ai.fastopt.internal"
PASSES = ["lower_attention", "eliminate_dead_nodes"]
NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


@dataclass
class Case:
    hq: int = 4
    hkv: int = 2
    d: int = 16
    dtype: int = TensorProto.FLOAT
    rotary: bool = False  # com.microsoft RotaryEmbedding on q3/k3 (position_ids input)
    layers: int = 2
    # Qwen3 / Gemma3: a per-head RMS norm after the head split, then the rotary on the BNSH
    # heads (4-D) instead of on q3/k3.
    head_norm: bool = False


def build(c: Case, opset: int = 23) -> onnx.ModelProto:
    """q3/k3/v3 (B,S,H*D) -> [RotaryEmbedding] -> Reshape -> Transpose -> Concat(past, .) ->
    internal Attention(q, present_k, present_v, mask) -> Transpose -> Reshape -> y.{i}.
    head_norm: q/k -> Reshape -> RMSNormalization -> Transpose -> RotaryEmbedding."""
    f, vi = c.dtype, helper.make_tensor_value_info
    b, s, p, t = "batch", "sequence_length", "past_sequence_length", "total_sequence_length"
    inputs = [
        vi("q3", f, [b, s, c.hq * c.d]),
        vi("k3", f, [b, s, c.hkv * c.d]),
        vi("v3", f, [b, s, c.hkv * c.d]),
        vi("attention_mask", TensorProto.INT64, [b, t]),
    ]
    outputs, vinfo, nodes = [], [], []
    inits = [
        helper.make_tensor("i0", TensorProto.INT64, [], [0]),
        helper.make_tensor("i1", TensorProto.INT64, [], [1]),
        helper.make_tensor("i2", TensorProto.INT64, [], [2]),
        helper.make_tensor("ax0", TensorProto.INT64, [1], [0]),
        helper.make_tensor("ax1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("ax12", TensorProto.INT64, [2], [1, 2]),
        helper.make_tensor("merge", TensorProto.INT64, [3], [0, 0, -1]),
    ]
    q_in, k_in = "q3", "k3"
    if c.rotary:
        inputs.append(vi("position_ids", TensorProto.INT64, [b, s]))
        inv = 1.0 / (10000 ** (np.arange(0, c.d, 2) / c.d))
        ang = np.arange(64)[:, None] * inv[None, :]
        for name, x in (("cos", np.cos(ang)), ("sin", np.sin(ang))):
            inits.append(onnx.numpy_helper.from_array(x.astype(NP[f]), name))
        for x, heads in (("q3", c.hq), ("k3", c.hkv)) if not c.head_norm else ():
            nodes.append(
                helper.make_node(
                    "RotaryEmbedding",
                    [x, "position_ids", "cos", "sin"],
                    [x + "_rot"],
                    domain="com.microsoft",
                    num_heads=heads,
                )
            )
        q_in, k_in = ("q3", "k3") if c.head_norm else ("q3_rot", "k3_rot")
    if c.head_norm:
        for w, x in (("qnorm_w", 0.5), ("knorm_w", 1.5)):
            inits.append(onnx.numpy_helper.from_array(np.linspace(x, 2 * x, c.d).astype(NP[f]), w))
    # The shared mask: allowed[b,s,t] = t <= P + s and attention_mask[b,t] != 0.
    nodes += [
        helper.make_node("Shape", ["past_key_values.0.key"], ["pshape"]),
        helper.make_node("Gather", ["pshape", "i2"], ["P"], axis=0),
        helper.make_node("Shape", ["q3"], ["qshape"]),
        helper.make_node("Gather", ["qshape", "i1"], ["S"], axis=0),
        helper.make_node("Add", ["P", "S"], ["T"]),
        helper.make_node("Range", ["P", "T", "i1"], ["rows"]),
        helper.make_node("Range", ["i0", "T", "i1"], ["cols"]),
        helper.make_node("Unsqueeze", ["rows", "ax1"], ["rows2"]),
        helper.make_node("LessOrEqual", ["cols", "rows2"], ["causal"]),
        helper.make_node("Cast", ["attention_mask"], ["am_bool"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["am_bool", "ax12"], ["am4"]),
        helper.make_node("And", ["causal", "am4"], ["mask"]),
    ]
    vinfo.append(vi("mask", TensorProto.BOOL, [b, 1, s, t]))
    for name, heads in (("q", c.hq), ("k", c.hkv), ("v", c.hkv)):
        inits.append(helper.make_tensor(f"{name}_shape", TensorProto.INT64, [4], [0, 0, heads, -1]))
    for i in range(c.layers):
        for name, src, heads in (("q", q_in, c.hq), ("k", k_in, c.hkv), ("v", "v3", c.hkv)):
            bshd, bnsh = f"{name}{i}_bshd", f"{name}{i}"
            nodes.append(helper.make_node("Reshape", [src, f"{name}_shape"], [bshd]))
            if c.head_norm and name != "v":
                nodes.append(helper.make_node(
                    "RMSNormalization", [bshd, f"{name}norm_w"], [bshd + "_n"], axis=-1,
                    epsilon=1e-6))  # fmt: skip
                bshd, bnsh = bshd + "_n", f"{name}{i}_heads"
            nodes.append(helper.make_node("Transpose", [bshd], [bnsh], perm=[0, 2, 1, 3]))
            if bnsh != f"{name}{i}":
                nodes.append(helper.make_node(
                    "RotaryEmbedding", [bnsh, "position_ids", "cos", "sin"], [f"{name}{i}"],
                    domain="com.microsoft"))  # fmt: skip
            vinfo.append(vi(f"{name}{i}", f, [b, heads, s, c.d]))
        for kv in ("key", "value"):
            past, present = f"past_key_values.{i}.{kv}", f"present.{i}.{kv}"
            inputs.append(vi(past, f, [b, c.hkv, p, c.d]))
            outputs.append(vi(present, f, [b, c.hkv, t, c.d]))
            nodes.append(helper.make_node("Concat", [past, f"{kv[0]}{i}"], [present], axis=2))
        nodes.append(helper.make_node(
            "Attention", [f"q{i}", f"present.{i}.key", f"present.{i}.value", "mask"], [f"y{i}"],
            domain=INTERNAL, is_causal=0, q_num_heads=c.hq, kv_num_heads=c.hkv,
            scale=float(1 / np.sqrt(c.d))))  # fmt: skip
        vinfo.append(vi(f"y{i}", f, [b, c.hq, s, c.d]))
        nodes.append(helper.make_node("Transpose", [f"y{i}"], [f"y{i}_bshd"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Reshape", [f"y{i}_bshd", "merge"], [f"out.{i}"]))
        outputs.insert(i, vi(f"out.{i}", f, [b, s, c.hq * c.d]))
    g = helper.make_graph(nodes, "cached", inputs, outputs, inits, value_info=vinfo)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset),
                                            helper.make_opsetid(INTERNAL, 1),
                                            helper.make_opsetid("com.microsoft", 1)])  # fmt: skip
    m.ir_version = 10
    return m


def run(m: onnx.ModelProto, target: str, options: dict, explain: str | None = None):
    r = fastopt.optimize(fastopt.from_onnx(m), passes=PASSES, target=target, options=options,
                         explain=explain)  # fmt: skip
    r.model.verify()
    return r


def lower(m: onnx.ModelProto, target: str, **options: int) -> onnx.ModelProto:
    return run(m, target, options).model.to_onnx()


def ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def session(m: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds(c: Case, rng, batch: int, s: int, p: int, lens=None) -> dict:
    """A step of s new tokens after p cached ones; lens: valid tokens per row (right padding)."""
    dt = NP[c.dtype]
    t = p + s
    am = np.ones((batch, t), np.int64)
    if lens is not None:
        for r, n in enumerate(lens):
            am[r, n:] = 0
    x = {
        "q3": rng.standard_normal((batch, s, c.hq * c.d)).astype(dt),
        "k3": rng.standard_normal((batch, s, c.hkv * c.d)).astype(dt),
        "v3": rng.standard_normal((batch, s, c.hkv * c.d)).astype(dt),
        "attention_mask": am,
    }
    if c.rotary:
        x["position_ids"] = np.maximum(np.cumsum(am, 1) - 1, 0)[:, p:]
    for i in range(c.layers):
        for kv in ("key", "value"):
            x[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, c.hkv, p, c.d)).astype(dt)
    return x


STEPS = {  # batch, S, P, lens (right padding)
    "prefill": (2, 6, 0, [6, 4]),
    "decode": (2, 1, 7, [8, 5]),
    "chunked": (1, 3, 5, None),
    "chunked_b2": (2, 3, 5, [8, 6]),
}
CASES = {
    "gqa_fp32": Case(),
    "mha_fp32": Case(hkv=4),
    "gqa_fp16": Case(dtype=TensorProto.FLOAT16),
    "mha_fp16": Case(hkv=4, dtype=TensorProto.FLOAT16),
}


def compare(c: Case, got: list, want: list, names: list[str]) -> float:
    tol = 1e-4 if c.dtype == TensorProto.FLOAT else 2e-2
    worst = 0.0
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape, name
        diff = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max(initial=0))
        assert diff <= tol, f"{name}: {diff}"
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cached_form_lowers_natively(target: str, case: str) -> None:
    c = CASES[case]
    m = build(c)
    out = lower(m, target)
    names = [o.name for o in m.graph.output]
    assert [o.name for o in out.graph.output] == names
    o = ops(out)
    assert "Concat" not in o  # past/present are the fused op's
    if target == "onnx":
        assert o.count("Attention") == c.layers
        onnx.checker.check_model(out, full_check=True)
    else:
        fused = "GroupQueryAttention" if c.dtype != TensorProto.FLOAT or c.hkv < c.hq else (
            "MultiHeadAttention")  # fmt: skip
        assert o.count(fused) == c.layers, o
        onnx.checker.check_model(out)
    ref = session(lower(m, target, attention_lowering=0))
    got = session(out)
    rng = np.random.default_rng(0)
    for step, (batch, s, p, lens) in STEPS.items():
        x = feeds(c, rng, batch, s, p, lens)
        compare(c, got.run(names, x), ref.run(names, x), [f"{step}: {n}" for n in names])


def test_onnx_needs_opset_23() -> None:
    out = lower(build(Case(), opset=21), "onnx")
    assert "Attention" not in ops(out) and "MatMul" in ops(out)


def test_cuda_grouped_cache_falls_back() -> None:
    """CUDA GQA rejects the cache's attention_bias; MHA cannot hold a grouped cache."""
    r = run(build(Case()), "ort", {"cuda": 1}, explain="lower_attention")
    o = ops(r.model.to_onnx())
    assert "GroupQueryAttention" not in o and "MatMul" in o
    assert any("grouped cache" in line for line in r.explain)


def test_not_cached_when_past_is_not_an_input() -> None:
    """A Concat of two computed values is no cache: plain lowering, the Concat stays."""
    m = build(Case(hkv=4, layers=1))
    for n in [n for n in m.graph.node if n.op_type == "Concat"]:
        m.graph.node.insert(0, helper.make_node("Neg", [n.input[0]], [n.input[0] + "_neg"]))
        n.input[0] += "_neg"
    out = lower(m, "onnx")
    assert ops(out).count("Concat") == 2 and ops(out).count("Attention") == 1


# ---- in place (kv_cache=2): one max-length buffer bound as past and present -------------------


def run_bound(sess, c: Case, x: dict, bufs: dict) -> list:
    io = sess.io_binding()
    for name, a in x.items():
        if not name.startswith("past_"):
            io.bind_cpu_input(name, a)
    for i in range(c.layers):
        for kv in ("key", "value"):
            io.bind_ortvalue_input(f"past_key_values.{i}.{kv}", bufs[i, kv])
            io.bind_ortvalue_output(f"present.{i}.{kv}", bufs[i, kv])
    for i in range(c.layers):
        io.bind_output(f"out.{i}")
    sess.run_with_iobinding(io)
    return io.copy_outputs_to_cpu()[-c.layers :]


INPLACE = {
    "fp32_rotary": Case(rotary=True),
    "fp16_rotary": Case(rotary=True, dtype=TensorProto.FLOAT16),
    "fp32_mha_heads": Case(hkv=4),
    "fp32_rotary_d8": Case(rotary=True, d=8),  # head size % 16 != 0: RoPE stays outside
    # the rotary on the normed BNSH heads (4-D) folds in too: GQA reads the norm's output
    "fp32_rotary_head_norm": Case(rotary=True, head_norm=True),
    "fp32_rotary_head_norm_d8": Case(rotary=True, head_norm=True, d=8),
}


@pytest.mark.parametrize("case", INPLACE, ids=list(INPLACE))
def test_inplace_gqa_matches_standard_decoding(case: str) -> None:
    c = INPLACE[case]
    m = build(c)
    out = lower(m, "ort", kv_cache=2)
    o = ops(out)
    assert o.count("GroupQueryAttention") == c.layers and "Concat" not in o
    folded = c.rotary and c.d % 16 == 0
    rotaries = (2 * c.layers if c.head_norm else 2) if c.rotary else 0  # one per head split
    assert o.count("RotaryEmbedding") == (0 if folded else rotaries)
    assert o.count("ReduceSum") == 1  # seqlens_k once for all layers
    for v in list(out.graph.input)[4:] + list(out.graph.output)[c.layers :]:
        if v.name.startswith(("past", "present")):
            assert v.type.tensor_type.shape.dim[2].dim_param == "max_sequence_length", v.name
    gqa = next(n for n in out.graph.node if n.op_type == "GroupQueryAttention")
    assert any(a.name == "do_rotary" and a.i == 1 for a in gqa.attribute) == folded
    onnx.checker.check_model(out)

    # Reference: the standard form (standard ops) with a growing cache; same tokens.
    ref, got = session(lower(m, "ort", attention_lowering=0)), session(out)
    dt, rng, batch, max_len = NP[c.dtype], np.random.default_rng(1), 2, 16
    lens = np.array([6, 4])
    bufs = {(i, kv): ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, c.hkv, max_len, c.d), dt))
            for i in range(c.layers) for kv in ("key", "value")}  # fmt: skip
    names = [f"out.{i}" for i in range(c.layers)]
    past = {f"past_key_values.{i}.{kv}": np.zeros((batch, c.hkv, 0, c.d), dt)
            for i in range(c.layers) for kv in ("key", "value")}  # fmt: skip
    am = np.zeros((batch, 6), np.int64)
    for r, n in enumerate(lens):
        am[r, :n] = 1
    s = 6
    for step in range(4):
        x = feeds(c, rng, batch, s, am.shape[1] - s, None)
        x["attention_mask"] = am
        if c.rotary:
            x["position_ids"] = (np.cumsum(am, 1) - 1)[:, -s:].clip(0)
        want = ref.run(None, {**x, **past})
        have = run_bound(got, c, x, bufs)
        valid = [np.arange(s) < (lens[r] if step == 0 else 1) for r in range(batch)]
        for name, a, b in zip(names, have, want[: c.layers], strict=True):
            for r in range(batch):
                compare(c, [a[r][valid[r]]], [b[r][valid[r]]], [f"step {step} {name} row {r}"])
        # The shared buffer holds each row's valid tokens from 0, as the growing cache does.
        for i in range(c.layers):
            grown = want[c.layers + 2 * i]
            buf = bufs[i, "key"].numpy()
            keep = am.astype(bool)
            for r in range(batch):
                n = int(keep[r].sum())
                compare(c, [buf[r, :, :n]], [grown[r][:, keep[r]]], [f"step {step} buffer {i}"])
        past = {f"past_key_values.{i}.{kv}": want[c.layers + 2 * i + j]
                for i in range(c.layers) for j, kv in enumerate(("key", "value"))}  # fmt: skip
        am = np.concatenate([am, np.ones((batch, 1), np.int64)], 1)
        s = 1


def test_inplace_explain_without_attention_mask() -> None:
    m = build(Case())
    m.graph.input[3].name = "mask_in"
    for n in m.graph.node:
        n.input[:] = ["mask_in" if x == "attention_mask" else x for x in n.input]
    r = run(m, "ort", {"kv_cache": 2}, explain="lower_attention")
    assert "GroupQueryAttention" not in ops(r.model.to_onnx())
    assert any("no attention_mask graph input" in line for line in r.explain)
