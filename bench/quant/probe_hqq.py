"""Does an HQQ-style refinement beat fastopt's search (csrc/quant/search.cc) on a real model?

HQQ (Badri & Shaji 2023): per block, alternate codes from (scale, zero) with a zero point refit on
the error shrunk by an l_p proximal step (p = 0.7, beta growing by kappa), the scale fixed at the
range's. Prototyped here in numpy, in MatMulNBits' format (integer 4-bit zero points) and, for
reference, with float zero points (a wider format: one more float per block). Compared with the
search on each MatMul weight of the model (relative MSE) and on the logits (KL of next-token
distributions vs fp32, weights fake-quantized the same way for both: dequantized float weights in
the float graph, so the comparison holds the activations' rounding out).

    nice flock /tmp/heavy.lock python bench/quant/probe_hqq.py /tmp/qsearch-smollm2/fp32/model.onnx
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def hqq_blocks(w: np.ndarray, bs: int, integer_zero: bool, iters: int = 20) -> np.ndarray:
    """HQQ asymmetric 4-bit of w [K, N] blockwise along K; returns the dequantized weight."""
    k, n = w.shape
    pad = -k % bs
    x = np.pad(w.astype(np.float32), ((0, pad), (0, 0))).T.reshape(-1, bs)  # [N * kb, bs]
    lo = np.minimum(x.min(1, keepdims=True), 0)
    hi = np.maximum(x.max(1, keepdims=True), 0)
    inv = np.where(hi > lo, 15.0 / np.maximum(hi - lo, 1e-30), 0.0)  # HQQ's "scale": 1/s
    zero = -lo * inv
    if integer_zero:
        zero = np.clip(np.round(zero), 0, 15)
    beta, kappa, p = 10.0, 1.01, 0.7
    best = np.full((x.shape[0], 1), np.inf)
    best_zero = zero.copy()
    safe = np.where(inv > 0, inv, 1.0)
    for _ in range(iters):
        q = np.clip(np.round(x * inv + zero), 0, 15)
        r = (q - zero) / safe
        err = np.abs(x - r).mean(1, keepdims=True)
        better = err < best
        best = np.where(better, err, best)
        best_zero = np.where(better, zero, best_zero)
        e = x - r
        a = np.abs(e)
        e = np.sign(e) * np.maximum(a - (1.0 / beta) * np.power(a + 1e-30, p - 1), 0)
        zero = (q - (x - e) * inv).mean(1, keepdims=True)
        if integer_zero:
            zero = np.clip(np.round(zero), 0, 15)
        beta *= kappa
    q = np.clip(np.round(x * inv + best_zero), 0, 15)
    r = (q - best_zero) / safe
    return r.reshape(n, -1)[:, :k].T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--hf", default="/work/cache/smollm2")
    ap.add_argument("--blocks", default="32,128")
    args = ap.parse_args()
    import fastopt
    from bench_quantize_accuracy import PROSE, logits_of, metrics
    from support.quant_reference import dequantize_nbits
    from transformers import AutoTokenizer

    proto = onnx.load(args.model)
    weights = {}
    used_as_b = {n.input[1] for n in proto.graph.node if n.op_type == "MatMul"}
    for t in proto.graph.initializer:
        if t.name in used_as_b and len(t.dims) == 2:
            weights[t.name] = numpy_helper.to_array(t)
    ids = np.array([AutoTokenizer.from_pretrained(args.hf)(PROSE)["input_ids"]], np.int64)

    def run(p: onnx.ModelProto) -> np.ndarray:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "m.onnx"
            onnx.save(p, str(path))
            return logits_of(path, ids)

    ref = run(proto)
    print("| block | method | size-weighted rel MSE | KL (fake-quant) | perplexity | top-1 | s |")
    print("|---|---|---|---|---|---|---|")
    for bs in (int(b) for b in args.blocks.split(",")):
        for method in ("search asym", "hqq asym int zp", "hqq asym float zp"):
            t0 = time.perf_counter()
            deq: dict[str, np.ndarray] = {}
            if method.startswith("search"):
                r = fastopt.quantize(
                    args.model, mode="int4", block_size=bs, symmetric=False, method="search"
                )
                assert r.model is not None
                for node in r.model.graph.nodes:
                    if node.op_type == "MatMulNBits":
                        name = node.inputs[1].name.removesuffix("_Q4")
                        k = weights[name].shape[0]
                        deq[name] = dequantize_nbits(
                            node.inputs[1].initializer.numpy(),
                            node.inputs[2].initializer.numpy(),
                            node.inputs[3].initializer.numpy(),
                            4,
                            k,
                        )
            else:
                for name, w in weights.items():
                    deq[name] = hqq_blocks(w, bs, integer_zero="int zp" in method)
            dt = time.perf_counter() - t0
            num = sum(((w.astype(np.float64) - deq[n]) ** 2).sum() for n, w in weights.items())
            den = sum((w.astype(np.float64) ** 2).sum() for w in weights.values())
            fake = onnx.ModelProto()
            fake.CopyFrom(proto)
            for t in fake.graph.initializer:
                if t.name in deq:
                    t.CopyFrom(numpy_helper.from_array(deq[t.name].astype(np.float32), t.name))
            m = metrics(ref, run(fake), ids)
            print(
                f"| {bs} | {method} | {num / den:.4e} | {m['kl']:.4f} | {m['ppl']:.3f} |"
                f" {m['top1']:.3f} | {dt:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
