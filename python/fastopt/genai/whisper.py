"""An onnxruntime-genai whisper folder from a whisper encoder and no-cache decoder exported as
optimum splits them (encoder.onnx: input_features -> last_hidden_state; decoder.onnx:
input_ids, encoder_hidden_states -> logits).

What onnxruntime-genai 0.18 runs (its WhisperModel, model.type "whisper"; read from its source
and checked on CPU): the encoder gets ``audio_features`` (B, mels, frames) with frames exactly
3000 (it rejects other counts: "Whisper uses num_frames = 3000"), so the encoder must take 3000
frames (max_source_positions 1500). When the encoder has no ``present_key_cross_*`` outputs,
genai feeds its ``encoder_hidden_states`` output to every decoder step and binds only the
decoder's self-attention cache (``past_key_names`` / ``present_key_names``; with
search.past_present_share_buffer one max-length buffer per layer as both, and the input
``past_sequence_length`` (int32 (1)) set to the tokens it holds).

The folder holds one of genai's two forms:

- ``cross_cache="encoder"`` (default): the encoder also computes the cross-attention cache.
  The decoder is optimized with add_kv_cache's cross_attention_cache 2: its cross-attentions read
  ``past_key_values.<i>.encoder.key|value`` inputs, and the projections of
  ``encoder_hidden_states`` that computed them become ``present.<i>.encoder.*`` outputs.
  ``_C.move_cross_projections`` then moves those projections into the encoder graph, reading its
  ``last_hidden_state``. The weights are shared, not copied: the encoder's cross weights are
  views of the decoder's data, written once into each output. genai binds the encoder's outputs
  (``cross_present_key_names``) to the decoder's inputs (``cross_past_key_names``) and feeds the
  decoder no ``encoder_hidden_states``. Each step then reads the cached keys and values instead
  of projecting 1500 encoder rows again in every layer.
- ``cross_cache="recompute"``: the encoder gives ``encoder_hidden_states`` alone. genai feeds it
  to every decoder step, and the decoder's cross-attentions project it again each time
  (cross_attention_cache 0).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastopt import _C
from fastopt._io import load
from fastopt.errors import OptionError, UnsupportedModelError
from fastopt.genai.config import (
    GENAI_CONFIG,
    PLACEHOLDER_CONTEXT_LENGTH,
    context_rows,
    genai_config_bytes,
    int_dim,
)
from fastopt.genai.hf import (
    GENAI_DEFAULTS,
    GENERATION_CONFIG,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    find_hf_files,
)
from fastopt.optimize import OptimizeReport, optimize

# onnxruntime-genai 0.18's WhisperState accepts exactly this many audio frames.
GENAI_WHISPER_FRAMES = 3000
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder.onnx"
# The cache forms add_kv_cache writes (csrc/passes/kv_cache/cache_form.h): names and genai keys.
_FORMS = _C.kv_cache_forms()
_SELF = _FORMS["seq2seq"]
_SELF_INPLACE = _FORMS["seq2seq_inplace"]
_CROSS = _FORMS["seq2seq_cross_from_encoder"]
SELF_PAST_KEY = _SELF.past_key
SELF_PAST_VALUE = _SELF.past_value
SELF_PRESENT_KEY = _SELF.present_key
SELF_PRESENT_VALUE = _SELF.present_value
CROSS_PAST_KEY = _CROSS.past_key
CROSS_PAST_VALUE = _CROSS.past_value
CROSS_PRESENT_KEY = _CROSS.present_key
CROSS_PRESENT_VALUE = _CROSS.present_value
# The in-place decoder's input telling the tokens its buffers hold.
PAST_LENGTH_INPUT = _SELF_INPLACE.past_length
ENCODER_HIDDEN = "last_hidden_state"  # optimum's encoder output, the decoder's cross input
CROSS_CACHE_FORMS = ("encoder", "recompute")


@dataclass
class GenaiWhisperReport:
    folder: str
    encoder: OptimizeReport
    decoder: OptimizeReport
    config: dict[str, Any]
    # Token ids and the context length no config told: genai's defaults written (one line).
    notes: list[str]


def _frames(encoder: str | os.PathLike[str]) -> int | None:
    graph = load(encoder).graph
    features = next((v for v in graph.inputs if v is not None and v.name == "input_features"), None)
    if features is None:
        raise UnsupportedModelError(f"{encoder}: no input_features input (a whisper encoder's)")
    return int_dim(features.shape, 2) if features.shape and len(features.shape) == 3 else None


def whisper_for_genai(
    encoder: str | os.PathLike[str],
    decoder: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    config: Mapping[str, Any] | None = None,
    *,
    kv_cache: str = "inplace",
    max_length: int | None = None,
    cross_cache: str = "encoder",
    hf_config: str | os.PathLike[str] | None = None,
) -> GenaiWhisperReport:
    """Optimizes ``encoder`` and ``decoder`` (preset llm, target ort) into ``folder`` with a
    genai_config.json for onnxruntime-genai's whisper (see the module docstring). ``config``:
    the model's transformers config (token ids, layers, heads, max_target_positions).
    ``cross_cache``: "encoder" or "recompute" (the module docstring).
    ``hf_config``: the checkpoint's folder instead of (or beside) ``config``: its config.json,
    generation_config.json's token ids over config.json's, and its tokenizer files copied into
    ``folder`` (onnxruntime-genai opens the tokenizer there).
    Refused (UnsupportedModelError, nothing written) when the encoder does not take exactly 3000
    frames, which is all onnxruntime-genai 0.18 feeds a whisper encoder."""
    if cross_cache not in CROSS_CACHE_FORMS:
        raise OptionError(
            f"cross_cache must be one of {', '.join(CROSS_CACHE_FORMS)}, not {cross_cache!r}"
        )
    config, copies, hf_notes = _checkpoint(config, hf_config)
    frames = _frames(encoder)
    if frames != GENAI_WHISPER_FRAMES:
        raise UnsupportedModelError(
            f"onnxruntime-genai 0.18 runs a whisper encoder only on exactly "
            f"{GENAI_WHISPER_FRAMES} audio frames (its WhisperState rejects any other count: "
            f"'Whisper uses num_frames = {GENAI_WHISPER_FRAMES}'); this encoder's input_features "
            f"take {frames if frames is not None else 'an unknown number of'} frames "
            "(max_source_positions must be 1500)"
        )
    layers = int(config.get("decoder_layers", 0))
    heads = int(config.get("decoder_attention_heads", 0))
    hidden = int(config.get("d_model", 0))
    if not layers or not heads or not hidden:
        raise UnsupportedModelError(
            "config lacks decoder_layers / decoder_attention_heads / d_model"
        )
    from_encoder = cross_cache == "encoder"
    enc = optimize(os.fspath(encoder), preset="llm")
    dec = optimize(
        os.fspath(decoder),
        preset="llm",
        kv_cache=kv_cache,  # type: ignore[arg-type]
        options={"cross_attention_cache": 2 if from_encoder else 0},
    )
    assert enc.model is not None and dec.model is not None
    if from_encoder:
        _C.move_cross_projections(enc.model, ENCODER_HIDDEN, dec.model)
    graph = dec.model.graph
    inputs = {v.name: v for v in graph.inputs if v is not None}
    outputs = {v.name: v for v in graph.outputs if v is not None}
    pasts = [SELF_PAST_KEY, SELF_PAST_VALUE] + ([CROSS_PAST_KEY, CROSS_PAST_VALUE] * from_encoder)
    for i in range(layers):
        for name in (p % i for p in pasts):
            if name not in inputs:
                raise UnsupportedModelError(f"the cached decoder has no input {name}")
    head_size = hidden // heads
    notes: list[str] = list(hf_notes)
    unknown: list[str] = []
    context = _positive(config.get("max_target_positions"))
    if context is None:
        context = context_rows(graph)
        if context is not None:
            notes.append(f"context_length {context}: from the decoder's position table")
        else:
            context = PLACEHOLDER_CONTEXT_LENGTH
            unknown.append(f"context_length {context} (placeholder: genai needs one)")
    ids: dict[str, int] = {}
    for key in ("pad_token_id", "bos_token_id", "decoder_start_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            ids[key] = value
        else:  # genai 0.18's defaults: 0, and eos = pad
            ids[key] = ids["pad_token_id"] if key == "eos_token_id" else 0
            unknown.append(f"{key} {ids[key]}")
    if unknown:
        notes.append(
            "not known (the config does not tell them), onnxruntime-genai's defaults written: "
            + ", ".join(unknown)
        )
    decoder_inputs = {
        "input_ids": "input_ids",
        _SELF.genai_past_key: SELF_PAST_KEY,
        _SELF.genai_past_value: SELF_PAST_VALUE,
    }
    encoder_outputs = {"encoder_hidden_states": ENCODER_HIDDEN}
    if from_encoder:
        decoder_inputs[_CROSS.genai_past_key] = CROSS_PAST_KEY
        decoder_inputs[_CROSS.genai_past_value] = CROSS_PAST_VALUE
        encoder_outputs[_CROSS.genai_present_key] = CROSS_PRESENT_KEY
        encoder_outputs[_CROSS.genai_present_value] = CROSS_PRESENT_VALUE
    else:
        decoder_inputs["encoder_hidden_states"] = "encoder_hidden_states"
    inplace = PAST_LENGTH_INPUT in inputs
    if inplace:
        decoder_inputs[PAST_LENGTH_INPUT] = PAST_LENGTH_INPUT
    logits = outputs.get("logits")
    vocab = int_dim(logits.shape, 2) if logits is not None else None
    block = {"head_size": head_size, "hidden_size": hidden, "num_attention_heads": heads}
    encoder_heads = int(config.get("encoder_attention_heads", heads))
    encoder_block = {
        "head_size": hidden // encoder_heads,
        "hidden_size": hidden,
        "num_attention_heads": encoder_heads,
    }
    genai = {
        "model": {
            "type": "whisper",
            "bos_token_id": ids["bos_token_id"],
            "eos_token_id": ids["eos_token_id"],
            "pad_token_id": ids["pad_token_id"],
            "decoder_start_token_id": ids["decoder_start_token_id"],
            "context_length": context,
            "vocab_size": vocab or 0,
            "encoder": {
                "filename": ENCODER_FILE,
                **encoder_block,
                "num_hidden_layers": int(config.get("encoder_layers", layers)),
                "inputs": {"audio_features": "input_features"},
                "outputs": encoder_outputs,
            },
            "decoder": {
                "filename": DECODER_FILE,
                **block,
                "num_hidden_layers": layers,
                "num_key_value_heads": heads,
                "inputs": decoder_inputs,
                "outputs": {
                    "logits": "logits",
                    _SELF.genai_present_key: SELF_PRESENT_KEY,
                    _SELF.genai_present_value: SELF_PRESENT_VALUE,
                },
            },
        },
        "search": {
            "do_sample": False,
            "max_length": max_length or context,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": inplace,
            "top_k": GENAI_DEFAULTS["top_k"],
        },
    }
    out = os.fspath(folder)
    # The config is committed with the decoder, the last file written: a folder missing any of
    # the three is never mistaken for a complete one.
    enc.model.save(os.path.join(out, ENCODER_FILE))
    dec.model.save(
        os.path.join(out, DECODER_FILE),
        side_files={**copies, GENAI_CONFIG: genai_config_bytes(genai)},
    )
    for report, name in ((enc, ENCODER_FILE), (dec, DECODER_FILE)):
        assert report.model is not None
        report.output = os.path.join(out, name)
        report.ops_after = report.model.op_counts()
        report.nodes_after = sum(report.ops_after.values())
    return GenaiWhisperReport(out, enc, dec, genai, notes)


# generation_config.json's values over config.json's (as transformers' generate reads them).
_GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _checkpoint(
    config: Mapping[str, Any] | None, hf_config: str | os.PathLike[str] | None
) -> tuple[Mapping[str, Any], dict[str, bytes], list[str]]:
    """(the config, the files to copy beside the model, report lines) from ``config`` and the
    checkpoint folder ``hf_config``."""
    if hf_config is None:
        if config is None:
            raise OptionError("whisper_for_genai needs the model's config or hf_config")
        return config, {}, []
    files = find_hf_files(hf_config, None)
    assert files is not None  # find_hf_files refuses a folder without config.json
    merged = dict(files.config if config is None else config)
    taken = []
    for key in _GENERATION_KEYS:
        value = files.generation.get(key)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            merged[key] = value
            taken.append(key)
    copies = {k: v for k, v in files.copies.items() if k != GENAI_CONFIG}
    notes = []
    if taken:
        notes.append(f"{', '.join(taken)}: from {GENERATION_CONFIG} in {files.folder}")
    if files.has_tokenizer:
        notes.append(f"tokenizer: copied {', '.join(n for n in copies if n in TOKENIZER_FILES)}")
    else:
        notes.append(
            f"tokenizer: no {TOKENIZER_CONFIG} with tokenizer.json or a sentencepiece model in "
            f"{files.folder}: onnxruntime-genai's Tokenizer will not open the folder"
        )
    return merged, copies, notes


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
