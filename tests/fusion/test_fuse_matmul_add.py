"""fuse_matmul_add: 2-D MatMul + Add -> Gemm."""

from __future__ import annotations

from collections.abc import Sequence

import fastopt
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from support.fusion_util import (
    TORCH_EXPORTERS,
    assert_close,
    check_fusion,
    info,
    make_model,
    ops,
    ort_run,
    out_info,
    random,
    run_passes,
    tensor,
    torch_export,
)
from support.paths import ROOT

F = TensorProto.FLOAT
PASS = ["fuse_matmul_add"]
CORPUS_DIR = ROOT.parent / "shared" / "corpus"
M, K, N = 5, 4, 3


def matmul_add(
    bias_shape: Sequence[int | str] | None = (N,),
    a_shape: Sequence[int | str] = (M, K),
    dtype=np.float32,
    bias_first: bool = False,
    b_constant: bool = True,
    bias_constant: bool = True,
    opset: int = 17,
    out_rank: int = 2,
) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [info("A", elem, list(a_shape))]
    inits = []
    if b_constant:
        inits.append(tensor("B", random((K, N), dtype, seed=2)))
    else:
        inputs.append(info("B", elem, [K, N]))
    concrete = [d if isinstance(d, int) else M for d in (bias_shape or ())]
    if bias_constant:
        inits.append(tensor("C", random(concrete, dtype, seed=3)))
    else:
        inputs.append(info("C", elem, None if bias_shape is None else list(bias_shape)))
    add_inputs = ["C", "mm"] if bias_first else ["mm", "C"]
    nodes = [
        helper.make_node("MatMul", ["A", "B"], ["mm"], "matmul"),
        helper.make_node("Add", add_inputs, ["y"], "add"),
    ]
    return make_model(nodes, inputs, [out_info("y", elem, out_rank)], inits, opset)


def feeds(model: onnx.ModelProto, dtype=np.float32) -> dict[str, np.ndarray]:
    out = {}
    for i, vi in enumerate(model.graph.input):
        shape = [
            d.dim_value if d.HasField("dim_value") else M for d in vi.type.tensor_type.shape.dim
        ]
        out[vi.name] = random(shape, dtype, seed=10 + i)
    return out


def gemm(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = model.graph.node
    assert node.op_type == "Gemm" and node.output == ["y"]
    assert not node.attribute  # alpha = beta = 1, no transposes
    return node


# ---- fires ----


@pytest.mark.parametrize(
    "bias_shape",
    [(N,), (1, N), (M, N), (M, 1), (1, 1), (1,), ()],
    ids=["N", "1xN", "MxN", "Mx1", "1x1", "1", "scalar"],
)
def test_bias_shapes(bias_shape):
    model = matmul_add(bias_shape)
    out = check_fusion(model, PASS, feeds(model), 1)
    assert list(gemm(out).input) == ["A", "B", "C"]


def test_bias_first():
    model = matmul_add(bias_first=True)
    out = check_fusion(model, PASS, feeds(model), 1)
    assert list(gemm(out).input) == ["A", "B", "C"]


def test_symbolic_rows():
    model = matmul_add(("batch", N), a_shape=("batch", K), bias_constant=False)
    out = check_fusion(model, PASS, feeds(model), 1)
    gemm(out)


def test_weight_not_constant():
    # Gemm takes any 2-D B; what matters is that its rank is known.
    model = matmul_add(b_constant=False)
    check_fusion(model, PASS, feeds(model), 1)


def test_float64():
    model = matmul_add(dtype=np.float64)
    check_fusion(model, PASS, feeds(model, np.float64), 1, tol=1e-10)


def test_float16():
    model = matmul_add(dtype=np.float16)
    check_fusion(model, PASS, feeds(model, np.float16), 1, tol=1e-2)


def test_linear_stack_and_preset():
    # Two Linear layers with a Relu between: both fuse; the default preset does too.
    inits = [
        tensor("W1", random((K, 8), seed=1)),
        tensor("b1", random((8,), seed=2)),
        tensor("W2", random((8, N), seed=3)),
        tensor("b2", random((N,), seed=4)),
    ]
    nodes = [
        helper.make_node("MatMul", ["A", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["m2"]),
        helper.make_node("Add", ["b2", "m2"], ["y"]),
    ]
    model = make_model(nodes, [info("A", F, ["batch", K])], [out_info("y", F, 2)], inits)
    # The second MatMul reads the Relu: only shape inference tells its rank.
    report, _ = run_passes(model, PASS)
    assert report.rewrites == 1
    model = onnx.shape_inference.infer_shapes(model)
    out = check_fusion(model, PASS, {"A": random((7, K), seed=5)}, 2)
    assert ops(out) == ["Gemm", "Relu", "Gemm"]
    _, preset_out = run_passes(model, None)
    assert ops(preset_out) == ["Gemm", "Relu", "Gemm"]


# ---- must not fire ----


def assert_unchanged(model: onnx.ModelProto) -> None:
    report, out = run_passes(model, PASS)
    assert report.rewrites == 0, report.passes
    assert ops(out) == ops(model)


def test_rank3_input():
    assert_unchanged(matmul_add(a_shape=(2, M, K), out_rank=3))


def renamed_through_identity(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """`name` reaches the MatMul/Add through an Identity whose output has no type."""
    for node in model.graph.node:
        for i, v in enumerate(node.input):
            if v == name:
                node.input[i] = name + "_id"
    model.graph.node.insert(0, helper.make_node("Identity", [name], [name + "_id"]))
    return model


def test_unknown_rank_input():
    assert_unchanged(renamed_through_identity(matmul_add(), "A"))


def test_shape_inference_gives_the_rank():
    model = onnx.shape_inference.infer_shapes(renamed_through_identity(matmul_add(), "A"))
    check_fusion(model, PASS, feeds(model), 1)


def test_rank1_weight():
    model = matmul_add()
    model.graph.initializer[0].CopyFrom(tensor("B", random((K,), seed=2)))
    model.graph.initializer[1].CopyFrom(tensor("C", random((M,), seed=3)))
    assert_unchanged(model)


@pytest.mark.parametrize(
    "bias_shape",
    [(2, M, N), (M + 1, N), (N + 1,), (M,), ("other", N)],
    ids=["rank3", "rows_differ", "cols_differ", "M_as_N", "other_symbol"],
)
def test_bias_does_not_broadcast_as_gemm(bias_shape):
    rank = 3 if len(bias_shape) == 3 else 2
    model = matmul_add(bias_shape, bias_constant=False, out_rank=rank)
    assert_unchanged(model)


def test_bias_shape_unknown():
    model = matmul_add((N,), bias_constant=False)
    assert_unchanged(renamed_through_identity(model, "C"))


def test_int_dtype():
    model = matmul_add(dtype=np.int32)
    assert_unchanged(model)


def test_mixed_bias_dtype():
    model = matmul_add()
    model.graph.node[1].input[1] = "C16"
    model.graph.node.insert(1, helper.make_node("Cast", ["C"], ["C16"], to=TensorProto.FLOAT))
    # Cast output has no type here: its dtype is unknown, so the rewrite declines.
    report = fastopt.optimize(fastopt.from_onnx(model), passes=PASS)
    assert report.rewrites == 0


def test_matmul_output_has_another_consumer():
    model = matmul_add()
    model.graph.node.append(helper.make_node("Relu", ["mm"], ["r"]))
    model.graph.output.append(out_info("r", F, 2))
    assert_unchanged(model)


def test_matmul_added_to_itself():
    nodes = [
        helper.make_node("MatMul", ["A", "B"], ["mm"]),
        helper.make_node("Add", ["mm", "mm"], ["y"]),
    ]
    inits = [tensor("B", random((K, N), seed=2))]
    model = make_model(nodes, [info("A", F, [M, K])], [out_info("y", F, 2)], inits)
    assert_unchanged(model)


def test_old_opset():
    model = matmul_add(opset=6)
    assert_unchanged(model)


# ---- real exports: LLM projections are rank 3 and stay ----


@pytest.mark.parametrize(
    "path",
    sorted(CORPUS_DIR.glob("*_ts_nocache/model.onnx")) if CORPUS_DIR.is_dir() else [],
    ids=lambda p: p.parent.name,
)
def test_corpus_exports(path):
    model = onnx.load(path)
    report, out = run_passes(model, PASS)
    gemms = sum(n.op_type == "Gemm" for n in out.graph.node)
    assert gemms - sum(n.op_type == "Gemm" for n in model.graph.node) == report.rewrites
    assert "MatMul" in ops(out)  # the rank-3 projections stay
    rng = np.random.default_rng(0)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value or 4 for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TensorProto.INT64:
            if "mask" in vi.name:
                feeds[vi.name] = np.ones(shape, np.int64)
            else:
                high = 2 if "type" in vi.name else 100
                feeds[vi.name] = rng.integers(0, high, shape).astype(np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    assert_close(ort_run(model, feeds), ort_run(out, feeds), 1e-4)


# ---- real exports: PyTorch `x @ w + b` on a 2-D input, and a Linear on a 3-D one ----


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_torch_export(exporter, tmp_path):
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))
            self.b = torch.nn.Parameter(torch.randn(4))
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            h = torch.relu(x @ self.w + self.b)  # 2-D: MatMul + Add
            return self.lin(h.unsqueeze(0))  # 3-D: MatMul + Add that must stay

    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 8)
    model = torch_export(net, (x,), tmp_path, **TORCH_EXPORTERS[exporter])
    assert ops(model).count("MatMul") == 2
    report, out = run_passes(model, PASS)
    assert report.rewrites == 1
    assert ops(out).count("Gemm") == 1 and ops(out).count("MatMul") == 1
    feeds = {"x": x.numpy()}
    assert_close(ort_run(model, feeds), ort_run(out, feeds), 1e-5)
