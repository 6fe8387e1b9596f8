"""Accuracy of weight-only int4/int8 rounding methods on a real trained model, peers side by side.

Exports a transformers causal LM (no cache, fp32, TorchScript exporter) once into --work, then for
each variant quantizes it and runs it in ONNX Runtime on a few hundred tokens of English prose
(below; written for this benchmark), against the fp32 export:
  KL(fp32 || quantized) of the next-token distributions (mean over positions), perplexity of the
  text, top-1 agreement with fp32, quantize wall time and output size.
Variants: fastopt --method rtn / search, symmetric and asymmetric, block 32 and 128, int8 and an
int8 lm_head; onnxruntime's MatMulNBitsQuantizer RTN and k_quant (algo_config).

    nice flock /tmp/heavy.lock python bench/quant/bench_quantize_accuracy.py \
        --model /work/cache/smollm2 --work /tmp/qsearch-smollm2

Standalone on purpose (the real-text evaluation module of fastopt is another part's job).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

PROSE = """\
The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only
people who saw it up close were the keeper and the men who brought his supplies. In winter the
sea came over the path twice a day, so the keeper learned to plan his errands around the tides.
He kept a notebook in which he wrote the weather each morning, the ships he saw, and the birds
that rested on the railing of the gallery. Over thirty years the notebook became a small library,
and when a university asked to borrow it, he was surprised that anyone cared about the wind.
Scientists later used his records to show how storms along the coast had grown more frequent.
The town below the cliff changed slowly. A bakery opened where the old post office had been, and
the school added a room for children who arrived on the early bus from the farms. On Saturdays
the market filled the square with apples, cheese, wool and second-hand books. Visitors came in
summer to walk the cliffs, and some of them climbed the hill to look at the lighthouse, though
the door was locked and the keeper rarely came down to talk. When the light was finally
automated, the keeper moved into a cottage near the harbour. He still woke before dawn, still
looked first at the sky, and still wrote a line about the weather in a new notebook. His
neighbours said he seemed happier than they expected, because he could now watch the boats come
home instead of only counting their lights. Every evening he walked to the end of the pier,
checked the direction of the wind, and then went home to cook a simple supper of fish, potatoes
and bread. In his last years he taught the children at the school how to read the clouds, how
to tell a squall from a passing shower, and why a red sky at night often means a calm morning.
Many of them remembered those lessons long after they had forgotten their arithmetic.
"""


def export(model_dir: str, out: Path) -> Path:
    path = out / "model.onnx"
    if path.exists():
        return path
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
        ) -> torch.Tensor:
            # mask and positions as inputs: without them transformers traces aten::diff
            return self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).logits

    out.mkdir(parents=True, exist_ok=True)
    ids = torch.ones((1, 8), dtype=torch.int64)
    names = ["input_ids", "attention_mask", "position_ids"]
    with torch.no_grad():
        torch.onnx.export(
            Logits(),
            (ids, torch.ones_like(ids), torch.arange(8)[None]),
            str(path),
            input_names=names,
            output_names=["logits"],
            dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "logits"]},
            opset_version=17,
            dynamo=False,
        )
    return path


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logits_of(path: Path, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
    }
    return s.run(None, feeds)[0][0]


def metrics(ref: np.ndarray, got: np.ndarray, ids: np.ndarray) -> dict[str, float]:
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    nxt = ids[0, 1:]
    nll = -lq[:-1][np.arange(len(nxt)), nxt].mean()
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
    return {"kl": kl, "ppl": float(np.exp(nll)), "top1": top1}


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file())


def fastopt_variant(src: Path, out: Path, **kw: object) -> Callable[[], float]:
    def run() -> float:
        import fastopt

        t0 = time.perf_counter()
        r = fastopt.quantize(src, out, **kw)  # type: ignore[arg-type]
        dt = time.perf_counter() - t0
        q = [w for w in r.weights if w.action == "quantized"]
        total = sum(w.bytes_before for w in q)
        rel = sum(w.rel_mse * w.bytes_before for w in q) / max(total, 1)
        print(f"    fastopt: {len(q)} weights, size-weighted rel MSE {rel:.3e}")
        return dt

    return run


def ort_variant(src: Path, out: Path, algo: str, block: int, sym: bool) -> Callable[[], float]:
    def run() -> float:
        import onnx
        from onnxruntime.quantization import matmul_nbits_quantizer as mnq

        t0 = time.perf_counter()
        model = onnx.load(str(src))
        if algo == "k_quant":
            cfg = mnq.KQuantWeightOnlyQuantConfig()
        elif algo == "hqq":
            cfg = mnq.HQQWeightOnlyQuantConfig(block_size=block, bits=4)
        else:
            cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=sym)
        q = mnq.MatMulNBitsQuantizer(
            model, block_size=block, is_symmetric=sym, accuracy_level=4, algo_config=cfg
        )
        q.process()
        q.model.save_model_to_file(str(out), use_external_data_format=False)
        return time.perf_counter() - t0

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/work/cache/smollm2")
    ap.add_argument("--work", default="/tmp/qsearch-smollm2")
    ap.add_argument("--only", default="", help="comma-separated variant name prefixes")
    ap.add_argument("--peers", action="store_true", help="also onnxruntime's quantizer")
    args = ap.parse_args()
    work = Path(args.work)
    src = export(args.model, work / "fp32")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    ids = np.array([tok(PROSE)["input_ids"]], dtype=np.int64)
    ref = logits_of(src, ids)
    base = metrics(ref, ref, ids)
    print(f"{ids.shape[1]} tokens; fp32 perplexity {base['ppl']:.3f}")

    variants: dict[str, Callable[[], float]] = {}
    for bits in (4,):
        for bs in (32, 128):
            for sym in (True, False):
                for method in ("rtn", "search"):
                    name = f"fastopt int{bits} b{bs} {'sym' if sym else 'asym'} {method}"
                    d = work / name.replace(" ", "_")
                    d.mkdir(parents=True, exist_ok=True)
                    variants[name] = fastopt_variant(
                        src,
                        d / "model.onnx",
                        mode=f"int{bits}",
                        block_size=bs,
                        symmetric=sym,
                        method=method,
                    )
    for method in ("rtn", "search"):
        name = f"fastopt int4 b32 sym {method} + int8 lm_head"
        d = work / name.replace(" ", "_").replace("+", "p")
        d.mkdir(parents=True, exist_ok=True)
        variants[name] = fastopt_variant(
            src, d / "model.onnx", mode="int4", lm_head="int8", method=method
        )
        name = f"fastopt int8 b32 sym {method}"
        d = work / name.replace(" ", "_")
        d.mkdir(parents=True, exist_ok=True)
        variants[name] = fastopt_variant(src, d / "model.onnx", mode="int8", method=method)
    if args.peers:
        peers = (
            ("k_quant", 32, True),
            ("k_quant", 32, False),
            ("k_quant", 64, False),
            ("k_quant", 128, False),
        )
        for algo, bs, sym in peers:
            name = f"ort {algo} b{bs} {'sym' if sym else 'asym'}"
            d = work / name.replace(" ", "_")
            d.mkdir(parents=True, exist_ok=True)
            variants[name] = ort_variant(src, d / "model.onnx", algo, bs, sym)
    only = [p for p in args.only.split(",") if p]
    head = f"perplexity (fp32 {base['ppl']:.2f})"
    print(f"| variant | KL vs fp32 | {head} | top-1 vs fp32 | quantize s | size MB |")
    print("|---|---|---|---|---|---|")
    for name, run in variants.items():
        if only and not any(name.startswith(p) for p in only):
            continue
        try:
            dt = run()
        except Exception as e:  # a peer that fails is a row saying so
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | | | | |", flush=True)
            continue
        out = work / name.replace(" ", "_").replace("+", "p") / "model.onnx"
        m = metrics(ref, logits_of(out, ids), ids)
        rise = 100 * (m["ppl"] / base["ppl"] - 1)
        print(
            f"| {name} | {m['kl']:.4f} | {m['ppl']:.3f} ({rise:+.1f} %)"
            f" | {m['top1']:.3f} | {dt:.1f} | {size_of(out) / 1e6:.0f} |",
            flush=True,
        )
        for f in out.parent.iterdir():
            f.unlink()
    os.sync()


if __name__ == "__main__":
    main()
