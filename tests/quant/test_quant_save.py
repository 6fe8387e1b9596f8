"""Quantized weights written once: a save with external data into the folder the quantized
bytes were written in takes their file as its data file (proto/output_files.h AdoptableFile)
instead of copying them; every other save copies. Both give the same tensors, and the same
outputs in ONNX Runtime. Also the packing paths of quant/pack.cc on matrices wider than a column
chunk (256) with a tail that is not a multiple of 16, byte for byte against onnxruntime."""

from __future__ import annotations

import hashlib
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
from support.quant_models import _matmul_model
from support.quant_reference import ort_quantize

FIXTURES = TESTS / "fixtures" / "models"
QWEN = FIXTURES / "qwen2_ts_float32" / "model.onnx"  # weights inline in the model file
QUANT_SUFFIXES = ("_Q4", "_scales")


def _layout(path: Path) -> list[tuple[int, int, str]]:
    """(offset, length, name) of each external tensor of the model at `path`, by offset."""
    m = onnx.load(str(path), load_external_data=False)
    rows = []
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if ext:
            assert ext["location"] == path.name + ".data"
            rows.append((int(ext["offset"]), int(ext["length"]), t.name))
    return sorted(rows)


def _tensors(path: Path) -> dict[str, bytes]:
    return {t.name: bytes(t.numpy().data) for t in fastopt.load(str(path)).graph.initializers}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(path: Path) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = fastopt.make_inputs(str(path), seed=0)
    return sess.run(None, feeds)


def _quantize_in_child(src: Path, dst: Path, env: dict[str, str]) -> None:
    code = (
        "import sys, fastopt; "
        "fastopt.quantize(sys.argv[1], sys.argv[2], mode='int4', external_data=True)"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(src), str(dst)], check=True, env={**os.environ, **env}
    )


def test_external_save_takes_the_quantized_file(tmp_path: Path) -> None:
    taken = tmp_path / "taken" / "model.onnx"
    taken.parent.mkdir()
    r = fastopt.quantize(QWEN, taken, mode="int4", external_data=True)
    layout = _layout(taken)
    quantized = [row for row in layout if row[2].endswith(QUANT_SUFFIXES)]
    assert len(quantized) == 2 * r.summary.quantized > 0
    # The quantized bytes are where the pass wrote them: first, in its order, each after the
    # few bytes of room it left for a self-contained save's framing (AdoptableFile::Slot); the
    # save appended the float tensors after them.
    assert layout[: len(quantized)] == quantized and 0 < quantized[0][0] < 128
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(quantized, quantized[1:])]
    assert all(0 < gap < 128 for gap in gaps)
    # Without unnamed files the quantized bytes wait in an unlinked temporary and are copied:
    # the layout is the writer's, the tensors and the results the same.
    copied = tmp_path / "copied" / "model.onnx"
    copied.parent.mkdir()
    _quantize_in_child(QWEN, copied, {"FASTOPT_TEST_NAMED_TEMPS": "1"})
    assert _layout(copied) != layout
    assert _tensors(copied) == _tensors(taken)
    for a, b in zip(_run(taken), _run(copied)):
        np.testing.assert_array_equal(a, b)
    onnx.checker.check_model(str(taken))


def test_file_taken_once_later_saves_copy(tmp_path: Path) -> None:
    first = tmp_path / "model.onnx"
    r = fastopt.quantize(QWEN, first, mode="int4", external_data=True)
    assert r.model is not None
    digest = _sha(Path(str(first) + ".data"))
    want = _tensors(first)
    # Another save into the same folder must not take (and append to) the first output's data.
    second = tmp_path / "second.onnx"
    r.model.save(str(second), True)
    assert _sha(Path(str(first) + ".data")) == digest
    assert _tensors(second) == want
    # Saving over the first output: its data file is replaced, the bytes come from the model.
    r.model.save(str(first), True)
    assert _tensors(first) == want
    for a, b in zip(_run(first), _run(second)):
        np.testing.assert_array_equal(a, b)


def test_self_contained_and_other_folder_saves_copy(tmp_path: Path) -> None:
    out = tmp_path / "a" / "model.onnx"
    out.parent.mkdir()
    r = fastopt.quantize(QWEN, out, mode="int4")  # under 2 GB: one file
    assert not Path(str(out) + ".data").exists()
    assert r.model is not None
    elsewhere = tmp_path / "b" / "model.onnx"
    r.model.save(str(elsewhere), True)  # not the folder the quantized bytes are in
    assert _tensors(elsewhere) == _tensors(out)
    # The model in memory still reads its quantized tensors after the saves.
    q = next(t for t in r.model.graph.initializers if t.name.endswith("_Q4"))
    assert bytes(q.numpy().data) == _tensors(out)[q.name]


def test_aligned_save_copies_what_is_not_aligned(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    fastopt.quantize(QWEN, out, mode="int4", external_data=True)
    # Quantized bytes in this folder, saved here with a 4096-byte alignment: none of them is at
    # a multiple of 4096 (each follows its framing room), so the file is not taken (its bytes
    # would all be dead) and every tensor is copied to an aligned offset.
    settings = fastopt.QuantSettings(mode="int4", tmpdir=str(tmp_path))
    r = fastopt.optimize(str(QWEN), passes=[], quantize=settings)
    aligned = tmp_path / "aligned.onnx"
    r.model.save(str(aligned), True, align=4096)
    layout = _layout(aligned)
    assert layout[0][0] == 0 and not layout[0][2].endswith("_Q4")  # the writer's order
    assert all(off % 4096 == 0 for off, _, _ in layout)
    assert _tensors(aligned) == _tensors(out)
    # Unaligned, the same file is taken: the quantized bytes stay where they are.
    unaligned = tmp_path / "unaligned.onnx"
    r.model.save(str(unaligned), True)
    assert _layout(unaligned)[0][2].endswith("_Q4")


@pytest.mark.parametrize("k", [64, 100])
@pytest.mark.parametrize(
    "bits,bs,sym", [(4, 16, True), (4, 32, False), (8, 32, True), (4, 128, True), (8, 16, False)]
)
def test_wide_weights_bytes_equal_onnxruntime(
    tmp_path: Path, k: int, bits: int, bs: int, sym: bool
) -> None:
    # N = 300: one full 256-column chunk, a chunk of 44 (two 16-column transposes and 12 columns
    # by the scalar path); K = 100 ends in a partial block.
    src = tmp_path / "m.onnx"
    onnx.save(_matmul_model(k, 300), src)
    w = onnx.numpy_helper.to_array(onnx.load(str(src)).graph.initializer[0])
    ref_b, ref_s, ref_z = ort_quantize(np.ascontiguousarray(w), bits, bs, sym)
    for threads in (1, 2):
        r = fastopt.quantize(
            src, mode=f"int{bits}", block_size=bs, symmetric=sym, threads=threads, method="rtn"
        )
        assert r.model is not None
        node = next(n for n in r.model.graph.nodes if n.op_type == "MatMulNBits")
        assert np.array_equal(node.inputs[1].initializer.numpy(), ref_b)
        assert np.array_equal(
            node.inputs[2].initializer.numpy().view(np.uint8), ref_s.view(np.uint8)
        )
        if not sym:
            assert ref_z is not None
            assert np.array_equal(node.inputs[3].initializer.numpy(), ref_z)


def _big_weight(k: int, r0: int, r1: int, cols: int) -> np.ndarray:
    """Rows r0..r1 of weight k: cheap to make again for any slice, different everywhere."""
    r = np.arange(r0, r1, dtype=np.float32)[:, None]
    c = np.arange(cols, dtype=np.float32)[None, :]
    return (np.sin(r * 0.37 + c * 0.11 + k) * 0.05).astype(np.float32)


@pytest.mark.slow
def test_over_2gb_input_quantized_into_the_taken_file(tmp_path: Path) -> None:
    # Two MatMuls, 2.28 GB of fp32 weights in a data file; int4 with external data: the output's
    # data file is the file the pass wrote, its bytes onnxruntime's (checked on column slices:
    # MatMulNBits quantizes each column on its own) and the model runs in ONNX Runtime.
    k, n = 16384, 17408
    shapes = {"w0": (k, n), "w1": (n, k)}
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    inits, offset = [], 0
    with open(str(src) + ".data", "wb") as f:
        for i, (name, (rows, cols)) in enumerate(shapes.items()):
            for r0 in range(0, rows, 2048):
                f.write(_big_weight(i, r0, min(rows, r0 + 2048), cols).tobytes())
            t = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=[rows, cols])
            t.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", src.name + ".data"), ("offset", str(offset)),
                               ("length", str(rows * cols * 4))):  # fmt: skip
                t.external_data.add(key=key, value=value)
            inits.append(t)
            offset += rows * cols * 4
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("MatMul", ["x", "w0"], ["h"], name="up"),
            onnx.helper.make_node("MatMul", ["h", "w1"], ["y"], name="down"),
        ],
        "big",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, k])],
        inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    src.write_bytes(model.SerializeToString())

    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    r = fastopt.quantize(src, out, mode="int4", external_data=True)
    assert r.summary.quantized == 2
    layout = _layout(out)
    assert 0 < layout[0][0] < 128 and all(row[2].endswith(QUANT_SUFFIXES) for row in layout)
    q = {t.name: t.numpy() for t in fastopt.load(str(out)).graph.initializers}
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        w = _big_weight(i, 0, rows, cols)
        for c0, c1 in ((0, 48), (cols - 40, cols)):
            ref_b, ref_s, _ = ort_quantize(np.ascontiguousarray(w[:, c0:c1]), 4, 32, True)
            assert np.array_equal(q[name + "_Q4"][c0:c1], ref_b), name
            assert np.array_equal(
                q[name + "_scales"].reshape(cols, -1)[c0:c1].ravel(), ref_s.ravel()
            )
        del w
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    ref = x @ _big_weight(0, 0, k, n) @ _big_weight(1, 0, n, k)
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"x": x})
    cos = float((ref.ravel() @ got.ravel()) / (np.linalg.norm(ref) * np.linalg.norm(got)))
    # int4 RTN of these weights through two 16k-wide layers measures 0.962 (accuracy level 4
    # also rounds the activations to int8); misplaced blocks or columns give about 0.
    assert cos > 0.9


def test_optimize_with_quantize_writes_next_to_its_output(tmp_path: Path) -> None:
    # fastopt.optimize(..., output=, quantize=) puts the quantized bytes in the output's folder
    # (not $TMPDIR), so its external-data save takes them as they are, like fastopt.quant.quantize.
    from fastopt.quant.settings import QuantSettings

    out = tmp_path / "model.onnx"
    r = fastopt.optimize(
        QWEN, preset="llm", output=out, external_data=True, quantize=QuantSettings(mode="int4")
    )
    layout = _layout(out)
    quantized = [row for row in layout if row[2].endswith(QUANT_SUFFIXES)]
    assert quantized and 0 < quantized[0][0] < 128 and layout[: len(quantized)] == quantized
    assert len(quantized) == 2 * sum(1 for w in r.quantization if w.action == "quantized")
    _run(out)
