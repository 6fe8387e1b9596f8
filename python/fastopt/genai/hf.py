"""The Hugging Face checkpoint files a genai folder is written from: ``config.json``,
``generation_config.json`` and the tokenizer files, read from ``--hf-config DIR`` or found
beside the input model.

genai_config.json takes token ids, the model type, the context length and the search defaults
from them (everything else comes from the graph: fastopt.genai_config); the tokenizer files are
copied into the output folder so that ``og.Tokenizer(og.Model(folder))`` opens it. Where no file
tells a value, genai's own default is written (GENAI_DEFAULTS) and the report says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from fastopt.errors import OptionError
from fastopt.genai.eos import end_of_text_tokens

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
# A genai folder's own config (the model builder's, or an earlier fastopt run's): read where no
# Hugging Face config tells a value, never copied (the output gets its own).
GENAI_CONFIG = "genai_config.json"
# Files onnxruntime-genai's tokenizer (onnxruntime-extensions) or transformers read beside the
# model; genai needs tokenizer_config.json plus tokenizer.json or a sentencepiece model.
# config.json too: a later fastopt run on the written model finds it there.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
COPIED_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG, CONFIG)
# Without it onnxruntime-genai 0.18's Tokenizer refuses the folder ("Failed to open
# tokenizer_config.json").
TOKENIZER_CONFIG = "tokenizer_config.json"
# The largest file copied (a tokenizer.json is a few MB; the copies are held in memory until
# they are committed with the model).
MAX_COPIED_BYTES = 64 << 20

# onnxruntime-genai 0.18's defaults (src/config.h: Config::Model and Config::Search), written
# where no file tells a value. genai has no default model type or context length: "decoder" is
# its generic decoder-only type (DecoderOnly_Model), and it refuses a context_length of 0.
GENAI_DEFAULTS: dict[str, Any] = {
    "bos_token_id": 0,
    "pad_token_id": 0,
    "type": "decoder",
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 0.0,
    "repetition_penalty": 1.0,
    "num_beams": 1,
    "num_return_sequences": 1,
    "min_length": 0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "diversity_penalty": 0.0,
    "early_stopping": True,
}
# genai's search options fastopt takes from generation_config.json (same names in both).
SEARCH_KEYS = (
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "num_beams",
    "num_return_sequences",
    "min_length",
    "length_penalty",
    "no_repeat_ngram_size",
    "diversity_penalty",
    "early_stopping",
)
# transformers model_type -> onnxruntime-genai 0.18 model.type, for the types whose genai runner
# is its DecoderOnly_Model (separate past_key_values.%d.key/value, which fastopt writes).
# Absent: types genai does not know, and "gpt2", whose genai runner (Gpt_Model) binds a combined
# past_%d cache. Those get genai's generic "decoder".
GENAI_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "gemma3": "gemma3_text",  # a Gemma3ForConditionalGeneration config; its text decoder
    "phi": "phi",
    "phi3": "phi3",
    "phimoe": "phimoe",
    "granite": "granite",
    "olmo": "olmo",
    "nemotron": "nemotron",
    "smollm3": "smollm3",
    "ernie4_5": "ernie4_5",
    "internlm2": "internlm2",
    "chatglm": "chatglm",
    "gpt_oss": "gptoss",
}
# transformers' names for the longest context a config allows, in the order they are preferred.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class HfFiles:
    """The checkpoint files found for a model: parsed configs and the files to copy."""

    folder: str
    how: str  # "given by --hf-config" or "found beside the model"
    config: dict[str, Any] = field(default_factory=dict)  # config.json ({} when absent)
    generation: dict[str, Any] = field(default_factory=dict)  # generation_config.json
    genai: dict[str, Any] = field(default_factory=dict)  # genai_config.json (read, not copied)
    copies: dict[str, bytes] = field(default_factory=dict)  # file name -> bytes to copy

    def describe(self) -> str:
        names = [n for n in (CONFIG, GENERATION_CONFIG) if n in self.copies]
        if self.genai:
            names.append(GENAI_CONFIG)
        return f"{', '.join(names) or 'no config.json'} in {self.folder} ({self.how})"

    @property
    def has_tokenizer(self) -> bool:
        return TOKENIZER_CONFIG in self.copies and any(
            n in self.copies for n in TOKENIZER_FILES if n != TOKENIZER_CONFIG
        )

    def text_config(self) -> dict[str, Any]:
        """config.json's values with a multimodal config's text_config (the decoder) on top."""
        text = self.config.get("text_config")
        return {**self.config, **text} if isinstance(text, dict) else dict(self.config)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OptionError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(value, dict):
        raise OptionError(f"{path} is not a JSON object")
    return value


def _read_copy(path: str) -> bytes:
    size = os.path.getsize(path)
    if size > MAX_COPIED_BYTES:
        raise OptionError(f"{path} is {size} bytes, more than a tokenizer file should be")
    with open(path, "rb") as f:
        return f.read()


def find_hf_files(
    hf_config: str | os.PathLike[str] | None, model_path: str | None
) -> HfFiles | None:
    """The checkpoint files of ``hf_config`` (a folder, or a config.json in one; OptionError when
    it holds no config.json), else those beside ``model_path``; None when neither has any."""
    if hf_config is not None:
        folder = os.fspath(hf_config)
        if os.path.isfile(folder) and os.path.basename(folder) == CONFIG:
            folder = os.path.dirname(os.path.abspath(folder))
        if not os.path.isdir(folder):
            raise OptionError(f"hf_config: {folder} is not a folder")
        if not os.path.isfile(os.path.join(folder, CONFIG)):
            raise OptionError(
                f"hf_config: {folder} has no {CONFIG} (give the Hugging Face checkpoint's folder)"
            )
        how = "given by hf_config"
    elif model_path:
        folder = os.path.dirname(os.path.abspath(model_path))
        how = "found beside the model"
    else:
        return None
    files = HfFiles(folder, how)
    for name in COPIED_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            files.copies[name] = _read_copy(path)
    genai = os.path.join(folder, GENAI_CONFIG)
    if os.path.isfile(genai):
        files.genai = _read_json(genai)
    if not files.copies and not files.genai:
        return None
    if CONFIG in files.copies:
        files.config = _read_json(os.path.join(folder, CONFIG))
    if GENERATION_CONFIG in files.copies:
        files.generation = _read_json(os.path.join(folder, GENERATION_CONFIG))
    return files


def _int_or_ints(value: Any) -> int | list[int] | None:
    """A token id or a list of them as JSON has it; None for null, an empty list or not ints."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return value[0] if len(value) == 1 else list(value)
    return None


@dataclass
class HfValues:
    """What the checkpoint files tell genai_config.json: values, their sources, and the keys
    that fell back to genai's defaults (with the value written)."""

    model: dict[str, Any] = field(default_factory=dict)  # bos/eos/pad_token_id, type
    search: dict[str, Any] = field(default_factory=dict)
    context_length: int | None = None
    hidden_size: int | None = None
    sources: dict[str, str] = field(default_factory=dict)  # key -> file it came from
    notes: list[str] = field(default_factory=list)
    layers: int | None = None
    kv_heads: int | None = None
    head_size: int | None = None
    vocab_size: int | None = None
    sliding_window: int | None = None
    sliding_layers: list[int] | None = None
    # A genai_config.json's search.past_present_share_buffer (its graph's cache binding).
    share_buffer: bool | None = None


def _add_end_of_turn(out: HfValues, files: HfFiles) -> None:
    """Without a generation_config.json's eos list, the tokenizer's eos_token and the chat
    template's end of turn join config.json's eos (a chat model stops at its end of turn)."""
    have = out.model.get("eos_token_id")
    ids = [] if have is None else list(have) if isinstance(have, list) else [have]
    added = [(i, t, where) for i, t, where in end_of_text_tokens(files.copies) if i not in ids]
    if not added:
        return
    ids += [i for i, _, _ in added]
    out.model["eos_token_id"] = ids if len(ids) > 1 else ids[0]
    out.sources.setdefault("eos_token_id", TOKENIZER_CONFIG)
    said = f"{out.sources['eos_token_id']}'s {have}" if have is not None else "no config's eos"
    out.notes.append(
        "eos_token_id: added "
        + ", ".join(f"{i} ({t}, {where})" for i, t, where in added)
        + f" to {said}: no {GENERATION_CONFIG} lists a chat model's end of turn"
    )


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def hf_values(files: HfFiles | None) -> HfValues:
    """genai_config.json's values from ``files`` (generation_config.json over config.json for
    token ids and search options, as transformers' generate and genai's model builder take them).
    Keys no file tells are absent: the caller writes GENAI_DEFAULTS and reports them."""
    out = HfValues()
    if files is None:
        return out
    config = files.text_config()
    gen = files.generation
    prior = _section(files.genai, "model")
    prior_search = _section(files.genai, "search")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        for source, name in ((gen, GENERATION_CONFIG), (config, CONFIG), (prior, GENAI_CONFIG)):
            value = _int_or_ints(source.get(key))
            if value is not None and (key == "eos_token_id" or isinstance(value, int)):
                out.model[key] = value
                out.sources[key] = name
                break
    if out.sources.get("eos_token_id") != GENERATION_CONFIG:
        _add_end_of_turn(out, files)
    hf_type = config.get("model_type")
    if isinstance(hf_type, str) and hf_type:
        genai_type = GENAI_TYPES.get(hf_type)
        if genai_type is not None:
            out.model["type"] = genai_type
            out.sources["type"] = CONFIG
        else:
            why = (
                "genai's gpt2 runner binds a combined past_%d cache, not this graph's separate "
                "key/value"
                if hf_type == "gpt2"
                else "onnxruntime-genai 0.18 has no model type for it"
            )
            out.notes.append(
                f"type: model_type {hf_type!r} ({CONFIG}) is not one of genai's decoder types "
                f"({why}): wrote genai's generic {GENAI_DEFAULTS['type']!r}"
            )
    elif isinstance(prior.get("type"), str) and prior["type"]:
        out.model["type"] = prior["type"]
        out.sources["type"] = GENAI_CONFIG
    for key in _CONTEXT_KEYS:
        value = _positive_int(config.get(key))
        if value is not None:
            out.context_length = value
            out.sources["context_length"] = f"{CONFIG} {key}"
            break
    if out.context_length is None and _positive_int(prior.get("context_length")):
        out.context_length = prior["context_length"]
        out.sources["context_length"] = GENAI_CONFIG
    for key in SEARCH_KEYS:
        value = gen.get(key, prior_search.get(key) if not gen else None)
        default = GENAI_DEFAULTS[key]
        if value is None:
            continue
        if isinstance(default, bool) and isinstance(value, bool):
            out.search[key] = value
        elif isinstance(default, (int, float)) and isinstance(value, (int, float)):
            out.search[key] = type(default)(value)
        else:
            continue
        out.sources[key] = GENERATION_CONFIG if gen else GENAI_CONFIG
    max_length = _positive_int(gen.get("max_length"))
    if max_length is not None:
        out.search["max_length"] = max_length
        out.sources["max_length"] = GENERATION_CONFIG
    shared = prior_search.get("past_present_share_buffer")
    if isinstance(shared, bool):
        out.share_buffer = shared
    carried = [
        k for k, source in out.sources.items() if source == GENAI_CONFIG and k not in SEARCH_KEYS
    ]
    if any(out.sources.get(k) == GENAI_CONFIG for k in SEARCH_KEYS):
        carried.append("the search options")
    if carried:
        out.notes.append(
            f"from the {GENAI_CONFIG} in {files.folder} (no Hugging Face file tells them): "
            + ", ".join(carried)
        )
    out.hidden_size = _positive_int(config.get("hidden_size") or config.get("n_embd"))
    out.layers = _positive_int(config.get("num_hidden_layers") or config.get("n_layer"))
    heads = _positive_int(config.get("num_attention_heads") or config.get("n_head"))
    out.kv_heads = _positive_int(config.get("num_key_value_heads")) or heads
    out.head_size = _positive_int(config.get("head_dim")) or (
        out.hidden_size // heads if out.hidden_size and heads else None
    )
    decoder = _section(prior, "decoder")
    for attr, key in (
        ("hidden_size", "hidden_size"),
        ("layers", "num_hidden_layers"),
        ("kv_heads", "num_key_value_heads"),
        ("head_size", "head_size"),
    ):
        if getattr(out, attr) is None and _positive_int(decoder.get(key)):
            setattr(out, attr, decoder[key])
    out.vocab_size = _positive_int(config.get("vocab_size")) or _positive_int(
        prior.get("vocab_size")
    )
    # Qwen2's config names a window it does not use (use_sliding_window false).
    if config.get("use_sliding_window") is not False:
        out.sliding_window = _positive_int(config.get("sliding_window"))
    types = config.get("layer_types")
    if out.sliding_window and isinstance(types, list):
        out.sliding_layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return out
