"""External data: reading the layouts exporters write, and every way fastopt writes it.

Input layouts (all valid ONNX): one data file, one file per tensor (some without offset/length),
one file with unaligned offsets, gaps and tensors out of order, 4096-aligned offsets, and what
`onnx.save_model(save_as_external_data=True, convert_attribute=True)` writes.
The input always lives in `tmp/in/`, the output in `tmp/out/`; after saving, the input folder is
renamed away so the output can only work if it stands on its own.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import pytest
from conftest import (
    assert_outputs_identical,
    assert_proto_equal,
    run_ort,
    tensor_protos,
    without_weights,
)
from onnx import TensorProto, external_data_helper, helper, numpy_helper

_rng = np.random.default_rng(7)
ARRAYS: dict[str, np.ndarray] = {
    "w_f32": _rng.standard_normal((64, 64)).astype(np.float32),  # 16 KiB
    "w_i64": _rng.integers(-(2**40), 2**40, 300),
    "w_f16": _rng.standard_normal((40, 40)).astype(np.float16),
    "w_u8": _rng.integers(0, 256, 5000, dtype=np.uint8),
    "w_bool": _rng.random(2000) < 0.5,
    "small": np.array([1.0, -2.0, 3.0], np.float32),  # below every threshold: always inline
}
CONST = np.linspace(-1, 1, 1024, dtype=np.float32)  # a Constant node's tensor attribute, 4 KiB
EXTERNAL = [n for n in ARRAYS if n != "small"]
LAYOUTS = ["one_file", "many_files", "offsets", "aligned", "onnx_saved"]
FEEDS = {"X": _rng.standard_normal((64, 64)).astype(np.float32)}


def _model() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["X", "w_f32"], ["Y"], name="add"),
        helper.make_node(
            "Constant",
            [],
            ["const_out"],
            name="const",
            value=numpy_helper.from_array(CONST, "const"),
        ),
    ]
    nodes += [helper.make_node("Identity", [n], [f"{n}_out"], name=f"id_{n}") for n in ARRAYS]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [64, 64])]
    outputs += [
        helper.make_tensor_value_info(f"{n}_out", helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in ARRAYS.items()
    ]
    outputs.append(helper.make_tensor_value_info("const_out", TensorProto.FLOAT, [1024]))
    graph = helper.make_graph(
        nodes,
        "ext",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [64, 64])],
        outputs,
        [numpy_helper.from_array(a, n) for n, a in ARRAYS.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def write_layout(folder: Path, layout: str) -> Path:
    """Write the test model into `folder` with the weights stored as `layout` says."""
    folder.mkdir(parents=True)
    model, path = _model(), folder / "model.onnx"
    if layout == "onnx_saved":
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx.data",
            size_threshold=1024,
            convert_attribute=True,
        )
        return path
    rng = np.random.default_rng(3)
    files: dict[str, bytearray] = {}
    by_name = {t.name: t for t in model.graph.initializer}
    for i, name in enumerate(EXTERNAL[::-1] if layout == "offsets" else EXTERNAL):
        t = by_name[name]
        location = f"data/{name}.bin" if layout == "many_files" else "weights.bin"
        buf = files.setdefault(location, bytearray())
        if layout == "offsets":
            buf += rng.bytes(int(rng.integers(1, 100)))  # junk between tensors
        elif layout == "aligned":
            buf += bytes(-len(buf) % 4096)
        offset, length = len(buf), len(t.raw_data)
        buf += t.raw_data
        if layout == "many_files" and i % 2:  # no offset / length: the whole file
            external_data_helper.set_external_data(t, location)
        else:
            external_data_helper.set_external_data(t, location, offset=offset, length=length)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
    for location, data in files.items():
        if layout == "offsets":
            data += b"trailing junk"
        (folder / location).parent.mkdir(parents=True, exist_ok=True)
        (folder / location).write_bytes(bytes(data))
    path.write_bytes(model.SerializeToString())
    return path


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in tensor_protos(model.graph)}


def external_tensors(model: onnx.ModelProto) -> dict[str, dict[str, str]]:
    return {
        t.name: {e.key: e.value for e in t.external_data}
        for t in tensor_protos(model.graph)
        if t.data_location == TensorProto.EXTERNAL
    }


def assert_expected_values(model: onnx.ModelProto) -> None:
    got = values(model)
    assert sorted(got) == sorted([*ARRAYS, "const"])
    for name, expected in [*ARRAYS.items(), ("const", CONST)]:
        assert got[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(got[name], expected, strict=True, err_msg=name)


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def src(tmp_path: Path, layout: str) -> Path:
    return write_layout(tmp_path / "in", layout)


def test_layouts_are_valid_onnx(src: Path) -> None:
    onnx.checker.check_model(str(src), full_check=True)
    assert_expected_values(onnx.load(str(src)))
    run_ort(src, FEEDS)


def test_load_external_views(src: Path, layout: str) -> None:
    before = digest(src.parent)
    m = fastopt.load(str(src))
    expected_files = {
        str(p.resolve()) for p in src.parent.rglob("*") if p.is_file() and p.name != "model.onnx"
    }
    assert {str(Path(f).resolve()) for f in m.external_data_files()} == expected_files
    assert all(os.path.isabs(f) for f in m.external_data_files())
    for name, expected in ARRAYS.items():
        t = m.graph.initializer(name)
        assert t is not None and t.name == name
        assert t.is_external == (name != "small"), name
        assert t.dtype == helper.np_dtype_to_tensor_dtype(expected.dtype)
        assert tuple(t.shape) == expected.shape
        assert t.nbytes == expected.nbytes
        arr = t.numpy()
        np.testing.assert_array_equal(arr, expected, strict=True)
        # zero copy: a read-only view of the mapped bytes (raw_data or external file)
        assert not arr.flags.owndata, name
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr[...] = 0
    const = next(n for n in m.graph.nodes if n.op_type == "Constant").attributes["value"]
    assert const.is_external == (layout == "onnx_saved")
    np.testing.assert_array_equal(const.numpy(), CONST, strict=True)
    assert digest(src.parent) == before


def _check_output(out: Path, src: Path, expected_ort: list[Any]) -> onnx.ModelProto:
    """The saved model equals the input up to where the bytes live, and runs the same."""
    shutil.move(src.parent, src.parent.with_name("moved_away"))  # the output must not need it
    saved = onnx.load(str(out))
    assert_expected_values(saved)
    original = onnx.load(str(src.parent.with_name("moved_away") / src.name))
    assert_proto_equal(without_weights(original), without_weights(saved))
    assert_outputs_identical(expected_ort, run_ort(out, FEEDS))
    reloaded = fastopt.load(str(out))
    for name in ARRAYS:
        np.testing.assert_array_equal(reloaded.graph.initializer(name).numpy(), ARRAYS[name])
    for info in external_tensors(onnx.load(str(out), load_external_data=False)).values():
        location = Path(info["location"])
        assert not location.is_absolute() and ".." not in location.parts
        assert (out.parent / location).is_file()
    return onnx.load(str(out), load_external_data=False)


@pytest.mark.parametrize("external_data", [None, False])
def test_save_self_contained(src: Path, tmp_path: Path, external_data: bool | None) -> None:
    before, expected_ort = digest(src.parent), run_ort(src, FEEDS)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.onnx"
    m = fastopt.load(str(src))
    m.save(str(out), external_data=external_data)
    assert digest(src.parent) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx"]
    saved = _check_output(out, src, expected_ort)
    assert external_tensors(saved) == {}
    assert fastopt.load(str(out)).external_data_files() == []


SAVE_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "location": {"location": "weights.custom"},
    "align": {"align": 4096},
    "threshold0": {"size_threshold": 0},
    "split": {"max_file_bytes": 20_000},
    "split_aligned": {"max_file_bytes": 20_000, "align": 64},
}


@pytest.mark.parametrize("variant", list(SAVE_VARIANTS))
def test_save_external(src: Path, tmp_path: Path, variant: str) -> None:
    kwargs = SAVE_VARIANTS[variant]
    before, expected_ort = digest(src.parent), run_ort(src, FEEDS)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.onnx"
    m = fastopt.load(str(src))
    m.save(str(out), external_data=True, **kwargs)
    assert digest(src.parent) == before

    written = {p.name for p in out.parent.iterdir()}
    saved = _check_output(out, src, expected_ort)
    ext = external_tensors(saved)
    threshold = kwargs.get("size_threshold", 1024)
    big = {n for n, a in [*ARRAYS.items(), ("const", CONST)] if a.nbytes >= threshold}
    assert "small" not in big or threshold == 0
    # Whether a Constant's tensor attribute goes external is the writer's choice; initializers
    # at or over size_threshold must, the others must stay inline.
    assert set(ext) - {"const"} == big - {"const"}
    locations = {info["location"] for info in ext.values()}
    assert written == {"model.onnx", *locations}, "no temp or stray files"
    if "max_file_bytes" in kwargs:
        assert len(locations) >= 2
        assert all((out.parent / f).stat().st_size <= kwargs["max_file_bytes"] for f in locations)
    else:
        assert locations == {kwargs.get("location", "model.onnx.data")}
    for info in ext.values():
        assert int(info.get("offset", 0)) % max(kwargs.get("align", 1), 1) == 0
    reloaded = fastopt.load(str(out))
    assert {Path(f).name for f in reloaded.external_data_files()} == locations
    assert all(reloaded.graph.initializer(n).is_external == (n in big) for n in ARRAYS)


def test_save_to_nested_directory_then_delete_input(tmp_path: Path) -> None:
    src = write_layout(tmp_path / "in", "one_file")
    expected_ort = run_ort(src, FEEDS)
    m = fastopt.load(str(src))
    out = tmp_path / "a" / "b" / "model.onnx"
    out.parent.mkdir(parents=True)
    m.save(str(out), external_data=True)
    shutil.rmtree(tmp_path / "in")
    assert_expected_values(onnx.load(str(out)))
    assert_outputs_identical(expected_ort, run_ort(out, FEEDS))
    # The loaded model still reads the (now unlinked) input through its mapping.
    np.testing.assert_array_equal(m.graph.initializer("w_f32").numpy(), ARRAYS["w_f32"])


# --- saving over the input itself -----------------------------------------------------------------

_OVERWRITE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import fastopt

    path, external = sys.argv[1], sys.argv[2] == "1"
    m = fastopt.load(path)
    views = {t.name: t.numpy() for t in m.graph.initializers}
    copies = {name: np.array(v) for name, v in views.items()}
    try:
        m.save(path, external_data=external)
    except fastopt.ModelError as e:
        assert "loaded model's own file" in str(e), e
    else:
        raise AssertionError("saving over the input was not refused")
    # Nothing was written: the views still read the input's bytes.
    for name, v in views.items():
        np.testing.assert_array_equal(v, copies[name])
    for t in fastopt.load(path).graph.initializers:
        np.testing.assert_array_equal(t.numpy(), copies[t.name])
    print("ok")
""")


@pytest.mark.parametrize(
    ("layout_name", "external"),
    [("inline", False), ("onnx_saved", True), ("onnx_saved", False), ("one_file", True)],
)
def test_save_over_input(tmp_path: Path, layout_name: str, external: bool) -> None:
    """Saving onto the input is refused and writes nothing (a child process: writing over a
    mapped file in place would crash with SIGBUS)."""
    folder = tmp_path / "m"
    if layout_name == "inline":
        folder.mkdir()
        src = folder / "model.onnx"
        onnx.save_model(_model(), str(src))
    else:
        src = write_layout(folder, layout_name)
    expected_ort = run_ort(src, FEEDS)
    before = digest(folder)
    proc = subprocess.run(
        [sys.executable, "-c", _OVERWRITE_SCRIPT, str(src), str(int(external))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert digest(folder) == before
    assert_expected_values(onnx.load(str(src)))
    assert_outputs_identical(expected_ort, run_ort(src, FEEDS))


# --- failures leave nothing behind ----------------------------------------------------------------


@pytest.fixture
def loaded(tmp_path: Path) -> Any:
    return fastopt.load(str(write_layout(tmp_path / "in", "one_file")))


@pytest.mark.parametrize("external_data", [False, True])
def test_save_into_missing_directory_creates_it(
    loaded: Any, tmp_path: Path, external_data: bool
) -> None:
    out = tmp_path / "missing" / "deeper" / "out.onnx"
    loaded.save(str(out), external_data=external_data)
    assert_expected_values(onnx.load(str(out)))


@pytest.mark.parametrize("external_data", [False, True])
def test_save_onto_directory_fails_cleanly(
    loaded: Any, tmp_path: Path, external_data: bool
) -> None:
    out_dir = tmp_path / "out"
    (out_dir / "model.onnx").mkdir(parents=True)  # the target path is a directory
    with pytest.raises((fastopt.ModelError, OSError)):
        loaded.save(str(out_dir / "model.onnx"), external_data=external_data)
    assert [p.name for p in out_dir.iterdir()] == ["model.onnx"]
    assert list((out_dir / "model.onnx").iterdir()) == []


def test_save_with_blocked_data_file_fails_cleanly(loaded: Any, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    (out_dir / "model.onnx.data").mkdir(parents=True)  # the data file cannot be created
    with pytest.raises((fastopt.ModelError, OSError)):
        loaded.save(str(out_dir / "model.onnx"), external_data=True)
    assert [p.name for p in out_dir.iterdir()] == ["model.onnx.data"], "no model without its data"
    assert list((out_dir / "model.onnx.data").iterdir()) == []


# --- bad external data references -----------------------------------------------------------------


def _corrupt(tmp_path: Path, **changes: str) -> Path:
    src = write_layout(tmp_path / "in", "one_file")
    model = onnx.load(str(src), load_external_data=False)
    t = next(t for t in model.graph.initializer if t.name == "w_f32")
    for entry in t.external_data:
        if entry.key in changes:
            entry.value = changes.pop(entry.key)
    for key, value in changes.items():
        t.external_data.add(key=key, value=value)
    src.write_bytes(model.SerializeToString())
    return src


@pytest.mark.parametrize(
    "changes",
    [
        {"location": "does_not_exist.bin"},
        {"location": "../outside.bin"},
        {"location": "/etc/passwd"},
        {"offset": str(10**9)},
        {"length": "8"},
        {"length": str(10**6)},
        {"offset": "-4"},
    ],
    ids=[
        "missing_file",
        "escapes_dir",
        "absolute",
        "offset_past_end",
        "short_length",
        "long_length",
        "negative_offset",
    ],
)
def test_bad_external_reference_raises(tmp_path: Path, changes: dict[str, str]) -> None:
    (tmp_path / "outside.bin").write_bytes(bytes(64 * 64 * 4))
    src = _corrupt(tmp_path, **changes)
    with pytest.raises(fastopt.ModelError):
        fastopt.load(str(src))


# --- external data inside subgraphs ---------------------------------------------------------------


def _subgraph_model() -> onnx.ModelProto:
    """If whose then branch holds a Constant with a 4 KiB tensor and whose else branch holds its own
    initializers (one raw, one in float_data); the main graph holds one more."""
    n, vi = 1024, helper.make_tensor_value_info
    c_then = numpy_helper.from_array(np.linspace(0, 1, n, dtype=np.float32), "c_then")
    then_g = helper.make_graph(
        [
            helper.make_node("Constant", [], ["ct"], name="then_const", value=c_then),
            helper.make_node("Add", ["X", "ct"], ["t"], name="then_add"),
        ],
        "then",
        [],
        [vi("t", TensorProto.FLOAT, [n])],
    )
    else_g = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "w_else"], ["e0"], name="else_mul"),
            helper.make_node("Add", ["e0", "w_typed"], ["e"], name="else_add"),
        ],
        "else",
        [],
        [vi("e", TensorProto.FLOAT, [n])],
        [
            numpy_helper.from_array(np.full(n, 3, np.float32), "w_else"),
            helper.make_tensor("w_typed", TensorProto.FLOAT, [n], np.arange(n, dtype=np.float32)),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["X", "w_main"], ["d"], name="sub"),
            helper.make_node("ReduceSum", ["d"], ["s"], name="sum", keepdims=0),
            helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
            helper.make_node("If", ["c"], ["Y"], name="if", then_branch=then_g, else_branch=else_g),
        ],
        "sub_ext",
        [vi("X", TensorProto.FLOAT, [n])],
        [vi("Y", TensorProto.FLOAT, [n])],
        [
            numpy_helper.from_array(np.ones(n, np.float32), "w_main"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("external_data", [False, True])
def test_external_data_in_subgraphs(tmp_path: Path, external_data: bool) -> None:
    model = _subgraph_model()
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "model.onnx"
    expected_values = values(model)
    copy = onnx.ModelProto.FromString(model.SerializeToString())  # save_model converts in place
    onnx.save_model(
        copy,
        str(src),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=1024,
        convert_attribute=True,
    )
    rng = np.random.default_rng(1)
    feeds = [{"X": (rng.standard_normal(1024) + shift).astype(np.float32)} for shift in (-5, 5)]
    expected_ort = [run_ort(src, f) for f in feeds]

    m = fastopt.load(str(src))
    if_node = next(n for n in m.graph.nodes if n.op_type == "If")
    branches = {g.name: g for g in if_node.subgraphs}
    assert branches["else"].initializer("w_else").is_external
    assert not branches["else"].initializer("w_typed").is_external
    const = branches["then"].nodes[0].attributes["value"]
    assert const.is_external
    np.testing.assert_array_equal(const.numpy(), expected_values["c_then"], strict=True)
    for g in branches.values():
        for t in g.initializers:
            np.testing.assert_array_equal(t.numpy(), expected_values[t.name], strict=True)

    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "model.onnx"
    m.save(str(out), external_data=external_data)
    shutil.move(tmp_path / "in", tmp_path / "moved_away")
    saved = onnx.load(str(out))
    got = values(saved)
    assert sorted(got) == sorted(expected_values)
    for name, value in expected_values.items():
        np.testing.assert_array_equal(got[name], value, strict=True, err_msg=name)
    assert_proto_equal(without_weights(model), without_weights(saved))
    ext = external_tensors(onnx.load(str(out), load_external_data=False))
    assert ("w_else" in ext and "w_main" in ext) == external_data and (external_data or not ext)
    assert {p.name for p in out.parent.iterdir()} == {
        "model.onnx",
        *(info["location"] for info in ext.values()),
    }
    for f, expected in zip(feeds, expected_ort):
        assert_outputs_identical(expected, run_ort(out, f))


def test_from_onnx_with_base_dir_and_to_onnx_inlines(src: Path) -> None:
    """from_onnx(proto, base_dir) resolves external data; to_onnx() inlines it."""
    proto = onnx.load(str(src), load_external_data=False)
    m = fastopt.from_onnx(proto, base_dir=str(src.parent))
    for name, expected in ARRAYS.items():
        t = m.graph.initializer(name)
        assert t.is_external == (name != "small")
        np.testing.assert_array_equal(t.numpy(), expected, strict=True)
    for model in (m.to_onnx(), fastopt.load(str(src)).to_onnx()):
        assert external_tensors(model) == {}
        assert_expected_values(model)
        assert_proto_equal(without_weights(onnx.load(str(src))), without_weights(model))


def test_symlinked_model_reads_data_beside_the_link(tmp_path: Path) -> None:
    """External data is relative to the folder of the path given (as onnx.load and ONNX Runtime
    resolve it), not to the folder a symlinked model file points into."""
    src = write_layout(tmp_path / "build", "onnx_saved")
    (tmp_path / "snap").mkdir()
    shutil.move(src.with_name("model.onnx.data"), tmp_path / "snap" / "model.onnx.data")
    link = tmp_path / "snap" / "model.onnx"
    link.symlink_to(src)
    assert_expected_values(onnx.load(str(link)))
    expected_ort = run_ort(link, FEEDS)
    m = fastopt.load(str(link))
    np.testing.assert_array_equal(m.graph.initializer("w_f32").numpy(), ARRAYS["w_f32"])
    out = tmp_path / "out.onnx"
    m.save(str(out))
    assert_outputs_identical(expected_ort, run_ort(out, FEEDS))


@pytest.mark.parametrize("external_data", [False, True])
def test_saved_files_get_default_permissions(
    loaded: Any, tmp_path: Path, external_data: bool
) -> None:
    """Temp files start as 0600; saved files must end up as a plain open() would make them."""
    umask = os.umask(0)
    os.umask(umask)
    out = tmp_path / "model.onnx"
    loaded.save(str(out), external_data=external_data)
    for f in [out, *([out.with_name("model.onnx.data")] if external_data else [])]:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name


def test_views_outlive_the_model(src: Path) -> None:
    """Arrays, values and nodes keep their mapping alive after the Model object is gone."""
    arrays = {name: fastopt.load(str(src)).graph.initializer(name).numpy() for name in ARRAYS}
    g = fastopt.load(str(src)).graph
    const = next(n for n in g.nodes if n.op_type == "Constant").attributes["value"].numpy()
    value, nodes = g.value("w_f32"), g.nodes
    del g
    gc.collect()
    churn = [np.ones(1 << 16) for _ in range(64)]  # reuse freed memory, if any was freed
    for name, expected in ARRAYS.items():
        np.testing.assert_array_equal(arrays[name], expected, strict=True)
    np.testing.assert_array_equal(const, CONST, strict=True)
    assert value.uses[0][0].op_type == "Add" and nodes[0].inputs[0].name == "X"
    del churn


def test_typed_field_tensors_move_to_external_data(tmp_path: Path) -> None:
    """A big tensor stored in float_data goes to the data file like raw_data does (decoded to
    little-endian bytes), so a model over 2 GB holding such tensors can still be written."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 400], [0.25] * 1200)
    small = helper.make_tensor("b", TensorProto.FLOAT, [2], [1.0, 2.0])
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 400])],
        [w, small],
    )
    m = fastopt.from_onnx(helper.make_model(g))
    out = tmp_path / "m.onnx"
    m.save(str(out), external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    saved = onnx.load(str(out), load_external_data=False)
    big, tiny = saved.graph.initializer
    assert big.data_location == TensorProto.EXTERNAL and not big.float_data
    assert tiny.data_location == TensorProto.DEFAULT and list(tiny.float_data) == [1.0, 2.0]
    loaded = onnx.load(str(out))
    np.testing.assert_array_equal(
        numpy_helper.to_array(loaded.graph.initializer[0]), np.full((3, 400), 0.25, np.float32)
    )


def _striped(n: int, seed: int) -> np.ndarray:
    """n float32 values that differ in every 4 KiB page (a misplaced chunk cannot compare equal)."""
    return (np.arange(n, dtype=np.float64) * 0.25 + seed * 1e6).astype(np.float32)


@pytest.mark.parametrize("fsync", [True, False])
@pytest.mark.parametrize("source", ["file", "memory"])
def test_save_streams_tensors_across_writeback_chunks(
    tmp_path: Path, source: str, fsync: bool
) -> None:
    """The save hands its output to writeback in 32 MiB chunks as it appends (output_files.cc:
    copy_file_range and write at most a chunk per call). Tensors larger than a chunk, at odd
    offsets in the input and in the output, from a file (copied in the kernel) or from memory
    (written), come out byte for byte; with fsync=False too (no writeback, no fsync)."""
    sizes = {"big_a": 11_000_003, "big_b": 9_000_001, "tail": 257}  # 44 + 36 MB + 1 KiB
    arrays = {name: _striped(n, k) for k, (name, n) in enumerate(sizes.items())}
    nodes = [helper.make_node("Identity", [n], [f"out_{n}"], name=f"id_{n}") for n in sizes]
    graph = helper.make_graph(
        nodes,
        "striped",
        [],
        [
            helper.make_tensor_value_info(f"out_{n}", TensorProto.FLOAT, [k])
            for n, k in sizes.items()
        ],
        [numpy_helper.from_array(a, n) for n, a in arrays.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if source == "file":
        (tmp_path / "in").mkdir()
        src = tmp_path / "in" / "model.onnx"
        # An odd first offset: the input's tensors do not start on a page.
        onnx.save_model(proto, str(src), save_as_external_data=True, size_threshold=0)
        m = fastopt.load(str(src))
        assert all(m.graph.initializer(n).is_external for n in sizes)
    else:
        m = fastopt.from_onnx(proto)
    out = tmp_path / "out" / "model.onnx"
    m.save(str(out), external_data=True, size_threshold=2048, fsync=fsync)  # "tail" stays inline
    data = out.parent / "model.onnx.data"
    assert data.stat().st_size == sum(a.nbytes for n, a in arrays.items() if n != "tail")
    saved = onnx.load(str(out))
    for t in saved.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), arrays[t.name], strict=True)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_fsync_false_makes_no_sync_calls(tmp_path: Path) -> None:
    """The default save fsyncs each file and hands its chunks to writeback; fsync=False makes
    neither call (counted by strace in a child process)."""
    data = np.arange(9_000_000, dtype=np.float32)  # 36 MB: more than one writeback chunk
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [data.size])],
        [numpy_helper.from_array(data, "w")],
    )
    src = tmp_path / "in.onnx"
    onnx.save_model(helper.make_model(graph), str(src), save_as_external_data=True)
    counts = {}
    for fsync in (True, False):
        out = tmp_path / f"out_{fsync}" / "model.onnx"
        code = (
            "import fastopt, sys; "
            f"fastopt.load(sys.argv[1]).save(sys.argv[2], external_data=True, fsync={fsync})"
        )
        done = subprocess.run(
            [
                "strace",
                "-f",
                "-qq",
                "-e",
                "trace=fsync,sync_file_range",
                "-o",
                str(tmp_path / f"trace_{fsync}"),
                sys.executable,
                "-c",
                code,
                str(src),
                str(out),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 and "ptrace" in done.stderr:
            pytest.skip("strace cannot trace here: " + done.stderr.strip())
        assert done.returncode == 0, done.stderr
        counts[fsync] = (tmp_path / f"trace_{fsync}").read_text().count("(")
        assert np.array_equal(numpy_helper.to_array(onnx.load(str(out)).graph.initializer[0]), data)
    assert counts[True] >= 3 and counts[False] == 0, counts  # 2 files + their folder; chunks
