"""Where the real-text check's tokens come from (:mod:`fastopt.verify.real_text`).

With a tokenizer (``tokenizer.json`` given, or in the folder given, or beside the original or the
output model), the built-in prose (``prose.txt`` here, written for fastopt) and the user's text
files are tokenized: with the ``tokenizers`` package when it is installed, else with
onnxruntime-genai's tokenizer (it reads the same folder). Without one, the tokens are sampled
from the original model itself: from its start token, one greedy row and the rest sampled at
temperature 1 with a seeded generator, so they are text the model finds likely, never uniform
random ids (on which a quantized model's top-1 agreement says little: a real int4 Gemma 3
measured 0.25 on random ids against 0.64 on text, issue 29).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastopt.errors import UnsupportedModelError

if TYPE_CHECKING:
    import numpy as np
else:
    from fastopt._lazy import lazy_module

    np = lazy_module("numpy")  # imported on first use: `import fastopt` stays cheap

PROSE = "built-in prose"
TOKENIZER_FILE = "tokenizer.json"
# Sampled sequences (no tokenizer): rows, new tokens per row, temperature of rows 1..
SAMPLED_ROWS = 4
SAMPLED_STEPS = 48
TEMPERATURE = 1.0


class TextFileError(UnsupportedModelError):
    """A --verify-text file that cannot be read or tokenized: bad input (exit 2)."""


@dataclass
class Tokens:
    """Token sequences to score, and what made them."""

    source: str  # "tokenizer.json (tokenizers)", "sampled from the original model", ...
    texts: list[tuple[str, list[int]]] = field(default_factory=list)  # (name, ids) per text
    prefix: list[int] = field(default_factory=list)  # special ids every window starts with
    sampled: bool = False


def prose() -> str:
    return resources.files("fastopt.verify").joinpath("prose.txt").read_text(encoding="utf-8")


def read_text_file(path: str | os.PathLike[str]) -> str:
    """The text of a --verify-text file; one clear TextFileError when it cannot serve."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise TextFileError(
            f"--verify-text {p}: not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    except OSError as e:
        raise TextFileError(f"--verify-text {p}: cannot read it: {e.strerror or e}") from None
    if not text.strip():
        raise TextFileError(f"--verify-text {p}: the file is empty")
    return text


def check_text_inputs(
    texts: Sequence[str | os.PathLike[str]], tokenizer: str | os.PathLike[str] | None
) -> None:
    """Reads the --verify-text files and finds a given tokenizer before any work is done: a bad
    one is one clear TextFileError."""
    for t in texts:
        read_text_file(t)
    if tokenizer is not None:
        find_tokenizer(tokenizer, ())


def find_tokenizer(
    tokenizer: str | os.PathLike[str] | None, models: Sequence[str | os.PathLike[str]]
) -> str | None:
    """The tokenizer.json to use: `tokenizer` (the file, or a folder holding one; given and
    missing is an error), else the first found beside one of `models`; None when none is."""
    if tokenizer is not None:
        t = os.fspath(tokenizer)
        path = os.path.join(t, TOKENIZER_FILE) if os.path.isdir(t) else t
        if not os.path.isfile(path):
            raise TextFileError(f"tokenizer {t}: no {TOKENIZER_FILE} there")
        return path
    for m in models:
        if not isinstance(m, (str, os.PathLike)):
            continue
        path = os.path.join(os.path.dirname(os.path.abspath(os.fspath(m))), TOKENIZER_FILE)
        if os.path.isfile(path):
            return path
    return None


class NoTokenizerLibrary(Exception):
    """Neither the tokenizers package nor onnxruntime-genai can read the tokenizer here; the
    message says why (the check then samples its tokens from the model)."""


def tokenizers_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tokenizers") is not None


def _encoder(path: str) -> tuple[str, Callable[[str], list[int]], list[int]]:
    """(what encodes, encode(text) -> ids without specials, the ids every sequence starts
    with): the tokenizers package, else onnxruntime-genai's tokenizer (it reads a folder with a
    genai_config.json); NoTokenizerLibrary when neither can."""
    if tokenizers_installed():
        import tokenizers

        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:
            raise TextFileError(
                f"tokenizer {path}: the tokenizers package cannot read it: {e}"
            ) from None
        start = tok.encode("", add_special_tokens=True).ids  # a BOS the post-processor adds
        return (
            f"{path} (tokenizers)",
            lambda text: tok.encode(text, add_special_tokens=False).ids,
            list(start),
        )
    folder = os.path.dirname(path)
    if not os.path.isfile(os.path.join(folder, "genai_config.json")):
        raise NoTokenizerLibrary(
            f"{path} found, but the tokenizers package is not installed and onnxruntime-genai "
            "reads a tokenizer only beside a genai_config.json"
        )
    try:
        import onnxruntime_genai as og  # type: ignore[import-untyped]
    except ImportError:
        raise NoTokenizerLibrary(
            f"{path} found, but neither the tokenizers package nor onnxruntime-genai is installed"
        ) from None
    try:
        gtok = og.Tokenizer(folder)
    except Exception as e:
        raise TextFileError(f"tokenizer {path}: onnxruntime-genai cannot read it: {e}") from None
    return (
        f"{path} (onnxruntime-genai)",
        lambda text: [int(t) for t in gtok.encode(text)],
        [],
    )


def tokenize(path: str, texts: Sequence[tuple[str, str]], vocab: int) -> Tokens:
    """Tokenizes (name, text) pairs with the tokenizer at `path`; ids must fit the model's
    vocabulary of `vocab` (logits' last dim)."""
    source, encode, start = _encoder(path)
    out = Tokens(source, prefix=start)
    for name, text in texts:
        ids = encode(text)
        if len(ids) < 2:
            raise TextFileError(f"{name}: {len(ids)} token(s); the check needs at least 2")
        out.texts.append((name, [int(i) for i in ids]))
    top = max(max(ids) for _, ids in out.texts)
    if max([top, *start]) >= vocab:
        raise TextFileError(
            f"tokenizer {path} gives id {max([top, *start])}, beyond the model's vocabulary of "
            f"{vocab}: not this model's tokenizer"
        )
    return out


def start_token(model: str | os.PathLike[str], vocab: int) -> tuple[int, str]:
    """The token sampled sequences start from: bos_token_id from config.json /
    generation_config.json / a fixture's meta.json / genai_config.json (last: an older fastopt
    wrote its bos without knowing it) beside the model, else 0 (also when the id is outside the
    model's vocabulary); and where it came from."""
    folder = os.path.dirname(os.path.abspath(os.fspath(model)))
    ids, name = config_ids(folder, "bos_token_id")
    if ids and 0 <= ids[0] < vocab:
        return ids[0], f"bos_token_id {ids[0]} from {name}"
    if ids:
        return 0, f"token 0 ({name}'s bos_token_id {ids[0]} is not in the vocabulary)"
    return 0, "token 0 (no bos_token_id beside the model)"


def config_ids(folder: str, key: str) -> tuple[list[int], str]:
    """``key``'s ids (bos_token_id, eos_token_id: an int or a list) from the first of
    config.json / generation_config.json / a fixture's meta.json / genai_config.json in
    ``folder`` that has it (at the top or under "config" / "model"), and that file's name;
    ([], "") where none does."""
    for name in ("config.json", "generation_config.json", "meta.json", "genai_config.json"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        for d in (data, data.get("config"), data.get("model")) if isinstance(data, dict) else ():
            value = d.get(key) if isinstance(d, dict) else None
            found = value if isinstance(value, list) else [value]
            ids = [int(i) for i in found if isinstance(i, int) and not isinstance(i, bool)]
            if ids:
                return ids, name
    return [], ""


def sample_tokens(
    logits_of: Callable[[Any], Any],
    start: int,
    vocab: int,
    *,
    rows: int = SAMPLED_ROWS,
    steps: int = SAMPLED_STEPS,
    seed: int = 0,
) -> np.ndarray:
    """[rows, 1 + steps] ids continuing `start`: row 0 greedy, the others sampled at
    TEMPERATURE from the softmax of `logits_of(ids)` ([rows, n] -> [rows, n, vocab] float64,
    the original model recomputing the whole prefix), one uniform draw per row and step from
    numpy's default_rng(seed), inverted through the cumulative distribution."""
    rng = np.random.default_rng(seed)
    ids = np.full((rows, 1), start, np.int64)
    for _ in range(steps):
        last = logits_of(ids)[:, -1, :vocab].astype(np.float64)
        nxt = np.empty(rows, np.int64)
        nxt[0] = int(np.argmax(last[0]))
        if rows > 1:
            nxt[1:] = draw(last[1:], rng, TEMPERATURE)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
    return ids


def draw(last: np.ndarray, rng: Any, temperature: float, banned: Sequence[int] = ()) -> np.ndarray:
    """One token per row of ``last`` [rows, vocab], sampled from softmax(last / temperature) by
    one uniform draw per row inverted through the cumulative distribution; ``banned`` ids never
    (fastopt.quant.sampled_text's EOS)."""
    z = np.asarray(last, np.float64) / temperature
    z[:, [b for b in banned if 0 <= b < z.shape[1]]] = -np.inf
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(z)) * cdf[:, -1]
    picks = [int(np.searchsorted(c, x, side="right")) for c, x in zip(cdf, u)]
    return np.minimum(np.array(picks, np.int64), z.shape[1] - 1)
