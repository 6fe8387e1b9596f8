"""Which ops ONNX Runtime's CPU provider runs in bfloat16 (one single-node model per op).

    python bench/probe_bf16_cpu.py          # prints the ops that load and run, then the rest

convert_precision's bf16 mode keeps the ops that fail here in float32 (csrc/passes/quant/
convert_precision.cc, kBf16CpuOps); re-run this when onnxruntime is upgraded.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

BF = TensorProto.BFLOAT16
X = np.ones((2, 4, 8), np.float32)

# op -> (inputs as (dtype, shape) or an int64 constant, attributes, domain)
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


def main() -> None:
    shape = [2, 4, 8]
    i64 = lambda *v: np.array(v, np.int64)  # noqa: E731
    cases: dict[str, tuple] = {op: ([shape], {}) for op in UNARY}
    cases.update({op: ([shape, shape], {}) for op in BINARY})
    cases["MatMul"] = ([shape, [8, 4]], {})
    cases.update(
        {
            "Reshape": ([shape, i64(8, 8)], {}),
            "Unsqueeze": ([shape, i64(0)], {}),
            "Squeeze": ([[1, 4, 8], i64(0)], {}),
            "Expand": ([[1, 4, 8], i64(2, 4, 8)], {}),
            "Concat": ([shape, shape], {"axis": 0}),
            "Slice": ([shape, i64(0), i64(1), i64(0)], {}),
            "Gather": ([shape, i64(0, 1)], {"axis": 0}),
            "Split": ([shape], {"axis": 0, "num_outputs": 2}),
            "Where": ([np.array([True]), shape, shape], {}),
            "Trilu": ([shape], {}),
            "LayerNormalization": ([shape, [8], [8]], {}),
            "SimplifiedLayerNormalization": ([shape, [8]], {}),
            "ConstantOfShape": ([i64(2, 3)], {"value": helper.make_tensor("v", BF, [1], [0])}),
            "Cast": ([shape], {"to": TensorProto.FLOAT}),
        }
    )
    results = {}
    for op, (ins, attrs) in cases.items():
        n_out = 2 if op == "Split" else 1
        results[op] = probe(op, ins, attrs, n_out=n_out)
    for op in MS_UNARY:
        ins = [shape, [8]] if op == "BiasGelu" else [shape]
        results["com.microsoft." + op] = probe(op, ins, {}, "com.microsoft")
    results["com.microsoft.SkipSimplifiedLayerNormalization"] = probe(
        "SkipSimplifiedLayerNormalization", [shape, shape, [8]], {}, "com.microsoft"
    )
    results["com.microsoft.MatMulNBits"] = probe(
        "MatMulNBits",
        [shape, np.zeros((4, 1, 16), np.uint8), [4]],
        {"K": 8, "N": 4, "bits": 4, "block_size": 32},
        "com.microsoft",
    )
    ok = sorted(k for k, v in results.items() if v == "ok")
    print(f"onnxruntime {ort.__version__}: runs in bfloat16 on CPU:", ", ".join(ok))
    for k, v in sorted(results.items()):
        if v != "ok":
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
