"""Attention sinks (gpt-oss; csrc/passes/attention/sinks.h) on real exports: tests/fixtures/sinks
(make_fixtures.py --arch gpt_oss --out tests/fixtures/sinks: both exporters, sliding-window and
full layers, MoE MLPs). Its rotary is not fused yet, so these fixtures stay out of the
per-family sweeps (llm_fixtures.FIXTURE_DIR) and are checked here:

- target ort: every attention is one GroupQueryAttention with the sinks as head_sink, logits
  within the fp32 bound on unpadded, right- and left-padded batches;
- target onnx: Attention-23 has no sinks, so the lowering falls back to standard ops, which
  write the sinks' Concat / Softmax / Slice again (same parity);
- KV cache, standard and in place: 32 greedy tokens from a right-padded batch equal to the
  no-cache original's, onnxruntime-genai's included for the in-place form.
"""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from support import kv_generation as kg
from support.alibi_models import genai_greedy, og
from support.llm_fixtures import Fixture, assert_parity, op_count
from support.paths import TESTS

SINK_FIXTURES = sorted((TESTS / "fixtures" / "sinks").glob("*/model.onnx"))
FX = [Fixture(p) for p in SINK_FIXTURES]
IDS = [fx.name for fx in FX]
STEPS = 32
HEAD_SINK = 11  # GroupQueryAttention's input index


def optimize(fx: Fixture, target: str, tmp_path: Path, **kw: object) -> onnx.ModelProto:
    out = tmp_path / "model.onnx"
    r = fastopt.optimize(fx.path, preset="llm", target=target, output=out, **kw)  # type: ignore[arg-type]
    counters = next(p.counters for p in r.passes if p.name == "fuse_attention")
    assert counters.get("attention sinks") == fx.layers, counters
    return onnx.load(out)


def sink_logits(fx: Fixture) -> np.ndarray:
    """The export's sink logits, one row of H per layer: its (1, H, 1, 1) constants (both
    exporters fold HF's sinks.reshape(1, -1, 1, 1) into one)."""
    model = onnx.load(fx.path)
    heads = int(fx.meta["config"]["num_attention_heads"])
    rows = [
        onnx.numpy_helper.to_array(t).reshape(-1)
        for t in model.graph.initializer
        if list(t.dims) == [1, heads, 1, 1]
    ]
    assert len(rows) == fx.layers
    return np.stack(rows)


def test_fixtures_exist() -> None:
    assert {fx.exporter for fx in FX} == {"ts", "dynamo"}
    assert all(fx.arch == "gpt_oss" for fx in FX)


@pytest.mark.parametrize("fx", FX, ids=IDS)
def test_sinks_fuse_into_gqa_head_sink(fx: Fixture, tmp_path: Path) -> None:
    out = optimize(fx, "ort", tmp_path)
    gqa = [n for n in out.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == fx.layers
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    got = np.stack([inits[n.input[HEAD_SINK]] for n in gqa])
    np.testing.assert_array_equal(np.sort(got, axis=None), np.sort(sink_logits(fx), axis=None))
    # The decomposed softmax is gone from attention: only the MoE routers' remain.
    assert op_count(out, "Softmax") == fx.layers
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", FX, ids=IDS)
def test_sinks_target_onnx_fall_back_to_standard_ops(fx: Fixture, tmp_path: Path) -> None:
    out = optimize(fx, "onnx", tmp_path)
    assert op_count(out, "Attention") == 0  # Attention-23 cannot take sinks
    assert not any(n.domain for n in out.graph.node)
    assert op_count(out, "Softmax") == 2 * fx.layers  # each attention's and each router's
    onnx.checker.check_model(out, full_check=True)
    assert_parity(fx, out)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in (9, 5)]


@pytest.mark.parametrize("mode", ["standard", "inplace"])
@pytest.mark.parametrize("fx", FX, ids=IDS)
def test_sinks_cached_generation(fx: Fixture, mode: str, tmp_path: Path) -> None:
    """32 greedy tokens of a right-padded batch equal the no-cache original's (standard: on the
    cache's own layout, holes where the short row's padding sits, which the sliding layers'
    windows count as the original does), logits within 1e-4."""
    out = optimize(fx, "ort", tmp_path, kv_cache=mode)
    gqa = [n for n in out.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == fx.layers and all(n.input[HEAD_SINK] for n in gqa)
    prompts = _prompts()
    if mode == "standard":
        ref = kg.greedy_no_cache_as_cached(fx.path, prompts, STEPS)
    else:
        ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), STEPS)
    got = kg.greedy_cached(tmp_path / "model.onnx", prompts, STEPS, inplace=mode == "inplace")
    same, diff = kg.compare(ref, got)
    assert same == STEPS, f"first token mismatch at step {same}"
    assert diff <= 1e-4


@pytest.mark.skipif(og is None, reason="onnxruntime-genai not installed")
@pytest.mark.parametrize("fx", FX, ids=IDS)
def test_sinks_inplace_runs_under_genai(fx: Fixture, tmp_path: Path) -> None:
    """onnxruntime-genai's greedy search over the in-place folder gives the original's tokens."""
    optimize(fx, "ort", tmp_path, kv_cache="inplace")
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    assert cfg["search"]["past_present_share_buffer"] is True
    prompt = _prompts()[0]
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad([prompt]), STEPS)
    expected = [int(t) for t in ref.tokens[0]]
    assert genai_greedy(tmp_path, prompt, STEPS, set(prompt) | set(expected)) == expected


def test_sinks_not_constant_are_refused_with_the_reason(tmp_path: Path) -> None:
    """Sink logits fed as a graph input (not one constant per head): that layer's attention
    stays as exported, --explain says why; the other layer still fuses."""
    fx = next(f for f in FX if f.exporter == "ts")
    model = onnx.load(fx.path)
    heads = int(fx.meta["config"]["num_attention_heads"])
    first = next(t for t in model.graph.initializer if list(t.dims) == [1, heads, 1, 1])
    model.graph.initializer.remove(first)
    model.graph.input.append(
        onnx.helper.make_tensor_value_info(first.name, first.data_type, [1, heads, 1, 1])
    )
    r = fastopt.optimize(
        fastopt.from_onnx(model), preset="llm", target="ort", explain="fuse_attention"
    )
    assert any(
        "attention sinks: the column joined to the scores is not one constant per head" in line
        for line in r.explain
    ), r.explain
    out = r.model.to_onnx()
    assert op_count(out, "GroupQueryAttention") == fx.layers - 1
    assert op_count(out, "Softmax") == fx.layers + 1  # the routers' and the refused layer's
