"""What ONNX Runtime's u8s8 integer GEMM computes on x86 CPUs without VNNI, emulated in standard
ops, so that tests on any machine can measure it.

There MLAS multiplies uint8 activations by int8 weights with VPMADDUBSW, which adds each pair of
products along K (k = 2j, 2j + 1) into an int16 with saturation; VPMADDWD then widens the pairs to
int32 exactly. A pair of full-range values (255 * 127 * 2 = 64770) saturates at 32767; 7-bit
weights (|b| <= 64: 255 * 64 * 2 = 32640) never do, which is what quantize_dynamic's
reduce_range is for. Zero points are applied after the raw product, from row and column sums.

``emulate_saturation(src, dst)`` rewrites each MatMulInteger(A uint8, B int8 constant, a_zp[,
b_zp]) of an int8-dynamic model for target onnx into that computation (float32 throughout: the
fixtures' sums stay below 2^24, so it is exact), keeping the int32 output.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def saturating_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The raw u8 x s8 product as the non-VNNI kernel computes it (no zero points)."""
    k = a.shape[-1]
    a2 = a.astype(np.int64).reshape(*a.shape[:-1], k // 2, 2)
    b2 = b.astype(np.int64).reshape(k // 2, 2, -1)
    pairs = np.einsum("...jt,jtn->...jn", a2, b2)
    return np.clip(pairs, -32768, 32767).sum(axis=-2)


def emulate_saturation(src: Path, dst: Path) -> int:
    """Writes `src` with every MatMulInteger emulated as above; returns how many."""
    m = onnx.load(str(src))
    inits = {t.name: t for t in m.graph.initializer}
    nodes: list[onnx.NodeProto] = []
    count = 0
    for n in m.graph.node:
        if n.op_type != "MatMulInteger" or n.input[1] not in inits:
            nodes.append(n)
            continue
        count += 1
        b = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
        k, cols = b.shape
        assert k % 2 == 0, "odd K: the kernel pads with a zero row"
        p = f"{n.output[0]}__sat"

        def c(name: str, value: np.ndarray, p: str = p) -> str:
            m.graph.initializer.append(numpy_helper.from_array(value, f"{p}/{name}"))
            return f"{p}/{name}"

        def op(op_type: str, inputs: list[str], out: str, p: str = p, **attrs: object) -> str:
            nodes.append(helper.make_node(op_type, inputs, [f"{p}/{out}"], **attrs))
            return f"{p}/{out}"

        bzp = np.zeros((), np.float32)
        if len(n.input) > 3 and n.input[3]:
            bzp = numpy_helper.to_array(inits[n.input[3]]).astype(np.float32)
        azp = n.input[2] if len(n.input) > 2 and n.input[2] else c("azp0", np.array(0, np.uint8))
        af = op("Cast", [n.input[0]], "af", to=TensorProto.FLOAT)
        azf = op("Cast", [azp], "azf", to=TensorProto.FLOAT)
        rows = op("Reshape", [af, c("rows", np.array([-1, k]))], "rows2d")  # (R, K)
        pairs_a = op("Reshape", [af, c("pairs", np.array([-1, k // 2, 2]))], "a3")  # (R, K/2, 2)
        pairs = op(
            "Einsum", [pairs_a, c("b3", b.reshape(k // 2, 2, cols))], "p", equation="rjt,jtn->rjn"
        )
        lo, hi = c("lo", np.array(-32768, np.float32)), c("hi", np.array(32767, np.float32))
        sat = op("Clip", [pairs, lo, hi], "sat")
        raw = op("ReduceSum", [sat, c("ax1", np.array([1]))], "raw", keepdims=0)  # (R, N)
        # raw - a_zp * colsum(B) - rowsum(A) * b_zp + K * a_zp * b_zp
        rowsum = op("ReduceSum", [rows, c("ax2", np.array([1]))], "rowsum", keepdims=1)
        y = op("Sub", [raw, op("Mul", [azf, c("colsum", b.sum(0))], "c1")], "y1")
        y = op("Sub", [y, op("Mul", [rowsum, c("bzp", bzp)], "c2")], "y2")
        y = op("Add", [y, op("Mul", [azf, c("kbzp", k * bzp)], "c3")], "y3")
        lead = op(
            "Slice",
            [op("Shape", [n.input[0]], "ashape"), c("s0", np.array([0])), c("s1", np.array([-1]))],
            "lead",
        )
        shape = op("Concat", [lead, c("n", np.array([cols]))], "oshape", axis=0)
        y = op("Reshape", [y, shape], "y4")
        nodes.append(helper.make_node("Cast", [y], [n.output[0]], to=TensorProto.INT32))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    onnx.save(m, str(dst))
    return count
