"""lower_attention for target ort: the internal Attention op
(csrc/passes/attention/internal_op.h) becomes com.microsoft MultiHeadAttention or
GroupQueryAttention. Test graphs hold the internal op
directly; the reference is the same graph with ONNX Attention-23 (the internal op's semantics),
run by ORT CPU. Rows of pad queries (every key masked) are don't-care and not compared."""

from __future__ import annotations

from dataclasses import dataclass

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.fusion_util import ort_run
from support.llm_fixtures import (
    ALIBI_ARCHS,
    Fixture,
    assert_parity,
    fixtures,
    ids,
    op_count,
    router_softmaxes,
)

INTERNAL = "ai.fastopt.internal"
PASSES = ["lower_attention", "fold_transposes", "fold_reshapes", "eliminate_noop",
          "eliminate_dead_nodes"]  # fmt: skip
# gemma2 attends eagerly (soft-capped scores, no Where(IsNaN)), which the stand-in below does not
# know; tests/attention/test_softcap.py lowers it through stage 1. Nor ALiBi's (test_alibi.py).
# falcon: V
# is sliced from the packed QKV before its head split; the stand-in walks back through every
# Reshape and would pass the 3-D packed value (fuse_attention handles falcon).
# deberta_v2: flat heads with position terms (test_family_fixes.py).
EAGER = {"gemma2", "falcon", "deberta_v2", *ALIBI_ARCHS}
DYNAMO = [fx for fx in fixtures(exporter="dynamo", fused_attention=True) if fx.arch not in EAGER]
NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


@dataclass
class Case:
    hq: int = 4
    hkv: int = 4
    s: int = 7
    d: int = 8
    b: int = 2
    dtype: int = TensorProto.FLOAT
    causal: int = 1
    scale: float | None = None  # None: 1/sqrt(d)
    mask: str | None = None  # None, "bool", "float", "bool_key" (B,1,1,T), "float_inf"
    padding: str | None = None  # "right", "left" (with a mask)
    kv_len: int | None = None  # T != S (cross attention); default S
    shapes: bool = True  # value_info for Q/K/V (what infer_shapes gives)
    named: bool = True  # the inputs' S / T dims named (False: unnamed, nothing equates them)
    softmax_precision: int | None = None

    @property
    def t(self) -> int:
        return self.kv_len or self.s


def build(c: Case, domain: str = INTERNAL) -> onnx.ModelProto:
    """q3/k3/v3 (B,S,H*D) -> Reshape -> Transpose -> Attention -> Transpose -> Reshape -> y."""
    f = c.dtype
    sdim: str | int | None = 1 if c.s == 1 else "S" if c.named else None  # 1: one query row
    tdim = ("T" if c.named else None) if c.kv_len else sdim
    nodes, inits = [], []
    inputs = [
        helper.make_tensor_value_info("q3", f, ["B", sdim, c.hq * c.d]),
        helper.make_tensor_value_info("k3", f, ["B", tdim, c.hkv * c.d]),
        helper.make_tensor_value_info("v3", f, ["B", tdim, c.hkv * c.d]),
    ]
    vinfo = []
    for name, heads, dim in (("q", c.hq, sdim), ("k", c.hkv, tdim), ("v", c.hkv, tdim)):
        inits.append(helper.make_tensor(f"{name}_shape", TensorProto.INT64, [4], [0, 0, heads, -1]))
        nodes.append(helper.make_node("Reshape", [f"{name}3", f"{name}_shape"], [f"{name}_bshd"]))
        nodes.append(helper.make_node("Transpose", [f"{name}_bshd"], [name], perm=[0, 2, 1, 3]))
        if c.shapes:
            vinfo.append(helper.make_tensor_value_info(name, f, ["B", heads, dim, c.d]))
    att_inputs = ["q", "k", "v"]
    if c.mask:
        if c.mask == "bool_key":  # (the reference gets it expanded: see reference_feeds)
            mt, shape = TensorProto.BOOL, ["B", 1, 1 if domain else sdim, tdim]
        elif c.mask == "bool":
            mt, shape = TensorProto.BOOL, ["B", 1, sdim, tdim]
        else:
            mt, shape = f, ["B", 1, sdim, tdim]
        inputs.append(helper.make_tensor_value_info("mask", mt, shape))
        att_inputs.append("mask")
    attrs = {"is_causal": c.causal}
    if domain == INTERNAL:
        attrs.update(q_num_heads=c.hq, kv_num_heads=c.hkv, scale=c.scale or 1 / np.sqrt(c.d))
    elif c.scale is not None:
        attrs["scale"] = c.scale
    if c.softmax_precision is not None:
        attrs["softmax_precision"] = c.softmax_precision
    nodes.append(helper.make_node("Attention", att_inputs, ["y4"], domain=domain, **attrs))
    nodes.append(helper.make_node("Transpose", ["y4"], ["y_bshd"], perm=[0, 2, 1, 3]))
    inits.append(helper.make_tensor("y_shape", TensorProto.INT64, [3], [0, 0, -1]))
    nodes.append(helper.make_node("Reshape", ["y_bshd", "y_shape"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info("y", f, ["B", sdim, c.hq * c.d])],
        inits,
        value_info=vinfo,
    )
    opsets = [helper.make_opsetid("", 23 if domain == "" else 18)]
    if domain == INTERNAL:
        opsets.append(helper.make_opsetid(INTERNAL, 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def feeds(c: Case, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Inputs, and which query rows are valid (B, S)."""
    rng = np.random.default_rng(seed)
    dt = NP[c.dtype]
    out = {
        "q3": rng.standard_normal((c.b, c.s, c.hq * c.d)).astype(dt),
        "k3": rng.standard_normal((c.b, c.t, c.hkv * c.d)).astype(dt),
        "v3": rng.standard_normal((c.b, c.t, c.hkv * c.d)).astype(dt),
    }
    valid = np.ones((c.b, c.s), bool)
    if c.mask:
        keys = np.ones((c.b, c.t), bool)
        short = max(1, c.t // 3)
        if c.padding == "right":
            keys[-1, c.t - short :] = False
        elif c.padding == "left":
            keys[-1, :short] = False
        allowed = np.broadcast_to(keys[:, None, None, :], (c.b, 1, c.s, c.t)).copy()
        if c.causal:  # which rows end up with no key at all (pad queries)
            allowed &= np.tril(np.ones((c.s, c.t), bool), c.t - c.s)
        valid = allowed.any(-1)[:, 0]
        if c.mask == "bool_key":
            out["mask"] = keys[:, None, None, :]
        elif c.mask == "bool":
            out["mask"] = np.broadcast_to(keys[:, None, None, :], (c.b, 1, c.s, c.t)).copy()
        else:
            low = -np.inf if c.mask == "float_inf" else np.finfo(dt).min
            m = np.where(keys[:, None, None, :], 0, low).astype(dt)
            out["mask"] = np.broadcast_to(m, (c.b, 1, c.s, c.t)).copy()
    return out, valid


def reference(c: Case, x: dict[str, np.ndarray]) -> np.ndarray:
    """internal_op.h in numpy (fp64): causal bottom-right, bool or additive mask."""

    def split(a: np.ndarray, heads: int) -> np.ndarray:
        return a.astype(np.float64).reshape(c.b, -1, heads, c.d).transpose(0, 2, 1, 3)

    q, k, v = split(x["q3"], c.hq), split(x["k3"], c.hkv), split(x["v3"], c.hkv)
    k, v = np.repeat(k, c.hq // c.hkv, 1), np.repeat(v, c.hq // c.hkv, 1)
    scores = (c.scale or 1 / np.sqrt(c.d)) * q @ k.transpose(0, 1, 3, 2)
    if c.causal:
        visible = np.tril(np.ones((c.s, c.t), bool), c.t - c.s)
        scores = np.where(visible, scores, -np.inf)
    if "mask" in x:
        m = x["mask"]
        scores = np.where(m, scores, -np.inf) if m.dtype == bool else scores + m
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    y = (p / p.sum(-1, keepdims=True)) @ v
    return y.transpose(0, 2, 1, 3).reshape(c.b, c.s, -1)


def reference_feeds(c: Case, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ORT's Attention-23 does not broadcast the mask over S: give it the full mask."""
    if c.mask != "bool_key":
        return x
    return {**x, "mask": np.broadcast_to(x["mask"], (c.b, 1, c.s, c.t)).copy()}


def lower(model: onnx.ModelProto, **kwargs) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:  # type: ignore[no-untyped-def]
    report = fastopt.optimize(fastopt.from_onnx(model), passes=PASSES, target="ort", **kwargs)
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def check(c: Case, expect_op: str, transposes: int = 0, **kwargs) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    _, out = lower(build(c), **kwargs)
    got = ops(out)
    assert got.count(expect_op) == 1, got
    assert "Attention" not in got
    # The head splits and the merge of Y are gone: the op reads and writes 3-D tensors.
    assert got.count("Transpose") == transposes, got
    onnx.checker.check_model(out)
    x, valid = feeds(c)
    if c.kv_len is None:
        (ref,) = ort_run(build(c, domain=""), reference_feeds(c, x))
    else:  # ORT's Attention-23 aligns causal top-left when T != S (no past)
        ref = reference(c, x)
    (y,) = ort_run(out, x)
    assert not np.isnan(y).any()
    tol = 1e-4 if c.dtype == TensorProto.FLOAT else 2e-2
    diff = np.abs(y.astype(np.float64) - ref.astype(np.float64))[valid]
    assert diff.max() <= tol, diff.max()
    return out


MHA, GQA = "MultiHeadAttention", "GroupQueryAttention"
F16 = TensorProto.FLOAT16

CASES = {
    # fp32, Hkv == Hq: MultiHeadAttention
    "mha_causal": (Case(), MHA),
    "mha_causal_right": (Case(mask="bool", padding="right"), MHA),
    "mha_causal_left": (Case(mask="bool", padding="left"), MHA),
    "mha_causal_left_additive": (Case(mask="float", padding="left"), MHA),
    "mha_causal_left_inf": (Case(mask="float_inf", padding="left"), MHA),
    "mha_key_mask": (Case(mask="bool_key", padding="left"), MHA),
    "mha_encoder": (Case(causal=0, mask="bool", padding="right"), MHA),
    "mha_encoder_additive": (Case(causal=0, mask="float", padding="left"), MHA),
    "mha_cross": (Case(causal=0, kv_len=5), MHA),
    "mha_scale": (Case(scale=0.05, mask="bool", padding="right"), MHA),
    "mha_s1": (Case(s=1), MHA),
    "mha_no_shapes_encoder": (Case(causal=0, shapes=False, mask="bool"), MHA),
    # no value_info: S == T from the inputs' shared dim name "S" (the shape analysis)
    "mha_causal_no_shapes": (Case(shapes=False), MHA),
    # fp32, Hkv < Hq: GroupQueryAttention (CPU)
    "gqa_causal": (Case(hkv=2), GQA),
    "gqa_causal_right": (Case(hkv=2, mask="bool", padding="right"), GQA),
    "gqa_causal_left": (Case(hkv=2, mask="bool", padding="left"), GQA),
    "gqa_causal_left_additive": (Case(hkv=1, mask="float", padding="left"), GQA),
    "gqa_key_mask": (Case(hkv=2, mask="bool_key", padding="right"), GQA),
    "gqa_scale": (Case(hkv=2, scale=0.5), GQA),
    "gqa_s1": (Case(hkv=2, s=1, mask="bool"), GQA),
    "gqa_encoder": (Case(hkv=2, causal=0, mask="bool", padding="left"), GQA),
    # one query row over 5 keys (a decode step): causal sees every key, MHA without mask
    "mha_one_row_causal": (Case(s=1, kv_len=5, mask="bool_key", padding="left"), MHA),
    # fp16: GroupQueryAttention for any heads
    "fp16_mha_heads": (Case(dtype=F16, mask="bool", padding="right"), GQA),
    "fp16_gqa_left": (Case(dtype=F16, hkv=2, mask="float", padding="left"), GQA),
    "fp16_gqa_left_inf": (Case(dtype=F16, hkv=2, mask="float_inf", padding="left"), GQA),
    "fp16_softmax_fp32": (
        Case(dtype=F16, hkv=2, mask="bool", padding="right", softmax_precision=1),
        GQA,
    ),
    "fp16_encoder": (Case(dtype=F16, causal=0, mask="bool", padding="left"), GQA),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lowering(name: str) -> None:
    c, op = CASES[name]
    check(c, op)


def test_cuda_option() -> None:
    """options cuda=1: no fp32 GQA and no GQA attention_bias on CUDA, so GQA only for
    fp16 causal attention without a mask; MHA (over repeated kv heads) for the rest."""
    cuda = {"cuda": 1}
    # K and V stay BNSH (their Transposes) for the head repeat.
    check(Case(hkv=2, mask="bool", padding="left"), MHA, 2, options=cuda)
    check(Case(hkv=2, dtype=F16), GQA, options=cuda)
    check(Case(hkv=2, dtype=F16, mask="bool", padding="right"), MHA, 2, options=cuda)
    check(Case(dtype=F16, causal=0, mask="bool", padding="left"), MHA, options=cuda)


def test_gqa_does_not_fit() -> None:
    """GQA kernels need head_size % 8 == 0 and T == S: MHA (over repeated kv heads when Hkv <
    Hq) takes fp32 and fp16 alike, e.g. an fp16 encoder-decoder's cross-attention."""
    check(Case(hkv=2, d=6, mask="bool", padding="left"), MHA, 2)
    check(Case(hkv=2, causal=0, kv_len=5, mask="bool", padding="right"), MHA, 2)
    check(Case(dtype=F16, causal=0, kv_len=5, mask="bool", padding="right"), MHA)
    check(Case(dtype=F16, hkv=2, causal=0, kv_len=5), MHA, 2)
    check(Case(dtype=F16, d=6), MHA)


def test_mask_bias_shared_by_layers() -> None:
    """Two attention nodes on one mask: one bias Where, one seqlens_k chain, one chain finding
    the rows with no visible key (each layer then one Where giving them 0: masked_rows.h)."""
    c = Case(hkv=2, mask="bool", padding="right")
    model = build(c)
    g = model.graph
    att = next(n for n in g.node if n.op_type == "Attention")
    second = onnx.NodeProto()
    second.CopyFrom(att)
    del second.input[:]
    second.input.extend(["q", "k", "v", "mask"])
    second.output[0] = "y4b"
    g.node.append(second)
    g.node.append(helper.make_node("Add", ["y4", "y4b"], ["y4sum"]))
    for n in g.node:
        if n.op_type == "Transpose" and n.input[0] == "y4":
            n.input[0] = "y4sum"
    g.node.sort(key=lambda n: 1 if n.output[0] in ("y_bshd", "y") else 0)
    _, out = lower(model)
    assert ops(out).count(GQA) == 2
    assert ops(out).count("Where") == 3 and ops(out).count("Shape") == 1, ops(out)
    assert ops(out).count("ReduceSum") == 1, ops(out)
    x, valid = feeds(c)
    (ref,) = ort_run(build(c, domain=""), reference_feeds(c, x))
    (y,) = ort_run(out, x)
    np.testing.assert_allclose(y[valid], 2 * ref[valid], atol=2e-4)


NOT_LOWERED = {
    "causal_cross": (Case(kv_len=5), "S == T"),
    "causal_no_shapes": (Case(shapes=False, named=False), "S == T"),
    "softmax_precision_fp16": (
        Case(softmax_precision=TensorProto.FLOAT16),
        "softmax_precision",
    ),
}


@pytest.mark.parametrize("name", list(NOT_LOWERED))
def test_not_lowered(name: str) -> None:
    c, why = NOT_LOWERED[name]
    report = fastopt.optimize(
        fastopt.from_onnx(build(c)), passes=["lower_attention"], explain="lower_attention"
    )
    assert report.model is not None
    out = report.model.to_onnx()
    assert MHA not in ops(out) and GQA not in ops(out)
    assert any(why in line for line in report.explain), report.explain


# ---- real exports: a stand-in for stage 1 (fuse_attention) on the dynamo fixtures ----


def internal_attention_standin(fx: Fixture) -> onnx.ModelProto:
    """The fixture after the classic preset, each dynamo SDPA core (MatMul(q*c, kT*c) + mask ->
    Softmax -> Where(IsNaN) -> MatMul(v)) replaced by the internal op, the way stage 1 will
    (is_causal 0: the exporters' mask holds the causal part)."""
    report = fastopt.optimize(fx.path, preset="classic")
    assert report.model is not None
    model = report.model.to_onnx()
    g = model.graph
    prod = {o: n for n in g.node for o in n.output}
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}

    def unscaled(v: str) -> tuple[str, float]:
        n = prod.get(v)
        if n is not None and n.op_type == "Mul" and n.input[1] in consts:
            return n.input[0], float(consts[n.input[1]])
        return v, 1.0

    def kv_source(v: str) -> str:  # back through repeat_kv and the K^T reshapes
        n = prod.get(v)
        while n is not None and (
            n.op_type in ("Reshape", "Expand", "Unsqueeze")
            or (n.op_type == "Transpose" and list(n.attribute[0].ints) != [0, 2, 1, 3])
        ):
            v, n = n.input[0], prod.get(n.input[0])
        return v

    cfg = fx.meta["config"]
    hq = cfg.get("num_attention_heads", cfg.get("n_head"))
    hkv = fx.kv_heads
    # Attention's softmaxes (the stand-in's Where(IsNaN) reads them; an MoE router's does not)
    softmaxes = [n for n in g.node if n.op_type == "Softmax"]
    for softmax in [n for n in softmaxes if any(u.op_type == "Where" for u in users[n.output[0]])]:
        where = next(u for u in users[softmax.output[0]] if u.op_type == "Where")
        pv = next(u for u in users[where.output[0]] if u.op_type == "MatMul")
        add = prod[softmax.input[0]]
        qk, mask = add.input if prod[add.input[0]].op_type == "MatMul" else add.input[::-1]
        q, cq = unscaled(prod[qk].input[0])
        kt, ck = unscaled(prod[qk].input[1])
        att = helper.make_node(
            "Attention",
            [q, kv_source(kt), kv_source(pv.input[1]), mask],
            [pv.output[0]],
            domain=INTERNAL,
            scale=cq * ck,
            is_causal=0,
            q_num_heads=hq,
            kv_num_heads=hkv,
        )
        idx = list(g.node).index(pv)
        g.node.remove(pv)
        g.node.insert(idx, att)
    model.opset_import.append(helper.make_opsetid(INTERNAL, 1))
    return model


@pytest.mark.parametrize("fx", DYNAMO, ids=ids(DYNAMO))
def test_fixture(fx: Fixture) -> None:
    model = internal_attention_standin(fx)
    report = fastopt.optimize(
        fastopt.from_onnx(model), passes=["infer_shapes", "lower_attention", "eliminate_dead_nodes"]
    )
    assert report.model is not None
    report.model.verify()
    out = report.model.to_onnx()
    cfg = fx.meta["config"]
    hq = cfg.get("num_attention_heads", cfg.get("n_head"))
    gqa = fx.dtype == "float16" or fx.kv_heads < hq
    assert op_count(out, GQA if gqa else MHA, "com.microsoft") == fx.layers
    assert op_count(out, "Attention") == 0
    assert op_count(out, "Softmax") == router_softmaxes(fx)
    assert_parity(fx, out)


# ---- S == T proven from the graph (TorchScript exports lose the sequence dims) ----

TS_GQA = fixtures(arch=["llama", "mistral", "qwen2", "phi3", "gemma"], exporter="ts")


@pytest.mark.parametrize("fx", TS_GQA, ids=ids(TS_GQA))
def test_ts_fixture_gqa(fx: Fixture) -> None:
    """Q and K come from one hidden state through head-split Reshapes whose target reads
    Shape(hidden)[1]: GroupQueryAttention (fp16 and fp32, Hkv < Hq) without shape facts."""
    import fastopt.pipeline.registry
    from support.llm_fixtures import optimize

    _, out = optimize(fx, passes=fastopt.pipeline.registry.preset("llm"), target="ort")
    assert op_count(out, GQA, "com.microsoft") == fx.layers
    assert op_count(out, "Softmax") == 0 and op_count(out, MHA, "com.microsoft") == 0
    assert_parity(fx, out)


def projected(kv: str = "self", domain: str = INTERNAL) -> onnx.ModelProto:
    """x (B,S,64) -MatMul-Reshape(Concat(Shape(x)[0], Shape(x)[1], -1, 16))-Transpose- Q, the
    same for K/V (Hkv 2) from `kv`: "self" (x), "cross" (another input y, its own Shape), "slice"
    (x, its projection sliced along the sequence axis, Reshape(0, 0, -1, 16)). fp16, causal; the
    projections' types have rank 3 and no dims, Q/K/V's only the head size (what TorchScript
    exports give)."""
    f, rng = TensorProto.FLOAT16, np.random.default_rng(0)
    nodes, vinfo = [], []
    inits = [
        helper.make_tensor(n, f, [64, c], rng.standard_normal((64, c)).astype(np.float16) / 8)
        for n, c in (("wq", 64), ("wk", 32), ("wv", 32))
    ]
    inits += [
        helper.make_tensor("i0", TensorProto.INT64, [], [0]),
        helper.make_tensor("i1", TensorProto.INT64, [], [1]),
        helper.make_tensor("ax0", TensorProto.INT64, [1], [0]),
        helper.make_tensor("tail", TensorProto.INT64, [2], [-1, 16]),
        helper.make_tensor("keep", TensorProto.INT64, [4], [0, 0, -1, 16]),
        helper.make_tensor("s0", TensorProto.INT64, [1], [0]),
        helper.make_tensor("s1", TensorProto.INT64, [1], [-1]),
    ]
    inputs = [helper.make_tensor_value_info("x", f, ["B", "S", 64])]
    src = "x"
    if kv == "cross":
        inputs.append(helper.make_tensor_value_info("y", f, ["B", "T", 64]))
        src = "y"

    def split(name: str, x: str, w: str, cut: bool) -> None:
        nodes.append(helper.make_node("MatMul", [x, w], [f"{name}p"]))
        p = f"{name}p"
        if cut:  # drops the last position: T = S - 1
            nodes.append(helper.make_node("Slice", [p, "s0", "s1", "i1_1d"], [f"{name}c"]))
            p = f"{name}c"
            target = "keep"
        else:
            for i in (0, 1):
                nodes.append(helper.make_node("Shape", [x], [f"{name}shape{i}"]))
                nodes.append(
                    helper.make_node("Gather", [f"{name}shape{i}", f"i{i}"], [f"{name}d{i}"])
                )
                nodes.append(helper.make_node("Unsqueeze", [f"{name}d{i}", "ax0"], [f"{name}u{i}"]))
            nodes.append(
                helper.make_node("Concat", [f"{name}u0", f"{name}u1", "tail"], [f"{name}t"], axis=0)
            )
            target = f"{name}t"
        vinfo.append(helper.make_tensor_value_info(p, f, [None, None, None]))
        nodes.append(helper.make_node("Reshape", [p, target], [f"{name}r"]))
        nodes.append(helper.make_node("Transpose", [f"{name}r"], [name], perm=[0, 2, 1, 3]))
        vinfo.append(helper.make_tensor_value_info(name, f, [None, None, None, 16]))

    inits.append(helper.make_tensor("i1_1d", TensorProto.INT64, [1], [1]))
    split("q", "x", "wq", False)
    split("k", src, "wk", kv == "slice")
    split("v", src, "wv", kv == "slice")
    attrs: dict = {"is_causal": 1}
    if domain == INTERNAL:
        attrs.update(q_num_heads=4, kv_num_heads=2, scale=0.25)
    nodes.append(helper.make_node("Attention", ["q", "k", "v"], ["y4"], domain=domain, **attrs))
    nodes.append(helper.make_node("Transpose", ["y4"], ["y_bshd"], perm=[0, 2, 1, 3]))
    inits.append(helper.make_tensor("y_shape", TensorProto.INT64, [3], [0, 0, -1]))
    nodes.append(helper.make_node("Reshape", ["y_bshd", "y_shape"], ["out"]))
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("out", f, None)], inits, value_info=vinfo
    )
    opsets = [helper.make_opsetid("", 23 if domain == "" else 18)]
    if domain == INTERNAL:
        opsets.append(helper.make_opsetid(INTERNAL, 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def test_same_sequence_from_graph() -> None:
    _, out = lower(projected())
    assert ops(out).count(GQA) == 1 and "Attention" not in ops(out), ops(out)
    x = {"x": np.random.default_rng(1).standard_normal((2, 7, 64)).astype(np.float16)}
    (ref,) = ort_run(projected(domain=""), x)
    (y,) = ort_run(out, x)
    assert np.abs(y.astype(np.float64) - ref.astype(np.float64)).max() <= 2e-2


@pytest.mark.parametrize("kv", ["cross", "slice"])
def test_same_sequence_not_proven(kv: str) -> None:
    """K from another input (cross-attention), or sliced along the sequence axis: no proof."""
    report = fastopt.optimize(
        fastopt.from_onnx(projected(kv)), passes=["lower_attention"], explain="lower_attention"
    )
    assert report.model is not None
    out = report.model.to_onnx()
    assert GQA not in ops(out) and MHA not in ops(out), ops(out)
    assert any("needs S == T" in line for line in report.explain), report.explain
