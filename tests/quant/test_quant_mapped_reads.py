"""The quantizers read weights in place from the model's mapping (csrc/quant/weight_source.h):
the same bytes as onnxruntime whether a weight is read in place (external data, aligned) or
copied out (inline raw data at an odd offset, or a model made in memory), the pages a weight was
read from leave the process's mapping once it is quantized (resident memory stays a few MB
whatever the model weighs), and `import fastopt` loads none of numpy / onnx / onnxruntime."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic
from support.mapping_rss import quantize_rss_file
from support.quant_reference import ort_quantize

logging.getLogger().setLevel(logging.ERROR)  # quantize_dynamic's "run pre-processing" warning

# 12 MB of float32: over the int8 mapped budget's share with 16 threads (8 MB), under it with 1.
K, N = 768, 4096


def _model(k: int = K, n: int = N) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    w[5, 7] = 0.9  # an outlier: the per-tensor int8 scale comes from it
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same model three ways: inline raw data (copied out where it is not 4-byte aligned),
    external data aligned to pages (read in place), and its weight's expected bytes."""
    d = tmp_path_factory.mktemp("mapped")
    inline = d / "inline.onnx"
    onnx.save(_model(), inline)
    external = d / "external" / "model.onnx"
    fastopt.load(str(inline)).save(str(external), external_data=True, align=4096)
    return {"inline": inline, "external": external}


def _weight(path: Path) -> np.ndarray:
    return next(t.numpy() for t in fastopt.load(str(path)).graph.initializers if t.name == "w")


def test_in_memory_weights_survive_quantizing(sources: dict[str, Path]) -> None:
    """Pages are released only from file mappings: on a model made in memory (from_onnx) a
    release would zero the weight's bytes under every view of them."""
    want = _weight(sources["inline"]).copy()
    for mode in ("int4", "int8-dynamic", "fp16"):
        model = fastopt.from_onnx(onnx.load(str(sources["inline"])))
        view = next(t.numpy() for t in model.graph.initializers if t.name == "w")
        fastopt.quantize(model, mode=mode)
        assert np.array_equal(view, want), mode


@pytest.mark.parametrize("form", ["inline", "external", "memory"])
@pytest.mark.parametrize("threads", [1, 16])
def test_int4_bytes_equal_onnxruntime(sources: dict[str, Path], form: str, threads: int) -> None:
    src = sources["inline" if form == "memory" else form]
    model = fastopt.from_onnx(onnx.load(str(src))) if form == "memory" else str(src)
    r = fastopt.quantize(model, mode="int4", threads=threads, method="rtn")
    assert r.model is not None
    node = next(n for n in r.model.graph.nodes if n.op_type == "MatMulNBits")
    ref_b, ref_s, _ = ort_quantize(_weight(sources["inline"]), 4, 32, True)
    assert np.array_equal(node.inputs[1].initializer.numpy(), ref_b)
    assert np.array_equal(node.inputs[2].initializer.numpy().view(np.uint8), ref_s.view(np.uint8))


@pytest.fixture(scope="module")
def int8_reference(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ort") / "q.onnx"
    quantize_dynamic(str(sources["inline"]), str(out), weight_type=QuantType.QInt8)
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}


@pytest.mark.parametrize("form", ["inline", "external", "memory"])
@pytest.mark.parametrize("threads", [1, 16])  # the weight read once, or twice in tiles
def test_int8_dynamic_bytes_equal_onnxruntime(
    sources: dict[str, Path], int8_reference: dict, form: str, threads: int
) -> None:
    src = sources["inline" if form == "memory" else form]
    model = fastopt.from_onnx(onnx.load(str(src))) if form == "memory" else str(src)
    r = fastopt.quantize(model, mode="int8-dynamic", threads=threads)
    assert r.model is not None
    got = {t.name: t.numpy() for t in r.model.graph.initializers}
    for name in ("w_quantized", "w_scale"):
        assert got[name].tobytes() == int8_reference[name].tobytes(), name
    assert not int8_reference["w_zero_point"].any() and "w_zero_point" not in got


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize(
    "mode,threads", [("int4", 2), ("int8", 2), ("int8-dynamic", 1), ("int8-dynamic", 16)]
)
def test_read_pages_leave_the_mapping(sources: dict[str, Path], mode: str, threads: int) -> None:
    """A 12 MB weight read from the mapping: without the releases its pages stay resident in
    the process (RssFile grows by the weight's size); with them a few fault-around windows at
    most remain."""
    rss = quantize_rss_file(sources["external"], mode, threads)
    grown = rss["after"] - rss["before"]
    assert grown < 2 << 20, f"{mode}: {grown} bytes of the 12 MB weight stayed mapped"


def test_import_fastopt_loads_no_heavy_modules() -> None:
    """numpy alone took 0.1-0.2 s of every fastopt process; quantize never needs it."""
    code = (
        "import sys, fastopt; "
        "print([m for m in ('numpy', 'onnx', 'onnxruntime') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
