"""transformers 4.49's causal mask (issue 27): _prepare_4d_causal_attention_mask_with_cache_position
builds it as a Trilu (triu of a full masking matrix) and merges the padding with a slice
assignment, which TorchScript exports as ScatterND. The mask proof (mask_proof.cc) evaluates
the mask natively, so the evaluator computes both ops as ONNX Runtime does; a Trilu or ScatterND
it cannot reproduce exactly (duplicate indices, an index out of range) stays unevaluated, and a
mask that differs from the causal pattern is still refused."""

from __future__ import annotations

from pathlib import Path

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support import kv_generation as kg
from support.folding_helpers import assert_parity, make_model, op_counts, optimize, out
from support.llm_fixtures import matrix_fixtures

F, INT, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
MIN = np.finfo(np.float32).min


def _trilu(upper: int, k: int | None, shape: tuple[int, ...], dtype: type) -> onnx.ModelProto:
    x = (np.arange(int(np.prod(shape))) - 5).astype(dtype).reshape(shape)
    inits: dict[str, np.ndarray] = {"X": x}
    inputs = ["X"]
    if k is not None:
        inits["k"] = np.array(k, np.int64)
        inputs.append("k")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Trilu", inputs, ["Y"], upper=upper)]
    nodes.append(helper.make_node("Identity", ["Y"], ["Z"]))
    return make_model(nodes, outputs=[out("Z", elem)], initializers=inits)


TRILU = [
    (1, None, (4, 4), np.float32),
    (1, 1, (3, 5), np.float32),  # transformers' triu(diagonal=1)
    (0, -2, (2, 5, 3), np.int64),  # gemma2's sliding-window tril
    (0, 7, (4, 4), np.float32),  # beyond the matrix: all kept
    (1, -9, (3, 2), np.bool_),
]


@pytest.mark.parametrize("upper,k,shape,dtype", TRILU, ids=[str(i) for i in range(len(TRILU))])
def test_trilu_folds_natively(
    upper: int, k: int | None, shape: tuple[int, ...], dtype: type, tmp_path: Path
) -> None:
    model = _trilu(upper, k, shape, dtype)
    _, path = optimize(model, ["fold_constants"], tmp_path)
    assert "Trilu" not in op_counts(path)
    assert_parity(model, path, tmp_path)


def _scatter(indices: np.ndarray, data_shape: tuple[int, ...]) -> onnx.ModelProto:
    data = np.full(data_shape, MIN, np.float32)
    upd_shape = indices.shape[:-1] + data_shape[indices.shape[-1] :]
    upd = (np.arange(int(np.prod(upd_shape))) * 0.5).astype(np.float32).reshape(upd_shape)
    nodes = [
        helper.make_node("ScatterND", ["D", "I", "U"], ["Y"]),
        helper.make_node("Identity", ["Y"], ["Z"]),
    ]
    return make_model(
        nodes, outputs=[out("Z", F)], initializers={"D": data, "I": indices, "U": upd}
    )


def test_scatternd_folds_natively(tmp_path: Path) -> None:
    # The slice assignment causal_mask[:, :, :, :n] = ...: every (b, h, s, t < n) tuple.
    grid = np.stack(np.meshgrid(*[np.arange(d) for d in (2, 1, 3, 2)], indexing="ij"), axis=-1)
    for name, indices, shape in [
        ("elements", grid.astype(np.int64), (2, 1, 3, 4)),
        ("rows", np.array([[1], [0]], np.int64), (3, 4)),
    ]:
        model = _scatter(indices, shape)
        _, path = optimize(model, ["fold_constants"], tmp_path / name)
        assert "ScatterND" not in op_counts(path), name
        assert_parity(model, path, tmp_path / name)


def test_scatternd_with_duplicate_indices_is_left_alone(tmp_path: Path) -> None:
    # Two updates of one slice: ONNX leaves the result undefined, so no value is made up.
    model = _scatter(np.array([[1], [1]], np.int64), (3, 4))
    _, path = optimize(model, ["fold_constants"], tmp_path)
    assert op_counts(path).get("ScatterND") == 1


def test_tf449_mask_with_wrong_diagonal_is_refused(tmp_path: Path) -> None:
    """The 4.49 TorchScript llama mask with its triu diagonal moved from 1 to 2: each query sees
    the next key, which the proof, now evaluating Trilu and ScatterND, finds."""
    (fx,) = matrix_fixtures("4.49.0", arch="llama", exporter="ts", dtype="float32")
    proto = onnx.load(fx.path)
    (tri,) = [n for n in proto.graph.node if n.op_type == "Trilu"]
    (k,) = [n for n in proto.graph.node if tri.input[1] in n.output]
    k.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(2, np.int64)))
    src = tmp_path / "model.onnx"
    onnx.save(proto, src)
    with pytest.raises(fastopt.ModelError, match="not proven to be causal") as e:
        fastopt.optimize(
            src, preset="llm", output=tmp_path / "o" / "model.onnx", kv_cache="inplace"
        )
    assert "sees key" in str(e.value)


def test_tf449_mask_reading_an_unknown_dim_is_refused(tmp_path: Path) -> None:
    """gpt_neox's 4.49 TorchScript mask is sliced to Shape(keys)[-2], keys a RotaryEmbedding
    whose head dim has no size in the graph's types: the proof admits the shape because only
    the known length is read. Reading the head dim instead (the slice width then is not the
    key length) must leave the mask unproven, never evaluated with a made-up size: the walker
    names the Slice that reads it other than as the size of a broadcast."""
    (fx,) = matrix_fixtures("4.49.0", arch="gpt_neox", exporter="ts", dtype="float32")
    proto = onnx.load(fx.path)
    shape_out = "/m/gpt_neox/layers.0/attention/Shape_6_output_0"
    (gather,) = [n for n in proto.graph.node if n.op_type == "Gather" and n.input[0] == shape_out]
    proto.graph.initializer.append(numpy_helper.from_array(np.array(-1, np.int64), "head_dim_at"))
    gather.input[1] = "head_dim_at"
    src = tmp_path / "model.onnx"
    onnx.save(proto, src)
    for mode in ("standard", "inplace"):
        with pytest.raises(
            fastopt.ModelError,
            match=r"not proven to be causal.*Slice '[^']*' of the mask reads a dim whose size",
        ):
            out_path = tmp_path / mode / "model.onnx"
            fastopt.optimize(src, preset="llm", output=out_path, kv_cache=mode)  # type: ignore[arg-type]


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_tf449_float16_mask_is_proven(exporter: str, tmp_path: Path) -> None:
    """A float16 export of 4.49 builds its mask in float16 (a bool Cast to half, Mul and Add in
    half), which the proof now evaluates exactly: the cache converts, both forms, and greedy
    decoding follows the original's (fp16: tokens until a near-tie, logits within 2e-2)."""
    (fx,) = matrix_fixtures("4.49.0", arch="llama", exporter=exporter, dtype="float16")
    prompts = [[5, 17, 42, 7, 99, 3], [3, 8, 250]]
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), 12)
    for mode in ("standard", "inplace"):
        out_path = tmp_path / mode / "model.onnx"
        fastopt.optimize(fx.path, preset="llm", output=out_path, kv_cache=mode)  # type: ignore[arg-type]
        got = kg.greedy_cached(out_path, prompts, 12, inplace=mode == "inplace")
        same, _ = kg.compare(ref, got)
        if same < 12:
            assert same >= 1
            _, moved = kg.divergence(ref, got, same)
            assert moved <= 2e-2, (mode, same, moved)


def _gqa_windows(path: Path) -> list[int]:
    return [
        {a.name: helper.get_attribute_value(a) for a in n.attribute}.get("local_window_size", -1)
        for n in onnx.load(path).graph.node
        if n.op_type == "GroupQueryAttention"
    ]


@pytest.mark.parametrize("exporter", ["ts", "dynamo"])
def test_tf449_qwen2_window_of_4096_is_proven_without_probing_it(
    exporter: str, tmp_path: Path
) -> None:
    """4.49's Qwen2 mask keeps the config's 4096 window (Sub(cache_position, 4096) compared
    with the key positions) although use_sliding_window is off. The proof replaces the constant
    by two probed values (the window follows them), so no 4096-row probe runs: the cache
    converts with a window of 4096 keys (local_window_size in place), well under a second, and
    decodes as the original."""
    (fx,) = matrix_fixtures("4.49.0", arch="qwen2", exporter=exporter, dtype="float32")
    prompts = [[5, 17, 42, 7, 99, 3], [3, 8, 250]]
    ref = kg.greedy_no_cache(fx.path, *kg.right_pad(prompts), 8)
    for mode in ("standard", "inplace"):
        out_path = tmp_path / mode / "model.onnx"
        report = fastopt.optimize(fx.path, preset="llm", output=out_path, kv_cache=mode)  # type: ignore[arg-type]
        add = next(p for p in report.passes if p.name == "add_kv_cache")
        assert add.counters["sliding-window layers"] == 2 and add.seconds < 5, add
        if mode == "inplace":
            assert _gqa_windows(out_path) == [4096, 4096]
        got = kg.greedy_cached(out_path, prompts, 8, inplace=mode == "inplace")
        same, diff = kg.compare(ref, got)
        assert same == 8 and diff <= 1e-4, (mode, same, diff)


def test_tf449_far_constant_used_otherwise_is_refused(tmp_path: Path) -> None:
    """The same mask with the constant read as 4096 - cache_position (no longer an offset of
    a compared position): the substitution argument does not hold, and the mask is refused as
    one holding a constant beyond the probes."""
    (fx,) = matrix_fixtures("4.49.0", arch="qwen2", exporter="ts", dtype="float32")
    proto = onnx.load(fx.path)
    consts = {
        n.output[0]
        for n in proto.graph.node
        if n.op_type == "Constant" and numpy_helper.to_array(n.attribute[0].t).tolist() == 4096
    }
    (sub,) = [n for n in proto.graph.node if n.op_type == "Sub" and n.input[1] in consts]
    sub.input[0], sub.input[1] = sub.input[1], sub.input[0]
    src = tmp_path / "model.onnx"
    onnx.save(proto, src)
    with pytest.raises(fastopt.ModelError, match="holds the constant 4096, beyond the lengths"):
        fastopt.optimize(src, preset="llm", output=tmp_path / "o.onnx", kv_cache="standard")
