"""``genai_config.json`` for onnxruntime-genai, derived from a decoder with a KV cache.

onnxruntime-genai loads a folder holding the model and this file (the layout its model builder
writes, ops.md §3.4). Everything here is read from the optimized graph, not from the exporter's
config: layers = number of ``present.{i}.key`` outputs, kv heads and head size from their shapes,
query heads from the attention ops, vocabulary from the logits, hidden size from the token
embedding. Token ids, the model type, the context length and the search options are not in an
ONNX graph: they come from the checkpoint's config.json and generation_config.json (genai.hf),
and where no file tells them genai's own defaults are written and the report says so.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from fastopt import _C
from fastopt.errors import UnsupportedModelError
from fastopt.genai.eos import in_vocabulary
from fastopt.genai.hf import GENAI_DEFAULTS, SEARCH_KEYS, HfValues

GENAI_CONFIG = "genai_config.json"
# A decoder's cache form (csrc/passes/kv_cache/cache_form.h; in place has the same names).
_FORM = _C.kv_cache_forms()["standard"]
PAST_KEY = _FORM.past_key
PAST_VALUE = _FORM.past_value
PRESENT_KEY = _FORM.present_key
PRESENT_VALUE = _FORM.present_value
# Written when neither a config nor the graph (rotary cos/sin table, position embedding) tells
# the context length: onnxruntime-genai refuses a config without one. Reported as a placeholder.
PLACEHOLDER_CONTEXT_LENGTH = 2048

_PRESENT_KEY_RE = re.compile("^" + re.escape(PRESENT_KEY).replace("%d", r"(\d+)") + "$")
# Attention ops and the attribute holding their number of query heads.
_HEADS_ATTR = {
    "GroupQueryAttention": "num_heads",
    "MultiHeadAttention": "num_heads",
    "Attention": "q_num_heads",  # ONNX Attention-23 and the internal op
}


class GenaiConfigError(UnsupportedModelError):
    """The graph lacks what onnxruntime-genai needs (names the missing piece)."""


class GenaiRunnerError(GenaiConfigError):
    """A cache that runs in ONNX Runtime but that onnxruntime-genai cannot hold (no config is
    written for it; the model itself is fine)."""


def int_dim(shape: tuple[int | str | None, ...] | None, axis: int) -> int | None:
    """Dim `axis` of `shape` when it is a positive number, else None."""
    if shape is None or len(shape) <= axis:
        return None
    d = shape[axis]
    return d if isinstance(d, int) and d > 0 else None


def _query_heads(graph: _C.Graph) -> int | None:
    for node in graph.nodes:
        attr = _HEADS_ATTR.get(node.op_type)
        if attr is not None and attr in node.attributes:
            return int(node.attributes[attr])
    return None


def _embedding(graph: _C.Graph) -> tuple[int, int] | None:
    """(vocab, hidden) of the Gather that reads input_ids from a 2-D weight."""
    ids = graph.value("input_ids")
    if ids is None:
        return None
    for node, index in ids.uses:
        if node.op_type == "Gather" and index == 1:
            w = node.inputs[0]
            if w is not None and w.shape is not None and len(w.shape) == 2:
                v, h = int_dim(w.shape, 0), int_dim(w.shape, 1)
                if v and h:
                    return v, h
    return None


def context_rows(graph: _C.Graph) -> int | None:
    """Rows of a rotary cos table (GQA cos_cache or RotaryEmbedding cos_cache) or of a learned
    position embedding (Gather on position_ids): the longest context the weights cover."""
    for node in graph.nodes:
        if node.op_type == "GroupQueryAttention" and len(node.inputs) > 7:
            cos = node.inputs[7]
            if cos is not None and int_dim(cos.shape, 0):
                return int_dim(cos.shape, 0)
        if node.op_type == "RotaryEmbedding":
            cos = node.inputs[2] if node.domain == "com.microsoft" else node.inputs[1]
            if cos is not None and cos.initializer is not None and int_dim(cos.shape, 0):
                return int_dim(cos.shape, 0)
    pos = graph.value("position_ids")
    if pos is not None:
        for node, index in pos.uses:
            w = node.inputs[0]
            if node.op_type == "Gather" and index == 1 and w is not None and w.initializer:
                return int_dim(w.shape, 0)
    return None


def genai_config(
    model: _C.Model,
    filename: str,
    *,
    inplace: bool,
    context_length: int | None = None,
    hf: HfValues | None = None,
) -> dict[str, Any]:
    """The config for ``model`` saved as ``filename`` (build_genai_config without its notes)."""
    return build_genai_config(
        model, filename, inplace=inplace, context_length=context_length, hf=hf
    )[0]


def is_in_place(model: _C.Model) -> bool:
    """past_key_values.0.key and present.0.key share their sequence dim's name: one max-length
    buffer bound as both (kv_cache "inplace"), as search.past_present_share_buffer tells genai."""
    values = {v.name: v for v in [*model.graph.inputs, *model.graph.outputs] if v is not None}
    past, present = values.get(PAST_KEY % 0), values.get(PRESENT_KEY % 0)
    if past is None or present is None or not past.shape or not present.shape:
        return False
    if len(past.shape) != 4 or len(present.shape) != 4:
        return False
    return isinstance(past.shape[2], str) and past.shape[2] == present.shape[2]


def _window_layers(graph: _C.Graph) -> dict[int, int]:
    """GroupQueryAttention index (in graph order) -> its local_window_size, where it has one."""
    gqa = [n for n in graph.nodes if n.op_type == "GroupQueryAttention"]
    return {
        i: int(n.attributes["local_window_size"])
        for i, n in enumerate(gqa)
        if int(n.attributes.get("local_window_size", -1)) > 0
    }


def build_genai_config(
    model: _C.Model,
    filename: str,
    *,
    inplace: bool,
    context_length: int | None = None,
    hf: HfValues | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The config for ``model`` saved as ``filename``, and the report's lines on where its values
    came from. Shapes come from the graph; token ids, model type, context length and search
    options from ``hf`` (the checkpoint's config.json / generation_config.json: genai.hf);
    where neither tells, genai's own default is written and a line says so. ``inplace``: past
    and present share one max-length buffer (search.past_present_share_buffer).
    ``context_length`` overrides the config's."""
    hf = hf or HfValues()
    notes = list(hf.notes)
    graph = model.graph
    outputs = {v.name: v for v in graph.outputs if v is not None}
    inputs = {v.name: v for v in graph.inputs if v is not None}
    layers = sorted(int(m.group(1)) for n in outputs if (m := _PRESENT_KEY_RE.match(n)))
    if not layers:
        raise GenaiConfigError("no present.{i}.key outputs: the model has no KV cache")
    if layers != list(range(len(layers))):
        raise GenaiConfigError(f"present.{{i}}.key outputs are not numbered 0..n-1: {layers}")
    for i in layers:
        for name in (PAST_KEY % i, PAST_VALUE % i):
            if name not in inputs:
                raise GenaiConfigError(f"input {name} is missing")
        if PRESENT_VALUE % i not in outputs:
            raise GenaiConfigError(f"output {PRESENT_VALUE % i} is missing")
    for name in ("input_ids", "attention_mask"):
        if name not in inputs:
            raise GenaiConfigError(f"input {name} is missing")
    if "logits" not in outputs:
        raise GenaiConfigError("output logits is missing")
    present = outputs[PRESENT_KEY % 0].shape
    # A symbolic dim (the model builder's "kv_cache_dim") is taken from the config.
    kv_heads = int_dim(present, 1) or hf.kv_heads
    head_size = int_dim(present, 3) or hf.head_size
    if kv_heads is None or head_size is None:
        raise GenaiConfigError(
            f"present.0.key shape {present} has no numeric kv heads (axis 1) / head size (axis 3)"
        )
    value = outputs[PRESENT_VALUE % 0].shape
    value_heads, value_size = int_dim(value, 1), int_dim(value, 3)
    if value_heads not in (None, kv_heads) or value_size not in (None, head_size):
        # genai 0.18 allocates past values with the keys' num_key_value_heads x head_size
        # (DeepSeek's MLA: keys nope+rope wide, values v_head_dim): its first step would fail.
        raise GenaiRunnerError(
            f"present.0.key has {kv_heads} heads of {head_size}, present.0.value "
            f"{value_heads} of {value_size}: onnxruntime-genai 0.18 sizes keys and values "
            "with one num_key_value_heads and head_size, so it cannot run this cache"
        )
    heads = _query_heads(graph) or kv_heads
    vocab = int_dim(outputs["logits"].shape, 2)
    embedding = _embedding(graph)
    if vocab is None and embedding is not None:
        vocab = embedding[0]
    if vocab is None:
        vocab = hf.vocab_size
    if vocab is None:
        raise GenaiConfigError("the vocabulary size (logits axis 2) is unknown")
    for what, in_graph, in_config in (
        ("num_hidden_layers", len(layers), hf.layers),
        ("num_key_value_heads", kv_heads, hf.kv_heads),
        ("head_size", head_size, hf.head_size),
    ):
        if in_config is not None and in_config != in_graph:
            notes.append(
                f"{what}: config.json says {in_config}, the graph {in_graph}: wrote the graph's"
            )
    hidden = embedding[1] if embedding is not None else hf.hidden_size
    if hidden is None:
        hidden = heads * head_size
        notes.append(
            f"hidden_size: neither the graph nor a config tells it: wrote num_attention_heads x "
            f"head_size = {hidden} (onnxruntime-genai 0.18 does not read it)"
        )
    context, fell_back = _pick_context(graph, context_length, hf, notes)
    model_values = {k: hf.model.get(k, GENAI_DEFAULTS.get(k)) for k in ("bos_token_id", "type")}
    pad = hf.model.get("pad_token_id", GENAI_DEFAULTS["pad_token_id"])
    # genai's default eos is the pad id (Config::Model: "If no eos_token_id was set, set it to
    # the pad token id").
    eos = hf.model.get("eos_token_id", pad)
    fitting = in_vocabulary(eos, vocab, notes)
    if fitting is None:
        raise GenaiConfigError(
            f"eos_token_id {eos} is outside the vocabulary ({vocab} tokens): onnxruntime-genai "
            "0.18 rejects it when it runs; give the checkpoint's files (hf_config / --hf-config "
            "DIR) with an eos the model's vocabulary holds"
        )
    eos = fitting
    unknown = [
        f"{k} {v!r}" if k == "type" else f"{k} {v}"
        for k, v in (*model_values.items(), ("pad_token_id", pad), ("eos_token_id", eos))
        if k not in hf.model
    ]
    if fell_back:
        unknown.append(f"context_length {context} (a placeholder: genai refuses none)")
    search = {k: hf.search.get(k, GENAI_DEFAULTS[k]) for k in SEARCH_KEYS}
    unknown += [f"{k} {json.dumps(search[k])}" for k in _REPORTED_SEARCH if k not in hf.search]
    max_length = hf.search.get("max_length", context)
    if max_length > context:
        notes.append(
            f"search.max_length: generation_config.json says {max_length}, more than the context "
            f"length: wrote {context}"
        )
        max_length = context
    if unknown:
        notes.append(
            "not known (no file tells them), onnxruntime-genai's defaults written: "
            + ", ".join(unknown)
        )
    windows = _window_layers(graph)
    if hf.sliding_window is not None or windows:
        notes.append(_sliding_note(hf, windows))
    decoder_inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if "position_ids" in inputs:
        decoder_inputs["position_ids"] = "position_ids"
    decoder_inputs |= {_FORM.genai_past_key: PAST_KEY, _FORM.genai_past_value: PAST_VALUE}
    config = {
        "model": {
            "bos_token_id": model_values["bos_token_id"],
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": head_size,
                "hidden_size": hidden,
                "inputs": decoder_inputs,
                "outputs": {
                    "logits": "logits",
                    _FORM.genai_present_key: PRESENT_KEY,
                    _FORM.genai_present_value: PRESENT_VALUE,
                },
                "num_attention_heads": heads,
                "num_hidden_layers": len(layers),
                "num_key_value_heads": kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": model_values["type"],
            "vocab_size": vocab,
        },
        "search": {
            **search,
            "max_length": max_length,
            "past_present_share_buffer": inplace,
        },
    }
    return config, notes


# The search options the report's fallback line names (the others rarely matter: beams, ...).
_REPORTED_SEARCH = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def _pick_context(
    graph: _C.Graph, given: int | None, hf: HfValues, notes: list[str]
) -> tuple[int, bool]:
    """(context_length, whether it is the placeholder). The caller's value, else the config's,
    capped by the rows of the graph's positional table (ONNX Runtime refuses positions past
    them), else those rows, else the placeholder genai needs (it refuses a config without one)."""
    rows = context_rows(graph)
    if given:
        return given, False
    if hf.context_length is not None:
        if rows is not None and rows < hf.context_length:
            notes.append(
                f"context_length: {hf.sources.get('context_length', 'the config')} says "
                f"{hf.context_length}, but the graph's positional table has {rows} rows "
                f"(positions past them fail): wrote {rows}"
            )
            return rows, False
        return hf.context_length, False
    if rows is not None:
        notes.append(
            f"context_length {rows}: from the graph (rows of its rotary or position table), "
            "no config tells the model's own"
        )
        return rows, False
    return PLACEHOLDER_CONTEXT_LENGTH, True


def _sliding_note(hf: HfValues, windows: dict[int, int]) -> str:
    """Why genai_config.json has no decoder.sliding_window: genai 0.18 then allocates a
    window-sized cache for those layers (ComputeWindowedKvCacheSize) that only a
    GroupQueryAttention evicting into it (sliding_window_cache=1) reads correctly; fastopt's
    graphs keep the full cache and apply the window in the attention itself."""
    said = ""
    if hf.sliding_window is not None:
        layers = f" on layers {hf.sliding_layers}" if hf.sliding_layers is not None else ""
        said = f"config.json: sliding_window {hf.sliding_window}{layers}; "
    graph = (
        "the graph's GroupQueryAttention applies local_window_size "
        + ", ".join(sorted({str(w) for w in windows.values()}))
        + f" on layers {sorted(windows)}"
        if windows
        else "the graph applies any window in its attention mask"
    )
    return (
        f"sliding window: {said}{graph} over a full-length cache; genai_config.json gets no "
        "decoder.sliding_window (genai would then allocate a window-sized cache this graph "
        "does not evict into)"
    )


def genai_config_bytes(config: dict[str, Any]) -> bytes:
    """``config`` as the JSON text written to ``genai_config.json``."""
    return (json.dumps(config, indent=4) + "\n").encode()


def write_genai_config(config: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Writes ``config`` as JSON, complete or absent, as ``Model.save`` writes a model file (the
    usual umask permissions, never over a directory or special file). To write it beside a
    model, pass ``side_files={GENAI_CONFIG: genai_config_bytes(config)}`` to ``Model.save``
    instead: then it is committed with the model and never describes another model file."""
    _C.write_file(os.fspath(path), genai_config_bytes(config))
