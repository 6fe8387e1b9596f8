"""``fastopt.optimize(quantize=...)`` takes the mode names ``--quantize`` takes (issue 28), as
well as a QuantSettings; an unknown name is an OptionError naming the known ones."""

from __future__ import annotations

from pathlib import Path

import fastopt
import onnx
import pytest
from support.llm_fixtures import fixtures

LLAMA = fixtures(arch="llama", exporter="ts", dtype="float32")[0]


def _ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


@pytest.mark.parametrize(("mode", "op"), [("int4", "MatMulNBits"), ("int8-dynamic", None)])
def test_optimize_takes_a_mode_name(mode: str, op: str | None, tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    r = fastopt.optimize(LLAMA.path, output=out, preset="llm", quantize=mode)  # type: ignore[arg-type]
    assert r.quantization and any(w.action == "quantized" for w in r.quantization)
    if op:
        assert op in _ops(out)
    # The same as the settings object with that mode and the defaults.
    out2 = tmp_path / "q2.onnx"
    fastopt.optimize(LLAMA.path, output=out2, preset="llm", quantize=fastopt.QuantSettings(mode))
    assert out.read_bytes() == out2.read_bytes()


def test_unknown_mode_name_is_an_option_error() -> None:
    with pytest.raises(fastopt.OptionError, match=r"unknown quantization mode 'int3'.*int4"):
        fastopt.optimize(LLAMA.path, quantize="int3")  # type: ignore[arg-type]
    with pytest.raises(fastopt.OptionError, match="unknown quantization mode"):
        fastopt.quantize(LLAMA.path, mode="int3")  # type: ignore[arg-type]


def test_other_types_are_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"mode name .* or a QuantSettings, not int"):
        fastopt.optimize(LLAMA.path, quantize=4)  # type: ignore[arg-type]
