"""The layering of csrc/: each folder may include only the folders below it (LAYERS), and no two
folders may include each other, directly or through others. Run by .ci/run and
tests/test_layering.py; ARCHITECTURE.md explains the layers.

    python tools/check_layering.py [csrc]     # exit 1 with one line per violation
"""

from __future__ import annotations

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


def main(argv: list[str]) -> int:
    csrc = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "csrc"
    problems = check(csrc)
    for line in problems:
        print(line)
    if not problems:
        print(f"layering: ok ({len(LAYERS)} folders)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
