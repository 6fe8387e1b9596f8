"""More than 2 GB of initializers (opt-in: `pytest -m slow`).

The models are written without ever holding the weights in a protobuf object: the weights are
streamed to disk in chunks with numpy, and the one single-file model is assembled from protobuf
wire format by hand (protobuf itself refuses messages over 2 GB, which is the point).
ONNX Runtime only ever runs Gather on the big weights, so its memory use stays modest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import fastopt
import numpy as np
import onnx
import pytest
from conftest import assert_outputs_identical, run_ort
from onnx import TensorProto, helper
from support.wire import varint

pytestmark = pytest.mark.slow

COLS = 256
CHUNK_ROWS = 1 << 16  # 64 MiB per write
TWO_GIB = 1 << 31


def rows(k: int, r0: int, r1: int) -> np.ndarray:
    """Rows r0..r1 of weight k: exact in float32, different in every tensor, row and column."""
    r = (np.arange(r0, r1) % 8191).astype(np.float32)
    return r[:, None] * 0.5 + np.float32(k * 10000) + np.arange(COLS, dtype=np.float32) / 256


def write_rows(f: BinaryIO, k: int, n_rows: int) -> None:
    for r0 in range(0, n_rows, CHUNK_ROWS):
        f.write(rows(k, r0, min(r0 + CHUNK_ROWS, n_rows)).tobytes())


def gather_model(weights: dict[str, int]) -> onnx.ModelProto:
    """Y_k = Gather(W_k, idx) for each weight W_k of shape [n_rows, COLS]; no initializers yet."""
    graph = helper.make_graph(
        [helper.make_node("Gather", [w, "idx"], [f"Y_{w}"], name=f"gather_{w}") for w in weights],
        "big",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info(f"Y_{w}", TensorProto.FLOAT, [None, COLS]) for w in weights],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def feeds(weights: dict[str, int]) -> dict[str, np.ndarray]:
    """Rows 0, 1, 8190, 8191, 123457 and the last row of the shortest weight."""
    return {"idx": np.array([0, 1, 8190, 8191, 123_457, min(weights.values()) - 1], np.int64)}


def expected_outputs(weights: dict[str, int]) -> list[np.ndarray]:
    idx = feeds(weights)["idx"]
    return [np.concatenate([rows(k, int(i), int(i) + 1) for i in idx]) for k in range(len(weights))]


def weight_proto(name: str, n_rows: int) -> TensorProto:
    return TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[n_rows, COLS])


@pytest.fixture
def big_dir(tmp_path: Path) -> Iterator[Path]:
    """A scratch folder that is really deleted afterwards (pytest keeps old tmp_paths around)."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def check_load_memory(path: Path, limit_bytes: int) -> dict[str, Any]:
    """Load in a child process; the weights must stay on disk (peak RSS far below their size)."""
    script = textwrap.dedent("""
        import json, resource, sys
        import fastopt
        m = fastopt.load(sys.argv[1])
        t = m.graph.initializers[-1]
        a = t.numpy()
        first, last = float(a.reshape(-1)[0]), float(a.reshape(-1)[-1])
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        nbytes = sum(t.nbytes for t in m.graph.initializers)
        print(json.dumps({"rss": rss, "bytes": nbytes, "first": first, "last": last,
                          "owndata": bool(a.flags.owndata)}))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["rss"] < limit_bytes, f"peak RSS {info['rss'] / 2**20:.0f} MiB"
    assert not info["owndata"]
    return info


def check_saved_external(m: Any, out_dir: Path, weights: dict[str, int]) -> None:
    """Default save of > 2 GB: external data chosen automatically; forced self-contained: error."""
    out_dir.mkdir()
    out = out_dir / "model.onnx"
    m.save(str(out))
    assert out.stat().st_size < 1 << 20, "the weights went into the data file"
    saved = onnx.load(str(out), load_external_data=False)
    ext = [t for t in saved.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert [t.name for t in ext] == list(weights)
    for t in ext:
        info = {e.key: e.value for e in t.external_data}
        assert (out_dir / info["location"]).is_file()
    files = {(out_dir / e.value).name for t in ext for e in t.external_data if e.key == "location"}
    assert {p.name for p in out_dir.iterdir()} == {"model.onnx", *files}, "no temp files"
    total = sum(n * COLS * 4 for n in weights.values())
    assert sum((out_dir / f).stat().st_size for f in files) >= total
    assert_outputs_identical(expected_outputs(weights), run_ort(out, feeds(weights)))
    reloaded = fastopt.load(str(out))
    assert sum(t.nbytes for t in reloaded.graph.initializers) == total
    for k, (name, n_rows) in enumerate(weights.items()):
        arr = reloaded.graph.initializer(name).numpy()
        assert arr.shape == (n_rows, COLS)
        np.testing.assert_array_equal(arr[-3:], rows(k, n_rows - 3, n_rows))
    del reloaded

    forced = out_dir.with_name("forced")
    forced.mkdir()
    with pytest.raises(fastopt.ModelError, match=r"2\s*G"):
        m.save(str(forced / "model.onnx"), external_data=False)
    assert list(forced.iterdir()) == [], "a failed save leaves nothing behind"


def test_external_data_over_2gb(big_dir: Path) -> None:
    # Three ~800 MB weights in one data file; a hole before the last pushes its offset past 4 GiB.
    weights = {"W0": 781_250, "W1": 781_250, "W2": 781_250}
    src_dir = big_dir / "in"
    src_dir.mkdir()
    model = gather_model(weights)
    with open(src_dir / "weights.bin", "wb") as f:
        for k, (name, n_rows) in enumerate(weights.items()):
            if k == 2:
                f.seek((5 << 30) - 3)  # sparse hole; odd offset on purpose
            offset = f.tell()
            write_rows(f, k, n_rows)
            t = weight_proto(name, n_rows)
            t.data_location = TensorProto.EXTERNAL
            for key, value in [
                ("location", "weights.bin"),
                ("offset", offset),
                ("length", n_rows * COLS * 4),
            ]:
                t.external_data.add(key=key, value=str(value))
            model.graph.initializer.append(t)
    src = src_dir / "model.onnx"
    src.write_bytes(model.SerializeToString())
    stat_before = (src_dir / "weights.bin").stat()

    assert_outputs_identical(expected_outputs(weights), run_ort(src, feeds(weights)))
    total = sum(n * COLS * 4 for n in weights.values())
    assert total > TWO_GIB
    info = check_load_memory(src, limit_bytes=800 << 20)
    assert info["bytes"] == total
    assert info["first"] == float(rows(2, 0, 1)[0, 0])

    m = fastopt.load(str(src))
    assert all(t.is_external for t in m.graph.initializers)
    assert [os.path.realpath(p) for p in m.external_data_files()] == [
        os.path.realpath(src_dir / "weights.bin")
    ]
    check_saved_external(m, big_dir / "out", weights)
    after = (src_dir / "weights.bin").stat()
    assert (after.st_size, after.st_mtime_ns) == (stat_before.st_size, stat_before.st_mtime_ns)
    assert (m.parameter_bytes(), m.num_parameters()) == (total, total // 4)


def _len_field(field: int, length: int) -> bytes:
    """Tag and length of a length-delimited field; the payload follows."""
    return varint(field << 3 | 2) + varint(length)


def test_single_file_over_2gb(big_dir: Path) -> None:
    """A self-contained ModelProto over 2 GB: one initializer whose raw_data alone is > 2 GiB."""
    n_rows = 2_100_000
    n_bytes = n_rows * COLS * 4
    assert n_bytes > TWO_GIB
    weights = {"W": n_rows}
    model = gather_model(weights)
    graph = model.graph
    model.ClearField("graph")
    # Field numbers: ModelProto.graph = 7, GraphProto.initializer = 5, TensorProto.raw_data = 9.
    tensor_head = weight_proto("W", n_rows).SerializeToString() + _len_field(9, n_bytes)
    tensor_len = len(tensor_head) + n_bytes
    graph_head = graph.SerializeToString() + _len_field(5, tensor_len)
    graph_len = len(graph_head) + tensor_len
    src = big_dir / "single.onnx"
    with open(src, "wb") as f:
        f.write(model.SerializeToString() + _len_field(7, graph_len))
        f.write(graph_head + tensor_head)
        write_rows(f, 0, n_rows)
    assert src.stat().st_size > TWO_GIB

    info = check_load_memory(src, limit_bytes=800 << 20)
    assert info["bytes"] == n_bytes
    assert info["last"] == float(rows(0, n_rows - 1, n_rows)[0, -1])

    m = fastopt.load(str(src))
    t = m.graph.initializer("W")
    assert t is not None and not t.is_external and t.nbytes == n_bytes
    assert m.external_data_files() == []
    check_saved_external(m, big_dir / "out", weights)
    assert (m.parameter_bytes(), m.num_parameters()) == (n_bytes, n_bytes // 4)
