"""``genai_config.json`` for onnxruntime-genai, derived from a decoder with a KV cache.

onnxruntime-genai loads a folder holding the model and this file (the layout its model builder
writes, ops.md §3.4). Everything here is read from the optimized graph, not from the exporter's
config: layers = number of ``present.{i}.key`` outputs, kv heads and head size from their shapes,
query heads from the attention ops, vocabulary from the logits, hidden size from the token
embedding. Token ids and the model type are not in an ONNX graph: they are parameters.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from fastopt import _C
from fastopt.errors import UnsupportedModelError

GENAI_CONFIG = "genai_config.json"
PAST_KEY = _C.KV_PAST_PREFIX + "%d.key"
PAST_VALUE = _C.KV_PAST_PREFIX + "%d.value"
PRESENT_KEY = _C.KV_PRESENT_PREFIX + "%d.key"
PRESENT_VALUE = _C.KV_PRESENT_PREFIX + "%d.value"
# Used when the graph has no rotary cos/sin table or position embedding that bounds it.
DEFAULT_CONTEXT_LENGTH = 2048

_PRESENT_KEY_RE = re.compile("^" + re.escape(_C.KV_PRESENT_PREFIX) + r"(\d+)\.key$")
# Attention ops and the attribute holding their number of query heads.
_HEADS_ATTR = {
    "GroupQueryAttention": "num_heads",
    "MultiHeadAttention": "num_heads",
    "Attention": "q_num_heads",  # ONNX Attention-23 and the internal op
}


class GenaiConfigError(UnsupportedModelError):
    """The graph lacks what onnxruntime-genai needs (names the missing piece)."""


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


def _context_length(graph: _C.Graph) -> int | None:
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
    model_type: str = "llama",
    bos_token_id: int = 1,
    eos_token_id: int | list[int] = 2,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """The config for ``model`` saved as ``filename``. ``inplace``: past and present share one
    max-length buffer (search.past_present_share_buffer). ``context_length`` defaults to what the
    weights cover (rotary table or position embedding rows), else 2048. ``model_type`` selects
    onnxruntime-genai's model class; "llama" is its generic decoder-only one."""
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
    kv_heads, head_size = int_dim(present, 1), int_dim(present, 3)
    if kv_heads is None or head_size is None:
        raise GenaiConfigError(
            f"present.0.key shape {present} has no numeric kv heads (axis 1) / head size (axis 3)"
        )
    heads = _query_heads(graph) or kv_heads
    vocab = int_dim(outputs["logits"].shape, 2)
    embedding = _embedding(graph)
    if vocab is None and embedding is not None:
        vocab = embedding[0]
    if vocab is None:
        raise GenaiConfigError("the vocabulary size (logits axis 2) is unknown")
    hidden = embedding[1] if embedding is not None else heads * head_size
    context = context_length or _context_length(graph) or DEFAULT_CONTEXT_LENGTH
    decoder_inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if "position_ids" in inputs:
        decoder_inputs["position_ids"] = "position_ids"
    decoder_inputs |= {"past_key_names": PAST_KEY, "past_value_names": PAST_VALUE}
    return {
        "model": {
            "bos_token_id": bos_token_id,
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": head_size,
                "hidden_size": hidden,
                "inputs": decoder_inputs,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": PRESENT_KEY,
                    "present_value_names": PRESENT_VALUE,
                },
                "num_attention_heads": heads,
                "num_hidden_layers": len(layers),
                "num_key_value_heads": kv_heads,
            },
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "type": model_type,
            "vocab_size": vocab,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": inplace,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def genai_config_bytes(config: dict[str, Any]) -> bytes:
    """``config`` as the JSON text written to ``genai_config.json``."""
    return (json.dumps(config, indent=4) + "\n").encode()


def write_genai_config(config: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Writes ``config`` as JSON, complete or absent, as ``Model.save`` writes a model file (the
    usual umask permissions, never over a directory or special file). To write it beside a
    model, pass ``side_files={GENAI_CONFIG: genai_config_bytes(config)}`` to ``Model.save``
    instead: then it is committed with the model and never describes another model file."""
    _C.write_file(os.fspath(path), genai_config_bytes(config))
