"""The coverage table (tests/fixtures/coverage.json) that tests/matrix/test_coverage_table.py
guards:
for every LLM fixture (tests/fixtures/models and the version matrix), what the `llm` preset
fuses for each target (fused op counts), what decomposed ops it leaves (residue), and whether
the KV-cache rewrite (standard, inplace) is accepted or the reason it is refused. An
encoder-decoder (t5, whisper, bart, marian: models/ and the matrix) has the same per graph
("encoder.ort", "decoder.onnx", ...), and its decoder's seq2seq cache (self + cross) as kv_*.

After an intended change (a new fusion, a fixed refusal), regenerate it and commit the diff:

    python tests/support/coverage_table.py --write

A lost fusion or cache then shows in review as a diff of this file, and fails CI until then.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import fastopt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support
from support import seq2seq_generation as sg
from support.llm_fixtures import Fixture, fixtures, matrix_fixtures

AnyFixture = Fixture | sg.Seq2SeqFixture

TABLE = Path(__file__).resolve().parents[1] / "fixtures" / "coverage.json"
# Standard-domain ops that are fusions (target onnx writes these); com.microsoft ops all are.
FUSED_ONNX = {"Attention", "RotaryEmbedding", "RMSNormalization", "LayerNormalization", "Gelu"}
# Ops that only a decomposed norm, softmax attention, rotary or GELU leaves.
RESIDUE = ("ReduceMean", "Softmax", "Sin", "Cos", "Neg", "Sqrt", "Erf", "Pow")


def all_fixtures() -> list[AnyFixture]:
    """Every fixture the table covers: models/ (with and without a cache) and the matrix, the
    encoder-decoders of both included."""
    llms: list[AnyFixture] = [*fixtures(cache_export=None), *matrix_fixtures(cache_export=None)]
    return llms + sg.seq2seq_fixtures() + sg.matrix_seq2seq_fixtures()


def _summary(report: fastopt.OptimizeReport) -> dict[str, Any]:
    fused: dict[str, int] = {}
    residue: dict[str, int] = {}
    for key, n in sorted(report.ops_after.items()):
        domain, _, op = key.rpartition("::")
        if domain == "com.microsoft" or (not domain and op in FUSED_ONNX):
            fused[op] = fused.get(op, 0) + n
        elif not domain and op in RESIDUE:
            residue[op] = n
    return {"fused": fused, "residue": residue}


def _kv(path: Path, mode: str) -> str:
    """ "ok", or the refusal's reason (first line, as the CLI prints it)."""
    try:
        fastopt.optimize(path, preset="llm", kv_cache=mode, run_check=False)  # type: ignore[arg-type]
    except fastopt.ModelError as e:
        return "refused: " + str(e).splitlines()[0]
    return "ok"


def row(fx: AnyFixture) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(fx, sg.Seq2SeqFixture):
        for graph, path in (("encoder", fx.encoder), ("decoder", fx.decoder)):
            for target in ("ort", "onnx"):
                report = fastopt.optimize(path, preset="llm", target=target, run_check=False)
                out[f"{graph}.{target}"] = _summary(report)
        for mode in ("standard", "inplace"):
            out[f"kv_{mode}"] = _kv(fx.decoder, mode)
        return out
    for target in ("ort", "onnx"):
        report = fastopt.optimize(fx.path, preset="llm", target=target, run_check=False)
        out[target] = _summary(report)
    if fx.is_decoder:
        for mode in ("standard", "inplace"):
            out[f"kv_{mode}"] = _kv(fx.path, mode)
    return out


def compute(items: list[AnyFixture] | None = None) -> dict[str, Any]:
    return {fx.name: row(fx) for fx in (all_fixtures() if items is None else items)}


def diff(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """One line per changed entry: `fixture.key: expected -> got`."""
    lines = []
    for name in sorted(set(expected) | set(got)):
        if name not in got:
            lines.append(f"{name}: in the table, no such fixture now")
            continue
        if name not in expected:
            lines.append(f"{name}: new fixture, not in the table: {json.dumps(got[name])}")
            continue
        a, b = expected[name], got[name]
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                lines.append(f"{name}.{key}: {json.dumps(a.get(key))} -> {json.dumps(b.get(key))}")
    return lines


def _exports() -> dict[str, dict[str, str]]:
    from support.llm_fixtures import MATRIX_DIR, matrix_releases

    return {r: json.loads((MATRIX_DIR / r / "exports.json").read_text()) for r in matrix_releases()}


def _cell(name: str, state: str, table: dict[str, Any], xfails: dict[str, dict[str, str]]) -> str:
    """One export's line: ok, or what fails (export, residue per target, a preset's parity, the
    KV rewrite refused or wrong)."""
    if state.startswith("absent"):
        return "n/a"
    if state.startswith("failed"):
        return "export fails"
    row, problems = table.get(name), []
    if row is None:
        return "not in coverage.json"
    for target in ("ort", "onnx"):
        # an encoder-decoder's graphs: "encoder.ort", "decoder.ort"
        residue = sorted(
            {op for k, v in row.items() if k.split(".")[-1] == target for op in v["residue"]}
        )
        if residue:
            problems.append(f"{target} residue {'+'.join(residue)}")
    failing = {
        check
        for check, entries in xfails.items()
        if any(i == name or i.startswith(name + "-") for i in entries)
    }
    presets = {"llm_preset_ort", "llm_preset_onnx", "cached_presets", "classic", "seq2seq_preset"}
    if failing & presets:
        problems.append("preset check fails")
    kv = {row.get("kv_standard", "ok"), row.get("kv_inplace", "ok")}
    if kv != {"ok"}:
        problems.append("KV refused")
    elif failing & {"kv_generation", "cached_kv", "genai", "seq2seq_kv", "seq2seq_inplace"}:
        problems.append("KV generation fails")
    return "; ".join(problems) or "ok"


def markdown() -> str:
    """The matrix as tables (one per release: family x exporter, without / with a cache, fp16), from
    the committed exports.json, coverage.json and expected_failures.json."""
    from support.llm_fixtures import MATRIX_XFAIL

    table = json.loads(TABLE.read_text())
    xfails = json.loads(MATRIX_XFAIL.read_text())
    out = []
    for release, exports in _exports().items():
        out += [
            f"transformers {release}:",
            "",
            "| family | ts | dynamo | ts, cache | dynamo, cache | ts, fp16 | dynamo, fp16 |",
            "|---|---|---|---|---|---|---|",
        ]
        archs = sorted({n.split("_ts_")[0].split("_dynamo_")[0] for n in exports})
        for arch in archs:
            cells = []
            for suffix in (
                "ts_float32",
                "dynamo_float32",
                "ts_float32_cache",
                "dynamo_float32_cache",
                "ts_float16",
                "dynamo_float16",
            ):
                name = f"{arch}_{suffix}"
                state = exports.get(name)
                cells.append(
                    "" if state is None else _cell(f"{name}.tf{release}", state, table, xfails)
                )
            out.append(f"| {arch} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite {TABLE.name}")
    ap.add_argument("--markdown", action="store_true", help="print the matrix for the README")
    args = ap.parse_args()
    if args.markdown:
        print(markdown())
        return 0
    got = compute()
    if args.write:
        TABLE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {TABLE} ({len(got)} fixtures)")
        return 0
    lines = diff(json.loads(TABLE.read_text()), got)
    print("\n".join(lines) or "coverage table unchanged")
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
