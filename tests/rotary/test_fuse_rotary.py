"""fuse_rotary: rotate_half rotary embeddings -> RotaryEmbedding (com.microsoft for target ort,
ai.onnx 23 for target onnx) with precomputed cos/sin caches."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.fusion_util import assert_close, info, ort_run, out_info, tensor
from support.llm_fixtures import ROPE_ARCHS, Fixture, assert_parity, fixtures, op_count, optimize

INTERLEAVED_ARCHS = ("gptj", "cohere", "glm", "glm4")
PARTIAL_DIM = {"gptj": 16, "glm": 8, "glm4": 8, "nemotron": 8}
PASSES = ["fuse_rotary", "eliminate_dead_nodes"]
TO_OPSET_23 = ["convert_version"]


def fused(fx: Fixture, target: str) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    pre = TO_OPSET_23 if target == "onnx" else []
    return optimize(
        fx,
        passes=fastopt.pipeline.registry.preset("classic") + pre + PASSES,
        target=target,
        options={"opset": 23},
    )


def counters(report: fastopt.OptimizeReport) -> dict[str, int]:
    return dict(next(p for p in report.passes if p.name == "fuse_rotary").counters)


# Target onnx runs only where there is something to fuse (gpt2/bert: same as target ort).
CASES = [(fx, "ort") for fx in fixtures()] + [(fx, "onnx") for fx in fixtures(arch=ROPE_ARCHS)]


@pytest.mark.parametrize(("fx", "target"), CASES, ids=[f"{fx.name}-{t}" for fx, t in CASES])
def test_fixture(fx: Fixture, target: str) -> None:
    report, out = fused(fx, target)
    domain = "com.microsoft" if target == "ort" else ""
    rope = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    if fx.arch not in ROPE_ARCHS:  # absolute positions
        assert not rope
        return
    assert len(rope) == 2 * fx.layers  # q and k of every layer
    assert all(n.domain == domain for n in rope)
    for op in ("Cos", "Sin", "Neg"):  # the cos/sin subgraph and rotate_half are gone
        assert op_count(out, op) == 0, op
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in rope]
    consumers = {i: n for n in out.graph.node for i in n.input}
    # gptj, cohere, glm rotate pairs (x[2i], x[2i+1]): interleaved.
    interleaved = int(fx.arch in INTERLEAVED_ARCHS)
    assert all(a.get("interleaved", 0) == interleaved for a in attrs)
    if fx.arch == "gpt_neox":  # rotary_pct 0.5 of head 16, on a slice of the fused qkv: 4-D
        assert all(a["rotary_embedding_dim"] == 8 and a["num_heads"] == 4 for a in attrs)
    elif fx.arch in ("gemma3", "qwen3", "falcon", "modernbert"):
        # gemma3, qwen3: after the per-head q/k norms; falcon, modernbert: on heads sliced /
        # split from the exported packed QKV: 4-D
        assert all("rotary_embedding_dim" not in a and "num_heads" not in a for a in attrs)
    else:  # 3-D on the projection, then the head split (gptj: partial 16 of 32, glm 8 of 16)
        partial = PARTIAL_DIM.get(fx.arch)
        assert all(a["num_heads"] in (4, 2, 1) for a in attrs)
        assert all(a.get("rotary_embedding_dim") == partial for a in attrs)
        for n in rope:
            reshape = consumers[n.output[0]]
            assert reshape.op_type == "Reshape"
            assert consumers[reshape.output[0]].op_type == "Transpose"
    # One cache pair per distinct source, shared by the layers' q and k (gemma_ts_float16 has
    # an fp32 layer whose cos/sin round-trip through fp16: a second pair; gemma3's sliding and
    # full layers have their own bases: a pair each).
    cos_inputs = {n.input[2 if target == "ort" else 1] for n in rope}
    assert len(cos_inputs) == counters(report)["caches"] <= (4 if fx.arch == "gemma3" else 2)
    inits = {t.name: t for t in out.graph.initializer}
    for name in cos_inputs:  # the default rotary_max_positions; gptj: its table's rows;
        # longrope: the short and the long table stacked
        rows = {"gptj": 256, "phi3_longrope": 2 * 4096}.get(fx.arch, 4096)
        assert next(iter(inits[name].dims)) == rows
    if target == "onnx":
        onnx.checker.check_model(out, full_check=True)
    else:
        onnx.checker.check_model(out)
    assert_parity(fx, out)


# ---- hand-built graphs ----

F, F16, I64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64
B, H, S, D = 2, 3, 5, 16
INV_FREQ = (1.0 / (10000.0 ** (np.arange(0, D, 2) / D))).astype(np.float32)


def rope_model(
    split: int = D // 2,
    swap_halves: bool = False,
    source: str = "mul",
    scaling: float | None = None,
    sin_freq: np.ndarray | None = None,
    table_halves_equal: bool = True,
    extra_output: str | None = None,
    opset: int = 17,
    pos_batch: int = B,
    split_heads: list[int] | None = None,
    pass_through: int = 0,
) -> onnx.ModelProto:
    """out = x * cos + rotate_half(x) * sin on x (B, H, S, D), cos/sin from position_ids."""
    nodes = []
    inits = [
        tensor("ax1", np.array([1], np.int64)),
        tensor("ax2", np.array([2], np.int64)),
        tensor("ax3", np.array([3], np.int64)),
        tensor("zero", np.array([0], np.int64)),
        tensor("split", np.array([split], np.int64)),
        tensor("big", np.array([np.iinfo(np.int64).max], np.int64)),
    ]
    mk = helper.make_node
    if source == "table":
        angles = np.arange(64, dtype=np.float32)[:, None] * INV_FREQ[None, :]
        emb = np.concatenate([angles, angles + (0 if table_halves_equal else 0.5)], axis=-1)
        inits += [tensor("cos_t", np.cos(emb)), tensor("sin_t", np.sin(emb))]
        nodes += [
            mk("Gather", ["cos_t", "pos"], ["cos3"]),
            mk("Gather", ["sin_t", "pos"], ["sin3"]),
        ]
    else:
        freqs = {"inv": INV_FREQ, "inv_s": INV_FREQ if sin_freq is None else sin_freq}
        inits += [tensor(k, v) for k, v in freqs.items()]
        for fn, inv in (("cos", "inv"), ("sin", "inv_s")):
            if source == "mul":
                nodes += [
                    mk("Unsqueeze", ["pos", "ax2"], [f"{fn}_pu"]),
                    mk("Cast", [f"{fn}_pu"], [f"{fn}_pf"], to=F),
                    mk("Mul", [f"{fn}_pf", inv], [f"{fn}_f"]),
                ]
            else:  # MatMul(inv_freq (1, D/2, 1), pos (B, 1, S)) -> Transpose(0, 2, 1)
                inits.append(tensor(f"{inv}3", freqs[inv][None, :, None]))
                nodes += [
                    mk("Unsqueeze", ["pos", "ax1"], [f"{fn}_pu"]),
                    mk("Cast", [f"{fn}_pu"], [f"{fn}_pf"], to=F),
                    mk("MatMul", [f"{inv}3", f"{fn}_pf"], [f"{fn}_mm"]),
                    mk("Transpose", [f"{fn}_mm"], [f"{fn}_f"], perm=[0, 2, 1]),
                ]
            nodes += [
                mk("Concat", [f"{fn}_f", f"{fn}_f"], [f"{fn}_a"], axis=-1),
                mk(fn.capitalize(), [f"{fn}_a"], [f"{fn}3" if scaling is None else f"{fn}_u"]),
            ]
            if scaling is not None:
                inits.append(tensor(f"{fn}_scale", np.array(scaling, np.float32)))
                nodes.append(mk("Mul", [f"{fn}_u", f"{fn}_scale"], [f"{fn}3"]))
    nodes += [
        mk("Unsqueeze", ["cos3", "ax1"], ["cos4"]),
        mk("Unsqueeze", ["sin3", "ax1"], ["sin4"]),
        mk("Slice", ["xr", "zero", "split", "ax3"], ["x1"]),
        mk("Slice", ["xr", "split", "big", "ax3"], ["x2"]),
        mk("Neg", ["x2"], ["nx2"]),
        mk("Concat", ["x1", "nx2"] if swap_halves else ["nx2", "x1"], ["rot"], axis=-1),
        mk("Mul", ["xr", "cos4"], ["xc"]),
        mk("Mul", ["rot", "sin4"], ["rs"]),
        mk("Add", ["xc", "rs"], ["y"]),
    ]
    if pass_through:  # partial rotary: rope on x[..., :D], x[..., D:] passes through
        inits.append(tensor("d", np.array([D], np.int64)))
        nodes[-1].output[0] = "yr"  # the rotation's Add
        nodes.insert(0, mk("Slice", ["x", "zero", "d", "ax3"], ["xr"]))
        nodes += [
            mk("Slice", ["x", "d", "big", "ax3"], ["xp"]),
            mk("Concat", ["yr", "xp"], ["y"], axis=-1),
        ]
    else:
        for n in nodes:
            n.input[:] = ["x" if i == "xr" else i for i in n.input]
    outputs = [out_info("y", F, 4)]
    if extra_output:
        outputs.append(out_info(extra_output, F, 4))
    x_info = info("x", F, [B, H, S, D + pass_through])
    if split_heads:  # x = Transpose(0, 2, 1, 3)(Reshape(x3d (B, S, H*D), split_heads))
        inits.append(tensor("heads_shape", np.array(split_heads, np.int64)))
        nodes[:0] = [
            mk("Reshape", ["x3d", "heads_shape"], ["xs"]),
            mk("Transpose", ["xs"], ["x"], perm=[0, 2, 1, 3]),
        ]
        x_info = info("x3d", F, [B, S, H * (D + pass_through)])
    graph = helper.make_graph(
        nodes, "g", [x_info, info("pos", I64, [pos_batch, S])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def feeds(pos_batch: int = B, x3d: bool = False, dx: int = D) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, H, S, dx)).astype(np.float32)
    return {
        "x3d" if x3d else "x": x.transpose(0, 2, 1, 3).reshape(B, S, H * dx) if x3d else x,
        "pos": np.array([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]], np.int64)[:pos_batch],
    }


def run(model: onnx.ModelProto, target: str = "ort", pre: tuple[str, ...] = (), **kw):  # type: ignore[no-untyped-def]
    pre = (*pre, *(TO_OPSET_23 if target == "onnx" else []))
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=[*pre, *PASSES],
        target=target,  # type: ignore[arg-type]
        options={"opset": 23, **kw.pop("options", {})},
        **kw,
    )
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize(
    "variant",
    [{}, {"source": "matmul"}, {"scaling": 0.75}, {"source": "table"}, {"pos_batch": 1}],
    ids=["mul", "matmul", "scaling", "table", "positions_1xS"],
)
def test_hand_built(variant: dict, target: str) -> None:
    model = rope_model(**variant)
    _, out = run(model, target)
    ops = [n.op_type for n in out.graph.node]
    if "pos_batch" in variant:  # (1, S) positions are expanded to the batch: the ops want (B, S)
        assert ops == ["Shape", "Gather", "Expand", "RotaryEmbedding"]
    else:
        assert ops == ["RotaryEmbedding"]  # 4-D form
    onnx.checker.check_model(out, full_check=target == "onnx")
    cache = next(t for t in out.graph.initializer if "cos" in t.name)
    assert list(cache.dims) == [64 if variant.get("source") == "table" else 4096, D // 2]
    inputs = feeds(variant.get("pos_batch", B))
    assert_close(ort_run(model, inputs), ort_run(out, inputs), 1e-5)


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("shape", [[0, 0, H, D], [B, S, -1, D], [0, 0, -1, D]])
def test_head_split_3d(shape: list[int], target: str) -> None:
    """x a head split of x3d: RotaryEmbedding on x3d (num_heads), then the split again."""
    model = rope_model(split_heads=shape)
    _, out = run(model, target)
    assert [n.op_type for n in out.graph.node] == ["RotaryEmbedding", "Reshape", "Transpose"]
    rope = out.graph.node[0]
    assert rope.input[0] == "x3d"
    assert helper.get_attribute_value(rope.attribute[1]) == H  # num_heads
    inputs = feeds(x3d=True)
    assert_close(ort_run(model, inputs), ort_run(out, inputs), 1e-5)


def test_head_split_other_dims_stays_4d() -> None:
    """A Reshape that does not keep (B, S) in front is no head split: the 4-D form."""
    model = rope_model(split_heads=[B, S, H, D])
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1  # x3d (1, B*S, H*D)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = B * S
    _, out = run(model, pre=("infer_shapes",))
    assert [n.op_type for n in out.graph.node][-1] == "RotaryEmbedding"
    assert out.graph.node[-1].input[0] == "x"


@pytest.mark.parametrize("target", ["ort", "onnx"])
@pytest.mark.parametrize("split_heads", [None, [0, 0, H, 2 * D]], ids=["4d", "3d"])
def test_partial(split_heads: list[int] | None, target: str) -> None:
    """Concat(rope(x[..., :r]), x[..., r:]) -> one RotaryEmbedding(rotary_embedding_dim=r)."""
    model = rope_model(pass_through=D, split_heads=split_heads)
    _, out = run(model, target, pre=("infer_shapes",))
    rope = [n for n in out.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(rope) == 1 and op_count(out, "Concat") == 0 and op_count(out, "Slice") == 0
    attrs = {a.name: helper.get_attribute_value(a) for a in rope[0].attribute}
    assert attrs["rotary_embedding_dim"] == D and attrs["num_heads"] == H
    assert rope[0].input[0] == ("x3d" if split_heads else "x")
    inputs = feeds(x3d=bool(split_heads), dx=2 * D)
    assert_close(ort_run(model, inputs), ort_run(out, inputs), 1e-5)


def test_max_positions_option() -> None:
    _, out = run(rope_model(), options={"rotary_max_positions": 32})
    caches = [numpy_helper.to_array(t) for t in out.graph.initializer]
    assert [c.shape for c in caches] == [(32, D // 2)] * 2
    assert_close(ort_run(rope_model(), feeds()), ort_run(out, feeds()), 1e-5)


@pytest.mark.parametrize(
    ("kwargs", "target", "reason"),
    [
        ({"split": 4}, "ort", "do not split x at D/2"),
        ({"swap_halves": True}, "ort", "stopped at"),  # rotates the other way
        ({"sin_freq": INV_FREQ * 2}, "ort", "different frequencies"),
        ({"source": "table", "table_halves_equal": False}, "ort", "two halves differ"),
        ({"extra_output": "nx2"}, "ort", "stopped at"),  # an intermediate has another use
        ({}, "onnx-opset17", "opset >= 23"),
    ],
    ids=["wrong_split", "swapped_halves", "cos_sin_differ", "table_halves", "extra_use", "opset"],
)
def test_not_fused(kwargs: dict, target: str, reason: str) -> None:
    model = rope_model(**kwargs)
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=["fuse_rotary"],
        target="onnx" if target.startswith("onnx") else "ort",  # type: ignore[arg-type]
        explain="fuse_rotary",
    )
    assert report.model is not None
    assert op_count(report.model.to_onnx(), "RotaryEmbedding") == 0
    lines = [line for line in report.explain if "'Add'" in line or "(Add)" in line]
    assert any(reason in line for line in lines), report.explain


def test_explain_rewritten() -> None:
    report = fastopt.optimize(
        fastopt.from_onnx(rope_model()), passes=["fuse_rotary"], explain="fuse_rotary"
    )
    assert any(line.endswith("rewritten") for line in report.explain), report.explain
