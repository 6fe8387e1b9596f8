"""Models for the benchmark-harness tests: a no-cache decoder fixture, its standard and
in-place cached forms, and an encoder."""

from __future__ import annotations

from pathlib import Path

import fastopt

from support.llm_fixtures import FIXTURE_DIR

DECODER = FIXTURE_DIR / "llama_ts_float32" / "model.onnx"
ENCODER = FIXTURE_DIR / "bert_ts_float32" / "model.onnx"


def cached_decoder(folder: Path, kv_cache: str) -> Path:
    """DECODER with a KV cache (`kv_cache` "standard" or "inplace"), written into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "model.onnx"
    fastopt.optimize(DECODER, preset="llm", kv_cache=kv_cache, output=out)  # type: ignore[arg-type]
    return out
