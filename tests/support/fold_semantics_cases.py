"""The cases of tests/fold/test_fold_semantics.py: small graphs of constants over a table of edge
values (0, 1, -1, INT32_MIN/MAX, INT64_MIN/MAX, 2^31, 2^32, 2^53 + 1, ...), each node with its
own graph output, so that a refusal to fold one node leaves the others checked."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

# The integer values every integer op is tried on (wrapped into narrower types).
EDGES = [0, 1, -1, 7, -7, I32_MIN, I32_MAX, I64_MIN, I64_MAX, 2**31, 2**32, 2**53 + 1, -128]
FLOAT_EDGES = [0.0, -0.0, 0.5, -1.5, 127.9, 128.0, -129.0, 255.5, 65504.0, 65520.0, 2.0**31,
               -(2.0**31), 2.0**32, 2.0**63, -(2.0**63), 2.0**64, 1e38, np.inf, -np.inf,
               np.nan]  # fmt: skip
INT_TYPES = [np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16, np.uint32, np.uint64]
SIGNED = [np.int64, np.int32, np.int16, np.int8]

# Pipeline name -> passes. "cleanup" is the preset (the ONNX Runtime fallback included).
PIPELINES = {
    "fold_constants": ["fold_constants"],
    "fold_shapes": ["infer_shapes", "fold_shapes"],
    "cleanup": ["cleanup"],
}


@dataclass
class Case:
    name: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    folds: bool = False  # fold_constants must fold every node (the property alone allows none)
    keeps: str = ""  # an op no pipeline may fold: its value in ORT is undefined (machine-dependent)
    opset: int = 18

    def const(self, value: np.ndarray) -> str:
        name = f"c{len(self.inits)}"
        self.inits[name] = value
        return name

    def node(self, op: str, inputs: list[np.ndarray | str], output: bool = True, **attrs) -> str:
        names = [x if isinstance(x, str) else self.const(x) for x in inputs]
        y = f"y{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, names, [y], **attrs))
        if output:
            self.outputs.append(y)
        return y

    def model(self) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(a, n) for n, a in self.inits.items()]
        outs = [helper.make_value_info(o, onnx.TypeProto()) for o in self.outputs]
        graph = helper.make_graph(self.nodes, self.name, [], outs, inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 9
        return m


def edges(dtype: type) -> list[np.generic]:
    """EDGES wrapped into `dtype` (two's complement, as a Cast would), without repeats."""
    seen: dict[int, np.generic] = {}
    for v in EDGES:
        x = np.array(v, np.int64 if v <= I64_MAX else np.uint64).astype(dtype)[()]
        seen.setdefault(int(x), x)
    return list(seen.values())


def scalar(dtype: type, v: object) -> np.ndarray:
    return np.array(v).astype(dtype)


def arithmetic_cases() -> list[Case]:
    cases = []
    for dtype, op in itertools.product(INT_TYPES, ["Add", "Sub", "Mul", "Div"]):
        c = Case(f"{op}_{dtype.__name__}", folds=op != "Div" and dtype != np.uint64)
        for a, b in itertools.product(edges(dtype), edges(dtype)):
            # Division by 0 and by -1 (INT_MIN / -1 traps) get cases of their own.
            if op == "Div" and int(b) in (0, -1, np.iinfo(dtype).max):
                continue
            c.node(op, [scalar(dtype, a), scalar(dtype, b)])
        cases.append(c)
    for dtype in SIGNED:
        for a in edges(dtype):
            c = Case(f"Div_{dtype.__name__}_{int(a)}_by_minus_1")
            c.node("Div", [scalar(dtype, a), scalar(dtype, -1)])
            cases.append(c)
    for dtype in INT_TYPES:
        c = Case(f"Div_{dtype.__name__}_by_zero")
        c.node("Div", [scalar(dtype, 7), scalar(dtype, 0)])
        cases.append(c)
    for op in ["Neg", "Abs"]:
        for dtype in SIGNED:
            c = Case(f"{op}_{dtype.__name__}", folds=True)
            for a in edges(dtype):
                c.node(op, [scalar(dtype, a)])
            cases.append(c)
    # Mod (fmod 0: the divisor's sign), which the shape analysis computes on shape values.
    for dtype in (np.int64, np.int32):
        c = Case(f"Mod_{dtype.__name__}")
        for a, b in itertools.product(edges(dtype), edges(dtype)):
            if int(b) not in (0, -1):
                c.node("Mod", [scalar(dtype, a), scalar(dtype, b)])
        cases.append(c)
    # Ops left to the ONNX Runtime fallback: Mod, BitShift, Pow.
    c = Case("Mod_int64_min_by_minus_1")
    c.node("Mod", [scalar(np.int64, I64_MIN), scalar(np.int64, -1)])
    cases.append(c)
    c = Case("Mod_int64_by_zero")
    c.node("Mod", [scalar(np.int64, 5), scalar(np.int64, 0)])
    cases.append(c)
    c = Case("BitShift")
    for dtype, shift in [(np.uint64, 64), (np.uint64, 65), (np.uint8, 8), (np.uint32, 31)]:
        for direction in ["LEFT", "RIGHT"]:
            c.node("BitShift", [scalar(dtype, 3), scalar(dtype, shift)], direction=direction)
    cases.append(c)
    # ORT's integer Pow goes through doubles: 3^39 rounds (folded as ORT computes it); past
    # int64 the cast back is undefined (x86: INT64_MIN; others saturate): never folded.
    c = Case("Pow_int64")
    for base, exp in [(-2, 63), (3, 39), (2, 62), (7, -1)]:
        c.node("Pow", [scalar(np.int64, base), scalar(np.int64, exp)])
    cases.append(c)
    for base, exp in [(3, 40), (2, 63)]:
        c = Case(f"Pow_int64_{base}_{exp}_overflows", keeps="Pow")
        c.node("Pow", [scalar(np.int64, base), scalar(np.int64, exp)])
        cases.append(c)
    return cases


CAST_TARGETS = [
    TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8,
    TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64,
    TensorProto.BOOL, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
]  # fmt: skip


def cast_cases() -> list[Case]:
    cases = []
    for to in CAST_TARGETS:
        name = TensorProto.DataType.Name(to).lower()
        c = Case(f"Cast_int64_to_{name}", folds=to != TensorProto.FLOAT16)
        for a in edges(np.int64):
            c.node("Cast", [scalar(np.int64, a)], to=to)
        cases.append(c)
        for src in [np.float32, np.float64]:
            c = Case(f"Cast_{src.__name__}_to_{name}")
            for f in FLOAT_EDGES:
                c.node("Cast", [scalar(src, f)], to=to)
            cases.append(c)
    # A narrowing round trip: int64 -> int32 -> int64 must wrap (INT64_MAX -> -1), through the
    # shape analysis (fold_shapes) as through the evaluator; and as a Slice end.
    for mid in [TensorProto.INT32, TensorProto.INT16, TensorProto.UINT8, TensorProto.UINT32]:
        c = Case(f"Cast_roundtrip_through_{TensorProto.DataType.Name(mid).lower()}")
        for a in edges(np.int64):
            inner = c.node("Cast", [scalar(np.int64, a)], output=False, to=mid)
            c.node("Cast", [inner], to=TensorProto.INT64)
        cases.append(c)
    c = Case("Slice_end_through_int32_cast")
    data = np.arange(6, dtype=np.int64)
    for end in [I64_MAX, 2**32 + 3, 2**31]:
        inner = c.node("Cast", [np.array([end], np.int64)], output=False, to=TensorProto.INT32)
        back = c.node("Cast", [inner], output=False, to=TensorProto.INT64)
        c.node("Slice", [data, np.array([0], np.int64), back])
        # A float input: its output's length through the shape analysis.
        sliced = c.node("Slice", [data.astype(np.float32), np.array([0], np.int64), back])
        c.node("Shape", [sliced])
    cases.append(c)
    return cases


SLICE_BOUNDS = [0, 1, -1, 4, 5, 6, -6, I32_MIN, I32_MAX, I64_MIN, I64_MAX]
SLICE_STEPS = [1, -1, 2, -3, I64_MAX, -I64_MAX, I64_MIN]


def slice_cases() -> list[Case]:
    cases = []
    for n in [5, 0]:
        c = Case(f"Slice_int64_length_{n}")
        data = np.arange(n, dtype=np.int64)
        for s, e, step in itertools.product(SLICE_BOUNDS, SLICE_BOUNDS, SLICE_STEPS):
            ints = [np.array([v], np.int64) for v in (s, e, 0, step)]
            c.node("Slice", [data, *ints])
        cases.append(c)
    # Starts/ends given as int32 (INT32_MAX as an int32 end).
    c = Case("Slice_int32_bounds")
    data = np.arange(5, dtype=np.int64)
    for s, e, step in itertools.product([0, -1, 4], [I32_MAX, I32_MIN, -1, 0], [1, -1, -2]):
        ints = [np.array([v], np.int32) for v in (s, e, 0, step)]
        c.node("Slice", [data, *ints])
    cases.append(c)
    # The lengths through the shape analysis: Shape(Slice(x)) of a float x.
    c = Case("Slice_shape_of_float")
    data = np.arange(5, dtype=np.float32)
    for s, e, step in itertools.product([0, -1, 4, I64_MIN, I64_MAX], SLICE_BOUNDS, [1, -1, -2]):
        ints = [np.array([v], np.int64) for v in (s, e, 0, step)]
        c.node("Shape", [c.node("Slice", [data, *ints])])
    cases.append(c)
    c = Case("slice_negative_step_end_int_max")
    for end in [I64_MAX, I32_MAX]:
        ints = [np.array([v], np.int64) for v in (-1, end, 0, -1)]
        c.node("Slice", [np.arange(5, dtype=np.int64), *ints])
    cases.append(c)
    return cases


RANGES = [
    (0, 5, 1),
    (5, 0, -2),
    (I64_MIN, I64_MIN + 3, 1),
    (I64_MAX - 2, I64_MAX, 1),
    (I64_MAX - 1, I64_MAX, 5),
    (I64_MIN, I64_MAX, I64_MAX),
    (I64_MAX, I64_MIN, I64_MIN),
    (0, 2**62 + 1, 2**61),
    (1, 2**62 + 3, 2**61),
    (0, 2**53 + 1, 2**52),
    (I32_MIN, I32_MAX, I32_MAX),
    (I32_MAX, I32_MIN, -(2**30)),
    (0, I64_MAX, 1),
    (I64_MIN, 0, -1),
]


def range_cases() -> list[Case]:
    cases = []
    for dtype in [np.int64, np.int32, np.int16]:
        for i, (start, limit, delta) in enumerate(RANGES):
            args = [np.array(v).astype(dtype) for v in (start, limit, delta)]
            if int(args[2]) == 0:
                continue
            # Each alone: a huge one fails in ONNX Runtime, which must not hide the others.
            c = Case(f"Range_{dtype.__name__}_{i}")
            c.node("Shape", [c.node("Range", args)])
            cases.append(c)
    return cases


CASES = arithmetic_cases() + cast_cases() + slice_cases() + range_cases()
