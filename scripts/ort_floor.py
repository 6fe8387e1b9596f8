"""Which onnxruntime releases load and run fastopt's outputs (the floor in pyproject.toml).

Two steps, so that the second needs nothing but onnxruntime and numpy:

    python scripts/ort_floor.py make DIR        # fastopt writes the outputs and their inputs
    python scripts/ort_floor.py try DIR         # in a venv with an older onnxruntime: load + run

`make` optimizes a few fixtures with every preset x target, the KV-cache modes and the
quantization modes, and saves each output with one set of inputs (batch 1, 2 tokens, an empty
past) made by fastopt's run check. `try` prints one JSON line per output: loaded, ran, and ORT's
first error line. scripts/ort_floor.sh runs `try` under each release.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "models"
MODELS = [
    "llama_ts_float32",
    "qwen3_dynamo_float32",
    "gemma3_ts_float16",
    "gpt2_ts_float32",
    "bert_ts_float32",
    "phi3_dynamo_float32",
]
DECODERS = {"llama_ts_float32", "qwen3_dynamo_float32", "gemma3_ts_float16", "phi3_dynamo_float32"}
# (label, optimize keyword arguments)
CONFIGS: list[tuple[str, dict]] = [
    (f"{preset}/{target}", {"preset": preset, "target": target})
    for preset in ("default", "llm", "classic", "cleanup")
    for target in ("ort", "onnx")
]
DECODER_CONFIGS: list[tuple[str, dict]] = [
    ("llm/ort/kv-standard", {"preset": "llm", "kv_cache": "standard"}),
    ("llm/onnx/kv-standard", {"preset": "llm", "target": "onnx", "kv_cache": "standard"}),
    ("llm/ort/kv-inplace", {"preset": "llm", "kv_cache": "inplace"}),
    ("llm/ort/kv-inplace/int4", {"preset": "llm", "kv_cache": "inplace", "quantize": "int4"}),
    ("llm/ort/int8", {"preset": "llm", "quantize": "int8"}),
    ("llm/ort/int8-dynamic", {"preset": "llm", "quantize": "int8-dynamic"}),
    ("llm/ort/fp16", {"preset": "llm", "quantize": "fp16"}),
]


def make(out: Path) -> None:
    import fastopt
    import numpy as np
    from fastopt.verify.inputs import _synthesize
    from fastopt.verify.run_check import RUN_CHECK_DIMS

    index = []
    for name in MODELS:
        source = FIXTURES / name / "model.onnx"
        configs = [("input", None), *CONFIGS, *(DECODER_CONFIGS if name in DECODERS else [])]
        for label, kwargs in configs:
            folder = out / name / label.replace("/", "_")
            path = folder / "model.onnx"
            try:
                if kwargs is None:
                    folder.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(source.read_bytes())
                else:
                    kwargs = dict(kwargs)
                    q = kwargs.pop("quantize", None)
                    if q is not None:
                        kwargs["quantize"] = fastopt.QuantSettings(mode=q)
                    fastopt.optimize(str(source), output=str(path), **kwargs)
            except fastopt.ModelError as e:
                print(f"{name} {label}: refused: {str(e)[:120]}", file=sys.stderr)
                continue
            feeds = _synthesize(fastopt.load(str(path)), RUN_CHECK_DIMS, seed=0)
            np.savez(folder / "inputs.npz", **{k: np.asarray(v) for k, v in feeds.items()})
            m = fastopt.load(str(path))
            index.append(
                {
                    "model": name,
                    "config": label,
                    "path": str(path.relative_to(out)),
                    "ir": m.ir_version,
                    "opsets": dict(m.opset_imports),
                }
            )
    (out / "index.json").write_text(json.dumps(index, indent=1))


def attempt(out: Path) -> None:
    import numpy as np
    import onnxruntime as ort

    for entry in json.loads((out / "index.json").read_text()):
        path = out / entry["path"]
        row = {**entry, "ort": ort.__version__, "loaded": False, "ran": False, "error": ""}
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 4
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            row["loaded"] = True
            feeds = dict(np.load(path.parent / "inputs.npz"))
            sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
            row["ran"] = True
        except Exception as e:  # ORT's verdict on this output is the datum
            text = " ".join(str(e).split())  # ORT names the reason at the end
            row["error"] = text if len(text) <= 400 else f"{text[:150]} ... {text[-250:]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"make": make, "try": attempt}[sys.argv[1]](Path(sys.argv[2]))
