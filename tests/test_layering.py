"""csrc/'s layering (tools/check_layering.py, ARCHITECTURE.md): no folder includes one above it,
no two folders include each other. The check runs on the tree, and on small trees made here to
show it fails on each kind of violation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
