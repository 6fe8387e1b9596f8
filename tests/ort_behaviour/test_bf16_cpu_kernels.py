"""Which ops ONNX Runtime's CPU provider runs in bfloat16 (one single-node model per op): a test
that fails when ORT changes what the code relies on (issue 26; was the bench script
probe_bf16_cpu.py).

    python tests/ort_behaviour/test_bf16_cpu_kernels.py   # the ops that run, then the others

ORT 1.32's CPU provider has bf16 kernels for data movement, Cast and the norms only, none for
Add, Mul, MatMul, Softmax, ... . fastopt relies on both halves: a bf16 output is made for GPU
providers, so optimize's run check skips it with a note and `quantize --verify` prints "not
verified" instead of failing (fastopt/quant/step.py `not_for_cpu`, cli/quantize.py), while
tests/quant/test_convert_precision.py runs a bf16 graph of the ops CPU has. When this test
fails, ORT changed: update RUNS_IN_BF16 and those places (a CPU that runs bf16 compute can verify
bf16 outputs instead of skipping them).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

BF = TensorProto.BFLOAT16

# Ops probed with one bf16 input [2, 4, 8], and with two (CASES adds the rest).
UNARY = [
    "Neg",
    "Abs",
    "Sqrt",
    "Reciprocal",
    "Exp",
    "Log",
    "Tanh",
    "Erf",
    "Sigmoid",
    "Relu",
    "Sin",
    "Cos",
    "Softmax",
    "Identity",
    "IsNaN",
    "IsInf",
    "Floor",
    "Ceil",
    "Round",
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "Transpose",
    "Flatten",
    "Gelu",
    "Shape",
]
BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Less", "Greater", "MatMul"]
MS_UNARY = ["QuickGelu", "Gelu", "FastGelu", "BiasGelu"]


def bf16_input(name: str, shape: list[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, BF, shape)


def probe(op: str, inputs: list, attrs: dict, domain: str = "", n_out: int = 1) -> str:
    vis, feeds, names, inits = [], {}, [], []
    for k, spec in enumerate(inputs):
        name = f"i{k}"
        names.append(name)
        if isinstance(spec, np.ndarray):
            inits.append(onnx.numpy_helper.from_array(spec, name))
            continue
        vis.append(bf16_input(name, list(spec)))
        feeds[name] = np.zeros(spec, np.uint16)  # bf16 zeros, viewed
    outs = [helper.make_empty_tensor_value_info(f"o{k}") for k in range(n_out)]
    node = helper.make_node(op, names, [o.name for o in outs], domain=domain, **attrs)
    opsets = [helper.make_opsetid("", 22)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(
        helper.make_graph([node], "p", vis, outs, inits), opset_imports=opsets
    )
    model.ir_version = 10
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ort_feeds = {
            k: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(v, BF) for k, v in feeds.items()
        }
        s.run_with_ort_values(None, ort_feeds)
        return "ok"
    except Exception as e:
        return str(e).split("\n")[0][:120]


# What ORT 1.32's CPU provider runs in bfloat16, of the ops CASES probes; every other op has no
# bf16 kernel there (ORT answers NOT_IMPLEMENTED).
RUNS_IN_BF16 = {
    "Cast",
    "Concat",
    "ConstantOfShape",
    "Flatten",
    "Gather",
    "Identity",
    "IsInf",
    "IsNaN",
    "LayerNormalization",
    "Reshape",
    "Shape",
    "SimplifiedLayerNormalization",
    "Slice",
    "Split",
    "Squeeze",
    "Transpose",
    "Unsqueeze",
    "com.microsoft.SkipSimplifiedLayerNormalization",
}


def cases() -> dict[str, tuple[list, dict, str, int]]:
    """op (com.microsoft ops prefixed) -> (inputs, attributes, domain, outputs) of its probe."""
    shape = [2, 4, 8]
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    found: dict[str, tuple[list, dict, str, int]] = {op: ([shape], {}, "", 1) for op in UNARY}
    found.update({op: ([shape, shape], {}, "", 1) for op in BINARY})
    found["MatMul"] = ([shape, [8, 4]], {}, "", 1)
    found.update(
        {
            "Reshape": ([shape, i64(8, 8)], {}, "", 1),
            "Unsqueeze": ([shape, i64(0)], {}, "", 1),
            "Squeeze": ([[1, 4, 8], i64(0)], {}, "", 1),
            "Expand": ([[1, 4, 8], i64(2, 4, 8)], {}, "", 1),
            "Concat": ([shape, shape], {"axis": 0}, "", 1),
            "Slice": ([shape, i64(0), i64(1), i64(0)], {}, "", 1),
            "Gather": ([shape, i64(0, 1)], {"axis": 0}, "", 1),
            "Split": ([shape], {"axis": 0, "num_outputs": 2}, "", 2),
            "Where": ([np.array([True]), shape, shape], {}, "", 1),
            "Trilu": ([shape], {}, "", 1),
            "LayerNormalization": ([shape, [8], [8]], {}, "", 1),
            "SimplifiedLayerNormalization": ([shape, [8]], {}, "", 1),
            "ConstantOfShape": (
                [i64(2, 3)],
                {"value": helper.make_tensor("v", BF, [1], [0])},
                "",
                1,
            ),
            "Cast": ([shape], {"to": TensorProto.FLOAT}, "", 1),
        }
    )
    ms = "com.microsoft"
    for op in MS_UNARY:
        found[f"{ms}.{op}"] = ([shape, [8]] if op == "BiasGelu" else [shape], {}, ms, 1)
    found[f"{ms}.SkipSimplifiedLayerNormalization"] = ([shape, shape, [8]], {}, ms, 1)
    found[f"{ms}.MatMulNBits"] = (
        [shape, np.zeros((4, 1, 16), np.uint8), [4]],
        {"K": 8, "N": 4, "bits": 4, "block_size": 32},
        ms,
        1,
    )
    return found


CASES = cases()


def outcome(name: str) -> str:
    inputs, attrs, domain, n_out = CASES[name]
    return probe(name.rsplit(".", 1)[-1], inputs, attrs, domain, n_out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_bf16_kernels_are_as_the_code_assumes(name: str) -> None:
    result = outcome(name)
    if name in RUNS_IN_BF16:
        assert result == "ok", f"{name} no longer runs in bf16 on CPU: {result}"
    else:
        assert "NOT_IMPLEMENTED" in result, (
            f"{name} runs in bf16 on ORT {ort.__version__}'s CPU provider now ({result}): "
            "update RUNS_IN_BF16 and what relies on it (this file's docstring)"
        )


def main() -> None:
    results = {name: outcome(name) for name in CASES}
    ok = sorted(k for k, v in results.items() if v == "ok")
    print(f"onnxruntime {ort.__version__}: runs in bfloat16 on CPU:", ", ".join(ok))
    for k, v in sorted(results.items()):
        if v != "ok":
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
