"""Calibration text the model samples itself (fastopt.quant.sampled_text): batched through a KV
cache (add_kv_cache on a second copy, or the export's own cache), it draws exactly the tokens the
model recomputing each prefix draws; EOS is never drawn; `--calibration sampled` samples even
where a tokenizer is found, and GPTQ runs on that text from the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fastopt
import numpy as np
import onnxruntime as ort
import pytest
from fastopt import _C
from fastopt.cli.main import main
from fastopt.quant import sampled_text
from fastopt.quant.calibration import collect_importance
from support.paths import TESTS
from support.word_tokenizer import with_word_tokenizer

FIXTURES = TESTS / "fixtures" / "models"


@pytest.fixture
def short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of sampling at one small size, so they can be compared draw for draw."""
    for name in ("SEQUENCES", "RECOMPUTED_SEQUENCES"):
        monkeypatch.setattr(sampled_text, name, 4)
    for name in ("TOKENS", "RECOMPUTED_TOKENS"):
        monkeypatch.setattr(sampled_text, name, 12)


def _recomputed(path: Path, rows: int, tokens: int) -> np.ndarray:
    """The reference: each step runs the original over the whole prefix (empty pasts where it
    was exported with a cache) and draws from its last logits as the sampler does."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    rng = np.random.default_rng(sampled_text.SEED)
    ids = np.zeros((rows, 1), np.int64)
    for _ in range(tokens - 1):
        t = ids.shape[1]
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((rows, t), np.int64),
            "position_ids": np.tile(np.arange(t), (rows, 1)),
        }
        for name, i in inputs.items():
            if name.startswith("past_key_values."):
                feeds[name] = np.zeros((rows, i.shape[1], 0, i.shape[3]), np.float32)
        (logits,) = sess.run(["logits"], {k: v for k, v in feeds.items() if k in inputs})
        nxt = sampled_text.draw(logits[:, -1], rng, sampled_text.TEMPERATURE)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
    return ids


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("llama_ts_float32", "through a KV cache"),  # add_kv_cache on a TorchScript export
        ("qwen2_dynamo_float32", "through a KV cache"),  # ... on a dynamo export
        ("mpt_ts_float32_cache", "through a KV cache"),  # ... on an export with a cache
        # add_kv_cache refuses this export's sliding mask (it reads outside its input at
        # length 1), and its own cache decodes other tokens than it recomputes: no cache
        ("gemma3_ts_float32_cache", "recomputing each prefix (no KV cache: add_kv_cache: "),
    ],
)
def test_cached_sampling_draws_what_recomputing_draws(name: str, how: str, short: None) -> None:
    path = FIXTURES / name / "model.onnx"
    cached = sampled_text.sample_calibration(fastopt.load(path), [], "", "test")
    assert "4 sequences of 12 tokens" in cached.source and how in cached.source
    got = np.concatenate(cached.batches)
    want = _recomputed(path, 4, 12)
    assert got.shape == (4, 12) and (got[:, 0] == 0).all()  # BOS: 0 with no config beside
    assert len(np.unique(got[:, 1:])) > 12  # sampled text, not one repeated token
    np.testing.assert_array_equal(got, want)


def test_a_model_that_is_no_file_recomputes(short: None) -> None:
    path = FIXTURES / "llama_ts_float32" / "model.onnx"
    got = sampled_text.sample_calibration(_C.load_bytes(path.read_bytes()), [], "", "test")
    assert "recomputing each prefix (no KV cache: the model is not a file" in got.source
    np.testing.assert_array_equal(np.concatenate(got.batches), _recomputed(path, 4, 12))


def test_eos_and_bos_from_the_config_beside(tmp_path: Path, short: None) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(FIXTURES / "llama_ts_float32" / "model.onnx", folder / "model.onnx")
    free = sampled_text.sample_calibration(fastopt.load(folder / "model.onnx"), [], "", "t")
    ids, counts = np.unique(np.concatenate(free.batches)[:, 1:], return_counts=True)
    eos = int(ids[np.argmax(counts)])  # the token drawn most when nothing is banned
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": [eos]}))
    got = sampled_text.sample_calibration(
        fastopt.load(folder / "model.onnx"), [str(folder)], "", "t"
    )
    rows = np.concatenate(got.batches)
    assert (rows[:, 0] == 5).all() and eos not in rows[:, 1:]


def test_bos_and_eos_read_as_the_real_text_check_reads_them(tmp_path: Path, short: None) -> None:
    """A fixture's meta.json (config under "config": bos 1, eos 2), as
    fastopt.verify.text_tokens.start_token reads it."""
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "llama_ts_float32", folder)
    got = sampled_text.sample_calibration(
        fastopt.load(folder / "model.onnx"), [str(folder)], "", "t"
    )
    rows = np.concatenate(got.batches)
    assert (rows[:, 0] == 1).all() and 2 not in rows[:, 1:]


def test_draw_never_picks_a_banned_token() -> None:
    logits = np.zeros((64, 10))
    logits[:, 3] = 50.0  # nearly all the mass
    rng = np.random.default_rng(0)
    assert (sampled_text.draw(logits, rng, 0.8) == 3).all()
    picked = sampled_text.draw(logits, rng, 0.8, banned=[3])
    assert 3 not in picked and len(set(picked.tolist())) > 3


def test_sampled_even_where_a_tokenizer_is_found(tmp_path: Path) -> None:
    path = with_word_tokenizer(FIXTURES / "llama_ts_float32" / "model.onnx", tmp_path / "m")
    model = fastopt.load(path)
    assert "tokenizer.json" in collect_importance(model, "builtin").source
    sampled = collect_importance(model, "sampled")
    assert "sampled from the model" in sampled.source and "--calibration sampled" in sampled.source
    assert sampled.tokens == sampled_text.SEQUENCES * sampled_text.TOKENS
    assert sampled.sampling_seconds > 0


def test_gptq_on_sampled_text_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q.onnx"
    src = FIXTURES / "llama_ts_float32" / "model.onnx"
    args = [str(src), "-o", str(out), "--mode", "int4", "--method", "gptq"]
    assert main(["quantize", *args, "--calibration", "sampled"]) == 0
    printed = capsys.readouterr().out
    assert "4096 tokens from 64 sequences of 64 tokens sampled from the model" in printed
    assert "through a KV cache" in printed and "sampling the text" in printed
    assert out.is_file()
