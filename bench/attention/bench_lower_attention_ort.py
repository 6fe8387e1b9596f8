"""Latency of one attention block on ONNX Runtime CPU (its optimizations ON), per lowering of
the internal Attention op (lower_attention, target ort) vs the decomposed standard ops.

    python bench/attention/bench_lower_attention_ort.py [--seq 128] [--batch 1] [--runs 200]

Block: q3 (B,S,Hq*D), k3/v3 (B,S,Hkv*D) -> head split -> attention -> head merge -> (B,S,Hq*D);
default size hidden 896, 14 heads, 2 kv heads, head 64 (a Qwen2-0.5B layer), fp32. Masks:
"causal" (is_causal=1, no mask) and "mask" (is_causal=0 with a full bool (B,1,S,S) mask, causal
+ padding, the form the exporters build). Writes a markdown table to stdout."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # support
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "attention"))
from test_lower_attention_ort import Case, build

THREADS = 1


def decomposed(c: Case) -> onnx.ModelProto:
    """The same block as standard ops: repeat_kv, MatMul, scale, mask, Softmax, MatMul."""
    model = build(c)
    g = model.graph
    att = next(n for n in g.node if n.op_type == "Attention")
    idx = list(g.node).index(att)
    g.node.remove(att)
    group = c.hq // c.hkv
    nodes, inits = [], []

    def const(name: str, arr: np.ndarray) -> str:
        inits.append(onnx.numpy_helper.from_array(arr, name))
        return name

    kv = {}
    for x in ("k", "v"):
        if group > 1:
            nodes.append(helper.make_node("Unsqueeze", [x, const("ax2", np.array([2]))], [f"{x}5"]))
            exp = const("rep", np.array([1, 1, group, 1, 1]))
            nodes.append(helper.make_node("Expand", [f"{x}5", exp], [f"{x}e"]))
            shp = const("hq_shape", np.array([0, c.hq, -1, c.d]))
            nodes.append(helper.make_node("Reshape", [f"{x}e", shp], [f"{x}r"]))
            kv[x] = f"{x}r"
        else:
            kv[x] = x
    nodes.append(helper.make_node("Transpose", [kv["k"]], ["kt"], perm=[0, 1, 3, 2]))
    nodes.append(helper.make_node("MatMul", ["q", "kt"], ["qk"]))
    scale = const("scale", np.array(1 / np.sqrt(c.d), np.float32))
    nodes.append(helper.make_node("Mul", ["qk", scale], ["scores"]))
    last = "scores"
    if c.causal:
        tri = np.triu(np.full((c.s, c.s), np.finfo(np.float32).min, np.float32), 1)
        nodes.append(helper.make_node("Add", [last, const("causal", tri)], ["masked"]))
        last = "masked"
    if c.mask:
        zero, low = (
            const("zero", np.array(0, np.float32)),
            const("low", np.array(-3.4e38, np.float32)),
        )
        nodes.append(helper.make_node("Where", ["mask", zero, low], ["bias"]))
        nodes.append(helper.make_node("Add", [last, "bias"], ["masked2"]))
        last = "masked2"
    nodes.append(helper.make_node("Softmax", [last], ["p"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["p", kv["v"]], ["y4"]))
    for n in reversed(nodes):
        g.node.insert(idx, n)
    g.initializer.extend(inits)
    del model.opset_import[1:]
    return model


def latency(model: onnx.ModelProto, feeds: dict[str, np.ndarray], runs: int) -> float:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = THREADS
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    for _ in range(5):
        sess.run(None, feeds)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def lowered(c: Case, **options: int) -> tuple[onnx.ModelProto, str]:
    report = fastopt.optimize(
        fastopt.from_onnx(build(c)),
        passes=["lower_attention", "eliminate_dead_nodes"],
        options=options,
    )
    assert report.model is not None
    out = report.model.to_onnx()
    ops = [n.op_type for n in out.graph.node if "Attention" in n.op_type]
    return out, ",".join(ops)


def gqa_for_mha(c: Case) -> onnx.ModelProto:
    """GroupQueryAttention for Hkv == Hq (to compare with the MHA lowering)."""
    model, _ = lowered(Case(**{**c.__dict__, "hkv": c.hq // 2}))
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention":
            for a in n.attribute:
                if a.name == "kv_num_heads":
                    a.i = c.hq
    for i in model.graph.input:
        if i.name in ("k3", "v3"):
            i.type.tensor_type.shape.dim[2].dim_value = c.hq * c.d
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    global THREADS
    THREADS = args.threads
    print(
        f"ORT {ort.__version__} CPU, {args.threads} thread(s), optimizations ON, "
        f"batch {args.batch}, seq {args.seq}, fp32, head 64; median of {args.runs} runs (ms)\n"
    )
    print("| heads (q/kv) | mask | variant | ops | ms |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for hkv in (2, 14):
        for mask in (None, "bool"):
            c = Case(
                hq=14, hkv=hkv, s=args.seq, d=64, b=args.batch, causal=0 if mask else 1, mask=mask
            )
            feeds = {
                "q3": rng.standard_normal((c.b, c.s, c.hq * c.d)).astype(np.float32),
                "k3": rng.standard_normal((c.b, c.s, c.hkv * c.d)).astype(np.float32),
                "v3": rng.standard_normal((c.b, c.s, c.hkv * c.d)).astype(np.float32),
            }
            if mask:
                m = np.tril(np.ones((c.s, c.s), bool))[None, None].repeat(c.b, 0)
                feeds["mask"] = m
            variants = [("decomposed", decomposed(c), "")]
            variants.append(("lowered (default)", *lowered(c)))
            if hkv != 14:
                variants.append(("lowered cuda=1", *lowered(c, cuda=1)))
            else:
                variants.append(("GQA instead", gqa_for_mha(c), "GroupQueryAttention"))
            for name, model, ops in variants:
                ms = latency(model, feeds, args.runs)
                print(
                    f"| {c.hq}/{c.hkv} | {'full bool' if mask else 'is_causal'} | {name} "
                    f"| {ops} | {ms:.3f} |"
                )


if __name__ == "__main__":
    main()
