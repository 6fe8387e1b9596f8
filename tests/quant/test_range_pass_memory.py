"""The range pass's instrumented run frees each activation once reduced
(fastopt.quant.activation_ranges.place_early and the session's priority-based order). Before,
the reductions ran after the whole graph (ONNX Runtime's default order is a DFS from the
outputs), so every observed activation was alive at once: SmolLM2 at 512 tokens peaked at 4.7 GB
against 1.9 GB for the plain model, 2.0 GB now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from onnx import TensorProto, helper, save

N, WIDTH = 40, 1 << 21  # 40 activations of 8 MiB: 320 MiB if all were alive at once

_CHILD = """
import resource, sys
import numpy as np
N, WIDTH = int(sys.argv[2]), int(sys.argv[3])
import onnx, onnxruntime  # (their import is not the run's memory)
import fastopt
from fastopt.quant.activation_ranges import collect_ranges

model = fastopt.load(sys.argv[1])
feeds = [{"x": np.ones((1, WIDTH), np.float32)}]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ranges = collect_ranges(model, feeds)
assert len(ranges.max_abs) == N + 1
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_activations_die_after_their_reduction(tmp_path: Path) -> None:
    nodes, prev = [], "x"
    for i in range(N):
        nodes.append(helper.make_node("Sigmoid" if i % 2 else "Neg", [prev], [f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, WIDTH])],
    )
    path = tmp_path / "chain.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    args = [sys.executable, "-c", _CHILD, str(path), str(N), str(WIDTH)]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    growth_mib = int(out.stdout.split()[-1])
    assert growth_mib < N * WIDTH * 4 / 2**20 / 2, growth_mib  # here about 80 MiB, main 390
