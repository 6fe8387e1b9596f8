"""fp16 ranges from calibration text (fastopt.quant.fp16_ranges with ``calibration``): the range
check runs on real token ids and lengths, and on the random inputs, in one ONNX Runtime session
(a RangeProbe riding fastopt.quant.calibration's runs).

The model is the gemma3 TorchScript fixture whose embedding row of one word of the calibration
text is scaled so that Gemma's sqrt(hidden) = 8 multiplier takes it past float16's range: a
massive activation triggered by one frequent token, as trained LLMs have on their delimiters and
first token. The row is one the random inputs never draw, so the random-input check keeps nothing
and the fp16 model writes NaN on the text; with the text the check keeps the ops it overflows."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.cli.main import main
from fastopt.quant.activation_ranges import RangeProbe, collect_ranges, representative_inputs
from fastopt.quant.calibration import builtin_text, collect_importance
from fastopt.quant.fp16_ranges import FP16_MAX, check_ranges
from onnx import numpy_helper
from support.llm_fixtures import fixtures

tokenizers = pytest.importorskip("tokenizers")

GEMMA3 = fixtures(arch="gemma3", exporter="ts", dtype="float32")[0]
EMBEDDING = "m.model.embed_tokens.weight"
ROW_MAX = 2.5e4  # inside float16 (no weight clamps); x8 in the graph passes 65504


def _random_ids(path: Path) -> set[int]:
    inputs = representative_inputs(fastopt.load(path))
    return {int(i) for feeds in inputs for i in feeds["input_ids"].flat}


@pytest.fixture(scope="module")
def massive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """(model folder with tokenizer.json, the triggering token id): module docstring."""
    folder = tmp_path_factory.mktemp("massive")
    shutil.copy(GEMMA3.path, folder / "model.onnx")
    drawn = _random_ids(folder / "model.onnx")
    words = builtin_text().split()
    trigger_word = Counter(words).most_common(1)[0][0]
    free = [i for i in range(2, 512) if i not in drawn]
    trigger, others = free[0], [i for i in range(2, 512) if i != free[0]]
    vocab = {w: others[i % len(others)] for i, w in enumerate(sorted(set(words)))}
    vocab[trigger_word] = trigger
    vocab["[UNK]"] = 1
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    model = onnx.load(str(folder / "model.onnx"))
    for t in model.graph.initializer:
        if t.name == EMBEDDING:
            table = numpy_helper.to_array(t).copy()
            table[trigger] *= ROW_MAX / np.abs(table[trigger]).max()
            t.CopyFrom(numpy_helper.from_array(table, EMBEDDING))
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx", trigger


def _text_feeds(path: Path) -> dict[str, np.ndarray]:
    tok = tokenizers.Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    ids = np.array([tok.encode(builtin_text()).ids[:128]], np.int64)
    t = ids.shape[1]
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(t, dtype=np.int64)[None],
    }


def _logits(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(["logits"], feeds)[0], np.float64)


def test_calibration_keeps_what_random_inputs_miss(
    massive: tuple[Path, int], tmp_path: Path
) -> None:
    path, trigger = massive
    feeds = _text_feeds(path)
    assert trigger in feeds["input_ids"] and trigger not in _random_ids(path)
    ref = _logits(path, feeds)
    assert np.isfinite(ref).all()
    # Random inputs alone: nothing comes near, and the fp16 model writes NaN on the text.
    plain = fastopt.quantize(path, tmp_path / "plain.onnx", mode="fp16")
    assert plain.range_check is not None and plain.range_check.kept == []
    assert not np.isfinite(_logits(tmp_path / "plain.onnx", feeds)).all()
    # The calibration text: the scaled embeddings' Mul and the residual Adds stay float32.
    r = fastopt.quantize(path, tmp_path / "cal.onnx", mode="fp16", calibration="builtin")
    check = r.range_check
    words = len(builtin_text().split())
    sequences = {"calibration": -(-words // 128), "random": 4}  # 128 tokens a run
    assert check is not None and check.samples_by_source == sequences
    assert check.tokens == words and "tokenizer.json" in check.calibration
    kept = {k.node: k for k in check.kept}
    scale = kept["/m/model/embed_tokens/Mul"]
    assert scale.by_source["calibration"] > FP16_MAX > 1e3 > scale.by_source["random"]
    assert "on calibration text" in scale.reason and "on random inputs" in scale.reason
    assert sum(k.op == "Add" for k in check.kept) >= 6
    assert "sequences of calibration text" in check.summary()
    got = _logits(tmp_path / "cal.onnx", feeds)
    assert np.isfinite(got).all(), "fp16 logits overflow on the calibration text"
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() >= 0.99, cos.min()
    assert r.to_dict()["range_check"]["samples_by_source"] == sequences


def test_one_session_measures_what_collect_ranges_does(massive: tuple[Path, int]) -> None:
    """The probe's random-input maxima equal the random-only pass's, value for value; its
    calibration maxima are those of the text alone."""
    path, _ = massive
    model = fastopt.load(path)
    probe = RangeProbe(model, representative_inputs(model))
    imp = collect_importance(model, "builtin", probes=[probe], importance=False, run_tokens=1)
    assert imp.vectors == {} and imp.tokens > 0
    alone = collect_ranges(model)
    got = probe.ranges
    assert set(got.by_source["random"]) == set(alone.max_abs) == set(got.max_abs)
    for name, m in alone.max_abs.items():
        assert got.by_source["random"][name] == pytest.approx(m, rel=1e-6)
        assert got.max_abs[name] == max(m, got.by_source["calibration"][name])
    runs = -(-imp.tokens // 128)
    assert got.samples == runs + 4 and got.samples_by_source == {"calibration": runs, "random": 4}


def test_check_ranges_with_calibration_direct(massive: tuple[Path, int]) -> None:
    path, _ = massive
    model = fastopt.load(path)
    assert check_ranges(model).kept == []
    check = check_ranges(model, calibration="builtin", sequence=64)
    assert check.samples_by_source["calibration"] == -(-check.tokens // 64)
    assert any(k.op == "Mul" and k.max_abs > FP16_MAX for k in check.kept)


def test_cli(massive: tuple[Path, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = massive
    out = tmp_path / "fp16.onnx"
    args = ["quantize", str(path), "-o", str(out), "--mode", "fp16"]
    assert main([*args, "--calibration", "builtin", "-v"]) == 0
    text = capsys.readouterr().out
    assert "sequences of calibration text" in text and "on calibration text" in text, text


def _bad_text(tmp_path: Path) -> Path:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    return bad


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mode", "fp16", "--calibration", "BAD"], "calibration: cannot read"),
        (["--mode", "fp16", "--calibration", "EMPTY"], "calibration: 'EMPTY' is empty"),
        (["--mode", "fp16", "--calibration", "/nonexistent.txt"], "calibration: no file"),
        (["--mode", "fp16", "--calibration", "builtin", "--fp16-ranges", "off"], "fp16_ranges on"),
        (["--mode", "bf16", "--calibration", "builtin"], "bf16 has float32's range"),
        (
            ["--mode", "fp16", "--calibration", "builtin", "--save-importance", "imp.onnx"],
            "importance_output applies to int4/int8, not to fp16",
        ),
    ],
)
def test_cli_refusals_are_one_line(
    massive: tuple[Path, int],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    path, _ = massive
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    names = {"BAD": str(_bad_text(tmp_path)), "EMPTY": str(empty)}
    extra = [names.get(a, a) for a in extra]
    message = message.replace("EMPTY", str(empty))
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(path), "-o", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_model_without_token_ids_is_refused(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [w],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(fastopt.ModelError, match="calibration: the model has no token ids"):
        fastopt.quantize(path, tmp_path / "o.onnx", mode="fp16", calibration="builtin")
    assert not (tmp_path / "o.onnx").exists()


def test_optimize_quantize_step_takes_calibration(
    massive: tuple[Path, int], tmp_path: Path
) -> None:
    """optimize(quantize=QuantSettings(mode="fp16", calibration=...)) after the llm preset's
    fusions: the check runs on the fused graph, on the text too."""
    from fastopt.quant.settings import QuantSettings

    path, _ = massive
    out = tmp_path / "o.onnx"
    settings = QuantSettings(mode="fp16", calibration="builtin", keep_io_types=True)
    r = fastopt.optimize(path, output=out, preset="llm", quantize=settings)
    check = r.range_check
    assert check is not None and check.samples_by_source["calibration"] > 0
    assert any(k.by_source.get("random", 0.0) < 1e3 < FP16_MAX <= k.max_abs for k in check.kept)
    feeds = _text_feeds(path)
    ref, got = _logits(path, feeds), _logits(out, feeds)
    assert np.isfinite(got).all()
    a, b = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() >= 0.99, cos.min()
