"""Bounded fuzzing of the reader (tests/fuzz/), plus the saved regression inputs.

The short run is part of every test run; the long one is opt-in (pytest -m slow). Each runs the
atheris harness in a child process through tests/fuzz/run_fuzz.py, so that a crash fails the
test instead of killing pytest.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import fastopt
import pytest

FUZZ_DIR = Path(__file__).resolve().parent / "fuzz"
REGRESSIONS = sorted(
    p
    for p in (FUZZ_DIR / "regressions").glob("*")
    if p.is_file() and not p.name.startswith(".") and p.suffix != ".md"
)


def run_fuzzer(runs: int, seed: int, timeout: float, extra: tuple[str, ...] = ()) -> str:
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
    assert m and int(m.group(1)) >= runs, out[-3000:]
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


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_fuzz_regression(path: Path, tmp_path: Path) -> None:
    """Inputs that once crashed a fuzzer (minimized): now a clean ModelError."""
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        from make_seeds import WEIGHTS_NAME, weights_bin
    finally:
        sys.path.remove(str(FUZZ_DIR))
    (tmp_path / WEIGHTS_NAME).write_bytes(weights_bin())
    with pytest.raises(fastopt.ModelError):
        fastopt.load_bytes(path.read_bytes(), base_dir=str(tmp_path))
