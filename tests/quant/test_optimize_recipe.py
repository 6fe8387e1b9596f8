"""`fastopt optimize --quantize int4` takes the recipe flags `fastopt quantize` has (--recipe,
--calibration, --bits-budget, --awq, --save-importance; cli/recipe_flags.py): the LLM path in one
command, fusions and the KV cache, then q4m with GPTQ on text the model samples itself."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from fastopt.cli.main import main
from support.paths import TESTS

LLAMA = TESTS / "fixtures" / "models" / "llama_ts_float32" / "model.onnx"


def _matmul_nbits(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]


def test_optimize_with_a_cache_and_q4m_on_sampled_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o" / "model.onnx"
    args = ["optimize", str(LLAMA), "-o", str(out), "--kv-cache", "inplace", "--quantize", "int4"]
    assert main([*args, "--recipe", "q4m", "--calibration", "sampled"]) == 0
    printed = capsys.readouterr().out
    assert "calibration: 4096 tokens from 64 sequences of 64 tokens sampled" in printed
    assert "gptq: X^T X factors for 11 weights" in printed  # q4m with calibration: GPTQ
    assert "budget 4.6" in printed
    nodes = _matmul_nbits(out)
    assert len(nodes) == 11
    for n in nodes:  # the recipe's blocks: 64, asymmetric (a zero point input)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["block_size"] == 64 and len(n.input) >= 4 and n.input[3]
    assert any(n.op_type == "GroupQueryAttention" for n in onnx.load(str(out)).graph.node)


def test_optimize_without_a_recipe_keeps_the_usual_defaults(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    assert main(["optimize", str(LLAMA), "-o", str(out), "--quantize", "int4"]) == 0
    for n in _matmul_nbits(out):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["block_size"] == 32 and (len(n.input) < 4 or not n.input[3])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--recipe", "q4m"], "error: --recipe: only with --quantize int4|int8"),
        (["--calibration", "sampled"], "error: --calibration: only with --quantize int4|int8"),
        (["--quantize", "int8", "--recipe", "q4m"], "error: recipe q4m is an int4 recipe"),
    ],
)
def test_recipe_flags_without_weight_quantization_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    out = tmp_path / "model.onnx"
    assert main(["optimize", str(LLAMA), "-o", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err
    assert not out.exists()
