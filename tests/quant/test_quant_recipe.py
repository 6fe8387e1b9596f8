"""``fastopt quantize --recipe NAME``: settings that go together (fastopt.quant.recipe.RECIPES),
flags given explicitly winning over them, on the llama TorchScript fixture (float32 weights, so
float32 scales) and its float16 dynamo sibling (float16 scales)."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from fastopt.cli.main import main
from fastopt.quant.budget import allocate
from fastopt.quant.calibration import weight_matmuls
from fastopt.quant.recipe import RECIPES, recipe_settings
from support.paths import TESTS

FIXTURES = TESTS / "fixtures" / "models"
LLAMA = FIXTURES / "llama_ts_float32" / "model.onnx"
LLAMA_FP16 = FIXTURES / "llama_dynamo_float16" / "model.onnx"


def _matmul_nbits(path: Path) -> list[dict[str, int]]:
    out = []
    for n in onnx.load(str(path)).graph.node:
        if n.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in n.attribute if a.type == onnx.AttributeProto.INT}
            attrs["zero_points"] = int(len(n.input) > 3 and bool(n.input[3]))
            out.append(attrs)
    return out


def _bits_per_weight(path: Path) -> float:
    """Codes, scales and zero points of every MatMulNBits weight, as written, per weight."""
    proto = onnx.load(str(path))
    inits = {i.name: i for i in proto.graph.initializer}
    bits = weights = 0
    for n in proto.graph.node:
        if n.op_type != "MatMulNBits":
            continue
        a = {x.name: x.i for x in n.attribute}
        weights += a["K"] * a["N"]
        for name in list(n.input)[1:4]:
            if name:
                bits += 8 * len(onnx.numpy_helper.to_array(inits[name]).tobytes())
    return bits / weights


def test_q4m_cli_within_its_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.onnx"
    args = ["quantize", str(LLAMA_FP16), "-o", str(out), "--mode", "int4", "--recipe", "q4m"]
    assert main(args) == 0
    assert "(budget 4.6)" in capsys.readouterr().out
    recipe = RECIPES["q4m"]
    nodes = _matmul_nbits(out)
    assert nodes and {n["block_size"] for n in nodes} == {recipe["block_size"]}
    assert {n["zero_points"] for n in nodes} == {int(not recipe["symmetric"])}
    assert _bits_per_weight(out) <= recipe["bits_budget"] + 1e-9
    # The budget's room went to int8 where the error per extra bit is largest.
    assert any(n["bits"] == 8 for n in nodes)


def test_q4m_over_its_budget_stays_int4(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """K = 64 with float32 scales: int4 alone takes 4.625 bits (one zero point byte per column
    for one block); the recipe writes all int4 and says so, where --bits-budget 4.6 refuses."""
    out = tmp_path / "q.onnx"
    args = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4"]
    assert main([*args, "--recipe", "q4m"]) == 0
    assert "(budget 4.6: int4 alone is over it here)" in capsys.readouterr().out
    nodes = _matmul_nbits(out)
    assert {(n["block_size"], n["bits"], n["zero_points"]) for n in nodes} == {(64, 4, 1)}
    assert main([*args, "--asymmetric", "--block-size", "64", "--bits-budget", "4.6"]) == 2
    assert "below what int4 takes" in capsys.readouterr().err


def test_explicit_flags_win_over_the_recipe(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    args = ["quantize", str(LLAMA), "-o", str(out), "--mode", "int4", "--recipe", "q4m"]
    assert main([*args, "--block-size", "32", "--symmetric", "--bits-budget", "5.5"]) == 0
    nodes = _matmul_nbits(out)
    assert {(n["block_size"], n["zero_points"]) for n in nodes} == {(32, 0)}
    assert any(n["bits"] == 8 for n in nodes)
    assert _bits_per_weight(out) <= 5.5 + 1e-9


def test_python_api_recipe_alone_applies_its_settings(tmp_path: Path) -> None:
    """fastopt.quantize(recipe="q4m") writes q4m's model, byte for byte the one its settings
    spelled out give (it wrote round to nearest's before: the name was only recorded)."""
    by_name, spelled = tmp_path / "name.onnx", tmp_path / "spelled.onnx"
    fastopt.quantize(LLAMA_FP16, by_name, mode="int4", recipe="q4m", run_check=False)
    settings = recipe_settings("q4m")
    fastopt.quantize(LLAMA_FP16, spelled, mode="int4", run_check=False, recipe="q4m", **settings)
    nodes = _matmul_nbits(by_name)
    assert nodes == _matmul_nbits(spelled)
    assert {n["block_size"] for n in nodes} == {settings["block_size"]}
    assert any(n["bits"] == 8 for n in nodes)
    a, b = onnx.load(str(by_name)).graph.initializer, onnx.load(str(spelled)).graph.initializer
    assert [t.raw_data for t in a] == [t.raw_data for t in b]


def test_without_a_recipe_the_defaults_stay(tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(LLAMA), "-o", str(out), "--mode", "int4"]) == 0
    nodes = _matmul_nbits(out)
    assert {(n["block_size"], n["bits"], n["zero_points"]) for n in nodes} == {(32, 4, 0)}


def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(LLAMA), "-o", str(out), "--mode", "int8", "--recipe", "q4m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: recipe q4m is an int4 recipe") and err.count("\n") == 1
    assert not out.exists()
    with pytest.raises(fastopt.ModelError, match="unknown recipe 'q9'; choose one of q4m"):
        recipe_settings("q9")
    with pytest.raises(fastopt.ModelError, match="unknown recipe 'q9'"):
        fastopt.quantize(LLAMA, out, mode="int4", recipe="q9")


@pytest.mark.parametrize("fixture", ["llama_ts_float32", "qwen2_ts_float32"])
def test_budget_ranks_value_and_down_projections_first(fixture: str) -> None:
    """The squared error alone ranked q/k first on SmolLM2 (KL 0.48 at 4.6 bits); attention V,
    then MLP down projections first: 0.33. Found by structure, not by name."""
    model = fastopt.load(FIXTURES / fixture / "model.onnx")
    node = {u.weight: u.node for u in weight_matmuls(model)}
    alloc = allocate(model, 5.6, block_size=32, symmetric=True, lm_head="int4")
    roles = {(node[t.weight].split("/")[-2], t.role) for t in alloc.tensors}
    assert {r for r in roles if r[1]} == {("v_proj", "value"), ("down_proj", "down")}
    int8 = [node[w].split("/")[-2] for w in alloc.int8_weights]
    assert int8.count("v_proj") == 2 and "down_proj" in int8
    # Calibrated the same groups come first, each ranked by the importance-weighted errors.
    ones = {u.weight: np.ones(u.k, np.float32) for u in weight_matmuls(model)}
    weighted = allocate(model, 5.6, block_size=32, symmetric=True, lm_head="int4", importance=ones)
    assert [t.role for t in weighted.tensors] == [t.role for t in alloc.tensors]
    assert weighted.weighted and weighted.int8_weights == alloc.int8_weights
