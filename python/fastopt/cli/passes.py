"""``fastopt passes``: the registered passes, presets and options."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.table import Table

import fastopt
from fastopt.cli.output import console, print_table
from fastopt.pipeline.options import OPTIONS
from fastopt.pipeline.registry import PRESET_DESCRIPTIONS


def _cmd_passes(args: argparse.Namespace) -> int:
    out = console()
    table = Table(show_edge=False)
    for col in ("pass", "lang", "opsets", "idempotent", "tags", "description"):
        table.add_column(col)
    for p in fastopt.all_passes():
        opsets = f"{p.min_opset}+" if p.max_opset is None else f"{p.min_opset}-{p.max_opset}"
        rules = [r for r in p.rule_names if r != p.name]  # --explain takes these too
        table.add_row(
            escape(p.name),
            p.language,
            opsets,
            "yes" if p.idempotent else "no",
            ",".join(p.tags),
            escape(p.description + (f" (rules: {', '.join(rules)})" if rules else "")),
        )
    print_table(out, table)
    out.print()
    presets = Table(title="presets", show_edge=False)
    presets.add_column("preset")
    presets.add_column("passes")
    for name, names in fastopt.PRESETS.items():
        what = PRESET_DESCRIPTIONS.get(name, "")
        presets.add_row(
            escape(name), escape(f"{what}: {', '.join(names)}" if what else ", ".join(names))
        )
    print_table(out, presets)
    out.print()
    options = Table(title="options (--option KEY=VALUE)", show_edge=False)
    for col in ("option", "passes", "default", "values, meaning"):
        options.add_column(col)
    for spec in OPTIONS.values():
        if spec.internal:
            continue
        default = "-" if spec.default is None else str(spec.default)
        options.add_row(
            escape(spec.name),
            escape(",".join(spec.passes)),
            default,
            escape(f"{spec.values_text()}: {spec.help}"),
        )
    print_table(out, options)
    return 0


def add_parser(sub: Any) -> None:
    lp = sub.add_parser("passes", help="list the registered passes and presets")
    lp.set_defaults(func=_cmd_passes)
