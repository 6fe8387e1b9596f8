"""Pass contracts (csrc/passes/registry.h): the placement facts and the options a C++ pass
declares with itself, the constants the Python side reads from _C instead of restating them,
and fuse_attention as a code rule on the shared driver (its --explain lines come from it)."""

from __future__ import annotations

import fastopt
import pytest
from fastopt import _C
from fastopt.pipeline.registry import finishing_pass, get_pass, place, preset
from support.attention_models import counters, run_sdpa, sdpa_model


def test_add_kv_cache_is_placed_by_its_contract() -> None:
    spec = get_pass("add_kv_cache")
    assert spec.requires_facts == (_C.FACT_ATTENTION_FUSED,)
    assert spec.runs_before == ("lower_attention",)
    assert _C.FACT_ATTENTION_FUSED in get_pass("fuse_attention").ensures_facts
    llm = preset("llm")
    placed = place(llm, "add_kv_cache")
    i = placed.index("add_kv_cache")
    assert placed[i - 1] == "fuse_attention" and placed[i + 1] == "lower_attention"
    assert [n for n in placed if n != "add_kv_cache"] == llm
    # Listed in the wrong place already: it moves.
    assert place(["add_kv_cache", *llm], "add_kv_cache") == placed


def test_a_contract_that_cannot_hold_is_an_option_error() -> None:
    with pytest.raises(fastopt.OptionError, match="needs the pass fuse_attention"):
        place(["eliminate_identity", "lower_attention"], "add_kv_cache")
    with pytest.raises(fastopt.OptionError, match="must run after fuse_attention and before"):
        place(["lower_attention", "fuse_attention"], "add_kv_cache")


def test_internal_ops_are_finished_by_the_pass_that_ensures_it() -> None:
    assert finishing_pass(_C.FACT_NO_INTERNAL_OPS) == "lower_attention"
    # fuse_attention alone leaves internal ops: optimize() runs the finishing pass itself.
    report = fastopt.optimize(
        fastopt.from_onnx(sdpa_model()), passes=["infer_shapes", "fuse_attention"], target="ort"
    )
    assert [p.name for p in report.passes][-1] == "lower_attention"
    assert not any(op.startswith(_C.INTERNAL_DOMAIN) for op in report.ops_after)


def test_attention_options_are_declared_with_their_passes() -> None:
    declared = {o.name: p.name for p in _C.cpp_passes() for o in p.options if o.help}
    for name in ("attention_lowering", "cuda", "packed_attention", "pack_matmuls", "kv_cache"):
        assert name in declared, name
        assert name in fastopt.OPTIONS, name
    assert fastopt.OPTIONS["packed_attention"].passes == ("lower_attention",)
    assert set(fastopt.OPTIONS["kv_cache"].passes) == {"add_kv_cache", "lower_attention"}
    assert fastopt.OPTIONS["kv_cache"].internal
    assert fastopt.OPTIONS["pack_matmuls"].default == 0
    assert fastopt.OPTIONS["cuda"].values_text() == "0 (any provider) or 1 (CUDA)"
    with pytest.raises(fastopt.OptionError, match=r"attention_lowering must be 0 \(keep"):
        fastopt.OPTIONS["attention_lowering"].check(3)


def test_constants_come_from_the_core() -> None:
    assert fastopt.OPTIONS["fold_max_bytes"].default == _C.FOLD_MAX_BYTES == 1 << 20
    assert fastopt.OPTIONS["fold_max_expand_bytes"].default == _C.FOLD_MAX_EXPAND_BYTES
    assert _C.INTERNAL_DOMAIN == "ai.fastopt.internal"
    assert _C.FUSED_OPS_OPSET == 23
    assert (_C.KV_PAST_PREFIX, _C.KV_PRESENT_PREFIX) == ("past_key_values.", "present.")


def test_fuse_attention_explains_through_the_driver() -> None:
    report, _ = run_sdpa(sdpa_model(), "onnx", explain="fuse_attention")
    assert counters(report, "fuse_attention").get("attention") == 1
    lines = [line for line in report.explain if line.startswith("fuse_attention @ node ")]
    assert len(lines) == 1 and lines[0].endswith("(MatMul): rewritten"), report.explain
    # The scores MatMul (no softmax behind it) is no candidate: nothing is explained for it.
    report, _ = run_sdpa(sdpa_model(axis=2), "onnx", explain="fuse_attention")
    lines = [line for line in report.explain if line.startswith("fuse_attention @ node ")]
    assert len(lines) == 1 and "Softmax is not over the last axis" in lines[0], lines
    assert counters(report, "fuse_attention").get("not fused") == 1
