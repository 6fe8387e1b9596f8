"""add_kv_cache: a no-cache decoder becomes a cached one (past/present, mask over past + new).

Step parity on every decoder fixture, both targets: the no-cache original on tokens[:t] for
t = 8..12 against the cached model fed step by step (prefill of 8 tokens with a zero-length past,
then one token at a time, presents fed back as pasts); batch 1, a right-padded batch of 2, and
chunked steps (S > 1 with P > 0).
Plus the refusals (ModelError, nothing written) and the graph interface."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fastopt.pipeline.registry import preset
from support.kv_models import (
    TP,
    H,
    attention_model,
    internal_attention,
    mask_nodes,
    with_opsets,
)
from support.llm_fixtures import PARITY_ATOL, Fixture, fixtures, ids, op_count

DECODERS = fixtures(decoder=True, kv_cache=True)
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


def check_steps(
    fx: Fixture,
    cached: onnx.ModelProto,
    batch: int,
    original: onnx.ModelProto | None = None,
    steps: tuple[int, ...] = tuple(range(PREFILL, TOTAL + 1)),
) -> float:
    """Max abs logits difference over the kept positions of each step; `steps` are the total
    lengths after each step (the first is the prefill)."""
    tokens, mask, positions = step_inputs(fx, batch)
    reference = session(str(fx.path) if original is None else original)
    model = session(cached)
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
    model_inputs = {i.name for i in model.get_inputs()}
    worst = 0.0
    start = 0
    for t in steps:
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
        step = {k: v for k, v in step.items() if k in model_inputs}
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
    # The lowerings take the cached form natively (lower_attention_ort/_onnx): Attention-23 with
    # past/present for onnx; GQA (fp16, or Hkv < Hq) / MHA (fp32, Hkv == Hq) with past/present
    # for ort; their present outputs are the graph's, the Concats gone.
    attention = {"Attention": ""} if target == "onnx" else {
        "GroupQueryAttention": "com.microsoft", "MultiHeadAttention": "com.microsoft"}  # fmt: skip
    assert sum(op_count(cached, op, d) for op, d in attention.items()) == layers
    if target == "onnx":
        onnx.checker.check_model(cached, full_check=True)
    producers = {o: n for n in cached.graph.node for o in n.output}
    for i in range(layers):
        for kv in ("key", "value"):
            node = producers[f"present.{i}.{kv}"]
            assert node.op_type in attention, node.op_type
            assert f"past_key_values.{i}.{kv}" in node.input
    bound = PARITY_ATOL[fx.dtype]
    for batch in (1, 2):
        diff = check_steps(fx, cached, batch)
        assert diff <= bound, f"{fx} {target} batch {batch}: max abs diff {diff:.3g} > {bound}"
    # Chunked prefill: S > 1 with P > 0.
    diff = check_steps(fx, cached, 1, steps=(PREFILL - 3, PREFILL + 1, TOTAL))
    assert diff <= bound, f"{fx} {target} chunked: max abs diff {diff:.3g} > {bound}"


def internal_positions(fx: Fixture) -> onnx.ModelProto:
    """The fixture with position_ids computed inside the graph, Expand(Range(0, S)), as exports
    of models that take no position_ids do."""
    model = onnx.load(fx.path)
    g = model.graph
    (pos,) = [i for i in g.input if i.name == "position_ids"]
    g.input.remove(pos)
    h = onnx.helper
    g.initializer.extend(
        [
            onnx.numpy_helper.from_array(np.array(v, dtype=np.int64), n)
            for n, v in [("pos_zero", 0), ("pos_one", 1), ("pos_axis", [0])]
        ]
    )
    nodes = [
        h.make_node("Shape", ["input_ids"], ["pos_shape"]),
        h.make_node("Gather", ["pos_shape", "pos_one"], ["pos_len"], axis=0),
        h.make_node("Range", ["pos_zero", "pos_len", "pos_one"], ["pos_range"]),
        h.make_node("Unsqueeze", ["pos_range", "pos_axis"], ["pos_row"]),
        h.make_node("Expand", ["pos_row", "pos_shape"], ["position_ids"]),
    ]
    for n in reversed(nodes):
        g.node.insert(0, n)
    return model


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_internal_positions_start_at_past_length(target: str) -> None:
    (fx,) = fixtures(arch="llama", exporter="dynamo", dtype="float32")
    original = internal_positions(fx)
    report = fastopt.optimize(
        fastopt.from_onnx(original, base_dir=fx.path.parent),
        passes=cached_passes(),
        target=target,
        options={"kv_cache": 1},
    )
    assert report.model is not None
    cached = report.model.to_onnx()
    assert "position_ids" not in [i.name for i in cached.graph.input]
    counters = report.passes[cached_passes().index("add_kv_cache")].counters
    assert counters["positions offset by the past length"] == 1
    assert check_steps(fx, cached, 1, original) <= PARITY_ATOL[fx.dtype]


# ---- refusals: ModelError naming what is missing, nothing written ----


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (attention_model(extra_inputs=("past_key_values.0.key",)), "does not read its keys"),
        (attention_model(seq=8), "fixed sequence length"),
        (attention_model(constant_mask=True), "is a constant"),
        (attention_model(k_shape=("B", "S", 32)), "not 4-D"),
        (attention_model(k_shape=("B", 3, "S", 16)), "not kv_num_heads"),
        (attention_model(k_shape=("B", 2, 9, 16)), "fixed length 9 on axis 2"),
    ],
    ids=["past", "static", "constant-mask", "k-rank", "k-heads", "k-length"],
)
def test_refusals(model: bytes, message: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.onnx"
    with pytest.raises(fastopt.ModelError, match=message):
        fastopt.optimize(
            fastopt.load_bytes(model), passes=["add_kv_cache"], options={"kv_cache": 1}, output=out
        )
    assert not out.exists()


def test_refuses_without_fused_attention(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (fx,) = fixtures(arch="llama", exporter="dynamo", dtype="float32")
    out = tmp_path / "out.onnx"
    with pytest.raises(fastopt.ModelError, match="no fused attention"):
        fastopt.optimize(
            fx.path,
            passes=[*preset("classic"), "add_kv_cache"],
            options={"kv_cache": 1},
            output=out,
        )
    assert not out.exists()


def test_bad_option() -> None:
    with pytest.raises(fastopt.ModelError, match="kv_cache must be"):
        fastopt.optimize(
            fastopt.load_bytes(attention_model()), passes=["add_kv_cache"], options={"kv_cache": 3}
        )


def test_inplace_option_gives_the_same_form() -> None:
    model = attention_model()
    report = fastopt.optimize(
        fastopt.load_bytes(model), passes=["add_kv_cache"], options={"kv_cache": 2}
    )
    assert report.model is not None
    out = report.model.to_onnx()
    assert [o.name for o in out.graph.output][1:] == ["present.0.key", "present.0.value"]
    mask = next(i for i in out.graph.input if i.name == "attention_mask")
    dims = [d.dim_param or d.dim_value for d in mask.type.tensor_type.shape.dim]
    assert dims == ["B", "total_sequence_length"]


def cached_attention_model(past_reader: str | None) -> bytes:
    """An internal Attention in the cached form (K/V = Concat(past input, new) = present
    outputs); `past_reader` also reads the past key's data (an op besides its Concat)."""
    inputs = [
        H.make_tensor_value_info("input_ids", TP.INT64, ["B", "S"]),
        H.make_tensor_value_info("attention_mask", TP.INT64, ["B", "T"]),
        H.make_tensor_value_info("q", TP.FLOAT, ["B", 4, "S", 16]),
        H.make_tensor_value_info("k", TP.FLOAT, ["B", 2, "S", 16]),
        H.make_tensor_value_info("v", TP.FLOAT, ["B", 2, "S", 16]),
        H.make_tensor_value_info("past_key_values.0.key", TP.FLOAT, ["B", 2, "P", 16]),
        H.make_tensor_value_info("past_key_values.0.value", TP.FLOAT, ["B", 2, "P", 16]),
    ]
    mask, inits = mask_nodes()
    nodes = [
        *mask,
        H.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
        H.make_node("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=2),
        internal_attention(["q", "present.0.key", "present.0.value", "mask"]),
    ]
    outputs = [
        H.make_tensor_value_info("y", TP.FLOAT, None),
        H.make_tensor_value_info("present.0.key", TP.FLOAT, None),
        H.make_tensor_value_info("present.0.value", TP.FLOAT, None),
    ]
    if past_reader:
        nodes.append(H.make_node(past_reader, ["past_key_values.0.key"], ["read"]))
        outputs.append(H.make_tensor_value_info("read", TP.FLOAT, None))
    return with_opsets(H.make_graph(nodes, "g", inputs, outputs, inits))


def test_adopts_a_cached_model() -> None:
    """Past inputs are adopted, not refused: the attention gets the shared causal + padding mask
    over attention_mask's width, and nothing else changes in the interface."""
    model = fastopt.load_bytes(cached_attention_model(None))
    ctx = fastopt.PassContext(model=model, target="ort", options={"kv_cache": 2})
    assert fastopt.get_pass("add_kv_cache").run(ctx) == 1
    assert ctx.counters["layers adopted"] == 1
    out = model.to_onnx()
    att = next(n for n in out.graph.node if n.op_type == "Attention")
    assert att.input[3] == "kv_attention_mask"
    assert [i.name for i in out.graph.input if i.name.startswith("past")] == [
        "past_key_values.0.key",
        "past_key_values.0.value",
    ]


def test_inplace_refuses_other_reads_of_the_past(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In place, the past is a max-length buffer: an op reading its data besides the cache
    Concat would read rows that are not the past. Standard mode keeps the model as it is."""
    out = tmp_path / "out.onnx"
    model = cached_attention_model("Relu")
    with pytest.raises(fastopt.ModelError, match="besides its cache Concat"):
        fastopt.optimize(
            fastopt.load_bytes(model), passes=["add_kv_cache"], options={"kv_cache": 2}, output=out
        )
    assert not out.exists()
    report = fastopt.optimize(
        fastopt.load_bytes(model), passes=["add_kv_cache"], options={"kv_cache": 1}
    )
    assert report.passes[0].counters["layers adopted"] == 1


def test_refuses_a_length_baked_into_a_reshape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A Reshape of a tensor with a symbolic dim to a constant shape: the export fixed the length
    it was traced with, so one new token after a past cannot run."""
    model = onnx.load_from_string(attention_model())
    shape = onnx.numpy_helper.from_array(np.array([1, 4, 8, 16], dtype=np.int64), "baked")
    model.graph.initializer.append(shape)
    model.graph.node.append(H.make_node("Reshape", ["q", "baked"], ["q_fixed"], name="head_split"))
    model.graph.output.append(H.make_tensor_value_info("q_fixed", TP.FLOAT, None))
    out = tmp_path / "out.onnx"
    with pytest.raises(fastopt.ModelError, match=r"Reshape 'head_split'.*\[1, 4, 8, 16\]"):
        fastopt.optimize(
            fastopt.load_bytes(model.SerializeToString()),
            passes=["add_kv_cache"],
            options={"kv_cache": 1},
            output=out,
        )
    assert not out.exists()
