"""The public API stays where users import it from while the package's rooms move (issue 26): every
name of ``fastopt.__all__`` (the list below is the contract, as main exported it before the move),
the documented names of ``fastopt.verify``, ``fastopt.bench`` and ``fastopt.errors``, the console
script's entry point and ``python -m fastopt``."""

from __future__ import annotations

import importlib
import subprocess
import sys

import fastopt
import pytest
from support.paths import ROOT

PUBLIC = [
    "OPTIONS",
    "PRESETS",
    "PRESET_DESCRIPTIONS",
    "CheckError",
    "CheckReport",
    "ExportError",
    "ExportReport",
    "Function",
    "Graph",
    "InputRejectedError",
    "Match",
    "Model",
    "ModelError",
    "Node",
    "OptimizeReport",
    "OptionError",
    "OptionSpec",
    "OutputRejectedError",
    "PassContext",
    "PassReport",
    "PassSpec",
    "Pattern",
    "PatternNode",
    "QuantSettings",
    "QuantVerifyReport",
    "QuantizeReport",
    "RejectedModelError",
    "Rewriter",
    "Rule",
    "Tensor",
    "UnknownNameError",
    "UnsupportedModelError",
    "Value",
    "VerifyError",
    "VerifyReport",
    "WeightQuantization",
    "__version__",
    "all_passes",
    "apply_rules",
    "check",
    "compare_providers",
    "export",
    "from_onnx",
    "get_pass",
    "infer_shapes",
    "load",
    "load_bytes",
    "make_inputs",
    "optimize",
    "quantize",
    "register_option",
    "register_pass",
    "register_rules",
    "unregister_option",
    "unregister_pass",
    "verify",
    "verify_checksums",
]

SUBMODULE_API = {
    "fastopt.verify": [
        "BATCH",
        "PAST",
        "SEQUENCE",
        "UNKNOWN_DIM",
        "InputRejectedError",
        "OutputComparison",
        "OutputRejectedError",
        "ProviderComparison",
        "ProviderRun",
        "Tolerance",
        "VerifyError",
        "VerifyReport",
        "compare_providers",
        "make_inputs",
        "verify",
    ],
    "fastopt.bench": ["BenchResult", "Runner", "Stats", "compare", "run", "sweep"],
    "fastopt.errors": ["OptionError", "RejectedModelError", "UnknownNameError"],
}


def test_all_is_the_public_api() -> None:
    assert sorted(fastopt.__all__) == sorted(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_imports(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from fastopt import {name}", namespace)
    assert namespace[name] is getattr(fastopt, name)


def test_the_entry_functions_are_functions() -> None:
    # fastopt.check / quantize / verify share names with modules of main's flat layout: the
    # package attribute must stay the function.
    for name in ("check", "quantize", "verify", "optimize", "infer_shapes", "compare_providers"):
        assert callable(getattr(fastopt, name)), name


@pytest.mark.parametrize("module", sorted(SUBMODULE_API))
def test_documented_submodule_names_import(module: str) -> None:
    mod = importlib.import_module(module)
    for name in SUBMODULE_API[module]:
        assert hasattr(mod, name), f"{module}.{name}"
    if module == "fastopt.verify":
        assert mod.verify is fastopt.verify and mod.make_inputs is fastopt.make_inputs


def test_the_console_script_entry_point_resolves() -> None:
    # pyproject.toml's [project.scripts]: what `pip install` writes into bin/fastopt.
    text = (ROOT / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith('fastopt = "fastopt.'))
    target = line.split("=", 1)[1].strip().strip('"')
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), target


def test_python_dash_m_runs_the_cli() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "fastopt", "--version"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("fastopt ")
