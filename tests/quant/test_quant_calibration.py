"""Calibration (importance vectors), AWQ scaling and the --bits-budget allocation
(fastopt.quant.calibration, quant_awq, quant_budget) on the llama TorchScript fixture: the
importance file against NumPy over ONNX Runtime's own intermediate values, the AWQ rewrite equal
to the original in ONNX Runtime, budgets met and never exceeded, the allocation order, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.cli.main import main
from fastopt.quant.awq import apply_awq
from fastopt.quant.budget import allocate
from fastopt.quant.calibration import (
    builtin_text,
    collect_importance,
    read_importance,
    weight_matmuls,
    write_importance,
)
from fastopt.verify.inputs import make_inputs
from support.paths import ROOT, TESTS
from support.word_tokenizer import save_word_tokenizer

FIXTURES = TESTS / "fixtures" / "models"
LLAMA = FIXTURES / "llama_ts_float32" / "model.onnx"
# Token batches the tests feed (the fixture has random weights and no tokenizer).
BATCHES = [
    np.arange(3, 3 + 24, dtype=np.int64).reshape(1, -1) * 7 % 97,
    np.arange(50, 50 + 16, dtype=np.int64).reshape(1, -1),
]


def _feeds(model: onnx.ModelProto, ids: np.ndarray) -> dict[str, np.ndarray]:
    feeds = make_inputs(fastopt.load(LLAMA), dims={"batch": 1, "sequence_length": ids.shape[1]})
    feeds["input_ids"] = ids.astype(feeds["input_ids"].dtype)
    return feeds


def _ort_values(path: Path, names: list[str], ids: np.ndarray) -> dict[str, np.ndarray]:
    """The values ``names`` as ONNX Runtime computes them (made graph outputs)."""
    proto = onnx.load(str(path))
    have = {o.name for o in proto.graph.output}
    for n in names:
        if n not in have:
            proto.graph.output.append(onnx.ValueInfoProto(name=n))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so)
    got = sess.run(names, _feeds(proto, ids))
    return dict(zip(names, got))


def test_importance_file_equals_numpy_over_ort_values(tmp_path: Path) -> None:
    model = fastopt.load(LLAMA)
    uses = weight_matmuls(model)
    assert len({u.weight for u in uses}) == 15  # 2 layers x 7 projections + lm_head
    imp = collect_importance(model, token_batches=BATCHES)
    assert imp.tokens == sum(b.size for b in BATCHES)
    path = tmp_path / "importance.onnx"
    write_importance(imp.vectors, path)
    stored = read_importance(path)
    inits = {t.name: t for t in model.graph.initializers}
    assert set(stored) == {u.weight for u in uses}
    # Reference: mean over every token of every batch of A^2 per channel, from ORT's A values.
    sums: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}
    for ids in BATCHES:
        values = _ort_values(LLAMA, sorted({u.a for u in uses}), ids)
        for u in uses:
            a = values[u.a].astype(np.float64).reshape(-1, u.k)
            sums[u.weight] = sums.get(u.weight, 0) + (a * a).sum(axis=0)
            rows[u.weight] = rows.get(u.weight, 0) + a.shape[0]
    for name, vec in stored.items():
        assert vec.dtype == np.float32 and vec.ndim == 1
        assert vec.shape[0] == inits[name].shape[0]  # K of MatMul(x, W [K, N])
        np.testing.assert_allclose(vec, sums[name] / rows[name], rtol=2e-5, atol=1e-7)


def test_sequences_run_together_give_the_same_statistics() -> None:
    """Equal-length sequences stacked into one run ([B, T]: masks, positions and ids per row)
    sum to what one run per sequence sums, X^T X included."""
    model = fastopt.load(LLAMA)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 97, (1, 16)) for _ in range(5)] + [rng.integers(0, 97, (1, 9))]
    alone = collect_importance(model, token_batches=seqs, hessians=True, run_tokens=1)
    together = collect_importance(model, token_batches=seqs, hessians=True, run_tokens=48)
    assert alone.tokens == together.tokens == 89
    for name, vec in alone.vectors.items():
        np.testing.assert_allclose(together.vectors[name], vec, rtol=1e-4, atol=1e-6)
    for name, h in alone.hessians.items():
        np.testing.assert_allclose(together.hessians[name], h, rtol=1e-4, atol=1e-4)


def test_tokenizer_beside_the_model_and_sampled_text(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(LLAMA, folder / "model.onnx")
    # No tokenizer: the model's own sampled text.
    sampled = collect_importance(fastopt.load(folder / "model.onnx"))
    assert "sampled from the model" in sampled.source and sampled.tokens > 0
    # A word-level tokenizer over the built-in text, ids inside the fixture's vocabulary.
    save_word_tokenizer(folder)
    imp = collect_importance(fastopt.load(folder / "model.onnx"), "builtin")
    assert "tokenizer.json" in imp.source
    assert imp.tokens == len(builtin_text().split())
    text = tmp_path / "cal.txt"
    text.write_text("the quick brown fox " * 10)
    own = collect_importance(fastopt.load(folder / "model.onnx"), str(text))
    assert own.tokens == 40 and str(text) in own.source


def test_awq_rewrite_is_exact_in_onnxruntime(tmp_path: Path) -> None:
    model = fastopt.load(LLAMA)
    n_inits = len(model.graph.initializers)
    imp = collect_importance(model, token_batches=BATCHES)
    report, imp2 = apply_awq(model, imp.vectors, bits=4, block_size=32, symmetric=True)
    scaled = report.scaled
    kinds = {g.scale_node.rsplit("/", 1)[0].rsplit("/", 1)[-1] for g in scaled}
    # q/k/v (input_layernorm), gate/up (post_attention_layernorm), down (the MLP's Mul), lm_head
    assert {"input_layernorm", "post_attention_layernorm", "mlp"} <= kinds, kinds
    assert len(report.groups[0].weights) == 3  # q, k, v share one s
    for g in scaled:
        assert g.alpha > 0 and g.error_after < g.error_before
    assert len(model.graph.initializers) == n_inits  # replaced, not added; names kept
    assert set(imp2) == set(imp.vectors)
    scaled_names = {w for g in scaled for w in g.weights}
    assert any(not np.allclose(imp2[w], imp.vectors[w]) for w in scaled_names)
    out = tmp_path / "awq.onnx"
    model.save(out)
    for ids in BATCHES:
        want = _ort_values(LLAMA, ["logits"], ids)["logits"]
        got = _ort_values(out, ["logits"], ids)["logits"]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        assert not np.array_equal(
            onnx.numpy_helper.to_array(
                next(t for t in onnx.load(str(out)).graph.initializer if t.name in scaled_names)
            ),
            onnx.numpy_helper.to_array(
                next(t for t in onnx.load(str(LLAMA)).graph.initializer if t.name in scaled_names)
            ),
        )


def _achieved_bits(report: fastopt.QuantizeReport) -> float:
    mm = [w for w in report.quantized if w.op == "MatMulNBits"]
    weights = sum(w.bytes_before // 4 for w in mm)  # float32
    return 8 * sum(w.bytes_after for w in mm) / weights


@pytest.mark.parametrize("budget", [5.0, 5.3, 6.0, 7.5, 9.0])
def test_bits_budget_met_and_never_exceeded(tmp_path: Path, budget: float) -> None:
    out = tmp_path / "q.onnx"
    r = fastopt.quantize(LLAMA, out, mode="int4", bits_budget=budget)
    got = _achieved_bits(r)
    assert got <= budget + 1e-9
    alloc = r.recipe.allocation
    assert alloc is not None and abs(alloc.average_bits - got) < 1e-9
    int8 = set(alloc.int8_weights)
    nbits = {
        n.input[1]: next(a.i for a in n.attribute if a.name == "bits")
        for n in onnx.load(str(out)).graph.node
        if n.op_type == "MatMulNBits"
    }
    assert {w.removesuffix("_Q8") for w, b in nbits.items() if b == 8} == int8
    # Every int4 weight left would not have fit in what the budget leaves.
    total = sum(t.shape[0] * t.shape[1] for t in alloc.tensors)
    left = budget * total - alloc.average_bits * total
    for t in alloc.tensors:
        if t.bits == 4:
            assert (9.0 - 5.0) * t.shape[0] * t.shape[1] > left
    if budget >= 9.0:
        assert len(int8) == len(alloc.tensors)


def test_allocation_order_lm_head_first_then_value_down_then_gain() -> None:
    model = fastopt.load(LLAMA)
    everything = allocate(model, None, block_size=32, symmetric=True)
    head = next(t for t in everything.tensors if t.lm_head)
    assert head.shape == (64, 512)
    total = sum(t.shape[0] * t.shape[1] for t in everything.tensors)
    # Just room for the lm_head at int8: it goes first, although smaller tensors gain more per bit.
    budget = 5.0 + 4.0 * head.shape[0] * head.shape[1] / total
    alloc = allocate(model, budget, block_size=32, symmetric=True)
    assert alloc.int8_weights == [head.weight]

    def gain(t):  # error removed per extra bit
        return (t.error_int4 - t.error_int8) / (4.0 * t.shape[0] * t.shape[1])

    alloc = allocate(model, 5.5, block_size=32, symmetric=True, lm_head="keep")
    chosen = [t for t in alloc.tensors if t.bits == 8]
    assert chosen and not any(t.lm_head for t in alloc.tensors)
    left = [t for t in alloc.tensors if t.bits == 4]
    # Greedy, data-free: attention V and MLP down projections first, each group by gain; the
    # first tensor left out ranks below every one taken before it.
    rank = {"value": 0, "down": 1}
    ranked = sorted(alloc.tensors, key=lambda t: (rank.get(t.role, 2), -gain(t)))
    first_out = next(i for i, t in enumerate(ranked) if t.bits == 4)
    assert all(t.bits == 8 for t in ranked[:first_out])
    assert left


def test_calibration_weights_the_errors_and_the_file_reaches_the_pass(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    imp_path = tmp_path / "imp.onnx"
    r = fastopt.quantize(
        LLAMA, out, mode="int4", calibration="builtin", awq=True, importance_output=imp_path
    )
    assert r.recipe is not None and r.recipe.allocation is not None
    assert r.recipe.allocation.weighted and r.recipe.calibration.tokens > 0
    assert r.recipe.awq is not None and r.recipe.awq.scaled
    stored = read_importance(imp_path)
    assert set(stored) == {t.weight for t in r.recipe.allocation.tensors}
    assert r.verify is None and r.summary.quantized == 15
    d = r.to_dict()
    json.dumps(d, default=str)
    assert d["recipe"]["calibration"]["tokens"] == r.recipe.calibration.tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "int8", "bits_budget": 5.0}, "use it with mode int4"),
        ({"mode": "int4", "bits_budget": 4.2}, "below what int4 takes"),
        ({"mode": "int4", "bits_budget": 3.0}, "from 4 to 16"),
        ({"mode": "int8-dynamic", "calibration": "builtin"}, r"and fp16 \(ranges\), not to int8"),
        ({"mode": "bf16", "calibration": "builtin"}, "bf16 has float32's range"),
        ({"mode": "int4", "calibration": "/nonexistent/cal.txt"}, "no file"),
        ({"mode": "int4", "awq": True}, "awq needs calibration"),
        ({"mode": "int4", "calibration": "builtin", "hf_config": "/nonexistent"}, "not a folder"),
    ],
)
def test_refusals(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(fastopt.ModelError, match=message):
        fastopt.quantize(LLAMA, tmp_path / "q.onnx", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "q.onnx").exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.onnx"
    args = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4"]
    assert main([*args, "--calibration", "builtin", "--awq", "--bits-budget", "5.5"]) == 0
    text = capsys.readouterr().out
    assert "calibration: " in text and "awq: " in text and "(budget 5.5)" in text
    assert "error int4" in text  # the per-weight table
    fp16 = FIXTURES / "llama_dynamo_float16" / "model.onnx"
    assert (
        main(
            [
                "quantize",
                str(fp16),
                "-o",
                str(out),
                "--mode",
                "int4",
                "--calibration",
                "builtin",
                "--awq",
            ]
        )
        == 0
    )
    assert "awq: no norm or scale feeds float32 weight MatMuls" in capsys.readouterr().out
    assert main([*args, "--bits-budget", "4.1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bits budget 4.1 is below") and err.count("\n") == 1


# --- Real trained model (opt-in: -m slow) -------------------------------------------------------

MAKE_SMOLLM2 = Path("/work/shared/realmodels/make-smollm2.sh")


def _bench() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_quant_calibration",
        ROOT / "bench" / "quant" / "bench_quant_calibration.py",
    )
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _smollm2(cache: Path) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct (transformers folder, ONNX export) built into ``cache``, or skip."""
    import subprocess
    import sys

    hf = cache / "smollm2"
    if not (hf / "tokenizer.json").exists():
        if not MAKE_SMOLLM2.exists():
            pytest.skip("make-smollm2.sh is not here")
        p = subprocess.run(
            ["bash", str(MAKE_SMOLLM2), str(hf), sys.executable], capture_output=True, text=True
        )
        if p.returncode != 0:
            pytest.skip(f"make-smollm2.sh failed (no PyPI?): {p.stderr[-300:]}")
    onnx_path = cache / "smollm2_onnx" / "model.onnx"
    if not onnx_path.exists():
        _bench().export(str(hf), onnx_path)
    return hf, onnx_path


@pytest.mark.slow
def test_smollm2_awq_and_budget_lower_kl(tmp_path_factory: pytest.TempPathFactory) -> None:
    import os

    cache = Path(os.environ.get("FASTOPT_TEST_CACHE", Path.home() / ".cache" / "fastopt-tests"))
    cache.mkdir(parents=True, exist_ok=True)
    hf, src = _smollm2(cache)
    bench = _bench()
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(hf / "tokenizer.json"))
    batches = bench.chunks(tok.encode(bench.EVAL_TEXT.read_text()).ids)
    ref, _ = bench.logits_of(src, batches)
    out = tmp_path_factory.mktemp("q") / "q.onnx"

    def kl(**kw: object) -> float:
        r = fastopt.quantize(src, out, mode="int4", hf_config=hf, **kw)  # type: ignore[arg-type]
        got, _ = bench.logits_of(out, batches)
        if kw.get("bits_budget"):
            assert _achieved_bits(r) <= float(kw["bits_budget"])  # type: ignore[arg-type]
        return float(bench.metrics(ref, got, batches)["kl"])

    rtn = kl(block_size=128)
    awq = kl(block_size=128, calibration="builtin", awq=True)
    budget = kl(block_size=128, bits_budget=5.0)
    assert awq < 0.9 * rtn, (awq, rtn)
    assert budget < 0.9 * rtn, (budget, rtn)
