"""An encoder that computes the cross-attention cache (issue 13; onnxruntime-genai's whisper
form): add_kv_cache's cross_attention_cache 2 on the seq2seq fixtures' decoders, then
_C.move_cross_projections moves the cross K/V projections into the encoder
(csrc/passes/kv_cache/cross_cache_split.h). The encoder then gives last_hidden_state and
present.<i>.encoder.key|value; the decoder reads them as past_key_values.<i>.encoder.* and has no
encoder_hidden_states. Greedy tokens and logits of the pair equal the original encoder + no-cache
decoder's, with the self-attention cache standard or in place."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt import _C
from fastopt.verify.generation import verify_generation
from support import seq2seq_generation as sg
from support.llm_fixtures import PARITY_ATOL

STEPS = 16
FIXTURES = sg.seq2seq_fixtures()


def _layers(fx: sg.Seq2SeqFixture) -> int:
    config = fx.meta["config"]
    return int(config.get("decoder_layers", config.get("num_decoder_layers", 0)))


def _with_cross_outputs(fx: sg.Seq2SeqFixture, kv_cache: str) -> fastopt.Model:
    return sg.cached_decoder(fx, kv_cache, 2)


def _split(fx: sg.Seq2SeqFixture, kv_cache: str) -> tuple[fastopt.Model, fastopt.Model, int]:
    enc = fastopt.optimize(str(fx.encoder), preset="llm").model
    dec = _with_cross_outputs(fx, kv_cache)
    assert enc is not None
    return enc, dec, _C.move_cross_projections(enc, "last_hidden_state", dec)


@pytest.mark.parametrize("kv_cache", ["standard", "inplace"])
@pytest.mark.parametrize("fx", FIXTURES, ids=[fx.name for fx in FIXTURES])
def test_encoder_computes_the_cross_cache(
    fx: sg.Seq2SeqFixture, kv_cache: str, tmp_path: Path
) -> None:
    feeds = sg.encoder_feeds(fx)
    mask = feeds.get("attention_mask")
    hidden = sg.encode(fx, feeds)
    start = int(fx.meta["decoder_start_token_id"])
    layers = _layers(fx)
    enc, dec, moved = _split(fx, kv_cache)
    assert moved == 2 * layers
    enc.save(str(tmp_path / "encoder.onnx"))
    dec.save(str(tmp_path / "decoder.onnx"))

    cross_names = [f"present.{i}.encoder.{kv}" for i in range(layers) for kv in ("key", "value")]
    d = onnx.load(str(tmp_path / "decoder.onnx"))
    inputs = {i.name for i in d.graph.input}
    assert "encoder_hidden_states" not in inputs
    assert {n.replace("present.", "past_key_values.", 1) for n in cross_names} <= inputs
    assert not any(".encoder." in o.name for o in d.graph.output)
    e = onnx.load(str(tmp_path / "encoder.onnx"))
    assert [o.name for o in e.graph.output] == ["last_hidden_state", *cross_names]

    sess = ort.InferenceSession(str(tmp_path / "encoder.onnx"), providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    atol = PARITY_ATOL[fx.meta["dtype"]]
    np.testing.assert_allclose(outs["last_hidden_state"], hidden, atol=atol * 10, rtol=0)
    heads = int(outs[cross_names[0]].shape[1])
    assert outs[cross_names[0]].shape[:3] == (hidden.shape[0], heads, hidden.shape[1])
    cross = {n.replace("present.", "past_key_values.", 1): outs[n] for n in cross_names}

    ref = sg.greedy_no_cache(fx.decoder, hidden, mask, start, STEPS)
    if kv_cache == "inplace":
        got = sg.greedy_inplace(
            tmp_path / "decoder.onnx", hidden, mask, start, STEPS, encoder_cross=cross
        )
    else:
        got = sg.greedy_cached(tmp_path / "decoder.onnx", hidden, mask, start, STEPS, cross=cross)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logits, ref.logits, atol=atol, rtol=0)


def _counts(m: fastopt.Model) -> tuple[int, int, int, int]:
    g = m.graph
    return g.node_count, len(g.inputs), len(g.outputs), len(g.initializers)


def test_refusals_leave_both_models_unchanged() -> None:
    fx = sg.seq2seq_fixtures("whisper")[0]
    enc = fastopt.optimize(str(fx.encoder), preset="llm").model
    recompute = fastopt.optimize(
        str(fx.decoder), preset="llm", kv_cache="standard", options={"cross_attention_cache": 0}
    ).model
    standard = fastopt.optimize(str(fx.decoder), preset="llm", kv_cache="standard").model
    assert enc is not None and recompute is not None and standard is not None
    before = _counts(enc), _counts(recompute), _counts(standard)
    with pytest.raises(fastopt.ModelError, match=r"no present\.<i>\.encoder\.key\|value outputs"):
        _C.move_cross_projections(enc, "last_hidden_state", recompute)
    # The standard cross cache: present = Concat(past, projection), which reads a decoder input.
    with pytest.raises(fastopt.ModelError, match=r"'past_key_values\.\d\.encoder\.\w+', which "):
        _C.move_cross_projections(enc, "last_hidden_state", standard)
    assert (_counts(enc), _counts(recompute), _counts(standard)) == before

    split = _with_cross_outputs(fx, "standard")
    before = _counts(enc), _counts(split)
    with pytest.raises(fastopt.ModelError, match=r"the encoder has no output 'hidden'"):
        _C.move_cross_projections(enc, "hidden", split)
    assert (_counts(enc), _counts(split)) == before

    other = _with_cross_outputs(fx, "inplace")
    _C.move_cross_projections(enc, "last_hidden_state", other)
    before = _counts(enc), _counts(split)
    with pytest.raises(fastopt.ModelError, match=r"already has a value named 'present\.0\.enc"):
        _C.move_cross_projections(enc, "last_hidden_state", split)
    assert (_counts(enc), _counts(split)) == before


def test_genai_whisper_rejects_an_unknown_cross_cache_form(tmp_path: Path) -> None:
    from fastopt.genai.whisper import whisper_for_genai

    fx = sg.seq2seq_fixtures("whisper")[0]
    with pytest.raises(fastopt.OptionError, match=r"cross_cache must be one of encoder, recomp"):
        whisper_for_genai(
            fx.encoder, fx.decoder, tmp_path / "g", fx.meta["config"], cross_cache="both"
        )
    assert not (tmp_path / "g").exists()


def test_refused_when_the_decoder_still_needs_encoder_hidden_states() -> None:
    """The decoder loses encoder_hidden_states, so nothing else in it may read it: neither
    directly nor through a node the cross cache shares with the rest of the decoder."""
    fx = sg.seq2seq_fixtures("bart")[0]
    enc = fastopt.optimize(str(fx.encoder), preset="llm").model
    assert enc is not None
    direct = _with_cross_outputs(fx, "standard")
    g = direct.graph
    hidden = g.value("encoder_hidden_states")
    assert hidden is not None
    g.add_output(g.add_node("Identity", [hidden], ["also_hidden"]).outputs[0])
    before = _counts(enc), _counts(direct)
    with pytest.raises(fastopt.ModelError, match=r"also feeds Identity .* would still need it"):
        _C.move_cross_projections(enc, "last_hidden_state", direct)
    assert (_counts(enc), _counts(direct)) == before

    shared = _with_cross_outputs(fx, "standard")
    g = shared.graph
    hidden = g.value("encoder_hidden_states")
    assert hidden is not None
    reader = next(
        u for u in g.nodes if any(v is not None and v.name == hidden.name for v in u.inputs)
    )
    g.add_output(g.add_node("Identity", [reader.outputs[0]], ["also_projected"]).outputs[0])
    before = _counts(enc), _counts(shared)
    with pytest.raises(fastopt.ModelError, match=r"for the rest of the decoder"):
        _C.move_cross_projections(enc, "last_hidden_state", shared)
    assert (_counts(enc), _counts(shared)) == before


VERIFIED = [fx for fx in FIXTURES if fx.name.endswith("_ts_float32")]


@pytest.mark.parametrize("cross_mode", [1, 2])
@pytest.mark.parametrize("kv_cache", ["standard", "inplace"])
@pytest.mark.parametrize("fx", VERIFIED, ids=[fx.name for fx in VERIFIED])
def test_verify_generation_reads_the_cross_cache_it_primed(
    fx: sg.Seq2SeqFixture, kv_cache: str, cross_mode: int, tmp_path: Path
) -> None:
    """`--verify` on a cached decoder: one priming run gives the cross cache (on empty pasts,
    Concat(empty, projection), for option 1; on zeros of the encoder's length, the projection
    itself, for 2), which every step then reads. Option 2 failed before (its cross pasts were
    taken for an in-place buffer of zeros)."""
    out = tmp_path / "decoder.onnx"
    sg.cached_decoder(fx, kv_cache, cross_mode, out)
    report = verify_generation(str(fx.decoder), str(out))
    assert report.ok and report.inplace == (kv_cache == "inplace")
    assert report.tokens_cached == report.tokens_original
