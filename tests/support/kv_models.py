"""Graphs with an internal Attention over Q/K/V inputs and an export-style mask, for the KV-cache
tests (test_add_kv_cache, test_sliding_window)."""

from __future__ import annotations

import numpy as np
import onnx

H = onnx.helper


TP = onnx.TensorProto


def mask_nodes(kind: str = "causal", window: int = 0) -> tuple[list, list]:  # type: ignore[type-arg]
    """(nodes, initializers) computing the bool mask "mask" (B, 1, S, T) from attention_mask
    (B, T) and input_ids' length S, the way exporters build it: query s at position T - S + s
    sees key t iff t <= T - S + s (and t > T - S + s - window), and attention_mask[b, t].
    kind "padding-only": no causality; "strict": the query's own key masked too; "positions":
    the query positions come from position_ids; "random": And with a random constant."""
    c = onnx.numpy_helper.from_array
    inits = [
        c(np.array(0, np.int64), "m_zero"),
        c(np.array(1, np.int64), "m_one"),
        c(np.array([1], np.int64), "m_axis1"),
        c(np.array([1, 2], np.int64), "m_axes12"),
        c(np.array(window, np.int64), "m_window"),
    ]
    nodes = [
        H.make_node("Shape", ["attention_mask"], ["m_mshape"]),
        H.make_node("Gather", ["m_mshape", "m_one"], ["m_total"], axis=0),
        H.make_node("Shape", ["input_ids"], ["m_ishape"]),
        H.make_node("Gather", ["m_ishape", "m_one"], ["m_seq"], axis=0),
        H.make_node("Sub", ["m_total", "m_seq"], ["m_past"]),
        H.make_node("Range", ["m_zero", "m_total", "m_one"], ["m_keys"]),
        H.make_node("Cast", ["attention_mask"], ["m_bool"], to=TP.BOOL),
        H.make_node("Unsqueeze", ["m_bool", "m_axes12"], ["m_pad"]),
    ]
    if kind == "positions":
        nodes.append(H.make_node("Unsqueeze", ["position_ids", "m_axis1"], ["m_qcol"]))
    else:
        nodes.append(H.make_node("Range", ["m_past", "m_total", "m_one"], ["m_queries"]))
        nodes.append(H.make_node("Unsqueeze", ["m_queries", "m_axis1"], ["m_qcol"]))
    less = "Less" if kind == "strict" else "LessOrEqual"
    nodes.append(H.make_node(less, ["m_keys", "m_qcol"], ["m_causal"]))
    last = "m_causal"
    if window:
        nodes.append(H.make_node("Sub", ["m_qcol", "m_window"], ["m_oldest"]))
        nodes.append(H.make_node("Greater", ["m_keys", "m_oldest"], ["m_inside"]))
        nodes.append(H.make_node("And", [last, "m_inside"], ["m_windowed"]))
        last = "m_windowed"
    if kind == "padding-only":
        nodes.append(H.make_node("Identity", ["m_pad"], ["mask"]))
        return nodes, inits
    if kind == "random":
        rng = np.random.default_rng(0)
        inits.append(c(rng.random((16, 16)) < 0.5, "m_random"))
        nodes.append(H.make_node("Shape", ["m_causal"], ["m_cshape"]))
        nodes.append(H.make_node("Slice", ["m_random", "m_zero1", "m_cshape_end"], ["m_rand"]))
        inits += [c(np.array([0, 0], np.int64), "m_zero1")]
        nodes.append(H.make_node("Identity", ["m_cshape"], ["m_cshape_end"]))
        nodes.append(H.make_node("And", [last, "m_rand"], ["m_randomized"]))
        last = "m_randomized"
    nodes.append(H.make_node("And", ["m_pad", last], ["mask"]))
    return nodes, inits


def attention_model(
    seq: int | str = "S",
    k_shape: tuple[int | str, ...] = ("B", 2, "S", 16),
    extra_inputs: tuple[str, ...] = (),
    constant_mask: bool = False,
    mask: str = "causal",
    window: int = 0,
) -> bytes:
    """input_ids/attention_mask plus an internal Attention over Q/K/V graph inputs, its mask
    built by mask_nodes (or a graph input "mask" for mask="input")."""
    inputs = [
        H.make_tensor_value_info("input_ids", TP.INT64, ["B", seq]),
        H.make_tensor_value_info("attention_mask", TP.INT64, ["B", seq]),
        H.make_tensor_value_info("q", TP.FLOAT, ["B", 4, seq, 16]),
        H.make_tensor_value_info("k", TP.FLOAT, list(k_shape)),
        H.make_tensor_value_info("v", TP.FLOAT, ["B", 2, seq, 16]),
    ] + [H.make_tensor_value_info(n, TP.FLOAT, ["B", 2, "P", 16]) for n in extra_inputs]
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    if constant_mask:
        inits.append(onnx.numpy_helper.from_array(np.ones((1, 1, 8, 8), dtype=bool), "mask"))
    elif mask == "input":
        inputs.append(H.make_tensor_value_info("mask", TP.BOOL, ["B", 1, seq, seq]))
    else:
        if mask == "positions":
            inputs.append(H.make_tensor_value_info("position_ids", TP.INT64, ["B", seq]))
        nodes, inits = mask_nodes(mask, window)
    att = internal_attention(["q", "k", "v", "mask"])
    graph = H.make_graph(
        [*nodes, att], "g", inputs, [H.make_tensor_value_info("y", TP.FLOAT, None)], inits
    )
    return with_opsets(graph)


def internal_attention(inputs: list[str]) -> onnx.NodeProto:
    """The internal op (internal_op.h) with 4 query heads over 2 kv heads -> y."""
    return H.make_node(
        "Attention",
        inputs,
        ["y"],
        domain="ai.fastopt.internal",
        scale=0.25,
        is_causal=0,
        q_num_heads=4,
        kv_num_heads=2,
    )


def with_opsets(graph: onnx.GraphProto) -> bytes:
    model = H.make_model(
        graph, opset_imports=[H.make_opsetid("", 18), H.make_opsetid("ai.fastopt.internal", 1)]
    )
    return model.SerializeToString()
