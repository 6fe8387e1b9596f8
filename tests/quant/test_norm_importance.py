"""Data-free importance (``importance="norms"``, fastopt.quant.norm_importance): each weight's
input mean square per channel estimated from the norms' gains, the embedding and the weights,
on the llama TorchScript fixture (RMSNorm as Mul(x, gamma), silu MLP, grouped-query attention)
and on small graphs for the fused norms; and how ``--recipe q4m`` hands it to the pass."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt.cli.main import main
from fastopt.quant import budget
from fastopt.quant.calibration import read_importance, weight_matmuls
from fastopt.quant.norm_importance import (
    kAttentionMix,
    kSuperRowPower,
    kSuperRowRatio,
    norm_gain,
    norm_importance,
    super_rows,
)
from fastopt.quant.recipe import recipe_settings
from onnx import TensorProto, helper, numpy_helper
from support.mapping_rss import RSS_FILE_SOURCE
from support.paths import TESTS

LLAMA = TESTS / "fixtures" / "models" / "llama_ts_float32" / "model.onnx"


def _by_role(model: fastopt.Model) -> dict[tuple[str, str], str]:
    """(layer, projection) -> weight name, from the fixture's node names."""
    out = {}
    for u in weight_matmuls(model):
        parts = u.node.split("/")
        layer = parts[3] if "layers." in u.node else "head"
        out[(layer, parts[-2])] = u.weight
    return out


def _weight(model: fastopt.Model, name: str) -> np.ndarray:
    t = model.graph.initializer(name)
    assert t is not None
    return np.asarray(t.numpy(), np.float64)


def _gain(model: fastopt.Model, layer: str, norm: str) -> np.ndarray:
    t = model.graph.initializer(f"m.model.{layer}.{norm}.weight")
    assert t is not None
    return np.asarray(t.numpy(), np.float64)


def _silu_square(var: np.ndarray) -> np.ndarray:
    """E[silu(g)^2] for g ~ N(0, var), by the trapezoid rule on a fine grid."""
    z = np.linspace(-12, 12, 24001)
    pdf = np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)
    g = np.sqrt(var)[:, None] * z[None, :]
    return np.trapezoid((g / (1 + np.exp(-g))) ** 2 * pdf, z, axis=1)


def test_the_first_layer_reads_its_gain_squared_times_the_embedding() -> None:
    model = fastopt.load(LLAMA)
    imp = norm_importance(model)
    w = _by_role(model)
    assert set(imp) == {u.weight for u in weight_matmuls(model)}
    table = _weight(model, "m.model.embed_tokens.weight")
    r = (table**2).mean(0)
    want = _gain(model, "layers.0", "input_layernorm") ** 2 * r / r.mean()
    for proj in ("q_proj", "k_proj", "v_proj"):  # one norm feeds all three
        np.testing.assert_allclose(imp[w[("layers.0", proj)]], want, rtol=1e-5)


def test_the_mlp_and_attention_outputs_follow_the_stream() -> None:
    model = fastopt.load(LLAMA)
    imp = norm_importance(model)
    w = _by_role(model)
    table = _weight(model, "m.model.embed_tokens.weight")
    r = (table**2).mean(0)
    qkv = imp[w[("layers.0", "v_proj")]].astype(np.float64)
    # attention's output: one value for all channels, the value projection's mean square
    values = qkv @ _weight(model, w[("layers.0", "v_proj")]) ** 2
    o = imp[w[("layers.0", "o_proj")]]
    np.testing.assert_allclose(o, np.full(o.shape, values.mean()), rtol=1e-5)
    r = r + kAttentionMix * (o.astype(np.float64) @ _weight(model, w[("layers.0", "o_proj")]) ** 2)
    post = _gain(model, "layers.0", "post_attention_layernorm") ** 2 * r / r.mean()
    np.testing.assert_allclose(imp[w[("layers.0", "gate_proj")]], post, rtol=1e-4)
    np.testing.assert_allclose(imp[w[("layers.0", "up_proj")]], post, rtol=1e-4)
    # the down projection reads silu(gate) * up: E[silu(g)^2] E[u^2] per channel
    g = post @ _weight(model, w[("layers.0", "gate_proj")]) ** 2
    u = post @ _weight(model, w[("layers.0", "up_proj")]) ** 2
    np.testing.assert_allclose(imp[w[("layers.0", "down_proj")]], _silu_square(g) * u, rtol=1e-3)
    # the next layer's norm reads the stream with the MLP's output added
    d = imp[w[("layers.0", "down_proj")]].astype(np.float64)
    r = r + d @ _weight(model, w[("layers.0", "down_proj")]) ** 2
    nxt = _gain(model, "layers.1", "input_layernorm") ** 2 * r / r.mean()
    np.testing.assert_allclose(imp[w[("layers.1", "q_proj")]], nxt, rtol=1e-3)


def _with_super_row(path: Path, row: int, ratio: float) -> tuple[fastopt.Model, np.ndarray]:
    """The llama fixture with layer 0's down projection row ``row`` given one weight ``ratio``
    times the median row's largest |weight| (a super weight); returns the model and that weight
    [K, N] as float64."""
    proto = onnx.load(str(LLAMA))
    name = _by_role(fastopt.load(LLAMA))[("layers.0", "down_proj")]
    init = next(i for i in proto.graph.initializer if i.name == name)
    w = numpy_helper.to_array(init).copy()
    w[row, 3] = np.float32(ratio * np.median(np.abs(w).max(1)))
    init.CopyFrom(numpy_helper.from_array(w, name))
    onnx.save(proto, str(path))
    return fastopt.load(path), w.astype(np.float64)


def test_a_down_projections_super_row_is_read_ratio_to_the_fourth(tmp_path: Path) -> None:
    """A row whose largest |weight| is >= 5x the median row's (the weights that write the
    stream's massive activations) is read ratio^4-fold; the other rows, and the stream that the
    next layer's norms read, keep the product's estimate."""
    plain = norm_importance(fastopt.load(LLAMA))
    model, w = _with_super_row(tmp_path / "m.onnx", row=7, ratio=8.0)
    got = norm_importance(model)
    down = _by_role(model)[("layers.0", "down_proj")]
    ratio = np.abs(w).max(1)[7] / np.median(np.abs(w).max(1))
    assert ratio >= kSuperRowRatio
    want = plain[down].astype(np.float64)
    want[7] *= ratio**kSuperRowPower
    np.testing.assert_allclose(got[down], want, rtol=1e-5)
    # the stream the next layer's norm reads: the product's estimate through the edited
    # weight, unboosted (as test_the_mlp_and_attention_outputs_follow_the_stream builds it)
    w_by = _by_role(model)
    r = (_weight(model, "m.model.embed_tokens.weight") ** 2).mean(0)
    o = got[w_by[("layers.0", "o_proj")]].astype(np.float64)
    r = r + kAttentionMix * (o @ _weight(model, w_by[("layers.0", "o_proj")]) ** 2)
    r = r + plain[down].astype(np.float64) @ w**2
    nxt = _gain(model, "layers.1", "input_layernorm") ** 2 * r / r.mean()
    np.testing.assert_allclose(got[w_by[("layers.1", "q_proj")]], nxt, rtol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_column_sums_read_each_rows_largest_weight(dtype: type) -> None:
    """weight_column_sums' row_max: the same read gives each row's largest |weight| (the
    super rows' test), for B [K, N] and a transposed one stored [N, K] (a tied lm_head)."""
    from fastopt import _C

    w = np.random.default_rng(1).standard_normal((37, 53)).astype(dtype)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", elem, [1, 37])],
        [helper.make_tensor_value_info("y", elem, [1, 53])],
        [numpy_helper.from_array(w, "w")],
    )
    t = fastopt.load_bytes(helper.make_model(graph).SerializeToString()).graph.initializer("w")
    assert t is not None
    exact = w.astype(np.float64)
    for transposed, b in ((False, exact), (True, exact.T)):
        row_max = np.full(b.shape[0], -1.0)
        sums = _C.weight_column_sums(t, transposed, row_max=row_max)
        np.testing.assert_allclose(sums, (b**2).sum(0), rtol=1e-6)
        np.testing.assert_array_equal(row_max, np.abs(b).max(1))
    with pytest.raises(fastopt.ModelError, match="row_max"):
        _C.weight_column_sums(t, row_max=np.zeros(5))
    with pytest.raises(fastopt.ModelError, match="row_max"):
        _C.weight_column_sums(t, row_max=np.zeros(37, np.float32))


def test_super_rows_needs_a_clear_outlier() -> None:
    rows = np.array([1.0, 1.0, 1.0, 4.9, 5.0, 10.0, 1.0])  # median 1
    np.testing.assert_allclose(super_rows(rows), [1, 1, 1, 1, 5.0**4, 10.0**4, 1])
    np.testing.assert_array_equal(super_rows(np.zeros(3)), np.ones(3))


def _norm_graph(op: str, gain: np.ndarray, domain: str = "") -> fastopt.Model:
    k = gain.size
    w = np.random.default_rng(0).standard_normal((k, 8)).astype(np.float32)
    inputs = ["x", "skip", "gamma"] if op.startswith("Skip") else ["x", "gamma"]
    if op == "LayerNormalization":
        inputs.append("beta")
    nodes = [
        helper.make_node(op, inputs, ["n"], domain=domain),
        helper.make_node("MatMul", ["n", "w"], ["y"]),
    ]
    inits = [numpy_helper.from_array(gain, "gamma"), numpy_helper.from_array(w, "w")]
    if op == "LayerNormalization":
        inits.append(numpy_helper.from_array(np.zeros(k, np.float32), "beta"))
    x = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])]
    if op.startswith("Skip"):
        x.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, [1, k]))
    graph = helper.make_graph(
        nodes, "g", x, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return fastopt.load_bytes(helper.make_model(graph, opset_imports=opsets).SerializeToString())


@pytest.mark.parametrize(
    "op,domain",
    [
        ("LayerNormalization", ""),
        ("SimplifiedLayerNormalization", ""),
        ("SkipSimplifiedLayerNormalization", "com.microsoft"),
    ],
)
def test_fused_norms_give_their_gain_squared(op: str, domain: str) -> None:
    gain = np.linspace(0.1, 3.0, 16).astype(np.float32)
    model = _norm_graph(op, gain, domain)
    np.testing.assert_allclose(norm_importance(model)["w"], gain**2, rtol=1e-6)


def test_no_norm_no_estimate() -> None:
    w = np.ones((4, 4), np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    model = fastopt.load_bytes(helper.make_model(graph).SerializeToString())
    assert norm_importance(model) == {}
    node = next(n for n in model.graph.nodes if n.op_type == "MatMul")
    assert norm_gain(node.inputs[0], 4) is None


def test_q4m_weights_the_search_with_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = recipe_settings("q4m")
    assert settings["importance"] == "norms"
    kept = tmp_path / "imp.onnx"
    r = fastopt.quantize(
        LLAMA, tmp_path / "a.onnx", mode="int4", recipe="q4m", importance_output=kept, **settings
    )
    assert r.recipe is not None and r.recipe.norm_importance == 15
    stored = read_importance(kept)
    want = norm_importance(fastopt.load(LLAMA))
    assert set(stored) == set(want)
    for name, v in want.items():
        np.testing.assert_array_equal(stored[name], v)
    # the importance reaches the pass: other bytes than the same recipe without it
    plain = {**settings, "importance": ""}
    fastopt.quantize(LLAMA, tmp_path / "b.onnx", mode="int4", recipe="q4m", **plain)

    def codes(path: Path) -> dict[str, bytes]:
        proto = onnx.load(str(path))
        return {i.name: i.raw_data for i in proto.graph.initializer if i.name.endswith("_Q4")}

    a, b = codes(tmp_path / "a.onnx"), codes(tmp_path / "b.onnx")
    assert a.keys() == b.keys() and a != b
    # the CLI: the recipe, and --importance norms alone
    out = tmp_path / "c.onnx"
    assert main(["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--recipe", "q4m"]) == 0
    line = "importance: estimated from the weights for 15 weights (norms)"
    assert line in capsys.readouterr().out
    args = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--method", "search"]
    assert main([*args, "--importance", "norms"]) == 0
    # with calibration, the measured importance wins
    r = fastopt.quantize(LLAMA, out, mode="int4", recipe="q4m", calibration="builtin", **settings)
    assert r.recipe is not None and r.recipe.calibration is not None
    assert r.recipe.norm_importance == 0


def test_the_budget_estimates_errors_from_a_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each weight's int4 and int8 errors were computed over all of it before the pass, which
    made q4m's command 2.0-2.1x round to nearest's: now from whole blocks of about 128 rows (or
    64 columns of a transposed lm_head), which rank as well."""
    seen: list[tuple[int, int]] = []
    real = budget.weighted_error

    def spy(w: np.ndarray, *a: object, **k: object) -> float:
        seen.append(w.shape)
        return real(w, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(budget, "weighted_error", spy)
    model = fastopt.load(LLAMA)
    alloc = budget.allocate(model, 4.6, block_size=32, symmetric=False, over_floor_ok=True)
    full = [t.shape for t in alloc.tensors for _ in (4, 8)]
    assert len(seen) == len(full)
    for (k, n), (rows, cols) in zip(full, seen, strict=True):
        assert cols == n and rows == min(k, 128), (k, n, rows, cols)
    down = next(t for t in alloc.tensors if t.role == "down")
    assert down.shape[0] > 128  # sampled: 4 blocks of 32 rows, spread along K
    monkeypatch.setattr(budget, "weighted_error", real)
    t = model.graph.initializer(down.weight)
    assert t is not None
    w = np.asarray(t.numpy(), np.float32)
    exact = real(w, 4, 32, False)
    assert down.error_int4 == pytest.approx(exact, rel=0.3)
    assert down.error_int4 != pytest.approx(exact, rel=1e-9)


_RSS_CHILD = (
    """
import json, sys, fastopt, numpy
from fastopt.quant.budget import allocate
from fastopt.quant.norm_importance import norm_importance
fastopt._C.quantization_error(numpy.ones((32, 2), numpy.float32))  # (libraries mapped first)
numpy.median(numpy.ones(8))  # (super_rows': 0.9-2 MB of numpy's pages, more in a fresh venv)
"""
    + RSS_FILE_SOURCE
    + """
m = fastopt.load(sys.argv[1])
before = rss_file()
if sys.argv[2] == "norms":
    got = len(norm_importance(m))
else:
    got = len(allocate(m, 4.6, block_size=64, symmetric=False, over_floor_ok=True).tensors)
print(json.dumps({"grew": rss_file() - before, "weights": got}))
"""
)


def _gated_mlp(path: Path) -> None:
    """Embedding -> Mul(gamma) -> MatMul [768, 4096] -> silu -> MatMul [4096, 768] -> + residual,
    the weights (12 MB each) in an external data file, so that they are read from a mapping."""
    rng = np.random.default_rng(0)
    h, f = 768, 4096
    inits = [
        numpy_helper.from_array(rng.standard_normal((256, h)).astype(np.float32), "emb"),
        numpy_helper.from_array(rng.uniform(0.5, 2, h).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal((h, f)).astype(np.float32), "w_up"),
        numpy_helper.from_array(rng.standard_normal((f, h)).astype(np.float32), "w_down"),
    ]
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),
        helper.make_node("Mul", ["e", "gamma"], ["n"]),
        helper.make_node("MatMul", ["n", "w_up"], ["g"]),
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["a"]),
        helper.make_node("MatMul", ["a", "w_down"], ["d"]),
        helper.make_node("Add", ["e", "d"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, h])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(proto, str(path), save_as_external_data=True, location="w.bin")


@pytest.mark.parametrize("step", ["norms", "budget"])
def test_the_recipe_steps_read_weights_like_the_pass(tmp_path: Path, step: str) -> None:
    """Both read every weight from the model's mapping and give the pages back once read
    (quant/weight_source.h), so a model larger than memory streams through: the budget
    converted each whole weight with numpy before, and 24 MB of weights stayed mapped."""
    import json
    import subprocess
    import sys

    path = tmp_path / "m.onnx"
    _gated_mlp(path)
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(path), step],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["weights"] == 2
    # Each weight is 12 MB: one left mapped passes 8 MB; what grows besides is library pages
    # (1.9 MB here; CI's fresh environment measured 4.8 MB before the median's warm-up).
    assert got["grew"] < 8 << 20, got


def test_the_importance_file_is_written_without_onnx(tmp_path: Path) -> None:
    """Importing onnx to write the file took 0.6 s of q4m's 3 s of CPU on SmolLM2."""
    import subprocess
    import sys

    from fastopt.quant.importance_file import write_importance_file

    vectors = {"a/b": np.arange(5, dtype=np.float32), "w": np.full(300, 0.5, np.float32)}
    write_importance_file(vectors, tmp_path / "i.onnx")
    got = read_importance(tmp_path / "i.onnx")
    assert got.keys() == vectors.keys()
    for k, v in vectors.items():
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], v)
    onnx.checker.check_model(onnx.load(str(tmp_path / "i.onnx")))
    child = (
        "import sys; from fastopt.cli.main import main; "
        f"main(['quantize', {str(LLAMA)!r}, '-o', {str(tmp_path / 'q.onnx')!r}, '--mode', "
        "'int4', '--recipe', 'q4m', '--no-run-check']); print('onnx' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_the_fused_graph_gets_its_estimate_too() -> None:
    """`fastopt optimize --quantize` quantizes after the fusions: SkipSimplifiedLayerNormalization
    gives the gains, QuickGelu(alpha 1) is the MLP's silu."""
    model = fastopt.optimize(LLAMA).model
    assert model is not None
    imp = norm_importance(model)
    downs = []
    for n in model.graph.nodes:
        p = n.inputs[0].producer if n.op_type == "MatMul" and n.inputs[0] is not None else None
        if p is None or p.op_type != "Mul":
            continue
        if any(x.producer is not None and x.producer.op_type == "QuickGelu" for x in p.inputs):
            downs.append(n.inputs[1].name)
    assert len(downs) == 2
    for name in downs:
        assert name in imp and imp[name].std() > 0
    normed = [n for n in model.graph.nodes if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert normed
    assert len(imp) >= len(weight_matmuls(model)) - 2  # (packed QKV: attention's output unknown)
