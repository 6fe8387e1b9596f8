"""The pipeline fuzzer's steps (fuzz_pipeline.cc) through the Python extension.

tests/safety/test_fuzz.py replays the saved regression inputs with ``replay`` wherever the sanitizer
binaries are absent (and also where they are present): read, run the C++ passes of the
"default" preset in the harness's order and variant, check that the result verifies, serializes
and reads back, save it with external data and read that back. The variant (target, KV cache,
quantization) comes from the input's size, as in the harness.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import fastopt
from fastopt import _C
from fastopt.pipeline.registry import PRESETS

QUANT_MODES = ("", "int4", "int8", "int8-dynamic", "fp16", "bf16")


def default_passes() -> list[str]:
    """The C++ passes of PRESETS["default"], add_kv_cache right after fuse_attention (where
    optimize(kv_cache=...) puts it): kDefaultPasses in fuzz_pipeline.cc plus that insertion."""
    cpp = {p.name for p in _C.cpp_passes()}
    names: list[str] = []
    for name in PRESETS["default"]:
        if name in cpp:
            names.append(name)
            if name == "fuse_attention":
                names.append("add_kv_cache")
    return names


def variant(size: int) -> tuple[str, int, str, bool]:
    """(target, kv_cache, quant_mode, save_to_file) for an input of `size` bytes."""
    return (
        "ort" if size % 2 == 0 else "onnx",
        (size // 2) % 3,
        QUANT_MODES[(size // 6) % 6],
        (size // 36) % 4 == 0,
    )


def _quant_pass(mode: str) -> str:
    if mode in ("int4", "int8"):
        return "quantize_weights"
    return "quantize_dynamic" if mode == "int8-dynamic" else "convert_precision"


def replay(data: bytes, base_dir: Path) -> str:
    """Runs one input as fuzz_pipeline does. Returns what happened ("unread", "refused by
    <pass>", "optimized"); raises AssertionError on a finding (and whatever else escapes)."""
    try:
        model = fastopt.load_bytes(data, base_dir=base_dir)
        model.verify()
    except fastopt.ModelError:
        return "unread"
    target, kv_cache, mode, save_to_file = variant(len(data))
    options: dict[str, int] = {"quant_threads": 1}
    text: dict[str, str] = {}
    if kv_cache:
        options["kv_cache"] = kv_cache
    if mode:
        text["quant_mode"] = mode
        if mode in ("int4", "int8"):
            options["quant_bits"] = 4 if mode == "int4" else 8
    names = default_passes() + ([_quant_pass(mode)] if mode else [])
    for name in names:
        if name == "add_kv_cache" and not kv_cache:
            continue
        try:
            _C.run_pass(model, name, target, 10, "", options, text, None)
        except fastopt.ModelError as e:
            assert str(e).strip(), f"{name} raised a ModelError with an empty message"
            return f"refused by {name}"
    model.verify()  # a ModelError here is a finding: the passes broke a valid model
    again = fastopt.load_bytes(model.serialize(), base_dir=base_dir)
    again.verify()
    assert again.op_counts() == model.op_counts(), "op counts changed in the round trip"
    if save_to_file:
        with tempfile.TemporaryDirectory() as out:
            path = Path(out) / "model.onnx"
            model.save(str(path), external_data=True, size_threshold=16)
            saved = fastopt.load(str(path))
            saved.verify()
            assert saved.op_counts() == model.op_counts(), "op counts changed in the save"
    return "optimized"
