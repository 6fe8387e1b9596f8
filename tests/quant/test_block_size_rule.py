"""The quantization block-size rule is stated once (csrc/passes/quant/options.h, exposed as
``_C.quant_block_size_problem``): the C++ pass, the API (``fastopt.quantize``), the option
declaration (``optimize(options=...)``) and the CLI take the same sizes and refuse the others with
the same message."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt import _C
from fastopt.cli.main import main
from fastopt.pipeline.options import OPTIONS, check_options
from onnx import TensorProto, helper, numpy_helper

SIZES = [-16, 0, 8, 15, 16, 24, 32, 48, 64, 100, 128, 256, 512, 2**40]
VALID = {16, 32, 64, 128, 256}


def _model(path: Path) -> str:
    w = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 8])
    g = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        "g",
        [x],
        [y],
        [numpy_helper.from_array(w, "W")],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def _pass_says(path: str, size: int) -> str:
    """The C++ pass's refusal ("" when it quantizes)."""
    m = fastopt.load(path)
    try:
        _C.run_pass(
            m, "quantize_weights", "ort", 10, "", {"quant_block_size": size}, {"quant_mode": "int4"}
        )
    except fastopt.ModelError as e:
        return str(e)
    assert m.op_counts().get("com.microsoft::MatMulNBits") == 1
    return ""


def _api_says(path: str, size: int, out: Path) -> str:
    try:
        fastopt.quantize(path, out, mode="int4", block_size=size, run_check=False)
    except fastopt.ModelError as e:
        return str(e)
    return ""


def _option_says(size: int) -> str:
    try:
        check_options({"quant_block_size": size})
    except fastopt.OptionError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("size", SIZES)
def test_pass_api_option_and_cli_agree(
    size: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _model(tmp_path / "m.onnx")
    said = _pass_says(path, size)
    assert (said == "") == (size in VALID)
    if said:
        assert said.startswith("block size must be a power of two in 16..256")
        assert said.endswith(f"not {size}")
    assert _api_says(path, size, tmp_path / "api.onnx") == said
    assert _option_says(size) == said
    code = main(
        [
            "quantize",
            path,
            "-o",
            str(tmp_path / "cli.onnx"),
            "--mode",
            "int4",
            "--block-size",
            str(size),
        ]
    )
    err = capsys.readouterr().err
    if said:
        assert (code, err) == (2, f"error: {said}\n")
    else:
        assert code == 0 and "error" not in err


def test_one_statement_of_the_rule() -> None:
    assert (_C.QUANT_BLOCK_SIZE_MIN, _C.QUANT_BLOCK_SIZE_MAX) == (16, 256)
    spec = OPTIONS["quant_block_size"]
    assert (spec.minimum, spec.maximum) == (16, 256) and spec.default == 32
    assert [n for n in range(-300, 600) if not _C.quant_block_size_problem(n)] == sorted(VALID)
