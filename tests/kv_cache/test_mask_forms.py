"""Mask forms of other exporter releases that add_kv_cache must still prove (issue 27).

Dynamo exports take the sequence length from whichever input carries its symbol: the fixtures'
read it as Shape(attention_mask)[1]; exports of other releases as Shape(position_ids)[1], so
the causal mask is Range(Shape(position_ids)[1]) with the same GatherND / LessOrEqual / And
around it. That reads position_ids' shape, not its positions: with position_ids' dims the
symbols of input_ids' the proof (mask_proof.cc) takes it as input_ids' shape, and the mask
converts. Here the form is made from the real llama / gemma3 dynamo fixtures by moving their
Shape reads of attention_mask to position_ids (the same dims), and the cached models must give
the original's greedy tokens (standard and in place) and run under onnxruntime-genai."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from support import kv_generation as kg
from support.llm_fixtures import Fixture, fixtures

try:
    import onnxruntime_genai as og
except ImportError:  # optional: the test extra installs it
    og = None

STEPS = 12
FORM_FX = fixtures(arch=["llama", "gemma3"], exporter="dynamo", dtype="float32")


def positions_shape_form(src: Path, dst: Path, symbol: str | None = None) -> int:
    """src with every Shape of attention_mask reading position_ids instead (the dims are the
    same symbols); symbol: give position_ids that sequence symbol of its own. Returns how many
    Shape nodes moved."""
    proto = onnx.load(src)
    moved = 0
    for n in proto.graph.node:
        if n.op_type == "Shape" and n.input[0] == "attention_mask":
            n.input[0] = "position_ids"
            moved += 1
    if symbol:
        (pos,) = [i for i in proto.graph.input if i.name == "position_ids"]
        pos.type.tensor_type.shape.dim[1].dim_param = symbol
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, dst)
    return moved


def _prompts(vocab: int, lengths: tuple[int, ...] = (9, 5)) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, vocab, n)] for n in lengths]


@pytest.mark.parametrize("mode", ["standard", "inplace"])
@pytest.mark.parametrize("fx", FORM_FX, ids=[f.name for f in FORM_FX])
def test_mask_from_position_ids_shape_converts(fx: Fixture, mode: str, tmp_path: Path) -> None:
    src = tmp_path / "src" / "model.onnx"
    assert positions_shape_form(fx.path, src) >= 2
    out = tmp_path / "out" / "model.onnx"
    fastopt.optimize(src, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    prompts = _prompts(int(fx.meta["config"]["vocab_size"]))
    sliding = bool(fx.meta["config"].get("sliding_window"))
    if mode == "standard" and sliding:  # the standard cache's holes count in a window
        ref = kg.greedy_no_cache_as_cached(fx.path, prompts, STEPS)
    else:
        ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), STEPS)
    got = kg.greedy_cached(out, prompts, STEPS, inplace=mode == "inplace")
    same, diff = kg.compare(ref, got)
    assert same == STEPS, f"first token mismatch at step {same}"
    assert diff <= 1e-4, f"step logits differ by {diff}"


@pytest.mark.skipif(og is None, reason="onnxruntime-genai not installed")
def test_position_ids_shape_form_runs_under_genai(tmp_path: Path) -> None:
    (fx,) = [f for f in FORM_FX if f.arch == "llama"]
    src = tmp_path / "src" / "model.onnx"
    positions_shape_form(fx.path, src)
    out = tmp_path / "out" / "model.onnx"
    fastopt.optimize(src, preset="llm", output=out, kv_cache="inplace")
    prompt = _prompts(int(fx.meta["config"]["vocab_size"]), (9,))[0]
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad([prompt]), STEPS)
    assert kg.genai_greedy(out.parent, prompt, ref.tokens[0]) == list(ref.tokens[0])


def test_position_ids_with_a_length_of_its_own_is_refused(tmp_path: Path) -> None:
    """position_ids whose length is a symbol of its own: its shape says nothing the probes can
    give (S is input_ids'), so the mask stays unproven, and the refusal names the read."""
    (fx,) = [f for f in FORM_FX if f.arch == "llama"]
    src = tmp_path / "src" / "model.onnx"
    positions_shape_form(fx.path, src, symbol="position_length")
    with pytest.raises(fastopt.ModelError, match="reads the shape of graph input 'position_ids'"):
        fastopt.optimize(src, preset="llm", output=tmp_path / "out.onnx", kv_cache="standard")
    assert not (tmp_path / "out.onnx").exists()
