"""fuse_rotary's cos/sin caches, value for value: where one export has the same frequencies in a
float16 and a float32 layer (gemma3 TorchScript fp16), the float16 cache is the float32 one
rounded by numpy (round to nearest even: an independent reference for the F16C conversion), bit
for bit, subnormals and zeros included."""

from __future__ import annotations

import fastopt
import numpy as np
import pytest
from support.paths import TESTS

MODELS = TESTS / "fixtures" / "models"


def caches(name: str) -> dict[str, np.ndarray]:
    path = MODELS / name / "model.onnx"
    if not path.exists():
        pytest.skip(f"fixture {name} absent")
    report = fastopt.optimize(
        fastopt.load(path), passes=[*fastopt.pipeline.registry.preset("classic"), "fuse_rotary"]
    )
    made = ("rotary_cos_cache", "rotary_sin_cache")
    return {
        t.name: t.numpy().copy() for t in report.model.graph.initializers if t.name.startswith(made)
    }


def test_mixed_dtypes_share_one_table() -> None:
    # gemma3 TorchScript fp16: a float16 cache (base 10000) and float32 caches (both bases, the
    # fp32 layers of the export); the float16 one is the rounded base-10000 float32 one.
    c = caches("gemma3_ts_float16")
    halves = [v for v in c.values() if v.dtype == np.float16]
    floats = [v for v in c.values() if v.dtype == np.float32]
    assert len(halves) == 2 and len(floats) == 4  # cos and sin each
    rounded = [f.astype(np.float16).view(np.uint16) for f in floats]
    for h in halves:
        assert sum(np.array_equal(h.view(np.uint16), r) for r in rounded) == 1
    everything = np.concatenate([h.ravel() for h in halves])
    assert (np.abs(everything) < 6.1e-5).any()  # float16 subnormals (or zeros) are in the check
