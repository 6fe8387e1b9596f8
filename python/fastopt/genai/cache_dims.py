"""The KV-cache geometry (kv heads, head size) of a decoder whose past inputs leave it symbolic.

onnxruntime-genai's model builder names the head size of ``past_key_values.*`` a dim_param
(``kv_cache_dim``): ONNX Runtime then accepts any size at load and fails at the first run with
the wrong one. The sizes come from ``genai_config.json`` next to the model (the builder writes
one: ``model.decoder.num_key_value_heads`` and ``head_size``), else from the graph's
GroupQueryAttention (``kv_num_heads``; the head size from the packed QKV projection's width,
``(num_heads + 2 * kv_num_heads) * head_size``, or from its key projection).
"""

from __future__ import annotations

import json
import os
from typing import Any

from fastopt import _C
from fastopt.genai.config import GENAI_CONFIG


def _from_config(path: str) -> tuple[int, int] | None:
    config_path = os.path.join(os.path.dirname(os.path.abspath(path)), GENAI_CONFIG)
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path) as f:
            decoder = json.load(f)["model"]["decoder"]
        heads, size = int(decoder["num_key_value_heads"]), int(decoder["head_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a config we can read: the graph may still tell
    return (heads, size) if heads > 0 and size > 0 else None


def _width(v: _C.Value | None) -> int | None:
    """The last dim of `v`: from its type, or from the weight of the MatMul (and bias Add)
    that computes it."""
    for _ in range(4):
        if v is None:
            return None
        shape = v.shape
        if shape and isinstance(shape[-1], int) and shape[-1] > 0:
            return int(shape[-1])
        node = v.producer
        if node is None or node.op_type not in ("MatMul", "Add"):
            return None
        weights = [i.initializer for i in node.inputs if i is not None and i.initializer]
        if node.op_type == "MatMul" and weights and len(weights[-1].shape) == 2:
            return int(weights[-1].shape[1])
        v = next((i for i in node.inputs if i is not None and i.initializer is None), None)
    return None


def _from_graph(model: _C.Model) -> tuple[int, int] | None:
    for node in model.graph.nodes:
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = node.attributes
        heads, kv = attrs.get("num_heads"), attrs.get("kv_num_heads")
        if not isinstance(heads, int) or not isinstance(kv, int) or heads <= 0 or kv <= 0:
            continue
        inputs = list(node.inputs)
        key = inputs[1] if len(inputs) > 1 else None
        if key is not None:
            width = _width(key)
            if width and width % kv == 0:
                return kv, width // kv
        width = _width(inputs[0] if inputs else None)
        if width and width % (heads + 2 * kv) == 0:
            return kv, width // (heads + 2 * kv)
    return None


def cache_geometry(model: Any) -> tuple[int, int] | None:
    """(kv heads, head size) of `model` (a path, or anything else fastopt.verify.core takes), or
    None when neither genai_config.json nor the graph tells."""
    if isinstance(model, (str, os.PathLike)):
        found = _from_config(os.fspath(model))
        if found is not None:
            return found
        from fastopt._io import load

        model = load(model)
    if isinstance(model, _C.Model):
        return _from_graph(model)
    return None
