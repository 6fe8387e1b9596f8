"""Logit soft-capping (issue 13, gemma2): scores = c * tanh(scale * Q K^T / c) before the mask
becomes the internal Attention's `softcap`, then GroupQueryAttention's / Attention-23's
`softcap` (ONNX Runtime 1.32 applies both after the scale and before the mask: checked here and
in tests/ort_behaviour/test_softcap_order.py), or the same formula in standard ops. gemma2's
final logit soft-capping (tanh on the lm_head output) is not attention and stays as exported.

The gemma2 fixtures are decoder fixtures like the others, so test_kv_generation.py also runs
their 32-token greedy generation (standard cache for both targets, in place, under
onnxruntime-genai, chunked prefill, a cache export converted); here: fusion, residue, parity on
unpadded and padded batches, the sliding layers' windows next to the cap, generation in both
cache modes with a control that a lost cap is caught, and the forms that must not fuse."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from support import kv_generation as kg
from support.fusion_util import make_model, ort_run, out_info, tensor
from support.llm_fixtures import Fixture, assert_parity, fixtures, ids, op_count, optimize

GEMMA2 = fixtures(arch="gemma2")
GEMMA2_F32 = fixtures(arch="gemma2", dtype="float32")
STEPS = 32
# Left over after --preset llm: the final logit soft-capping (Div, Tanh, Mul on the logits).
FINAL_CAP_OPS = {"Tanh": 1}
# What an unfused attention, rotary or norm would leave behind.
RESIDUE = {"Softmax", "Sin", "Cos", "ReduceMean", "Pow", "Sqrt", "Reciprocal", "Erf", "Neg"}


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _softcap(fx: Fixture) -> float:
    return float(fx.meta["config"]["attn_logit_softcapping"])


def _final_cap_is_exact(model: onnx.ModelProto, fx: Fixture) -> None:
    """The one Tanh left is the final soft-capping: Mul(Tanh(Div(logits, c)), c), c = 30."""
    producers = {o: n for n in model.graph.node for o in n.output}
    (tanh,) = [n for n in model.graph.node if n.op_type == "Tanh"]
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    div = producers[tanh.input[0]]
    assert div.op_type in ("Div", "Mul")
    c = float(fx.meta["config"]["final_logit_softcapping"])
    factor = next(float(consts[i]) for i in div.input if i in consts)
    assert np.isclose(factor, c if div.op_type == "Div" else 1 / c)


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", GEMMA2, ids=ids(GEMMA2))
def test_gemma2_fuses_with_the_cap(fx: Fixture, target: str) -> None:
    """One capped attention op per layer, no attention/rotary/norm residue, the final cap kept;
    logits within the bounds on unpadded, right- and left-padded batches."""
    _, model = optimize(fx, preset="llm", target=target)
    op = "GroupQueryAttention" if target == "ort" else "Attention"
    atts = [n for n in model.graph.node if n.op_type == op]
    assert len(atts) == fx.layers
    assert all(_attrs(n)["softcap"] == pytest.approx(_softcap(fx)) for n in atts)
    ops = {n.op_type for n in model.graph.node}
    assert not ops & RESIDUE, ops & RESIDUE
    assert op_count(model, "RotaryEmbedding") == 2 * fx.layers
    assert {k: op_count(model, k) for k in FINAL_CAP_OPS} == FINAL_CAP_OPS
    _final_cap_is_exact(model, fx)
    if target == "onnx":
        onnx.checker.check_model(model, full_check=True)
    assert_parity(fx, model)


@pytest.mark.parametrize("fx", GEMMA2_F32, ids=ids(GEMMA2_F32))
def test_standard_ops_keep_the_cap(fx: Fixture) -> None:
    """Where no capping op fits (attention_lowering=0; cuda=1 fp32: CUDA's GQA has no fp32
    kernel and MultiHeadAttention cannot cap) the attention is standard ops again, cap included,
    with the reason explained."""
    report, model = optimize(fx, preset="llm", options={"attention_lowering": 0})
    assert op_count(model, "Tanh") == fx.layers + 1
    assert_parity(fx, model, paddings=(None, "right"))
    report, model = optimize(fx, preset="llm", options={"cuda": 1}, explain="lower_attention")
    assert op_count(model, "GroupQueryAttention") == op_count(model, "MultiHeadAttention") == 0
    why = [line for line in report.explain if "soft-capping needs GroupQueryAttention" in line]
    assert len(why) == fx.layers, report.explain
    assert_parity(fx, model, paddings=(None, "right"))


@pytest.mark.parametrize("fx", GEMMA2_F32, ids=ids(GEMMA2_F32))
def test_sliding_layers_keep_window_and_cap(fx: Fixture, tmp_path: Path) -> None:
    """Layers 0 and 2 slide (window 4), layer 1 does not: in place, local_window_size on the
    sliding layers only and softcap on all; standard, the cap on every GQA with its layer's mask."""
    window = int(fx.meta["config"]["sliding_window"])
    for mode in ("inplace", "standard"):
        out = tmp_path / mode / "model.onnx"
        fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
        atts = [n for n in onnx.load(out).graph.node if n.op_type == "GroupQueryAttention"]
        assert [_attrs(n)["softcap"] for n in atts] == [pytest.approx(_softcap(fx))] * 3
        if mode == "inplace":
            windows = [_attrs(n).get("local_window_size", -1) for n in atts]
            assert windows == [window, -1, window]
        else:
            assert len({n.input[10] for n in atts}) == 2  # the windowed bias and the full one


def _prompts(vocab: int, lengths: tuple[int, ...] = (9, 5)) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


def _drop_softcap(path: Path, out: Path) -> None:
    model = onnx.load(path)
    for n in model.graph.node:
        kept = [a for a in n.attribute if a.name != "softcap"]
        del n.attribute[:]
        n.attribute.extend(kept)
    onnx.save(model, out)


@pytest.mark.parametrize("mode", ["standard", "inplace"])
@pytest.mark.parametrize("fx", GEMMA2_F32, ids=ids(GEMMA2_F32))
def test_cached_generation_keeps_the_cap(fx: Fixture, mode: str, tmp_path: Path) -> None:
    """32 greedy tokens of a right-padded batch as the no-cache original, step logits within
    1e-4; the same cached model with its softcap attributes removed is caught (the comparison
    can fail)."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    prompts = _prompts(int(fx.meta["config"]["vocab_size"]))
    inplace = mode == "inplace"
    if inplace:
        ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), STEPS)
    else:  # the standard cache's holes count in the window, as in the original on those inputs
        ref = kg.greedy_no_cache_as_cached(fx.path, prompts, STEPS)
    same, diff = kg.compare(ref, kg.greedy_cached(out, prompts, STEPS, inplace=inplace))
    assert same == STEPS and diff <= 1e-4, (same, diff)
    uncapped = tmp_path / "uncapped.onnx"
    _drop_softcap(out, uncapped)
    _, diff = kg.compare(ref, kg.greedy_cached(uncapped, prompts, STEPS, inplace=inplace))
    assert diff > 0.1, diff


# --- ONNX Runtime's semantics, which the lowerings rely on ------------------------------------

B, HQ, HKV, S, D = 2, 4, 2, 6, 16
SCALE, CAP = 0.3, 2.0


def _expected(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention with the cap after the scale and before the mask, (B, Hq, S, D)."""
    k = np.repeat(k, HQ // HKV, axis=1).astype(np.float64)
    v = np.repeat(v, HQ // HKV, axis=1).astype(np.float64)
    s = CAP * np.tanh(SCALE * (q.astype(np.float64) @ np.swapaxes(k, -1, -2)) / CAP)
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _session(
    node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto], opsets: list
) -> ort.InferenceSession:  # type: ignore[type-arg]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "g", inputs, [out])
    model = helper.make_model(graph, opset_imports=opsets)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_ort_caps_after_the_scale_before_the_mask() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, HQ, S, D)).astype(np.float32) * 2
    k = rng.standard_normal((B, HKV, S, D)).astype(np.float32) * 2
    v = rng.standard_normal((B, HKV, S, D)).astype(np.float32)
    expected = _expected(q, k, v)
    f = TensorProto.FLOAT
    # Attention-23, causal.
    node = helper.make_node(
        "Attention", ["q", "k", "v"], ["y"], is_causal=1, scale=SCALE, softcap=CAP
    )
    vi = helper.make_tensor_value_info
    inputs = [vi("q", f, [B, HQ, S, D]), vi("k", f, [B, HKV, S, D]), vi("v", f, [B, HKV, S, D])]
    sess = _session(node, inputs, [helper.make_opsetid("", 23)])
    (y,) = sess.run(None, {"q": q, "k": k, "v": v})
    np.testing.assert_allclose(y, expected, atol=1e-5)
    # GroupQueryAttention, a prompt (causal).
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "", "", "seqlens", "total"],
        ["y", "pk", "pv"],
        domain="com.microsoft",
        num_heads=HQ,
        kv_num_heads=HKV,
        scale=SCALE,
        softcap=CAP,
    )
    inputs = [vi(n, f, [B, S, h * D]) for n, h in (("q", HQ), ("k", HKV), ("v", HKV))]
    inputs += [vi("seqlens", TensorProto.INT32, [B]), vi("total", TensorProto.INT32, [])]
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    sess = _session(node, inputs, opsets)
    to3 = lambda x: x.transpose(0, 2, 1, 3).reshape(B, S, -1)  # noqa: E731
    feed = {"q": to3(q), "k": to3(k), "v": to3(v)}
    feed |= {"seqlens": np.full(B, S - 1, np.int32), "total": np.array(S, np.int32)}
    y = sess.run(["y"], feed)[0].reshape(B, S, HQ, D).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(y, expected, atol=1e-5)


# --- small hand-built attentions --------------------------------------------------------------


def capped_model(order: str = "gemma2", inner: str = "Div") -> onnx.ModelProto:
    """MatMul(q, k^T) -> Mul(scale) -> cap -> Add(mask) -> Softmax -> MatMul(v), the cap
    c * tanh(x / c) written with Div(c) or Mul(1/c). order "mask inside": the mask is added
    before the cap; "scale after": the scale multiplies the capped scores."""
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    inputs = [vi("q", f, ["B", 4, "S", 16]), vi("k", f, ["B", 4, "S", 16])]
    inputs += [vi("v", f, ["B", 4, "S", 16]), vi("mask", TensorProto.BOOL, ["B", 1, "S", "S"])]
    inits = [
        tensor("scale", np.array(0.25, np.float32)),
        tensor("cap", np.array(CAP, np.float32)),
        tensor("inv_cap", np.array(1 / CAP, np.float32)),
        tensor("zero", np.array(0, np.float32)),
        tensor("lowest", np.array(np.finfo(np.float32).min, np.float32)),
    ]
    n = helper.make_node
    nodes = [
        n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "kt"], ["qk"]),
        n("Where", ["mask", "zero", "lowest"], ["bias"]),
    ]

    def cap(x: str, y: str) -> list[onnx.NodeProto]:
        first = (
            n("Div", [x, "cap"], [y + "_in"])
            if inner == "Div"
            else n("Mul", ["inv_cap", x], [y + "_in"])
        )
        return [first, n("Tanh", [y + "_in"], [y + "_t"]), n("Mul", [y + "_t", "cap"], [y])]

    if order == "gemma2":
        nodes += [n("Mul", ["qk", "scale"], ["s"]), *cap("s", "c"), n("Add", ["c", "bias"], ["m"])]
    elif order == "mask inside":
        nodes += [n("Mul", ["qk", "scale"], ["s"]), n("Add", ["s", "bias"], ["a"]), *cap("a", "m")]
    else:  # scale after
        nodes += [*cap("qk", "c"), n("Mul", ["c", "scale"], ["s"]), n("Add", ["s", "bias"], ["m"])]
    nodes += [n("Softmax", ["m"], ["p"], axis=-1), n("MatMul", ["p", "v"], ["y"])]
    return make_model(nodes, inputs, [out_info("y", f, 4)], inits, opset=18)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    out = {x: rng.standard_normal((2, 4, 5, 16)).astype(np.float32) * 3 for x in "qkv"}
    mask = np.tril(np.ones((5, 5), bool))[None, None].repeat(2, 0)
    mask[1, :, :, 3:] = False  # right padding
    out["mask"] = mask
    return out


def _run(
    model: onnx.ModelProto, target: str, **kw: object
) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    passes = ["infer_shapes", "fuse_attention", "lower_attention"]
    options: dict[str, int] = {}
    if target == "onnx":
        passes = ["convert_version", *passes]
        options["opset"] = 23
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=passes,
        target=target,
        options=options,
        **kw,  # type: ignore[arg-type]
    )
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()


@pytest.mark.parametrize("inner", ["Div", "Mul"])
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_small_capped_attention_fuses(target: str, inner: str) -> None:
    """fp32, Hq == Hkv: GroupQueryAttention all the same (MultiHeadAttention cannot cap)."""
    model = capped_model(inner=inner)
    _, out = _run(model, target)
    op = "GroupQueryAttention" if target == "ort" else "Attention"
    (att,) = [n for n in out.graph.node if n.op_type == op]
    assert _attrs(att)["softcap"] == pytest.approx(CAP)
    assert op_count(out, "Tanh") == op_count(out, "Softmax") == 0
    feeds = _feeds()
    got, expected = ort_run(out, feeds)[0], ort_run(model, feeds)[0]
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize(
    ("order", "reason"),
    [
        ("mask inside", "the mask is added before the soft-cap"),
        ("scale after", "a scale factor after the soft-cap"),
    ],
)
def test_other_orders_are_not_fused(order: str, reason: str) -> None:
    """Neither op can cap a masked sum or scale capped scores: left as is, with the reason."""
    model = capped_model(order)
    report, out = _run(model, "onnx", explain="fuse_attention")
    assert op_count(out, "Softmax") == 1 and op_count(out, "Tanh") == 1
    assert any(reason in line for line in report.explain), report.explain
