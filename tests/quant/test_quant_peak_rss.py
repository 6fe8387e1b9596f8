"""Resident memory of quantizing a float16 model read from its mapping: the pages each weight was
read from leave the process (csrc/quant/weight_source.cc release), including the pages a fault
mapped beyond the bytes read. Linux maps a whole large folio of the page cache on a read fault
(ext4 and others cache files in folios up to 2 MB; Linux 6.18 here maps them whole), so releasing
only the fault-around windows of the bytes read left about a tenth of a 7B model resident
(1.3 GB of a 13.5 GB fp16 model, 130 MB of a 1 GB one)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.mapping_rss import quantize_rss_file

# 16 float16 weights of 8 MB (128 MB): [1024, 4096] tiles span the width, [4096, 1024] ones too;
# the lm_head-like [1024, 12288] is cut in column tiles (rows read in parts).
HIDDEN, WIDE, LAYERS, HEAD = 1024, 4096, 8, 12288


def _write_model(path: Path) -> int:
    rng = np.random.default_rng(7)
    nodes, inits, x, total = [], [], "x", 0
    shapes = [(HIDDEN, WIDE), (WIDE, HIDDEN)] * LAYERS + [(HIDDEN, HEAD)]
    for i, (k, n) in enumerate(shapes):
        w = (rng.standard_normal((k, n), dtype=np.float32) * 0.05).astype(np.float16)
        # A bias after each weight, as norms sit between an LLM's weights: the weights start
        # at offsets that are not multiples of 2 MB, so their blocks straddle folios.
        b = (rng.standard_normal(n + 3, dtype=np.float32) * 0.05).astype(np.float16)[:n]
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"proj{i}"))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"], name=f"bias{i}"))
        x, total = f"y{i}", total + w.nbytes
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", HIDDEN])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT16, ["batch", HEAD])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data")
    # Out of the page cache: the quantizer's faults read it back through readahead, which
    # caches it in large folios (the write path may leave small ones).
    fd = os.open(path.parent / "model.onnx.data", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return total


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("threads", [1, 2])
def test_fp16_int4_keeps_a_few_mb_of_the_mapping(tmp_path: Path, threads: int) -> None:
    """128 MB of float16 weights to int4: what stays mapped afterwards is a few pages at the
    ends of weights, and the peak while quantizing is bounded by the threads' regions in use
    (a 2 MB page-table region and its folios per thread, twice for a neighbour's), not by the
    model's size. Before the fix 10-13% of the weights stayed mapped."""
    path = tmp_path / "model.onnx"
    weights = _write_model(path)
    rss = quantize_rss_file(path, "int4", threads)
    left = rss["after"] - rss["before"]
    peak = rss["peak"] - rss["before"]
    assert left < 2 << 20, f"{left} bytes of the {weights}-byte weights stayed mapped"
    bound = threads * (8 << 20)
    assert peak < bound, f"peak {peak} bytes of the mapping resident (bound {bound})"
