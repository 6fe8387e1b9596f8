"""GPTQ's X^T X collected in groups of inputs when they do not fit fastopt.quant.gptq's limit at
once (python/fastopt/quant/calibration.py, gptq.hessian_groups / FactorWriter): one calibration
pass per group, each group's factors written and its sums freed before the next. With the limit
lowered on the llama fixture (9 distinct inputs: K = 64 x 7, 256 x 2; 0.61 MiB in all) the
groups hold what the one pass holds, bit for bit (the same ONNX Runtime values summed in the
same order), the quantized model is byte-identical, and no pass holds more than the limit. An
input whose own K x K passes the limit is refused in one line (the recipe rounds by the
search)."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import pytest
from fastopt.cli.main import main
from fastopt.quant import gptq
from fastopt.quant.calibration import WeightUse, collect_importance, weight_matmuls
from support.paths import TESTS
from support.word_tokenizer import with_word_tokenizer

LLAMA = TESTS / "fixtures" / "models" / "llama_ts_float32" / "model.onnx"
BATCHES = [
    np.arange(3, 3 + 24, dtype=np.int64).reshape(1, -1) * 7 % 97,
    np.arange(50, 50 + 16, dtype=np.int64).reshape(1, -1),
]
# 3 groups of the llama fixture's inputs: [n1, attn, n2] (48 KiB), [act, n1, attn] (272 KiB),
# [n2, act, final] (288 KiB); its one K = 256 input (256 KiB) alone passes 100_000.
LIMIT = 300_000
TOO_SMALL = 100_000


def _with_tokenizer(tmp_path: Path) -> Path:
    """The fixture beside a word-level tokenizer (no sampling: the calibration tokens are
    fixed)."""
    return with_word_tokenizer(LLAMA, tmp_path / "m")


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.parent.iterdir())}


def test_groups_hold_the_one_pass_sums_under_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fastopt.load(LLAMA)
    one = collect_importance(model, token_batches=BATCHES, hessians=True)
    assert one.hessian_passes == 1 and one.hessian_peak_bytes == gptq.hessian_bytes(
        weight_matmuls(model)
    )
    monkeypatch.setattr(gptq, "MAX_HESSIAN_BYTES", LIMIT)
    groups: list[dict[str, np.ndarray]] = []
    held: list[int] = []

    def sink(hs: dict[str, np.ndarray]) -> None:
        groups.append(dict(hs))
        held.append(sum(h.nbytes for h in {id(h): h for h in hs.values()}.values()))

    got = collect_importance(model, token_batches=BATCHES, hessians=True, hessian_sink=sink)
    assert got.hessians == {}  # (each group went to the sink)
    assert got.hessian_passes == len(groups) == 3
    assert got.to_dict()["hessians"] == one.to_dict()["hessians"] == 9
    # the accumulators' own peak, and what each group handed over, under the limit
    assert 0 < got.hessian_peak_bytes <= LIMIT and max(held) == got.hessian_peak_bytes
    names = [n for g in groups for n in g]
    assert sorted(names) == sorted(one.hessians) and len(set(names)) == len(names)
    for g in groups:
        for name, h in g.items():
            np.testing.assert_array_equal(h, one.hessians[name])
    # the importance comes from the first pass alone, the same as the one pass's
    assert got.tokens == one.tokens == sum(b.size for b in BATCHES)
    for name, v in one.vectors.items():
        np.testing.assert_array_equal(got.vectors[name], v)


def test_sampled_text_is_sampled_once_for_every_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """--calibration sampled: the model's own text is written once, before the passes, and
    every group's pass reads it (seeded: the one pass samples the same tokens)."""
    model = fastopt.load(LLAMA)
    one = collect_importance(model, "sampled", hessians=True)
    monkeypatch.setattr(gptq, "MAX_HESSIAN_BYTES", LIMIT)
    got: dict[str, np.ndarray] = {}
    grouped = collect_importance(model, "sampled", hessians=True, hessian_sink=got.update)
    assert grouped.hessian_passes == 3 and grouped.tokens == one.tokens > 0
    assert sorted(got) == sorted(one.hessians)
    for name, h in one.hessians.items():
        np.testing.assert_array_equal(got[name], h)


def test_grouped_gptq_writes_the_one_pass_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fastopt.quantize(method="gptq"): the factors of three groups, written as each came, give
    the quantized model of the one pass, byte for byte."""
    model = _with_tokenizer(tmp_path)
    kw = {"mode": "int4", "method": "gptq", "calibration": "builtin", "symmetric": False}
    one = fastopt.quantize(model, tmp_path / "one" / "q.onnx", block_size=64, **kw)
    monkeypatch.setattr(gptq, "MAX_HESSIAN_BYTES", LIMIT)
    grouped = fastopt.quantize(model, tmp_path / "groups" / "q.onnx", block_size=64, **kw)
    assert one.recipe is not None and grouped.recipe is not None
    assert one.recipe.calibration is not None and grouped.recipe.calibration is not None
    assert (one.recipe.calibration.hessian_passes, grouped.recipe.calibration.hessian_passes) == (
        1,
        3,
    )
    assert grouped.recipe.calibration.hessian_peak_bytes <= LIMIT
    assert one.recipe.gptq is not None and grouped.recipe.gptq is not None
    assert (grouped.recipe.gptq.weights, grouped.recipe.gptq.factors) == (15, 9)
    assert grouped.summary.quantized == one.summary.quantized == 15
    a, b = _files(tmp_path / "one" / "q.onnx"), _files(tmp_path / "groups" / "q.onnx")
    assert a.keys() == b.keys() and a == b


def test_cli_q4m_collects_in_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--recipe q4m --calibration over the limit: GPTQ still (it fell back to the search
    before), saying how many passes, and the one pass's bytes."""
    model = _with_tokenizer(tmp_path)
    args = ["quantize", str(model), "--mode", "int4", "--recipe", "q4m", "--calibration", "builtin"]
    assert main([*args, "-o", str(tmp_path / "one" / "q.onnx")]) == 0
    text = capsys.readouterr().out
    assert "gptq: X^T X factors for 15 weights (9 distinct" in text and "passes" not in text
    monkeypatch.setattr(gptq, "MAX_HESSIAN_BYTES", LIMIT)
    assert main([*args, "-o", str(tmp_path / "groups" / "q.onnx")]) == 0
    text = capsys.readouterr().out
    assert "the recipe rounds by the search" not in text
    assert "the X^T X collected in 3 calibration passes under the limit" in text
    assert _files(tmp_path / "one" / "q.onnx") == _files(tmp_path / "groups" / "q.onnx")


def test_an_input_over_the_limit_alone_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gptq, "MAX_HESSIAN_BYTES", TOO_SMALL)
    model = fastopt.load(LLAMA)
    with pytest.raises(
        fastopt.ModelError, match=r"gptq: the X\^T X of MatMul input '.*' \(K = 256\) alone"
    ):
        collect_importance(model, token_batches=BATCHES, hessians=True, hessian_sink=print)
    out = tmp_path / "q.onnx"
    plain = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--calibration", "builtin"]
    assert main([*plain, "--method", "gptq"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gptq: the X^T X of MatMul input") and err.count("\n") == 1
    assert "(K = 256) alone takes 0.00 GiB of float32, over the 0.00 GiB limit" in err
    assert not out.exists()
    # the recipe rounds by the search instead, and says why
    assert main([*plain, "--recipe", "q4m"]) == 0
    text = capsys.readouterr().out
    assert "(K = 256) alone takes" in text and "the recipe rounds by the search" in text
    assert "gptq: X^T X factors" not in text and out.exists()


def test_awq_needs_the_sums_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWQ's scaling of the factors needs every X^T X before the first is factored: with groups,
    --method gptq --awq is refused in one line, and the recipe with --awq rounds by the search."""
    monkeypatch.setattr(gptq, "MAX_HESSIAN_BYTES", LIMIT)
    out = tmp_path / "q.onnx"
    plain = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--calibration", "builtin"]
    assert main([*plain, "--method", "gptq", "--awq"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gptq: the X^T X pass the") and err.count("\n") == 1
    assert "(3 calibration passes), and awq's scaling needs them all at once" in err
    assert main([*plain, "--recipe", "q4m", "--awq"]) == 0
    assert "the recipe rounds by the search" in capsys.readouterr().out


def test_passes_of_model_shapes() -> None:
    """SmolLM2 and a 0.5B Qwen2 shape in one pass; a 7B shape (20.5 GiB) in 8 of at most
    3 GiB; an input of K = 30000 (3.35 GiB alone) refused."""

    def shape(layers: int, hidden: int, inter: int) -> list[WeightUse]:
        uses = [WeightUse("lm", "final", "lm_head", hidden)]
        for i in range(layers):
            for w, a, k in (("q", "n1", hidden), ("k", "n1", hidden), ("v", "n1", hidden),
                            ("o", "attn", hidden), ("gate", "n2", hidden), ("up", "n2", hidden),
                            ("down", "act", inter)):  # fmt: skip
                uses.append(WeightUse(f"{w}{i}", f"{a}{i}", f"{w}{i}", k))
        return uses

    assert len(gptq.hessian_groups(shape(30, 576, 1536))) == 1
    assert len(gptq.hessian_groups(shape(24, 896, 4864))) == 1
    seven = shape(32, 4096, 11008)
    groups = gptq.hessian_groups(seven)
    assert len(groups) == 8 and sorted(a for g in groups for a in g) == sorted({u.a for u in seven})
    k = {u.a: u.k for u in seven}
    assert max(sum(4 * k[a] ** 2 for a in g) for g in groups) <= gptq.MAX_HESSIAN_BYTES
    assert len(gptq.hessian_groups(shape(24, 896, 4864), 1 << 30)) == 3
    with pytest.raises(fastopt.ModelError, match=r"\(K = 30000\) alone takes 3\.35 GiB"):
        gptq.hessian_groups(shape(2, 896, 30000))
