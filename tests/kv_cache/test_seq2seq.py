"""Encoder-decoders (issue 13): bart, marian, whisper, t5 exported as optimum does (encoder.onnx,
decoder.onnx; tests/fixtures/make_seq2seq_fixtures.py). Self- and cross-attention fuse for both
targets, outputs stay within the parity bounds on a padded batch, and the decoder's KV cache
(add_kv_cache's seq2seq form, csrc/passes/kv_cache/kv_cache_cross.cc) generates the same 32
greedy tokens as the no-cache decoder, or is refused with the reason. t5's relative position bias
is kept and re-read over absolute positions (kv_cache_cross_bias.cc). The in-place form and
onnxruntime-genai's whisper: tests/kv_cache/test_seq2seq_inplace.py."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from support import seq2seq_generation as sg
from support.llm_fixtures import PARITY_ATOL, matrix_params

STEPS = 32
FIXTURES = sg.seq2seq_fixtures()
CACHED_ARCHS = {"bart", "marian", "whisper", "t5"}
# Ops a fused graph must not hold: the decomposed attention core and norm statistics.
RESIDUE = {"Softmax", "ReduceMean", "Pow", "Sqrt", "Erf", "Tanh"}
FUSED_ATTENTION = {
    "ort": {"MultiHeadAttention", "Attention", "GroupQueryAttention"},
    "onnx": {"Attention"},
}


def _ids(items: list[sg.Seq2SeqFixture]) -> list[str]:
    return [fx.name for fx in items]


def _optimize(
    src: Path, out: Path, target: str = "ort", kv_cache: str | None = None
) -> onnx.ModelProto:
    fastopt.optimize(str(src), output=str(out), preset="llm", target=target, kv_cache=kv_cache)
    return onnx.load(str(out))


def _ops(m: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(n.op_type for n in m.graph.node)


def _layers(fx: sg.Seq2SeqFixture) -> int:
    config = fx.meta["config"]
    return int(config.get("decoder_layers", config.get("num_decoder_layers", 0)))


def test_fixtures_present() -> None:
    assert {fx.arch for fx in FIXTURES} >= set(sg.SEQ2SEQ_ARCHS)
    for fx in FIXTURES:
        assert fx.encoder.is_file() and fx.decoder.is_file()


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", FIXTURES, ids=_ids(FIXTURES))
def test_fused_and_equal(fx: sg.Seq2SeqFixture, target: str, tmp_path: Path) -> None:
    feeds = sg.encoder_feeds(fx)
    hidden = sg.encode(fx, feeds)
    enc = _optimize(fx.encoder, tmp_path / "encoder.onnx", target)
    dec = _optimize(fx.decoder, tmp_path / "decoder.onnx", target)
    layers = _layers(fx)
    for m, attentions in ((enc, layers), (dec, 2 * layers)):
        ops = _ops(m)
        assert not RESIDUE & set(ops), {op: ops[op] for op in RESIDUE & set(ops)}
        assert sum(ops[op] for op in FUSED_ATTENTION[target]) == attentions, dict(ops)
    atol = PARITY_ATOL[fx.dtype]
    np.testing.assert_allclose(
        sg.encode(fx, feeds, tmp_path / "encoder.onnx").astype(np.float32),
        hidden.astype(np.float32),
        atol=atol,
        rtol=0,
    )
    mask = feeds.get("attention_mask")
    start = int(fx.meta["decoder_start_token_id"])
    ref = sg.greedy_no_cache(fx.decoder, hidden, mask, start, 4)
    got = sg.greedy_no_cache(tmp_path / "decoder.onnx", hidden, mask, start, 4)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logits, ref.logits, atol=atol, rtol=0)


# The version matrix's encoder-decoders (t5, whisper, bart from other transformers releases,
# tests/fixtures/matrix; make_matrix.py): the same checks, strict xfails where
# expected_failures.json records a failure ("seq2seq_preset", "seq2seq_kv"); t5 and whisper in
# the default run, bart under -m slow.
MATRIX = sg.matrix_seq2seq_fixtures()


@pytest.mark.parametrize(
    ("fx", "target"),
    matrix_params(
        "seq2seq_preset", MATRIX, [("ort",), ("onnx",)], default_archs=sg.MATRIX_DEFAULT_ARCHS
    ),
)
def test_matrix_fused_and_equal(fx: sg.Seq2SeqFixture, target: str, tmp_path: Path) -> None:
    test_fused_and_equal(fx, target, tmp_path)


CACHED = [fx for fx in FIXTURES if fx.arch in CACHED_ARCHS]


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", CACHED, ids=_ids(CACHED))
def test_cached_decoder_generates_the_same_tokens(
    fx: sg.Seq2SeqFixture, target: str, tmp_path: Path
) -> None:
    feeds = sg.encoder_feeds(fx)
    hidden = sg.encode(fx, feeds)
    mask = feeds.get("attention_mask")
    start = int(fx.meta["decoder_start_token_id"])
    cached = _optimize(fx.decoder, tmp_path / "decoder.onnx", target, kv_cache="standard")
    layers = _layers(fx)
    names = {i.name for i in cached.graph.input}
    outs = {o.name for o in cached.graph.output}
    for i in range(layers):
        for side in ("decoder", "encoder"):
            for kv in ("key", "value"):
                assert f"past_key_values.{i}.{side}.{kv}" in names
                assert f"present.{i}.{side}.{kv}" in outs
    ops = _ops(cached)
    assert not RESIDUE & set(ops)
    assert sum(ops[op] for op in FUSED_ATTENTION[target]) == 2 * layers, dict(ops)
    # The fused ops take the caches: each present comes out of one of them, not out of a Concat;
    # but Attention-23 in ONNX Runtime refuses the empty new rows a cross cache has after the
    # first step, so for target onnx the cross-attention reads the Concat.
    producer = {o: n.op_type for n in cached.graph.node for o in n.output}
    for o in outs:
        if o.startswith("present."):
            cross_concat = target == "onnx" and ".encoder." in o
            assert producer[o] in ({"Concat"} if cross_concat else FUSED_ATTENTION[target]), o
    ref = sg.greedy_no_cache(fx.decoder, hidden, mask, start, STEPS)
    got = sg.greedy_cached(tmp_path / "decoder.onnx", hidden, mask, start, STEPS)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logits, ref.logits, atol=PARITY_ATOL[fx.dtype], rtol=0)
    # Each row alone: nothing leaks between rows (the encoder padding of row 1 included).
    for b in range(hidden.shape[0]):
        solo = sg.greedy_cached(
            tmp_path / "decoder.onnx",
            hidden[b : b + 1],
            None if mask is None else mask[b : b + 1],
            start,
            8,
        )
        np.testing.assert_array_equal(solo.tokens[0], ref.tokens[b, :8])


@pytest.mark.parametrize(
    ("fx", "target"),
    matrix_params(
        "seq2seq_kv", MATRIX, [("ort",), ("onnx",)], default_archs=sg.MATRIX_DEFAULT_ARCHS
    ),
)
def test_matrix_cached_decoder_generates_the_same_tokens(
    fx: sg.Seq2SeqFixture, target: str, tmp_path: Path
) -> None:
    test_cached_decoder_generates_the_same_tokens(fx, target, tmp_path)


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", sg.seq2seq_fixtures("t5"), ids=_ids(sg.seq2seq_fixtures("t5")))
def test_t5_bias_kept_beside_the_mask(fx: sg.Seq2SeqFixture, target: str) -> None:
    """t5's one relative position bias (layer 0 computes it, every layer reads it) is re-read
    over the cached positions once; each self-attention takes it with the causal mask, each
    cross-attention only the encoder padding (t5's cross-attention has no bias)."""
    report = fastopt.optimize(str(fx.decoder), preset="llm", target=target, kv_cache="standard")
    (counters,) = [p.counters for p in report.passes if p.name == "add_kv_cache"]
    assert counters["relative position bias over absolute positions"] == 1
    assert counters["seq2seq decoder layers cached"] == _layers(fx)
    assert report.model is not None
    m = report.model.to_onnx()
    producer = {o: n for n in m.graph.node for o in n.output}
    tables = {i.name for i in m.graph.initializer if "relative_attention_bias" in i.name}
    assert len(tables) == 1

    def reads_table(v: str) -> bool:
        todo, seen = [v], set()
        while todo:
            x = todo.pop()
            if x in tables:
                return True
            if x in seen or x not in producer or producer[x].op_type == "Shape":
                continue  # a shape read takes no value
            seen.add(x)
            todo.extend(producer[x].input)
        return False

    attentions = [n for n in m.graph.node if n.op_type in FUSED_ATTENTION[target]]
    # The mask / bias input: MHA's attention_bias, GQA's (fp16 self-attention), Attention-23's.
    bias_input = {"MultiHeadAttention": 5, "GroupQueryAttention": 10}
    masks = [n.input[bias_input.get(n.op_type, 3)] for n in attentions]
    kinds = [
        "cross" if "EncDec" in n.name or "encoder" in " ".join(n.input) else "self"
        for n in attentions
    ]
    assert [reads_table(v) for v in masks] == [k == "self" for k in kinds], kinds


def _edited_t5(tmp_path: Path, edit: str) -> Path:
    """The t5 TorchScript decoder with its relative position bias changed so that it no longer
    follows key - query over 0-based positions: the query positions start at 1 ("start"), the
    relative position is key + query ("add"), or the bias is laid out (heads, key, query)
    ("perm": still a function of the difference, but not the layout the rewrite widens), or the
    bias is also a graph output ("output": the rewrite would change what it returns)."""
    fx = next(f for f in sg.seq2seq_fixtures("t5", "float32") if "_ts_" in f.name)
    m = onnx.load(str(fx.decoder))
    attention = "/m/decoder/block.0/layer.0/SelfAttention/"
    nodes = {n.name: n for n in m.graph.node}
    if edit == "start":
        m.graph.initializer.append(onnx.helper.make_tensor("one", onnx.TensorProto.INT64, [], [1]))
        nodes[attention + "Range"].input[0] = "one"
    elif edit == "output":
        bias = attention + "relative_attention_bias/Gather_output_0"
        m.graph.output.append(
            onnx.helper.make_tensor_value_info(bias, onnx.TensorProto.FLOAT, None)
        )
    elif edit == "perm":
        (perm,) = nodes[attention + "Transpose_3"].attribute
        perm.ints[:] = [2, 1, 0]
    else:
        nodes[attention + "Sub"].op_type = "Add"
    src = tmp_path / "src.onnx"
    onnx.save(m, str(src))
    return src


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ("start", "does not count 0, 1"),
        ("add", "do not come from one Sub of key and query positions"),
        ("perm", r"not laid out as \(heads, query, key\)"),
        ("output", "is a graph output"),
    ],
)
def test_t5_bias_not_over_key_minus_query_refused(edit: str, reason: str, tmp_path: Path) -> None:
    """A relative position bias the rewrite cannot prove to be table[f(key - query)] over the
    positions 0 .. S - 1 (which it re-reads as P + s and 0 .. T - 1) is refused, never cached; the
    decoder without a cache still optimizes."""
    src = _edited_t5(tmp_path, edit)
    with pytest.raises(fastopt.ModelError, match="position bias this rewrite cannot prove") as e:
        _optimize(src, tmp_path / "decoder.onnx", kv_cache="standard")
    assert re.search(reason, str(e.value)), str(e.value)
    assert not (tmp_path / "decoder.onnx").exists()
    _optimize(src, tmp_path / "plain.onnx")


def test_cross_mask_that_is_not_padding_is_refused(tmp_path: Path) -> None:
    """A decoder whose cross-attention mask is not the encoder padding (here its inverse, 1 -
    encoder_attention_mask) is refused, never cached."""
    fx = sg.seq2seq_fixtures("bart", "float32")[0]
    m = onnx.load(str(fx.decoder))
    for node in m.graph.node:
        for i, name in enumerate(node.input):
            if name == "encoder_attention_mask":
                node.input[i] = "inverted_mask"
    m.graph.initializer.append(onnx.helper.make_tensor("one", onnx.TensorProto.INT64, [], [1]))
    invert = onnx.helper.make_node("Sub", ["one", "encoder_attention_mask"], ["inverted_mask"])
    nodes = [invert, *m.graph.node]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    src = tmp_path / "src.onnx"
    onnx.save(m, str(src))
    with pytest.raises(fastopt.ModelError, match="not proven to be the encoder padding"):
        _optimize(src, tmp_path / "decoder.onnx", kv_cache="standard")


def test_cli_verify_generation(tmp_path: Path) -> None:
    """`--kv-cache standard --verify` on a seq2seq decoder compares greedy generation over random
    encoder states (verify_generation), exit 0."""
    from fastopt.cli.main import main

    fx = sg.seq2seq_fixtures("whisper", "float32")[0]
    out = tmp_path / "decoder.onnx"
    args = ["optimize", str(fx.decoder), "-o", str(out), "--preset", "llm"]
    assert main([*args, "--kv-cache", "standard", "--verify"]) == 0
    assert not (tmp_path / "genai_config.json").exists()  # onnxruntime-genai: not for seq2seq


def test_encoder_cache_refused(tmp_path: Path) -> None:
    """An encoder (bidirectional self-attention over input_ids / attention_mask) is no decoder:
    its mask is not causal, so no cache is added."""
    fx = sg.seq2seq_fixtures("bart", "float32")[0]
    with pytest.raises(fastopt.ModelError, match="not proven to be causal"):
        _optimize(fx.encoder, tmp_path / "encoder.onnx", kv_cache="standard")


def _t5_449_sliced(tmp_path: Path, edit: str | None) -> Path:
    """The TorchScript t5 decoder of transformers 4.49 (tests/fixtures/matrix), whose
    T5Attention slices its position bias to the last S query rows (position_bias[:, :, -S:, :])
    between the table lookup and the mask; `edit` "key" moves that Slice to the key axis, "end"
    makes it stop after two rows (neither keeps the bias whole)."""
    (fx,) = sg.matrix_seq2seq_fixtures("4.49.0", "t5", "ts")
    m = onnx.load(str(fx.decoder))
    name = "/m/decoder/block.0/layer.0/SelfAttention/Slice"
    (node,) = [n for n in m.graph.node if n.name == name]
    if edit is not None:
        value = {"key": [3], "end": [2]}[edit]
        m.graph.initializer.append(
            onnx.helper.make_tensor(edit, onnx.TensorProto.INT64, [1], value)
        )
        node.input[3 if edit == "key" else 2] = edit
    src = tmp_path / "src.onnx"
    onnx.save(m, str(src))
    return src


def test_t5_bias_sliced_to_the_queries_is_accepted(tmp_path: Path) -> None:
    """transformers 4.49's t5 slices its bias to the last S query rows: a Slice from -S (a
    decoder length) to the end over the query axis keeps every row, with or without a past, so
    the self-attention's bias is accepted. Its cross-attention's mask, zeros of
    (1, H, S, E) sized from Shape(hidden states) plus the padding, reads the hidden states' S
    only as the size of a broadcast (the norm above that Shape has no type on its query axis):
    the cache is added (main refused it: "SimplifiedLayerNormalization ... cannot evaluate")."""
    src = _t5_449_sliced(tmp_path, None)
    cached = _optimize(src, tmp_path / "decoder.onnx", kv_cache="standard")
    names = {i.name for i in cached.graph.input}
    assert {"past_key_values.0.encoder.key", "past_key_values.0.decoder.key"} <= names


def test_t5_zero_bias_dim_read_as_a_value_is_refused(tmp_path: Path) -> None:
    """The same decoder with the hidden states' S (read off Shape(hidden), whose size the types
    do not give) also cutting the padding's key axis (Slice ends): the mask then reads that dim
    as a value, not as the size of a broadcast, so the check refuses it, naming the Slice."""
    (fx,) = sg.matrix_seq2seq_fixtures("4.49.0", "t5", "ts")
    m = onnx.load(str(fx.decoder))
    cross = "/m/decoder/block.0/layer.1/EncDecAttention/"
    (node,) = [n for n in m.graph.node if n.name == cross + "Slice"]
    node.input[2] = cross + "Unsqueeze_3_output_0"  # ends: S instead of the keys' length
    src = tmp_path / "src.onnx"
    onnx.save(m, str(src))
    with pytest.raises(fastopt.ModelError, match="not proven to be the encoder padding") as e:
        _optimize(src, tmp_path / "decoder.onnx", kv_cache="standard")
    reason = str(e.value)
    assert re.search(r"Slice '[^']*' of the mask reads a dim whose size", reason), reason


@pytest.mark.parametrize("edit", ["key", "end"])
def test_t5_bias_slice_that_cuts_is_refused(edit: str, tmp_path: Path) -> None:
    """The same Slice on the key axis, or stopping short: refused, never cached."""
    src = _t5_449_sliced(tmp_path, edit)
    with pytest.raises(fastopt.ModelError, match=r"is not x\[\.\.\., -S:, \.\.\.\] over the query"):
        _optimize(src, tmp_path / "decoder.onnx", kv_cache="standard")
