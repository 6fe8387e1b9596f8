"""quantize_weights' method search (csrc/quant/search.cc): each block's scale (and zero point)
chosen for the least (importance-weighted) squared error. Never worse than round-to-nearest on any
block and column, exact on zero and constant blocks, importance vectors weighting the channels
that matter, bad importance files refused, the report's rel_mse, the binding that computes a
tensor's error without writing (quantization_error), and the output's parity in ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.cli.main import main
from onnx import helper, numpy_helper
from support.paths import TESTS
from support.quant_reference import dequantize_nbits

FIXTURES = TESTS / "fixtures" / "models"


def _model(w: np.ndarray, path: Path) -> Path:
    dtype = helper.np_dtype_to_tensor_dtype(w.dtype)
    k, n = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "g",
        [helper.make_tensor_value_info("x", dtype, ["batch", k])],
        [helper.make_tensor_value_info("y", dtype, ["batch", n])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _importance_file(path: Path, vectors: dict[str, np.ndarray]) -> Path:
    g = helper.make_graph(
        [], "importance", [], [], [numpy_helper.from_array(v, k) for k, v in vectors.items()]
    )
    onnx.save(helper.make_model(g), path)
    return path


def _dequantized(r: fastopt.QuantizeReport, bits: int, k: int) -> np.ndarray:
    assert r.model is not None
    node = next(n for n in r.model.graph.nodes if n.op_type == "MatMulNBits")
    b = node.inputs[1].initializer.numpy()
    s = node.inputs[2].initializer.numpy()
    zp = node.inputs[3].initializer.numpy() if len(node.inputs) > 3 and node.inputs[3] else None
    return dequantize_nbits(b, s, zp, bits, k)


def _block_errors(
    w: np.ndarray, wq: np.ndarray, bs: int, imp: np.ndarray | None = None, search: bool = False
):
    """Squared error per block and column, [k_blocks, N], weighted by imp per row; with
    `search` also by the search's element weights av + |x| (av: the block column's weighted
    rms), the error it minimises."""
    k, n = w.shape
    x = w.astype(np.float64)
    d2 = (x - wq) ** 2
    iw = np.ones(k) if imp is None else imp.astype(np.float64)
    pad = -k % bs
    d2 = np.pad(d2 * iw[:, None], ((0, pad), (0, 0))).reshape(-1, bs, n)
    if search:
        xb = np.pad(x, ((0, pad), (0, 0))).reshape(-1, bs, n)
        ib = np.pad(iw, (0, pad)).reshape(-1, bs, 1)
        av = np.sqrt((ib * xb**2).sum(1, keepdims=True) / ib.sum(1, keepdims=True))
        d2 = d2 * (av + np.abs(xb))
    return d2.sum(1)


def _weights(kind: str, k: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    if kind == "heavy":  # Student-t with 2 degrees of freedom: outliers in most blocks
        return (rng.standard_t(2, (k, n)) * 0.02).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05 + 0.03).astype(np.float32)  # lopsided
    return w


@pytest.mark.parametrize("kind", ["normal", "heavy", "lopsided"])
@pytest.mark.parametrize(
    "bits,bs,sym,dtype",
    [
        (4, 32, True, np.float32),
        (4, 32, False, np.float32),
        (4, 128, True, np.float16),
        (4, 16, False, np.float16),
        (8, 32, True, np.float32),
        (8, 64, False, np.float32),
    ],
)
def test_search_never_worse_than_rtn_on_any_block(
    tmp_path: Path, kind: str, bits: int, bs: int, sym: bool, dtype: type
) -> None:
    k, n = 200, 96  # a partial last block
    w = _weights(kind, k, n, seed=bits * 1000 + bs).astype(dtype)
    src = _model(w, tmp_path / "m.onnx")
    errs, plain, mse = {}, {}, {}
    for method in ("rtn", "search"):
        r = fastopt.quantize(src, mode=f"int{bits}", block_size=bs, symmetric=sym, method=method)
        wq = _dequantized(r, bits, k)
        errs[method] = _block_errors(w, wq, bs, search=True)
        plain[method] = _block_errors(w, wq, bs)
        [q] = r.quantized
        mse[method] = q.rel_mse
    tol = 1e-5 * errs["rtn"].max()
    assert (errs["search"] <= errs["rtn"] + tol).all()
    # and better overall, by a margin at 4 bits
    gain = 1 - errs["search"].sum() / errs["rtn"].sum()
    assert gain > (0.01 if bits == 4 else 0.0), gain
    # the report's rel_mse is the plain relative squared error, lower too
    want = plain["search"].sum() / (w.astype(np.float64) ** 2).sum()
    assert mse["search"] == pytest.approx(want, rel=1e-3)
    assert mse["search"] < mse["rtn"]


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_zero_and_constant_blocks_exact(tmp_path: Path, bits: int, sym: bool) -> None:
    w = _weights("normal", 128, 32, seed=1)
    w[:32] = 0.0  # a zero block in every column
    w[32:64, :16] = 0.37  # constant blocks
    w[32:64, 16:] = -1.25
    w[64:96, 5] = 0.0
    src = _model(w, tmp_path / "m.onnx")
    kw = {"mode": f"int{bits}", "block_size": 32, "symmetric": sym}
    wq = _dequantized(fastopt.quantize(src, method="search", **kw), bits, 128)
    rtn = _dequantized(fastopt.quantize(src, method="rtn", **kw), bits, 128)
    assert np.isfinite(wq).all()
    assert np.array_equal(wq[:32], np.zeros((32, 32)))  # zero blocks: scale 0, exact
    assert np.array_equal(wq[64:96, 5], np.zeros(32))
    # constant blocks: exact up to the float rounding of scale * code (asymmetric -1.25 is
    # (0 - 15) * fp32(1.25 / 15)), and never further than nearest rounding's
    want = w[32:64].astype(np.float64)
    np.testing.assert_allclose(wq[32:64], want, rtol=1e-6, atol=0)
    assert (np.abs(wq[32:64] - want) <= np.abs(rtn[32:64] - want)).all()


@pytest.mark.parametrize("sym", [True, False])
def test_importance_lowers_the_error_where_it_matters(tmp_path: Path, sym: bool) -> None:
    k, n = 256, 64
    w = _weights("heavy", k, n, seed=7)
    imp = np.ones(k, np.float32)
    imp[::8] = 100.0  # every 8th input channel carries large activations
    src = _model(w, tmp_path / "m.onnx")
    imp_file = _importance_file(tmp_path / "imp.onnx", {"w": imp, "unrelated": np.ones(3, "f")})
    kw = {"mode": "int4", "block_size": 32, "symmetric": sym}
    plain = fastopt.quantize(src, method="search", **kw)
    weighted = fastopt.quantize(src, method="search", importance=imp_file, **kw)
    rtn = fastopt.quantize(src, method="rtn", **kw)
    ew = {
        name: _block_errors(w, _dequantized(r, 4, k), 32, imp, search=True).sum()
        for name, r in (("plain", plain), ("weighted", weighted), ("rtn", rtn))
    }
    # the weighted error (what the model's output sees) goes down with the importance vector
    assert ew["weighted"] < 0.9 * ew["plain"] < ew["rtn"]
    # on the important channels themselves
    rows = np.arange(0, k, 8)
    imp_err = {
        name: ((w[rows].astype(np.float64) - _dequantized(r, 4, k)[rows]) ** 2).sum()
        for name, r in (("plain", plain), ("weighted", weighted))
    }
    assert imp_err["weighted"] < 0.85 * imp_err["plain"]
    # the report weights its rel_mse with the importance vector
    [q] = weighted.quantized
    plain = _block_errors(w, _dequantized(weighted, 4, k), 32, imp).sum()
    want = plain / (imp[:, None] * w.astype(np.float64) ** 2).sum()
    assert q.rel_mse == pytest.approx(want, rel=1e-3)


def test_bad_importance_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = _weights("normal", 64, 16, seed=2)
    src = _model(w, tmp_path / "m.onnx")
    cases = [
        ({"w": np.ones(63, np.float32)}, "'w' .* must be 1-D of length 64 .*not \\[63\\]"),
        ({"w": np.ones((64, 1), np.float32)}, "must be 1-D of length 64"),
        ({"w": np.ones(64, np.float64)}, "importance 'w' .* must be float32, not double"),
        ({"w": -np.ones(64, np.float32)}, "value 0 is negative or not finite"),
    ]
    for i, (vectors, message) in enumerate(cases):
        f = _importance_file(tmp_path / f"bad{i}.onnx", vectors)
        with pytest.raises(fastopt.ModelError, match=message):
            fastopt.quantize(src, tmp_path / "q.onnx", mode="int4", method="search", importance=f)
        assert not (tmp_path / "q.onnx").exists()
    with pytest.raises(fastopt.ModelError, match="needs method search"):
        fastopt.quantize(src, mode="int4", method="rtn", importance=tmp_path / "bad0.onnx")
    with pytest.raises(fastopt.ModelError, match="does not exist"):
        fastopt.quantize(src, mode="int4", method="search", importance=tmp_path / "missing.onnx")
    with pytest.raises(fastopt.ModelError, match="method must be rtn, search or gptq"):
        fastopt.quantize(src, mode="int4", method="nearest")
    out = str(tmp_path / "q.onnx")
    assert (
        main(
            [
                "quantize",
                str(src),
                "-o",
                out,
                "--mode",
                "int4",
                "--method",
                "search",
                "--importance",
                str(tmp_path / "bad0.onnx"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: importance 'w'") and err.count("\n") == 1
    # the C++ pass checks its option itself
    with pytest.raises(fastopt.ModelError, match=r"quant_method must be 0 \(rtn\), 1 .* or 2"):
        fastopt._C.run_pass(
            fastopt.load(str(src)), "quantize_weights", "ort", 10, "", {"quant_method": 3}
        )


def test_cli_method_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(FIXTURES / "llama_ts_float32" / "model.onnx")
    reports = {}
    for method in ("rtn", "search"):
        out, rep = str(tmp_path / f"{method}.onnx"), tmp_path / f"{method}.json"
        args = ["quantize", src, "-o", out, "--mode", "int4", "--method", method]
        assert main([*args, "--report", str(rep), "-v"]) == 0
        assert "rel mse" in capsys.readouterr().out
        import json

        reports[method] = json.loads(rep.read_text())
        assert reports[method]["settings"]["method"] == method
    for a, b in zip(reports["rtn"]["weights"], reports["search"]["weights"]):
        if a["action"] == "quantized":
            assert b["rel_mse"] <= a["rel_mse"] * (1 + 1e-6), a["weight"]
    assert (
        main(
            [
                "optimize",
                src,
                "-o",
                str(tmp_path / "o.onnx"),
                "--quantize",
                "int4",
                "--method",
                "rtn",
            ]
        )
        == 0
    )
    with pytest.raises(SystemExit):  # argparse's choices
        main(["quantize", src, "-o", str(tmp_path / "x.onnx"), "--mode", "int4", "--method", "x"])


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_ort_output_is_the_dequantized_matmul(tmp_path: Path, bits: int, sym: bool) -> None:
    k, n = 96, 40
    w = _weights("heavy", k, n, seed=11)
    src = _model(w, tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    r = fastopt.quantize(
        src, out, mode=f"int{bits}", block_size=32, symmetric=sym, accuracy_level=0
    )
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    want = x.astype(np.float64) @ _dequantized(r, bits, k)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_quantization_error_binding_matches_the_pass(tmp_path: Path) -> None:
    """What part B reads to allocate bits: a tensor's error at int4/int8 without writing."""
    w = _weights("heavy", 160, 48, seed=5)
    imp = np.random.default_rng(1).uniform(0.1, 10, 160).astype(np.float32)
    src = _model(w, tmp_path / "m.onnx")
    f = _importance_file(tmp_path / "imp.onnx", {"w": imp})
    for bits in (4, 8):
        for method in ("rtn", "search"):
            kw = {"importance": f} if method == "search" else {}
            r = fastopt.quantize(src, mode=f"int{bits}", block_size=32, method=method, **kw)
            [q] = r.quantized
            e = fastopt._C.quantization_error(
                w,
                bits=bits,
                block_size=32,
                symmetric=True,
                method=method,
                importance=imp if method == "search" else None,
            )
            assert e["rel_mse"] == pytest.approx(q.rel_mse, rel=1e-9)
            assert e["mean_rel_error"] == pytest.approx(q.mean_rel_error, rel=1e-9)
    e4 = fastopt._C.quantization_error(w, bits=4)["rel_mse"]
    e8 = fastopt._C.quantization_error(w, bits=8)["rel_mse"]
    assert 0 < e8 < e4 / 100
    with pytest.raises(fastopt.ModelError, match="importance must be 1-D of length K = 160"):
        fastopt._C.quantization_error(w, importance=np.ones(3, np.float32))


def test_decoder_search_closer_than_rtn(tmp_path: Path) -> None:
    """On a real export (random weights): the search's weights are closer to float, and its
    logits too."""
    src = FIXTURES / "qwen2_ts_float32" / "model.onnx"
    feeds = fastopt.make_inputs(str(src), {"sequence_length": 8})
    ref = ort.InferenceSession(str(src)).run(None, feeds)[0]
    dist = {}
    for method in ("rtn", "search"):
        out = tmp_path / f"{method}.onnx"
        r = fastopt.quantize(src, out, mode="int4", method=method, accuracy_level=0)
        assert all(q.rel_mse > 0 for q in r.quantized)
        got = ort.InferenceSession(str(out)).run(None, feeds)[0]
        dist[method] = float(np.abs(got - ref).mean())
        dist[method + "_mse"] = sum(q.rel_mse for q in r.quantized)
    assert dist["search_mse"] < 0.95 * dist["rtn_mse"]
    assert dist["search"] < dist["rtn"]
