"""Helpers for the classic-fusion tests: build small models, run passes, check ORT parity."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ort.set_default_logger_severity(3)

LIGHT_DIR = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opset: int = 17,
    extra_opsets: Sequence[onnx.OperatorSetIdProto] = (),
    functions: Sequence[onnx.FunctionProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", opset), *extra_opsets]
    model = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    model.ir_version = min(model.ir_version, 8)  # what the installed ORT accepts
    onnx.checker.check_model(model)
    return model


def tensor(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def info(name: str, elem_type: int, shape: Sequence[int | str] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def out_info(name: str, elem_type: int, rank: int) -> onnx.ValueInfoProto:
    """A graph output of known rank whose dims are symbolic (the checker wants a shape)."""
    return info(name, elem_type, [f"{name}_d{i}" for i in range(rank)])


def run_passes(
    model: onnx.ModelProto, passes: Sequence[str] | None, target: str = "ort"
) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    """Runs `passes` (None: the default preset); verifies the IR and checks the output."""
    report = fastopt.optimize(
        fastopt.from_onnx(model),
        passes=None if passes is None else list(passes),
        target=target,  # type: ignore[arg-type]
    )
    assert report.model is not None
    report.model.verify()
    out = report.model.to_onnx()
    onnx.checker.check_model(out)
    return report, out


def rewrites(report: fastopt.OptimizeReport, name: str) -> int:
    return sum(p.rewrites for p in report.passes if p.name == name)


def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def ort_run(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def assert_close(expected: list[Any], actual: list[Any], tol: float) -> None:
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual)):
        e, a = np.asarray(e), np.asarray(a)
        assert e.dtype == a.dtype and e.shape == a.shape, f"output {i}"
        np.testing.assert_allclose(
            a.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol, err_msg=f"output {i}"
        )


def check_fusion(
    model: onnx.ModelProto,
    passes: Sequence[str],
    feeds: dict[str, Any],
    expected: int,
    target: str = "ort",
    tol: float = 1e-4,
) -> onnx.ModelProto:
    """Runs the passes, expects `expected` rewrites from the last one, ORT parity (optimizations
    off), and no rewrite on a second run (idempotence). Returns the optimized model."""
    report, out = run_passes(model, passes, target)
    assert rewrites(report, passes[-1]) == expected, report.passes
    assert_close(ort_run(model, feeds), ort_run(out, feeds), tol)
    again, out2 = run_passes(out, passes, target)
    assert again.rewrites == 0, again.passes
    assert ops(out2) == ops(out)
    return out


def random(shape: Sequence[int], dtype: Any = np.float32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---- light models of the onnx wheel ----


def light_models() -> list[Path]:
    return sorted(LIGHT_DIR.glob("light_*.onnx"))


def materialize_light(model: onnx.ModelProto, seed: int | None = 0) -> onnx.ModelProto:
    """The light models keep their weights as ConstantOfShape(shape initializer) nodes and, being
    IR version 3, list every initializer as a graph input (overridable, so not constant to
    fastopt). This stands in for constant folding: each ConstantOfShape of a constant shape
    becomes an initializer, and initializers leave the graph inputs (IR version 4).

    Every ConstantOfShape fills 0.02, which makes the class scores uniform; with `seed`, the
    weights are random instead (He-scaled for rank >= 2, uniform in [0.5, 1.5] for vectors so that
    BatchNormalization variances stay positive) and the outputs mean something."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    rng = np.random.default_rng(seed)
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    kept = []
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            value = np.zeros(1, np.float32)
            for a in node.attribute:
                if a.name == "value":
                    value = numpy_helper.to_array(a.t)
            shape = tuple(int(d) for d in inits[node.input[0]])
            if seed is None:
                array = np.full(shape, value[0], value.dtype)
            elif len(shape) >= 2:
                fan_in = int(np.prod(shape[1:]))
                array = rng.standard_normal(shape, np.float32) * np.float32(np.sqrt(2 / fan_in))
            else:
                array = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            g.initializer.append(tensor(node.output[0], array.astype(value.dtype)))
        else:
            kept.append(node)
    del g.node[:]
    g.node.extend(kept)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    live = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(live)
    names = {t.name for t in g.initializer}
    inputs = [vi for vi in g.input if vi.name not in names and vi.name in used]
    del g.input[:]
    g.input.extend(inputs)
    out.ir_version = max(out.ir_version, 4)
    return out


def light_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The inputs onnx's backend runner writes to test_data_set_0: arange(n) / n per input."""
    inits = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        assert vi.type.tensor_type.elem_type == TensorProto.FLOAT
        shape = [
            d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim
        ]
        n = int(np.prod(shape))
        feeds[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return feeds


# ---- PyTorch exports (the tests that use them skip when torch is not installed) ----


def torch_export(
    module: Any, args: tuple[Any, ...], tmp_path: Path, **kwargs: Any
) -> onnx.ModelProto:
    """Exports `module` in eval mode with torch.onnx.export(**kwargs); returns the loaded model.
    The dynamo exporter needs onnxscript, which torch does not install: skip without it."""
    import warnings

    import pytest
    import torch

    if kwargs.get("dynamo"):
        pytest.importorskip("onnxscript")

    path = tmp_path / "export.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), input_names=["x"], **kwargs)
    return onnx.load(path)


# The two exporters, as users call them (dynamo: the exporter's own optimizer on or off).
TORCH_EXPORTERS = {
    "torchscript": {"dynamo": False, "opset_version": 17},
    "torchscript_nofold": {"dynamo": False, "opset_version": 17, "do_constant_folding": False},
    "dynamo": {"dynamo": True, "verbose": False},
    "dynamo_noopt": {"dynamo": True, "optimize": False, "verbose": False},
}


def torch_cnn() -> tuple[Any, tuple[Any, ...]]:
    """A small CNN: Conv-BN-ReLU, grouped Conv (no bias)-BN-ReLU6, 1x1 Conv-BN-LeakyReLU, pooling
    and a Linear; BN statistics randomized so that folding them matters."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            nn = torch.nn
            self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.c2, self.b2 = (
                nn.Conv2d(8, 8, 3, padding=1, groups=4, bias=False),
                nn.BatchNorm2d(8),
            )
            self.c3, self.b3 = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 10)

        def forward(self, x: Any) -> Any:
            f = torch.nn.functional
            x = torch.relu(self.b1(self.c1(x)))
            x = f.relu6(self.b2(self.c2(x)))
            x = f.leaky_relu(self.b3(self.c3(x)), 0.1)
            return self.fc(x.mean((2, 3)))

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for bn in (net.b1, net.b2, net.b3):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 2)
            bn.bias.uniform_(-1, 1)
    return net, (torch.randn(2, 3, 16, 16),)
