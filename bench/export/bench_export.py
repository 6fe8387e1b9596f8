"""``fastopt export`` vs onnxruntime-genai's model builder, from the same Hugging Face folder
(a random Qwen2 of the 0.5B or 1.5B shape, fp32, saved with save_pretrained, with a word-level
tokenizer the builder insists on; nothing is downloaded), one run each on this machine:

* ``fastopt export HF -o OUT --quantize int4`` (dynamo export, check against PyTorch, preset
  default, KV cache, int4) and ``python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4
  -e cpu``: wall time and peak RSS (wait4's ru_maxrss of the command and what it waited for),
  against the checkpoint's size;
* decode speed of both int4 folders in onnxruntime-genai: greedy, a 16-token prompt then 64
  new tokens, tokens/s after the first (best of 3 rounds, the two folders interleaved, one
  process per round).

    python bench/export/bench_export.py [--sizes 0.5b,1.5b] [--builder 0.5b,1.5b]
        [--models-dir /tmp/fastopt-export-bench] [--out bench/results/export.json]

Run it under ``flock /tmp/heavy.lock`` on a shared machine (the 1.5B checkpoint is 6 GB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _benchlib
import _benchlib as bl

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2-0.5B and Qwen2-1.5B (tied embeddings, as the released models)
    "0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
    },
    "1.5b": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
    },
}
PROMPT = [101, 2023, 7, 88, 15000, 151000, 42, 3, 900, 12345, 5, 6, 77, 1000, 20000, 31]
NEW_TOKENS = 64


def make_hf(size: str, folder: str) -> None:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        **SHAPES[size],
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)


def decode_speed(folder: str) -> dict[str, Any]:
    """onnxruntime-genai greedy: tokens/s after the first new token (eos set to an id the
    prompt lacks: a random model must not stop early)."""
    import time

    import numpy as np
    import onnxruntime_genai as og

    cfg_path = Path(folder) / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["eos_token_id"] = 151935
    cfg_path.write_text(json.dumps(cfg, indent=4))
    model = og.Model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + NEW_TOKENS, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(np.array([PROMPT], np.int32))
    gen.generate_next_token()
    t1 = time.perf_counter()
    n = 1
    while not gen.is_done():
        gen.generate_next_token()
        n += 1
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "tokens": n, "tokens_per_s": (n - 1) / (t2 - t1)}


def _run(cmd: list[str], what: str) -> dict[str, Any]:
    print(f"{what}: {' '.join(cmd)}", flush=True)
    rc, wall, rss, _out, err = bl.spawn(cmd, timeout=3 * 3600, max_rss=20 << 30)
    row: dict[str, Any] = {"cmd": " ".join(cmd), "rc": rc, "seconds": wall, "peak_rss": rss}
    if rc != 0:
        row["error"] = bl.error_text(rc, err)
    print(f"  rc {rc}, {bl.fmt_s(wall)}, peak RSS {bl.fmt_mb(rss)}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--builder", default="0.5b", help="sizes the builder also runs on")
    ap.add_argument("--models-dir", default="/tmp/fastopt-export-bench")
    ap.add_argument("--out", default="/tmp/fastopt-export-bench/export.json")
    ap.add_argument("--decode", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.decode:  # a child: one folder's decode speed
        print(bl.RESULT_TAG + json.dumps(decode_speed(args.decode[0])), flush=True)
        return
    results: dict[str, Any] = {"environment": bl.environment(["torch", "transformers"])}
    py = sys.executable
    for size in args.sizes.split(","):
        base = Path(args.models_dir) / size
        hf = base / "hf"
        if not (hf / "config.json").exists():
            print(f"making {hf}", flush=True)
            code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            code += f"import bench_export as b; b.make_hf({size!r}, {str(hf)!r})"
            _run([py, "-c", code], f"{size} checkpoint")
        ckpt = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        row: dict[str, Any] = {"checkpoint_bytes": ckpt}
        outs = {"fastopt": base / "fastopt_int4", "builder": base / "builder_int4"}
        for d in outs.values():
            shutil.rmtree(d, ignore_errors=True)
        row["fastopt"] = _run(
            [
                py,
                "-m",
                "fastopt",
                "export",
                str(hf),
                "-o",
                str(outs["fastopt"]),
                "--quantize",
                "int4",
            ],
            f"{size} fastopt export",
        )
        tools = ["fastopt"]
        if size in args.builder.split(","):
            builder = [py, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o"]
            builder += [str(outs["builder"]), "-p", "int4", "-e", "cpu"]
            row["builder"] = _run(builder, f"{size} builder")
            tools.append("builder")
        for tool in tools:
            row[tool]["folder_bytes"] = (
                sum(
                    f.stat().st_size for f in outs[tool].iterdir() if f.suffix in (".onnx", ".data")
                )
                if outs[tool].is_dir()
                else 0
            )
        speeds: dict[str, list[dict[str, Any]]] = {t: [] for t in tools}
        for _ in range(3):
            for tool in tools:
                if row[tool]["rc"] != 0:
                    continue
                rc, _, _, out, err = bl.spawn(
                    [py, __file__, "--decode", str(outs[tool])], timeout=1800
                )
                if rc == 0:
                    speeds[tool].append(bl.result_line(out))
                else:
                    row[tool]["decode_error"] = bl.error_text(rc, err)
        for tool in tools:
            if speeds[tool]:
                row[tool]["decode"] = max(speeds[tool], key=lambda s: s["tokens_per_s"])
                print(f"  {size} {tool}: {row[tool]['decode']}", flush=True)
        results[size] = row
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
