"""The version matrix (issue 27; tests/fixtures/matrix, made by make_matrix.py): the main families
exported by several transformers releases, both exporters, without and with a KV cache. The
fixture tests run over it (test_llm_preset, test_kv_generation, test_cached_presets,
test_fixtures: matrix_params); here, that the matrix is what its tables say, and that the
exports made WITH a cache convert to the standard and in-place cache forms."""

from __future__ import annotations

import json
from pathlib import Path

import fastopt
import pytest
from support import kv_generation as kg
from support.cached_exports import original
from support.llm_fixtures import (
    MATRIX_DIR,
    MATRIX_XFAIL,
    Fixture,
    matrix_fixtures,
    matrix_params,
    matrix_releases,
)
from support.paths import ROOT
from support.seq2seq_generation import matrix_seq2seq_fixtures

README = ROOT / "README.md"
STEPS = 32


def test_matrix_tables_say_what_is_there() -> None:
    """At least four releases; each release's exports.json lists every export it tried: the
    "ok" ones are the folders (meta.json records that release), the others say why."""
    releases = matrix_releases()
    assert len(releases) >= 4, releases
    for release in releases:
        table = json.loads((MATRIX_DIR / release / "exports.json").read_text())
        folders = {p.name for p in (MATRIX_DIR / release).iterdir() if p.is_dir()}
        assert folders == {name for name, state in table.items() if state == "ok"}, release
        assert all(s == "ok" or s.startswith(("failed: ", "absent: ")) for s in table.values())
        for name in folders:
            meta = json.loads((MATRIX_DIR / release / name / "meta.json").read_text())
            assert meta["versions"]["transformers"] == release, (release, name)
            limit = 2e-2 if meta["dtype"] == "float16" else 1e-4  # make_matrix.py's MAX_ABS*
            assert meta["ort_vs_torch_max_abs"] < limit, (release, name)
    tested = README.read_text().split("version matrix", 1)[1][:400]  # "How this is tested"
    assert all(release in tested for release in releases), tested


def test_matrix_expected_failures_name_real_tests() -> None:
    """Every expected failure names a matrix fixture that exists (a stale entry would hide
    nothing, but would mislead)."""
    names = {fx.name for fx in matrix_fixtures(cache_export=None)}
    names |= {fx.name for fx in matrix_seq2seq_fixtures()}
    expected = json.loads(MATRIX_XFAIL.read_text())
    for check, entries in expected.items():
        for test_id in entries:
            assert test_id.split("-")[0] in names, (check, test_id)


def test_matrix_is_small() -> None:
    """The committed matrix stays a few MB (weights are not stored: make_matrix.py)."""
    total = sum(p.stat().st_size for p in MATRIX_DIR.rglob("*") if p.is_file())
    assert total < 8e6, total


CACHED = matrix_fixtures(cache_export=True)


@pytest.mark.parametrize(
    ("fx", "mode"), matrix_params("cached_kv", CACHED, [("standard",), ("inplace",)])
)
def test_matrix_cached_export_converts(fx: Fixture, mode: str, tmp_path: Path) -> None:
    """An export made WITH a cache (past_key_values in the layout its release uses) is adopted:
    32 greedy tokens and step logits (1e-4) as the original cached export driven with its own
    past/present (standard: the same batch; in place: each row alone)."""
    out = tmp_path / "model.onnx"
    fastopt.optimize(fx.path, preset="llm", output=out, kv_cache=mode)  # type: ignore[arg-type]
    prompts = [[5, 77, 301, 12, 9, 400, 33, 2, 88], [41, 7, 250, 19]]
    ref = original(fx, prompts, STEPS, mode)
    got = kg.greedy_cached(out, prompts, STEPS, inplace=mode == "inplace")
    same, diff = kg.compare(ref, got)
    assert same == STEPS, f"first token mismatch at step {same}"
    assert diff <= 1e-4, f"step logits differ by {diff}"


def test_fixtures_readme_shows_the_matrix_as_committed() -> None:
    """tests/fixtures/README.md's matrix tables are what coverage_table.py --markdown prints
    from the committed tables (regenerate both together)."""
    from support import coverage_table as ct

    text = (MATRIX_DIR.parent / "README.md").read_text()
    start = text.index("<!-- matrix table: python tests/support/coverage_table.py --markdown -->\n")
    end = text.index("<!-- end matrix table -->")
    shown = text[start:end].split("\n", 1)[1].strip()
    assert shown == ct.markdown().strip()
