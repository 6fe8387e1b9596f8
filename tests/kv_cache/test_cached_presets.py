"""Every preset on the decoders exported WITH a cache (`*_cache` fixtures), both targets.

mpt's ALiBi bias reads the keys' length as Shape(present.i.key); the default preset's lowering
once handed the present to MultiHeadAttention, whose inputs then depended on its own output (a
cycle: "graph 'main_graph' has a cycle through node '.../Shape_3'"). Here every cached fixture
goes through `default` and `llm` for `ort` and `onnx`: the output must be written, agree with
the original in ONNX Runtime on a right-padded prefill step (every output, presents and pad
positions included) and decode the original's greedy tokens and step logits over a past
(kv_generation.greedy_cached), padded and not."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import pytest
from support import kv_generation as kg
from support.llm_fixtures import Fixture, fixtures, matrix_fixtures, matrix_params

CACHED = fixtures(cache_export=True)
STEPS = 6
CASES = [
    pytest.param(fx, preset, target, id=f"{fx}-{preset}-{target}")
    for fx in CACHED
    for preset in ("default", "llm")
    for target in ("ort", "onnx")
]
# The version matrix's exports with a cache (tests/fixtures/matrix), `llm` preset: strict xfails
# where expected_failures.json records a failure, most of them under -m slow.
CASES += matrix_params(
    "cached_presets", matrix_fixtures(cache_export=True), [("llm", "ort"), ("llm", "onnx")]
)


def _prefill_feed(path: Path, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """The first step's inputs as a runtime feeds them: (right-padded) ids, their mask, empty
    pasts (and positions where the export takes them)."""
    sess = kg.session(path)
    names = {i.name for i in sess.get_inputs()}
    layers, kv_heads, head_dim, dtypes = kg._cache_layout(sess)
    ids, mask = kg.right_pad(prompts)
    feed: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in names:
        feed["position_ids"] = kg.positions(mask)
    for i in range(layers):
        for kv in ("key", "value"):
            name = f"past_key_values.{i}.{kv}"
            feed[name] = np.zeros((len(prompts), kv_heads, 0, head_dim), dtypes[name])
    return feed


@pytest.mark.parametrize(("fx", "preset", "target"), CASES)
def test_cached_export_presets(fx: Fixture, preset: str, target: str, tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset=preset, target=target, output=out)  # type: ignore[arg-type]
    fused = next(p.counters for p in report.passes if p.name == "fuse_attention")
    assert fused.get("attention", 0) == fx.layers, fused  # fused, never left to chance
    if fx.arch == "mpt":  # the bias reading Shape(present): lowered, not decomposed
        lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
        assert lowered.get("kept as standard ops", 0) == 0, lowered
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 512, 7)), list(rng.integers(1, 512, 3))]
    # Every output, presents and pad positions included, on a right-padded batch: a pad query
    # whose every key is masked gives what the export gives (masked_rows.h), which matters
    # because gemma2/3's sliding caches then hold the short row's pad keys and the export's
    # next step reads them.
    fastopt.verify(fx.path, out, inputs=_prefill_feed(fx.path, prompts))
    batches = [prompts, [prompts[0], prompts[0][::-1]], prompts[1:]]
    for batch in batches:
        ref = kg.greedy_cached(fx.path, batch, STEPS)
        got = kg.greedy_cached(out, batch, STEPS)
        same, diff = kg.compare(ref, got)
        assert same == STEPS, f"first token mismatch at step {same}"
        assert diff <= 1e-4, f"step logits differ by {diff}"


def test_present_data_read_by_the_attentions_inputs_is_refused(tmp_path: Path) -> None:
    """A cached form whose mask reads the present's data (not only its shape): the op's present
    output cannot replace it (the mask would depend on the op's own output), so lower_attention
    keeps standard ops, says why in --explain, and the result still matches in ONNX Runtime."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    b, h, s, p, d = 1, 2, 3, 2, 4
    nodes = [
        helper.make_node("Concat", ["past_k", "k_new"], ["present_k"], axis=2),
        helper.make_node("Concat", ["past_v", "v_new"], ["present_v"], axis=2),
        helper.make_node("Transpose", ["present_k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "c"], ["scores"]),
        # (B, H, T, 1) -> (B, H, 1, T): an additive term computed from the keys' values
        helper.make_node("ReduceSum", ["present_k", "axes"], ["ksum"], keepdims=1),
        helper.make_node("Transpose", ["ksum"], ["term"], perm=[0, 1, 3, 2]),
        helper.make_node("Add", ["scores", "term"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present_v"], ["Y"]),
    ]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "g",
        [
            vi("q", f, [b, h, s, d]),
            vi("k_new", f, [b, h, s, d]),
            vi("v_new", f, [b, h, s, d]),
            vi("past_k", f, [b, h, p, d]),
            vi("past_v", f, [b, h, p, d]),
        ],
        [
            vi("Y", f, [b, h, s, d]),
            vi("present_k", f, [b, h, p + s, d]),
            vi("present_v", f, [b, h, p + s, d]),
        ],
        [
            helper.make_tensor("c", f, [], [0.5]),
            helper.make_tensor("axes", TensorProto.INT64, [1], [3]),
        ],
    )
    src = tmp_path / "in.onnx"
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    src.write_bytes(onnx_model.SerializeToString())
    out = tmp_path / "out.onnx"
    report = fastopt.optimize(
        src,
        passes=["infer_shapes", "fuse_attention", "lower_attention"],
        output=out,
        explain="lower_attention",
    )
    fused = next(p.counters for p in report.passes if p.name == "fuse_attention")
    assert fused.get("attention") == 1, fused
    lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
    assert lowered.get("kept as standard ops") == 1, lowered
    assert any(
        "present 'present_k' is read by ReduceSum" in line and "(a cycle)" in line
        for line in report.explain
    ), report.explain
    fastopt.verify(src, out)
