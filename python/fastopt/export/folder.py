"""The output folder: built in a scratch folder beside it and renamed into place at the end,
so a failed export leaves nothing half-written; the checkpoint's tokenizer and generation
files copied next to the model (onnxruntime-genai opens the tokenizer from the model's
folder)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastopt.export.errors import ExportError
from fastopt.genai.hf import COPIED_FILES

# What onnxruntime-genai and the tokenizers read beside the model (genai.hf's list, which
# optimize copies for a decoder's genai folder) and a speech model's feature extractor config.
SIDE_FILES = (*COPIED_FILES, "preprocessor_config.json")
# Any of these makes a tokenizer transformers and onnxruntime-genai can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / n).is_file() for n in TOKENIZER_FILES)


def check_output(output: Path) -> None:
    """A new folder, or an empty one: an export never mixes its files with older ones."""
    if output.exists() and not output.is_dir():
        raise ExportError(f"{output}: exists and is not a folder (fastopt export writes a folder)")
    if output.is_dir() and any(output.iterdir()):
        raise ExportError(f"{output}: exists and is not empty; give a new folder")
    if not output.parent.is_dir():
        raise ExportError(f"{output.parent}: no such folder")


@contextmanager
def staging(output: Path) -> Iterator[Path]:
    """A scratch folder beside `output` (same file system: the final rename is atomic),
    renamed to `output` when the block succeeds, removed when it fails."""
    check_output(output)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".export", dir=output.parent))
    try:
        yield tmp
        if output.is_dir():
            output.rmdir()  # empty (check_output); a file appearing meanwhile fails the rmdir
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(source: Path, dest: Path) -> list[str]:
    """Copies the checkpoint's side files that `dest` does not have yet (optimize may have
    written its own from the same folder); returns their names."""
    copied = []
    for name in SIDE_FILES:
        src = source / name
        if src.is_file() and not (dest / name).exists():
            shutil.copyfile(src, dest / name)
            copied.append(name)
    return copied
