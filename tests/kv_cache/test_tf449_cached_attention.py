"""transformers 4.49's TorchScript exports made WITH a cache (issue 27): the mask is sliced to
Shape(repeat_kv(present key))[2], so the attention's mask reads the present through the GQA
repeat. Lowered as is, the op's present output would feed its own mask (a cycle) and the
attention stayed decomposed. fold_shapes reads that dim on the present itself (proven equal
through the Unsqueeze/Expand/Reshape), which lower_attention's cache adoption rewrites as
Shape(past) + new rows: the attention fuses, and the fused cached model decodes as the export.

4.49's GPT-2 exports with a cache write each present as Identity(past): the cache never grows.
add_kv_cache refuses them saying so (it said the attention does not read Concat(past, new))."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support import kv_generation as kg
from support.folding_helpers import assert_parity, make_model, op_counts
from support.folding_helpers import optimize as run_passes
from support.llm_fixtures import Fixture, matrix_fixtures, op_count, optimize

CACHED_449 = matrix_fixtures(
    release="4.49.0", arch=("llama", "mistral", "phi3", "qwen2"), exporter="ts", cache_export=True
)
GPT2_CACHED_449 = matrix_fixtures(release="4.49.0", arch="gpt2", cache_export=True)
FUSED = {"ort": "GroupQueryAttention", "onnx": "Attention"}


def _params() -> list:  # type: ignore[type-arg]
    slow = [pytest.mark.slow]
    return [
        pytest.param(fx, t, id=f"{fx.name}-{t}", marks=[] if fx.arch == "llama" else slow)
        for fx in CACHED_449
        for t in ("ort", "onnx")
    ]


def test_fixtures_present() -> None:
    assert sorted(fx.arch for fx in CACHED_449) == ["llama", "mistral", "phi3", "qwen2"]


@pytest.mark.parametrize(("fx", "target"), _params())
def test_cached_449_attention_fuses(fx: Fixture, target: str, tmp_path: Path) -> None:
    report, model = optimize(fx, preset="llm", target=target)
    assert op_count(model, "Softmax") == 0
    assert op_count(model, FUSED[target]) == fx.layers
    counters = next(p.counters for p in report.passes if p.name == "fold_shapes")
    assert counters.get("Gather(Shape) rerouted", 0) >= fx.layers
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 4))]
    for chunk in (None, 3):  # single-token steps; multi-token steps over a non-empty past
        want = kg.greedy_cached(fx.path, prompts, 12, prefill_chunk=chunk)
        got = kg.greedy_cached(path, prompts, 12, prefill_chunk=chunk)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        assert float(np.max(np.abs(got.logits - want.logits))) < 1e-4


@pytest.mark.parametrize("fx", GPT2_CACHED_449, ids=lambda fx: fx.name)
def test_gpt2_449_unchanged_present_is_refused(fx: Fixture, tmp_path: Path) -> None:
    assert {fx.exporter for fx in GPT2_CACHED_449} == {"ts", "dynamo"}
    # The export itself: the present it returns is the past it was given.
    prompts = [[5, 77, 301, 12], [41, 7, 250, 19]]
    sess = kg.session(fx.path)
    layers, kv_heads, head_dim, _ = kg._cache_layout(sess)
    past = np.random.default_rng(0).standard_normal((2, kv_heads, 3, head_dim)).astype(np.float32)
    feed = {"input_ids": np.array(prompts), "attention_mask": np.ones((2, 7), np.int64)}
    names = {i.name for i in sess.get_inputs()}
    if "position_ids" in names:
        feed["position_ids"] = np.tile(np.arange(3, 7), (2, 1))
    for i in range(layers):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = past
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
    np.testing.assert_array_equal(outs["present.0.key"], past)
    for mode in ("standard", "inplace"):
        with pytest.raises(fastopt.ModelError) as err:
            fastopt.optimize(fx.path, preset="llm", output=tmp_path / "m.onnx", kv_cache=mode)  # type: ignore[arg-type]
        msg = str(err.value)
        assert "present output 'present.0.key' is past input 'past_key_values.0.key'" in msg
        assert "unchanged (Identity)" in msg
    assert not list(tmp_path.iterdir())


def _repeat_shape_read(expand: bool) -> onnx.ModelProto:
    """D = Shape(repeat(K))[2] with repeat = Unsqueeze(2) -> [Expand(B, 2, 2, T, 16)] -> Reshape,
    the form 4.49 slices its mask with (the Expand's shape computed, as TorchScript writes it)."""
    nodes = [
        helper.make_node("Unsqueeze", ["K", "ax2"], ["u"]),
        helper.make_node("Shape", ["K"], ["sk"]),
        helper.make_node("Gather", ["sk", "i0"], ["b"]),
        helper.make_node("Gather", ["sk", "i2"], ["t"]),
        helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
        helper.make_node("Unsqueeze", ["t", "ax0"], ["t1"]),
        helper.make_node("Concat", ["b1", "two", "two", "t1", "d16"], ["es"], axis=0),
        helper.make_node("Concat", ["b1", "four", "t1", "d16"], ["rs"], axis=0),
    ]
    if expand:
        nodes += [helper.make_node("Expand", ["u", "es"], ["e"])]
    nodes += [
        helper.make_node("Reshape", ["e" if expand else "u", "rs" if expand else "rs2"], ["r"]),
        helper.make_node("Shape", ["r"], ["sr"]),
        helper.make_node("Gather", ["sr", "i2"], ["D"]),
    ]
    if not expand:
        nodes.insert(-3, helper.make_node("Concat", ["b1", "two", "t1", "d16"], ["rs2"], axis=0))
    ints = {"ax2": [2], "ax0": [0], "two": [2], "four": [4], "d16": [16]}
    inits = {k: np.array(v, np.int64) for k, v in ints.items()}
    inits |= {"i0": np.array(0, np.int64), "i2": np.array(2, np.int64)}
    k = helper.make_tensor_value_info("K", TensorProto.FLOAT, ["B", 2, "T", 16])
    d = helper.make_tensor_value_info("D", TensorProto.INT64, [])
    return make_model(nodes, [k], [d], inits)


@pytest.mark.parametrize("expand", [True, False])
def test_shape_read_through_a_repeat_reads_the_source(expand: bool, tmp_path: Path) -> None:
    """Through an Expand the read moves to K and the repeat dies; without one (nothing copied)
    the graph keeps its form."""
    model = _repeat_shape_read(expand)
    report, path = run_passes(model, ["infer_shapes", "fold_shapes"], tmp_path)
    counters = next(p.counters for p in report.passes if p.name == "fold_shapes")
    ops = op_counts(path)
    if expand:
        assert counters.get("Gather(Shape) rerouted") == 1
        assert "Expand" not in ops and "Reshape" not in ops, ops
    else:
        assert "Gather(Shape) rerouted" not in counters
        assert ops.get("Reshape") == 1, ops
    feeds = {"K": np.zeros((3, 2, 5, 16), np.float32)}
    assert int(assert_parity(model, path, tmp_path, feeds)[0]) == 5
