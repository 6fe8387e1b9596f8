"""A self-contained quantized output written once: the quantization passes lay out their file as
the start of a model file (room for the graph's tag and length, then each tensor after room for
its initializer's framing: proto/output_files.h AdoptableFile::Slot), and a self-contained save
into that folder takes it as the model file, writes the framing into the room and appends the
rest of the model (proto/onnx_writer.cc write_in_place). The output holds the same model as the
copying save's, field for field; only the order differs (the graph field first, the quantized
initializers first in it, the graph's length as a 5-byte varint)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from support.paths import TESTS

FIXTURES = TESTS / "fixtures" / "models"
QWEN = FIXTURES / "qwen2_ts_float32" / "model.onnx"
IO = Path("/proc/self/io")

MODES = [
    pytest.param({"mode": "int4"}, id="int4"),
    pytest.param({"mode": "int4", "symmetric": False, "block_size": 16}, id="int4-asym"),
    pytest.param({"mode": "int8"}, id="int8"),
    pytest.param({"mode": "int4", "target": "onnx"}, id="int4-qdq"),
    pytest.param({"mode": "int8-dynamic"}, id="int8-dynamic"),
    pytest.param({"mode": "fp16"}, id="fp16"),
    pytest.param({"mode": "bf16"}, id="bf16"),
]


def _written() -> int:
    """Bytes this process has passed to write, pwrite and copy_file_range so far."""
    for line in IO.read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def _quantized_bytes(model: fastopt.Model) -> int:
    """Bytes of the initializers the quantization passes wrote (quantized or converted)."""
    return sum(
        t.nbytes
        for t in model.graph.initializers
        if t.name.endswith(("_Q4", "_Q8", "_scales", "_zero_points", "_quantized"))
        or "_DQ_" in t.name
        or t.dtype in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    )


def _same_model(a_path: Path, b_path: Path) -> None:
    """The two files hold the same ModelProto: equal once a's initializers are put in b's order."""
    a, b = onnx.load(str(a_path)), onnx.load(str(b_path))
    by_name = {t.name: t for t in a.graph.initializer}
    assert sorted(by_name) == sorted(t.name for t in b.graph.initializer)
    ordered = [by_name[t.name] for t in b.graph.initializer]
    del a.graph.initializer[:]
    a.graph.initializer.extend(ordered)
    assert a.SerializeToString() == b.SerializeToString()


def _run(path: Path) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, fastopt.make_inputs(str(path), seed=0))


@pytest.mark.skipif(not IO.exists(), reason="needs /proc/self/io")
@pytest.mark.parametrize("settings", MODES)
def test_self_contained_output_written_once(tmp_path: Path, settings: dict) -> None:
    out = tmp_path / "once" / "model.onnx"
    out.parent.mkdir()
    before = _written()
    r = fastopt.quantize(QWEN, out, **settings)
    written = _written() - before
    assert r.model is not None and r.summary.quantized > 0
    quantized = _quantized_bytes(r.model)
    assert quantized > 50_000
    # One file, nothing beside it, and every byte of it written once: quantized bytes by the
    # pass, the rest by the save (a copy of the quantized bytes would add `quantized` again).
    assert os.listdir(out.parent) == ["model.onnx"]
    size = out.stat().st_size
    assert size <= written < size + 4096
    # The copying save of the same model (another folder): the same model, the same results.
    copied = tmp_path / "copied" / "model.onnx"
    before = _written()
    r.model.save(str(copied), False)
    assert _written() - before >= copied.stat().st_size > quantized
    _same_model(out, copied)
    onnx.checker.check_model(str(out))
    if settings["mode"] != "bf16":  # (ORT's CPU provider lacks bf16 kernels for these ops)
        for x, y in zip(_run(out), _run(copied)):
            np.testing.assert_array_equal(x, y)
    # fastopt reads it back with the same tensors.
    back = {t.name: bytes(t.raw_bytes()) for t in fastopt.load(str(out)).graph.initializers}
    for t in r.model.graph.initializers:
        assert back[t.name] == bytes(t.raw_bytes()), t.name


@pytest.mark.skipif(not IO.exists(), reason="needs /proc/self/io")
def test_without_unnamed_files_the_save_copies(tmp_path: Path) -> None:
    # Where the filesystem has no unnamed files (simulated), the quantized bytes wait in an
    # unlinked temporary and the save copies them: the write count shows the second write, so
    # the count above would catch a copy.
    out = tmp_path / "model.onnx"
    code = (
        "import sys, fastopt; from pathlib import Path; "
        "io = lambda: int(next(l for l in Path('/proc/self/io').read_text().splitlines() "
        "if l.startswith('wchar:')).split()[1]); "
        "b = io(); r = fastopt.quantize(sys.argv[1], sys.argv[2], mode='int4'); "
        "print(io() - b)"
    )
    env = {**os.environ, "FASTOPT_TEST_NAMED_TEMPS": "1"}
    p = subprocess.run(
        [sys.executable, "-c", code, str(QWEN), str(out)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    written = int(p.stdout.split()[-1])
    quantized = _quantized_bytes(fastopt.load(str(out)))
    assert written >= out.stat().st_size + quantized
    assert os.listdir(tmp_path) == ["model.onnx"]
    once = tmp_path / "once" / "model.onnx"
    fastopt.quantize(QWEN, once, mode="int4")
    _same_model(once, out)


def _child_quantize(out: Path, env: dict[str, str], fsize: int = 0) -> subprocess.CompletedProcess:
    code = (
        "import resource, signal, sys, fastopt\n"
        "if int(sys.argv[3]):\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]),) * 2)\n"
        "fastopt.quantize(sys.argv[1], sys.argv[2], mode='int4')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(QWEN), str(out), str(fsize)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )


def test_failed_save_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    reference = tmp_path / "ref" / "model.onnx"
    fastopt.quantize(QWEN, reference, mode="int4")
    size = reference.stat().st_size
    quantized = _quantized_bytes(fastopt.load(str(reference)))
    # Files may grow to hold the quantized bytes but not the whole model: the pass succeeds and
    # the save fails appending the rest of the model to the file it took.
    limit = (quantized + size) // 2
    assert quantized + 4096 < limit < size
    p = _child_quantize(out, {}, fsize=limit)
    assert p.returncode != 0 and "File too large" in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == ["ref"]
    # Killed after the file is complete and fsynced, before it is named: nothing is left.
    p = _child_quantize(out, {"FASTOPT_TEST_KILL_AT_STEP": "1"})
    assert p.returncode == -9
    assert sorted(os.listdir(tmp_path)) == ["ref"]
    # Killed once it is named: the model is complete.
    p = _child_quantize(out, {"FASTOPT_TEST_KILL_AT_STEP": "3"})
    assert p.returncode == -9
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "ref"]
    _same_model(out, reference)


def test_a_failed_save_leaves_the_file_for_the_next(tmp_path: Path) -> None:
    # A save that cannot finish (the output is a folder: refused before anything is written,
    # and a name already taken by another program at the end) leaves the quantized file to a
    # later save, which takes it.
    settings = fastopt.QuantSettings(mode="int4", tmpdir=str(tmp_path))
    r = fastopt.optimize(str(QWEN), passes=[], quantize=settings)
    (tmp_path / "dir.onnx").mkdir()
    with pytest.raises(fastopt.ModelError):
        r.model.save(str(tmp_path / "dir.onnx"), None)
    before = _written() if IO.exists() else 0
    out = tmp_path / "model.onnx"
    r.model.save(str(out), None)
    if IO.exists():
        assert _written() - before < out.stat().st_size - _quantized_bytes(r.model) + 4096
    # A second self-contained save copies (the file is the first output's now), unchanged.
    second = tmp_path / "second.onnx"
    digest = out.read_bytes()
    r.model.save(str(second), None)
    assert out.read_bytes() == digest
    _same_model(out, second)


def test_renamed_tensor_falls_back_to_copying(tmp_path: Path) -> None:
    # A quantized initializer renamed after the pass no longer fits the room reserved for its
    # framing: the save copies, and the output is the same model.
    settings = fastopt.QuantSettings(mode="int4", tmpdir=str(tmp_path))
    r = fastopt.optimize(str(QWEN), passes=[], quantize=settings)
    q = next(t for t in r.model.graph.initializers if t.name.endswith("_Q4"))
    r.model.graph.value(q.name).rename(q.name + "_renamed_after_the_pass")
    out = tmp_path / "model.onnx"
    before = _written() if IO.exists() else 0
    r.model.save(str(out), None)
    if IO.exists():
        assert _written() - before >= out.stat().st_size
    assert out.read_bytes()[:1] == b"\x08"  # the writer's order: ir_version first
    _run(out)


@pytest.mark.slow
def test_output_over_2gb_still_goes_to_external_data(tmp_path: Path) -> None:
    # A 2.2 GB float table (kept: embeddings are not quantized by default) and one quantized
    # MatMul: the output cannot be one file, so the default save writes external data and takes
    # the quantized file as its data file, as before.
    vocab, hidden = 1 << 20, 528  # 2.2 GB of float32, zeros (a sparse file)
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    w = np.random.default_rng(0).standard_normal((hidden, 256)).astype(np.float32)
    with open(str(src) + ".data", "wb") as f:
        f.write(w.tobytes())
        f.truncate(w.nbytes + vocab * hidden * 4)
    table = onnx.TensorProto(name="table", data_type=onnx.TensorProto.FLOAT, dims=[vocab, hidden])
    weight = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[hidden, 256])
    for t, offset, length in ((weight, 0, w.nbytes), (table, w.nbytes, vocab * hidden * 4)):
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", src.name + ".data"), ("offset", str(offset)),
                           ("length", str(length))):  # fmt: skip
            t.external_data.add(key=key, value=value)
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gather", ["table", "ids"], ["h"], name="embed"),
            onnx.helper.make_node("MatMul", ["h", "w"], ["y"], name="proj"),
        ],
        "big",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 256])],
        [table, weight],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    src.write_bytes(model.SerializeToString())

    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()  # (the pass writes into the output's folder when it exists)
    r = fastopt.quantize(src, out, mode="int4")
    assert r.summary.quantized == 1
    data = Path(str(out) + ".data")
    assert sorted(os.listdir(out.parent)) == ["model.onnx", "model.onnx.data"]
    assert out.stat().st_size < 1 << 20 and data.stat().st_size > vocab * hidden * 4
    m = onnx.load(str(out), load_external_data=False)
    where = {
        t.name: int({e.key: e.value for e in t.external_data}["offset"])
        for t in m.graph.initializer
        if t.external_data
    }
    # The quantized bytes first, where the pass wrote them (the file was taken); the table after.
    assert 0 < where["w_Q4"] < 128 and where["table"] > where["w_Q4"]
    got = {t.name: t for t in fastopt.load(str(out)).graph.initializers}
    assert bytes(got["w_Q4"].raw_bytes()) == bytes(
        next(t for t in r.model.graph.initializers if t.name == "w_Q4").raw_bytes()
    )
