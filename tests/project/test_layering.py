"""The layering (tools/check_layering.py, ARCHITECTURE.md): in csrc/ no folder includes one above
it and no two folders include each other; in python/fastopt/ no module imports a higher room and
no two modules import each other. The check runs on the tree, and on small trees made here to
show it fails on each kind of violation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from support.paths import ROOT

SCRIPT = ROOT / "tools" / "check_layering.py"


def load_checker():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_layering", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_tree_is_layered() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "layering: ok" in run.stdout


def test_every_csrc_folder_is_in_the_table() -> None:
    checker = load_checker()
    folders = {
        p.parent.relative_to(ROOT / "csrc").as_posix()
        for p in (ROOT / "csrc").rglob("*")
        if p.suffix in (".cc", ".h")
    }
    assert folders <= set(checker.LAYERS), folders - set(checker.LAYERS)


def test_an_upward_include_fails(tmp_path: Path) -> None:
    # main's fuse_rotary.cc read the rotary cache from the attention folder (issue 26).
    csrc = write(
        tmp_path,
        {
            "ir/graph.h": "#pragma once\n",
            "passes/registry.h": '#include "ir/graph.h"\n',
            "passes/attention/internal_op.h": '#include "passes/registry.h"\n',
            "passes/rotary/fuse_rotary.cc": '#include "passes/attention/internal_op.h"\n',
        },
    )
    problems = load_checker().check(csrc)
    assert problems == [
        "passes/rotary/fuse_rotary.cc:1: passes/rotary may not include "
        "passes/attention/internal_op.h (passes/attention)"
    ]


def test_a_cycle_between_folders_fails(tmp_path: Path) -> None:
    # main's ir/tensor.cc read proto/wire.h, which reads ir/buffer.h.
    csrc = write(
        tmp_path,
        {
            "ir/buffer.h": "#pragma once\n",
            "ir/tensor.cc": '#include "proto/wire.h"\n',
            "proto/wire.h": '#pragma once\n#include "ir/buffer.h"\n',
        },
    )
    problems = load_checker().check(csrc)
    assert "folders include each other: ir, proto" in problems
    assert "ir/tensor.cc:1: ir may not include proto/wire.h (proto)" in problems


def test_a_folder_missing_from_the_table_fails(tmp_path: Path) -> None:
    csrc = write(tmp_path, {"ir/graph.h": "", "newroom/x.cc": '#include "ir/graph.h"\n'})
    problems = load_checker().check(csrc)
    assert len(problems) == 1 and "folder 'newroom' is not in LAYERS" in problems[0]


def test_main_before_the_moves_fails() -> None:
    """The includes issue 26 named, as they were: each is a violation."""
    checker = load_checker()
    assert "passes/attention" not in checker.reach("passes/rotary")
    assert "passes" not in checker.reach("quant")
    assert "pattern" not in checker.reach("analysis")
    assert "proto" not in checker.reach("ir")


def write_package(root: Path, files: dict[str, str]) -> Path:
    """A package named fastopt under `root` with these modules (relative paths, text)."""
    package = root / "fastopt"
    write(package, {"__init__.py": "", **files})
    return package


def test_the_python_package_is_layered() -> None:
    assert load_checker().check_python(ROOT / "python" / "fastopt") == []


def test_every_python_module_has_a_room() -> None:
    checker = load_checker()
    for module in checker.python_modules(ROOT / "python" / "fastopt"):
        assert checker.room_of(module) is not None, module


def test_an_upward_python_import_fails(tmp_path: Path) -> None:
    # main's verify_generation imported the bench harness's cache geometry (issue 26): verify
    # sits below bench. An import inside a function counts too.
    package = write_package(
        tmp_path,
        {
            "bench/__init__.py": "",
            "bench/cache_dims.py": "X = 1\n",
            "verify/__init__.py": "",
            "verify/generation.py": "def f():\n    from fastopt.bench.cache_dims import X\n",
        },
    )
    problems = load_checker().check_python(package)
    assert problems == [
        "fastopt/verify/generation.py:2: fastopt.verify.generation (verify) may not import "
        "fastopt.bench.cache_dims (bench)"
    ]


def test_a_python_import_cycle_fails(tmp_path: Path) -> None:
    # main's cli_optimize and cli_quantize imported each other (issue 26); one room, so only the
    # cycle check sees it.
    package = write_package(
        tmp_path,
        {
            "cli/__init__.py": "",
            "cli/optimize.py": "from fastopt.cli.quantize import add_quant_flags\n",
            "cli/quantize.py": "from fastopt.cli import optimize\n",
        },
    )
    problems = load_checker().check_python(package)
    assert problems == ["modules import each other: fastopt.cli.optimize, fastopt.cli.quantize"]


def test_a_python_module_without_a_room_fails(tmp_path: Path) -> None:
    package = write_package(tmp_path, {"newroom/__init__.py": "", "newroom/x.py": ""})
    problems = load_checker().check_python(package)
    assert len(problems) == 2 and all("is in no room of ROOMS" in p for p in problems)


def test_imports_for_type_checking_only_make_no_cycle(tmp_path: Path) -> None:
    package = write_package(
        tmp_path,
        {
            "pipeline/__init__.py": "",
            "pipeline/a.py": "from fastopt.pipeline.b import B\n",
            "pipeline/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from fastopt.pipeline.a import A\nB = 1\n"
            ),
        },
    )
    assert load_checker().check_python(package) == []
