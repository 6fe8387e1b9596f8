"""add_kv_cache: a no-cache decoder becomes a cached one (past/present, mask over past + new).

Step parity on every decoder fixture, both targets: the no-cache original on tokens[:t] for
t = 8..12 against the cached model fed step by step (prefill of 8 tokens with a zero-length past,
then one token at a time, presents fed back as pasts); batch 1 and a right-padded batch of 2.
Plus the refusals (ModelError, nothing written) and the graph interface."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.registry import preset
from llm_fixtures import PARITY_ATOL, Fixture, fixtures, ids

DECODERS = fixtures(decoder=True)
PREFILL, TOTAL = 8, 12
ORT_DTYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


def cached_passes() -> list[str]:
    passes = preset("llm")
    i = passes.index("fuse_attention") + 1
    return [*passes[:i], "add_kv_cache", *passes[i:]]


def add_cache(fx: Fixture, target: str) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    report = fastopt.optimize(
        fx.path, passes=cached_passes(), target=target, options={"kv_cache": 1}
    )
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()


def session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def step_inputs(fx: Fixture, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, mask and positions over TOTAL steps; in a batch of 2 the second prompt is 5 tokens
    right-padded to PREFILL (its pads stay in the cache, masked)."""
    rng = np.random.default_rng(1)
    vocab = int(fx.meta["config"].get("vocab_size", 512))
    tokens = rng.integers(0, vocab, (batch, TOTAL), dtype=np.int64)
    mask = np.ones((batch, TOTAL), dtype=np.int64)
    if batch > 1:
        mask[1, 5:PREFILL] = 0
    positions = np.cumsum(mask, axis=1) - 1
    positions[mask == 0] = 1
    return tokens, mask, positions


def check_steps(fx: Fixture, cached: onnx.ModelProto, batch: int) -> float:
    tokens, mask, positions = step_inputs(fx, batch)
    reference, model = session(str(fx.path)), session(cached)
    ref_inputs = {i.name for i in reference.get_inputs()}
    pasts = {}
    for i in model.get_inputs():
        if i.name.startswith("past_key_values."):
            _, kv_heads, _, head = i.shape
            dtype = ORT_DTYPES[
                cached.graph.input[
                    [x.name for x in cached.graph.input].index(i.name)
                ].type.tensor_type.elem_type
            ]
            pasts[i.name] = np.zeros((batch, kv_heads, 0, head), dtype=dtype)
    out_names = [o.name for o in model.get_outputs()]
    worst = 0.0
    start = 0
    for t in range(PREFILL, TOTAL + 1):
        full = {
            "input_ids": tokens[:, :t],
            "attention_mask": mask[:, :t],
            "position_ids": positions[:, :t],
        }
        expected = reference.run(None, {k: v for k, v in full.items() if k in ref_inputs})[0]
        step = {
            "input_ids": tokens[:, start:t],
            "attention_mask": mask[:, :t],
            "position_ids": positions[:, start:t],
            **pasts,
        }
        outs = dict(zip(out_names, model.run(None, step)))
        got = outs["logits"]
        assert got.shape[1] == t - start
        keep = mask[:, start:t].astype(bool)
        diff = np.abs(expected[:, start:t].astype(np.float64) - got.astype(np.float64))[keep]
        worst = max(worst, float(diff.max()))
        for name in pasts:
            present = outs[name.replace("past_key_values.", "present.")]
            assert present.shape[2] == t
            pasts[name] = present
        start = t
    return worst


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("fx", DECODERS, ids=ids(DECODERS))
def test_step_parity(fx: Fixture, target: str) -> None:
    report, cached = add_cache(fx, target)
    layers = fx.layers
    names = [i.name for i in cached.graph.input]
    assert names[:2] == ["input_ids", "attention_mask"]
    for i in range(layers):
        assert f"past_key_values.{i}.key" in names and f"past_key_values.{i}.value" in names
    outs = [o.name for o in cached.graph.output]
    assert outs[0] == "logits"
    assert outs[1:] == [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    assert report.passes[cached_passes().index("add_kv_cache")].rewrites == layers
    bound = PARITY_ATOL[fx.dtype]
    for batch in (1, 2):
        diff = check_steps(fx, cached, batch)
        assert diff <= bound, f"{fx} {target} batch {batch}: max abs diff {diff:.3g} > {bound}"
