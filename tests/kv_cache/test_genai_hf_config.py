"""genai_config.json from the Hugging Face checkpoint files (issue 29): token ids, model type,
context length and search defaults from config.json / generation_config.json given by
hf_config (--hf-config) or found beside the model; genai's own defaults, reported, where no
file tells; the tokenizer files copied so that og.Tokenizer(og.Model(folder)) opens the folder.

The checkpoint folders are written here from the configs transformers serialized when
tests/fixtures/make_fixtures.py exported the fixtures (random weights): config.json as
save_pretrained writes it, generation_config.json, a tokenizer trained with `tokenizers`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import pytest
from fastopt.cli.main import main
from support import kv_generation as kg
from support.paths import TESTS

MODELS = TESTS / "fixtures" / "models"
GEMMA3 = MODELS / "gemma3_dynamo_float32"
QWEN2 = MODELS / "qwen2_dynamo_float32"
LLAMA = MODELS / "llama_ts_float32"
SMOLLM2 = Path("/work/cache/smollm2")  # opt-in (slow), never required


def _meta(fixture: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((fixture / "meta.json").read_text())
    return meta


def _checkpoint(fixture: Path, folder: Path, **overrides: Any) -> dict[str, Any]:
    """``folder``/config.json: the config transformers serialized when the fixture was made
    (meta.json's "config", what save_pretrained writes), with ``overrides``."""
    config = {**_meta(fixture)["config"], **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return config


def _generation_config(folder: Path, **values: Any) -> None:
    (folder / "generation_config.json").write_text(json.dumps(values, indent=2))


def _tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer of at most ``vocab`` ids trained here with the tokenizers
    library: tokenizer.json, and the tokenizer_config.json naming its special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = byte_level(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=min(vocab, 300),
        special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=byte_level.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _genai_config(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((folder / "genai_config.json").read_text())
    return config


def _beside(fixture: Path, folder: Path) -> Path:
    """The fixture's model.onnx copied into ``folder`` (where the checkpoint files are)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(fixture / "model.onnx", folder / "model.onnx")
    return folder / "model.onnx"


def test_gemma3_token_ids_type_and_context_from_hf_config(tmp_path: Path) -> None:
    """Gemma 3 has bos 2, eos 1 (main wrote bos 1, eos 2: swapped), model_type gemma3_text and
    max_position_embeddings 256 (main wrote 2048); nothing of them falls back."""
    hf = tmp_path / "hf"
    written = _checkpoint(GEMMA3, hf)
    assert (written["bos_token_id"], written["eos_token_id"]) == (2, 1)
    out = tmp_path / "out" / "model.onnx"
    report = fastopt.optimize(
        GEMMA3 / "model.onnx", preset="llm", kv_cache="inplace", output=out, hf_config=hf
    )
    model = _genai_config(out.parent)["model"]
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (2, 1, 0)
    assert model["type"] == "gemma3_text"
    assert model["context_length"] == 256
    assert _genai_config(out.parent)["search"]["max_length"] == 256
    assert (
        report.genai_notes[0] == f"genai_config.json from config.json in {hf} (given by hf_config)"
    )
    fallback = [n for n in report.genai_notes if n.startswith("not known")]
    assert len(fallback) == 1 and "bos_token_id" not in fallback[0]
    assert "eos_token_id" not in fallback[0] and "type" not in fallback[0]
    assert "do_sample" in fallback[0]  # no generation_config.json: genai's search defaults
    # Gemma 3's sliding layers: kept in the graph, said so, no genai sliding_window section
    assert any(
        n.startswith("sliding window: config.json: sliding_window 4") for n in report.genai_notes
    )
    assert "sliding_window" not in model["decoder"]
    # the config is copied too: a later run on the output finds it beside the model
    assert json.loads((out.parent / "config.json").read_text()) == written


def test_qwen2_eos_list_and_search_from_generation_config_beside_the_model(
    tmp_path: Path,
) -> None:
    """Found beside the model without hf_config: generation_config.json's eos list wins over
    config.json's single eos (as transformers' generate and genai's builder take it), and the
    search defaults come from it."""
    folder = tmp_path / "qwen"
    model = _beside(QWEN2, folder)
    _checkpoint(QWEN2, folder, bos_token_id=10, eos_token_id=12)
    _generation_config(
        folder,
        bos_token_id=10,
        eos_token_id=[12, 10],
        pad_token_id=10,
        do_sample=True,
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        repetition_penalty=1.05,
        max_length=100,
    )
    out = tmp_path / "out" / "model.onnx"
    report = fastopt.optimize(model, preset="llm", kv_cache="standard", output=out)
    config = _genai_config(out.parent)
    assert config["model"]["eos_token_id"] == [12, 10]
    assert (config["model"]["bos_token_id"], config["model"]["pad_token_id"]) == (10, 10)
    assert config["model"]["type"] == "qwen2"
    assert config["model"]["context_length"] == 256
    search = config["search"]
    assert search["do_sample"] is True and search["top_k"] == 20 and search["max_length"] == 100
    assert (search["temperature"], search["top_p"], search["repetition_penalty"]) == (
        pytest.approx(0.7),
        pytest.approx(0.8),
        pytest.approx(1.05),
    )
    assert search["past_present_share_buffer"] is False
    assert "found beside the model" in report.genai_notes[0]
    assert not any(n.startswith("not known") for n in report.genai_notes)
    assert (out.parent / "generation_config.json").is_file()


@pytest.mark.parametrize("fixture", [LLAMA, QWEN2], ids=lambda p: p.name)
def test_context_length_is_max_position_embeddings(fixture: Path, tmp_path: Path) -> None:
    """max_position_embeddings 256 beside the model gives context_length 256 (main wrote the
    graph's rotary rows or 2048), and the rotary caches fastopt builds cover exactly that."""
    assert _meta(fixture)["config"]["max_position_embeddings"] == 256
    folder = tmp_path / "ckpt"
    model = _beside(fixture, folder)
    _checkpoint(fixture, folder)
    out = tmp_path / "out" / "model.onnx"
    fastopt.optimize(model, preset="llm", kv_cache="inplace", output=out)
    config = _genai_config(out.parent)
    assert config["model"]["context_length"] == 256
    assert config["search"]["max_length"] == 256


def test_no_config_reports_genai_defaults_not_guesses(tmp_path: Path) -> None:
    """No checkpoint files anywhere: genai's own defaults are written (bos 0, pad 0, eos = pad,
    type "decoder", search top_k 50) and one line lists them; the context length is the graph's
    positional table or a placeholder the report names; the tokenizer line says how to fix it."""
    out = tmp_path / "out" / "model.onnx"
    report = fastopt.optimize(LLAMA / "model.onnx", preset="llm", kv_cache="inplace", output=out)
    model = _genai_config(out.parent)["model"]
    assert (model["bos_token_id"], model["eos_token_id"], model["pad_token_id"]) == (0, 0, 0)
    assert model["type"] == "decoder"
    assert _genai_config(out.parent)["search"]["top_k"] == 50
    notes = report.genai_notes
    assert notes[0].startswith("genai_config.json: no checkpoint files")
    (fallback,) = [n for n in notes if n.startswith("not known")]
    for value in ("bos_token_id 0", "eos_token_id 0", "pad_token_id 0", "type 'decoder'"):
        assert value in fallback
    context = model["context_length"]
    assert f"context_length {context}" in " ".join(notes)
    assert "Tokenizer will not open" in notes[-1] and "--hf-config" in notes[-1]
    assert sorted(p.name for p in out.parent.iterdir()) == ["genai_config.json", "model.onnx"]


def test_genai_tokenizer_opens_the_folder(tmp_path: Path) -> None:
    """The tokenizer files are copied: og.Tokenizer(og.Model(folder)) encodes and decodes."""
    og = pytest.importorskip("onnxruntime_genai")
    hf = tmp_path / "hf"
    _checkpoint(LLAMA, hf)
    _tokenizer(hf, _meta(LLAMA)["config"]["vocab_size"])
    out = tmp_path / "out" / "model.onnx"
    report = fastopt.optimize(
        LLAMA / "model.onnx", preset="llm", kv_cache="inplace", output=out, hf_config=hf
    )
    assert report.genai_notes[-1].startswith(
        "tokenizer: copied tokenizer.json, tokenizer_config.json"
    )
    tokenizer = og.Tokenizer(og.Model(str(out.parent)))
    ids = tokenizer.encode("the lazy fox")
    assert len(ids) > 0 and max(ids) < 300
    assert tokenizer.decode(ids) == "the lazy fox"


@pytest.mark.slow
def test_genai_tokenizer_of_smollm2(tmp_path: Path) -> None:
    """SmolLM2's real tokenizer files (opt-in; skipped without /work/cache/smollm2) beside a
    fixture's config: genai's Tokenizer opens the folder and round-trips text."""
    og = pytest.importorskip("onnxruntime_genai")
    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.skip(f"{SMOLLM2} is not built (shared/realmodels/make-smollm2.sh)")
    hf = tmp_path / "hf"
    _checkpoint(LLAMA, hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(SMOLLM2 / name, hf / name)
    out = tmp_path / "out" / "model.onnx"
    fastopt.optimize(
        LLAMA / "model.onnx", preset="llm", kv_cache="inplace", output=out, hf_config=hf
    )
    assert (out.parent / "chat_template.jinja").is_file()
    tokenizer = og.Tokenizer(og.Model(str(out.parent)))
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_genai_greedy_stops_at_the_eos_of_generation_config(tmp_path: Path) -> None:
    """The token the model emits at step 3 is made the eos (in generation_config.json's list):
    onnxruntime-genai's greedy search stops right after emitting it, at the reference's 4th
    token, where it would otherwise run on."""
    og = pytest.importorskip("onnxruntime_genai")
    vocab = _meta(LLAMA)["config"]["vocab_size"]
    rng = np.random.default_rng(0)
    for _ in range(20):
        prompt = [int(t) for t in rng.integers(3, vocab, 7)]
        ref = kg.greedy_no_cache(LLAMA / "model.onnx", *kg.right_pad([prompt]), 8).tokens[0]
        if ref[3] not in ref[:3]:
            break
    else:
        pytest.fail("no prompt whose 4th greedy token is new")
    eos = int(ref[3])
    unused = min(set(range(vocab)) - {*prompt, *map(int, ref)})
    hf = tmp_path / "hf"
    _checkpoint(LLAMA, hf, eos_token_id=unused)
    _generation_config(hf, eos_token_id=[unused, eos])
    out = tmp_path / "out" / "model.onnx"
    fastopt.optimize(
        LLAMA / "model.onnx", preset="llm", kv_cache="inplace", output=out, hf_config=hf
    )
    model = og.Model(str(out.parent))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + len(ref), do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    got = []
    while not generator.is_done():
        generator.generate_next_token()
        got.append(int(generator.get_next_tokens()[0]))
    assert got == [int(t) for t in ref[:4]]


def test_quantize_writes_the_genai_folder_of_a_cached_model(tmp_path: Path) -> None:
    """quantize on a genai folder fastopt wrote (config.json copied into it): the int4 output's
    folder gets genai_config.json with the same ids and the in-place buffer, and the tokenizer."""
    hf = tmp_path / "hf"
    _checkpoint(GEMMA3, hf)
    _tokenizer(hf, 512)
    cached = tmp_path / "cached" / "model.onnx"
    fastopt.optimize(
        GEMMA3 / "model.onnx", preset="llm", kv_cache="inplace", output=cached, hf_config=hf
    )
    out = tmp_path / "int4" / "model.onnx"
    report = fastopt.quantize(cached, out, mode="int4")
    config = _genai_config(out.parent)
    assert (config["model"]["bos_token_id"], config["model"]["eos_token_id"]) == (2, 1)
    assert config["search"]["past_present_share_buffer"] is True
    assert "found beside the model" in report.genai_notes[0]
    assert (out.parent / "tokenizer.json").is_file()


def test_cli_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--hf-config on optimize prints where the values came from; a folder without config.json
    is one error line, exit 2, nothing written."""
    hf = tmp_path / "hf"
    _checkpoint(GEMMA3, hf)
    out = tmp_path / "out" / "model.onnx"
    args = ["optimize", str(GEMMA3 / "model.onnx"), "-o", str(out), "--kv-cache", "inplace"]
    assert main([*args, "--hf-config", str(hf)]) == 0
    printed = capsys.readouterr().out
    assert f"genai_config.json from config.json in {hf}" in printed
    assert _genai_config(out.parent)["model"]["bos_token_id"] == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    out2 = tmp_path / "out2" / "model.onnx"
    args = ["quantize", str(out), "-o", str(out2), "--mode", "int8"]
    assert main([*args, "--hf-config", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hf_config: ") and "no config.json" in err
    assert err.count("\n") == 1
    assert not out2.parent.exists()


def test_genai_whisper_token_ids_not_guessed(tmp_path: Path) -> None:
    """A whisper config without token ids: genai's defaults (0, eos = pad), reported; main wrote
    bos 1, eos 2, decoder_start 1."""
    from fastopt.genai.whisper import whisper_for_genai
    from support import seq2seq_generation as sg

    fx = sg.Seq2SeqFixture(TESTS / "fixtures" / "whisper_genai" / "ts_float32")
    config = dict(fx.meta["config"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        config.pop(key, None)
    report = whisper_for_genai(fx.encoder, fx.decoder, tmp_path / "genai", config)
    model = report.config["model"]
    ids = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    assert [model[k] for k in ids] == [0, 0, 0, 0]
    (line,) = report.notes
    assert line.startswith("not known") and all(f"{k} 0" in line for k in ids)
    kept = whisper_for_genai(fx.encoder, fx.decoder, tmp_path / "g2", fx.meta["config"])
    assert kept.config["model"]["eos_token_id"] == fx.meta["config"]["eos_token_id"]
    assert kept.notes == []


def test_quantize_keeps_the_ids_of_a_model_builder_folder(tmp_path: Path) -> None:
    """A folder the model builder wrote (genai_config.json and tokenizer, no config.json):
    quantize's output folder gets a genai_config.json with that config's ids, type, context
    and shared buffer (its past and present dims have different names), and the tokenizer."""
    og = pytest.importorskip("onnxruntime_genai")
    folder = TESTS / "fixtures" / "genai" / "qwen2_builder_fp32"
    before = json.loads((folder / "genai_config.json").read_text())
    out = tmp_path / "int4" / "model.onnx"
    report = fastopt.quantize(folder / "model.onnx", out, mode="int4")
    after = _genai_config(out.parent)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "type", "context_length"):
        assert after["model"][key] == before["model"][key], key
    assert after["search"]["past_present_share_buffer"] is True
    assert any(n.startswith("from the genai_config.json in") for n in report.genai_notes)
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "genai_config.json",
        "model.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    og.Model(str(out.parent))


def test_the_input_folders_genai_config_is_not_replaced(tmp_path: Path) -> None:
    """quantize into the input's own folder: its genai_config.json (naming the input) stays,
    and the report says why no config was written."""
    source = TESTS / "fixtures" / "genai" / "qwen2_builder_fp32"
    folder = tmp_path / "builder"
    shutil.copytree(source, folder)
    before = (folder / "genai_config.json").read_bytes()
    report = fastopt.quantize(folder / "model.onnx", folder / "model_int4.onnx", mode="int4")
    assert (folder / "genai_config.json").read_bytes() == before
    assert report.genai_notes[0].startswith("genai_config.json not written: ")


def _chat_tokenizer(folder: Path, template: bool = True) -> None:
    """A chat model's tokenizer: <|endoftext|> (id 1, its eos_token) and the chat template's
    end of turn <|im_end|> (id 3), as Qwen's and SmolLM2's instruct tokenizers name them."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": "<|endoftext|>", "pad_token": "<pad>"}
    if template:
        config["chat_template"] = (
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
        )
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def test_chat_end_of_turn_joins_eos_without_generation_config(tmp_path: Path) -> None:
    """No generation_config.json: config.json names the end of text (1) only; the chat
    template's end of turn (<|im_end|>, 3) joins the eos list, reported. With a
    generation_config.json its list stands as it is."""
    folder = tmp_path / "chat"
    model = _beside(QWEN2, folder)
    _checkpoint(QWEN2, folder, bos_token_id=1, eos_token_id=1)
    _chat_tokenizer(folder)
    out = tmp_path / "out" / "model.onnx"
    report = fastopt.optimize(model, preset="llm", kv_cache="standard", output=out)
    assert _genai_config(out.parent)["model"]["eos_token_id"] == [1, 3]
    (line,) = [n for n in report.genai_notes if n.startswith("eos_token_id: added")]
    assert "3 (<|im_end|>, the chat template's end of turn)" in line
    _generation_config(folder, eos_token_id=1)
    out2 = tmp_path / "out2" / "model.onnx"
    fastopt.optimize(model, preset="llm", kv_cache="standard", output=out2)
    assert _genai_config(out2.parent)["model"]["eos_token_id"] == 1


def test_tokenizer_eos_token_is_an_eos_without_any_config_eos(tmp_path: Path) -> None:
    """No file gives an eos id: the tokenizer's eos_token (<|endoftext|>, 1) is written, not
    genai's default (the pad id)."""
    folder = tmp_path / "chat"
    model = _beside(QWEN2, folder)
    config = _checkpoint(QWEN2, folder)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    _chat_tokenizer(folder, template=False)
    out = tmp_path / "out" / "model.onnx"
    fastopt.optimize(model, preset="llm", kv_cache="standard", output=out)
    assert _genai_config(out.parent)["model"]["eos_token_id"] == 1


def test_eos_outside_the_vocabulary_is_dropped_or_refused(tmp_path: Path) -> None:
    """generation_config.json's eos list holds an id past the vocabulary (512): it is dropped
    with a report line and onnxruntime-genai generates (it raised 'eos_token_id (100000) must
    be in range [0, 512)' at run time). With no eos left the genai folder is refused."""
    og = pytest.importorskip("onnxruntime_genai")
    folder = tmp_path / "hf"
    model = _beside(QWEN2, folder)
    _checkpoint(QWEN2, folder, eos_token_id=5)
    _generation_config(folder, eos_token_id=[5, 100000])
    out = tmp_path / "out" / "model.onnx"
    report = fastopt.optimize(model, preset="llm", kv_cache="standard", output=out)
    assert _genai_config(out.parent)["model"]["eos_token_id"] == 5
    assert any("dropped 100000, outside the vocabulary (512" in n for n in report.genai_notes)
    params = og.GeneratorParams(genai := og.Model(str(out.parent)))
    params.set_search_options(max_length=8, do_sample=False)
    generator = og.Generator(genai, params)
    generator.append_tokens(np.array([[7, 8, 9]], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    _generation_config(folder, eos_token_id=100000)
    with pytest.raises(fastopt.ModelError, match=r"eos_token_id 100000 is outside the vocab"):
        fastopt.optimize(model, preset="llm", kv_cache="standard", output=tmp_path / "o2" / "m")
    assert not (tmp_path / "o2").exists()


def test_genai_whisper_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fastopt genai-whisper --hf-config DIR`: config.json from the checkpoint folder,
    generation_config.json's token ids over it, the tokenizer files copied beside the model."""
    from support import seq2seq_generation as sg

    fx = sg.Seq2SeqFixture(TESTS / "fixtures" / "whisper_genai" / "ts_float32")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(fx.meta["config"]))
    _generation_config(hf, eos_token_id=7, decoder_start_token_id=9)
    _tokenizer(hf, 300)
    out = tmp_path / "genai"
    argv = ["genai-whisper", str(fx.encoder), str(fx.decoder), "-o", str(out)]
    assert main([*argv, "--hf-config", str(hf)]) == 0, capsys.readouterr().err
    model = _genai_config(out)["model"]
    assert (model["eos_token_id"], model["decoder_start_token_id"]) == (7, 9)
    assert model["decoder"]["num_hidden_layers"] == fx.meta["config"]["decoder_layers"]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert "from generation_config.json" in capsys.readouterr().out
    assert main([*argv[:-1], str(tmp_path / "g2")]) == 2  # neither --config nor --hf-config
    assert "--hf-config DIR" in capsys.readouterr().err
