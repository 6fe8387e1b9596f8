"""Cross-provider verification: ``verify(..., providers=[...])``, ``compare_providers``, the
CPU-fallback report read from ORT profiles, and ``fastopt check``.

This machine's onnxruntime has only CPU, so the several-provider machinery runs for real on
CPU listed twice (the second time with options, which the CPU provider ignores), and an
accelerator is stood in for by patching the run of one provider (its outputs, or its profile).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastopt
import onnx
import pytest
from fastopt.cli.main import main
from fastopt.runtime.providers import placement_from_events, provider_name, read_profile
from support.llm_fixtures import fixtures

verify_module = importlib.import_module("fastopt.verify.core")
check_module = importlib.import_module("fastopt.verify.check")

# The CPU provider a second time: a run of its own with another label ("cpu#2").
CPU_AGAIN = ("cpu", {"arena_extend_strategy": "kSameAsRequested"})
DTYPES = ("float32", "float16")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """dtype -> (llama TorchScript fixture, its preset-llm optimization), "onnx-" + dtype -> (the
    same, optimized for target onnx) and "kv" -> (the fp32 fixture with a standard KV cache, the
    same)."""
    out: dict[str, tuple[Path, Path]] = {}
    folder = tmp_path_factory.mktemp("xprovider")
    for dtype in DTYPES:
        (fx,) = fixtures(arch="llama", exporter="ts", dtype=dtype)
        opt = folder / f"{dtype}.onnx"
        fastopt.optimize(fx.path, preset="llm", output=opt)
        out[dtype] = (fx.path, opt)
        # standard ops only: passes fastopt.check, which rejects ORT's default-domain
        # SimplifiedLayerNormalization
        onnx_target = folder / f"onnx-{dtype}.onnx"
        fastopt.optimize(fx.path, preset="llm", target="onnx", output=onnx_target)
        out[f"onnx-{dtype}"] = (fx.path, onnx_target)
    kv = folder / "kv.onnx"
    fastopt.optimize(out["float32"][0], preset="llm", kv_cache="standard", output=kv)
    out["kv"] = (kv, kv)
    return out


def kinds(report: fastopt.VerifyReport) -> list[tuple[str, str, str]]:
    return [(c.kind, c.subject, c.reference) for c in report.comparisons]


def graph_nodes(path: Path) -> int:
    """Nodes ORT runs as kernels: Constant nodes become initializers when a session loads."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return sum(1 for n in graph.node if n.op_type != "Constant")


# --- several providers, on CPU ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_providers_compare_both_models_on_each(
    models: dict[str, tuple[Path, Path]], dtype: str
) -> None:
    original, optimized = models[dtype]
    report = fastopt.verify(original, optimized, providers=["cpu", CPU_AGAIN])
    assert report.ok and report.providers == ["cpu", "cpu#2"]
    assert kinds(report) == [
        ("optimization", "optimized@cpu", "original@cpu"),
        ("optimization", "optimized@cpu#2", "original@cpu#2"),
        ("provider", "original@cpu#2", "original@cpu"),
        ("end-to-end", "optimized@cpu#2", "original@cpu"),
    ]
    # `outputs` keeps its meaning: the optimization on the first provider
    assert report.outputs is report.comparisons[0].outputs
    assert [o.name for o in report.outputs] == ["logits"]
    atol = {"float32": 1e-4, "float16": 1e-2}[dtype]
    assert all(o.atol == atol for c in report.comparisons for o in c.outputs)
    # the same kernels on the same inputs: the provider changed nothing
    assert report.comparisons[2].outputs[0].max_abs_err == 0.0
    assert [r.name for r in report.runs] == [
        "original@cpu",
        "optimized@cpu",
        "original@cpu#2",
        "optimized@cpu#2",
    ]
    for run in report.runs:
        assert run.placement is not None
        assert set(run.placement.nodes) == {"CPUExecutionProvider"}
        assert run.placement.fallback_count == 0 and not run.placement.transfers
    text = str(report)
    assert "providers: cpu, cpu#2" in text and "end-to-end" in text and "cpu fallbacks" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] and all(c["ok"] for c in data["comparisons"])
    assert data["runs"][0]["placement"]["fallback_count"] == 0


def test_profiled_placement_counts_the_nodes(models: dict[str, tuple[Path, Path]]) -> None:
    """ORT 1.32's profile, parsed: one kernel per fp32 node, all on CPU, except the few nodes
    ORT computes once at load (Casts of constants)."""
    original, optimized = models["float32"]
    report = fastopt.verify(original, optimized, providers=["cpu", CPU_AGAIN])
    by_run = {r.name: r.placement for r in report.runs}
    for role, path in (("original", original), ("optimized", optimized)):
        first, second = by_run[f"{role}@cpu"], by_run[f"{role}@cpu#2"]
        assert first is not None and first == second
        assert set(first.nodes) == {"CPUExecutionProvider"}
        assert 0.95 * graph_nodes(path) <= first.nodes["CPUExecutionProvider"] <= graph_nodes(path)


def test_one_provider_keeps_the_classic_report(models: dict[str, tuple[Path, Path]]) -> None:
    original, optimized = models["float32"]
    classic = fastopt.verify(original, optimized)
    for providers in (["cpu"], ["CPUExecutionProvider"], [CPU_AGAIN]):
        report = fastopt.verify(original, optimized, providers=providers)
        assert report.comparisons == []
        assert [r.placement for r in report.runs] == [None, None]  # CPU: nothing to profile
        assert report.outputs == classic.outputs
        assert set(report.seconds) == {"original", "optimized", "total"}
        assert "providers:" not in str(report)


def test_compare_providers_runs_one_model(models: dict[str, tuple[Path, Path]]) -> None:
    cached, _ = models["kv"]
    report = fastopt.compare_providers(cached, ["cpu", CPU_AGAIN], dims={"past_sequence_length": 3})
    assert report.ok and report.optimized == "" and report.outputs == []
    assert kinds(report) == [("provider", "original@cpu#2", "original@cpu")]
    names = {o.name for o in report.comparisons[0].outputs}
    assert "logits" in names and "present.0.key" in names
    assert "past_key_values.0.key float32[2, 2, 3, 16]" in str(report)
    with pytest.raises(ValueError, match="at least one provider"):
        fastopt.compare_providers(cached, [])


@pytest.fixture
def second_cpu_shifted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs on the second CPU entry return every float output shifted by 0.1, as a provider
    with wrong kernels would."""
    real = verify_module._run

    def run(source: Any, feeds: Any, provider: Any, prefix: Any = None) -> Any:
        names, outputs, placement = real(source, feeds, provider, prefix)
        if provider == ("CPUExecutionProvider", CPU_AGAIN[1]):
            outputs = {k: v + v.dtype.type(0.1) for k, v in outputs.items()}
        return names, outputs, placement

    monkeypatch.setattr(verify_module, "_run", run)
    yield


@pytest.mark.usefixtures("second_cpu_shifted")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_provider_that_changes_results_fails(
    models: dict[str, tuple[Path, Path]], dtype: str
) -> None:
    """The optimization is fine on both providers; the provider is not."""
    original, optimized = models[dtype]
    with pytest.raises(fastopt.VerifyError) as caught:
        fastopt.verify(original, optimized, providers=["cpu", CPU_AGAIN])
    report = caught.value.report
    verdicts = {(c.kind, c.subject): c.ok for c in report.comparisons}
    assert verdicts == {
        ("optimization", "optimized@cpu"): True,
        ("optimization", "optimized@cpu#2"): True,
        ("provider", "original@cpu#2"): False,
        ("end-to-end", "optimized@cpu#2"): False,
    }
    assert report.failed == [] and not report.ok
    message = str(caught.value)
    assert "original@cpu#2 vs original@cpu (provider)" in message and "logits" in message
    worst = report.comparisons[2].outputs[0]
    assert worst.max_abs_err == pytest.approx(0.1, rel=0.01)
    # a tolerance above the shift lets it pass
    assert fastopt.verify(original, optimized, providers=["cpu", CPU_AGAIN], atol=0.2).ok


# --- accelerators ----------------------------------------------------------------------------


def test_unavailable_cuda_is_refused_naming_the_available(
    models: dict[str, tuple[Path, Path]],
) -> None:
    original, optimized = models["float32"]
    for call in (
        lambda: fastopt.verify(original, optimized, providers=["cpu", "cuda"]),
        lambda: fastopt.compare_providers(original, ["cuda"]),
        lambda: fastopt.check(original, providers=["CUDA"]),
    ):
        with pytest.raises((ValueError, fastopt.CheckError)) as caught:
            call()
        text = str(caught.value)
        assert "'CUDAExecutionProvider' is not available" in text
        assert "cpu (CPUExecutionProvider)" in text


def test_a_provider_ort_drops_is_refused() -> None:
    """ORT starts a session on CPU alone when CUDA's libraries are missing."""
    check_module._check_started(
        ["CUDAExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    with pytest.raises(ValueError, match=r"could not start execution provider.*CUDA"):
        check_module._check_started([("CUDAExecutionProvider", {})], ["CPUExecutionProvider"])


def test_short_names() -> None:
    assert provider_name("cuda") == "CUDAExecutionProvider"
    assert provider_name("TRT") == "TensorrtExecutionProvider"
    assert provider_name(("dml", {"device_id": 0})) == "DmlExecutionProvider"
    assert provider_name("MyExecutionProvider") == "MyExecutionProvider"
    chosen = check_module.check_providers(["cpu", ("CPU", {"a": "1"})])
    assert chosen == ["CPUExecutionProvider", ("CPUExecutionProvider", {"a": "1"})]
    with pytest.raises(TypeError):
        provider_name(3)


def _event(node: str, op: str, provider: str, cat: str = "Node") -> dict[str, Any]:
    return {
        "cat": cat,
        "name": f"{node}_kernel_time",
        "args": {"op_name": op, "provider": provider},
    }


CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# What a CUDA session's profile holds, in ORT 1.32's format (see the run on CPU above).
MIXED_PROFILE = [
    {"cat": "Session", "name": "session_initialization", "args": {}},
    _event("mm0", "MatMul", CUDA),
    _event("mm0", "MatMul", CUDA),  # a second run of the same node
    {"cat": "Node", "name": "mm0_fence_before", "args": {"op_name": "MatMul"}},
    _event("Memcpy_token_0", "MemcpyToHost", CUDA),
    _event("topk0", "TopK", CPU),
    _event("topk1", "TopK", CPU),
    _event("uniq", "Unique", CPU),
    _event("Memcpy_token_1", "MemcpyFromHost", CUDA),
    _event("gqa0", "GroupQueryAttention", CUDA),
]


def test_profile_parser_on_mixed_providers(tmp_path: Path) -> None:
    placement = placement_from_events(MIXED_PROFILE, "cuda")
    assert placement.provider == CUDA
    assert placement.nodes == {CUDA: 2, CPU: 3}
    assert placement.fallbacks == {"TopK": ["topk0", "topk1"], "Unique": ["uniq"]}
    assert placement.fallback_count == 3
    assert placement.fallback_text() == "TopK 2, Unique 1"
    assert placement.transfers == {"MemcpyToHost": 1, "MemcpyFromHost": 1}
    # on a CPU session nothing is a fallback
    assert placement_from_events(MIXED_PROFILE, "cpu").fallbacks == {}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(MIXED_PROFILE))
    assert read_profile(str(path), CUDA) == placement
    assert not path.exists()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """ "cuda" is available, and its runs are CPU runs whose profile is MIXED_PROFILE."""
    ort = check_module.onnxruntime()
    available = ort.get_available_providers()
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, *available])
    real = verify_module._run

    def run(source: Any, feeds: Any, provider: Any, prefix: Any = None) -> Any:
        if provider != CUDA:
            return real(source, feeds, provider, prefix)
        assert prefix is not None, "accelerator runs are profiled"
        names, outputs, _ = real(source, feeds, None)
        return names, outputs, placement_from_events(MIXED_PROFILE, provider)

    monkeypatch.setattr(verify_module, "_run", run)
    yield


@pytest.mark.usefixtures("fake_cuda")
@pytest.mark.parametrize("dtype", DTYPES)
def test_accelerator_tolerances_and_fallback_report(
    models: dict[str, tuple[Path, Path]], dtype: str
) -> None:
    original, optimized = models[dtype]
    report = fastopt.verify(original, optimized, providers=["cpu", "cuda"])
    assert report.providers == ["cpu", "cuda"]
    tolerances = {c.subject: (c.outputs[0].atol, c.outputs[0].rtol) for c in report.comparisons}
    cpu, gpu = {"float32": (1e-4, 1e-3), "float16": (1e-2, 2e-2)}[dtype]
    assert tolerances == {
        "optimized@cpu": (cpu, cpu),
        "optimized@cuda": (gpu, gpu),
        "original@cuda": (gpu, gpu),
    }
    placements = {r.name: r.placement for r in report.runs}
    cuda_run = placements["optimized@cuda"]
    assert cuda_run is not None and cuda_run.fallback_count == 3
    table = report.placement_table()
    assert "optimized@cuda" in table and "TopK 2, Unique 1" in table
    assert "MemcpyFromHost 1, MemcpyToHost 1" in table
    # atol/rtol given override the accelerator's defaults
    strict = fastopt.verify(original, optimized, providers=["cpu", "cuda"], atol=0.5, rtol=0)
    assert {o.atol for c in strict.comparisons for o in c.outputs} == {0.5}
    # one accelerator alone: the classic comparison, profiled, with its looser tolerance
    alone = fastopt.verify(original, optimized, providers=["cuda"])
    assert alone.comparisons == [] and alone.outputs[0].atol == gpu
    assert [r.placement.fallback_count for r in alone.runs if r.placement] == [3, 3]


# --- fastopt check ---------------------------------------------------------------------------


def test_cli_check_against_on_two_providers(
    models: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original, optimized = models["onnx-float16"]
    out = tmp_path / "report.json"
    argv = ["check", str(optimized), "--providers", "cpu,CPUExecutionProvider"]
    argv += ["--against", str(original), "--json", str(out), "--dims", "batch=1", "seq=5"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "check passed" in text and "verify passed" in text
    assert "end-to-end" in text and "cpu fallbacks" in text
    data = json.loads(out.read_text())
    assert data["check"]["ok"] and data["verify"]["ok"]
    assert data["verify"]["inputs"]["input_ids"] == "int64[1, 5]"
    assert len(data["verify"]["comparisons"]) == 4
    # target ort's output (SimplifiedLayerNormalization in the ONNX domain) passes, judged by
    # ORT's schemas, and is said to run in ONNX Runtime only
    ort_target = models["float16"][1]
    assert (
        main(["check", str(ort_target), "--providers", "cpu,cpu", "--against", str(original)]) == 0
    )
    text = capsys.readouterr().out
    assert "check passed" in text and "verify passed" in text
    assert "runs in ONNX Runtime only" in text


def test_cli_check_against_compares_a_cached_model_by_generation(
    models: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KV-cached output takes past_key_values.* the original lacks: `check --against` compares
    greedy generations (it reported "a fastopt bug" before) and still fails a wrong pair."""
    cached, _ = models["kv"]
    original = models["float32"][0]
    out = tmp_path / "report.json"
    assert main(["check", str(cached), "--against", str(original), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verify passed: greedy generation" in text and "fastopt bug" not in text
    assert json.loads(out.read_text())["verify"]["tokens_original"]
    (other,) = fixtures(arch="qwen2", exporter="ts", dtype="float32")
    assert main(["check", str(cached), "--against", str(other.path)]) == 1
    assert "verify FAILED" in capsys.readouterr().out


@pytest.mark.usefixtures("second_cpu_shifted")
def test_cli_check_fails_when_providers_disagree(
    models: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, optimized = models["onnx-float32"]
    assert main(["check", str(optimized)]) == 0
    assert main(["check", str(optimized), "--providers", "cpu"]) == 0
    # the second CPU provider's options cannot be spelled on the command line: patch the call
    real = verify_module.compare_providers

    def with_options(model: Any, providers: Any, **kwargs: Any) -> Any:
        return real(model, [providers[0], CPU_AGAIN], **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify_module, "compare_providers", with_options)
        assert main(["check", str(optimized), "--providers", "cpu,cpu"]) == 1
    text = capsys.readouterr().out
    assert "verify FAILED" in text and "provider  original@cpu#2  original@cpu" in text


def test_cli_check_bad_input(
    models: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, optimized = models["onnx-float32"]
    cases = [
        ["--providers", "cpu,cuda"],
        ["--providers", ","],
        ["--dims", "batch"],
        ["--against", str(tmp_path / "missing.onnx")],
    ]
    for extra in cases:
        assert main(["check", str(optimized), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert main(["check", str(tmp_path / "missing.onnx")]) == 2


def test_cli_check_reports_a_failing_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Relu", ["x"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 17)],
    )
    path = tmp_path / "bad.onnx"
    onnx.save(bad, str(path))
    assert main(["check", str(path), "--providers", "cpu"]) == 1
    text = capsys.readouterr().out
    assert "check FAILED" in text and "verify" not in text


def test_cli_optimize_verify_on_providers(
    models: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    original, _ = models["float32"]
    out, report = tmp_path / "opt.onnx", tmp_path / "report.json"
    argv = ["optimize", str(original), "-o", str(out), "--preset", "llm", "--verify"]
    assert main([*argv, "--providers", "cpu,cpu", "--report", str(report)]) == 0
    verify = json.loads(report.read_text())["verify"]
    assert verify["providers"] == ["cpu", "cpu#2"] and len(verify["comparisons"]) == 4
    assert main([*argv, "--providers", "cuda"]) == 2
