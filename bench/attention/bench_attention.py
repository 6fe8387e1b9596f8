"""ORT CPU latency: Attention-23 (fuse_attention + lower_attention, target onnx) against the
decomposed attention the exporters write, ORT optimizations on.

    python bench/attention/bench_attention.py MODEL.onnx [MODEL.onnx ...]   # exported decoders
    python bench/attention/bench_attention.py --core                          # attention core alone

Models: decoders with input_ids / attention_mask / position_ids (tests/fixtures/make_fixtures.py
with a larger config). Batch 1, sequence 128, no padding; median of --runs runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def session(model: onnx.ModelProto | str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def compare_ms(
    a: ort.InferenceSession, b: ort.InferenceSession, feeds: dict[str, np.ndarray], runs: int
) -> tuple[float, float]:
    """Median latencies of two sessions, runs interleaved (the machine's load hits both)."""
    for _ in range(3):
        a.run(None, feeds)
        b.run(None, feeds)
    ta, tb = [], []
    for _ in range(runs):
        for sess, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def optimized(path: str, fuse: bool) -> onnx.ModelProto:
    passes = ["convert_version", *fastopt.pipeline.registry.preset("classic")]
    if fuse:
        passes += ["fuse_attention", "lower_attention"]
    report = fastopt.optimize(path, passes=passes, target="onnx", options={"opset": 23})
    assert report.model is not None
    return report.model.to_onnx()


def core_models(hq: int, hkv: int, s: int, d: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """HF-style decomposed core (repeat_kv, sqrt-scale on Q and K^T, Where(bool) mask, Softmax,
    Where(IsNaN)) and the same as one Attention-23 node."""
    g = hq // hkv
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", f, [1, hq, s, d]),
        helper.make_tensor_value_info("k", f, [1, hkv, s, d]),
        helper.make_tensor_value_info("v", f, [1, hkv, s, d]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, s, s]),
    ]
    out = [helper.make_tensor_value_info("y", f, [1, hq, s, d])]
    c = lambda n, a: numpy_helper.from_array(np.asarray(a), n)  # noqa: E731
    root = float(d) ** -0.25
    inits = [
        c("ax", np.array([2], np.int64)),
        c("e5", np.array([1, hkv, g, s, d], np.int64)),
        c("s4", np.array([1, hq, s, d], np.int64)),
        c("r", np.array(root, np.float32)),
        c("zero", np.array(0.0, np.float32)),
        c("ninf", np.array(-np.inf, np.float32)),
    ]
    nodes = []
    for x in ("k", "v"):
        nodes += [
            helper.make_node("Unsqueeze", [x, "ax"], [x + "5"]),
            helper.make_node("Expand", [x + "5", "e5"], [x + "e"]),
            helper.make_node("Reshape", [x + "e", "s4"], [x + "r"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["q", "r"], ["qs"]),
        helper.make_node("Mul", ["kt", "r"], ["kts"]),
        helper.make_node("MatMul", ["qs", "kts"], ["sc"]),
        helper.make_node("Where", ["mask", "zero", "ninf"], ["bias"]),
        helper.make_node("Add", ["sc", "bias"], ["m"]),
        helper.make_node("Softmax", ["m"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["p0"]),
        helper.make_node("MatMul", ["p0", "vr"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "core", inputs, out, inits)
    decomposed = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    decomposed.ir_version = 10
    fused = fastopt.optimize(
        fastopt.from_onnx(decomposed),
        passes=["infer_shapes", "fuse_attention", "lower_attention"],
        target="onnx",
    )
    assert fused.model is not None
    return decomposed, fused.model.to_onnx()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--core", action="store_true")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.core:
        dec, fus = core_models(14, 2, a.seq, 64)
        assert sum(n.op_type == "Attention" for n in fus.graph.node) == 1
        rng = np.random.default_rng(0)
        feeds = {
            n: rng.standard_normal((1, h, a.seq, 64)).astype(np.float32)
            for n, h in (("q", 14), ("k", 2), ("v", 2))
        }
        feeds["mask"] = np.tril(np.ones((a.seq, a.seq), bool))[None, None]
        t_dec, t_fus = compare_ms(session(dec, a.threads), session(fus, a.threads), feeds, a.runs)
        print(
            f"core Hq=14 Hkv=2 S={a.seq} D=64: decomposed {t_dec:.3f} ms, "
            f"Attention-23 {t_fus:.3f} ms, ratio {t_fus / t_dec:.2f}"
        )
    for path in a.models:
        rng = np.random.default_rng(0)
        feeds = {
            "input_ids": rng.integers(0, 512, (1, a.seq), dtype=np.int64),
            "attention_mask": np.ones((1, a.seq), np.int64),
            "position_ids": np.arange(a.seq, dtype=np.int64)[None],
        }
        dec = session(optimized(path, False), a.threads)
        fus = session(optimized(path, True), a.threads)
        names = {i.name for i in dec.get_inputs()}
        t_dec, t_fus = compare_ms(dec, fus, {k: v for k, v in feeds.items() if k in names}, a.runs)
        print(
            f"{Path(path).parent.name}: decomposed {t_dec:.2f} ms, Attention-23 "
            f"{t_fus:.2f} ms, ratio {t_fus / t_dec:.2f}"
        )


if __name__ == "__main__":
    main()
