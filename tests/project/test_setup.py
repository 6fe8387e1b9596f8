"""The set-up a new user meets (issue 28): the README's two commands, what CI runs, the test
requirements, and the oldest onnxruntime fastopt accepts."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

import fastopt.runtime.version as ort_version
import pytest
import tomllib
from support.paths import ROOT

FIRST_HOUR = ROOT / "scripts" / "first_hour.sh"


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def readme_commands() -> list[str]:
    """The README's Set-up commands, as scripts/first_hour.sh reads them."""
    out = subprocess.run(
        ["bash", str(FIRST_HOUR), "--print-commands"], capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def requirement_lines(text: str) -> list[str]:
    lines = (line.split(" #")[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_the_readme_has_two_commands_and_the_second_builds_nothing() -> None:
    install, tests = readme_commands()
    assert install.startswith("pip install -v . && ")  # -v: the build's progress shows
    assert "--verify" in install and "fastopt bench" in install
    # the test command installs requirements, never the package (which would build it again)
    assert tests == "pip install -r requirements-test.txt && python -m pytest"
    assert not re.search(r"pip install (-\S+ )*['\"]?\.", tests)


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    _, tests = readme_commands()
    assert tests in ci  # what a user runs, as a line of its own
    assert "pip install ." in ci[: ci.index(tests)]  # fastopt is built once, before it
    assert not any('".[test]"' in line for line in ci if not line.startswith("#"))


def test_requirements_file_and_test_extra_agree() -> None:
    listed = requirement_lines((ROOT / "requirements-test.txt").read_text())
    extra = [r.strip() for r in pyproject()["project"]["optional-dependencies"]["test"]]
    assert listed == extra
    assert not any(r.startswith(("fastopt", ".", "-e")) for r in listed)


def test_the_declared_onnxruntime_floor_is_the_checked_one() -> None:
    deps = pyproject()["project"]["dependencies"]
    declared = next(d for d in deps if d.startswith("onnxruntime"))
    floor = ".".join(map(str, ort_version.ORT_FLOOR))
    assert declared == f"onnxruntime>={floor}"
    assert ort_version._release(metadata.version("onnxruntime")) >= ort_version.ORT_FLOOR


@pytest.mark.parametrize(
    "text,release",
    [
        ("1.17.3", (1, 17, 3)),
        ("1.20.0.dev20240101", (1, 20, 0)),
        ("1.19.2+cu118", (1, 19, 2)),
        ("1.22.0rc1", (1, 22, 0)),
        ("2.0", (2, 0)),
    ],
)
def test_release_numbers(text: str, release: tuple[int, ...]) -> None:
    assert ort_version._release(text) == release


def test_an_older_onnxruntime_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.version

    def version(name: str) -> str:
        return "1.17.3" if name == "onnxruntime" else real(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ort_version.OnnxRuntimeTooOldError) as caught:
        ort_version.require_floor()
    message = str(caught.value)
    floor = ".".join(map(str, ort_version.ORT_FLOOR))
    assert f"needs onnxruntime >= {floor}" in message and "onnxruntime 1.17.3" in message
    assert "pip install -U" in message and "\n" not in message
    assert isinstance(caught.value, ImportError)


def test_the_floor_itself_and_newer_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    floor = ".".join(map(str, ort_version.ORT_FLOOR))
    for v in (floor, "9.0.0"):
        monkeypatch.setattr(metadata, "version", lambda name, v=v: v)
        ort_version.require_floor()


def test_gpu_build_is_found_by_its_distribution_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def version(name: str) -> str:
        if name == "onnxruntime-gpu":
            return "1.16.0"
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ort_version.OnnxRuntimeTooOldError, match=r"onnxruntime-gpu 1\.16\.0"):
        ort_version.require_floor()


def test_import_fastopt_refuses_an_older_onnxruntime() -> None:
    """`import fastopt` itself, in a fresh interpreter that sees onnxruntime 1.17.3."""
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda n: '1.17.3' if n == 'onnxruntime' else real(n)\n"
        "import fastopt\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "fastopt.runtime.version.OnnxRuntimeTooOldError: fastopt needs onnxruntime"
    )


@pytest.mark.parametrize("argv0", ["/venv/bin/fastopt", "/x/fastopt/__main__.py"])
def test_the_fastopt_command_refuses_an_older_onnxruntime_in_one_line(argv0: str) -> None:
    """The console script imports the package before the CLI's error handling: one line, exit 2."""
    code = (
        "import importlib.metadata as m, sys\n"
        "real = m.version\n"
        "m.version = lambda n: '1.17.3' if n == 'onnxruntime' else real(n)\n"
        f"sys.argv = [{argv0!r}, '--version']\n"
        "from fastopt.cli.main import main\n"
        "sys.exit(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: fastopt needs onnxruntime >= 1.32.0"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr
