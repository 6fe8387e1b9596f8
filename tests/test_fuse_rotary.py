"""fuse_rotary: rotate_half rotary embeddings -> RotaryEmbedding (com.microsoft for target ort,
ai.onnx 23 for target onnx) with precomputed cos/sin caches."""

from __future__ import annotations

import fastopt
import numpy as np
import onnx
import pytest
from fusion_util import assert_close, info, ort_run, out_info, tensor
from llm_fixtures import Fixture, assert_parity, fixtures, op_count, optimize
from onnx import TensorProto, helper, numpy_helper

ROPE_ARCHS = ("llama", "mistral", "qwen2", "phi3", "gemma", "gpt_neox")
PASSES = ["fuse_rotary", "eliminate_dead_nodes"]
TO_OPSET_23 = ["convert_version"]


def fused(fx: Fixture, target: str) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    pre = TO_OPSET_23 if target == "onnx" else []
    return optimize(
        fx,
        passes=fastopt.registry.preset("default") + pre + PASSES,
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
    if fx.arch == "gpt_neox":  # rotary_pct 0.5 of head 16, on a slice of the fused qkv: 4-D
        assert all(a["rotary_embedding_dim"] == 8 and a["num_heads"] == 4 for a in attrs)
    else:  # 3-D form on the projection, then the head split again
        assert all(a["num_heads"] in (4, 2, 1) and "rotary_embedding_dim" not in a for a in attrs)
        for n in rope:
            reshape = consumers[n.output[0]]
            assert reshape.op_type == "Reshape"
            assert consumers[reshape.output[0]].op_type == "Transpose"
    # One cache pair per distinct source, shared by the layers' q and k (gemma_ts_float16 has
    # an fp32 layer whose cos/sin round-trip through fp16: a second pair).
    cos_inputs = {n.input[2 if target == "ort" else 1] for n in rope}
    assert len(cos_inputs) == counters(report)["caches"] <= 2
    inits = {t.name: t for t in out.graph.initializer}
    for name in cos_inputs:
        assert next(iter(inits[name].dims)) == 4096  # the default rotary_max_positions
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
        mk("Slice", ["x", "zero", "split", "ax3"], ["x1"]),
        mk("Slice", ["x", "split", "big", "ax3"], ["x2"]),
        mk("Neg", ["x2"], ["nx2"]),
        mk("Concat", ["x1", "nx2"] if swap_halves else ["nx2", "x1"], ["rot"], axis=-1),
        mk("Mul", ["x", "cos4"], ["xc"]),
        mk("Mul", ["rot", "sin4"], ["rs"]),
        mk("Add", ["xc", "rs"], ["y"]),
    ]
    outputs = [out_info("y", F, 4)]
    if extra_output:
        outputs.append(out_info(extra_output, F, 4))
    graph = helper.make_graph(
        nodes, "g", [info("x", F, [B, H, S, D]), info("pos", I64, [pos_batch, S])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def feeds(pos_batch: int = B) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((B, H, S, D)).astype(np.float32),
        "pos": np.array([[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]], np.int64)[:pos_batch],
    }


def run(model: onnx.ModelProto, target: str = "ort", **kw):  # type: ignore[no-untyped-def]
    pre = TO_OPSET_23 if target == "onnx" else []
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=pre + PASSES,
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
