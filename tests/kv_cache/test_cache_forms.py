"""The KV-cache forms as data (csrc/passes/kv_cache/cache_form.h, `_C.kv_cache_forms()`): each
entry says what add_kv_cache writes (the past/present names, their length dims, how P is fed,
whether present aliases past) and what genai_config.json calls them. These tests hold the table
to the graphs the rewrites write on real exports, and the genai configs to the table, so an entry
that drifts from its rewrite (or a rewrite that hard-codes a name again) fails here."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import onnx
import pytest
from fastopt import _C
from support.paths import TESTS

MODELS = TESTS / "fixtures" / "models"
FORMS = _C.kv_cache_forms()


def _dims(v: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]


def _optimize(path: Path, out: Path, **kwargs: object) -> onnx.ModelProto:
    fastopt.optimize(str(path), output=str(out), preset="llm", **kwargs)  # type: ignore[arg-type]
    return onnx.load(str(out), load_external_data=False)


def _check_layers(m: onnx.ModelProto, form: _C.KvCacheForm, layers: int) -> None:
    inputs = {i.name: i for i in m.graph.input}
    outputs = {o.name: o for o in m.graph.output}
    for i in range(layers):
        for past, present in (
            (form.past_key, form.present_key),
            (form.past_value, form.present_value),
        ):
            assert past % i in inputs and present % i in outputs
            past_len, present_len = _dims(inputs[past % i])[2], _dims(outputs[present % i])[2]
            if form.shares_buffer:  # one max-length buffer bound as both (the lowering's name)
                assert past_len == present_len == "max_sequence_length"
            else:
                assert (past_len, present_len) == (form.past_dim, form.present_dim)
    suffix = form.section + ".key"
    pasts = [n for n in inputs if n.startswith(_C.KV_PAST_PREFIX) and n.endswith(suffix)]
    assert len(pasts) == layers


def test_the_table_lists_every_form() -> None:
    assert sorted(FORMS) == sorted(
        [
            "standard",
            "inplace",
            "seq2seq",
            "seq2seq_inplace",
            "seq2seq_cross",
            "seq2seq_cross_from_encoder",
        ]
    )
    for name, form in FORMS.items():
        assert form.name == name
        assert form.past_key.startswith(_C.KV_PAST_PREFIX)
        assert form.present_value.startswith(_C.KV_PRESENT_PREFIX)
        assert form.past_key == _C.KV_PAST_PREFIX + "%d" + form.section + ".key"
    # Where P comes from: the mask's width for a decoder, the past's rows or the length input
    # for a seq2seq decoder (no attention_mask), nothing for a cross cache.
    assert FORMS["standard"].past_length == FORMS["inplace"].past_length == "attention_mask"
    assert FORMS["seq2seq"].past_length == "past_rows"
    assert FORMS["seq2seq_inplace"].past_length == "past_sequence_length"
    assert FORMS["seq2seq_cross"].past_length == "encoder"
    assert [n for n, f in FORMS.items() if f.shares_buffer] == ["inplace", "seq2seq_inplace"]


@pytest.mark.parametrize("kv_cache", ["standard", "inplace"])
def test_decoder_forms_are_what_add_kv_cache_writes(kv_cache: str, tmp_path: Path) -> None:
    form = FORMS[kv_cache]
    m = _optimize(
        MODELS / "llama_dynamo_float32" / "model.onnx", tmp_path / "m.onnx", kv_cache=kv_cache
    )
    _check_layers(m, form, 2)
    mask = next(i for i in m.graph.input if i.name == "attention_mask")
    assert _dims(mask)[1] == form.present_dim  # the mask covers past + new: T
    config = json.loads((tmp_path / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert decoder["inputs"][form.genai_past_key] == form.past_key
    assert decoder["inputs"][form.genai_past_value] == form.past_value
    assert decoder["outputs"][form.genai_present_key] == form.present_key
    assert decoder["outputs"][form.genai_present_value] == form.present_value
    assert config["search"]["past_present_share_buffer"] is form.shares_buffer


def test_an_adopted_cache_keeps_the_exports_names(tmp_path: Path) -> None:
    # A model exported with a cache: the attentions get the standard form's mask, the pasts
    # keep the exporter's names (bloom's TorchScript export: past_key_values.N.key).
    path = MODELS / "bloom_ts_float32_cache" / "model.onnx"
    before = {i.name for i in onnx.load(str(path), load_external_data=False).graph.input}
    m = _optimize(path, tmp_path / "m.onnx", kv_cache="standard")
    assert {i.name for i in m.graph.input} == before


@pytest.mark.parametrize(
    ("kv_cache", "cross", "cross_form"),
    [
        ("standard", 1, "seq2seq_cross"),
        ("inplace", 1, "seq2seq_cross"),
        ("standard", 2, "seq2seq_cross_from_encoder"),
    ],
)
def test_seq2seq_forms_are_what_add_kv_cache_writes(
    kv_cache: str, cross: int, cross_form: str, tmp_path: Path
) -> None:
    self_form = FORMS["seq2seq" if kv_cache == "standard" else "seq2seq_inplace"]
    m = _optimize(
        MODELS / "bart_dynamo_float32" / "decoder.onnx",
        tmp_path / "decoder.onnx",
        kv_cache=kv_cache,
        options={"cross_attention_cache": cross},
    )
    _check_layers(m, self_form, 2)
    _check_layers(m, FORMS[cross_form], 2)
    names = {i.name for i in m.graph.input}
    assert (self_form.past_length in names) == (self_form.past_length == "past_sequence_length")


def test_genai_whisper_names_come_from_the_table(tmp_path: Path) -> None:
    from fastopt.genai import whisper

    self_form, cross = FORMS["seq2seq"], FORMS["seq2seq_cross_from_encoder"]
    assert whisper.SELF_PAST_KEY == self_form.past_key == "past_key_values.%d.decoder.key"
    assert whisper.CROSS_PRESENT_VALUE == cross.present_value == "present.%d.encoder.value"
    assert (cross.genai_past_key, cross.genai_present_value) == (
        "cross_past_key_names",
        "cross_present_value_names",
    )
    assert FORMS["seq2seq_cross"].genai_past_key == ""  # genai 0.18 runs no such decoder
