"""The layering of csrc/ and of the Python package. csrc/: each folder may include only the folders
below it (LAYERS), and no two folders may include each other, directly or through others.
python/fastopt/: each module may import only modules of its own room or of rooms below it
(ROOMS, lowest first; imports inside functions count too), and no two modules may import each
other at module level, directly or through others. Run by .ci/run and
tests/project/test_layering.py;
ARCHITECTURE.md explains the layers and the rooms.

    python tools/check_layering.py [csrc [python/fastopt]]   # exit 1 with one line per violation
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

# folder (relative to csrc/) -> the folders its files may include directly, besides itself. What a
# folder may reach is the closure: kv_cache may include ir because attention may.
LAYERS: dict[str, tuple[str, ...]] = {
    "ir": (),
    "proto": ("ir",),
    "schema": ("ir",),
    "eval": ("ir", "schema"),
    "analysis": ("eval", "schema", "ir"),
    "pattern": ("analysis",),
    "quant": ("proto",),
    "passes": ("pattern", "quant"),
    "passes/cleanup": ("passes",),
    "passes/fold": ("passes/cleanup",),
    "passes/fusion": ("passes",),
    "passes/rotary": ("passes/fusion",),
    "passes/attention": ("passes",),
    "passes/attention/fuse": ("passes/attention", "passes/fusion"),
    "passes/kv_cache": ("passes/attention", "passes/fold"),
    # lowering runs after caching and asks the cache's proofs which pad rows nothing reads
    "passes/attention/lower": ("passes/attention", "passes/kv_cache"),
    "passes/quant": ("passes",),
}
LAYERS["bindings"] = tuple(LAYERS)  # the Python module sees everything; nothing includes it

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
SOURCES = (".cc", ".h", ".inc")


def folder_of(path: str) -> str:
    """The deepest folder of LAYERS holding `path` (relative to csrc/), or its own folder."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    while parent and parent not in LAYERS:
        parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
    return parent or (path.rsplit("/", 1)[0] if "/" in path else "")


def reach(folder: str, seen: set[str] | None = None) -> set[str]:
    """The folders `folder` may include: LAYERS' closure."""
    seen = set() if seen is None else seen
    for dep in LAYERS.get(folder, ()):
        if dep not in seen:
            seen.add(dep)
            reach(dep, seen)
    return seen


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of folders that reach each other (Tarjan's strongly connected components of
    more than one folder), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def check(csrc: Path) -> list[str]:
    """The violations in the tree under `csrc`, one line each."""
    problems: list[str] = []
    for group in cycles({k: set(v) for k, v in LAYERS.items()}):
        problems.append("LAYERS itself has a cycle between " + ", ".join(group))
    files = sorted(p for p in csrc.rglob("*") if p.is_file() and p.suffix in SOURCES)
    known = {p.relative_to(csrc).as_posix() for p in files}
    edges: dict[str, set[str]] = {}
    for p in files:
        rel = p.relative_to(csrc).as_posix()
        src = folder_of(rel)
        if src not in LAYERS:
            problems.append(
                f"{rel}: folder '{src or '.'}' is not in LAYERS (tools/check_layering.py)"
            )
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        for m in INCLUDE.finditer(text):
            target = m.group(1)
            if target not in known:
                continue  # a file next to the includer ("x.inc") or outside csrc
            dst = folder_of(target)
            if dst == src:
                continue
            edges.setdefault(src, set()).add(dst)
            if dst not in reach(src):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: {src} may not include {target} ({dst})")
    for group in cycles(edges):
        problems.append("folders include each other: " + ", ".join(group))
    return problems


# The Python package's rooms, lowest first: (room, the module prefixes it holds). A module belongs
# to the room of its longest matching prefix, so an entry point inside a room (quantize(), the
# Whisper layout: both run optimize()) can sit above the facade its room's helpers sit below.
ROOMS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "fastopt._C",
            "fastopt.errors",
            "fastopt._io",
            "fastopt._lazy",
            "fastopt._numpy",
            "fastopt._signatures",
            "fastopt.forked",
        ),
    ),
    ("runtime", ("fastopt.runtime",)),  # ORT facts: ops, kernels, version, providers
    ("pipeline", ("fastopt.pipeline",)),  # registry, options, shapes, manager, KV-cache policy
    ("passes", ("fastopt.passes",)),  # Python passes (register into the pipeline)
    ("genai", ("fastopt.genai",)),  # genai_config.json, cache geometry, the folder beside output
    ("verify", ("fastopt.verify",)),  # runs models in ORT: verify(), check(), generation
    ("quant", ("fastopt.quant",)),  # settings, checks, ranges (they run models: above verify), step
    ("optimize", ("fastopt.optimize",)),  # the facade: checks arguments, calls the rooms in order
    ("entries", ("fastopt.quant.quantize", "fastopt.genai.whisper")),  # run optimize()
    ("export", ("fastopt.export",)),  # HF checkpoint -> torch.onnx -> optimize() -> a folder
    ("bench", ("fastopt.bench",)),  # the harness: runs models, no CLI
    ("api", ("fastopt",)),  # the public API: __init__ re-exports the rooms' public names
    ("cli", ("fastopt.cli", "fastopt.__main__")),  # one module per command, over the public API
]


def room_of(module: str) -> tuple[int, str] | None:
    """(level, room) of the longest ROOMS prefix of `module`, or None. The prefix "fastopt" is
    the package's __init__ alone: a new module must be given a room."""
    best: tuple[int, int, str] | None = None
    for level, (room, prefixes) in enumerate(ROOMS):
        for prefix in prefixes:
            inside = prefix != "fastopt" and module.startswith(prefix + ".")
            if (module == prefix or inside) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level, room)
    return None if best is None else (best[1], best[2])


def python_modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package`."""
    mods: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def python_imports(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(module imported, line, at module level) for each import of the package in `path`.
    `from a import b` names the submodule a.b when there is one, else a."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    top = {id(n) for n in tree.body}
    for stmt in tree.body:  # if and try blocks at module level run at import, but TYPE_CHECKING's
        checking = isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "TYPE_CHECKING"
        if isinstance(stmt, (ast.If, ast.Try)) and not checking:
            top.update(id(n) for n in ast.walk(stmt))
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                name = sub if sub in known or sub == "fastopt._C" else node.module
                found.append((name, node.lineno, id(node) in top))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, id(node) in top) for alias in node.names)
    return [f for f in found if f[0] == "fastopt" or f[0].startswith("fastopt.")]


def check_python(package: Path) -> list[str]:
    """The violations of ROOMS in the Python package at `package`, one line each."""
    problems: list[str] = []
    mods = python_modules(package)
    edges: dict[str, set[str]] = {}
    for module, path in mods.items():
        rel = path.relative_to(package.parent).as_posix()
        src = room_of(module)
        if src is None:
            problems.append(
                f"{rel}: module {module} is in no room of ROOMS (tools/check_layering.py)"
            )
            continue
        for target, line, at_top in python_imports(path, set(mods)):
            dst = room_of(target)
            if dst is not None and dst[0] > src[0]:
                problems.append(
                    f"{rel}:{line}: {module} ({src[1]}) may not import {target} ({dst[1]})"
                )
            if at_top and target in mods and target != module:
                edges.setdefault(module, set()).add(target)
    for group in cycles(edges):
        problems.append("modules import each other: " + ", ".join(group))
    return problems


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    csrc = Path(argv[1]) if len(argv) > 1 else root / "csrc"
    package = Path(argv[2]) if len(argv) > 2 else root / "python" / "fastopt"
    problems = check(csrc) + check_python(package)
    for line in problems:
        print(line)
    if not problems:
        print(f"layering: ok ({len(LAYERS)} folders, {len(ROOMS)} Python rooms)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
