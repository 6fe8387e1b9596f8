"""genai_config.json for a cache whose keys and values differ in shape (DeepSeek's MLA: keys
qk_nope + qk_rope wide, values v_head_dim): onnxruntime-genai 0.18 sizes both with one
num_key_value_heads and head_size, so the config is refused with the two shapes, never written
with the keys' head size (genai's first step then fails on the value's shape)."""

from __future__ import annotations

import onnx
import pytest
from fastopt._io import load_bytes
from fastopt.genai.config import GenaiConfigError, build_genai_config
from onnx import TensorProto, helper


def _cached_model(value_heads: int, value_size: int) -> bytes:
    """A one-layer cache wired through: input_ids -> logits [1, s, 8], past -> present."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, [1, "s"]),
        helper.make_tensor_value_info("attention_mask", i64, [1, "t"]),
        helper.make_tensor_value_info("past_key_values.0.key", f, [1, 4, "p", 48]),
        helper.make_tensor_value_info(
            "past_key_values.0.value", f, [1, value_heads, "p", value_size]
        ),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", f, [1, "s", 8]),
        helper.make_tensor_value_info("present.0.key", f, [1, 4, "p", 48]),
        helper.make_tensor_value_info("present.0.value", f, [1, value_heads, "p", value_size]),
    ]
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=f),
        helper.make_node("Unsqueeze", ["ids_f", "axis"], ["ids_3d"]),
        helper.make_node("Expand", ["ids_3d", "shape"], ["logits"]),
        helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"]),
        helper.make_node("Identity", ["past_key_values.0.value"], ["present.0.value"]),
    ]
    inits = [
        helper.make_tensor("axis", i64, [1], [2]),
        helper.make_tensor("shape", i64, [3], [1, 1, 8]),
    ]
    graph = helper.make_graph(nodes, "cache", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_value_head_size_unlike_the_keys_is_refused() -> None:
    model = load_bytes(_cached_model(4, 32))
    with pytest.raises(GenaiConfigError, match=r"present.0.value 4 of 32.*one num_key_value_heads"):
        build_genai_config(model, "model.onnx", inplace=False)


def test_value_like_the_keys_is_written() -> None:
    onnx.checker.check_model(onnx.load_from_string(_cached_model(4, 48)))
    config, _ = build_genai_config(load_bytes(_cached_model(4, 48)), "model.onnx", inplace=False)
    assert config["model"]["decoder"]["head_size"] == 48
