"""Bounded fuzzing of the reader and the pass pipeline (tests/fuzz/), plus the saved regression
inputs.

The short runs are part of every test run; the long ones are opt-in (pytest -m slow). Each runs
a fuzzer in a child process through tests/fuzz/run_fuzz.py, so that a crash fails the test
instead of killing pytest: the atheris harness over the extension, and the libFuzzer binaries
(ASan + UBSan, tests/fuzz/build.sh) where clang built them (skipped where clang is absent).
Regression inputs replay through the extension always, and through the binaries when present.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import fastopt
import pytest
from support.paths import ROOT, TESTS

FUZZ_DIR = TESTS / "fuzz"
# Where tests/fuzz/build.sh puts the sanitizer binaries (FASTOPT_FUZZ_BUILD overrides).
FUZZ_BUILD = Path(os.environ.get("FASTOPT_FUZZ_BUILD", ROOT / "build" / "fuzz-san"))
REGRESSIONS = sorted(
    p
    for p in (FUZZ_DIR / "regressions").glob("*")
    if p.is_file() and not p.name.startswith(".") and p.suffix != ".md"
)


def libfuzzer_binary(name: str) -> Path:
    """A sanitizer fuzzer built by tests/fuzz/build.sh; skips where clang or the build is
    absent (.ci/run builds them where clang is installed)."""
    path = FUZZ_BUILD / name
    if not path.is_file():
        if shutil.which("clang++") is None:
            pytest.skip("clang is absent: no sanitizer fuzzers (apt-get install clang)")
        pytest.skip(f"{path} is not built: run tests/fuzz/build.sh")
    return path


def run_fuzzer(runs: int, seed: int, timeout: float, extra: tuple[str, ...] = ()) -> str:
    if "--libfuzzer" not in extra:
        pytest.importorskip("atheris")
    proc = subprocess.run(
        [
            sys.executable,
            str(FUZZ_DIR / "run_fuzz.py"),
            "--runs",
            str(runs),
            "--seed",
            str(seed),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"^executions: (\d+)$", proc.stdout, re.MULTILINE)
    timed = "--max-time" in extra
    assert m and (int(m.group(1)) >= runs or (timed and int(m.group(1)) > 0)), out[-3000:]
    assert re.search(r"^findings: 0$", proc.stdout, re.MULTILINE), out[-3000:]
    return out


def test_fuzz_reader_short() -> None:
    """20k executions around the seed corpus: a few seconds."""
    run_fuzzer(20_000, seed=1, timeout=300)


def test_fuzz_reader_short_with_roundtrip() -> None:
    """Models that load and verify are also saved and loaded back."""
    run_fuzzer(5_000, seed=2, timeout=300, extra=("--roundtrip",))


@pytest.mark.slow
def test_fuzz_reader_long() -> None:
    run_fuzzer(2_000_000, seed=3, timeout=3600)


def test_libfuzzer_reader_short() -> None:
    """About 10 s of the coverage-guided reader/writer fuzzer (ASan + UBSan) from the seeds."""
    binary = libfuzzer_binary("fuzz_reader")
    run_fuzzer(10**9, seed=1, timeout=300, extra=("--libfuzzer", str(binary), "--max-time", "10"))


def test_libfuzzer_pipeline_short() -> None:
    """About 10 s of the pass-pipeline fuzzer (read, every default pass, save, read back)."""
    binary = libfuzzer_binary("fuzz_pipeline")
    extra = ("--libfuzzer", str(binary), "--max-time", "10", "--max-len", "65536")
    run_fuzzer(10**9, seed=1, timeout=300, extra=extra)


@pytest.mark.slow
def test_libfuzzer_long() -> None:
    for name, max_len in (("fuzz_reader", 8192), ("fuzz_pipeline", 65536)):
        extra = ("--libfuzzer", str(libfuzzer_binary(name)), "--max-len", str(max_len))
        run_fuzzer(200_000, seed=4, timeout=3600, extra=extra)


def test_pipeline_fuzzer_runs_the_default_preset() -> None:
    """fuzz_pipeline.cc's pass list is PRESETS["default"]'s C++ passes, in order."""
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        from pipeline import default_passes
    finally:
        sys.path.remove(str(FUZZ_DIR))
    src = (FUZZ_DIR / "fuzz_pipeline.cc").read_text()
    listed = re.search(r"kDefaultPasses\[\] = \{(.*?)\};", src, re.DOTALL)
    assert listed
    names = re.findall(r'"(\w+)"', listed.group(1))
    at = names.index("fuse_attention") + 1
    assert [*names[:at], "add_kv_cache", *names[at:]] == default_passes()


def _data_dir(tmp_path: Path) -> Path:
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        from make_seeds import write_data_files
    finally:
        sys.path.remove(str(FUZZ_DIR))
    write_data_files(tmp_path)
    return tmp_path


def _replay(data: bytes, base_dir: Path) -> str:
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        from pipeline import replay
    finally:
        sys.path.remove(str(FUZZ_DIR))
    return replay(data, base_dir)


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_fuzz_regression(path: Path, tmp_path: Path) -> None:
    """Inputs that once made a fuzzer fail (minimized): a reader regression (reader-* and the
    first ones) is now a clean ModelError; a pipeline regression (pipeline-*) goes through
    every pass, or is refused with a ModelError, and its result saves and reads back."""
    base = _data_dir(tmp_path)
    data = path.read_bytes()
    if path.name.startswith("pipeline-"):
        _replay(data, base)
        return
    try:
        model = fastopt.load_bytes(data, base_dir=str(base))
    except fastopt.ModelError:
        return
    assert not path.name.startswith("zero-dim"), "the first regression must stay refused"
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        from exercise import exercise
    finally:
        sys.path.remove(str(FUZZ_DIR))
    exercise(model, str(tmp_path))  # fully usable; saved and loaded back when it verifies


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_fuzz_regression_under_sanitizers(path: Path) -> None:
    """The same inputs through the sanitizer binary of the fuzzer that found them."""
    binary = libfuzzer_binary(
        "fuzz_pipeline" if path.name.startswith("pipeline-") else "fuzz_reader"
    )
    proc = subprocess.run(
        [str(binary), "-runs=1", str(path)],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def test_pipeline_replay_optimizes_the_export_seeds(tmp_path: Path) -> None:
    """The replay is a real pipeline: the committed export seeds get fused, not refused."""
    base = _data_dir(tmp_path)
    outcomes = {
        p.name: _replay(p.read_bytes(), base)
        for p in sorted((FUZZ_DIR / "corpus").glob("export_*.onnx"))
    }
    assert outcomes["export_llama_dynamo_float32.onnx"] == "optimized", outcomes
    # an encoder has no causal attention to cache (the variant of its size asks for one)
    assert outcomes["export_bert_dynamo_float32.onnx"] in ("optimized", "refused by add_kv_cache")
