"""fastopt's int4 in-place decoder vs onnxruntime-genai's model builder int4, on the Qwen2-0.5B
shape (bench_llm_fusions.QWEN2_05B, untied lm_head), in one run:

* the builder's input: a random model of that config saved with transformers' save_pretrained
  (and a small word-level tokenizer, which the builder insists on; nothing is downloaded);
  ``python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4 -e cpu``, its time and RSS;
* fastopt: ``fastopt optimize EXPORT -o OUT --preset llm --kv-cache inplace --quantize int4``
  on the TorchScript and dynamo exports of the same shape (bench_llm_fusions.py --make-large),
  time and RSS; then what ``--verify`` reports on each output (fastopt.verify.quantized against
  the float export), and on ``fastopt quantize EXPORT --mode int4`` (no fusions, no cache) for
  comparison;
* size of each output folder's model files;
* decode latency, context 256, ORT CPU 2 threads, the three models interleaved in one
  ``fastopt bench`` process;
* onnxruntime-genai runs each folder: its greedy tokens against a plain ONNX Runtime greedy loop
  over the same model (the in-place buffers fed back), which must agree.

Settings are the builder's CPU int4 defaults and fastopt's: block 32, symmetric, accuracy level
4, embeddings in float (untied), lm_head int4.

    python bench/export/bench_builder.py [--models-dir /tmp/fastopt-bench]
                                  [--out bench/results/quantize_builder.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
import _benchlib as bl

STEPS = 16
PROMPT = [101, 2023, 7, 88, 15000, 151000, 42, 3, 900, 12345]


def _make_hf(folder: str) -> dict[str, Any]:
    """A random Qwen2-0.5B-shaped model and a word-level tokenizer, saved for the builder."""
    import torch

    sys.path.insert(0, str(bl.REPO / "bench" / "fusion"))
    from bench_llm_fusions import QWEN2_05B
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN2_05B, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def _ort_greedy(model: str, cfg: dict[str, Any]) -> list[int]:
    """Greedy decoding in ONNX Runtime over an in-place (shared past/present buffer) model."""
    import numpy as np
    import onnxruntime as ort

    dec = cfg["model"]["decoder"]
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    total = len(PROMPT) + STEPS
    np_type = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    cache = {
        name: np.zeros((1, dec["num_key_value_heads"], total, dec["head_size"]), np_type[i.type])
        for name, i in inputs.items()
        if name.startswith("past_key_values.")
    }
    ids_type = np.int32 if inputs["input_ids"].type == "tensor(int32)" else np.int64
    out_names = [o.name for o in sess.get_outputs()]
    tokens: list[int] = []
    step, past = list(PROMPT), 0
    for _ in range(STEPS):
        n = past + len(step)
        feed = {
            "input_ids": np.array([step], ids_type),
            "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(past, n, dtype=np.int64)[None, :],
        }
        for name in ("attention_mask", "position_ids"):
            if name in inputs and inputs[name].type == "tensor(int32)":
                feed[name] = feed[name].astype(np.int32)
        feed = {k: v for k, v in feed.items() if k in inputs}
        outs = dict(zip(out_names, sess.run(out_names, {**feed, **cache})))
        tokens.append(int(outs["logits"][0, -1].argmax()))
        for name in cache:
            cache[name] = outs["present" + name[len("past_key_values") :]]
        past, step = n, [tokens[-1]]
    return tokens


def _genai(folder: str) -> dict[str, Any]:
    """onnxruntime-genai's greedy tokens on the folder, and ONNX Runtime's on its model. eos is
    set to an id neither produces, so it cannot stop the search early."""
    import numpy as np
    import onnxruntime_genai as og

    cfg_path = Path(folder) / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    model_file = os.path.join(folder, cfg["model"]["decoder"]["filename"])
    ref = _ort_greedy(model_file, cfg)
    used = set(PROMPT) | set(ref)
    cfg["model"]["eos_token_id"] = min(set(range(len(used) + 1)) - used)
    cfg_path.write_text(json.dumps(cfg, indent=4))
    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + STEPS, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([PROMPT], np.int32))
    got: list[int] = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    return {"genai": got, "ort": ref, "equal": got == ref, "genai_version": og.__version__}


def _verify(pair: str) -> dict[str, Any]:
    """fastopt.verify.quantized's criteria for int4 (what --verify prints), ORIGINAL,QUANTIZED."""
    from fastopt.verify.quantized import verify_quantized

    original, quantized = pair.split(",")
    r = verify_quantized(original, quantized, "int4")
    return {"ok": r.ok, "thresholds": r.thresholds, "outputs": [o.to_dict() for o in r.outputs]}


def _weights(model: str) -> dict[str, Any]:
    """Initializer bytes by element type (uint8: the quantized weights)."""
    import fastopt

    by_type: dict[str, int] = {}
    for t in fastopt.load(model).graph.initializers:
        a = t.numpy()
        by_type[str(a.dtype)] = by_type.get(str(a.dtype), 0) + a.nbytes
    return by_type


def _size(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.suffix in (".onnx", ".data"))


def _run(cmd: list[str], timeout: float, what: str) -> dict[str, Any]:
    print(f"{what}: {' '.join(cmd)}", flush=True)
    rc, wall, rss, out, err = bl.spawn(cmd, timeout=timeout, max_rss=16 << 30)
    row: dict[str, Any] = {"rc": rc, "seconds": wall, "peak_rss": rss, "stdout": out[-2000:]}
    if rc != 0:
        row["error"] = bl.error_text(rc, err)
    print(f"  rc {rc}, {bl.fmt_s(wall)}, peak RSS {bl.fmt_mb(rss)}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models-dir", default="/tmp/fastopt-bench")
    ap.add_argument("--out", default=str(bl.REPO / "bench" / "results" / "quantize_builder.md"))
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--child", nargs=2, metavar=("WHAT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        fn = {"make-hf": _make_hf, "genai": _genai, "verify": _verify, "weights": _weights}[
            args.child[0]
        ]
        print(bl.RESULT_TAG + json.dumps(fn(args.child[1])), flush=True)
        return
    d = args.models_dir
    py, me = sys.executable, __file__
    env = bl.environment(["onnxruntime", "onnxruntime-genai", "transformers", "torch"])
    env["load_average"] = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    hf = os.path.join(d, "qwen2_0.5b_hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        r = _run([py, me, "--child", "make-hf", hf], 1800, "save_pretrained")
        if r["rc"] != 0:
            raise SystemExit(r["error"])
    exports = {e: os.path.join(d, f"qwen2_0.5b_{e}", "model.onnx") for e in ("ts", "dynamo")}
    for e, path in exports.items():
        if not os.path.exists(path):
            bl_script = str(bl.REPO / "bench" / "fusion" / "bench_llm_fusions.py")
            r = _run([py, bl_script, "--make-large", e, os.path.dirname(path)], 3600, "export")
            if r["rc"] != 0:
                raise SystemExit(r["error"])
    outs = {
        "builder": os.path.join(d, "builder_int4"),
        "fastopt_ts": os.path.join(d, "fastopt_int4_ts"),
        "fastopt_dynamo": os.path.join(d, "fastopt_int4_dynamo"),
    }
    rows["builder"] = _run(
        [py, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", outs["builder"],
         "-p", "int4", "-e", "cpu", "-c", os.path.join(d, "builder_cache")],
        3600, "model builder",
    )  # fmt: skip
    for e in ("ts", "dynamo"):
        rows[f"fastopt_{e}"] = _run(
            [py, "-m", "fastopt", "optimize", exports[e], "-o",
             os.path.join(outs[f"fastopt_{e}"], "model.onnx"), "--preset", "llm",
             "--kv-cache", "inplace", "--quantize", "int4"],
            1800, f"fastopt {e}",
        )  # fmt: skip
    plain = os.path.join(d, "fastopt_int4_plain", "model.onnx")
    r = _run([py, "-m", "fastopt", "quantize", exports["ts"], "-o", plain, "--mode", "int4"],
             1800, "fastopt quantize")  # fmt: skip
    verify: dict[str, Any] = {}
    checks = {f"fastopt_{e}": (exports[e], os.path.join(outs[f"fastopt_{e}"], "model.onnx"))
              for e in ("ts", "dynamo") if rows[f"fastopt_{e}"]["rc"] == 0}  # fmt: skip
    if r["rc"] == 0:
        checks["plain"] = (exports["ts"], plain)
    for name, (a, b) in checks.items():
        v = _run([py, me, "--child", "verify", f"{a},{b}"], 1800, f"verify {name}")
        verify[name] = bl.result_line(v["stdout"]) if v["rc"] == 0 else {"error": v["error"]}
    for name, folder in outs.items():
        if rows[name]["rc"] == 0:
            rows[name]["bytes"] = _size(folder)
            w = _run([py, me, "--child", "weights", os.path.join(folder, "model.onnx")], 600,
                     f"weights {name}")  # fmt: skip
            rows[name]["by_type"] = bl.result_line(w["stdout"]) if w["rc"] == 0 else {}
    bench: dict[str, Any] = {}
    ok = [n for n in outs if rows[n]["rc"] == 0]
    if len(ok) == 3:
        js = os.path.join(d, "bench_builder.json")
        models = [os.path.join(outs[n], "model.onnx") for n in outs]
        r = _run(
            [py, "-m", "fastopt", "bench", models[0], "--against", *models[1:], "--phase",
             "decode", "--seq", "256", "--threads", "2", "--runs", str(args.runs),
             "--json", js],
            3600, "fastopt bench",
        )  # fmt: skip
        if r["rc"] == 0:
            data = json.loads(Path(js).read_text())
            bench = {"results": data["results"] if isinstance(data, dict) else data}
        else:
            bench = {"error": r["error"]}
    genai: dict[str, Any] = {}
    for n in ok:
        r = _run([py, me, "--child", "genai", outs[n]], 1800, f"genai {n}")
        genai[n] = bl.result_line(r["stdout"]) if r["rc"] == 0 else {"error": r["error"]}
    _write(args, env, rows, bench, genai, outs, verify)


def _write(
    args: argparse.Namespace,
    env: dict[str, Any],
    rows: dict[str, dict[str, Any]],
    bench: dict[str, Any],
    genai: dict[str, Any],
    outs: dict[str, str],
    verify: dict[str, Any],
) -> None:
    label = {
        "builder": "model builder int4",
        "fastopt_ts": "fastopt int4, TorchScript export",
        "fastopt_dynamo": "fastopt int4, dynamo export",
    }
    md = [
        "# int4 decoder: fastopt vs onnxruntime-genai's model builder",
        "",
        f"{env['date']}; {env['cpu']}, {env['cores']} cores, "
        f"{env['ram_bytes'] / bl.MB / 1024:.0f} GiB; onnxruntime "
        f"{env['versions']['onnxruntime']}, onnxruntime-genai "
        f"{env['versions']['onnxruntime-genai']}, transformers {env['versions']['transformers']}; "
        f"fastopt {env['fastopt_commit']}; load average at the start {env['load_average'][0]:.1f}",
        "",
        "Qwen2-0.5B shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151936, "
        "untied lm_head), random weights. int4, block 32, symmetric, accuracy level 4, "
        "embeddings in float. Time and peak RSS of each tool's process (wait4); size of the "
        "output's .onnx and .data files.",
        "",
        "| output | tool time | peak RSS | size | size / builder | uint8 weights | float "
        "initializers | notes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    base = rows["builder"].get("bytes")
    for name in outs:
        r = rows[name]
        size = r.get("bytes")
        ratio = f"{size / base:.4f}" if size and base else "-"
        note = r.get("error", "")
        types = r.get("by_type", {})
        md.append(
            f"| {label[name]} | {bl.fmt_s(r['seconds'])} | {bl.fmt_mb(r['peak_rss'])} | "
            f"{bl.fmt_mb(size)} | {ratio} | {bl.fmt_mb(types.get('uint8'))} | "
            f"{bl.fmt_mb(types.get('float32'))} | {note.replace('|', '/')} |"
        )
    uint8 = {rows[n].get("by_type", {}).get("uint8") for n in outs}
    if len(uint8) == 1 and None not in uint8:
        md += [
            "",
            "The quantized (uint8) weights have the same size in all three; the difference is "
            "in float initializers (the builder stores cos/sin caches for all 32768 positions "
            "of max_position_embeddings, 8.4 MB).",
        ]
    md += [
        "",
        "## --verify (fastopt.verify.quantized) against the float export",
        "",
        "| output | verdict | logits cosine | max rel err | top-1 |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    vlabel = {**label, "plain": "fastopt quantize int4 (no fusions, no cache), TorchScript"}
    for name, v in verify.items():
        if "error" in v:
            md.append(f"| {vlabel[name]} | error: {v['error']} | | | |")
            continue
        o = next(x for x in v["outputs"] if x["name"] == "logits")
        md.append(
            f"| {vlabel[name]} | {'passed' if v['ok'] else 'FAILED'} | {o['cosine']:.4f} | "
            f"{o['max_rel_error']:.4f} | {o['top1_agreement']:.3f} |"
        )
    if verify:
        t = next(iter(verify.values())).get("thresholds", ["?"] * 3)
        md += [
            "",
            f"Thresholds for int4: cosine >= {t[0]}, max rel err <= {t[1]}, top-1 >= {t[2]} "
            "(measured on the 2-layer test fixtures). The last row quantizes the export without "
            "fusions or cache: the same scores mean the fusions and the in-place cache add no "
            "error to int4's own, whose bytes equal onnxruntime's quantizer's "
            "(tests/quant/test_quantize_weights.py).",
        ]
    md += ["", "## Decode latency: context 256, ORT CPU, 2 threads, interleaved in one process", ""]
    if "results" in bench:
        md += ["| model | median step | p90 | / builder |", "| --- | ---: | ---: | ---: |"]
        first = None
        for name, r in zip(outs, bench["results"]):
            med = r["stats"]["median"]
            first = first or med
            md.append(
                f"| {label[name]} | {med * 1e3:.1f} ms | {r['stats']['p90'] * 1e3:.1f} ms | "
                f"{med / first:.3f} |"
            )
        md += [
            "",
            f"Command: `fastopt bench BUILDER --against FASTOPT_TS FASTOPT_DYNAMO --phase decode "
            f"--seq 256 --threads 2 --runs {args.runs}`.",
        ]
    else:
        md.append(f"not measured: {bench.get('error', 'an output is missing')}")
    md += ["", f"## onnxruntime-genai greedy search ({STEPS} tokens, prompt of {len(PROMPT)})", ""]
    md += [
        "| folder | genai tokens = ONNX Runtime greedy loop | genai tokens |",
        "| --- | --- | --- |",
    ]
    for name, g in genai.items():
        if "error" in g:
            md.append(f"| {label[name]} | error: {g['error']} | |")
        else:
            md.append(f"| {label[name]} | {'yes' if g['equal'] else 'NO'} | {g['genai']} |")
    md += [
        "",
        "Command: `python bench/export/bench_builder.py` (the machine is shared: 2 cores, other "
        "sessions' jobs running).",
        "",
    ]
    report = {"env": env, "rows": rows, "bench": bench, "genai": genai, "verify": verify}
    bl.write_results("\n".join(md), report, args.out)


if __name__ == "__main__":
    main()
