"""Per fixture (tests/fixtures/models): fastopt.optimize with preset llm (decoders also with
kv_cache standard and inplace), in memory: op counts after and seconds of optimize(). Prints one
JSON object; run it under two installs (venvs) and compare, e.g. that a refactor changes no
output and no time:

    /work/venv-main/bin/python bench/pipeline/bench_fixture_outputs.py > main.json
    /work/venv-NAME/bin/python bench/pipeline/bench_fixture_outputs.py > branch.json
    python bench/pipeline/bench_fixture_outputs.py --compare main.json branch.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"


def run(root: Path) -> dict[str, dict[str, object]]:
    import fastopt

    out: dict[str, dict[str, object]] = {}
    for d in sorted(p for p in root.iterdir() if (p / "model.onnx").exists()):
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("cache"):  # exported with a cache: bench_cached_exports.py (some refused)
            continue
        modes = [None, "standard", "inplace"] if meta.get("kind") == "decoder" else [None]
        for mode in modes:
            model = fastopt.load(str(d / "model.onnx"))
            t = time.perf_counter()
            try:
                r = fastopt.optimize(model, preset="llm", target="ort", kv_cache=mode)  # type: ignore[arg-type]
            except fastopt.ModelError as e:  # a refusal (phi3's LongRoPE, lfm2's Conv state)
                out[f"{d.name}/{mode}"] = {"ops": {"refused": str(e)}, "seconds": 0.0}
                continue
            out[f"{d.name}/{mode or 'no cache'}"] = {
                "ops": r.ops_after,
                "seconds": time.perf_counter() - t,
            }
    return out


def compare(a_path: str, b_path: str) -> None:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    differ = [k for k in a if a[k]["ops"] != b.get(k, {}).get("ops")]
    keys = sorted(a)[1:]  # the first run pays the imports
    ta, tb = (sum(d[k]["seconds"] for k in keys) for d in (a, b))
    print(f"{len(a)} runs, {len(differ)} with different op counts {differ[:5]}")
    print(f"optimize() seconds over {len(keys)} runs: {ta:.3f} vs {tb:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        compare(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(run(FIXTURES)))
