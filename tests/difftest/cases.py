"""What one differential run is (``Case``: a fixture, a mutation kind, a mode, a seed), its
one-line key for the command line, and the seeded samplers of the default and long runs.

A mode is preset x target x KV mode x quantization. The full product (4 presets x 2 targets x 3
KV modes x 5 quantizations, less the impossible ones: a KV cache needs the attention fusion's
presets, an in-place cache target ort) is sampled, never run whole by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from .mutations import MUTATIONS

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "models"
PRESETS = ("default", "llm", "classic", "cleanup")
TARGETS = ("ort", "onnx")
KV_MODES = ("none", "standard", "inplace")
QUANT_MODES = ("none", "int4", "int8", "int8-dynamic", "fp16")
# Decoders whose KV rewrite is refused by design or tested elsewhere
# (tests/support/llm_fixtures.py).
KV_REFUSED = {"phi3_longrope", "bloom", "mpt"}


@dataclass(frozen=True)
class Mode:
    preset: str = "llm"
    target: str = "ort"
    kv: str = "none"
    quant: str = "none"

    def __str__(self) -> str:
        return f"{self.preset}/{self.target}/kv={self.kv}/q={self.quant}"

    @staticmethod
    def parse(text: str) -> Mode:
        preset, target, kv, quant = text.split("/")
        return Mode(preset, target, kv.removeprefix("kv="), quant.removeprefix("q="))

    @property
    def valid(self) -> bool:
        if self.kv != "none" and self.preset not in ("default", "llm"):
            return False  # add_kv_cache edits the fused attention
        return not (self.kv == "inplace" and self.target != "ort")


ALL_MODES = tuple(
    m
    for p in PRESETS
    for t in TARGETS
    for kv in KV_MODES
    for q in QUANT_MODES
    if (m := Mode(p, t, kv, q)).valid
)


@dataclass(frozen=True)
class Case:
    fixture: str
    mutation: str
    mode: Mode
    seed: int

    @property
    def key(self) -> str:
        return f"{self.fixture}:{self.mutation}:{self.mode}:{self.seed}"

    @staticmethod
    def parse(key: str) -> Case:
        fixture, mutation, mode, seed = key.split(":")
        return Case(fixture, mutation, Mode.parse(mode), int(seed))

    @property
    def command(self) -> str:
        return f"python -m tests.difftest --case '{self.key}'"


# A pseudo-fixture for minimized findings: the decoder inputs and one integer output, all that
# the folding probes need (a finding there saves as a model of a few hundred bytes).
BARE = "bare"


def bare_model() -> onnx.ModelProto:
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])
    out = helper.make_tensor_value_info("ids_and_mask", TensorProto.INT64, ["batch", "seq"])
    node = helper.make_node("Add", ["input_ids", "attention_mask"], ["ids_and_mask"])
    graph = helper.make_graph([node], "bare", [ids, mask], [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def load_fixture(name: str) -> onnx.ModelProto:
    if name == BARE:
        return bare_model()
    return onnx.load(str(FIXTURE_DIR / name / "model.onnx"))


@cache
def fixture_meta(name: str) -> dict:  # type: ignore[type-arg]
    if name == BARE:
        return {"kind": "bare", "arch": BARE, "dtype": "float32", "config": {"vocab_size": 512}}
    return dict(json.loads((FIXTURE_DIR / name / "meta.json").read_text()))


def fixtures(dtype: str | None = "float32") -> list[str]:
    """Exports the tester mutates: decoders and encoders without a cache."""
    out = []
    for meta_file in sorted(FIXTURE_DIR.glob("*/meta.json")):
        meta = json.loads(meta_file.read_text())
        if meta.get("cache") or meta["kind"] not in ("decoder", "encoder"):
            continue
        if "attention_mask" not in meta["inputs"] or (dtype and meta["dtype"] != dtype):
            continue
        out.append(meta_file.parent.name)
    return out


def modes_for(fixture: str) -> list[Mode]:
    meta = fixture_meta(fixture)
    cacheable = meta["kind"] == "decoder" and meta["arch"] not in KV_REFUSED
    return [m for m in ALL_MODES if m.kv == "none" or cacheable]


def sample(seed: int, runs: int, dtype: str | None = "float32") -> list[Case]:
    """`runs` cases drawn from `seed`: mutation kinds in turn (every kind once per round), a
    fixture and a mode drawn for each; KV modes only for decoders whose cache is expected."""
    rng = np.random.default_rng(seed)
    names = fixtures(dtype)
    kinds = sorted(MUTATIONS)
    cases = []
    for i in range(runs):
        kind = kinds[i % len(kinds)]
        fixture = names[int(rng.integers(len(names)))]
        modes = modes_for(fixture)
        mode = modes[int(rng.integers(len(modes)))]
        cases.append(Case(fixture, kind, mode, int(rng.integers(1 << 31))))
    return cases
