"""Encoder-decoders with an in-place self-attention cache (issue 13): `--kv-cache inplace` on the
seq2seq fixtures' decoders (tests/fixtures/make_seq2seq_fixtures.py; add_kv_cache's seq2seq form,
csrc/passes/kv_cache/kv_cache_cross.cc). Each self-attention becomes GroupQueryAttention on one
max-length buffer bound as past and present, its valid length the new input past_sequence_length
(int32 (1)); the cross cache keeps the standard form (filled at the first step, passed through).
32 greedy tokens and their logits equal the no-cache decoder's, driven by
seq2seq_generation.greedy_inplace (IOBinding, the buffers shared)."""

from __future__ import annotations

import collections
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from support import seq2seq_generation as sg
from support.llm_fixtures import PARITY_ATOL, matrix_params
from support.paths import TESTS

STEPS = 32
FIXTURES = sg.seq2seq_fixtures()


def _ids(items: list[sg.Seq2SeqFixture]) -> list[str]:
    return [fx.name for fx in items]


def _layers(fx: sg.Seq2SeqFixture) -> int:
    config = fx.meta["config"]
    return int(config.get("decoder_layers", config.get("num_decoder_layers", 0)))


def _inplace(fx: sg.Seq2SeqFixture, out: Path) -> onnx.ModelProto:
    fastopt.optimize(str(fx.decoder), output=str(out), preset="llm", kv_cache="inplace")
    return onnx.load(str(out))


def _dims(v: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]


@pytest.mark.parametrize("fx", FIXTURES, ids=_ids(FIXTURES))
def test_inplace_decoder_generates_the_same_tokens(fx: sg.Seq2SeqFixture, tmp_path: Path) -> None:
    feeds = sg.encoder_feeds(fx)
    hidden = sg.encode(fx, feeds)
    mask = feeds.get("attention_mask")
    start = int(fx.meta["decoder_start_token_id"])
    m = _inplace(fx, tmp_path / "decoder.onnx")
    inputs = {i.name: i for i in m.graph.input}
    outputs = {o.name: o for o in m.graph.output}
    length = inputs["past_sequence_length"]
    assert length.type.tensor_type.elem_type == onnx.TensorProto.INT32 and _dims(length) == [1]
    producer = {o: n.op_type for n in m.graph.node for o in n.output}
    for i in range(_layers(fx)):
        for kv in ("key", "value"):
            past, present = f"past_key_values.{i}.decoder.{kv}", f"present.{i}.decoder.{kv}"
            # One buffer: past and present have the same (max) length dim, GQA writes it.
            assert _dims(inputs[past])[2] == _dims(outputs[present])[2] == "max_sequence_length"
            assert producer[present] == "GroupQueryAttention", present
            cross = f"present.{i}.encoder.{kv}"
            assert producer[cross] == "MultiHeadAttention", cross  # standard: filled once
    ops = collections.Counter(n.op_type for n in m.graph.node)
    assert ops["GroupQueryAttention"] == ops["MultiHeadAttention"] == _layers(fx), dict(ops)

    ref = sg.greedy_no_cache(fx.decoder, hidden, mask, start, STEPS)
    got = sg.greedy_inplace(tmp_path / "decoder.onnx", hidden, mask, start, STEPS)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logits, ref.logits, atol=PARITY_ATOL[fx.meta["dtype"]], rtol=0)
    # A longer buffer than the tokens need: its length must not leak into positions or masks.
    longer = sg.greedy_inplace(tmp_path / "decoder.onnx", hidden, mask, start, 8, max_length=80)
    np.testing.assert_array_equal(longer.tokens, ref.tokens[:, :8])
    # Each row alone: nothing leaks between rows (row 1's encoder padding included).
    for b in range(hidden.shape[0]):
        solo = sg.greedy_inplace(
            tmp_path / "decoder.onnx",
            hidden[b : b + 1],
            None if mask is None else mask[b : b + 1],
            start,
            8,
        )
        np.testing.assert_array_equal(solo.tokens[0], ref.tokens[b, :8])


@pytest.mark.parametrize(
    "fx",
    matrix_params(
        "seq2seq_inplace",
        sg.matrix_seq2seq_fixtures(),
        default_archs=sg.MATRIX_DEFAULT_ARCHS,
    ),
)
def test_matrix_inplace_decoder_generates_the_same_tokens(
    fx: sg.Seq2SeqFixture, tmp_path: Path
) -> None:
    """The same on the version matrix's encoder-decoders (tests/fixtures/matrix; strict xfails
    where expected_failures.json says "seq2seq_inplace"; bart under -m slow)."""
    test_inplace_decoder_generates_the_same_tokens(fx, tmp_path)


def test_inplace_needs_target_ort(tmp_path: Path) -> None:
    """No standard op shares one buffer as past and present: target onnx is refused, nothing
    written."""
    fx = sg.seq2seq_fixtures("bart")[0]
    with pytest.raises(fastopt.OptionError, match="needs target 'ort'"):
        fastopt.optimize(
            str(fx.decoder),
            output=str(tmp_path / "d.onnx"),
            preset="llm",
            target="onnx",
            kv_cache="inplace",
        )
    assert not (tmp_path / "d.onnx").exists()


def test_existing_past_sequence_length_refused(tmp_path: Path) -> None:
    """The in-place form adds the input past_sequence_length: a decoder that already computes a
    value of that name is refused, never rewired onto it."""
    fx = sg.seq2seq_fixtures("bart")[0]
    m = onnx.load(str(fx.decoder))
    node = next(n for n in m.graph.node if n.op_type == "Gather" and "input_ids" in n.input)
    old, node.output[0] = node.output[0], "past_sequence_length"
    for n in m.graph.node:
        n.input[:] = ["past_sequence_length" if x == old else x for x in n.input]
    src = tmp_path / "src.onnx"
    onnx.save(m, str(src))
    out = tmp_path / "d.onnx"
    with pytest.raises(fastopt.ModelError, match="'past_sequence_length' exists"):
        fastopt.optimize(str(src), output=str(out), preset="llm", kv_cache="inplace")
    assert not out.exists()
    fastopt.optimize(str(src), output=str(out), preset="llm", kv_cache="standard")


def test_cli_verify_inplace(tmp_path: Path) -> None:
    """`--kv-cache inplace --verify` on a seq2seq decoder: verify_generation feeds
    past_sequence_length and max-length self buffers beside the standard cross cache, exit 0."""
    from fastopt.cli.main import main

    fx = sg.seq2seq_fixtures("whisper")[0]
    out = tmp_path / "decoder.onnx"
    args = ["optimize", str(fx.decoder), "-o", str(out), "--preset", "llm"]
    assert main([*args, "--kv-cache", "inplace", "--verify"]) == 0


@pytest.mark.parametrize("kv_cache", ["standard", "inplace"])
@pytest.mark.parametrize("fx", FIXTURES, ids=_ids(FIXTURES))
def test_cross_recomputed_decoder_generates_the_same_tokens(
    fx: sg.Seq2SeqFixture, kv_cache: str, tmp_path: Path
) -> None:
    """Option cross_attention_cache 0 (the decoder onnxruntime-genai's whisper runs when its
    encoder gives no cross cache): only the self-attention is cached, the cross-attention reads
    encoder_hidden_states, fed whole at every step."""
    feeds = sg.encoder_feeds(fx)
    hidden = sg.encode(fx, feeds)
    mask = feeds.get("attention_mask")
    start = int(fx.meta["decoder_start_token_id"])
    out = tmp_path / "decoder.onnx"
    sg.cached_decoder(fx, kv_cache, 0, out)
    m = onnx.load(str(out))
    names = {i.name for i in m.graph.input} | {o.name for o in m.graph.output}
    assert not any(".encoder." in n for n in names), names
    assert "past_key_values.0.decoder.key" in names
    ref = sg.greedy_no_cache(fx.decoder, hidden, mask, start, STEPS)
    generate = sg.greedy_inplace if kv_cache == "inplace" else sg.greedy_cached
    got = generate(out, hidden, mask, start, STEPS)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logits, ref.logits, atol=PARITY_ATOL[fx.meta["dtype"]], rtol=0)


def test_genai_whisper_refuses_other_frame_counts(tmp_path: Path) -> None:
    """onnxruntime-genai 0.18 feeds a whisper encoder exactly 3000 frames; the fixtures' encoders
    take 64 (max_source_positions 32): refused with that reason, nothing written."""
    from fastopt.genai.whisper import whisper_for_genai

    fx = sg.seq2seq_fixtures("whisper")[0]
    folder = tmp_path / "genai"
    with pytest.raises(fastopt.UnsupportedModelError, match=r"exactly 3000 audio frames.* 64 "):
        whisper_for_genai(fx.encoder, fx.decoder, folder, fx.meta["config"])
    assert not folder.exists()


# A whisper of max_source_positions 1500 (the 3000 frames onnxruntime-genai feeds; the models/
# fixtures have 64), 1.8 MB, made by `tests/fixtures/make_seq2seq_fixtures.py --genai-whisper`.
WHISPER_3000 = TESTS / "fixtures" / "whisper_genai" / "ts_float32"


@pytest.fixture(scope="module")
def whisper_3000() -> Path:
    assert (WHISPER_3000 / "encoder.onnx").is_file()
    return WHISPER_3000


@pytest.mark.parametrize("cross_cache", ["encoder", "recompute"])
@pytest.mark.parametrize("kv_cache", ["standard", "inplace"])
def test_genai_runs_whisper(
    whisper_3000: Path, kv_cache: str, cross_cache: str, tmp_path: Path
) -> None:
    """onnxruntime-genai 0.18 on CPU runs the folder (og.Model, audio features in): its greedy
    tokens equal the original encoder + no-cache decoder's, with the cross cache computed by
    the encoder (genai binds it to the decoder) or recomputed by the decoder at every step."""
    og = pytest.importorskip("onnxruntime_genai")
    from fastopt.genai.whisper import whisper_for_genai

    fx = sg.Seq2SeqFixture(whisper_3000)
    config = fx.meta["config"]
    folder = tmp_path / "genai"
    report = whisper_for_genai(
        fx.encoder, fx.decoder, folder, config, kv_cache=kv_cache, cross_cache=cross_cache
    )
    assert report.config["search"]["past_present_share_buffer"] == (kv_cache == "inplace")
    decoder_inputs = {i.name for i in onnx.load(str(folder / "decoder.onnx")).graph.input}
    encoder_outputs = {o.name for o in onnx.load(str(folder / "encoder.onnx")).graph.output}
    from_encoder = cross_cache == "encoder"
    assert ("encoder_hidden_states" in decoder_inputs) == (not from_encoder)
    assert ("present.0.encoder.key" in encoder_outputs) == from_encoder
    assert ("cross_present_key_names" in report.config["model"]["encoder"]["outputs"]) == (
        from_encoder
    )
    features = sg.encoder_feeds(fx)["input_features"][:1]
    hidden = sg.encode(fx, {"input_features": features})
    start = int(fx.meta["decoder_start_token_id"])
    steps = 24
    ref = sg.greedy_no_cache(fx.decoder, hidden, None, start, steps).tokens[0].tolist()

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=steps + 1, do_sample=False)
    generator = og.Generator(model, params)
    inputs = og.NamedTensors()
    inputs["input_features"] = features
    generator.set_inputs(inputs)
    generator.append_tokens(np.array([[start]], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    got = list(generator.get_sequence(0))[1:]
    eos = int(config["eos_token_id"])
    want = ref[: ref.index(eos) + 1] if eos in ref else ref
    assert got == want


def test_cli_genai_whisper_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fastopt genai-whisper` on an encoder of 64 frames: one line naming the reason, exit 2."""
    import json

    from fastopt.cli.main import main

    fx = sg.seq2seq_fixtures("whisper")[0]
    config = tmp_path / "config.json"
    config.write_text(json.dumps(fx.meta["config"]))
    folder = tmp_path / "genai"
    args = ["genai-whisper", str(fx.encoder), str(fx.decoder), "-o", str(folder)]
    assert main([*args, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "exactly 3000 audio frames" in err
    assert not folder.exists()


@pytest.mark.parametrize("fx", FIXTURES, ids=_ids(FIXTURES))
def test_inplace_prompt_then_chunk(fx: sg.Seq2SeqFixture, tmp_path: Path) -> None:
    """Several tokens at once, batch 2: a 3-token prompt (P = 0), then a 2-token chunk after the
    past (P = 3, which GroupQueryAttention runs for batch > 1 only with query_seqlens); the
    logits of all 5 positions equal the no-cache decoder's on the whole sequence."""
    feeds = sg.encoder_feeds(fx)
    hidden = sg.encode(fx, feeds)
    mask = feeds.get("attention_mask")
    ids = np.array([[1, 7, 9, 4, 11], [1, 3, 8, 8, 2]], np.int64)
    original = sg.session(fx.decoder)
    (ref,) = original.run(["logits"], sg._decoder_feeds(original, ids, hidden, mask))
    out = tmp_path / "decoder.onnx"
    _inplace(fx, out)
    sess = sg.session(out)
    io = sess.io_binding()
    buffers, cross = {}, {}
    for i in sess.get_inputs():
        if not i.name.startswith("past_key_values."):
            continue
        shape = (2, int(i.shape[1]), 0, int(i.shape[3]))
        if ".decoder." in i.name:
            zeros = np.zeros((2, shape[1], 16, shape[3]), hidden.dtype)
            buffers[i.name] = ort.OrtValue.ortvalue_from_numpy(zeros)
        else:
            cross[i.name] = np.zeros(shape, hidden.dtype)
    logits = []
    for past, chunk, states in ((0, ids[:, :3], hidden), (3, ids[:, 3:], hidden[:, :0])):
        feed = {**sg._decoder_feeds(sess, chunk, states, mask), **cross}
        feed["past_sequence_length"] = np.array([past], np.int32)
        for k, v in feed.items():
            io.bind_cpu_input(k, np.ascontiguousarray(v))
        io.clear_binding_outputs()
        io.bind_output("logits")
        for n in cross:
            io.bind_output(n.replace("past_key_values.", "present.", 1))
        for n, buf in buffers.items():
            io.bind_ortvalue_input(n, buf)
            io.bind_ortvalue_output(n.replace("past_key_values.", "present.", 1), buf)
        sess.run_with_iobinding(io)
        outs = io.get_outputs()
        logits.append(outs[0].numpy())
        cross = {n: v.numpy() for n, v in zip(cross, outs[1:])}
    got = np.concatenate(logits, axis=1)
    np.testing.assert_allclose(got, ref, atol=PARITY_ATOL[fx.meta["dtype"]], rtol=0)
