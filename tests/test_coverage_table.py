"""The coverage-regression guard (issue 27): what the `llm` preset fuses and leaves for each
target, and whether the KV-cache rewrite is accepted (or why not), on every LLM fixture and
the version matrix, must equal the committed tests/fixtures/coverage.json. A change that loses
a fusion or a cache fails here with the diff; after an intended improvement, regenerate the
table (`python tests/coverage_table.py --write`) and commit it."""

from __future__ import annotations

import json

import coverage_table as ct


def test_coverage_table_unchanged() -> None:
    expected = json.loads(ct.TABLE.read_text())
    lines = ct.diff(expected, ct.compute())
    assert not lines, (
        "coverage changed (expected -> now); if intended, run "
        "`python tests/coverage_table.py --write` and commit the table:\n" + "\n".join(lines)
    )


def test_diff_names_a_lost_fusion() -> None:
    """The guard can fail: a row that lost a fused op and gained residue is reported."""
    row = {"ort": {"fused": {"GroupQueryAttention": 2}, "residue": {}}, "kv_inplace": "ok"}
    lost = {
        "ort": {"fused": {"GroupQueryAttention": 1}, "residue": {"Softmax": 1}},
        "kv_inplace": "refused: why",
    }
    lines = ct.diff({"m": row}, {"m": lost})
    assert lines == [
        'm.kv_inplace: "ok" -> "refused: why"',
        'm.ort: {"fused": {"GroupQueryAttention": 2}, "residue": {}} -> '
        '{"fused": {"GroupQueryAttention": 1}, "residue": {"Softmax": 1}}',
    ]
