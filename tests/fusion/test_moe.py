"""Mixture-of-experts decoders (issue 13): mixtral, qwen2_moe and olmoe fixtures (4 experts,
top-2, both exporters, fp32 and fp16; tests/fixtures/make_fixtures.py exports them with
transformers' batched_mm experts, as its default grouped_mm exports with neither exporter).

What fuses is what a dense decoder has: norms, attention, rotary, and the experts' SwiGLU
(SiLU(gate) * up on the gathered experts' projections: QuickGelu(alpha 1) for target ort). The
routing stays exact as exported and is no attention residue: the router's Softmax over the
expert logits, TopK, the renormalised top-k weights, the experts' weights gathered per token.
The shape analysis knows every op of these exports (TopK, OneHot: no fallback to onnx's
inference). KV cache: test_kv_generation.py runs these fixtures too (32 greedy tokens equal
to the original's with --kv-cache standard and inplace, both targets, onnxruntime-genai); here
in place, GroupQueryAttention applies the rotary itself."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from support import kv_generation as kg
from support.llm_fixtures import (
    MOE_ARCHS,
    PARITY_ATOL,
    Fixture,
    assert_parity,
    fixtures,
    ids,
    op_count,
    optimize,
    router_softmaxes,
)

MOE = fixtures(arch=list(MOE_ARCHS))
TARGETS = ("ort", "onnx")
# Ops a decomposed norm, attention or rotary would leave (the router's Softmax aside).
RESIDUE = ("ReduceMean", "Sqrt", "Reciprocal", "Sin", "Cos", "Neg", "IsNaN")


def _routing(model: onnx.ModelProto) -> dict[str, int]:
    return {t: op_count(model, t) for t in ("TopK", "Softmax")}


def test_moe_fixtures_are_there() -> None:
    assert {fx.arch for fx in MOE} == set(MOE_ARCHS)
    assert {fx.exporter for fx in MOE} == {"ts", "dynamo"}
    for fx in MOE:
        config = fx.meta["config"]
        assert config.get("num_local_experts", config.get("num_experts")) == 4
        assert config["num_experts_per_tok"] == 2


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fx", MOE, ids=ids(MOE))
def test_moe_fuses_and_routing_stays_exact(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="llm", target=target, explain="fuse_attention")
    n = fx.layers
    # Attention: every layer fused, nothing refused (the router's Softmax feeds TopK, no
    # MatMul: not a candidate).
    assert [line for line in report.explain if not line.endswith("rewritten")] == []
    attention = ("GroupQueryAttention", "com.microsoft") if target == "ort" else ("Attention", "")
    assert op_count(out, *attention) == n
    assert op_count(out, "RotaryEmbedding") == 2 * n
    assert {t: op_count(out, t) for t in RESIDUE if op_count(out, t)} == {}
    # Routing, as exported: one router Softmax and one TopK per layer (the export's attention
    # Softmax, one per layer too, is gone).
    assert _routing(out) == {"TopK": n, "Softmax": router_softmaxes(fx)}
    assert _routing(onnx.load(fx.path)) == {"TopK": n, "Softmax": 2 * n}
    if target == "ort":
        # The experts' SwiGLU, and qwen2_moe's shared expert's: SiLU fused.
        silu = 2 if fx.arch == "qwen2_moe" else 1
        assert op_count(out, "QuickGelu", "com.microsoft") == silu * n
        # Left: qwen2_moe's sigmoid gate on the shared expert's output, one per layer.
        assert op_count(out, "Sigmoid") == (n if fx.arch == "qwen2_moe" else 0)
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", MOE, ids=ids(MOE))
def test_moe_shapes_need_no_fallback(fx: Fixture) -> None:
    """TopK and OneHot have native rules: onnx's shape inference is not called."""
    report = fastopt.optimize(fx.path, passes=["infer_shapes"])
    counters = report.passes[0].counters
    assert counters.get("engine:native") == 1 and "engine:onnx" not in counters, counters
    assert not [k for k in counters if k.startswith("native_unknown:")]


STEPS = 32
TS_AND_DYNAMO_MIXTRAL = fixtures(arch="mixtral")


@pytest.mark.parametrize("fx", TS_AND_DYNAMO_MIXTRAL, ids=ids(TS_AND_DYNAMO_MIXTRAL))
def test_moe_in_place_cache_applies_the_rotary(fx: Fixture, tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="inplace")
    model = onnx.load(out)
    assert op_count(model, "GroupQueryAttention", "com.microsoft") == fx.layers
    assert op_count(model, "RotaryEmbedding") == 0  # GQA's do_rotary
    assert _routing(model) == {"TopK": fx.layers, "Softmax": fx.layers}
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(1, 512, 7)), list(rng.integers(1, 512, 12))]
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), STEPS)
    got = kg.greedy_cached(out, prompts, STEPS, inplace=True)
    same, diff = kg.compare(ref, got)
    assert same == STEPS, f"first token mismatch at step {same}"
    assert diff <= PARITY_ATOL[fx.dtype]
