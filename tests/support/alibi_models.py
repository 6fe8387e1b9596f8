"""Models and runs that more than one test file uses (from test_alibi)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from fastopt.genai.config import write_genai_config

try:
    import onnxruntime_genai as og
except ImportError:  # pragma: no cover - optional
    og = None


def without_attention_bias(path: Path, dst: Path) -> None:
    """The in-place model with GroupQueryAttention's attention_bias dropped (what the old
    lowering would have run)."""
    model = onnx.load(path)
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention":
            n.input[10] = ""
    onnx.save(model, dst)


def genai_greedy(folder: Path, prompt: list[int], steps: int, used: set[int]) -> list[int]:
    """onnxruntime-genai's greedy search; eos set to an id no token of the run holds, so that
    it cannot stop early."""
    assert og is not None
    path = folder / "genai_config.json"
    cfg = json.loads(path.read_text())
    cfg["model"]["eos_token_id"] = min(set(range(len(used) + 1)) - used)
    write_genai_config(cfg, path)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], np.int32))
    tokens = []
    while not gen.is_done():
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
    return tokens
