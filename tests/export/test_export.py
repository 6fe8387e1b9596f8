"""`fastopt export HF_DIR -o OUT`: tiny checkpoints saved with save_pretrained (random weights,
nothing downloaded) exported with torch.onnx, checked, optimized and written as a folder
onnxruntime-genai runs; its greedy tokens must equal the PyTorch model's. Bad inputs: one line,
exit 2, nothing written. The slow tests (`-m slow`) export every fixture family from its config
and, with FASTOPT_SMOLLM2 naming a SmolLM2 folder (../shared/realmodels/make-smollm2.sh), a
real trained model."""

from __future__ import annotations

import builtins
import json
import os
import sys
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import pytest
from fastopt.cli.main import main
from support.paths import TESTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

EOS = 2
PROMPT = [5, 17, 42, 99, 7, 150, 3, 64]


def save_qwen2(folder: Path, tokenizer: bool = False, **overrides: Any) -> Any:
    """A 2-layer Qwen2 (hidden 64, vocab 256) with random weights, saved as a checkpoint."""
    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=EOS,
        initializer_range=0.1,
    )
    kw.update(overrides)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()
    model.save_pretrained(folder)
    if tokenizer:
        save_tokenizer(folder)
    return model


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE trained on the check's own prose (vocab 200 < the model's 256)."""
    from fastopt.export.check import TEXT
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(TEXT) * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)


def torch_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of the PyTorch model (fp32, no cache: every step reads the whole text)."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]), use_cache=False).logits
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
    return out


def genai_tokens(folder: Path, prompt: list[int], steps: int) -> list[int]:
    """onnxruntime-genai's greedy search on the folder as written (no edits): it stops at the
    eos the config names or after `steps` tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], np.int32))
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("qwen2") / "hf"
    model = save_qwen2(folder, tokenizer=True)
    return folder, model


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_export_decoder_genai_greedy_equals_pytorch(
    qwen2: tuple[Path, Any], tmp_path: Path, exporter: str
) -> None:
    hf, model = qwen2
    out = tmp_path / "out"
    report = fastopt.export(hf, out, exporter=exporter)  # type: ignore[arg-type]
    files = set(os.listdir(out))
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert "generation_config.json" in files
    assert not [n for n in os.listdir(tmp_path) if n != "out"]  # no scratch folder left
    (check,) = report.checks
    assert check.inputs == "real text (tokenizer)" and check.relative < 1e-4
    ops = report.optimize[0].ops_after
    assert ops.get("com.microsoft::GroupQueryAttention") == 2, ops
    steps = 12
    want = torch_greedy(model, PROMPT, steps)
    got = genai_tokens(out, PROMPT, steps)
    assert got == until_eos(want, {EOS}) and len(got) >= 4, (got, want)


def test_export_cli_int4_folder_runs_in_genai(qwen2: tuple[Path, Any], tmp_path: Path) -> None:
    """The CLI with optimize's flags: int4, the report; genai opens the folder and its
    tokenizer."""
    og = pytest.importorskip("onnxruntime_genai")
    hf, _ = qwen2
    out = tmp_path / "int4"
    report = tmp_path / "report.json"
    code = main(["export", str(hf), "-o", str(out), "--quantize", "int4", "--report", str(report)])
    assert code == 0
    ops = json.loads(report.read_text())["optimize"]["ops_after"]
    assert ops.get("com.microsoft::MatMulNBits", 0) > 0
    model = og.Model(str(out))
    tokenizer = og.Tokenizer(model)
    ids = tokenizer.encode("The river ran fast")
    assert len(ids) > 0 and "river" in tokenizer.decode(ids)
    assert len(genai_tokens(out, PROMPT, 6)) >= 1


def test_export_encoder(tmp_path: Path) -> None:
    """bert: model.onnx (last_hidden_state), fused, equal to PyTorch in ONNX Runtime."""
    import onnxruntime as ort

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
    )
    model = transformers.BertModel(config).eval()
    model.save_pretrained(tmp_path / "hf")
    report = fastopt.export(tmp_path / "hf", tmp_path / "out")
    assert report.kind == "encoder" and sorted(os.listdir(tmp_path / "out")) == [
        "config.json",
        "model.onnx",
    ]
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    sess = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"))
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": np.ones((2, 11), np.int64)})
    np.testing.assert_allclose(got[0], want.numpy(), atol=1e-4)
    assert report.optimize[0].ops_after != report.optimize[0].ops_before


# ---- bad input: one line, exit 2, nothing written ----


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    out = Path(argv[argv.index("-o") + 1])
    assert not out.exists() or not any(out.iterdir())
    assert not [n for n in os.listdir(out.parent) if n.startswith(f".{out.name}.")]
    return lines[0]


def test_refuses_folder_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hf").mkdir()
    _refused(capsys, ["export", str(tmp_path / "hf"), "-o", str(tmp_path / "o")], "config.json")


def test_refuses_recipe_flags_without_quantize_before_exporting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hf").mkdir()  # (no config.json: the flags are refused first)
    args = ["export", str(tmp_path / "hf"), "-o", str(tmp_path / "o"), "--recipe", "q4m"]
    _refused(capsys, args, "--recipe: only with --quantize")


def test_refuses_unknown_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8}))
    _refused(capsys, ["export", str(hf), "-o", str(tmp_path / "o")], "no_such_model")


def test_refuses_missing_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_qwen2(tmp_path / "hf")
    _refused(capsys, ["export", str(tmp_path / "hf"), "-o", str(tmp_path / "o")], "no tokenizer")


def _child_runs_first(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """The export's PyTorch process runs `code` (its monkeypatch) before its own main."""
    from fastopt.export import torch_process

    def command(request: Path) -> list[str]:
        main = "import sys\nfrom fastopt.export import child\n"
        main += f"sys.exit(child.main([{str(request)!r}]))"
        return [sys.executable, "-c", f"{code}\n{main}"]

    monkeypatch.setattr(torch_process, "child_command", command)


def test_refuses_export_failing_in_torch(
    qwen2: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.onnx fails in the export's process: its ExportError's line, as it wrote it."""
    fail = (
        "import torch\n"
        "def fail(*args, **kwargs):\n"
        "    raise RuntimeError('Unsupported: data-dependent control flow in forward')\n"
        "torch.onnx.export = fail"
    )
    _child_runs_first(monkeypatch, fail)
    line = _refused(
        capsys,
        ["export", str(qwen2[0]), "-o", str(tmp_path / "o")],
        "torch.onnx (dynamo) failed",
        "data-dependent",
        "--exporter torchscript",
    )
    assert "Traceback" not in line


def test_export_process_crash_or_kill_is_one_line(
    qwen2: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any other exception in the export's process is named in one line; a process killed by
    a signal (the OOM killer's 9) says so; nothing is written either way."""
    from fastopt.export import torch_process

    boom = (
        "from fastopt.export import child\n"
        "def boom(*args):\n"
        "    raise MemoryError('no room for the weights')\n"
        "child.export_torch = boom"
    )
    _child_runs_first(monkeypatch, boom)
    argv = ["export", str(qwen2[0]), "-o", str(tmp_path / "o")]
    line = _refused(capsys, argv, "the export process failed: MemoryError: no room")
    assert "Traceback" not in line
    kill = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    monkeypatch.setattr(torch_process, "child_command", lambda _: kill)
    _refused(capsys, argv, "the export process was killed (signal 9; out of memory?)")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_checkpoint_is_not_mapped_during_the_check(
    qwen2: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyTorch runs in a process of its own: torch.export keeps tensors viewing the
    safetensors mapping alive from C++ after the model is freed, so in one process the check in
    ONNX Runtime mapped the raw export beside the whole checkpoint (2.67x a 0.5B checkpoint's
    size at peak). Nothing is written when the block ends without the graphs."""
    from fastopt.export import pipeline

    weights = str((qwen2[0] / "model.safetensors").resolve())
    mapped: list[bool] = []
    check = pipeline.compare

    def compare_and_look(*args: Any) -> Any:
        mapped.append(weights in Path("/proc/self/maps").read_text())
        return check(*args)

    monkeypatch.setattr(pipeline, "compare", compare_and_look)
    with (
        pytest.raises(fastopt.ModelError, match="not written"),
        pipeline.stage(qwen2[0], tmp_path / "o") as staged,
    ):
        assert staged.report.checks
    assert mapped == [False], "the checkpoint is mapped while ONNX Runtime checks the export"
    assert not (tmp_path / "o").exists()


def test_kv_refusal_names_no_kv_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose cache add_kv_cache refuses (Phi-3's LongRoPE switch) but which exports
    and passes its check: the one-line refusal names --no-kv-cache (the slow family sweep
    checks the API's line and that the flag exports it)."""
    sys.path.insert(0, str(TESTS / "fixtures"))
    import make_fixtures as mf

    _, model = mf.build_model("phi3_longrope", "float32")
    _token_ids_in_vocab(model)
    model.save_pretrained(tmp_path / "hf")
    args = ["export", str(tmp_path / "hf"), "-o", str(tmp_path / "o"), "--no-tokenizer"]
    _refused(capsys, args, "add_kv_cache: ", "LongRoPE switch", "--no-kv-cache exports")


def test_refuses_non_empty_output(
    qwen2: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(qwen2[0]), "-o", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]


def test_without_the_extra_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_torch(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "torch":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    monkeypatch.delitem(sys.modules, "torch")
    (tmp_path / "hf").mkdir()
    line = _refused(
        capsys, ["export", str(tmp_path / "hf"), "-o", str(tmp_path / "o")], "fastopt[export]"
    )
    assert "torch" in line


def test_export_seq2seq_pair(tmp_path: Path) -> None:
    """t5: encoder.onnx and decoder.onnx (cross-attending, no cache), each checked against
    PyTorch and optimized; no genai_config (onnxruntime-genai has no t5 runner)."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        vocab_size=256, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    report = fastopt.export(tmp_path / "hf", tmp_path / "out", exporter="torchscript")
    assert report.kind == "seq2seq" and [c.graph for c in report.checks] == ["encoder", "decoder"]
    assert {"encoder.onnx", "decoder.onnx", "config.json"} <= set(os.listdir(tmp_path / "out"))
    assert "genai_config.json" not in os.listdir(tmp_path / "out")
    assert all(c.relative < 1e-4 for c in report.checks), [c.describe() for c in report.checks]


# ---- slow: every fixture family from its config, and a real trained model ----


def _genai_eos(folder: Path) -> set[int]:
    eos = json.loads((folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _fixture_archs() -> list[str]:
    sys.path.insert(0, str(TESTS / "fixtures"))
    import make_fixtures as mf

    return list(mf.ARCHS)


def _token_ids_in_vocab(model: Any) -> None:
    """The fixtures shrink the vocabulary (512) but keep the family's token ids (gpt2's eos
    50256): onnxruntime-genai refuses an eos outside the vocabulary, so ids past it become the
    last token (the PyTorch greedy run does not read them)."""
    last = model.config.vocab_size - 1
    for config in (model.config, getattr(model, "generation_config", None)):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > last:
                setattr(config, key, last)
            elif isinstance(value, list):
                setattr(config, key, [min(v, last) for v in value])


# Decoders whose cache the export refuses (one line, nothing written; --no-kv-cache exports them
# without one): the KV rewrite's own refusals, and a cache onnxruntime-genai cannot hold.
KV_REFUSED = {
    "phi3_longrope": r"add_kv_cache: .*LongRoPE switch",
    "lfm2": r"add_kv_cache: .*Conv .*needs a cached state of its own",
    "deepseek_v3": r"present.0.key has 4 heads of 48, present.0.value 4 of 32: onnxruntime-genai",
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", _fixture_archs())
def test_export_fixture_family(arch: str, tmp_path: Path) -> None:
    """Each family of tests/fixtures/make_fixtures.py, saved from its config with the fixture
    weights: the export passes its check; a decoder's folder generates in onnxruntime-genai the
    PyTorch model's greedy tokens. A decoder whose cache is refused (KV_REFUSED) is refused with
    the reason, nothing written, and exports without a cache."""
    import make_fixtures as mf

    _, model = mf.build_model(arch, "float32")
    _token_ids_in_vocab(model)
    model.save_pretrained(tmp_path / "hf")
    if arch in KV_REFUSED:
        with pytest.raises(fastopt.ModelError, match=KV_REFUSED[arch]) as refused:
            fastopt.export(tmp_path / "hf", tmp_path / "out", require_tokenizer=False)
        assert "\n" not in str(refused.value)
        assert "--no-kv-cache exports" in str(refused.value)
        assert not (tmp_path / "out").exists()
        assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no scratch folder left
        report = fastopt.export(
            tmp_path / "hf", tmp_path / "out", require_tokenizer=False, kv_cache=None
        )
        assert all(c.relative < 1e-3 for c in report.checks), [c.describe() for c in report.checks]
        assert "model.onnx" in os.listdir(tmp_path / "out")
        assert "genai_config.json" not in os.listdir(tmp_path / "out")
        return
    report = fastopt.export(tmp_path / "hf", tmp_path / "out", require_tokenizer=False)
    assert all(c.relative < 1e-3 for c in report.checks), [c.describe() for c in report.checks]
    if arch in mf.ENCODERS:
        assert report.kind == "encoder"
        return
    assert report.kind == "decoder"
    prompt = [p % model.config.vocab_size for p in PROMPT]
    want = torch_greedy(model.eval(), prompt, 10)
    got = genai_tokens(tmp_path / "out", prompt, 10)
    assert got == until_eos(want, _genai_eos(tmp_path / "out")), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["bart", "marian", "whisper", "t5"])
def test_export_seq2seq_family(arch: str, tmp_path: Path) -> None:
    sys.path.insert(0, str(TESTS / "fixtures"))
    import make_seq2seq_fixtures as ms

    ms._model(arch).save_pretrained(tmp_path / "hf")
    report = fastopt.export(tmp_path / "hf", tmp_path / "out")
    assert report.kind == "seq2seq"
    assert all(c.relative < 1e-3 for c in report.checks), [c.describe() for c in report.checks]
    assert {"encoder.onnx", "decoder.onnx"} <= set(os.listdir(tmp_path / "out"))


SMOLLM2_ENV = "FASTOPT_SMOLLM2"  # a SmolLM2-135M-Instruct folder (make-smollm2.sh builds one)


@pytest.mark.slow
def test_export_smollm2_generates_pytorch_greedy(tmp_path: Path) -> None:
    """A real trained model: text in, onnxruntime-genai's greedy tokens equal PyTorch's."""
    folder = os.environ.get(SMOLLM2_ENV)
    if not folder or not (Path(folder) / "config.json").is_file():
        pytest.skip(f"set {SMOLLM2_ENV} to a SmolLM2 transformers folder")
    og = pytest.importorskip("onnxruntime_genai")
    out = tmp_path / "out"
    report = fastopt.export(folder, out)
    (check,) = report.checks
    assert check.inputs == "real text (tokenizer)" and check.top1 == 1.0, check.describe()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = torch_greedy(model, prompt, 16)
    del model
    got = genai_tokens(out, prompt, 16)
    assert got == until_eos(want, _genai_eos(out)), (got, want)
    og_tok = og.Tokenizer(og.Model(str(out)))
    assert list(og_tok.encode("The capital of France is")) == prompt
