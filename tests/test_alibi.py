"""ALiBi attention (issue 13): bloom and mpt add slopes[h] * key_position to the scores besides
the causal/padding mask. Both export with transformers 5.24 through both torch.onnx exporters
(eager attention: neither family has an sdpa path), fp32 and fp16; fixtures bloom_* and mpt_*.

- fuse_attention recognises bloom's flat (B*H, S, T) heads (baddbmm) and mpt's masked_fill, and
  keeps the bias as the export computes it (bloom's from cumsum(attention_mask)), added into the
  internal op's additive mask; both targets lower it (MultiHeadAttention / GroupQueryAttention
  attention_bias, Attention-23 attn_mask). test_llm_preset.py checks counts, residue and parity
  (unpadded, right- and left-padded) for every fixture, these among them.
- Here: the bias counters, parity on masks with holes (where bloom's positions are not the key
  index, so a bias folded to slopes * j would differ), and the KV cache: bloom's bias reads
  attention_mask alone, so --kv-cache standard keeps it (32 greedy tokens equal to the
  original's, chunked prefill too); in place is refused (GroupQueryAttention in place reads no
  mask), and mpt (its bias slices a table by the keys' length) is refused in both forms, each
  naming the reason and writing nothing.
"""

from __future__ import annotations

from pathlib import Path

import fastopt
import kv_generation as kg
import numpy as np
import onnx
import pytest
from llm_fixtures import ALIBI_ARCHS, PARITY_ATOL, Fixture, feeds, fixtures, op_count, optimize
from llm_fixtures import run as ort_run
from onnx import helper

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


STANDARD = [
    pytest.param(fx, t, id=f"{fx}-{t}")
    for fx in fixtures(arch="bloom")
    for t in ("ort", "onnx")
    if fx.dtype == "float32" or (t == "ort" and fx.exporter == "dynamo")
]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 4))]


@pytest.mark.parametrize(("fx", "target"), STANDARD)
def test_bloom_standard_cache_generation(fx: Fixture, target: str, tmp_path: Path) -> None:
    """32 greedy tokens from a right-padded batch: the short row's cache holds a hole, which the
    copied bias skips as the original's cumsum positions do."""
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", target=target, output=out, kv_cache="standard")
    assert counters(report, "add_kv_cache").get("score bias (ALiBi) kept") == fx.layers
    model = report.model.to_onnx() if report.model is not None else None
    assert model is not None and op_count(model, "Softmax") == 0
    prompts = _prompts()
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), 32)
    got = kg.greedy_cached(out, prompts, 32)
    same, diff = kg.compare(ref, got)
    if fx.dtype == "float32":
        assert same == 32, f"first token mismatch at step {same}"
    else:
        assert same >= 1
    assert diff <= {"float32": 1e-4, "float16": 2e-2}[fx.dtype], diff


@pytest.mark.parametrize("fx", fixtures(arch="bloom", dtype="float32"), ids=str)
def test_bloom_chunked_prefill(fx: Fixture, tmp_path: Path) -> None:
    """Prompts prefilled 4 tokens at a time: S > 1 queries over a past, one bias row for all."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="standard")
    prompts = _prompts()
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), 8)
    got = kg.greedy_cached(out, prompts, 8, prefill_chunk=4)
    assert kg.compare(ref, got)[0] == 8
    np.testing.assert_allclose(got.logits, ref.logits, atol=1e-4, rtol=0)


# mpt's bias: TorchScript slices the table by Shape(K) (an activation); dynamo by lengths of
# attention_mask, but whether one row results (the same for every query) is not proven.
MPT_WHY = {"ts": "keys' length", "dynamo": "same for every query"}
REFUSED = [pytest.param(fx, "inplace", "in-place", id=f"{fx}-inplace") for fx in FP32] + [
    pytest.param(fx, "standard", MPT_WHY[fx.exporter], id=f"{fx}-standard")
    for fx in FP32
    if fx.arch == "mpt"
]


@pytest.mark.parametrize(("fx", "kv", "why"), REFUSED)
def test_kv_cache_refused(fx: Fixture, kv: str, why: str, tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    with pytest.raises(fastopt.ModelError, match=r"score bias \(ALiBi") as e:
        fastopt.optimize(fx.path, output=out, preset="llm", kv_cache=kv)  # type: ignore[arg-type]
    assert why in str(e.value)
    assert not out.exists()


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
