"""fastopt.bench: inputs per model kind and phase, bindings, statistics, providers, reports."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt.bench as bench
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.bench import memory, report
from fastopt.bench.inputs import Port
from fastopt.bench.session import CUDA, plan_outputs
from fastopt.bench.timing import Stats, interleaved
from fastopt.cli.main import main
from onnx import TensorProto, helper
from support.bench_models import DECODER, ENCODER, cached_decoder

HAS_CUDA = CUDA in ort.get_available_providers()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench_models")
    return {
        "decoder": DECODER,
        "standard": cached_decoder(root / "standard", "standard"),
        "inplace": cached_decoder(root / "inplace", "inplace"),
        "encoder": ENCODER,
    }


def _runner(path: Path, **options: object) -> bench.Runner:
    return bench.Runner(path, provider="cpu", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("decoder", "decoder"),
        ("standard", "decoder_cache"),
        ("inplace", "decoder_inplace"),
        ("encoder", "encoder"),
    ],
)
def test_kind(models: dict[str, Path], name: str, kind: str) -> None:
    with _runner(models[name], seq=4) as r:
        assert r.workload.kind == kind
        assert bench.detect_kind(r.inputs, r.outputs) == kind


# (model, phase) -> (input_ids, attention_mask, past) shapes for batch 2, seq 8
SHAPES = {
    ("decoder", "prefill"): ((2, 8), (2, 8), None),
    ("decoder", "decode"): ((2, 9), (2, 9), None),  # recompute over seq + 1
    ("standard", "prefill"): ((2, 8), (2, 8), (2, 2, 0, 16)),
    ("standard", "decode"): ((2, 1), (2, 9), (2, 2, 8, 16)),
    ("inplace", "prefill"): ((2, 8), (2, 8), (2, 2, 8, 16)),
    ("inplace", "decode"): ((2, 1), (2, 9), (2, 2, 9, 16)),
    ("encoder", "prefill"): ((2, 8), (2, 8), None),
}


@pytest.mark.parametrize(("name", "phase"), list(SHAPES), ids=lambda v: str(v))
def test_input_shapes(models: dict[str, Path], name: str, phase: str) -> None:
    ids, mask, past = SHAPES[(name, phase)]
    with _runner(models[name], phase=phase, batch=2, seq=8) as r:
        feeds = r.workload.feeds
        assert feeds["input_ids"].shape == ids
        assert feeds["attention_mask"].shape == mask
        assert (feeds["attention_mask"] == 1).all()
        if past is None:
            assert not any(k.startswith("past") for k in feeds)
        else:
            assert feeds["past_key_values.1.value"].shape == past
        if "position_ids" in feeds:
            start = 8 if (phase, name) in (("decode", "standard"), ("decode", "inplace")) else 0
            assert feeds["position_ids"][1, 0] == start
        assert r.workload.tokens == (2 if phase == "decode" else 16)
        outputs = r.run_outputs()
        assert outputs[r.outputs[0].name].shape[:2] == ids


def test_decoder_decode_says_it_recomputes(models: dict[str, Path]) -> None:
    with _runner(models["decoder"], phase="decode", seq=8) as r:
        assert "recompute" in r.workload.note


def test_inplace_buffer_is_shared(models: dict[str, Path]) -> None:
    with _runner(models["inplace"], phase="decode", seq=8, max_length=32) as r:
        buffer = r.workload.feeds["past_key_values.0.key"]
        assert buffer.shape == (1, 2, 32, 16)
        assert r.io_binding
        assert r.workload.shared["present.0.key"] == "past_key_values.0.key"
        before = buffer[:, :, 8].copy()
        present = r.run_outputs()["present.0.key"]
        # the step wrote its key at position 8 of the one buffer, in place
        assert present.shape == buffer.shape
        assert not np.array_equal(before, buffer[:, :, 8])
        np.testing.assert_array_equal(present[:, :, 8], buffer[:, :, 8])


def test_inplace_max_length_too_short(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="max_length 8 is shorter than the 9 positions"):
        _runner(models["inplace"], phase="decode", seq=8, max_length=8)


def test_encoder_has_no_decode(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="needs a decoder"):
        _runner(models["encoder"], phase="decode", seq=8)


def test_bad_phase_and_sizes(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="phase must be one of"):
        _runner(models["decoder"], phase="generate")
    with pytest.raises(ValueError, match="must be positive"):
        _runner(models["decoder"], seq=0)


def test_other_model(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq_len", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq_len", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    result = bench.run(path, provider="cpu", batch=3, seq=5, runs=3, warmup=1)
    assert result.kind == "other"
    assert result.inputs == {"x": "float32[3, 5, 4]"}
    with pytest.raises(ValueError, match="needs a decoder"):
        bench.run(path, provider="cpu", phase="decode", runs=1)


def test_plan_outputs_for_cuda(models: dict[str, Path]) -> None:
    """The bindings the CUDA path would make: presents share the in-place buffers, the other
    outputs are pre-allocated with the shapes the step produces."""
    with _runner(models["inplace"], phase="decode", batch=2, seq=8) as r:
        plans = {p.name: p for p in plan_outputs(r.outputs, r.workload, preallocate=True)}
        assert plans["logits"].how == "preallocated"
        assert plans["logits"].shape == (2, 1, 512)
        assert plans["present.1.value"].how == "shared"
        assert plans["present.1.value"].past == "past_key_values.1.value"
    with _runner(models["standard"], phase="decode", batch=2, seq=8) as r:
        plans = {p.name: p for p in plan_outputs(r.outputs, r.workload, preallocate=True)}
        assert plans["present.0.key"].shape == (2, 2, 9, 16)
        assert plans["present.0.key"].dtype == np.float32
        unplanned = plan_outputs(r.outputs, r.workload, preallocate=False)
        assert {p.how for p in unplanned} == {"allocated"}
    # a dim nothing binds stays to ORT
    loose = [Port("y", "tensor(float)", ("batch_size", "unknown_dim"))]
    assert plan_outputs(loose, r.workload, preallocate=True)[0].how == "allocated"


def test_run_statistics(models: dict[str, Path]) -> None:
    result = bench.run(models["standard"], provider="cpu", phase="decode", seq=16, runs=7)
    assert result.provider == "CPUExecutionProvider"
    s = result.stats
    assert s.runs == 7
    assert 0 < s.min <= s.median <= s.p90 <= s.p99 <= s.max
    assert result.tokens == 1
    assert result.tokens_per_s == pytest.approx(1 / s.median)
    assert result.memory_bytes is None or result.memory_bytes >= 0
    data = result.to_dict()
    assert data["stats"]["median"] == s.median
    assert data["inputs"]["past_key_values.0.key"] == "float32[1, 2, 16, 16]"
    json.dumps(data)


def test_resolve_device() -> None:
    assert bench.resolve_device("auto", ["CPUExecutionProvider"]) == "cpu"
    assert bench.resolve_device("auto", [CUDA, "CPUExecutionProvider"]) == "cuda"
    assert bench.resolve_device("cuda", [CUDA, "CPUExecutionProvider"]) == "cuda"
    with pytest.raises(bench.ProviderUnavailableError, match="no CUDAExecutionProvider"):
        bench.resolve_device("cuda", ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="provider must be one of"):
        bench.resolve_device("gpu", ["CPUExecutionProvider"])


@pytest.mark.skipif(HAS_CUDA, reason="this onnxruntime has CUDA")
def test_cuda_absent_is_an_error(models: dict[str, Path]) -> None:
    with pytest.raises(bench.ProviderUnavailableError, match="install onnxruntime-gpu"):
        bench.run(models["decoder"], provider="cuda", runs=1)


def test_cuda_graph_needs_cuda(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="cuda_graph needs provider 'cuda'"):
        bench.run(models["decoder"], provider="cpu", cuda_graph=True, runs=1)


def test_stats() -> None:
    s = Stats.of([0.004, 0.001, 0.002, 0.003])
    assert (s.runs, s.median, s.min, s.max, s.mean) == (4, 0.0025, 0.001, 0.004, 0.0025)
    assert s.p90 == pytest.approx(0.0037)
    assert Stats.of([0.5]).stdev == 0.0
    with pytest.raises(ValueError):
        Stats.of([])


def test_interleaved_rotates() -> None:
    calls: list[str] = []
    times = interleaved(
        [lambda: calls.append("a"), lambda: calls.append("b")], 3, warmup=1, block=2
    )
    # warm-up; round 0: a (untimed, timed x2), b (same); round 1 rotated: b then a, 1 run left
    assert "".join(calls) == "ab" + "aaa" + "bbb" + "bb" + "aa"
    assert [len(t) for t in times] == [3, 3]
    single: list[str] = []
    assert len(interleaved([lambda: single.append("a")], 3, warmup=0)[0]) == 3
    assert single == ["a"] * 3  # one step: no untimed runs between blocks


def test_peak_rss_growth() -> None:
    with memory.PeakRssGrowth() as rss:
        block = np.ones(64 * 2**20, np.uint8)  # touched: resident
    del block
    if not memory._reset_peak():
        pytest.skip("this kernel does not let a process reset its peak RSS")
    assert rss.bytes is not None and rss.bytes >= 60 * 2**20


def test_parse_compute_apps() -> None:
    text = "123, 500\n456, 20\n123, 12\n"
    assert memory.parse_compute_apps(text, 123) == 512 * 2**20
    assert memory.parse_compute_apps(text, 789) is None
    assert memory.parse_compute_apps("[N/A]", 123) is None


def test_short_labels() -> None:
    labels = ["/a/x/model.onnx", "/a/y/model.onnx"]
    assert report.short_labels(labels) == ["x/model.onnx", "y/model.onnx"]
    assert report.short_labels(["/a/b/x/m.onnx", "/a/c/x/m.onnx"]) == ["b/x/m.onnx", "c/x/m.onnx"]


def test_compare_document(models: dict[str, Path]) -> None:
    results = bench.compare(
        [models["decoder"], models["standard"]], provider="cpu", phase="decode", seq=8, runs=3
    )
    assert [r.kind for r in results] == ["decoder", "decoder_cache"]
    doc = report.document(results)
    assert doc["results"][0]["ratio"] == 1.0
    assert doc["results"][1]["ratio"] == pytest.approx(
        results[1].stats.median / results[0].stats.median
    )
    assert doc["environment"]["onnxruntime"] == ort.__version__


# --- the CLI ----------------------------------------------------------------------------------


def test_cli_against_table_and_json(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", str(models["decoder"]), "--against", str(models["standard"])]
    argv += ["--phase", "decode", "--seq", "16", "--runs", "3", "--warmup", "1", "--vs-recompute"]
    assert main([*argv, "--provider", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "speed-up" in text and "tokens/s" in text
    # captured output is a pipe: a plain-text table (cli_output), no box characters
    rows = [line for line in text.splitlines() if "model.onnx" in line and " CPU " in line]
    assert len(rows) == 2
    assert rows[0].rstrip().endswith("1.00x")
    assert "17 tokens, no cache (recompute)" in rows[0] and "1 token after 16 cached" in rows[1]
    doc = json.loads(out.read_text())
    assert doc["results"][0]["ratio"] == 1.0
    assert doc["results"][1]["kind"] == "decoder_cache"
    assert doc["results"][1]["inputs"]["attention_mask"] == "int64[1, 17]"
    assert "cpu" in doc["environment"]


def test_cli_plot(models: dict[str, Path], tmp_path: Path) -> None:
    png = tmp_path / "latency.png"
    argv = ["bench", str(models["standard"]), "--against", str(models["inplace"])]
    argv += ["--phase", "decode", "--runs", "2", "--warmup", "1", "--provider", "cpu"]
    assert main([*argv, "--plot", str(png), "--seqs", "8,16,32"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_cli_plot_without_matplotlib(
    models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    code = main(["bench", str(models["decoder"]), "--plot", str(tmp_path / "x.png")])
    assert code == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastopt.bench.plot import plot_sweep

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_sweep([], "x.png")


def test_cli_bad_arguments(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", str(models["decoder"]), "--seqs", "a,b"])
    assert "--seqs takes integers" in capsys.readouterr().err
    if not HAS_CUDA:
        assert main(["bench", str(models["decoder"]), "--provider", "cuda"]) == 2
        assert "CUDAExecutionProvider" in capsys.readouterr().err


def test_default_seqs() -> None:
    from fastopt.cli.bench import default_seqs

    assert default_seqs(128) == [16, 32, 64, 128]
    assert default_seqs(4) == [1, 2, 4]
