"""No public entry point lets a foreign exception escape: over a corpus of hostile models
(tests/support/hostile_models.py: files fastopt reads but onnx, protobuf or ONNX Runtime refuse),
every entry point either succeeds or raises fastopt.ModelError (or a documented subclass), with the
foreign exception kept as __cause__. Programming errors (a TypeError) are not converted."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fastopt
import fastopt.bench
import onnx
import pytest
from support.hostile_models import HOSTILE

Entry = Callable[[Path, Path], Any]

ENTRY_POINTS: dict[str, Entry] = {
    "load": lambda p, d: fastopt.load(p),
    "load_bytes": lambda p, d: fastopt.load_bytes(p.read_bytes()),
    "to_onnx": lambda p, d: fastopt.load(p).to_onnx(),
    "infer_shapes": lambda p, d: fastopt.infer_shapes(fastopt.load(p)),
    "optimize": lambda p, d: fastopt.optimize(p, output=d / "out.onnx"),
    "optimize_llm_onnx": lambda p, d: fastopt.optimize(p, preset="llm", target="onnx"),
    "convert_version": lambda p, d: fastopt.optimize(
        p, passes=["convert_version"], options={"opset": 18}
    ),
    "check": lambda p, d: fastopt.check(p),
    "verify": lambda p, d: fastopt.verify(p, p),
    "make_inputs": lambda p, d: fastopt.make_inputs(p),
    "bench_run": lambda p, d: fastopt.bench.run(p, runs=1, warmup=0, seq=4, provider="cpu"),
    "bench_compare": lambda p, d: fastopt.bench.compare(
        [p, p], runs=1, warmup=0, seq=4, provider="cpu"
    ),
}


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    for name, make in HOSTILE.items():
        (d / f"{name}.onnx").write_bytes(make())
    return d


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("name", list(HOSTILE))
def test_only_model_errors_escape(name: str, entry: str, hostile_dir: Path, tmp_path: Path) -> None:
    path = hostile_dir / f"{name}.onnx"
    before = path.read_bytes()
    try:
        ENTRY_POINTS[entry](path, tmp_path)
    except fastopt.ModelError as e:
        assert str(e), "a ModelError must say what is wrong"
        if isinstance(e, fastopt.RejectedModelError):
            assert e.__cause__ is not None and e.stage in str(e)
    # Anything else (onnx's InferenceError, protobuf's DecodeError, ORT's Fail...) fails here.
    assert path.read_bytes() == before


# Each refusal a foreign library makes, as the entry point now reports it: the stage, the
# problem, and the library's exception as the cause.
@pytest.mark.parametrize(
    ("name", "entry", "pattern", "cause"),
    [
        ("missing_opset_import", "optimize", "shape inference.*No opset import", "InferenceError"),
        ("recursive_function", "infer_shapes", "shape inference.*recursive", "ValidationError"),
        ("duplicate_functions", "optimize", "multiple local functions", "ValidationError"),
        ("matmul_without_inputs", "optimize", "MatMul.*Input 0 is out of bounds", "InferenceError"),
        # Past protobuf's nesting limit: refused at load, before onnx or protobuf see it.
        ("deep_if", "optimize", "nesting deeper than 100 levels", None),
        ("deep_type", "to_onnx", "nesting deeper than 100 levels", None),
        ("deep_if", "convert_version", "nesting deeper than 100 levels", None),
        ("invalid_tensor_dtype", "verify", "unsupported ONNX element type 99", None),
        ("invalid_tensor_dtype", "bench_run", "ONNX Runtime session creation", "InvalidArgument"),
        ("type_mismatch", "bench_run", "ONNX Runtime session creation", "Fail"),
        ("wrong_attribute_type", "verify", "could not run the original", "InvalidGraph"),
    ],
)
def test_refusals_name_stage_and_problem(
    name: str, entry: str, pattern: str, cause: str | None, hostile_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(fastopt.ModelError, match=pattern) as caught:
        ENTRY_POINTS[entry](hostile_dir / f"{name}.onnx", tmp_path)
    if cause is not None:
        assert type(caught.value.__cause__).__name__ == cause


def test_verify_tells_bad_input_from_a_bad_output(tmp_path: Path, hostile_dir: Path) -> None:
    good = tmp_path / "good.onnx"
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Relu", ["x"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 17)],
    )
    onnx.save(model, good)
    bad = hostile_dir / "unknown_op.onnx"  # same interface, an op ORT does not have
    with pytest.raises(fastopt.InputRejectedError):
        fastopt.verify(bad, good)
    with pytest.raises(fastopt.OutputRejectedError, match="fastopt bug") as caught:
        fastopt.verify(good, bad)
    assert isinstance(caught.value, fastopt.VerifyError)  # a failed verification: CLI exit 1


def test_programming_errors_are_not_converted(hostile_dir: Path) -> None:
    with pytest.raises(TypeError):
        fastopt.load(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        fastopt.check(object())  # type: ignore[arg-type]


def test_error_hierarchy() -> None:
    for cls in (
        fastopt.RejectedModelError,
        fastopt.OptionError,
        fastopt.UnknownNameError,
        fastopt.UnsupportedModelError,
        fastopt.VerifyError,
        fastopt.InputRejectedError,
        fastopt.OutputRejectedError,
        fastopt.CheckError,
    ):
        assert issubclass(cls, fastopt.ModelError), cls
    assert issubclass(fastopt.OptionError, ValueError)
    assert issubclass(fastopt.UnknownNameError, KeyError)
    assert str(fastopt.UnknownNameError("no pass named 'x'")) == "no pass named 'x'"


def test_hostile_files_are_what_they_claim(hostile_dir: Path) -> None:
    """The corpus must stay hostile: protobuf refuses the deep ones, onnx the others."""
    for name in ("deep_if", "deep_type"):
        with pytest.raises(Exception, match=r"MaxDepth|parse"):
            onnx.load_from_string((hostile_dir / f"{name}.onnx").read_bytes())
    for name in ("missing_opset_import", "recursive_function", "duplicate_functions"):
        with pytest.raises(Exception):  # noqa: B017 - onnx's exception types vary by version
            onnx.checker.check_model(str(hostile_dir / f"{name}.onnx"), full_check=True)
    assert os.path.getsize(hostile_dir / "deep_if.onnx") < 1 << 20
