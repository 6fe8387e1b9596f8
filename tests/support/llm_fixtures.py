"""Helpers for tests on the LLM fixtures (tests/fixtures/models, made by
tests/fixtures/make_fixtures.py): pick fixtures, make realistic feeds (with padding), run passes,
count fused ops, and check ONNX Runtime parity of the logits."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import fastopt
import numpy as np
import onnx
import onnxruntime as ort
import pytest

ort.set_default_logger_severity(3)

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "models"
# The version matrix (tests/fixtures/make_matrix.py): MATRIX_DIR/<transformers release>/<name>/
# model.onnx.gz (weights as mean/std, filled by materialize) + meta.json; exports.json per
# release says which combinations failed to export, and why.
MATRIX_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "matrix"
# Expected failures of the matrix: {check: {fixture name: reason}} (strict xfails, so a fix
# flips them; tests/fixtures/README.md says how to update it).
MATRIX_XFAIL = MATRIX_DIR / "expected_failures.json"
RANDOM_MARK = "fastopt-random"
# Decoders whose KV-cache rewrite is refused by design, with the reason tested in
# test_rotary_variants.py: phi3 LongRoPE picks its rotary table from the longest position, which
# a cache computed step by step cannot reproduce once the switch flips.
# ALiBi: a score bias (slopes x key positions) beside the mask, eager attention (no sdpa form).
ALIBI_ARCHS = ("bloom", "mpt")
# Decoders the generic KV tests leave out: phi3_longrope's cache is refused; ALiBi's caches (both
# forms) are tested in test_alibi.py, whose reference lays out a standard cache's holes for mpt
# (its bias counts key indices, holes included).
KV_REFUSED_ARCHS = {"phi3_longrope", *ALIBI_ARCHS}
# Architectures whose attention stays decomposed, with the reason --explain gives. None today:
# deberta_v2's disentangled attention fuses with its position terms as the attention bias
# (test_family_fixes.py).
UNFUSED_ATTENTION_ARCHS: set[str] = set()
# Mixture-of-experts decoders (tests/fusion/test_moe.py): the experts' MLPs fuse like dense
# ones, the routing stays exact as exported.
MOE_ARCHS = ("mixtral", "qwen2_moe", "olmoe")

# fp16 twins that every fixture-walking test runs only under `-m slow` (tests/conftest.py marks
# them), to keep the default run short: each family keeps its dynamo fp16 export there.
SLOW_FIXTURES = {
    f"{arch}_ts_float16" for arch in ("mixtral", "qwen2_moe", "olmoe", "deberta_v2", "t5")
}

# Max abs error of the logits allowed after fusion (issue 4's acceptance bounds).
PARITY_ATOL = {"float32": 1e-4, "float16": 2e-2}


@dataclass(frozen=True)
class Fixture:
    path: Path
    # matrix fixtures: the transformers release (the name gets ".tf<release>")
    release: str | None = None

    @cached_property
    def meta(self) -> dict[str, Any]:
        return dict(json.loads((self.path.parent / "meta.json").read_text()))

    @property
    def name(self) -> str:
        """The folder's name; a matrix fixture's ends in .tf<transformers release>."""
        folder = self.meta.get("folder", self.path.parent.name)
        return f"{folder}.tf{self.release}" if self.release else folder

    @property
    def arch(self) -> str:
        return str(self.meta["arch"])

    @property
    def exporter(self) -> str:
        return str(self.meta["exporter"])

    @property
    def dtype(self) -> str:
        return str(self.meta["dtype"])

    @property
    def is_decoder(self) -> bool:
        return bool(self.meta["kind"] == "decoder")

    @property
    def has_cache(self) -> bool:
        """Exported with a KV cache (past_key_values inputs, present outputs)."""
        return bool(self.meta.get("cache", False))

    @property
    def layers(self) -> int:
        config = self.meta["config"]
        return int(
            config.get("num_hidden_layers", config.get("n_layer", config.get("n_layers", 0)))
        )

    @property
    def heads(self) -> int:
        """Query heads (num_attention_heads; gpt2/falcon n_head; mpt n_heads)."""
        config = self.meta["config"]
        return int(config.get("num_attention_heads") or config.get("n_head") or config["n_heads"])

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_key_value_heads; falcon's multi_query (outside its new decoder
        architecture) has one; else the query heads."""
        config = self.meta["config"]
        heads = self.heads
        if config.get("multi_query") and not config.get("new_decoder_architecture"):
            return 1
        return int(config.get("num_key_value_heads") or heads)

    def __str__(self) -> str:
        return self.name


def fixtures(
    arch: str | Sequence[str] | None = None,
    exporter: str | None = None,
    dtype: str | None = None,
    decoder: bool | None = None,
    kv_cache: bool | None = None,
    fused_attention: bool | None = None,
    cache_export: bool | None = False,
) -> list[Fixture]:
    """The committed fixtures, filtered; sorted by name (stable test ids). kv_cache: decoders
    whose KV rewrite is (True) or is not (False) expected to work. fused_attention: fixtures
    whose attention fuses (True) or stays decomposed (False, UNFUSED_ATTENTION_ARCHS).
    cache_export: the decoders exported WITH a cache (`*_cache`, past/present in the graph;
    make_fixtures.py --cache) (True), the others (False, the default: their feeds differ), or
    both (None)."""
    archs = [arch] if isinstance(arch, str) else arch
    out = []
    for path in sorted(FIXTURE_DIR.glob("*/model.onnx")):
        fx = Fixture(path)
        if archs is not None and fx.arch not in archs:
            continue
        if exporter is not None and fx.exporter != exporter:
            continue
        if dtype is not None and fx.dtype != dtype:
            continue
        if decoder is not None and fx.is_decoder != decoder:
            continue
        if cache_export is not None and fx.has_cache != cache_export:
            continue
        cacheable = fx.is_decoder and fx.arch not in KV_REFUSED_ARCHS
        if kv_cache is not None and cacheable != kv_cache:
            continue
        fuses = fx.arch not in UNFUSED_ATTENTION_ARCHS
        if fused_attention is not None and fuses != fused_attention:
            continue
        out.append(fx)
    return out


def materialize(folder: Path, graphs: Sequence[str] = ("model",)) -> Path:
    """model.onnx of a matrix fixture folder (model.onnx.gz + meta.json), with every weight
    make_matrix.py stripped filled again by seeded normal values of its recorded mean and std,
    in a temporary folder (reused while the gzipped files are unchanged); meta.json beside it.
    `graphs`: the gzipped graphs to fill (an encoder-decoder's ("encoder", "decoder")); the
    first one's path is returned."""
    packed = {g: (folder / f"{g}.onnx.gz").read_bytes() for g in graphs}
    crc = zlib.crc32(b"".join(packed.values()))
    key = f"{folder.name}-{crc:08x}"
    cache = Path(tempfile.gettempdir()) / f"fastopt-matrix-{os.getuid()}" / folder.parent.name
    outs = [cache / key / f"{g}.onnx" for g in graphs]
    if all(out.exists() for out in outs):
        return outs[0]
    outs[0].parent.mkdir(parents=True, exist_ok=True)
    meta = json.loads((folder / "meta.json").read_text())
    meta["folder"] = folder.name
    tmp = outs[0].parent / f".{os.getpid()}.tmp"  # atomic: concurrent sessions may fill it too
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, outs[0].parent / "meta.json")
    for graph, out in zip(graphs, outs):
        tmp.write_bytes(_filled(packed[graph]))
        os.replace(tmp, out)
    return outs[0]


def _filled(packed: bytes) -> bytes:
    """A gzipped stripped graph with its weights filled (materialize)."""
    proto = onnx.ModelProto.FromString(gzip.decompress(packed))
    for t in proto.graph.initializer:
        if not t.doc_string.startswith(RANDOM_MARK):
            continue
        mean, std = (float(x) for x in t.doc_string.split()[1:3])
        rng = np.random.default_rng(zlib.crc32(t.name.encode()))
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        t.raw_data = (rng.standard_normal(tuple(t.dims)) * std + mean).astype(dtype).tobytes()
        t.doc_string = ""
    return proto.SerializeToString()


def matrix_releases() -> list[str]:
    """The transformers releases of the matrix, oldest first."""
    found = [p.name for p in MATRIX_DIR.iterdir() if (p / "exports.json").is_file()]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def matrix_fixtures(
    release: str | None = None,
    arch: str | Sequence[str] | None = None,
    exporter: str | None = None,
    decoder: bool | None = None,
    cache_export: bool | None = False,
    dtype: str | None = None,
) -> list[Fixture]:
    """The version matrix's fixtures (materialized), filtered as fixtures() does; sorted by
    release, then name. Its encoder-decoders are seq2seq_generation.matrix_seq2seq_fixtures."""
    archs = [arch] if isinstance(arch, str) else arch
    out = []
    for rel in matrix_releases() if release is None else [release]:
        for meta_path in sorted((MATRIX_DIR / rel).glob("*/meta.json")):
            meta = json.loads(meta_path.read_text())
            if meta["kind"] == "encoder-decoder":  # seq2seq_generation.matrix_seq2seq_fixtures
                continue
            if archs is not None and meta["arch"] not in archs:
                continue
            if exporter is not None and meta["exporter"] != exporter:
                continue
            if decoder is not None and (meta["kind"] == "decoder") != decoder:
                continue
            if cache_export is not None and bool(meta.get("cache")) != cache_export:
                continue
            if dtype is not None and meta["dtype"] != dtype:
                continue
            out.append(Fixture(materialize(meta_path.parent), release=rel))
    return out


# The matrix's default share (the rest runs under -m slow): every release's llama and gpt2
# (both exporters, float32), so each release's mask, rotary and attention forms stay in the
# default run; the fp16 exports run under -m slow.
MATRIX_DEFAULT_ARCHS = ("llama", "gpt2")


def matrix_params(
    check: str,
    items: Sequence[Any],
    variants: Sequence[tuple[str, ...]] = ((),),
    default_archs: Sequence[str] = MATRIX_DEFAULT_ARCHS,
) -> list[Any]:
    """pytest params (fx, *variant) for the matrix fixtures of a check (a key of
    expected_failures.json), id "<fixture>[-<variant>...]": a strict xfail with the recorded
    reason where the table expects that id to fail; slow outside `default_archs` (the
    encoder-decoders': seq2seq_generation.MATRIX_DEFAULT_ARCHS). `items`: Fixture or
    seq2seq_generation.Seq2SeqFixture (name, arch, dtype)."""
    expected = json.loads(MATRIX_XFAIL.read_text()).get(check, {}) if MATRIX_XFAIL.exists() else {}
    params = []
    for fx in items:
        for variant in variants:
            test_id = "-".join([fx.name, *variant])
            marks: list[Any] = []
            if test_id in expected:
                marks.append(pytest.mark.xfail(strict=True, reason=expected[test_id]))
            if fx.arch not in default_archs or fx.dtype != "float32":
                marks.append(pytest.mark.slow)
            params.append(pytest.param(fx, *variant, marks=marks, id=test_id))
    return params


def router_softmaxes(fx: Fixture) -> int:
    """Softmax nodes a fully fused model keeps: one per MoE layer over the router logits (the
    routing weights, which no fused op computes), none elsewhere. Not attention residue."""
    return fx.layers if fx.arch in MOE_ARCHS else 0


def ids(items: Sequence[Fixture]) -> list[str]:
    return [fx.name for fx in items]


def feeds(
    fx: Fixture, batch: int = 2, seq: int = 13, padding: str | None = "right", seed: int = 0
) -> dict[str, np.ndarray]:
    """input_ids, attention_mask and position_ids (where the model takes them). With padding
    "right" or "left" and batch > 1, the second row is shorter by a third of `seq`; positions
    follow the mask (cumsum - 1, pads at 1), the way generate() makes them."""
    rng = np.random.default_rng(seed)
    vocab = int(fx.meta["config"].get("vocab_size", 512))
    out: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64),
    }
    mask = np.ones((batch, seq), dtype=np.int64)
    if padding and batch > 1:
        short = max(1, seq // 3)
        if padding == "right":
            mask[1, seq - short :] = 0
        elif padding == "left":
            mask[1, :short] = 0
        else:
            raise ValueError(f"padding must be right, left or None, not {padding!r}")
    out["attention_mask"] = mask
    if "position_ids" in fx.meta["inputs"]:
        positions = np.cumsum(mask, axis=1) - 1
        positions[mask == 0] = 1
        out["position_ids"] = positions.astype(np.int64)
    return {k: v for k, v in out.items() if k in fx.meta["inputs"]}


def optimize(
    fx: Fixture,
    preset: str | None = None,
    passes: Sequence[str] | None = None,
    target: str = "ort",
    **kwargs: Any,
) -> tuple[fastopt.OptimizeReport, onnx.ModelProto]:
    """Runs a preset or passes on a fixture; checks the IR invariants; returns the report and
    the optimized model as a ModelProto (fixtures are small)."""
    report = fastopt.optimize(
        fx.path,
        preset=preset,  # type: ignore[arg-type]
        passes=None if passes is None else list(passes),
        target=target,  # type: ignore[arg-type]
        **kwargs,
    )
    assert report.model is not None
    report.model.verify()
    return report, report.model.to_onnx()


def op_count(model: onnx.ModelProto, op_type: str, domain: str | None = None) -> int:
    """Nodes of `op_type` in the main graph (domain None: any domain; "" is ai.onnx)."""
    return sum(
        1
        for n in model.graph.node
        if n.op_type == op_type and (domain is None or (n.domain or "") == domain)
    )


def run(model: onnx.ModelProto | Path, inputs: dict[str, np.ndarray], optimize_ort: bool = False):  # type: ignore[no-untyped-def]
    """Outputs of `model` in ONNX Runtime CPU; ORT's own graph optimizations off unless asked."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize_ort:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in inputs.items() if k in names})


def max_abs_diff(fx: Fixture, optimized: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> float:
    """Max abs difference of the first output (logits / last_hidden_state) between the fixture
    and `optimized`, over the positions the attention mask keeps (pad positions' outputs are
    don't-care, and fused kernels legitimately differ there)."""
    expected = np.asarray(run(fx.path, inputs)[0], dtype=np.float64)
    got = np.asarray(run(optimized, inputs)[0], dtype=np.float64)
    assert expected.shape == got.shape, (expected.shape, got.shape)
    keep = inputs["attention_mask"].astype(bool)
    return float(np.max(np.abs(expected[keep] - got[keep])))


def assert_parity(
    fx: Fixture,
    optimized: onnx.ModelProto,
    paddings: Sequence[str | None] = (None, "right", "left"),
) -> None:
    """Logits agree within the dtype's bound on unpadded, right-padded and left-padded
    batches."""
    bound = PARITY_ATOL[fx.dtype]
    for padding in paddings:
        diff = max_abs_diff(fx, optimized, feeds(fx, padding=padding))
        assert diff <= bound, f"{fx}: max abs diff {diff:.3g} > {bound} (padding={padding})"


# Fixture architectures with rotary position embeddings.
ROPE_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma3",
    "gemma2",
    "gpt_neox",
    "gptj",
    "cohere",
    "glm",
    "glm4",
    "phi3_longrope",
    "falcon",
    "nemotron",
    "modernbert",
    *MOE_ARCHS,
)
