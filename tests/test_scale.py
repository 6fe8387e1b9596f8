"""Scale: models with very many initializers.

eliminate_dead_nodes removed dead initializers one by one, each removal a scan of the list:
quadratic (100k took 7.7 s, 1M did not finish in 600 s).
"""

from __future__ import annotations

import time

import fastopt
import numpy as np
import pytest
from fastopt import _C
from onnx import TensorProto, helper
from wire import f_len, f_str, f_varint


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
    """100k dead initializers: 7.7 s before (quadratic), about 0.1 s now; 3 s is generous for a
    loaded machine and far below the quadratic time."""
    seconds = dead_initializer_seconds(100_000)
    assert seconds < 3, f"eliminate_dead_nodes took {seconds:.1f} s for 100k dead initializers"


@pytest.mark.slow
def test_a_million_dead_initializers() -> None:
    seconds = dead_initializer_seconds(1_000_000)
    assert seconds < 30, f"eliminate_dead_nodes took {seconds:.1f} s for 1M dead initializers"
