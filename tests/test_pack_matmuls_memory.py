"""pack_matmuls' packed weights are made when read (csrc/ir/column_concat.h): optimize + save of a
model whose packed weights total 48 MB raises the process's peak resident memory by far less
than that (the save streams them from the sources' files in 4 MB blocks; before, the pass held
the packed copy and the mapped sources' pages: ~2x the packed bytes). The output is exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

K, N = 1024, 4096  # three [K, N] fp32 weights sharing their input: 48 MB packed

# VmHWM, not ru_maxrss: exec keeps the parent's ru_maxrss (pytest's, with the weights in it).
_CHILD = """
import json, sys, fastopt
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
m = fastopt.load(sys.argv[1])
before = peak()
r = fastopt.optimize(m, passes=["pack_matmuls"], options={"pack_matmuls": 1})
r.model.save(sys.argv[2], external_data=True)
print(json.dumps({"growth": peak() - before, "ops": r.ops_after}))
"""


def _model(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    ws = {f"w{i}": rng.standard_normal((K, N), dtype=np.float32) for i in range(3)}
    nodes = [
        helper.make_node("MatMul", ["x", w], [f"y{i}"], name=f"mm{i}") for i, w in enumerate(ws)
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["batch", N]) for i in range(3)],
        [numpy_helper.from_array(w, n) for n, w in ws.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data")
    return ws


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_packed_weights_are_streamed_not_held(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    src, out = tmp_path / "in" / "model.onnx", tmp_path / "out" / "model.onnx"
    ws = _model(src)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["ops"].get("MatMul") == 1 and got["ops"].get("Split") == 1, got["ops"]
    packed = 3 * K * N * 4
    assert got["growth"] < packed // 3, f"peak RSS grew {got['growth'] >> 20} MB"

    saved = onnx.load(str(out))
    (weight,) = [t for t in saved.graph.initializer if tuple(t.dims) == (K, 3 * N)]
    np.testing.assert_array_equal(
        numpy_helper.to_array(weight), np.concatenate(list(ws.values()), 1)
    )
    x = np.random.default_rng(4).standard_normal((2, K), dtype=np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    have = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    for a, b in zip(want, have):
        np.testing.assert_array_equal(a, b)
