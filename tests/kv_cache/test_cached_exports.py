"""Decoders exported WITH a KV cache (issue 13): fixtures `*_cache` (make_fixtures.py --cache:
past_key_values.{i}.key/value inputs, present.{i}.key/value outputs, transformers' own cache
of the config) of the ALiBi families (bloom both exporters; mpt TorchScript: its dynamo export
with a cache fails in torch.export, "Eq(s70 + Max(0, -s15 - 2*s70 + 1), 1) is inconsistent")
and of the sliding-window families (gemma2, gemma3, both exporters).

- ALiBi: add_kv_cache adopts the cache and keeps the bias (kv_cache_bias.cc): its copies read
  the keys' length as attention_mask's width (in place the present becomes the max-length
  buffer) and a past's shape as P (in place those reads are given P). Proven here by 32 greedy
  tokens against the ORIGINAL cached export driven with its own past/present (standard: the
  same batch; in place: each row alone, the layout an in-place cache holds, which for mpt's key
  index differs from a standard cache's holes), and by onnxruntime-genai for the in-place form.
- Sliding windows: transformers' sliding layers cache only their last window - 1 rows
  (present = Slice(Concat(past, new), -3)); the export's mask covers those rows and the new
  ones. kv_cache_adopt.cc adopts them as full caches (the Concat is the present, the past holds
  every row) once the mask is proven over the rows the layer holds (mask_proof.h SlidingRows):
  the dynamo exports convert in place (right padding only, GroupQueryAttention's
  local_window_size), proven below by greedy parity with the original. The standard form is
  refused: with a left padding or a hole, these exports read a sliding layer's padding from
  attention_mask's first columns, not the held positions' (they decode differently from the
  same weights without a cache, shown below). The TorchScript exports are refused in both
  forms: their traced offset indexes attention_mask out of range below a past of window - 1
  (ONNX Runtime fails on them for a 1- or 2-token prompt).
"""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from support import kv_generation as kg
from support.alibi_models import genai_greedy, without_attention_bias
from support.cached_exports import original
from support.llm_fixtures import ALIBI_ARCHS, FIXTURE_DIR, Fixture, fixtures

try:
    import onnxruntime_genai as og
except ImportError:  # pragma: no cover - optional
    og = None

SLIDING_ARCHS = ("gemma2", "gemma3")
CACHED = fixtures(cache_export=True)
ALIBI_CACHED = fixtures(arch=ALIBI_ARCHS, cache_export=True)
SLIDING_CACHED = fixtures(arch=SLIDING_ARCHS, cache_export=True)
STEPS = 32


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(rng.integers(1, 512, 9)), list(rng.integers(1, 512, 4))]


def counters(report: fastopt.OptimizeReport, name: str) -> dict[str, int]:
    return next(p.counters for p in report.passes if p.name == name)


def test_cached_fixtures_present() -> None:
    """Every family and exporter that exports with a cache (a missing one would skip
    silently); the cached fixtures share the no-cache fixtures' weights (same config)."""
    assert {(fx.arch, fx.exporter) for fx in CACHED} == {
        ("bloom", "ts"),
        ("bloom", "dynamo"),
        ("mpt", "ts"),
        ("gemma2", "ts"),
        ("gemma2", "dynamo"),
        ("gemma3", "ts"),
        ("gemma3", "dynamo"),
    }
    for fx in CACHED:
        names = [i.name for i in onnx.load(fx.path, load_external_data=False).graph.input]
        assert f"past_key_values.{fx.layers - 1}.value" in names
        (plain,) = fixtures(arch=fx.arch, exporter=fx.exporter, dtype=fx.dtype)
        assert plain.meta["config"] == fx.meta["config"]


CASES = [
    pytest.param(fx, target, mode, id=f"{fx}-{target}-{mode}")
    for fx in ALIBI_CACHED
    for target, mode in (("ort", "standard"), ("ort", "inplace"), ("onnx", "standard"))
]


@pytest.mark.parametrize(("fx", "target", "mode"), CASES)
def test_alibi_cached_export_converts(fx: Fixture, target: str, mode: str, tmp_path: Path) -> None:
    """Adopted with the bias kept (in place: GroupQueryAttention's attention_bias on shared
    max-length buffers; target onnx: Attention-23 with past/present, onnx.checker clean); 32
    greedy tokens and step logits (1e-4) as the original cached export."""
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", target=target, output=out, kv_cache=mode)  # type: ignore[arg-type]
    kv = counters(report, "add_kv_cache")
    assert kv.get("layers adopted") == fx.layers
    assert kv.get("score bias (ALiBi) kept") == fx.layers
    model = onnx.load(out)
    assert "Softmax" not in {n.op_type for n in model.graph.node}
    if mode == "inplace":
        gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == fx.layers and all(len(n.input) > 10 and n.input[10] for n in gqa)
        dims = {
            v.type.tensor_type.shape.dim[2].dim_param
            for v in [*model.graph.input, *model.graph.output]
            if v.name.startswith(("past_key_values.", "present."))
        }
        assert dims == {"max_sequence_length"}
    elif target == "onnx":
        assert report.ops_after.get("Attention") == fx.layers
        onnx.checker.check_model(model, full_check=True)
    else:
        assert report.ops_after.get("com.microsoft::MultiHeadAttention") == fx.layers
    prompts = _prompts()
    ref = original(fx, prompts, STEPS, mode)
    got = kg.greedy_cached(out, prompts, STEPS, inplace=mode == "inplace")
    same, diff = kg.compare(ref, got)
    assert same == STEPS, f"first token mismatch at step {same}"
    assert diff <= 1e-4, f"step logits differ by {diff}"


@pytest.mark.parametrize("fx", ALIBI_CACHED, ids=str)
def test_alibi_cached_chunked_prefill(fx: Fixture, tmp_path: Path) -> None:
    """Standard: prompts prefilled 4 tokens at a time (S > 1 over a past), as the original."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="standard")
    prompts = _prompts()
    ref = kg.greedy_cached(fx.path, prompts, 8, prefill_chunk=4)
    got = kg.greedy_cached(out, prompts, 8, prefill_chunk=4)
    assert kg.compare(ref, got)[0] == 8
    np.testing.assert_allclose(got.logits, ref.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fx", ALIBI_CACHED, ids=str)
def test_alibi_cached_bias_matters(fx: Fixture, tmp_path: Path) -> None:
    """The conversion tests can fail: the same in-place model without its attention_bias
    decodes other logits than the original."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="inplace")
    without_attention_bias(out, tmp_path / "unbiased.onnx")
    prompts = _prompts()
    ref = original(fx, prompts, 8, "inplace")
    got = kg.greedy_cached(tmp_path / "unbiased.onnx", prompts, 8, inplace=True)
    assert np.abs(ref.logits[0] - got.logits[0]).max() > 1e-2


@pytest.mark.skipif(og is None, reason="onnxruntime-genai not installed")
@pytest.mark.parametrize("fx", ALIBI_CACHED, ids=str)
def test_alibi_cached_inplace_runs_under_genai(fx: Fixture, tmp_path: Path) -> None:
    """onnxruntime-genai runs the in-place folder and decodes the original cached export's 32
    tokens."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="inplace")
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    assert cfg["search"]["past_present_share_buffer"] is True
    prompt = _prompts()[0]
    ref = kg.greedy_cached(fx.path, [prompt], STEPS)
    used = set(prompt) | {int(t) for t in ref.tokens[0]}
    assert genai_greedy(tmp_path, prompt, STEPS, used) == list(ref.tokens[0])


SLIDING_CASES = [
    pytest.param(fx, mode, id=f"{fx}-{mode}")
    for fx in SLIDING_CACHED
    for mode in ("standard", "inplace")
    if not (fx.exporter == "dynamo" and mode == "inplace")
]
SLIDING_INPLACE = [fx for fx in SLIDING_CACHED if fx.exporter == "dynamo"]


@pytest.mark.parametrize(("fx", "mode"), SLIDING_CASES)
def test_sliding_cached_export_is_refused(fx: Fixture, mode: str, tmp_path: Path) -> None:
    """Refused with the real obstacle, nothing written: the dynamo export's mask reads a
    sliding layer's padding from attention_mask's first columns (a standard cache's holes reach
    it); the TorchScript export's index leaves attention_mask below a past of window - 1."""
    out = tmp_path / "model.onnx"
    with pytest.raises(fastopt.ModelError) as err:
        fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    msg = str(err.value)
    if fx.exporter == "dynamo":
        assert "(past 4)" in msg and "a window of 4 keys" in msg, msg
        assert "reads their padding from attention_mask's first columns" in msg, msg
    else:
        assert "its index -3 is outside the 1 entries there" in msg, msg
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("fx", SLIDING_INPLACE, ids=str)
def test_sliding_cached_export_converts_in_place(fx: Fixture, tmp_path: Path) -> None:
    """The dynamo export's sliding caches become full in-place caches with the window as
    GroupQueryAttention's local_window_size (4 on the sliding layers 0 and 2, none on layer
    1): 32 greedy tokens and step logits (1e-4) as the original fed its own presents, each row
    alone (past 0 .. 40 rows: below, at and past the 3 rows a sliding layer keeps); genai
    decodes the first row's 16 tokens alike."""
    out = tmp_path / "model.onnx"
    report = fastopt.optimize(fx.path, preset="llm", output=out, kv_cache="inplace")
    assert counters(report, "add_kv_cache")["sliding caches adopted"] == 2
    model = onnx.load(out)
    windows = [
        {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get(
            "local_window_size", -1
        )
        for n in model.graph.node
        if n.op_type == "GroupQueryAttention"
    ]
    assert windows == [4, -1, 4]
    prompts = _prompts()
    ref = original(fx, prompts, STEPS, "inplace")
    got = kg.greedy_cached(out, prompts, STEPS, inplace=True)
    same, diff = kg.compare(ref, got)
    assert same == STEPS and diff <= 1e-4, (same, diff)
    if og is not None:  # onnxruntime-genai runs the folder and decodes the same tokens
        used = set(prompts[0]) | {int(t) for t in ref.tokens[0]}
        assert genai_greedy(tmp_path, prompts[0], 16, used) == list(ref.tokens[0][:16])


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_sliding_cached_export_is_not_a_window(arch: str) -> None:
    """Why the standard form is refused: the same weights without a cache (whose
    --kv-cache form, with local_window_size, decodes as they do: test_kv_generation.py) give
    other tokens or logits than the cached export on a right-padded batch, and the TorchScript
    cached export differs even for one unpadded row (its branches on the cache length are
    traced once). A conversion to the window would change what the model computes."""
    prompts = _prompts()
    for exporter in ("ts", "dynamo"):
        cached = FIXTURE_DIR / f"{arch}_{exporter}_float32_cache" / "model.onnx"
        plain = FIXTURE_DIR / f"{arch}_{exporter}_float32" / "model.onnx"
        window = kg.greedy_no_cache(plain, *kg.right_pad(prompts), 16)
        got = kg.greedy_cached(cached, prompts, 16)
        same, _ = kg.compare(window, got)
        assert same < 16 or np.abs(window.logits - got.logits).max() > 1e-2, exporter
        if exporter == "ts":
            alone = kg.greedy_cached(cached, prompts[:1], 16)
            ref = kg.greedy_no_cache(plain, *kg.right_pad(prompts[:1]), 16)
            assert np.abs(alone.logits - ref.logits).max() > 1e-2
