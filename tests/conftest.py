"""Shared helpers for the round-trip acceptance tests (model discovery, feeds, ONNX Runtime)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.backend.test
import onnxruntime as ort
import pytest
from google.protobuf.message import Message
from onnx import helper, numpy_helper

ort.set_default_logger_severity(3)

BACKEND_DATA = Path(onnx.backend.test.__file__).resolve().parent / "data"
BACKEND_KINDS = ("light", "pytorch-converted", "pytorch-operator", "simple", "real")
# ../shared/corpus beside the repository: on the project's machines, absent in a user's clone.
CORPUS_DIR = Path(__file__).resolve().parents[2] / "shared" / "corpus"

# Values for symbolic dimensions (the corpus uses these names; anything else gets 2).
DIMS = {
    "batch_size": 2,
    "sequence_length": 8,
    "past_sequence_length": 4,
    "total_sequence_length": 12,
}


def backend_models() -> list[Path]:
    """Every model of the onnx wheel's backend data: `<kind>/<test>/model.onnx`, `light/*.onnx`."""
    found: list[Path] = []
    for kind in BACKEND_KINDS:
        found += sorted((BACKEND_DATA / kind).glob("*/model.onnx"))
        found += sorted((BACKEND_DATA / kind).glob("*.onnx"))
    return found


def corpus_models() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*/model.onnx")) if CORPUS_DIR.is_dir() else []


def model_id(path: Path) -> str:
    """Short test id: `simple/test_shrink`, `light/light_vgg19`, `corpus/llama_ts_cache`."""
    if path.name != "model.onnx":
        return f"{path.parent.name}/{path.stem}"
    group = "corpus" if CORPUS_DIR in path.parents else path.parent.parent.name
    return f"{group}/{path.parent.name}"


def ort_session(path: Path | str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1  # deterministic kernels: parity means bit-identical
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run_ort(path: Path | str, feeds: dict[str, Any]) -> list[Any]:
    return ort_session(path).run(None, feeds)


def assert_outputs_identical(expected: list[Any], actual: list[Any]) -> None:
    """Bit-identical outputs (NaNs must sit in the same places); recurses into sequences."""
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, (list, tuple)):
            assert isinstance(a, (list, tuple)), f"output {i}"
            assert_outputs_identical(list(e), list(a))
        else:
            e, a = np.asarray(e), np.asarray(a)
            assert e.dtype == a.dtype and e.shape == a.shape, f"output {i}"
            np.testing.assert_array_equal(a, e, err_msg=f"output {i}", strict=True)


def random_feeds(model: onnx.ModelProto, meta: dict[str, Any] | None = None, seed: int = 0) -> dict:
    """Random inputs for the graph inputs that are not initializers.

    Integer inputs stay in a small valid range: token ids below the vocabulary size from meta.json,
    attention masks of ones, position ids counting on from the past length, anything else 0..1.
    """
    rng = np.random.default_rng(seed)
    vocab = int(((meta or {}).get("config") or {}).get("vocab_size", 2))
    initializers = {t.name for t in model.graph.initializer}
    has_past = any("past" in vi.name for vi in model.graph.input)
    feeds: dict[str, Any] = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        tt = vi.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else DIMS.get(d.dim_param, 2)
            for d in tt.shape.dim
        ]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if dtype == np.bool_:
            feeds[vi.name] = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            if "input_ids" in vi.name:
                value = rng.integers(0, vocab, shape)
            elif "attention_mask" in vi.name:
                value = np.ones(shape)
            elif "position_ids" in vi.name:
                start = DIMS["past_sequence_length"] if has_past else 0
                value = np.broadcast_to(np.arange(start, start + shape[-1]), shape)
            else:
                value = rng.integers(0, 2, shape)
            feeds[vi.name] = np.ascontiguousarray(value, dtype=dtype)
        elif dtype == np.object_:
            feeds[vi.name] = np.full(shape, "a", dtype=object)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def model_feeds(path: Path, model: onnx.ModelProto) -> dict[str, Any]:
    """Backend tests: `test_data_set_0/input_*.pb`; otherwise random feeds (meta.json if any)."""
    data_set = path.parent / "test_data_set_0"
    files = sorted(data_set.glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    if path.name == "model.onnx" and files:
        initializers = {t.name for t in model.graph.initializer}
        inputs = [vi for vi in model.graph.input if vi.name not in initializers]
        feeds: dict[str, Any] = {}
        for vi, f in zip(inputs, files):
            if vi.type.HasField("sequence_type"):
                seq = onnx.SequenceProto.FromString(f.read_bytes())
                feeds[vi.name] = numpy_helper.to_list(seq)
            else:
                feeds[vi.name] = numpy_helper.to_array(onnx.load_tensor(str(f)))
        return feeds
    meta_file = path.parent / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    return random_feeds(model, meta)


def tensor_protos(graph: onnx.GraphProto | onnx.FunctionProto) -> list[onnx.TensorProto]:
    """Initializers and tensor attributes of a graph (or function body) and all its subgraphs."""
    out = list(graph.initializer) if isinstance(graph, onnx.GraphProto) else []
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                out.append(attr.t)
            out.extend(attr.tensors)
            subgraphs = [attr.g] if attr.HasField("g") else []
            for g in [*subgraphs, *attr.graphs]:
                out += tensor_protos(g)
    return out


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every tensor's payload and storage fields cleared (structure comparison)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for owner in [copy.graph, *copy.functions]:
        for t in tensor_protos(owner):
            for field in (
                "raw_data",
                "data_location",
                "external_data",
                "float_data",
                "int32_data",
                "int64_data",
                "double_data",
                "uint64_data",
                "string_data",
            ):
                t.ClearField(field)
    return copy


def first_difference(a: Message, b: Message, path: str = "") -> str | None:
    """Where two protobuf messages first differ (a short description), or None when equal."""
    if a == b:
        return None
    for field in a.DESCRIPTOR.fields:
        name, where = field.name, f"{path}.{field.name}"
        va, vb = getattr(a, name), getattr(b, name)
        repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.x; `label` before
        if repeated if repeated is not None else field.label == field.LABEL_REPEATED:
            if len(va) != len(vb):
                return f"{where}: {len(va)} vs {len(vb)} entries"
            for i, (x, y) in enumerate(zip(va, vb)):
                if isinstance(x, Message):
                    found = first_difference(x, y, f"{where}[{i}]")
                    if found:
                        return found
                elif x != y:
                    return f"{where}[{i}]: {_short(x)} != {_short(y)}"
            continue
        if field.has_presence and a.HasField(name) != b.HasField(name):
            return f"{where}: set in {'first' if a.HasField(name) else 'second'} only"
        if isinstance(va, Message):
            found = first_difference(va, vb, where)
            if found:
                return found
        elif va != vb:
            return f"{where}: {_short(va)} != {_short(vb)}"
    return f"{path or '<root>'}: known fields equal, unknown fields differ"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} chars)"


def assert_proto_equal(expected: Message, actual: Message) -> None:
    """Exact protobuf equality (presence and unknown fields count), with a short failure message."""
    if expected != actual:
        pytest.fail(f"protos differ: {first_difference(expected, actual)}", pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests parametrized by a fixture of llm_fixtures.SLOW_FIXTURES are slow."""
    from support.llm_fixtures import SLOW_FIXTURES

    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        names = {getattr(v, "name", None) for v in callspec.params.values()}
        if names & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
