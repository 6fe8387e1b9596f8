"""Does onnxruntime's CPU MatMulNBits take float zero points (the scales' type, [N, k_blocks]) at
accuracy levels 0, 1 and 4, exactly, and how fast against uint8 zero points? One 1536 x 576
weight, block 64, 256 rows of activations, 2 threads.

    nice python bench/quant/probe_float_zero_points.py
"""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

RUNS = 40


def main() -> None:
    rng = np.random.default_rng(0)
    k, n, bs, m = 1536, 576, 64, 256
    kb = k // bs
    for dt, npdt in ((TensorProto.FLOAT, np.float32), (TensorProto.FLOAT16, np.float16)):
        w = rng.standard_normal((k, n)).astype(np.float32)
        blocks = w.T.reshape(n, kb, bs)
        lo, hi = blocks.min(-1), blocks.max(-1)
        s = ((hi - lo) / 15).astype(npdt).astype(np.float32)
        mn = lo.astype(npdt).astype(np.float32)
        q = np.clip(np.round((blocks - mn[..., None]) / s[..., None]), 0, 15).astype(np.uint8)
        zp = (-mn / s).astype(npdt)  # MatMulNBits: x = (q - zp) * s
        deq = (q - zp.astype(np.float32)[..., None]) * s[..., None]
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        a = rng.standard_normal((1, m, k)).astype(npdt)
        ref = a.astype(np.float32) @ deq.reshape(n, k).T
        zp_u8 = np.full((n, (kb + 1) // 2), 0x88, np.uint8)  # speed only
        for level in (0, 1, 4):
            for kind, z in (("float", zp.reshape(n, kb)), ("uint8", zp_u8)):
                node = helper.make_node(
                    "MatMulNBits",
                    ["A", "B", "S", "Z"],
                    ["Y"],
                    domain="com.microsoft",
                    K=k,
                    N=n,
                    bits=4,
                    block_size=bs,
                    accuracy_level=level,
                )
                inits = [
                    numpy_helper.from_array(packed, "B"),
                    numpy_helper.from_array(s.astype(npdt).reshape(n, kb), "S"),
                    numpy_helper.from_array(z, "Z"),
                ]
                g = helper.make_graph(
                    [node],
                    "g",
                    [helper.make_tensor_value_info("A", dt, [1, m, k])],
                    [helper.make_tensor_value_info("Y", dt, [1, m, n])],
                    inits,
                )
                opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
                model = helper.make_model(g, opset_imports=opsets)
                so = ort.SessionOptions()
                so.intra_op_num_threads = 2
                sess = ort.InferenceSession(model.SerializeToString(), so)
                y = sess.run(None, {"A": a})[0].astype(np.float32)
                t = time.perf_counter()
                for _ in range(RUNS):
                    sess.run(None, {"A": a})
                ms = (time.perf_counter() - t) / RUNS * 1e3
                err = np.abs(y - ref).max() / np.abs(ref).max()
                exact = f"rel max err {err:.2e}" if kind == "float" else "(codes not matched)"
                print(f"{npdt.__name__} {kind} zero points, level {level}: {ms:.2f} ms {exact}")


if __name__ == "__main__":
    main()
