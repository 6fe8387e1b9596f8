"""Rows whose every key is masked (masked_rows.h): pad queries under left padding (and in a
sliding window's pads under right padding). The export gives them 0 (-inf masks, Where(IsNaN)),
the mean of V (finfo.min masks: eager and dynamo exports) or softmax(scores + v); the fused ops
give a finite average of their own unless the lowering puts the export's rows back. Those rows
reach real tokens where an export's next step reads their keys (gemma2/3's sliding caches:
test_cached_presets.py), so here every position is compared, pads included."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from llm_fixtures import PARITY_ATOL, Fixture, feeds, fixtures, ids, optimize, run
from onnx import TensorProto, helper

CASES = [
    fx
    for arch, exporter, dtype in [
        ("llama", "ts", "float32"),  # -inf mask, Where(IsNaN): rows give 0
        ("gpt2", "dynamo", "float32"),  # finfo.min: the mean of V (MHA's own, lowest bias)
        ("gemma2", "ts", "float32"),  # finfo.min + soft-capping: GQA, the mean put back
        ("gemma3", "dynamo", "float32"),  # finfo.min + Where(IsNaN) (a no-op there)
        ("qwen2", "dynamo", "float16"),  # fp16 finfo.min: GQA over zeroed queries (finite)
        ("bert", "dynamo", "float16"),  # an encoder's key mask (finite)
    ]
    for fx in fixtures(arch=arch, exporter=exporter, dtype=dtype)
]


def _rows_with_no_key(fx: Fixture) -> dict[str, np.ndarray]:
    """Left padding: the second row's leading pad queries see no key (a causal decoder)."""
    x = feeds(fx, padding="left")
    if not fx.is_decoder:  # an encoder's key mask hides a row's keys only when it is all pad
        x["attention_mask"][1, :] = 0
    return x


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", CASES, ids=ids(CASES))
def test_every_position_matches(fx: Fixture, target: str) -> None:
    report, out = optimize(fx, preset="default", target=target)
    fused = next(p.counters for p in report.passes if p.name == "fuse_attention")
    assert fused.get("attention") == fx.layers, fused
    x = _rows_with_no_key(fx)
    expected = np.asarray(run(fx.path, x)[0], np.float64)
    got = np.asarray(run(out, x)[0], np.float64)
    assert np.isfinite(expected).all() and np.isfinite(got).all()
    # fp16's finfo.min rows are the export's rounding of scores + -65504 to multiples of 32,
    # which no kernel reproduces (masked_rows.h): real positions only there.
    keep = np.ones(x["attention_mask"].shape, bool)
    if fx.dtype == "float16":
        keep = x["attention_mask"].astype(bool)
    diff = float(np.abs(expected[keep] - got[keep]).max()) if keep.any() else 0.0
    assert diff <= PARITY_ATOL[fx.dtype], f"max abs diff {diff:.3g}, pad positions included"


def _attention23(mask_value: float) -> np.ndarray:
    """ORT's Attention-23 on one query row whose every key an fp32 additive mask hides."""
    f = TensorProto.FLOAT
    node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y"], scale=0.25)
    shape = [1, 1, 3, 4]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, f, shape) for n in "qkv"]
        + [helper.make_tensor_value_info("m", f, [1, 1, 3, 3])],
        [helper.make_tensor_value_info("y", f, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    m = np.zeros((1, 1, 3, 3), np.float32)
    m[..., 0, :] = mask_value
    y = sess.run(None, {"q": q, "k": k, "v": v, "m": m})[0]
    return np.asarray(y[0, 0, 0] - v[0, 0].mean(axis=0))


def test_attention23_reads_the_lowest_as_minus_infinity() -> None:
    """Why lower_attention_onnx masks with -2^127, not fp32's lowest, where the export's rows
    average V: ORT 1.32 gives 0 for a row at the lowest, the mean one step above it."""
    lowest = float(np.finfo(np.float32).min)
    assert not np.allclose(_attention23(lowest), 0, atol=1e-6)  # 0, not the mean
    np.testing.assert_allclose(_attention23(-(2.0**127)), 0, atol=1e-6)  # the mean
