"""Scale: models with very many initializers or external data files.

eliminate_dead_nodes removed dead initializers one by one, each removal a scan of the list:
quadratic (100k took 7.7 s, 1M did not finish in 600 s). A FileBuffer kept its descriptor for
its lifetime, so a model with more external data files than the descriptor limit failed with
"Too many open files" where onnx and ONNX Runtime load it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt import _C
from onnx import TensorProto, helper, numpy_helper
from support.wire import f_len, f_str, f_varint


def dead_initializers_model(n: int) -> bytes:
    """Y = Identity(X) and `n` float scalars nothing reads, as bytes (written field by field:
    onnx.helper takes seconds for a million tensors)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])],
    )
    raw = np.float32(1.5).tobytes()
    inits = b"".join(
        f_len(5, f_varint(2, TensorProto.FLOAT) + f_str(8, f"dead{i}") + f_len(9, raw))
        for i in range(n)
    )
    model = helper.make_model(
        helper.make_graph([], "", [], []), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ClearField("graph")
    return model.SerializeToString() + f_len(7, graph.SerializeToString() + inits)


def dead_initializer_seconds(n: int) -> float:
    model = fastopt.load_bytes(dead_initializers_model(n))
    assert len(model.graph.initializers) == n
    start = time.perf_counter()
    rewrites, _ = _C.run_pass(model, "eliminate_dead_nodes")
    seconds = time.perf_counter() - start
    assert rewrites == n and model.graph.initializers == []
    return seconds


def test_dead_initializers_removed_in_linear_time() -> None:
    """200k dead initializers: 29 s before (quadratic; 81 s on a loaded 2-core machine), 0.2 s
    now; 3 s is generous for a loaded machine and far below the quadratic time."""
    seconds = dead_initializer_seconds(200_000)
    assert seconds < 3, f"eliminate_dead_nodes took {seconds:.1f} s for 200k dead initializers"


@pytest.mark.slow
def test_a_million_dead_initializers() -> None:
    seconds = dead_initializer_seconds(1_000_000)
    assert seconds < 30, f"eliminate_dead_nodes took {seconds:.1f} s for 1M dead initializers"


# ---------------------------------------------------------------------------------------------
# Many external data files under a small descriptor limit

FILES = 3000

MANY_FILES_CHILD = """
    import json, os, resource, sys
    import fastopt
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    src, out = sys.argv[1], sys.argv[2]
    m = fastopt.load(src)
    report = fastopt.optimize(m, preset="cleanup", output=out, external_data=True)
    m2 = fastopt.load(out)  # the output loads too, its one data file opened on demand
    print(json.dumps({
        "files": len(m.external_data_files()),
        "initializers": len(m2.graph.initializers),
        "open_fds_below_bound": len(os.listdir("/proc/self/fd")) <= 64 + 16,
    }))
"""


def many_files_model(folder: Path, files: int = FILES) -> tuple[Path, np.ndarray]:
    """Y = X + w0 + ... + w{files-1} (Sum), each w a float[4] in its own data file."""
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal(4).astype(np.float32) for _ in range(files)]
    graph = helper.make_graph(
        [helper.make_node("Sum", ["X"] + [f"w{i}" for i in range(files)], ["Y"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(ws)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder.mkdir()
    for i, t in enumerate(model.graph.initializer):
        (folder / f"w{i}.bin").write_bytes(t.raw_data)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=f"w{i}.bin")
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))
    return path, np.sum(ws, axis=0)


def run_child(code: str, src: Path, out: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter (its own descriptor limit), argv SRC OUT; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_ort(path: Path, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"X": x})[0]


def test_thousands_of_external_files_under_a_small_descriptor_limit(tmp_path: Path) -> None:
    """3,000 external data files, RLIMIT_NOFILE 256: load, optimize and save (one data file),
    then ORT runs the output as it runs the original."""
    src, total = many_files_model(tmp_path / "src")
    out = tmp_path / "out" / "model.onnx"
    proc = run_child(MANY_FILES_CHILD, src, out, timeout=300)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"files": FILES, "initializers": FILES, "open_fds_below_bound": True}, got
    x = np.arange(4, dtype=np.float32)
    want = run_ort(src, x)
    np.testing.assert_allclose(want, x + total, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(run_ort(out, x), want)


REPLACED_CHILD = """
    import resource, os, sys
    import fastopt
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # 16 pooled descriptors
    src, out = sys.argv[1], sys.argv[2]
    m = fastopt.load(src)
    for t in m.graph.initializers:
        t.numpy()  # maps every file; w0's descriptor is closed long before the last
    new = os.path.join(os.path.dirname(src), "new.bin")
    with open(new, "wb") as f:
        f.write(b"\\0" * 16)
    os.replace(new, os.path.join(os.path.dirname(src), "w0.bin"))
    try:
        m.save(out, external_data=True)
    except fastopt.ModelError as e:
        print(e)
"""


def test_a_data_file_replaced_after_its_descriptor_closed(tmp_path: Path) -> None:
    """Opened again, a data file must be the one loaded (device and inode): one replaced under
    its name is a ModelError, never its new bytes saved as the tensor's."""
    src, _ = many_files_model(tmp_path / "src", files=40)
    out = tmp_path / "out" / "model.onnx"
    proc = run_child(REPLACED_CHILD, src, out, timeout=120)
    assert "w0.bin' is another file than the one loaded" in proc.stdout, proc.stdout
    assert not out.exists()
