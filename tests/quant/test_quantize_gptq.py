"""GPTQ (csrc/quant/gptq.h, python/fastopt/quant/gptq.py, --method gptq): the kernel against a
NumPy GPTQ on small random weights, its weighted error tr(E^T H E) below round to nearest's and
the search's, identity H as plain rounding; the calibration's X^T X against NumPy over ONNX
Runtime's own values; a real fixture quantized with it, run through MatMulNBits; refusals."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt import _C
from fastopt.cli.main import main
from fastopt.quant.calibration import collect_importance, weight_matmuls
from fastopt.quant.gptq import awq_input_scales, factor, hessian_groups, write_factors
from fastopt.verify.inputs import make_inputs
from support.paths import TESTS
from support.word_tokenizer import with_word_tokenizer

FIXTURES = TESTS / "fixtures" / "models"
LLAMA = FIXTURES / "llama_ts_float32" / "model.onnx"
BATCHES = [
    np.arange(3, 3 + 24, dtype=np.int64).reshape(1, -1) * 7 % 97,
    np.arange(50, 50 + 16, dtype=np.int64).reshape(1, -1),
]


def _rtn_params(block: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's round-to-nearest scale and zero point per column of a block (float32)."""
    mn, mx = block.min(0), block.max(0)
    if symmetric:
        m = np.where(np.abs(mx) > np.abs(mn), mx, mn)
        return (-m / np.float32(8)).astype(np.float32), np.full(block.shape[1], 8, np.float32)
    lo, hi = np.minimum(mn, 0), np.maximum(mx, 0)
    scale = ((hi - lo) / np.float32(15)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        zp = np.where(scale != 0, np.clip(np.floor(-lo / scale + 0.5), 0, 15), 0)
    return scale, zp.astype(np.float32)


def _code(v: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        recip = np.where(scale != 0, np.float32(1) / scale, 0).astype(np.float32)
    x = np.clip(v * recip + zp, 0, 15)
    return np.floor(x + np.float32(0.5))  # x >= 0: round half away from zero


def numpy_gptq(w: np.ndarray, u: np.ndarray, bs: int, symmetric: bool) -> np.ndarray:
    """GPTQ as the paper's reference code does it (W^T's rows are our columns), with each
    block's round-to-nearest parameters taken when the block starts: the dequantized weight."""
    w = w.astype(np.float32).copy()
    out = np.zeros_like(w)
    k = w.shape[0]
    for r0 in range(0, k, bs):
        scale, zp = _rtn_params(w[r0 : r0 + bs], symmetric)
        for r in range(r0, min(k, r0 + bs)):
            out[r] = (_code(w[r], scale, zp) - zp) * scale
            err = (w[r] - out[r]) / u[r, r]
            w[r + 1 :] -= np.outer(u[r, r + 1 :], err).astype(np.float32)
    return out


def numpy_gptq_act_order(w: np.ndarray, h: np.ndarray, bs: int, symmetric: bool) -> np.ndarray:
    """Act order with static groups: rows coded by decreasing H_kk, each with its block's
    round-to-nearest parameters taken from the original rows."""
    k = w.shape[0]
    params = [_rtn_params(w[r : r + bs], symmetric) for r in range(0, k, bs)]
    perm = np.argsort(-np.diagonal(h), kind="stable")
    u = factor(h[np.ix_(perm, perm)]).astype(np.float64)
    wp = w[perm].astype(np.float32).copy()
    out = np.zeros_like(wp)
    for i in range(k):
        scale, zp = params[perm[i] // bs]
        out[i] = (_code(wp[i], scale, zp) - zp) * scale
        err = (wp[i] - out[i]) / u[i, i]
        wp[i + 1 :] -= np.outer(u[i, i + 1 :], err).astype(np.float32)
    res = np.empty_like(out)
    res[perm] = out
    return res


def _problem(seed: int, k: int = 128, n: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """A weight and an H = X^T X from correlated inputs with a few loud channels."""
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(k, k)) * 0.3 + np.eye(k)
    x = rng.normal(size=(512, k)) @ mix * np.exp(rng.normal(size=k))
    return rng.normal(size=(k, n)).astype(np.float32) * 0.05, x.T @ x


def _weighted(e: np.ndarray, h: np.ndarray) -> float:
    return float(np.einsum("kn,kl,ln->", e, h, e))


@pytest.mark.parametrize("symmetric", [True, False])
def test_kernel_equals_numpy_gptq(symmetric: bool) -> None:
    w, h = _problem(0)
    u = factor(h)
    got = _C.gptq_dequantize(w, u, 4, 32, symmetric, params="rtn")
    ref = numpy_gptq(w, u.astype(np.float64), 32, symmetric)
    # float32 sums in another order flip a rounding now and then, and the change feeds forward
    # within its column: nearly every value agrees.
    same = np.isclose(got, ref, rtol=0, atol=1e-6)
    assert same.mean() > 0.97, same.mean()
    assert abs(_weighted(w - got, h) / _weighted(w - ref, h) - 1) < 0.02


def test_partial_last_block_equals_numpy() -> None:
    """K = 80 in blocks of 32 (K = 576 in blocks of 128 on SmolLM2 ends the same way)."""
    w, h = _problem(6, k=80)
    u = factor(h)
    got = _C.gptq_dequantize(w, u, 4, 32, False, params="rtn")
    ref = numpy_gptq(w, u.astype(np.float64), 32, False)
    assert np.isclose(got, ref, rtol=0, atol=1e-6).mean() > 0.97
    perm = np.argsort(-np.diagonal(h), kind="stable")
    got = _C.gptq_dequantize(w, factor(h[np.ix_(perm, perm)]), 4, 32, True, "rtn", order=perm)
    ref = numpy_gptq_act_order(w, h, 32, True)
    assert np.isclose(got, ref, rtol=0, atol=1e-6).mean() > 0.97


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_kernel_equals_numpy(symmetric: bool) -> None:
    w, h = _problem(5)
    perm = np.argsort(-np.diagonal(h), kind="stable")
    u = factor(h[np.ix_(perm, perm)])
    got = _C.gptq_dequantize(w, u, 4, 32, symmetric, params="rtn", order=perm)
    ref = numpy_gptq_act_order(w, h, 32, symmetric)
    same = np.isclose(got, ref, rtol=0, atol=1e-6)
    assert same.mean() > 0.97, same.mean()
    assert abs(_weighted(w - got, h) / _weighted(w - ref, h) - 1) < 0.02
    with pytest.raises(fastopt.ModelError, match="permutation"):
        _C.gptq_dequantize(w, u, 4, 32, symmetric, order=np.zeros(128, np.int64))


@pytest.mark.parametrize(("bs", "symmetric"), [(32, True), (64, False), (128, True)])
def test_weighted_error_below_rtn_and_search(bs: int, symmetric: bool) -> None:
    for seed in range(3):
        w, h = _problem(seed)
        u = factor(h)
        eye = np.eye(w.shape[0], dtype=np.float32)
        imp = np.diagonal(h).astype(np.float32)
        rtn = _C.gptq_dequantize(w, eye, 4, bs, symmetric, params="rtn")
        search = _C.gptq_dequantize(w, eye, 4, bs, symmetric, params="search", importance=imp)
        gptq = _C.gptq_dequantize(w, u, 4, bs, symmetric, params="search", importance=imp)
        perm = np.argsort(-np.diagonal(h), kind="stable")
        up = factor(h[np.ix_(perm, perm)])
        act = _C.gptq_dequantize(w, up, 4, bs, symmetric, importance=imp, order=perm)
        e_rtn, e_search, e_gptq, e_act = (_weighted(w - d, h) for d in (rtn, search, gptq, act))
        assert e_gptq < 0.8 * e_rtn and e_gptq < 0.8 * e_search, (e_rtn, e_search, e_gptq)
        assert e_act < 0.8 * e_rtn and e_act < 0.8 * e_search, (e_rtn, e_search, e_act)


def test_identity_hessian_is_round_to_nearest() -> None:
    w, _ = _problem(1, k=96, n=40)
    eye = np.eye(96, dtype=np.float32)
    for symmetric in (True, False):
        got = _C.gptq_dequantize(w, eye, 4, 32, symmetric, params="rtn")
        ref = np.concatenate(
            [
                (_code(b, *p) - p[1]) * p[0]
                for b in np.split(w, 3)
                for p in [_rtn_params(b, symmetric)]
            ]
        )
        np.testing.assert_array_equal(got, ref)
        # and its sums are quantization_error's (rtn) for the same weight
        rel = float(((w - got) ** 2).sum() / (w**2).sum())
        want = _C.quantization_error(w, 4, 32, symmetric, method="rtn")["rel_mse"]
        assert rel == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("scipy", [True, False])
def test_factor_is_the_inverse_cholesky(scipy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import fastopt.quant.gptq as gptq

    if not scipy:  # (scipy is optional: numpy's Cholesky and inverse then)
        monkeypatch.setattr(gptq, "_lapack", lambda: None)
    _, h = _problem(2, k=64)
    u = factor(h, damp=0.01).astype(np.float64)
    assert np.allclose(np.tril(u, -1), 0)
    hd = h + 0.01 * np.diagonal(h).mean() * np.eye(64)
    np.testing.assert_allclose(u.T @ u, np.linalg.inv(hd), rtol=1e-4, atol=1e-9)
    # a channel no token used: H_kk = 1 before damping, still positive definite
    h2 = h.copy()
    h2[5, :] = h2[:, 5] = 0
    assert np.all(np.diagonal(factor(h2)) > 0)


def test_calibration_hessians_equal_numpy_over_ort_values() -> None:
    import onnxruntime as ort

    model = fastopt.load(LLAMA)
    uses = weight_matmuls(model)
    imp = collect_importance(model, token_batches=BATCHES, hessians=True)
    assert imp.to_dict()["hessians"] == len({u.a for u in uses})
    proto = onnx.load(str(LLAMA))
    names = sorted({u.a for u in uses})
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so)
    ref: dict[str, np.ndarray] = {}
    for ids in BATCHES:
        feeds = make_inputs(model, dims={"batch": 1, "sequence_length": ids.shape[1]})
        feeds["input_ids"] = ids.astype(feeds["input_ids"].dtype)
        for name, a in zip(names, sess.run(names, feeds)):
            x = a.astype(np.float64).reshape(-1, a.shape[-1])
            ref[name] = ref.get(name, 0) + x.T @ x
    for u in uses:
        np.testing.assert_allclose(imp.hessians[u.weight], ref[u.a], rtol=1e-4, atol=1e-4)
    # weights of one input share one array
    by_input: dict[str, set[int]] = {}
    for u in uses:
        by_input.setdefault(u.a, set()).add(id(imp.hessians[u.weight]))
    assert all(len(ids) == 1 for ids in by_input.values())


def test_factor_file_shares_the_bytes_of_one_input(tmp_path: Path) -> None:
    _, h = _problem(3, k=32)
    _, h2 = _problem(4, k=32)
    c = np.linspace(0.5, 2, 32)
    path = tmp_path / "hessian.onnx"
    hs = {"q": h, "k": h, "v": h, "o": h2, "down": h}
    rep = write_factors(hs, path, {"down": c}, act_order=False)
    assert (rep.weights, rep.factors) == (5, 3)
    assert rep.bytes <= 3 * (32 * 32 * 4 + 64)
    m = onnx.load(str(path))
    got = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    np.testing.assert_array_equal(got["q"], factor(h))
    np.testing.assert_array_equal(got["k"], got["q"])
    np.testing.assert_array_equal(got["down"], factor(h * np.outer(c, c)))
    assert not any(n.endswith("#order") for n in got)
    # act order: each weight's order beside its factor, the factor that of the permuted H
    rep = write_factors(hs, path, {"down": c}, act_order=True)
    assert (rep.weights, rep.factors) == (5, 3)
    m = onnx.load(str(path))
    got = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    order = got["q#order"]
    np.testing.assert_array_equal(order, np.argsort(-np.diagonal(h), kind="stable"))
    np.testing.assert_array_equal(got["q"], factor(h[np.ix_(order, order)]))
    np.testing.assert_array_equal(got["k#order"], order)
    before = {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}
    after = {"a": before["a"], "b": np.full(4, 0.25, np.float32)}
    scales = awq_input_scales(before, after)
    assert list(scales) == ["b"] and np.allclose(scales["b"], 0.5)


def _logits(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})[0])


def _matmulnbits_weights(path: Path) -> dict[str, np.ndarray]:
    """weight name -> W' [K, N] as MatMulNBits reads its 4-bit B, scales and zero points."""
    proto = onnx.load(str(path))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    out = {}
    for n in proto.graph.node:
        if n.op_type != "MatMulNBits":
            continue
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        k, nn, bs = a["K"], a["N"], a["block_size"]
        assert a["bits"] == 4
        b = inits[n.input[1]].reshape(nn, -1)
        codes = np.stack([b & 15, b >> 4], -1).reshape(nn, -1)[:, :k].astype(np.float32)
        blocks = -(-k // bs)
        scales = inits[n.input[2]].reshape(nn, blocks).astype(np.float32)
        zp = np.full((nn, blocks), 8, np.float32)
        if len(n.input) > 3 and n.input[3]:
            z = inits[n.input[3]].reshape(nn, -1)
            zp = np.stack([z & 15, z >> 4], -1).reshape(nn, -1)[:, :blocks].astype(np.float32)
        per_k = np.repeat(np.arange(blocks), bs)[:k]
        out[n.input[1].removesuffix("_Q4")] = ((codes - zp[:, per_k]) * scales[:, per_k]).T
    return out


@pytest.mark.parametrize("act_order", [False, True])
def test_real_fixture_through_matmulnbits(
    tmp_path: Path, act_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The llama fixture with a word-level tokenizer over the built-in text (512 tokens), int4
    asymmetric b64 and symmetric b32: GPTQ writes MatMulNBits that ONNX Runtime runs, and the
    output error its weights make on the calibration tokens, sum tr(E^T H E) / tr(W^T H W)
    read back from the written B / scales / zero points, is below round to nearest's and the
    search's, along K and in act order. (The logits of a 2-layer random model move with ONNX
    Runtime's thread timing in calibration from one process to the next; the weighted error
    is the stable measure.)"""
    import fastopt.quant.gptq as gptq

    monkeypatch.setattr(gptq, "ACT_ORDER", act_order)
    model = with_word_tokenizer(LLAMA, tmp_path / "m")
    loaded = fastopt.load(model)
    hs = collect_importance(loaded, "builtin", hessians=True).hessians
    floats = {t.name: np.asarray(t.numpy(), np.float64) for t in loaded.graph.initializers}
    feeds = make_inputs(loaded, dims={"batch": 1, "sequence_length": 128})
    import tokenizers
    from fastopt.quant.calibration import builtin_text

    tok = tokenizers.Tokenizer.from_file(str(model.parent / "tokenizer.json"))
    feeds["input_ids"] = np.array([tok.encode(builtin_text()).ids[:128]], np.int64)
    ref = _logits(model, feeds)
    for symmetric, bs in ((False, 64), (True, 32)):
        errs, logit_errs = {}, {}
        for method in ("rtn", "search", "gptq"):
            out = tmp_path / f"{method}{bs}" / "model.onnx"
            kw = {"calibration": "builtin"} if method != "rtn" else {}
            r = fastopt.quantize(
                model, out, mode="int4", method=method, symmetric=symmetric, block_size=bs, **kw
            )
            assert r.summary.quantized == 15
            written = _matmulnbits_weights(out)
            assert len(written) == 15
            total = 0.0
            for name, wq in written.items():
                w = floats[name] if floats[name].shape == wq.shape else floats[name].T
                h = hs[name].astype(np.float64)
                total += _weighted(w - wq, h) / _weighted(w, h)
            errs[method] = total
            logit_errs[method] = float(np.mean((_logits(out, feeds) - ref) ** 2))
            if method == "gptq":
                assert r.recipe is not None and r.recipe.gptq is not None
                assert r.recipe.gptq.weights == 15
                # one per distinct input: 4 per layer (q/k/v, o, gate/up, down), the lm_head's
                assert r.recipe.to_dict()["gptq"]["factors"] == 2 * 4 + 1
        assert errs["gptq"] < 0.8 * min(errs["rtn"], errs["search"]), errs
        assert logit_errs["gptq"] < 1.5 * logit_errs["rtn"], logit_errs  # (runs, not broken)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "int4", "method": "gptq"}, "method gptq needs calibration"),
        ({"mode": "int8", "method": "gptq", "calibration": "builtin"}, "rounds int4 weights"),
        ({"mode": "int4", "method": "gtpq"}, "method must be rtn, search or gptq"),
        (
            {"mode": "int4", "method": "gptq", "calibration": "builtin", "target": "onnx"},
            "gptq writes MatMulNBits",
        ),
    ],
)
def test_refusals(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(fastopt.ModelError, match=message):
        fastopt.quantize(LLAMA, tmp_path / "q.onnx", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "q.onnx").exists()


def _gptq_pass(model: fastopt.Model, hessian: Path) -> None:
    _C.run_pass(
        model,
        "quantize_weights",
        "ort",
        1,
        "",
        {"quant_method": 2},
        {"quant_hessian": str(hessian)},
        None,
    )


def test_pass_option_refusals(tmp_path: Path) -> None:
    model = fastopt.load(LLAMA)
    with pytest.raises(fastopt.ModelError, match="needs quant_hessian"):
        _C.run_pass(model, "quantize_weights", "ort", 1, "", {"quant_method": 2}, {}, None)
    bad = tmp_path / "hessian.onnx"
    name = weight_matmuls(model)[0].weight
    write_factors({name: np.eye(8)}, bad)
    with pytest.raises(fastopt.ModelError, match=r"must be \[64, 64\]|must be \["):
        _gptq_pass(model, bad)
    # act order: an order that is not a permutation
    k = weight_matmuls(model)[0].k
    write_factors({name: np.eye(k)}, bad, act_order=True)
    with open(str(bad) + ".data", "r+b") as f:
        f.seek(k * k * 4)
        f.write(bytes(8 * k))
    with pytest.raises(fastopt.ModelError, match="not a permutation"):
        _gptq_pass(model, bad)
    uses = weight_matmuls(model)
    with pytest.raises(fastopt.ModelError, match=r"GiB of float32, over the"):
        hessian_groups(uses, limit=1000)


def test_hessian_cost_of_model_shapes() -> None:
    """The accumulators' bytes of SmolLM2's shape (the passes each shape takes:
    tests/quant/test_gptq_groups.py)."""
    from fastopt.quant.calibration import WeightUse
    from fastopt.quant.gptq import hessian_bytes

    uses = [WeightUse("lm", "final", "lm_head", 576)]
    for i in range(30):
        for w, a, k in (("q", "n1", 576), ("k", "n1", 576), ("v", "n1", 576), ("o", "attn", 576),
                        ("gate", "n2", 576), ("up", "n2", 576), ("down", "act", 1536)):  # fmt: skip
            uses.append(WeightUse(f"{w}{i}", f"{a}{i}", f"{w}{i}", k))
    assert hessian_bytes(uses) == 4 * (576**2 * 91 + 1536**2 * 30)


def test_cli_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--method", "gptq"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: method gptq needs calibration") and err.count("\n") == 1
    args = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--calibration", "builtin"]
    assert main([*args, "--method", "gptq", "--asymmetric", "--block-size", "64"]) == 0
    assert out.exists()
    assert "gptq: X^T X factors for 15 weights (9 distinct" in capsys.readouterr().out


def test_q4m_with_calibration_rounds_by_gptq(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastopt.quant.recipe import recipe_settings

    assert recipe_settings("q4m")["method"] == "search"
    assert recipe_settings("q4m", calibrated=True)["method"] == "gptq"
    out = tmp_path / "q.onnx"
    args = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--recipe", "q4m"]
    assert main([*args, "--calibration", "builtin"]) == 0
    assert "gptq: X^T X factors" in capsys.readouterr().out
    assert main([*args, "--calibration", "builtin", "--method", "search"]) == 0  # flags win
    assert "gptq:" not in capsys.readouterr().out
    assert main(args) == 0  # data-free: the search
    assert "gptq:" not in capsys.readouterr().out


def test_factors_run_blas_single_threaded() -> None:
    """OpenBLAS's threads cost 3-30x on a busy machine for matrices of this size: one inside
    write_factors, scipy's included though it is imported only there (a fresh process), the
    settings restored after."""
    import subprocess
    import sys

    code = """
import ctypes, json
from fastopt.quant.gptq import _blas_threads

def counts():
    with open("/proc/self/maps") as maps:
        paths = sorted({ln.split()[-1] for ln in maps if "openblas" in ln.lower() and ".so" in ln})
    out = {}
    for path in paths:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads"):
            if (get := getattr(lib, name, None)) is not None:
                out[path] = int(get())
    return out

before = counts()
with _blas_threads(1):
    inside = counts()
print(json.dumps([before, inside, counts()]))
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, inside, after = json.loads(got.stdout)
    import importlib.util

    if not inside and importlib.util.find_spec("scipy") is None:
        pytest.skip("no OpenBLAS with a thread setter is loaded")
    assert inside, "scipy's OpenBLAS was not loaded before the setters were looked for"
    assert set(inside.values()) == {1}, inside
    assert len(inside) >= len(before)  # scipy's too, when installed
    assert {p: n for p, n in after.items() if p in before} == before


def test_q4m_falls_back_to_the_search_over_the_hessian_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model with an input whose X^T X alone is over the limit still quantizes with the
    recipe: the search, and a line saying why; --method gptq without a recipe is refused."""
    import fastopt.quant.gptq as gptq

    monkeypatch.setattr(gptq, "MAX_HESSIAN_BYTES", 1000)
    out = tmp_path / "q.onnx"
    args = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--recipe", "q4m"]
    assert main([*args, "--calibration", "builtin"]) == 0
    text = capsys.readouterr().out
    assert "over the 0.00 GiB limit: the recipe rounds by the search" in text
    assert "gptq: X^T X factors" not in text and out.exists()
    plain = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--calibration", "builtin"]
    assert main([*plain, "--method", "gptq"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gptq: the X^T X of MatMul input") and err.count("\n") == 1
