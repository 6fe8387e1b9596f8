"""ALiBi attention (issue 13): bloom and mpt add slopes[h] * key_position to the scores besides
the causal/padding mask. Both export with transformers 5.24 through both torch.onnx exporters
(eager attention: neither family has an sdpa path), fp32 and fp16; fixtures bloom_* and mpt_*.

- fuse_attention recognises bloom's flat (B*H, S, T) heads (baddbmm) and mpt's masked_fill, and
  keeps the bias as the export computes it (bloom's from cumsum(attention_mask)), added into the
  internal op's additive mask; both targets lower it (MultiHeadAttention / GroupQueryAttention
  attention_bias, Attention-23 attn_mask). test_llm_preset.py checks counts, residue and parity
  (unpadded, right- and left-padded) for every fixture, these among them.
- Here: the bias counters, parity on masks with holes (where bloom's positions are not the key
  index, so a bias folded to slopes * j would differ), and the KV cache in both forms. Both
  biases are the same for every query and computed from the keys alone: bloom's from
  attention_mask (slopes x (cumsum(mask) - 1) x mask), mpt's as the last T columns of a constant
  (H, 1, L) table, slopes x (t - (T - 1)), T read from the keys' shape (TorchScript) or from
  attention_mask's (dynamo, which also slices the table's one query row by max(1 - S, 0)). A
  cached step recomputes the bias over all T keys from the whole attention_mask (T on the keys'
  shape). In place, GroupQueryAttention takes it as attention_bias: ORT 1.32 wants exactly
  (B|1, H|1, S, total_sequence_length) ("attention_bias dimension 3 must be equal to
  total_sequence_length, got 16" for the buffer's length 16; "dimension 2 must be equal to the
  sequence length, got 1" for one row broadcast over S) and reads [b, h, s, t] for the keys
  t <= seqlens_k[b]; onnxruntime-genai runs those folders. mpt's key index counts a short row's
  holes (the original does the same on the holed mask), so its standard cache is compared with
  the original on the cached layout. Refused, naming the reason and writing nothing: a bias that
  differs per query, and one sliced by the length of an activation that is not the keys.
"""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import helper
from support import kv_generation as kg
from support.alibi_models import genai_greedy, og, without_attention_bias
from support.llm_fixtures import (
    ALIBI_ARCHS,
    PARITY_ATOL,
    Fixture,
    feeds,
    fixtures,
    op_count,
    optimize,
)
from support.llm_fixtures import run as ort_run

ALIBI = fixtures(arch=ALIBI_ARCHS)
FP32 = fixtures(arch=ALIBI_ARCHS, dtype="float32")
CASES = [(fx, t) for fx in ALIBI for t in ("ort", "onnx")]


def counters(report: fastopt.OptimizeReport, name: str) -> dict[str, int]:
    return next(p.counters for p in report.passes if p.name == name)


def test_fixtures_present() -> None:
    """Both families, both exporters, fp32 and fp16 (a missing export would skip silently)."""
    assert {(fx.arch, fx.exporter, fx.dtype) for fx in ALIBI} == {
        (a, e, d) for a in ALIBI_ARCHS for e in ("ts", "dynamo") for d in ("float32", "float16")
    }


def holed_feeds(fx: Fixture) -> dict[str, np.ndarray]:
    """Row 0 full; row 1 with a hole of two pads in the middle and one at the end: bloom's
    positions (cumsum(mask) - 1) then lag the key index by 2 after the hole."""
    out = feeds(fx, batch=2, seq=11, padding=None, seed=3)
    out["attention_mask"][1, 4:6] = 0
    out["attention_mask"][1, -1] = 0
    return out


@pytest.mark.parametrize(("fx", "target"), CASES, ids=[f"{fx}-{t}" for fx, t in CASES])
def test_alibi_fused(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="llm", target=target)
    fused = counters(report, "fuse_attention")
    assert fused.get("attention") == fx.layers, fused
    assert fused.get("attention bias (ALiBi)") == fx.layers, fused
    assert fused.get("flat heads", 0) == (fx.layers if fx.arch == "bloom" else 0), fused
    assert op_count(out, "Softmax") == 0
    attention = ("MultiHeadAttention", "GroupQueryAttention") if target == "ort" else ("Attention",)
    assert sum(op_count(out, t) for t in attention) == fx.layers
    # The bias stays computed from the graph's inputs: bloom's reads the mask's cumsum.
    assert op_count(out, "CumSum") == (1 if fx.arch == "bloom" else 0)
    inputs = holed_feeds(fx)
    expected = np.asarray(ort_run(fx.path, inputs)[0], dtype=np.float64)
    got = np.asarray(ort_run(out, inputs)[0], dtype=np.float64)
    keep = inputs["attention_mask"].astype(bool)
    diff = float(np.max(np.abs(expected[keep] - got[keep])))
    assert diff <= PARITY_ATOL[fx.dtype], f"{fx} {target}: max abs diff {diff:.3g} with holes"


def test_holes_change_bloom_bias() -> None:
    """The holed mask is a real test: bloom's logits after the hole differ from those of the same
    tokens with the hole's keys kept (the positions, not only the masked keys, change)."""
    (fx,) = fixtures(arch="bloom", exporter="dynamo", dtype="float32")
    holed = holed_feeds(fx)
    full = {k: v.copy() for k, v in holed.items()}
    full["attention_mask"][1, 4:6] = 1
    a = np.asarray(ort_run(fx.path, holed)[0])
    b = np.asarray(ort_run(fx.path, full)[0])
    assert np.max(np.abs(a[1, 6:-1] - b[1, 6:-1])) > 1e-3


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 4))]


def reference(fx: Fixture, prompts: list[list[int]], steps: int, mode: str) -> kg.Generation:
    """The original's greedy tokens on the layout the cache holds: mpt's bias counts key
    indices, a standard cache's holes included; bloom's positions skip them (as does a causal
    mask), and an in-place cache holds each row contiguously."""
    if fx.arch == "mpt" and mode == "standard":
        return kg.greedy_no_cache_as_cached(fx.path, prompts, steps)
    return kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), steps)


CACHED = [
    pytest.param(fx, t, mode, id=f"{fx}-{t}-{mode}")
    for fx in ALIBI
    for t in ("ort", "onnx")
    for mode in ("standard", "inplace")
    if mode == "standard" or t == "ort"
]


@pytest.mark.parametrize(("fx", "target", "mode"), CACHED)
def test_cache_generation(fx: Fixture, target: str, mode: str, tmp_path: Path) -> None:
    """32 greedy tokens from a right-padded batch equal to the original's (fp16: up to the first
    near-tie), step logits within 1e-4 (fp32) / 2e-2 (fp16); in place every layer is one
    GroupQueryAttention reading the bias as attention_bias."""
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", target=target, output=out, kv_cache=mode)  # type: ignore[arg-type]
    assert counters(report, "add_kv_cache").get("score bias (ALiBi) kept") == fx.layers
    model = onnx.load(out)
    assert op_count(model, "Softmax") == 0
    if mode == "inplace":
        gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == fx.layers and all(len(n.input) > 10 and n.input[10] for n in gqa)
    prompts = _prompts()
    ref = reference(fx, prompts, 32, mode)
    got = kg.greedy_cached(out, prompts, 32, inplace=mode == "inplace")
    same, diff = kg.compare(ref, got)
    if fx.dtype == "float32":
        assert same == 32, f"first token mismatch at step {same}"
    else:
        assert same >= 1
    assert diff <= {"float32": 1e-4, "float16": 2e-2}[fx.dtype], diff


@pytest.mark.parametrize("arch", ALIBI_ARCHS)
def test_inplace_bias_matters(arch: str, tmp_path: Path) -> None:
    """The in-place tests can fail: without the bias the same model decodes other tokens; and
    mpt's reference choice is a real one (on the holed layout its logits differ)."""
    (fx,) = fixtures(arch=arch, exporter="dynamo", dtype="float32")
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="inplace")
    without_attention_bias(out, tmp_path / "unbiased.onnx")
    prompts = _prompts()
    ref = reference(fx, prompts, 8, "inplace")
    got = kg.greedy_cached(tmp_path / "unbiased.onnx", prompts, 8, inplace=True)
    assert np.abs(ref.logits[0] - got.logits[0]).max() > 1e-2
    if arch == "mpt":
        holed = reference(fx, prompts, 8, "standard")
        assert np.abs(ref.logits[1:, 1] - holed.logits[1:, 1]).max() > 1e-3


@pytest.mark.parametrize("fx", FP32, ids=str)
def test_chunked_prefill(fx: Fixture, tmp_path: Path) -> None:
    """Prompts prefilled 4 tokens at a time: S > 1 queries over a past, one bias row for all."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="standard")
    prompts = _prompts()
    ref = reference(fx, prompts, 8, "standard")
    got = kg.greedy_cached(out, prompts, 8, prefill_chunk=4)
    assert kg.compare(ref, got)[0] == 8
    np.testing.assert_allclose(got.logits, ref.logits, atol=1e-4, rtol=0)


@pytest.mark.skipif(og is None, reason="onnxruntime-genai not installed")
@pytest.mark.parametrize("mode", ["standard", "inplace"])
@pytest.mark.parametrize("fx", FP32, ids=str)
def test_runs_under_genai(fx: Fixture, mode: str, tmp_path: Path) -> None:
    """onnxruntime-genai loads the folder (in place: one buffer bound as past and present, its
    attention_mask growing by one column a step) and decodes the original's 32 tokens."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    prompt = _prompts()[0]
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad([prompt]), 32)
    used = set(prompt) | {int(t) for t in ref.tokens[0]}
    assert genai_greedy(tmp_path, prompt, 32, used) == list(ref.tokens[0])


def per_query_bias(fx: Fixture) -> onnx.ModelProto:
    """The fixture with each layer's bias expanded over the queries before it is added: a bias
    (B*H, S, T), computed from attention_mask alone, that differs per query as far as the
    graph shows."""
    model = onnx.load(fx.path)
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        if n.op_type == "Add":
            a, b = n.input
            mul = producer.get(a)
            if mul is not None and mul.op_type == "Mul":
                src = producer.get(mul.input[0])
                if src is not None and src.op_type == "MatMul":
                    # (B*H, S, T) from the bias's and attention_mask's shapes only
                    shapes = [
                        helper.make_node("Shape", [b], [f"{a}_bh"], end=1),
                        helper.make_node("Shape", ["attention_mask"], [f"{a}_s"], start=1),
                        helper.make_node("Shape", [b], [f"{a}_t"], start=2),
                    ]
                    target = helper.make_node(
                        "Concat", [o.output[0] for o in shapes], [f"{a}_bst"], axis=0
                    )
                    full = helper.make_node("Expand", [b, f"{a}_bst"], [f"{b}_per_query_{a}"])
                    nodes += [*shapes, target, full]
                    n.input[1] = full.output[0]
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return model


def test_bias_per_query_fuses_but_is_not_cached(tmp_path: Path) -> None:
    """A bias of full (B*H, S, T) shape still fuses exactly (reshaped to (B, H, S, T)), and the
    KV rewrite refuses it: a cached step could not tell its rows for the new queries."""
    (fx,) = fixtures(arch="bloom", exporter="ts", dtype="float32")
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(per_query_bias(fx), src)
    report = fastopt.optimize(src, preset="llm")
    assert counters(report, "fuse_attention").get("attention bias (ALiBi)") == fx.layers
    assert report.model is not None
    out = report.model.to_onnx()
    inputs = holed_feeds(fx)
    keep = inputs["attention_mask"].astype(bool)
    expected = np.asarray(ort_run(src, inputs)[0], dtype=np.float64)[keep]
    assert np.max(np.abs(expected - np.asarray(ort_run(out, inputs)[0])[keep])) <= 1e-4
    with pytest.raises(fastopt.ModelError, match="not proven the same for every query"):
        fastopt.optimize(src, preset="llm", kv_cache="standard")


def bias_by_query_length(fx: Fixture) -> onnx.ModelProto:
    """TorchScript mpt with each layer's table sliced by the queries' length (Shape of Q, not of
    the keys): the same model without a cache (S == T), not in a cached step (S < T)."""
    model = onnx.load(fx.path)
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    changed = 0
    for mm in g.node:
        kt = producer.get(mm.input[1]) if mm.op_type == "MatMul" else None
        if kt is None or kt.op_type != "Transpose":
            continue
        for n in g.node:  # Shape(Transpose(k_bshd)) read by the bias -> Shape(Q)
            t = producer.get(n.input[0]) if n.op_type == "Shape" else None
            if t is not None and t.op_type == "Transpose" and t.input[0] == kt.input[0]:
                n.input[0] = mm.input[0]
                changed += 1
    assert changed == fx.layers
    return model


def test_bias_by_query_length_is_refused(tmp_path: Path) -> None:
    (fx,) = fixtures(arch="mpt", exporter="ts", dtype="float32")
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(bias_by_query_length(fx), src)
    inputs = feeds(fx, batch=2, seq=7, padding="right", seed=1)
    np.testing.assert_allclose(ort_run(src, inputs)[0], ort_run(fx.path, inputs)[0], atol=0)
    report = fastopt.optimize(src, preset="llm")
    assert counters(report, "fuse_attention").get("attention bias (ALiBi)") == fx.layers
    out = tmp_path / "out" / "model.onnx"
    for mode in ("standard", "inplace"):
        with pytest.raises(fastopt.ModelError, match="not an attention's keys"):
            fastopt.optimize(src, preset="llm", kv_cache=mode, output=out)  # type: ignore[arg-type]
        assert not out.exists()


@pytest.mark.parametrize("fx", fixtures(arch="mpt"), ids=str)
def test_mpt_table_is_alibi(fx: Fixture) -> None:
    """What mpt's bias slices (the last T columns, the same for every query): a constant
    (H, 1, max_seq_len) table slopes[h] * (j - (L - 1)), slopes 2^(-8 (h + 1) / H). The cache
    recomputes the slice over all T keys with the export's own ops, so the cached bias is the
    full recompute's value for value (no softmax-invariance argument needed)."""
    model = onnx.load(fx.path)
    heads, length = fx.heads, int(fx.meta["config"]["max_seq_len"])
    tensors = [*model.graph.initializer]
    tensors += [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute]
    tables = [t for t in tensors if list(t.dims) == [heads, 1, length]]
    assert len(tables) == 1
    table = onnx.numpy_helper.to_array(tables[0]).astype(np.float64)
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    expected = slopes[:, None, None] * (np.arange(length) - (length - 1))[None, None, :]
    np.testing.assert_allclose(table, expected, rtol=1e-3, atol=0)


def test_inplace_bias_on_cuda_is_refused(tmp_path: Path) -> None:
    """cuda=1: CUDA's GroupQueryAttention rejects attention_bias, so in place the biased
    attention is not lowered to it and the in-place form is refused, writing nothing."""
    (fx,) = fixtures(arch="bloom", exporter="dynamo", dtype="float16")
    out = tmp_path / "model.onnx"
    with pytest.raises(fastopt.ModelError, match="not GroupQueryAttention"):
        fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="inplace", options={"cuda": 1})
    assert not out.exists()
