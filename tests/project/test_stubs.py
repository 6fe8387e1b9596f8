"""The checked-in type stubs of the extension must match what pybind11-stubgen generates."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

STUB = ROOT / "python" / "fastopt" / "_C.pyi"


def test_stubs_are_current(tmp_path: Path) -> None:
    if shutil.which("pybind11-stubgen") is None:
        pytest.skip("pybind11-stubgen is not installed")
    subprocess.run(
        [sys.executable, "-m", "pybind11_stubgen", "fastopt._C", "-o", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = (tmp_path / "fastopt" / "_C.pyi").read_text()
    assert generated == STUB.read_text(), (
        "python/fastopt/_C.pyi is stale: run `pybind11-stubgen fastopt._C -o python`"
    )
