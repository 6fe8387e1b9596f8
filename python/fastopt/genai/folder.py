"""What ``optimize(output=...)`` writes beside the model for onnxruntime-genai: whether a
genai_config.json is written (and why not), the checkpoint files copied with it (tokenizer,
generation and model configs), and the report's lines on where each came from. The files are
committed with the model (Model.save's side files), so an old config never sits beside a new
model.
"""

from __future__ import annotations

import os

from fastopt import _C
from fastopt.genai.config import (
    GENAI_CONFIG,
    GenaiConfigError,
    GenaiRunnerError,
    build_genai_config,
    genai_config_bytes,
    is_in_place,
)
from fastopt.genai.hf import (
    CONFIG,
    GENERATION_CONFIG,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    HfFiles,
    HfValues,
)


def genai_side_files(
    model: _C.Model,
    out_path: str,
    *,
    kv_cache: str | None,
    hf_files: HfFiles | None,
    hf: HfValues,
    seq2seq: bool,
) -> tuple[dict[str, bytes], list[str]]:
    """(file name -> bytes to write beside `out_path`, the report's genai notes)."""
    side_files: dict[str, bytes] = {}
    genai_notes: list[str] = []
    if (
        kv_cache is None
        and hf_files is not None
        and hf_files.genai
        and _in_source_folder(hf_files, out_path)
    ):
        # Never replace the input's own genai_config.json unasked (it names the input).
        genai_notes = [
            f"genai_config.json not written: {hf_files.folder} holds the input's; write the "
            "output to another folder for a genai folder of its own"
        ]
    elif not seq2seq and (kv_cache is not None or hf_files is not None):
        # (onnxruntime-genai runs an encoder-decoder as a folder of encoder and decoder:
        # fastopt.genai.whisper writes one for whisper; a decoder alone gets no config.)
        # Before the model: a model without its config is of no use to onnxruntime-genai,
        # and a config that cannot be derived should leave nothing written (with kv_cache;
        # without it a model that is not genai's form just gets no config). Committed with
        # the model, so an old config never sits beside the new model.
        inplace = kv_cache == "inplace"
        if kv_cache is None:  # as the folder's genai_config.json binds it, else the graph
            inplace = is_in_place(model) if hf.share_buffer is None else hf.share_buffer
        try:
            config, notes = build_genai_config(
                model, os.path.basename(out_path), inplace=inplace, hf=hf
            )
        except GenaiRunnerError as e:  # the cached model runs in ORT; genai cannot hold it
            genai_notes = [f"genai_config.json not written: {e}"]
        except GenaiConfigError as e:
            if kv_cache is not None:
                raise
            assert hf_files is not None
            genai_notes = [
                f"genai_config.json not written (checkpoint files {hf_files.how} in "
                f"{hf_files.folder}): {e}; kv_cache / --kv-cache gives a decoder its cache"
            ]
        else:
            side_files[GENAI_CONFIG] = genai_config_bytes(config)
            genai_notes = _genai_notes(hf_files, notes, out_path)
            side_files |= _copies(hf_files, out_path)
    return side_files, genai_notes


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _in_source_folder(files: HfFiles, out_path: str) -> bool:
    return _same_folder(files.folder, os.path.dirname(os.path.abspath(out_path)))


def _copies(files: HfFiles | None, out_path: str) -> dict[str, bytes]:
    """The checkpoint files to write beside the output (none when it is their own folder)."""
    if files is None or _in_source_folder(files, out_path):
        return {}
    return {k: v for k, v in files.copies.items() if k != GENAI_CONFIG}


def _genai_notes(files: HfFiles | None, notes: list[str], out_path: str) -> list[str]:
    """The report's lines on a written genai_config.json: its sources, then build_genai_config's
    notes, then the tokenizer."""
    if files is None:
        lines = [
            "genai_config.json: no checkpoint files (config.json, generation_config.json, "
            "tokenizer) beside the model and no hf_config (--hf-config DIR)"
        ]
    else:
        lines = [f"genai_config.json from {files.describe()}"]
    lines += notes
    if files is not None and files.has_tokenizer:
        copied = _copies(files, out_path)
        names = [n for n in TOKENIZER_FILES if n in copied]
        also = [n for n in (GENERATION_CONFIG, CONFIG) if n in copied]
        lines.append(
            f"tokenizer: copied {', '.join(names)}"
            + (f" (and {', '.join(also)})" if also else "")
            + f" from {files.folder}"
            if names
            else f"tokenizer: the output's folder {files.folder} holds the tokenizer files"
        )
    else:
        where = f"in {files.folder}" if files is not None else "beside the model"
        lines.append(
            f"tokenizer: no {TOKENIZER_CONFIG} with tokenizer.json or a sentencepiece model "
            f"{where}: onnxruntime-genai's Tokenizer will not open the output's folder; pass "
            "hf_config (--hf-config DIR) with the checkpoint's tokenizer files, or copy them in"
        )
    return lines
