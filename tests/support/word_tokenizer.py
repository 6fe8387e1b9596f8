"""A word-level tokenizer over fastopt's built-in calibration text (ids 2..91, inside the small
fixtures' vocabularies; [UNK] 1), saved as tokenizer.json: calibration then tokenizes the text
with fixed ids instead of sampling. Skips the test where the `tokenizers` package is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastopt.quant.calibration import builtin_text


def save_word_tokenizer(folder: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = sorted(set(builtin_text().split()))
    vocab = {w: i % 90 + 2 for i, w in enumerate(words)} | {"[UNK]": 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def with_word_tokenizer(model: Path, folder: Path) -> Path:
    """A copy of ``model`` in ``folder`` (made) beside the tokenizer; the copy's path."""
    pytest.importorskip("tokenizers")
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(model, folder / "model.onnx")
    save_word_tokenizer(folder)
    return folder / "model.onnx"
