"""How the CLI prints: rich tables on a terminal, plain text in pipes and CI logs.

On a terminal, tables are rich's, with no cell ever truncated: every column but the last keeps
its widest cell whole (``min_width``), and the last one wraps; a table still wider than the
terminal prints as in a pipe. Anywhere else (a pipe, a file, a CI
log) the same tables print as plain text: columns padded with spaces, no box characters, no
colour codes, and the last column wrapped to the width (``COLUMNS``, default 100) with
continuation lines indented under it.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

PLAIN_WIDTH = 100  # when neither a terminal nor COLUMNS says
_MIN_LAST = 24  # the narrowest a wrapped last column gets


def console(*, stderr: bool = False) -> Console:
    """A console for output: rich's defaults on a terminal; in a pipe no colour, no markup
    codes, and the width of ``COLUMNS`` (else 100)."""
    c = Console(stderr=stderr)
    if c.is_terminal:
        return c
    return Console(stderr=stderr, width=width(), no_color=True, highlight=False, soft_wrap=True)


def width() -> int:
    return shutil.get_terminal_size((PLAIN_WIDTH, 24)).columns


def _plain(cell: object) -> str:
    if isinstance(cell, Text):
        return cell.plain
    return Text.from_markup(str(cell)).plain


def plain_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int,
    right: Sequence[bool] = (),
) -> str:
    """Columns padded to their widest cell (right-aligned where `right` says), the last column
    wrapped to what `width` leaves (at least 24 characters)."""
    if not header:
        return ""
    all_rows = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(header) - 1)]
    indent = sum(widths) + 2 * len(widths)
    longest_last = max(len(r[-1]) for r in all_rows)
    if indent + _MIN_LAST > width and longest_last > _MIN_LAST and len(header) > 1:
        # Too narrow for the columns and a wrapped text column: one record per row instead.
        # (Tables of short cells, such as numbers, keep their columns and run past the width.)
        return _stacked(all_rows, width)
    room = max(_MIN_LAST, width - indent)
    lines = []
    for r in all_rows:
        cells = [
            c.rjust(w) if i < len(right) and right[i] else c.ljust(w)
            for i, (c, w) in enumerate(zip(r[:-1], widths))
        ]
        last = textwrap.wrap(r[-1], room, break_on_hyphens=False) or [""]
        lines.append(("  ".join([*cells, last[0]])).rstrip())
        lines.extend(" " * indent + more for more in last[1:])
    return "\n".join(lines)


def _stacked(rows: Sequence[Sequence[str]], width: int) -> str:
    """Too narrow for columns: each row's leading cells on one line, its last cell wrapped
    below, indented."""
    lines = []
    for r in rows:
        lines.append("  ".join(c for c in r[:-1] if c).rstrip())
        lines.extend("    " + part for part in textwrap.wrap(r[-1], max(_MIN_LAST, width - 4)))
    return "\n".join(lines)


def print_table(out: Console, table: Table) -> None:
    """Prints `table` on `out`: as is on a terminal (no cell truncated), as plain text
    elsewhere."""
    columns = table.columns
    if out.is_terminal:
        for col in columns[:-1]:
            texts = [_plain(c) for c in col.cells]
            col.min_width = max([len(_plain(col.header)), *map(len, texts)])
            col.no_wrap = True
        if columns:
            columns[-1].overflow = "fold"
        if Measurement.get(out, out.options.update_width(1 << 20), table).minimum <= out.width:
            out.print(table)
            return
        # Wider than the terminal even with the last column wrapped: rich would crop the
        # lines; the plain layout below keeps every cell whole.
    header = [_plain(c.header) for c in columns]
    cells = [[_plain(c) for c in col.cells] for col in columns]
    rows: list[list[str]] = [list(r) for r in zip(*cells)]
    right = [c.justify == "right" for c in columns]
    if table.title:
        out.print(_plain(table.title), markup=False, highlight=False)
    out.print(
        plain_table(header, rows, width=out.width, right=right), markup=False, highlight=False
    )
