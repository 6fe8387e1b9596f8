"""Rows whose every key is masked (masked_rows.h): pad queries under left padding (and in a
sliding window's pads under right padding). The export gives them 0 (-inf masks, Where(IsNaN)),
the mean of V (finfo.min masks: eager and dynamo exports) or softmax(scores + v); the fused ops
give a finite average of their own unless the lowering puts the export's rows back. Those rows
reach real tokens where an export's next step reads their keys (gemma2/3's sliding caches:
test_cached_presets.py), so here every position is compared, pads included.

A decoder exported WITH a cache whose pad rows are proven to reach only padded positions'
outputs (kv_cache_mask.cc mark_unread_masked_rows) leaves them unspecified (README: outputs at
padded positions): its tests compare real positions and greedy decoding; pad_rows=0 keeps the
export's rows."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from support import kv_generation as kg
from support.llm_fixtures import (
    PARITY_ATOL,
    Fixture,
    feeds,
    fixtures,
    ids,
    matrix_fixtures,
    op_count,
    optimize,
    run,
)
from support.paths import TESTS

CASES = [
    fx
    for arch, exporter, dtype in [
        ("llama", "ts", "float32"),  # -inf mask, Where(IsNaN): rows give 0
        ("gpt2", "dynamo", "float32"),  # finfo.min: the mean of V (MHA's own, lowest bias)
        ("gemma2", "ts", "float32"),  # finfo.min + soft-capping: GQA, the mean put back
        ("gemma3", "dynamo", "float32"),  # finfo.min + Where(IsNaN) (a no-op there)
        ("qwen2", "dynamo", "float16"),  # fp16 finfo.min: GQA over zeroed queries (finite)
        ("bert", "dynamo", "float16"),  # an encoder's key mask (finite)
    ]
    for fx in fixtures(arch=arch, exporter=exporter, dtype=dtype)
]


def _rows_with_no_key(fx: Fixture) -> dict[str, np.ndarray]:
    """Left padding: the second row's leading pad queries see no key (a causal decoder)."""
    x = feeds(fx, padding="left")
    if not fx.is_decoder:  # an encoder's key mask hides a row's keys only when it is all pad
        x["attention_mask"][1, :] = 0
    return x


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", CASES, ids=ids(CASES))
def test_every_position_matches(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="default", target=target)
    fused = next(p.counters for p in report.passes if p.name == "fuse_attention")
    assert fused.get("attention") == fx.layers, fused
    x = _rows_with_no_key(fx)
    expected = np.asarray(run(fx.path, x)[0], np.float64)
    got = np.asarray(run(out, x)[0], np.float64)
    assert np.isfinite(expected).all() and np.isfinite(got).all()
    # fp16's finfo.min rows are the export's rounding of scores + -65504 to multiples of 32,
    # which no kernel reproduces (masked_rows.h): real positions only there.
    keep = np.ones(x["attention_mask"].shape, bool)
    if fx.dtype == "float16":
        keep = x["attention_mask"].astype(bool)
    diff = float(np.abs(expected[keep] - got[keep]).max()) if keep.any() else 0.0
    assert diff <= PARITY_ATOL[fx.dtype], f"max abs diff {diff:.3g}, pad positions included"


def _attention23(mask_value: float) -> np.ndarray:
    """ORT's Attention-23 on one query row whose every key an fp32 additive mask hides."""
    f = TensorProto.FLOAT
    node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y"], scale=0.25)
    shape = [1, 1, 3, 4]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, f, shape) for n in "qkv"]
        + [helper.make_tensor_value_info("m", f, [1, 1, 3, 3])],
        [helper.make_tensor_value_info("y", f, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    m = np.zeros((1, 1, 3, 3), np.float32)
    m[..., 0, :] = mask_value
    y = sess.run(None, {"q": q, "k": k, "v": v, "m": m})[0]
    return np.asarray(y[0, 0, 0] - v[0, 0].mean(axis=0))


def test_attention23_reads_the_lowest_as_minus_infinity() -> None:
    """Why lower_attention_onnx masks with -2^127, not fp32's lowest, where the export's rows
    average V: ORT 1.32 gives 0 for a row at the lowest, the mean one step above it."""
    lowest = float(np.finfo(np.float32).min)
    assert not np.allclose(_attention23(lowest), 0, atol=1e-6)  # 0, not the mean
    np.testing.assert_allclose(_attention23(-(2.0**127)), 0, atol=1e-6)  # the mean


# --- a decoder exported WITH a cache: pad rows no real position reads (issue 27) --------------

# llama, dynamo exporter, transformers 5.24, exported with a cache (past_key_values.{i}.key/value
# in, present.{i}.key/value out; GroupQueryAttention: 4 query heads over 2 kv heads). Its mask
# is finfo.min, so pad queries' rows average V in the export.
CACHED_GQA = Fixture(
    TESTS / "fixtures" / "cached_gqa" / "llama_dynamo_float32_cache" / "model.onnx"
)
UNREAD = "pad rows left unspecified (proven unread)"


def _left_padded(path: Path, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """The prefill of left-padded prompts with empty pasts: the short row's leading pad queries
    see no key."""
    sess = kg.session(path)
    layers, kv_heads, head_dim, dtypes = kg._cache_layout(sess)
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": kg.positions(mask)}
    for i in range(layers):
        for kv in ("key", "value"):
            name = f"past_key_values.{i}.{kv}"
            feed[name] = np.zeros((len(prompts), kv_heads, 0, head_dim), dtypes[name])
    return feed


def _greedy_left_padded(path: Path, prompts: list[list[int]], steps: int) -> kg.Generation:
    """Greedy decoding from a left-padded prefill, each step's presents fed back as pasts with
    attention_mask still 0 at the pads (as transformers' generate and onnxruntime-genai do)."""
    sess = kg.session(path)
    feed = _left_padded(path, prompts)
    names = [o.name for o in sess.get_outputs()]
    as_past = {n: n.replace("present.", "past_key_values.") for n in names if n != "logits"}
    tokens, step_logits = [], []
    for _ in range(steps):
        outs = dict(zip(names, sess.run(names, feed)))
        picked = outs["logits"][:, -1].astype(np.float32)
        nxt = picked.argmax(axis=-1)
        tokens.append(nxt)
        step_logits.append(picked)
        mask = np.concatenate([feed["attention_mask"], np.ones((len(prompts), 1), np.int64)], 1)
        feed = {
            "input_ids": nxt.astype(np.int64)[:, None],
            "attention_mask": mask,
            "position_ids": kg.positions(mask)[:, -1:],
            **{past: outs[n] for n, past in as_past.items()},
        }
    return kg.Generation(np.stack(tokens, axis=1).astype(np.int64), np.stack(step_logits))


def _real_positions_diff(src: Path, out: Path, feed: dict[str, np.ndarray]) -> tuple[float, float]:
    """(max diff at real positions, max diff at pad positions) over every output: the logits
    per position and the presents' rows, on the same left-padded prefill."""
    a, b = kg.session(src), kg.session(out)
    names = [o.name for o in a.get_outputs()]
    real = feed["attention_mask"].astype(bool)  # (B, S); presents' rows = positions (no past)
    worst = [0.0, 0.0]
    for name, x, y in zip(names, a.run(names, feed), b.run(names, feed)):
        d = np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
        d = d if name == "logits" else d.transpose(0, 2, 1, 3)  # (B, S, ...)
        d = d.reshape(*real.shape, -1).max(axis=-1)
        worst[0] = max(worst[0], float(d[real].max()))
        worst[1] = max(worst[1], float(d[~real].max()) if (~real).any() else 0.0)
    return worst[0], worst[1]


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_cached_export_leaves_unread_pad_rows(target: str, tmp_path: Path) -> None:
    """Every attention's mask proven causal with padding over past + new and every other op
    position-wise: a pad query's row reaches only padded positions' outputs, so the lowering
    does not reproduce the export's mean of V there (target ort: no ReduceMean over each
    layer's value cache in every decode step). Real positions, presents included, and greedy
    decoding from a left-padded prefill are the original's."""
    fx = CACHED_GQA
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", target=target, output=out)  # type: ignore[arg-type]
    lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
    assert lowered.get(UNREAD) == fx.layers, lowered
    assert "ReduceMean" not in {n.op_type for n in onnx.load(out).graph.node}
    prompts = [[5, 9, 77, 301, 12, 8, 440], [61, 7, 250]]
    real, _ = _real_positions_diff(fx.path, out, _left_padded(fx.path, prompts))
    assert real <= PARITY_ATOL["float32"], f"real positions differ by {real}"
    ref = _greedy_left_padded(fx.path, prompts, 8)
    got = _greedy_left_padded(out, prompts, 8)
    same, diff = kg.compare(ref, got)
    assert same == 8 and diff <= PARITY_ATOL["float32"], (same, diff)


def test_pad_rows_option_keeps_the_export_rows(tmp_path: Path) -> None:
    """pad_rows=0: the export's rows at every position, pads included (the emulation kept)."""
    fx = CACHED_GQA
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", output=out, options={"pad_rows": 0})
    lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
    assert UNREAD not in lowered, lowered
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count("ReduceMean") == fx.layers
    real, pads = _real_positions_diff(fx.path, out, _left_padded(fx.path, [[5, 9, 77, 3], [61]]))
    assert max(real, pads) <= PARITY_ATOL["float32"], (real, pads)


def _with_running_sum(src: Path, dst: Path) -> None:
    """src with h + 0 * CumSum(h) over the tokens after layer 0's attention residual: the same
    values, but a later position now reads every earlier one, pad rows included, which the
    proof cannot rule out."""
    proto = onnx.load(src)
    (res,) = [n for n in proto.graph.node if n.op_type == "Add" and "embedding" in n.input]
    h = res.output[0]
    for n in proto.graph.node:
        for i, x in enumerate(n.input):
            if x == h:
                n.input[i] = "h_kept"
    proto.graph.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.array(1, np.int64), "tokens_axis"),
            onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ]
    )
    at = list(proto.graph.node).index(res) + 1
    for k, node in enumerate(
        [
            helper.make_node("CumSum", [h, "tokens_axis"], ["h_sum"], name="running_sum"),
            helper.make_node("Mul", ["h_sum", "zero"], ["h_nothing"]),
            helper.make_node("Add", [h, "h_nothing"], ["h_kept"]),
        ]
    ):
        proto.graph.node.insert(at + k, node)
    onnx.save(proto, dst)


def test_pad_rows_kept_where_a_real_position_may_read_them(tmp_path: Path) -> None:
    """A running sum over the tokens after an attention: a real position reads the pad rows
    before it, so the export's rows are reproduced, and --explain says why."""
    src = tmp_path / "src.onnx"
    _with_running_sum(CACHED_GQA.path, src)
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(src, preset="llm", output=out, explain="lower_attention")
    lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
    assert UNREAD not in lowered, lowered
    assert [n.op_type for n in onnx.load(out).graph.node].count("ReduceMean") == CACHED_GQA.layers
    assert any("kept as exported" in e and "running_sum" in e for e in report.explain), (
        report.explain
    )
    real, pads = _real_positions_diff(src, out, _left_padded(src, [[5, 9, 77, 3], [61]]))
    assert max(real, pads) <= PARITY_ATOL["float32"], (real, pads)


def test_sliding_cache_keeps_pad_rows(tmp_path: Path) -> None:
    """gemma3's sliding layers cache their last rows (Slice(Concat(past, new))): their rows are
    not proven to be the positions', so every layer keeps the export's rows."""
    (fx,) = fixtures(arch="gemma3", exporter="dynamo", cache_export=True)
    report = fastopt.optimize(
        fx.path, preset="llm", output=tmp_path / "m.onnx", explain="lower_attention"
    )
    lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
    assert UNREAD not in lowered, lowered
    assert any("kept as exported" in e and "sliding-window cache" in e for e in report.explain)


def _without_emulation(src: Path, dst: Path) -> int:
    """src with each emulated row's Where bypassed (its other branch read instead): the fused op's
    own rows where every key is masked, as if the emulation were dropped. Returns how many."""
    proto = onnx.load(src)
    made = {o: n for n in proto.graph.node for o in n.output}

    def from_mean(value: str, depth: int = 8) -> bool:
        node = made.get(value)
        if node is None or depth == 0:
            return False
        return node.op_type == "ReduceMean" or any(from_mean(i, depth - 1) for i in node.input)

    bypassed = 0
    for where in [n for n in proto.graph.node if n.op_type == "Where"]:
        for k in (1, 2):
            if from_mean(where.input[k]):
                other = where.input[3 - k]
                for n in proto.graph.node:
                    n.input[:] = [other if x == where.output[0] else x for x in n.input]
                bypassed += 1
    onnx.save(proto, dst)
    return bypassed


# Every fixture whose target-ort output keeps a masked-row emulation (coverage.json's ReduceMean
# residue): gemma2's cache exports (both exporters), gemma3's dynamo one; models/ and 5.24.
SLIDING_CACHED = [
    *fixtures(arch="gemma2", cache_export=True),
    *fixtures(arch="gemma3", exporter="dynamo", cache_export=True),
    *matrix_fixtures(release="5.24.0", arch="gemma2", cache_export=True),
    *matrix_fixtures(release="5.24.0", arch="gemma3", exporter="dynamo", cache_export=True),
]


@pytest.mark.parametrize("fx", SLIDING_CACHED, ids=ids(SLIDING_CACHED))
def test_sliding_export_reads_its_all_masked_rows(fx: Fixture, tmp_path: Path) -> None:
    """Why gemma2/3's dynamo cache exports keep the emulation (their target-ort residue): the
    export's sliding layers read their keys' padding from attention_mask's first columns, so
    after a left-padded prompt a real query can see no key (or a pad key) and a real token reads
    an all-masked row. Greedy decoding from left-padded prompts: the optimized model gives the
    original's logits; with the emulation bypassed (the fused op's own rows), real tokens' logits
    change: the residue is what equality with the export costs, not a missed proof."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", target="ort", output=out)  # type: ignore[arg-type]
    dropped = tmp_path / "dropped.onnx"
    assert _without_emulation(out, dropped) >= 1
    prompts = [[5, 9, 77, 301, 12, 8, 440, 17, 23], [61, 7, 250, 3, 11], [44]]
    ref = _greedy_left_padded(fx.path, prompts, 6)
    same, diff = kg.compare(ref, _greedy_left_padded(out, prompts, 6))
    assert same == 6 and diff <= PARITY_ATOL["float32"], (same, diff)
    dropped_gen = _greedy_left_padded(dropped, prompts, 6)
    worst = float(np.abs(dropped_gen.logits - ref.logits).max())
    assert worst > 1e-2, f"dropping the emulation changed real logits by only {worst}"


def test_capped_sliding_layers_name_why_they_stay_decomposed(tmp_path: Path) -> None:
    """gemma2's sliding layers (soft-capped; keys = a sliding cache's rows + the new ones) stay
    standard ops for target ort: only GroupQueryAttention caps, and its keys must be the query's
    rows or a cache it holds. The reason names the soft-capping (the target-ort Softmax residue
    of gemma2's cache exports in coverage.json)."""
    (fx,) = fixtures(arch="gemma2", exporter="dynamo", cache_export=True)
    report = fastopt.optimize(
        fx.path, preset="llm", output=tmp_path / "m.onnx", explain="lower_attention"
    )
    kept = [e for e in report.explain if "kept as standard ops" in e]
    assert kept and all("soft-capping needs GroupQueryAttention" in e for e in kept), kept
    assert op_count(onnx.load(tmp_path / "m.onnx"), "Softmax") == len(kept)
