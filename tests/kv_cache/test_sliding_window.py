"""Sliding-window attention through the KV-cache rewrite (issue 13): add_kv_cache proves each
attention's mask (causal, or causal with a window of w keys, with padding) before replacing it,
and refuses any other; the window survives into every cached form. The gemma3 fixtures' greedy
generation is checked by test_kv_generation.py (they are decoder fixtures like the others)."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from support.kv_models import attention_model
from support.llm_fixtures import fixtures, ids

GEMMA3 = fixtures(arch="gemma3", dtype="float32")


def test_gqa_local_window_size_counts_the_query() -> None:
    """ONNX Runtime's GroupQueryAttention local_window_size = w: a query sees its own key and the
    w - 1 before it, as transformers' sliding_window = w (lower_attention_ort relies on it)."""
    t, d = 10, 16
    for window in (2, 4):
        node = helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "", "", "seqlens", "total"],
            ["y", "pk", "pv"],
            domain="com.microsoft",
            num_heads=1,
            kv_num_heads=1,
            local_window_size=window,
        )
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, t, d]) for n in "qkv"]
        inputs += [
            helper.make_tensor_value_info("seqlens", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total", TensorProto.INT32, []),
        ]
        out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
        model = helper.make_model(
            helper.make_graph([node], "g", inputs, out),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        zeros = np.zeros((1, t, d), np.float32)
        v = zeros.copy()
        v[0, np.arange(t), np.arange(t)] = 1  # output column j = weight on key j
        feed = {"q": zeros, "k": zeros, "v": v}
        feed |= {"seqlens": np.array([t - 1], np.int32), "total": np.array(t, np.int32)}
        (y,) = sess.run(["y"], feed)
        for i in range(t):
            seen = np.flatnonzero(y[0, i, :t] > 0)
            assert list(seen) == list(range(max(0, i - window + 1), i + 1)), (window, i)


def _add_cache(model: bytes, out: Path | None = None) -> fastopt.OptimizeReport:
    return fastopt.optimize(
        fastopt.load_bytes(model), passes=["add_kv_cache"], options={"kv_cache": 1}, output=out
    )


def test_a_proven_window_is_kept() -> None:
    model = fastopt.load_bytes(attention_model(window=3))
    ctx = fastopt.PassContext(model=model, target="ort", options={"kv_cache": 1})
    assert fastopt.get_pass("add_kv_cache").run(ctx) == 1
    assert ctx.counters["sliding-window layers"] == 1
    att = next(n for n in model.to_onnx().graph.node if n.op_type == "Attention")
    attrs = {a.name: helper.get_attribute_value(a) for a in att.attribute}
    assert attrs["sliding_window"] == 3 and att.input[3] == "kv_sliding_window_mask"


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        ("input", "reads the graph input 'mask'"),
        ("positions", "depends on the values of input 'position_ids'"),
        ("padding-only", "query 0 sees key 1"),
        ("strict", "query 0 does not see key 0"),
        ("random", "unlike a causal mask"),
    ],
)
def test_a_mask_it_does_not_know_is_refused(mask: str, message: str, tmp_path: Path) -> None:
    """Nothing is written; the message names the layer and what the mask does."""
    out = tmp_path / "out.onnx"
    with pytest.raises(fastopt.ModelError, match=f"mask of layer 0 .*{message}"):
        _add_cache(attention_model(mask=mask), out)
    assert not out.exists()


def test_a_computed_window_is_found() -> None:
    """A window the graph computes (Mul(256, 2)) is probed around too: proven 512, not taken
    for a plain causal mask from probes shorter than the window."""
    model = onnx.load_from_string(attention_model(window=512))
    g = model.graph
    (w,) = [i for i in g.initializer if i.name == "m_window"]
    g.initializer.remove(w)
    g.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.array(256, np.int64), "m_half"),
            onnx.numpy_helper.from_array(np.array(2, np.int64), "m_two"),
        ]
    )
    g.node.insert(0, helper.make_node("Mul", ["m_half", "m_two"], ["m_window"]))
    loaded = fastopt.load_bytes(model.SerializeToString())
    ctx = fastopt.PassContext(model=loaded, target="ort", options={"kv_cache": 1})
    assert fastopt.get_pass("add_kv_cache").run(ctx) == 1
    att = next(n for n in loaded.to_onnx().graph.node if n.op_type == "Attention")
    attrs = {a.name: helper.get_attribute_value(a) for a in att.attribute}
    assert attrs["sliding_window"] == 512


def _window_of(model: onnx.ModelProto) -> int:
    loaded = fastopt.load_bytes(model.SerializeToString())
    ctx = fastopt.PassContext(model=loaded, target="ort", options={"kv_cache": 1})
    assert fastopt.get_pass("add_kv_cache").run(ctx) == 1
    att = next(n for n in loaded.to_onnx().graph.node if n.op_type == "Attention")
    return int({a.name: helper.get_attribute_value(a) for a in att.attribute}["sliding_window"])


def test_a_window_beyond_the_probes_is_proven_by_substitution() -> None:
    """A window of 4096, beyond the probed lengths, that is only an offset compared with the
    positions: proven with the constant replaced by two probed values (the window follows)."""
    assert _window_of(onnx.load_from_string(attention_model(window=4096))) == 4096


def test_a_computed_window_beyond_the_probes_is_refused() -> None:
    """Computed (Mul(2048, 2)), the constant is no offset the proof can replace: refused."""
    model = onnx.load_from_string(attention_model(window=4096))
    g = model.graph
    (w,) = [i for i in g.initializer if i.name == "m_window"]
    g.initializer.remove(w)
    g.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.array(2048, np.int64), "m_half"),
            onnx.numpy_helper.from_array(np.array(2, np.int64), "m_two"),
        ]
    )
    g.node.insert(0, helper.make_node("Mul", ["m_half", "m_two"], ["m_window"]))
    with pytest.raises(fastopt.ModelError, match="constant 4096, beyond the lengths"):
        _add_cache(model.SerializeToString())


def _bool_mask(model: onnx.ModelProto, bias: str) -> str:
    """The bool mask behind a bias: back through Where(mask, 0, lowest) and Expand."""
    producers = {o: n for n in model.graph.node for o in n.output}
    while producers[bias].op_type in ("Where", "Expand"):
        bias = producers[bias].input[0]
    return bias


@pytest.mark.parametrize("fx", GEMMA3, ids=ids(GEMMA3))
def test_gemma3_layers_keep_their_own_masks(fx, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Layers 0 and 2 slide (window 4), layer 1 does not: in place, GroupQueryAttention has
    local_window_size 4 on the sliding layers only; standard MHA/GQA read a windowed bias there
    and the shared causal one on layer 1."""
    window = int(fx.meta["config"]["sliding_window"])
    for mode in ("inplace", "standard"):
        out = tmp_path / mode / "model.onnx"
        out.parent.mkdir()
        fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
        model = onnx.load(out)
        atts = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(atts) == 3
        if mode == "inplace":
            windows = [
                {a.name: helper.get_attribute_value(a) for a in n.attribute}.get(
                    "local_window_size", -1
                )
                for n in atts
            ]
            assert windows == [window, -1, window]
        else:
            masks = [_bool_mask(model, n.input[10]) for n in atts]
            assert masks[0] == masks[2] != masks[1]


def test_a_sliced_cache_is_refused_with_the_reason(tmp_path: Path) -> None:
    """A model exported WITH a sliding-window cache (gemma3: the sliding layers' present is the
    last w rows of Concat(past, new)) is not converted; the refusal says so."""
    h, tp = helper, TensorProto
    kv = ["B", 2, "P", 16]
    inputs = [
        h.make_tensor_value_info("input_ids", tp.INT64, ["B", "S"]),
        h.make_tensor_value_info("attention_mask", tp.INT64, ["B", "T"]),
        h.make_tensor_value_info("q", tp.FLOAT, ["B", 4, "S", 16]),
        h.make_tensor_value_info("k", tp.FLOAT, ["B", 2, "S", 16]),
        h.make_tensor_value_info("v", tp.FLOAT, ["B", 2, "S", 16]),
        h.make_tensor_value_info("past_key_values.0.key", tp.FLOAT, kv),
        h.make_tensor_value_info("past_key_values.0.value", tp.FLOAT, kv),
    ]
    inits = [
        onnx.numpy_helper.from_array(np.array([-4], np.int64), "last_rows"),
        onnx.numpy_helper.from_array(np.array([2**62], np.int64), "to_end"),
        onnx.numpy_helper.from_array(np.array([2], np.int64), "seq_axis"),
    ]
    nodes = []
    for kind, new in (("key", "k"), ("value", "v")):
        nodes.append(h.make_node("Concat", [f"past_key_values.0.{kind}", new], [kind], axis=2))
        nodes.append(
            h.make_node("Slice", [kind, "last_rows", "to_end", "seq_axis"], [f"present.0.{kind}"])
        )
    nodes.append(
        h.make_node(
            "Attention",
            ["q", "present.0.key", "present.0.value"],
            ["y"],
            domain="ai.fastopt.internal",
            scale=0.25,
            is_causal=1,
            q_num_heads=4,
            kv_num_heads=2,
        )
    )
    outputs = [h.make_tensor_value_info(n, tp.FLOAT, None) for n in ("y", "present.0.key")]
    outputs.append(h.make_tensor_value_info("present.0.value", tp.FLOAT, None))
    model = h.make_model(
        h.make_graph(nodes, "g", inputs, outputs, inits),
        opset_imports=[h.make_opsetid("", 18), h.make_opsetid("ai.fastopt.internal", 1)],
    )
    out = tmp_path / "out.onnx"
    with pytest.raises(
        fastopt.ModelError,
        match=r"sliding-window cache: 'present.0.key' keeps the last 4 rows.* not converted",
    ):
        _add_cache(model.SerializeToString(), out)
    assert not out.exists()
