"""pytest-benchmark I/O benchmarks on a ~220 MB generated model, plus checks of the generator.

Not part of the default test run (pyproject's testpaths is tests/). Run with:

    pytest bench/ --benchmark-only             # just the benchmark tables
    pytest bench/                              # also the generator / comparison checks
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent / "models"  # make_llm_model
sys.path.insert(0, str(MODELS))
from bench_io import DATA_FILE, MODEL_FILE, compare_models, warm_cache  # noqa: E402
from make_llm_model import MEDIUM, TINY, LLMConfig, make_from_config, model_bytes, run_ort  # noqa: E402

ROUNDS = 5


@pytest.fixture(scope="module")
def fastopt() -> ModuleType:
    return pytest.importorskip("fastopt")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_from_config(TINY, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_from_config(MEDIUM, tmp_path_factory.mktemp("medium"), check=False)
    warm_cache([path, os.path.join(os.path.dirname(path), DATA_FILE)])
    return path


@pytest.fixture
def out_path(tmp_path: Path) -> Path:
    return tmp_path / "out" / MODEL_FILE


def _fresh(out: Path) -> Callable[[], None]:
    """pedantic setup: every round writes into an empty directory (untimed)."""

    def setup() -> None:
        shutil.rmtree(out.parent, ignore_errors=True)
        out.parent.mkdir(parents=True)

    return setup


# --- benchmarks ----------------------------------------------------------------------------


@pytest.mark.benchmark(group="load")
def test_fastopt_load(benchmark: Any, fastopt: ModuleType, medium_model: str) -> None:
    m = benchmark.pedantic(fastopt.load, args=(medium_model,), rounds=ROUNDS, warmup_rounds=1)
    assert len(m.graph.nodes) > 0


@pytest.mark.benchmark(group="load")
def test_onnx_load(benchmark: Any, medium_model: str) -> None:
    m = benchmark.pedantic(onnx.load, args=(medium_model,), rounds=ROUNDS, warmup_rounds=1)
    assert len(m.graph.node) > 0


@pytest.mark.benchmark(group="load+save")
def test_fastopt_load_save(
    benchmark: Any, fastopt: ModuleType, medium_model: str, out_path: Path
) -> None:
    def run() -> None:
        fastopt.load(medium_model).save(str(out_path), external_data=True)

    benchmark.pedantic(run, setup=_fresh(out_path), rounds=ROUNDS, warmup_rounds=1)
    assert compare_models(medium_model, str(out_path))["equal"]


@pytest.mark.benchmark(group="load+save")
def test_onnx_load_save(benchmark: Any, medium_model: str, out_path: Path) -> None:
    def run() -> None:
        onnx.save(
            onnx.load(medium_model),
            str(out_path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=DATA_FILE,
        )

    benchmark.pedantic(run, setup=_fresh(out_path), rounds=ROUNDS, warmup_rounds=1)


@pytest.mark.benchmark(group="load+save")
def test_cp_baseline(benchmark: Any, medium_model: str, out_path: Path) -> None:
    src_dir = os.path.dirname(medium_model)
    files = [os.path.join(src_dir, MODEL_FILE), os.path.join(src_dir, DATA_FILE)]

    def run() -> None:
        subprocess.run(["cp", *files, str(out_path.parent)], check=True)

    benchmark.pedantic(run, setup=_fresh(out_path), rounds=ROUNDS, warmup_rounds=1)


# --- checks of the generator and the comparison (skipped by --benchmark-only) -----------------


def _reference_logits(model_path: str, cfg: LLMConfig, ids: np.ndarray) -> np.ndarray:
    """What the generated graph is meant to compute, in numpy."""
    w = {t.name: numpy_helper.to_array(t) for t in onnx.load(model_path).graph.initializer}
    d = cfg.hidden // cfg.heads

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * weight

    def split(x: np.ndarray) -> np.ndarray:  # [B, S, H] -> [B, heads, S, d]
        return x.reshape(*x.shape[:2], cfg.heads, d).transpose(0, 2, 1, 3)

    x = w["model.embed_tokens.weight"][ids]
    for layer in range(cfg.layers):
        p = f"model.layers.{layer}"
        y = rms(x, w[f"{p}.input_layernorm.weight"])
        q, k, v = (split(y @ w[f"{p}.self_attn.{n}_proj.weight"]) for n in "qkv")
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
        probs = np.exp(s - s.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(x.shape)
        x = x + ctx @ w[f"{p}.self_attn.o_proj.weight"]
        y = rms(x, w[f"{p}.post_attention_layernorm.weight"])
        gate = y @ w[f"{p}.mlp.gate_proj.weight"]
        act = gate / (1 + np.exp(-gate)) * (y @ w[f"{p}.mlp.up_proj.weight"])
        x = x + act @ w[f"{p}.mlp.down_proj.weight"]
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"]


def test_tiny_model_valid_and_runs(tiny_model: str) -> None:
    onnx.checker.check_model(tiny_model)
    m = onnx.load(tiny_model, load_external_data=False)
    weights = [t for t in m.graph.initializer if t.name.endswith(".weight")]
    assert weights and all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)
    data = os.path.join(os.path.dirname(tiny_model), DATA_FILE)
    assert os.path.getsize(data) == model_bytes(TINY)
    ops = {n.op_type for n in m.graph.node}
    assert {"Gather", "Pow", "ReduceMean", "Sqrt", "Div", "Softmax", "Sigmoid"} <= ops

    ids = np.random.default_rng(1).integers(0, TINY.vocab, (2, 7), dtype=np.int64)
    logits = run_ort(tiny_model, ids)
    assert logits.shape == (2, 7, TINY.vocab)
    np.testing.assert_allclose(
        logits, _reference_logits(tiny_model, TINY, ids), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiny_model_other_dtypes(tmp_path: Path, dtype: str) -> None:
    cfg = LLMConfig(**{**TINY.__dict__, "dtype": dtype})
    path = make_from_config(cfg, tmp_path)  # runs the checker
    assert os.path.getsize(tmp_path / DATA_FILE) == model_bytes(cfg)
    if dtype == "float16":  # onnxruntime's CPU provider lacks bf16 Pow etc.
        assert np.isfinite(run_ort(path)).all()


def test_generator_streams_weights(tmp_path: Path) -> None:
    """Writing ~220 MB must not hold the model in memory (child peak RSS well below the size)."""
    # VmHWM, not ru_maxrss: exec inherits the (large) pytest process's ru_maxrss
    code = (
        "import sys; sys.path[:0] = sys.argv[1].split(',');"
        "from bench_io import _proc_status;"
        "from make_llm_model import MEDIUM, make_from_config;"
        "make_from_config(MEDIUM, sys.argv[2], check=False);"
        "print(_proc_status()['VmHWM'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, f"{HERE},{MODELS}", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert int(out.stdout.split()[-1]) < 150 * 2**20 < model_bytes(MEDIUM)


def test_compare_models(tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / MODEL_FILE
    onnx.save(
        onnx.load(tiny_model),
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_FILE,
        size_threshold=0,
    )
    res = compare_models(tiny_model, str(out))
    assert res["equal"], res["diffs"]
    assert res["bytes_compared"] > 0

    # one flipped byte in the last weight must be found
    with open(tmp_path / DATA_FILE, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    res = compare_models(tiny_model, str(out))
    assert not res["equal"]
    assert any("lm_head.weight" in d for d in res["diffs"])


def test_fastopt_roundtrip_tiny(fastopt: ModuleType, tiny_model: str, tmp_path: Path) -> None:
    out = tmp_path / MODEL_FILE
    fastopt.load(tiny_model).save(str(out), external_data=True)
    res = compare_models(tiny_model, str(out))
    assert res["equal"], res["diffs"]
