"""The `llm` preset end to end on every fixture (9 architectures, both exporters, fp32/fp16), for
both targets: every layer's norms, attention and rotary fused (counts against the number of
layers), nothing decomposed left behind, and ONNX Runtime parity of the logits on unpadded,
right-padded and left-padded batches. Per-pass tests cover the variants; this covers the order
the preset runs them in."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import onnx
import pytest
from conftest import CORPUS_DIR
from support.llm_fixtures import (
    MOE_ARCHS,
    ROPE_ARCHS,
    Fixture,
    assert_parity,
    fixtures,
    matrix_fixtures,
    matrix_params,
    op_count,
    optimize,
    router_softmaxes,
)

ALL = fixtures(fused_attention=True)
# The version matrix's exports without a cache (tests/fixtures/matrix): the same checks, strict
# xfails where expected_failures.json records a failure, most of them under -m slow.
MATRIX = matrix_fixtures()
RMS_ARCHS = {"llama", "mistral", "qwen2", "phi3", "gemma", "gemma3", "glm", "glm4", "phi3_longrope"}
RMS_ARCHS |= {"gemma2", "qwen3", *MOE_ARCHS}

NORMS_ORT = (
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "LayerNormalization",
    "SkipLayerNormalization",
)
NORMS_ONNX = ("RMSNormalization", "LayerNormalization")
ATTENTION_ORT = ("MultiHeadAttention", "GroupQueryAttention", "Attention")
# Ops that only a decomposed norm, softmax attention or rotary would leave.
DECOMPOSED = ("ReduceMean", "Softmax", "Sin", "Cos", "Neg", "Sqrt", "Erf")


def expected_norms(fx: Fixture) -> int:
    # Two per layer plus the final one; bert: the embeddings' norm instead of a final one.
    # gemma3: four around the blocks (pre/post attention, pre/post MLP) and the q/k norms.
    # glm4: pre and post norms around both blocks. gptj, cohere, falcon: attention and MLP in
    # parallel after one norm. gemma2: four around the blocks. olmoe, qwen3: q/k norms too.
    norms = {"gemma3": 6, "glm4": 4, "gptj": 1, "cohere": 1, "gemma2": 4, "falcon": 1, "olmoe": 4}
    norms["qwen3"] = 4
    per_layer = norms.get(fx.arch, 2)
    embedding_norm = 1 if fx.arch == "bloom" else 0  # bloom: word_embeddings_layernorm too
    return per_layer * fx.layers + 1 + embedding_norm


def expected_attention_op(fx: Fixture) -> str:
    """Encoders (bert): packed-QKV com.microsoft Attention; modernbert, whose export splits one
    packed projection, and deberta_v2, whose position terms are an attention bias, MHA (fp16
    deberta_v2: GroupQueryAttention with causal 0, as fp16 self-attention lowers).
    Decoders: GroupQueryAttention for fp16 (what CUDA runs) and for grouped kv heads, else
    MHA."""
    if fx.arch == "deberta_v2" and fx.dtype == "float16":
        return "GroupQueryAttention"
    if fx.arch == "bert" and fx.exporter == "dynamo" and fx.dtype == "float16":
        # finfo.min masks: rows with no visible key average V, which packing cannot keep
        # (masked_rows.h); fp16 self-attention then lowers to GroupQueryAttention.
        return "GroupQueryAttention"
    if fx.arch in ("modernbert", "deberta_v2"):
        return "MultiHeadAttention"
    if not fx.is_decoder:
        return "Attention"
    grouped = fx.dtype == "float16" or fx.kv_heads < fx.heads
    return "GroupQueryAttention" if grouped else "MultiHeadAttention"


def count(model: onnx.ModelProto, op_types: tuple[str, ...]) -> int:
    return sum(op_count(model, t) for t in op_types)


def decomposed_left(fx: Fixture, model: onnx.ModelProto) -> dict[str, int]:
    """DECOMPOSED ops beyond what the fixture keeps by design (the MoE router's Softmax)."""
    left = {t: op_count(model, t) for t in DECOMPOSED}
    left["Softmax"] -= router_softmaxes(fx)
    if fx.arch == "deberta_v2":  # p2c's bucket index: -relative_pos, one for all layers
        left["Neg"] -= 1
    return {t: n for t, n in left.items() if n}


@pytest.mark.parametrize("fx", [*ALL, *matrix_params("llm_preset_ort", MATRIX)], ids=str)
def test_llm_preset_target_ort(fx: Fixture) -> None:
    _, out = optimize(fx, preset="llm", target="ort")
    assert count(out, NORMS_ORT) == expected_norms(fx)
    if fx.arch in RMS_ARCHS:
        # Every norm but the first (it reads the embeddings, no residual) takes the residual Add.
        assert op_count(out, "SkipSimplifiedLayerNormalization", "com.microsoft") == 2 * fx.layers
    assert count(out, ATTENTION_ORT) == fx.layers
    assert op_count(out, expected_attention_op(fx), "com.microsoft") == fx.layers
    assert op_count(out, "RotaryEmbedding", "com.microsoft") == (
        2 * fx.layers if fx.arch in ROPE_ARCHS else 0
    )
    left = decomposed_left(fx, out)
    assert not left, f"decomposed ops left: {left}"
    assert not any(n.domain == "ai.fastopt.internal" for n in out.graph.node)
    assert_parity(fx, out)


@pytest.mark.parametrize("fx", [*ALL, *matrix_params("llm_preset_onnx", MATRIX)], ids=str)
def test_llm_preset_target_onnx(fx: Fixture) -> None:
    _, out = optimize(fx, preset="llm", target="onnx")
    assert {o.domain or "" for o in out.opset_import} <= {"", "ai.onnx"}
    assert {n.domain or "" for n in out.graph.node} <= {"", "ai.onnx"}
    onnx.checker.check_model(out, full_check=True)
    assert count(out, NORMS_ONNX) == expected_norms(fx)
    if fx.arch in RMS_ARCHS:
        assert op_count(out, "RMSNormalization") == expected_norms(fx)
    assert op_count(out, "Attention", "") == fx.layers
    assert op_count(out, "RotaryEmbedding", "") == (2 * fx.layers if fx.arch in ROPE_ARCHS else 0)
    left = decomposed_left(fx, out)
    assert not left, f"decomposed ops left: {left}"
    assert_parity(fx, out)


# The reference corpus (../shared/corpus, absent in a user's clone): exports of other runs,
# including models exported WITH a KV cache (attention over past + new keys).
CORPUS = sorted(CORPUS_DIR.glob("*/model.onnx")) if CORPUS_DIR.is_dir() else []


@pytest.mark.skipif(not CORPUS, reason="../shared/corpus is absent")
@pytest.mark.parametrize("path", CORPUS, ids=[p.parent.name for p in CORPUS])
@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_llm_preset_on_corpus(path: Path, target: str) -> None:
    meta = json.loads((path.parent / "meta.json").read_text())
    config = meta["config"]
    layers = int(config.get("num_hidden_layers") or config.get("n_layer"))
    report = fastopt.optimize(path, preset="llm", target=target)  # type: ignore[arg-type]
    assert report.model is not None
    ops = {k.split("::")[-1]: v for k, v in report.ops_after.items()}
    attention = ("Attention",) if target == "onnx" else ATTENTION_ORT
    assert sum(ops.get(t, 0) for t in attention) == layers
    # A cached export's causal GroupQueryAttention puts back the mean of V on rows with no
    # visible key (masked_rows.h): one ReduceMean per layer there, none else (norms fused).
    lowered = next(p.counters for p in report.passes if p.name == "lower_attention")
    mean_fixes = lowered.get("rows with every key masked: the mean of V put back", 0)
    assert "Softmax" not in ops and ops.get("ReduceMean", 0) == mean_fixes, ops
    if meta["arch"] in ROPE_ARCHS:
        assert ops.get("RotaryEmbedding") == 2 * layers
    for dims in (
        {"batch_size": 1, "sequence_length": 16, "past_sequence_length": 5},
        {"batch_size": 2, "sequence_length": 7, "past_sequence_length": 0},
    ):
        fastopt.verify(path, report.model, dims=dims)
