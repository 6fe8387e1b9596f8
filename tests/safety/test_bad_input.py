"""Bad input must raise fastopt.ModelError with a message that names the problem.

Never a segfault, a hang, an allocation sized by an untrusted length, or another exception
type. Each test builds its bad file from a small valid model (onnx.helper, or the protobuf wire
format by hand for the encoding-level cases). Loads run in-process under a hang guard; the
checks whose failure mode is a crash (corrupted-byte sweeps, deep nesting, memory limits, saving
over a mapped input) run in a child process so that a crash fails one test, not the session.

Saving must never touch the input and must be atomic (see test_file_safety.py).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.paths import TESTS
from support.wire import (
    EGROUP_WT,
    I32_WT,
    I64_WT,
    LEN_WT,
    SGROUP_WT,
    VARINT_WT,
    f_len,
    f_str,
    f_varint,
    key,
    varint,
)
from support.wire_models import (
    OPSET,
    add_model,
    model_from_graph,
    nested_graph_model,
    nested_group_model,
    nested_type_model,
    wire_node,
)

HERE = TESTS
FUZZ_DIR = HERE / "fuzz"
CORPUS = FUZZ_DIR / "corpus"

# Regexes (matched case-insensitively) that name each problem: broad enough for wording, narrow
# enough to name the class.
TRUNCATED = r"truncat|past the end|end of (the )?(file|data|input|buffer)|unexpected end"
PAST_END = r"past the end|truncat|exceeds|overrun|out of bounds"
VARINT = r"varint"
WIRE_TYPE = r"wire type"
DIM = r"dim"
DIM_OR_OVERFLOW = r"dim|overflow"
RAW_SIZE = r"raw_data.*size|expected \d+ bytes|\d+ bytes.*expected"
OUTSIDE = r"outside|escapes"
OFFSET_LENGTH = r"offset|length"
MISSING = r"not found|missing|no such|does not exist"
CYCLE = r"cycle"
DANGLING = r"dangling|undefined|not defined"

SOFT_TIMEOUT_S = 120  # SIGALRM: raises in Python once control comes back from C++; wall time,
# generous: the flip test takes ~10 s alone and 30+ s on a machine shared with builds
HARD_TIMEOUT_S = 300  # faulthandler watchdog thread: dumps stacks and exits even if C++ spins


class HangError(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _hang_guard() -> Iterator[None]:
    """Per-test time limit without a plugin: a hang fails loudly instead of stalling CI."""

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise HangError(f"test exceeded {SOFT_TIMEOUT_S}s (hang in the reader?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(SOFT_TIMEOUT_S)
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------------------
# Models encoded by hand (tests/support/wire.py)


def wire_value_info(name: str) -> bytes:
    # ValueInfoProto{name, type{tensor_type{elem_type: FLOAT}}}
    return f_str(1, name) + f_len(2, f_len(1, f_varint(1, TensorProto.FLOAT)))


# ---------------------------------------------------------------------------------------------
# Small valid models


def tensor(name: str, dtype: int, dims: list[int], raw: bytes | None = None) -> TensorProto:
    """A TensorProto built field by field (helper.make_tensor validates, which we must not)."""
    t = TensorProto()
    t.name = name
    t.data_type = dtype
    t.dims.extend(dims)
    if raw is not None:
        t.raw_data = raw
    return t


def external_tensor(
    dims: list[int], location: str | None, offset: str | None = "0", length: str | None = None
) -> TensorProto:
    t = tensor("W", TensorProto.FLOAT, dims)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", offset), ("length", length)):
        if v is not None:
            e = t.external_data.add()
            e.key, e.value = k, v
    return t


def write(path: Path, data: bytes | onnx.ModelProto) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.SerializeToString())
    return path


def load(path: Path) -> fastopt.Model:
    return fastopt.load(str(path))


_TMP_ROOTS: list[str] = []


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Overrides pytest's tmp_path: its folder is named after the test, and error messages quote
    file paths, so `test_truncated_inside_graph0/m.onnx` would satisfy a /truncat/ match on its
    own. A neutral folder, and scrub() on top, keep every match honest."""
    d = Path(tempfile.mkdtemp(prefix="fo-"))
    _TMP_ROOTS[:] = [str(d), os.path.realpath(d)]
    try:
        yield d
    finally:
        _TMP_ROOTS.clear()
        shutil.rmtree(d, ignore_errors=True)


def scrub(message: str) -> str:
    """The message without the temporary folder's path (which is not the message's content)."""
    for root in sorted(_TMP_ROOTS, key=len, reverse=True):
        message = message.replace(root, "<tmp>")
    return message


def expect_error(path: Path, pattern: str) -> str:
    with pytest.raises(fastopt.ModelError) as exc:
        load(path)
    msg = scrub(str(exc.value))
    assert re.search(pattern, msg, re.IGNORECASE), (
        f"ModelError does not name the problem (/{pattern}/): {msg}"
    )
    return msg


def graph_bytes(m: onnx.ModelProto) -> bytes:
    return m.graph.SerializeToString()


def run_child(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def child_report(proc: subprocess.CompletedProcess[str]) -> str:
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    return f"child {how}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


# ---------------------------------------------------------------------------------------------
# Baselines: the models the bad inputs are made from are themselves fine


def test_baseline_model_loads(tmp_path: Path) -> None:
    m = load(write(tmp_path / "m.onnx", add_model()))
    assert m.op_counts() == {"Add": 1}
    np.testing.assert_array_equal(
        m.graph.initializer("W").numpy(), np.arange(6, dtype=np.float32).reshape(2, 3)
    )


def test_baseline_wire_built_model_loads(tmp_path: Path) -> None:
    init = tensor("W", TensorProto.FLOAT, [2, 3], bytes(24)).SerializeToString()
    g = (
        f_len(1, wire_node("Add", ["X", "W"], ["Y"]))
        + f_str(2, "g")
        + f_len(5, init)
        + f_len(11, wire_value_info("X"))
        + f_len(12, wire_value_info("Y"))
    )
    m = load(write(tmp_path / "m.onnx", model_from_graph(g)))
    assert m.op_counts() == {"Add": 1}


def put_weights_bin(d: Path) -> None:
    """The external data files the fuzz seeds point into (tests/fuzz/make_seeds.py)."""
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        from make_seeds import write_data_files
    finally:
        sys.path.remove(str(FUZZ_DIR))
    write_data_files(d)


@pytest.mark.parametrize("seed", sorted(p.name for p in CORPUS.glob("*.onnx")))
def test_fuzz_seeds_load(tmp_path: Path, seed: str) -> None:
    put_weights_bin(tmp_path)
    m = load(write(tmp_path / seed, (CORPUS / seed).read_bytes()))
    m.verify()


def test_wire_variants_that_are_valid_still_load(tmp_path: Path) -> None:
    """Strictness must not reject legal encodings: unknown fields of every wire type (skipped),
    packed and unpacked repeated scalars, fields out of number order."""
    unknown = (
        f_varint(900, 7)
        + key(901, I64_WT)
        + bytes(8)
        + f_len(902, b"xyz")
        + key(903, I32_WT)
        + bytes(4)
    )
    unpacked_dims = f_varint(1, 2) + f_varint(1, 3)
    init = (
        f_str(8, "W")
        + unknown
        + unpacked_dims
        + f_varint(2, TensorProto.FLOAT)
        + f_len(9, bytes(24))
    )
    g = (
        f_len(12, wire_value_info("Y"))  # output before node: any order is legal
        + f_len(1, wire_node("Add", ["X", "W"], ["Y"], extra=unknown))
        + f_len(5, init)
        + f_len(11, wire_value_info("X"))
        + unknown
    )
    data = OPSET + f_len(7, g) + unknown + f_varint(1, 10)
    m = load(write(tmp_path / "m.onnx", data))
    assert m.graph.initializer("W").shape == (2, 3)

    packed = f_str(8, "W") + f_len(1, varint(2) + varint(3)) + f_varint(2, 1) + f_len(9, bytes(24))
    g2 = g.replace(f_len(5, init), f_len(5, packed))
    assert load(write(tmp_path / "m2.onnx", model_from_graph(g2))).graph.initializer("W").shape == (
        2,
        3,
    )


def test_omitted_optional_input_is_not_dangling(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Clip", ["X", "", "hi"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "hi")],
    )
    m = load(write(tmp_path / "m.onnx", helper.make_model(graph)))
    assert m.graph.nodes[0].inputs[1] is None


# ---------------------------------------------------------------------------------------------
# Truncated files


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_truncated_inside_graph(tmp_path: Path, fraction: float) -> None:
    data = add_model().SerializeToString()
    g = graph_bytes(add_model())
    start = data.index(g)
    cut = start + max(1, int(len(g) * fraction))
    expect_error(write(tmp_path / "m.onnx", data[:cut]), TRUNCATED)


def test_truncated_inside_raw_data(tmp_path: Path) -> None:
    raw = np.arange(6, dtype=np.float32).tobytes()
    data = add_model().SerializeToString()
    cut = data.index(raw) + 5
    expect_error(write(tmp_path / "m.onnx", data[:cut]), TRUNCATED)


def test_truncated_inside_varint(tmp_path: Path) -> None:
    # ir_version's value is a 2-byte varint; the file ends after its first byte.
    data = f_varint(1, 300)[:-1]
    expect_error(write(tmp_path / "m.onnx", data), TRUNCATED + "|" + VARINT)


def test_truncated_inside_fixed32(tmp_path: Path) -> None:
    # An unknown fixed32 field at the end of the model with only 2 of its 4 bytes.
    data = add_model().SerializeToString() + key(900, I32_WT) + b"\x01\x02"
    expect_error(write(tmp_path / "m.onnx", data), TRUNCATED + "|fixed32")


# ---------------------------------------------------------------------------------------------
# Wrong wire types


def test_graph_field_with_varint_wire_type(tmp_path: Path) -> None:
    data = f_varint(1, 10) + f_varint(7, 5) + OPSET
    expect_error(write(tmp_path / "m.onnx", data), WIRE_TYPE)


def test_ir_version_with_len_wire_type(tmp_path: Path) -> None:
    data = f_len(1, b"abc") + f_len(7, graph_bytes(add_model())) + OPSET
    expect_error(write(tmp_path / "m.onnx", data), WIRE_TYPE)


def test_node_op_type_with_fixed32_wire_type(tmp_path: Path) -> None:
    node = f_str(1, "X") + f_str(1, "W") + f_str(2, "Y") + key(4, I32_WT) + b"Add\x00"
    g = f_len(1, node) + graph_bytes(add_model())
    expect_error(write(tmp_path / "m.onnx", model_from_graph(g)), WIRE_TYPE)


def test_tensor_dims_with_fixed64_wire_type(tmp_path: Path) -> None:
    init = f_str(8, "W") + key(1, I64_WT) + (6).to_bytes(8, "little") + f_varint(2, 1)
    g = graph_bytes(add_model()) + f_len(5, init)
    expect_error(write(tmp_path / "m.onnx", model_from_graph(g)), WIRE_TYPE)


@pytest.mark.parametrize("wire_type", [6, 7])
def test_invalid_wire_type(tmp_path: Path, wire_type: int) -> None:
    data = add_model().SerializeToString() + key(3, wire_type) + b"\x00" * 8
    expect_error(write(tmp_path / "m.onnx", data), WIRE_TYPE)


def test_end_group_without_start(tmp_path: Path) -> None:
    data = add_model().SerializeToString() + key(900, EGROUP_WT)
    expect_error(write(tmp_path / "m.onnx", data), r"group|wire type")


def test_unterminated_group(tmp_path: Path) -> None:
    data = add_model().SerializeToString() + key(900, SGROUP_WT) + f_varint(1, 1)
    expect_error(write(tmp_path / "m.onnx", data), r"group|truncat")


def test_field_number_zero(tmp_path: Path) -> None:
    data = add_model().SerializeToString() + b"\x00\x00"
    expect_error(write(tmp_path / "m.onnx", data), r"field number|tag")


# ---------------------------------------------------------------------------------------------
# Lengths past the end


def test_length_past_end_of_file(tmp_path: Path) -> None:
    g = graph_bytes(add_model())
    data = f_varint(1, 10) + key(7, LEN_WT) + varint(len(g) + 100) + g
    expect_error(write(tmp_path / "m.onnx", data), PAST_END)


def test_length_past_end_of_enclosing_message(tmp_path: Path) -> None:
    """A node's length runs past its graph but not past the file: still out of bounds."""
    node = wire_node("Add", ["X", "W"], ["Y"])
    g = key(1, LEN_WT) + varint(len(node) + 40) + node
    data = f_varint(1, 10) + f_len(7, g) + OPSET + f_len(900, bytes(64))
    expect_error(write(tmp_path / "m.onnx", data), PAST_END)


@pytest.mark.parametrize(
    "length", [2**31 - 1, 2**32 + 3, 2**63 - 1, 2**63, 2**64 - 1], ids=lambda n: f"{n:#x}"
)
def test_huge_length(tmp_path: Path, length: int) -> None:
    """Lengths that overflow 32-bit or signed arithmetic (pos + len) must not wrap around."""
    data = f_varint(1, 10) + key(7, LEN_WT) + varint(length) + graph_bytes(add_model())
    expect_error(write(tmp_path / "m.onnx", data), PAST_END)


def test_raw_data_length_past_end(tmp_path: Path) -> None:
    init = f_str(8, "W") + f_varint(1, 2) + f_varint(1, 3) + f_varint(2, 1)
    init += key(9, LEN_WT) + varint(24) + bytes(10)  # claims 24 bytes, has 10
    g = wire_node("Add", ["X", "W"], ["Y"])
    data = model_from_graph(f_len(1, g) + f_len(5, init))
    expect_error(write(tmp_path / "m.onnx", data), PAST_END)


# ---------------------------------------------------------------------------------------------
# Varints that never end


def test_varint_longer_than_ten_bytes(tmp_path: Path) -> None:
    data = key(1, VARINT_WT) + b"\x80" * 20 + b"\x01"
    expect_error(write(tmp_path / "m.onnx", data), VARINT)


def test_varint_continues_to_end_of_file(tmp_path: Path) -> None:
    data = add_model().SerializeToString() + key(1, VARINT_WT) + b"\xff" * 5
    expect_error(write(tmp_path / "m.onnx", data), VARINT)


def test_tag_varint_never_ends(tmp_path: Path) -> None:
    expect_error(write(tmp_path / "m.onnx", b"\xff" * 64), VARINT)


def test_packed_varint_ends_inside_value(tmp_path: Path) -> None:
    init = f_str(8, "W") + f_len(1, b"\x02\x83") + f_varint(2, 1) + f_len(9, bytes(8))
    g = f_len(1, wire_node("Identity", ["W"], ["Y"])) + f_len(5, init)
    expect_error(write(tmp_path / "m.onnx", model_from_graph(g)), VARINT + "|packed")


@pytest.mark.parametrize(
    ("field", "dtype"), [(5, TensorProto.INT32), (7, TensorProto.INT64), (11, TensorProto.UINT64)]
)
def test_overlong_varint_in_packed_typed_data(tmp_path: Path, field: int, dtype: int) -> None:
    """int32_data / int64_data / uint64_data hold packed varints: an 11-byte one is corrupt
    input, refused at load rather than when (if ever) the values are decoded. Found by atheris:
    such a model loaded and its Tensor.numpy() raised later."""
    payload = varint(1) + b"\x80" * 10 + b"\x01" + varint(3)
    init = f_str(8, "W") + f_varint(1, 3) + f_varint(2, dtype) + f_len(field, payload)
    g = f_len(1, wire_node("Identity", ["W"], ["Y"])) + f_len(5, init)
    expect_error(write(tmp_path / "m.onnx", model_from_graph(g)), VARINT)


# ---------------------------------------------------------------------------------------------
# Negative or absurd dims


def test_negative_dim_in_initializer(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.FLOAT, [-1, 3], bytes(12))
    expect_error(write(tmp_path / "m.onnx", add_model(t)), DIM)


def test_negative_dim_with_typed_data(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.FLOAT, [-2, -3])
    t.float_data.extend([1.0] * 6)  # (-2) * (-3) == 6: a product check alone is not enough
    expect_error(write(tmp_path / "m.onnx", add_model(t)), DIM)


def test_negative_dim_in_constant_attribute(tmp_path: Path) -> None:
    value = tensor("c", TensorProto.FLOAT, [-4], bytes(16))
    node = helper.make_node("Constant", [], ["W"], value=value)
    graph = helper.make_graph(
        [node, helper.make_node("Add", ["X", "W"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])],
    )
    expect_error(write(tmp_path / "m.onnx", helper.make_model(graph)), DIM)


@pytest.mark.parametrize(
    "dims",
    [[2**62, 4], [2**31, 2**31, 2**31], [2**63 - 1, 2], [2**32, 2**31 + 1]],
    ids=["2^62x4", "2^31^3", "int64max_x2", "over_int64_under_uint64"],
)
def test_dims_whose_product_overflows(tmp_path: Path, dims: list[int]) -> None:
    t = tensor("W", TensorProto.FLOAT, dims, bytes(16))
    expect_error(write(tmp_path / "m.onnx", add_model(t)), DIM_OR_OVERFLOW)


def test_zero_dim_does_not_hide_absurd_dims(tmp_path: Path) -> None:
    """[0, 2^62, 2^62] has no elements, so it needs no data, but its other dims multiply past
    int64: no consumer can represent the shape (numpy raises ValueError in reshape). Found by
    the mutant sweep: a bit flip turned raw_data into packed dims that include zeros."""
    t = tensor("W", TensorProto.FLOAT, [0, 2**62, 2**62])
    expect_error(write(tmp_path / "m.onnx", add_model(t)), DIM_OR_OVERFLOW)


def test_absurd_dims_with_tiny_payload(tmp_path: Path) -> None:
    """4 TiB of floats declared, 4 bytes present: rejected before anything is sized by it."""
    t = tensor("W", TensorProto.FLOAT, [2**20, 2**20], bytes(4))
    expect_error(write(tmp_path / "m.onnx", add_model(t)), DIM + "|" + RAW_SIZE)


def sparse_model(dims: list[int], indices: list[int], index_dims: list[int] | None = None) -> bytes:
    values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "S")
    idx = numpy_helper.from_array(np.array(indices, np.int64).reshape(index_dims or [-1]), "")
    graph = helper.make_graph(
        [helper.make_node("Neg", ["S"], ["Y"])],
        "g",
        [],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )
    graph.sparse_initializer.append(helper.make_sparse_tensor(values, idx, dims))
    return helper.make_model(graph).SerializeToString()


def test_sparse_initializer_baseline(tmp_path: Path) -> None:
    load(write(tmp_path / "m.onnx", sparse_model([2, 3], [1, 5])))
    load(write(tmp_path / "m2.onnx", sparse_model([2, 3], [0, 1, 1, 2], [2, 2])))


def test_sparse_negative_dim(tmp_path: Path) -> None:
    expect_error(write(tmp_path / "m.onnx", sparse_model([-4], [0, 1])), DIM)


def test_sparse_absurd_dims(tmp_path: Path) -> None:
    expect_error(write(tmp_path / "m.onnx", sparse_model([2**62, 8], [0, 1])), DIM_OR_OVERFLOW)


@pytest.mark.parametrize(
    ("dims", "indices", "index_dims"),
    [
        ([4], [1, 100], None),
        ([4], [1, -1], None),
        ([2, 3], [0, 1, 2, 0], [2, 2]),
        ([2, 3], [1, 6], None),
    ],
    ids=["linear_past_end", "linear_negative", "coordinate_past_end", "linear_equals_numel"],
)
def test_sparse_index_out_of_range(
    tmp_path: Path, dims: list[int], indices: list[int], index_dims: list[int] | None
) -> None:
    """An index outside the dense shape is an offset past the end: densifying it would write
    out of bounds."""
    data = sparse_model(dims, indices, index_dims)
    expect_error(write(tmp_path / "m.onnx", data), r"ind(ex|ices)|out of (range|bounds)")


def test_sparse_index_count_not_matching_values(tmp_path: Path) -> None:
    data = sparse_model([8], [0, 1, 2])  # 2 values, 3 indices
    expect_error(write(tmp_path / "m.onnx", data), r"ind(ex|ices)|values")


# ---------------------------------------------------------------------------------------------
# raw_data / typed data size not matching the shape


@pytest.mark.parametrize("nbytes", [0, 20, 23, 25, 28, 48])
def test_raw_data_size_mismatch(tmp_path: Path, nbytes: int) -> None:
    t = tensor("W", TensorProto.FLOAT, [2, 3])
    t.raw_data = bytes(nbytes)
    if nbytes == 0:
        # An empty raw_data field is "no data" to most readers; say so either way.
        expect_error(write(tmp_path / "m.onnx", add_model(t)), RAW_SIZE + r"|no data")
    else:
        msg = expect_error(write(tmp_path / "m.onnx", add_model(t)), RAW_SIZE)
        assert "24" in msg, f"message should state the expected size (24 bytes): {msg}"


def test_scalar_raw_data_size_mismatch(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.FLOAT, [], bytes(3))
    expect_error(write(tmp_path / "m.onnx", add_model(t)), RAW_SIZE)


@pytest.mark.parametrize("count", [5, 7])
def test_float_data_count_mismatch(tmp_path: Path, count: int) -> None:
    t = tensor("W", TensorProto.FLOAT, [2, 3])
    t.float_data.extend([1.0] * count)
    expect_error(write(tmp_path / "m.onnx", add_model(t)), r"float_data|typed data|values")


def test_int64_data_count_mismatch(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.INT64, [4])
    t.int64_data.extend([1, 2])
    expect_error(write(tmp_path / "m.onnx", add_model(t)), r"int64_data|typed data|values")


def test_shape_without_any_data(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.FLOAT, [2, 3])
    expect_error(write(tmp_path / "m.onnx", add_model(t)), r"no data|missing data")


def test_raw_data_with_wrong_typed_field(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.FLOAT, [2, 3], bytes(24))
    t.int64_data.extend([1] * 6)
    expect_error(write(tmp_path / "m.onnx", add_model(t)), r"both|raw_data")


def test_string_tensor_with_raw_data(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.STRING, [2], b"abcd")
    expect_error(write(tmp_path / "m.onnx", add_model(t)), r"string")


@pytest.mark.parametrize("dtype", [0, 99, -3])
def test_unknown_data_type_with_payload(tmp_path: Path, dtype: int) -> None:
    t = tensor("W", dtype, [2, 3], bytes(24))
    expect_error(write(tmp_path / "m.onnx", add_model(t)), r"type")


# ---------------------------------------------------------------------------------------------
# External data


@pytest.fixture
def ext_dir(tmp_path: Path) -> Path:
    """tmp/model/ holds the model and a 24-byte weights.bin; tmp/secret.bin lies outside it."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "weights.bin").write_bytes(np.arange(6, dtype=np.float32).tobytes())
    (d / "sub").mkdir()
    (tmp_path / "secret.bin").write_bytes(b"S" * 24)
    return d


def ext_model(d: Path, t: TensorProto) -> Path:
    return write(d / "model.onnx", add_model(t))


def test_external_data_baseline(ext_dir: Path) -> None:
    m = load(ext_model(ext_dir, external_tensor([2, 3], "weights.bin", "0", "24")))
    np.testing.assert_array_equal(
        m.graph.initializer("W").numpy(), np.arange(6, dtype=np.float32).reshape(2, 3)
    )
    assert m.graph.initializer("W").is_external


def test_external_absolute_location(ext_dir: Path) -> None:
    secret = str(ext_dir.parent / "secret.bin")
    expect_error(ext_model(ext_dir, external_tensor([2, 3], secret)), OUTSIDE + "|absolute")


@pytest.mark.parametrize(
    "location",
    ["../secret.bin", "sub/../../secret.bin", "./../secret.bin", "sub/../../model/../secret.bin"],
)
def test_external_location_escapes_with_dotdot(ext_dir: Path, location: str) -> None:
    expect_error(ext_model(ext_dir, external_tensor([2, 3], location)), OUTSIDE)


def test_external_location_symlink_to_outside_file(ext_dir: Path) -> None:
    """A symlink inside the folder that resolves outside it is refused like ../ (the check is on
    the resolved path, else any symlink planted next to a model defeats it)."""
    (ext_dir / "link.bin").symlink_to(ext_dir.parent / "secret.bin")
    expect_error(ext_model(ext_dir, external_tensor([2, 3], "link.bin")), OUTSIDE + "|symlink")


def test_external_location_through_symlinked_folder(ext_dir: Path) -> None:
    (ext_dir / "up").symlink_to(ext_dir.parent, target_is_directory=True)
    t = external_tensor([2, 3], "up/secret.bin")
    expect_error(ext_model(ext_dir, t), OUTSIDE + "|symlink")


def test_external_symlink_inside_folder_is_fine(ext_dir: Path) -> None:
    (ext_dir / "alias.bin").symlink_to("weights.bin")
    m = load(ext_model(ext_dir, external_tensor([2, 3], "alias.bin", "0", "24")))
    assert m.graph.initializer("W").numpy().shape == (2, 3)


def test_external_offset_beyond_file(ext_dir: Path) -> None:
    t = external_tensor([2, 3], "weights.bin", "100", "24")
    expect_error(ext_model(ext_dir, t), OFFSET_LENGTH)


def test_external_offset_plus_length_beyond_file(ext_dir: Path) -> None:
    t = external_tensor([2, 3], "weights.bin", "8", "24")
    expect_error(ext_model(ext_dir, t), OFFSET_LENGTH)


def test_external_offset_without_length_beyond_file(ext_dir: Path) -> None:
    t = external_tensor([2, 3], "weights.bin", "8", None)
    expect_error(ext_model(ext_dir, t), OFFSET_LENGTH + "|" + RAW_SIZE)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(str(2**63 - 1), "24"), (str(2**64 - 8), "24"), ("8", str(2**64 - 4)), ("0", str(2**40))],
    ids=["offset_int64max", "offset_wraps", "length_wraps", "length_1TiB"],
)
def test_external_offset_length_overflow(ext_dir: Path, offset: str, length: str) -> None:
    t = external_tensor([2, 3], "weights.bin", offset, length)
    expect_error(ext_model(ext_dir, t), OFFSET_LENGTH)


@pytest.mark.parametrize("length", ["20", "28", "0"])
def test_external_length_not_matching_shape(ext_dir: Path, length: str) -> None:
    (ext_dir / "weights.bin").write_bytes(bytes(64))
    t = external_tensor([2, 3], "weights.bin", "0", length)
    expect_error(ext_model(ext_dir, t), r"length|expected \d+ bytes|size")


@pytest.mark.parametrize("value", ["-8", "abc", "12abc", "", "0x10", "1e3", "8 8"])
def test_external_offset_not_a_number(ext_dir: Path, value: str) -> None:
    t = external_tensor([2, 3], "weights.bin", value, "24")
    expect_error(ext_model(ext_dir, t), r"offset")


def test_external_missing_file(ext_dir: Path) -> None:
    msg = expect_error(ext_model(ext_dir, external_tensor([2, 3], "nope.bin")), MISSING)
    assert "nope.bin" in msg


def test_external_without_location(ext_dir: Path) -> None:
    expect_error(ext_model(ext_dir, external_tensor([2, 3], None)), r"location")


def test_external_location_is_a_directory(ext_dir: Path) -> None:
    expect_error(ext_model(ext_dir, external_tensor([2, 3], "sub")), r"directory|regular file")


def test_external_location_with_nul_byte(ext_dir: Path) -> None:
    t = external_tensor([2, 3], "weights.bin\x00../../secret.bin")
    expect_error(ext_model(ext_dir, t), r"NUL|null|invalid")


def test_external_data_from_bytes_without_folder() -> None:
    """load_bytes has no model folder to resolve against: refuse rather than guess (the cwd)."""
    data = add_model(external_tensor([2, 3], "weights.bin", "0", "24")).SerializeToString()
    with pytest.raises(fastopt.ModelError, match=re.compile("external", re.IGNORECASE)):
        fastopt.load_bytes(data)


# ---------------------------------------------------------------------------------------------
# Graph structure: dangling names, cycles, subgraph scopes


def graph_model(nodes: list[onnx.NodeProto], outputs: tuple[str, ...] = ("Y",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [2]) for o in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_dangling_node_input(tmp_path: Path) -> None:
    m = graph_model([helper.make_node("Add", ["X", "nope"], ["Y"], name="add")])
    msg = expect_error(write(tmp_path / "m.onnx", m), DANGLING)
    assert "nope" in msg, f"message should name the undefined value: {msg}"


def test_dangling_graph_output(tmp_path: Path) -> None:
    m = graph_model([helper.make_node("Neg", ["X"], ["Y"])], outputs=("Y", "ghost"))
    msg = expect_error(write(tmp_path / "m.onnx", m), DANGLING)
    assert "ghost" in msg


def test_two_node_cycle(tmp_path: Path) -> None:
    m = graph_model(
        [
            helper.make_node("Add", ["X", "b"], ["a"], name="n1"),
            helper.make_node("Neg", ["a"], ["b"], name="n2"),
            helper.make_node("Identity", ["a"], ["Y"], name="n3"),
        ]
    )
    expect_error(write(tmp_path / "m.onnx", m), CYCLE)


def test_self_loop(tmp_path: Path) -> None:
    m = graph_model([helper.make_node("Add", ["X", "Y"], ["Y"], name="selfish")])
    expect_error(write(tmp_path / "m.onnx", m), CYCLE)


def test_value_defined_twice(tmp_path: Path) -> None:
    m = graph_model([helper.make_node("Neg", ["X"], ["Y"]), helper.make_node("Abs", ["X"], ["Y"])])
    expect_error(write(tmp_path / "m.onnx", m), r"more than once|duplicate|twice|already")


def if_model(then_input: str) -> onnx.ModelProto:
    branch = helper.make_graph(
        [helper.make_node("Neg", [then_input], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Abs", ["X"], ["ax"]),
            helper.make_node("If", ["c"], ["Y"], then_branch=branch, else_branch=other),
        ],
        "g",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("outer", ["X", "ax"])
def test_subgraph_reading_defined_outer_name_loads(tmp_path: Path, outer: str) -> None:
    m = load(write(tmp_path / "m.onnx", if_model(outer)))
    assert m.op_counts()["Neg"] == 1


def test_subgraph_referencing_undefined_outer_name(tmp_path: Path) -> None:
    msg = expect_error(write(tmp_path / "m.onnx", if_model("nowhere")), DANGLING)
    assert "nowhere" in msg


def test_cycle_through_subgraph_outer_reference(tmp_path: Path) -> None:
    """The If's branch reads `z`, and `z` is computed from the If's own output: a cycle that only
    shows when a subgraph's outer references count as inputs of the node that owns it."""
    m = if_model("z")
    m.graph.node.append(helper.make_node("Neg", ["Y"], ["z"]))
    expect_error(write(tmp_path / "m.onnx", m), CYCLE + "|" + DANGLING)


# ---------------------------------------------------------------------------------------------
# Names that are not UTF-8 (protobuf `string` fields). Tensor strings, STRING attributes: bytes


def neg_model(
    node_extra: bytes = b"",
    graph_extra: bytes = b"",
    model_extra: bytes = b"",
    node_input: bytes = b"X",
) -> bytes:
    node = f_len(1, node_input) + f_str(2, "Y") + f_str(4, "Neg") + node_extra
    g = f_len(1, node) + f_len(11, wire_value_info("X")) + f_len(12, wire_value_info("Y"))
    return model_from_graph(g + graph_extra) + model_extra


NOT_UTF8 = {
    "node_name": neg_model(node_extra=f_len(3, b"n\xff")),
    "dangling_input": neg_model(node_input=b"X\xff"),
    "op_type": neg_model(node_extra=f_len(4, b"N\xc3")),
    "graph_name": neg_model(graph_extra=f_len(2, b"g\x80")),
    "producer_name": neg_model(model_extra=f_len(2, b"p\xfe\xff")),
    "attribute_name": neg_model(
        node_extra=f_len(5, f_len(1, b"a\xff") + f_varint(20, 2) + f_varint(3, 1))
    ),
    "metadata_key": neg_model(model_extra=f_len(14, f_len(1, b"k\xff") + f_str(2, "v"))),
    "opset_domain": neg_model(model_extra=f_len(8, f_len(1, b"d\xff") + f_varint(2, 1))),
}


@pytest.mark.parametrize("where", list(NOT_UTF8))
def test_names_that_are_not_utf8(tmp_path: Path, where: str) -> None:
    """Refused with a ModelError naming the encoding, or loaded with every accessor working;
    never a UnicodeDecodeError from load() (e.g. while formatting the error message) or later."""
    path = write(tmp_path / "m.onnx", NOT_UTF8[where])
    try:
        m = load(path)
    except fastopt.ModelError as e:
        msg = scrub(str(e))
        assert re.search(r"utf-?8|encoding|unicode", msg, re.IGNORECASE), msg
        return
    sys.path.insert(0, str(FUZZ_DIR))
    try:
        from exercise import exercise
    finally:
        sys.path.remove(str(FUZZ_DIR))
    exercise(m, str(tmp_path))


def test_string_tensor_and_string_attribute_bytes_need_not_be_utf8(tmp_path: Path) -> None:
    t = tensor("W", TensorProto.STRING, [2])
    t.string_data.extend([b"\xff\xfe", b"ok"])
    node = helper.make_node("Identity", ["W"], ["Y"])
    node.attribute.append(helper.make_attribute("blob", b"\x80\x81"))
    graph = helper.make_graph(
        [node], "g", [], [helper.make_tensor_value_info("Y", TensorProto.STRING, [2])], [t]
    )
    m = load(write(tmp_path / "m.onnx", helper.make_model(graph)))
    assert m.graph.nodes[0].attributes["blob"] == b"\x80\x81"
    assert list(m.graph.initializer("W").strings()) == [b"\xff\xfe", b"ok"]


# ---------------------------------------------------------------------------------------------
# Not a model at all


def test_directory_as_model_path(tmp_path: Path) -> None:
    expect_error(tmp_path, r"directory|regular file")


def test_nonexistent_model_path(tmp_path: Path) -> None:
    expect_error(tmp_path / "absent.onnx", MISSING + r"|cannot open")


def test_empty_file(tmp_path: Path) -> None:
    expect_error(write(tmp_path / "m.onnx", b""), r"empty|no graph")


@pytest.mark.parametrize("size", [1, 7, 100, 4096, 100_000])
def test_random_bytes(tmp_path: Path, size: int) -> None:
    rng = random.Random(size)
    for i in range(20):
        data = bytes(rng.randrange(256) for _ in range(size))
        with pytest.raises(fastopt.ModelError) as exc:
            load(write(tmp_path / f"r{i}.onnx", data))
        assert str(exc.value).strip()


def test_other_protobuf_message_as_model(tmp_path: Path) -> None:
    """A serialized GraphProto is a well-formed protobuf, but not a ModelProto."""
    with pytest.raises(fastopt.ModelError):
        load(write(tmp_path / "g.onnx", graph_bytes(add_model())))


def test_model_without_graph(tmp_path: Path) -> None:
    expect_error(write(tmp_path / "m.onnx", f_varint(1, 10) + OPSET), r"graph")


def test_two_graph_fields_merge_like_protobuf_or_are_refused(tmp_path: Path) -> None:
    """A repeated message field merges in protobuf; a reader may do the same or refuse, but must
    never silently keep only one of the two."""
    g = add_model().graph
    a = onnx.GraphProto(name="g", node=g.node, input=g.input)
    b = onnx.GraphProto(output=g.output, initializer=g.initializer)
    data = f_varint(1, 10) + f_len(7, a.SerializeToString()) + f_len(7, b.SerializeToString())
    path = write(tmp_path / "m.onnx", data + OPSET)
    try:
        m = load(path)
    except fastopt.ModelError as e:
        assert re.search(r"graph", scrub(str(e)), re.IGNORECASE), str(e)
        return
    assert m.op_counts() == {"Add": 1}
    assert [t.name for t in m.graph.initializers] == ["W"]
    assert [v.name for v in m.graph.outputs if v is not None] == ["Y"]
    # The same graph twice merges into every name defined twice.
    twice = f_len(7, graph_bytes(add_model()))
    expect_error(
        write(tmp_path / "m2.onnx", f_varint(1, 10) + twice + twice + OPSET),
        "more than once|duplicate|twice",
    )


# ---------------------------------------------------------------------------------------------
# Crash classes, checked in a child process


MUTATE = FUZZ_DIR / "mutate_loads.py"
MUTANT_SEEDS = [
    "seed_basic.onnx",
    "seed_subgraphs.onnx",
    "seed_external.onnx",
    "seed_typed.onnx",
    "seed_attributes.onnx",
]


@pytest.mark.parametrize("seed", MUTANT_SEEDS)
def test_flipped_bytes_never_crash(tmp_path: Path, seed: str) -> None:
    """2000 seeded byte/bit flips plus every truncation: each load succeeds or raises ModelError
    (a loaded mutant must then be fully usable); never another exception, a crash or a hang."""
    put_weights_bin(tmp_path)
    model = write(tmp_path / seed, (CORPUS / seed).read_bytes())
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(MUTATE),
            str(model),
            "--flips",
            "2000",
            "--truncations",
            "all",
            "--seed",
            "1234",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    current = tmp_path / "current.txt"
    last = current.read_text() if current.exists() else "?"
    assert proc.returncode == 0, f"last mutant: {last}\n{child_report(proc)}"
    assert "findings: 0" in proc.stdout


NESTING_CHILD = """
    import sys, json
    import fastopt
    out = {}
    for path in sys.argv[1:]:
        try:
            fastopt.load(path)
            out[path] = "OK"
        except fastopt.ModelError as e:
            out[path] = "ModelError: " + str(e)[:300]
        except Exception as e:
            out[path] = type(e).__name__ + ": " + str(e)[:300]
    print(json.dumps(out))
"""


def test_deep_nesting_is_refused_not_a_stack_overflow(tmp_path: Path) -> None:
    """Recursion on attacker-controlled nesting must be bounded (a few MB of input can nest
    100k levels deep; unbounded recursive descent overflows the stack)."""
    cases = {
        "graphs": nested_graph_model(100_000),
        "graphs_moderate": nested_graph_model(2_000),
        "types": nested_type_model(100_000),
        "groups": nested_group_model(100_000),
    }
    paths = [str(write(tmp_path / f"c{i}.onnx", v)) for i, v in enumerate(cases.values())]
    proc = run_child(NESTING_CHILD, *paths, timeout=120)
    assert proc.returncode == 0, child_report(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    by_case = {k: scrub(result[p]) for k, p in zip(cases, paths)}
    for k in ("graphs", "graphs_moderate", "groups"):
        assert by_case[k].startswith("ModelError"), f"{k}: {by_case[k]}"
        assert any(w in by_case[k].lower() for w in ("nest", "deep", "depth", "recurs", "group")), (
            by_case[k]
        )
    # A deeply nested type: either a bounded decode (ModelError) or kept as opaque bytes (OK).
    assert by_case["types"] == "OK" or by_case["types"].startswith("ModelError"), by_case["types"]


ALLOC_CHILD = """
    import json, resource, sys, time
    import numpy, onnx  # imported before the limit: they map a lot of address space
    import fastopt

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize")

    # Allow 768 MiB more than we use now: any case that sizes an allocation by an untrusted
    # length (1 GiB .. exabytes) fails with MemoryError (std::bad_alloc) instead of passing.
    limit = vm_bytes() + (768 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    out = {}
    for path in sys.argv[1:]:
        t0 = time.monotonic()
        try:
            m = fastopt.load(path)
            for t in m.graph.initializers:
                t.numpy()
            out[path] = "OK"
        except fastopt.ModelError as e:
            out[path] = "ModelError: " + str(e)[:200]
        except BaseException as e:
            out[path] = type(e).__name__ + ": " + str(e)[:200]
        out[path] += " [%.2fs]" % (time.monotonic() - t0)
    print(json.dumps(out))
"""


def test_untrusted_sizes_never_drive_allocations(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "weights.bin").write_bytes(bytes(24))

    def typed(dtype: int, dims: list[int], field: str, values: list[object]) -> TensorProto:
        t = tensor("W", dtype, dims)
        getattr(t, field).extend(values)
        return t

    big_float_claim = (
        f_str(8, "W")
        + f_varint(1, 6)
        + f_varint(2, 1)
        + key(4, LEN_WT)
        + varint(1 << 30)
        + bytes(8)
    )
    cases: dict[str, bytes] = {
        "dims_4TiB_raw_4B": add_model(tensor("W", 1, [2**20, 2**20], bytes(4))).SerializeToString(),
        "dims_1GiB_no_data": add_model(tensor("W", 1, [2**28])).SerializeToString(),
        "int64_2GiB_one_value": add_model(typed(7, [2**28], "int64_data", [1])).SerializeToString(),
        "float_1GiB_two_values": add_model(
            typed(1, [2**28], "float_data", [1.0, 2.0])
        ).SerializeToString(),
        "string_2^28_one_value": add_model(
            typed(8, [2**28], "string_data", [b"a"])
        ).SerializeToString(),
        "double_1PiB_one_value": add_model(
            typed(11, [2**47], "double_data", [1.0])
        ).SerializeToString(),
        "external_length_1TiB": add_model(
            external_tensor([2**38], "weights.bin", "0", str(2**40))
        ).SerializeToString(),
        "external_1GiB_exact_shape": add_model(
            external_tensor([2**28], "weights.bin", "0", str(2**30))
        ).SerializeToString(),
        "external_1GiB_no_length": add_model(
            external_tensor([2**28], "weights.bin", "0", None)
        ).SerializeToString(),
        "packed_float_claims_1GiB": model_from_graph(
            f_len(1, wire_node("Identity", ["W"], ["Y"])) + f_len(5, big_float_claim)
        ),
    }
    paths = [str(write(d / f"c{i}.onnx", v)) for i, v in enumerate(cases.values())]
    proc = run_child(ALLOC_CHILD, *paths, timeout=120)
    assert proc.returncode == 0, child_report(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {k: result[p] for k, p in zip(cases, paths) if not result[p].startswith("ModelError")}
    assert not bad, f"expected ModelError for each: {json.dumps(bad, indent=1)}"


# ---------------------------------------------------------------------------------------------
# Saving: never touches the input, atomic


def digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def listing(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


@pytest.fixture
def external_model(tmp_path: Path) -> Path:
    """src/model.onnx with its two initializers in src/model.onnx.data, mtimes in the past."""
    src = tmp_path / "src"
    src.mkdir()
    w = numpy_helper.from_array(np.arange(4096, dtype=np.float32).reshape(64, 64), "W")
    b = numpy_helper.from_array(np.arange(64, dtype=np.float32), "B")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "B"], ["Y"]),
        ],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 64])],
        [w, b],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save_model(
        m,
        str(src / "model.onnx"),
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    past = 1_600_000_000
    for p in src.iterdir():
        os.utime(p, (past, past))
    return src / "model.onnx"


def test_load_and_save_never_touch_the_input(tmp_path: Path, external_model: Path) -> None:
    src = external_model.parent
    before = {p.name: digest(p) for p in src.iterdir()}
    m = load(external_model)
    assert m.graph.initializer("W").is_external
    m.graph.initializer("W").numpy().sum()
    out = tmp_path / "out"
    out.mkdir()
    m.save(str(out / "inline.onnx"), external_data=False)
    m.save(str(out / "ext.onnx"), external_data=True, size_threshold=0)
    m.save(str(out / "ext_aligned.onnx"), external_data=True, size_threshold=0, align=4096)
    after = {p.name: digest(p) for p in src.iterdir()}
    assert after == before
    # And the copies are right.
    for name in ("inline.onnx", "ext.onnx", "ext_aligned.onnx"):
        ref = onnx.load(str(out / name))
        w = next(t for t in ref.graph.initializer if t.name == "W")
        want = np.arange(4096, dtype=np.float32).reshape(64, 64)
        np.testing.assert_array_equal(numpy_helper.to_array(w), want)
    assert sorted(listing(out)) == sorted(
        ["inline.onnx", "ext.onnx", "ext.onnx.data", "ext_aligned.onnx", "ext_aligned.onnx.data"]
    ), "save left extra files (temporaries?)"


SAVE_OVER_SELF_CHILD = """
    import sys
    import numpy as np
    import fastopt
    path = sys.argv[1]
    want = np.arange(4096, dtype=np.float32).reshape(64, 64)
    for external in (True, False):
        m = fastopt.load(path)
        w = m.graph.initializer("W").numpy()  # a view into the mapped input
        try:
            m.save(path, external_data=external, size_threshold=0)
        except fastopt.ModelError as e:
            assert "own file" in str(e), e
        else:
            raise AssertionError("saving over the input was not refused")
        np.testing.assert_array_equal(w, want)
        del m, w
    print("ok")
"""


def test_save_over_its_own_input_is_refused(external_model: Path) -> None:
    """Saving onto the path a model was loaded from (weights still mapped from it, data file of
    the same name) is refused, and writes nothing."""
    before = {p.name: digest(p) for p in external_model.parent.iterdir()}
    proc = run_child(SAVE_OVER_SELF_CHILD, str(external_model), timeout=120)
    assert proc.returncode == 0, child_report(proc)
    assert {p.name: digest(p) for p in external_model.parent.iterdir()} == before


def test_failed_save_onto_a_directory_leaves_nothing(tmp_path: Path, external_model: Path) -> None:
    m = load(external_model)
    out = tmp_path / "out"
    (out / "target.onnx").mkdir(parents=True)
    (out / "target.onnx" / "keep").write_bytes(b"x")
    before = listing(out)
    for external in (False, True):
        with pytest.raises(fastopt.ModelError):
            m.save(str(out / "target.onnx"), external_data=external, size_threshold=0)
        leftovers = listing(out) - before
        assert not leftovers, f"failed save left files behind: {leftovers}"


def test_save_into_missing_folder_creates_it(tmp_path: Path, external_model: Path) -> None:
    m = load(external_model)
    m.save(str(tmp_path / "no" / "such" / "dir" / "m.onnx"))
    assert load(tmp_path / "no" / "such" / "dir" / "m.onnx").graph.initializer("W") is not None


SAVE_FSIZE_CHILD = """
    import os, resource, signal, sys
    import fastopt
    src, out_dir, external = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    m = fastopt.load(src)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        m.save(os.path.join(out_dir, "target.onnx"), external_data=external, size_threshold=0)
    except fastopt.ModelError as e:
        print("ModelError:", e)
    except BaseException as e:
        print("OTHER", type(e).__name__, e)
    else:
        print("SAVED")
"""


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
def test_failed_write_leaves_no_temp_file_and_old_target_intact(
    tmp_path: Path, external_model: Path, external: bool
) -> None:
    """The write fails midway (file size limit, EFBIG, as a full disk would): the error is a
    ModelError, no temporary file remains, and the files previously at the target are intact."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "target.onnx").write_bytes(b"previous model")
    (out / "target.onnx.data").write_bytes(b"previous data")
    before = {p.name: digest(p) for p in out.iterdir()}
    src_before = {p.name: digest(p) for p in external_model.parent.iterdir()}
    proc = run_child(SAVE_FSIZE_CHILD, str(external_model), str(out), "1" if external else "0")
    assert proc.returncode == 0, child_report(proc)
    assert proc.stdout.startswith("ModelError"), proc.stdout + proc.stderr
    assert {p.name: digest(p) for p in out.iterdir()} == before
    assert {p.name: digest(p) for p in external_model.parent.iterdir()} == src_before
