"""Calibration for weight quantization: the importance of each input channel of each weight
MatMul, measured by running the float model in ONNX Runtime on calibration text.

For every MatMul whose B is a 2-D float initializer W [K, N] (or Transpose of one: a tied
lm_head), the graph gets ``ReduceSumSquare(Reshape(A, [-1, K]), axes=[0])`` (length K) and
``Size(A)`` as extra outputs, so nothing the size of an activation is kept: ONNX Runtime frees
the activations as it always does. Summed over the batches and divided by the rows seen, that is
the importance vector of W: mean x_k^2 over tokens, per input channel k (what llama.cpp's
imatrix holds). A weight read by several MatMuls accumulates over all of them.

The text (``--calibration FILE|builtin|sampled``; builtin: ``fastopt/quant/calibration.txt``, prose
written for this package) is tokenized with the model's tokenizer: ``tokenizer.json`` beside the
model or in the ``hf_config`` folder, read with the ``tokenizers`` package, else with
onnxruntime-genai's tokenizer when the folder holds a genai_config.json. With ``sampled``, or with
no tokenizer, the model writes its own calibration text (fastopt.quant.sampled_text: continuations
of its BOS token, batched through a KV cache; never uniform random ids, which no layer sees in use).

With ``hessians=True`` (``--method gptq``), each distinct MatMul input also gets
``MatMul(Transpose(Reshape(A, [-1, K])), Reshape(A, [-1, K]))``: H = X^T X [K, K], summed over the
runs in float32 (fastopt.quant.gptq says what it costs and where it refuses).

The importance file (``write_importance``) is an ONNX model whose graph holds only initializers:
one float32 1-D tensor of length K per weight, named as the MatMul's weight initializer. The
quantization pass reads it as option ``quant_importance=PATH``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.quant.importance_file import write_importance_file
from fastopt.quant.sampled_text import sample_calibration
from fastopt.quant.token_feeds import ids_input, token_feeds

if TYPE_CHECKING:
    import numpy as np
    import onnx
else:
    np = lazy_module("numpy")

BUILTIN = "builtin"
SAMPLED = "sampled"  # the model's own text, even where a tokenizer is found
# Tokens per calibration sequence, and the most tokens taken from the text in all.
SEQUENCE = 128
MAX_TOKENS = 4096
# Sequences of one length run together, up to this many tokens a run: batch 8 x 64 ran SmolLM2's
# forward 1.9x faster than 8 runs of one sequence (ORT's MatMuls are more efficient at more
# rows), while a run's activations (the logits above all: tokens x vocab) stay bounded.
RUN_TOKENS = 512
_PREFIX = "fastopt_calib/"
_FLOAT_TYPES = (1, 10, 16)  # float, float16, bfloat16


@dataclass
class Importance:
    """Per weight initializer: mean x_k^2 of its MatMul's input over the calibration tokens."""

    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    tokens: int = 0  # tokens run through the model
    source: str = ""  # what the tokens came from
    seconds: float = 0.0  # the whole calibration
    sampling_seconds: float = 0.0  # writing the model's own text (sampled_text), when it did
    forward_seconds: float = 0.0  # ONNX Runtime's runs of the instrumented model alone
    # with hessians=True: weight -> X^T X [K, K] float32 summed over the tokens (one array
    # shared by the weights of one input)
    hessians: dict[str, np.ndarray] = field(default_factory=dict)
    hessian_inputs: int = 0  # distinct inputs whose X^T X were collected
    hessian_passes: int = 0  # passes over the tokens that collected them (groups)
    hessian_peak_bytes: int = 0  # the most bytes of X^T X sums held at once

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights": len(self.vectors),
            "hessians": self.hessian_inputs,
            "hessian_passes": self.hessian_passes,
            "hessian_peak_bytes": self.hessian_peak_bytes,
            "tokens": self.tokens,
            "source": self.source,
            "seconds": self.seconds,
            "forward_seconds": self.forward_seconds,
            "sampling_seconds": self.sampling_seconds,
        }


class Probe(Protocol):
    """More statistics gathered in the same ONNX Runtime runs as the importance (so calibration
    costs one pass): fastopt.quant.activation_ranges.RangeProbe (the fp16 range check)."""

    def instrument(self, proto: onnx.ModelProto) -> list[str]:
        """Adds the probe's nodes and graph outputs to ``proto``; returns the outputs' names."""
        ...

    def add(self, got: Sequence[Any], source: str) -> None:
        """One run's values of the probe's outputs; ``source``: "calibration" or "extra"."""
        ...

    def extra_inputs(self) -> Sequence[Mapping[str, np.ndarray]]:
        """Input sets run after the calibration text, for the probe's outputs alone."""
        ...


@dataclass(frozen=True)
class WeightUse:
    """A MatMul reading a weight: the node, the A input, the weight's name and K."""

    node: str
    a: str
    weight: str
    k: int


def weight_matmuls(model: _C.Model) -> list[WeightUse]:
    """The main graph's MatMuls whose B is a 2-D float initializer (or a Transpose of one)."""
    out = []
    for n in model.graph.nodes:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or len(n.inputs) != 2:
            continue
        a, b = n.inputs
        if a is None or b is None:
            continue
        t, k = b.initializer, 0
        if t is not None and len(t.shape) == 2:
            k = t.shape[0]
        elif t is None and b.producer is not None and b.producer.op_type == "Transpose":
            src = b.producer.inputs[0]
            t = src.initializer if src is not None else None
            perm = b.producer.attributes.get("perm")
            if t is not None and len(t.shape) == 2 and perm in (None, [1, 0]):
                k = t.shape[1]
            else:
                t = None
        if t is None or k == 0 or t.dtype not in _FLOAT_TYPES:
            continue
        out.append(WeightUse(n.name, a.name, t.name, int(k)))
    return out


def builtin_text() -> str:
    return resources.files("fastopt.quant").joinpath("calibration.txt").read_text("utf-8")


def calibration_text(calibration: str) -> str:
    """The text of ``--calibration``: ``builtin`` or a UTF-8 text file; ModelError otherwise."""
    if calibration == BUILTIN:
        return builtin_text()
    try:
        with open(calibration, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise _C.ModelError(
            f"calibration: cannot read {calibration!r} as UTF-8 text ({e.__class__.__name__}); "
            "give a text file or 'builtin'"
        ) from e
    if not text.strip():
        raise _C.ModelError(f"calibration: {calibration!r} is empty")
    return text


def tokenizer_folders(model: _C.Model, hf_config: str | None) -> list[str]:
    folders = [hf_config] if hf_config else []
    if model.path:
        folders.append(os.path.dirname(os.path.abspath(model.path)))
    return folders


def find_tokenizer(folders: Sequence[str]) -> tuple[Callable[[str], list[int]] | None, str]:
    """An encode function for the first folder with a tokenizer, and what was used (or why
    none was: the message names what to install or pass)."""
    for folder in folders:
        path = os.path.join(folder, "tokenizer.json")
        if os.path.isfile(path):
            try:
                import tokenizers
            except ImportError:
                break  # maybe onnxruntime-genai's, below
            tok = tokenizers.Tokenizer.from_file(path)
            return (lambda text, tok=tok: list(tok.encode(text).ids)), f"tokenizer {path}"
    for folder in folders:
        if os.path.isfile(os.path.join(folder, "genai_config.json")):
            try:
                import onnxruntime_genai as og  # type: ignore[import-untyped]

                gtok = og.Tokenizer(og.Model(folder))
            except Exception:
                continue
            return (lambda text, gtok=gtok: [int(i) for i in gtok.encode(text)]), (
                f"onnxruntime-genai tokenizer in {folder}"
            )
    where = ", ".join(folders) or "no folder (the model is not a file)"
    has_json = any(os.path.isfile(os.path.join(f, "tokenizer.json")) for f in folders)
    why = (
        "tokenizer.json found but neither the tokenizers package nor onnxruntime-genai can read it"
        if has_json
        else f"no tokenizer.json in {where}"
    )
    return None, why


def hessian_inputs(uses: Sequence[WeightUse]) -> dict[str, int]:
    """Distinct MatMul inputs -> the index of the first use reading each (its X^T X output)."""
    first: dict[str, int] = {}
    for i, u in enumerate(uses):
        first.setdefault(u.a, i)
    return first


def _xtx_inputs(uses: Sequence[WeightUse], only: Collection[str] | None) -> dict[str, int]:
    """hessian_inputs, of the inputs in ``only`` when given (one group's)."""
    first = hessian_inputs(uses)
    return first if only is None else {a: i for a, i in first.items() if a in only}


class _Accumulator:
    def __init__(
        self,
        uses: Sequence[WeightUse],
        hessians: bool = False,
        xtx_inputs: Collection[str] | None = None,
    ) -> None:
        self.uses = uses
        self.sums: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}
        self.inputs = _xtx_inputs(uses, xtx_inputs) if hessians else {}
        self.xtx: dict[str, np.ndarray] = {}  # input -> sum X^T X (float32)
        self.peak_bytes = 0  # the most bytes self.xtx held

    def outputs(self) -> list[str]:
        out = []
        for i in range(len(self.uses)):
            out += [f"{_PREFIX}{i}/sumsq", f"{_PREFIX}{i}/size"]
        out += [f"{_PREFIX}{i}/xtx" for i in self.inputs.values()]
        return out

    def add(self, got: Sequence[Any]) -> None:
        for i, u in enumerate(self.uses):
            sumsq = np.asarray(got[2 * i], dtype=np.float64)
            rows = int(np.asarray(got[2 * i + 1])) // u.k
            if u.weight in self.sums:
                self.sums[u.weight] += sumsq
            else:
                self.sums[u.weight] = sumsq.copy()
            self.rows[u.weight] = self.rows.get(u.weight, 0) + rows
        base = 2 * len(self.uses)
        for j, a in enumerate(self.inputs):
            h = np.asarray(got[base + j], np.float32)
            if a in self.xtx:
                self.xtx[a] += h
            else:
                self.xtx[a] = h
        held = sum(h.nbytes for h in self.xtx.values())
        self.peak_bytes = max(self.peak_bytes, held)

    def hessians(self) -> dict[str, np.ndarray]:
        return {u.weight: self.xtx[u.a] for u in self.uses if u.a in self.xtx}

    def vectors(self) -> dict[str, np.ndarray]:
        return {w: (s / max(self.rows[w], 1)).astype(np.float32) for w, s in self.sums.items()}


def _instrument(
    proto: onnx.ModelProto, uses: Sequence[WeightUse], opset: int, xtx: Collection[int] = ()
) -> None:
    """Adds per use i the outputs ``<prefix>i/sumsq`` (float32 [K]) and ``<prefix>i/size``, and
    for the uses i in ``xtx`` (each the first reader of its input: _Accumulator.inputs)
    ``<prefix>i/xtx`` [K, K]."""
    from onnx import TensorProto, helper, numpy_helper

    g = proto.graph
    axes = _PREFIX + "axes0"
    g.initializer.append(numpy_helper.from_array(np.array([0], np.int64), axes))
    for i, u in enumerate(uses):
        t = f"{_PREFIX}{i}/"
        shape = t + "shape"
        g.initializer.append(numpy_helper.from_array(np.array([-1, u.k], np.int64), shape))
        g.node.extend(
            [
                helper.make_node("Cast", [u.a], [t + "f32"], name=t + "Cast", to=TensorProto.FLOAT),
                helper.make_node("Reshape", [t + "f32", shape], [t + "rows"], name=t + "Reshape"),
                helper.make_node("Size", [u.a], [t + "size"], name=t + "Size"),
            ]
        )
        if opset >= 18:
            g.node.append(
                helper.make_node(
                    "ReduceSumSquare", [t + "rows", axes], [t + "sumsq"], name=t + "RSS", keepdims=0
                )
            )
        else:
            g.node.append(
                helper.make_node(
                    "ReduceSumSquare",
                    [t + "rows"],
                    [t + "sumsq"],
                    name=t + "RSS",
                    axes=[0],
                    keepdims=0,
                )
            )
        g.output.extend(
            [
                helper.make_tensor_value_info(t + "sumsq", TensorProto.FLOAT, [u.k]),
                helper.make_tensor_value_info(t + "size", TensorProto.INT64, []),
            ]
        )
        if i in xtx:
            g.node.extend(
                [
                    helper.make_node("Transpose", [t + "rows"], [t + "rowsT"], name=t + "T"),
                    helper.make_node(
                        "MatMul", [t + "rowsT", t + "rows"], [t + "xtx"], name=t + "XtX"
                    ),
                ]
            )
            g.output.append(helper.make_tensor_value_info(t + "xtx", TensorProto.FLOAT, [u.k, u.k]))


def _chunks(ids: Sequence[int], length: int, limit: int) -> list[np.ndarray]:
    ids = list(ids)[:limit]
    return [
        np.array([ids[i : i + length]], np.int64) for i in range(0, len(ids), length) if ids[i:]
    ]


def collect_importance(
    model: _C.Model,
    calibration: str = BUILTIN,
    hf_config: str | None = None,
    *,
    sequence: int = SEQUENCE,
    max_tokens: int = MAX_TOKENS,
    token_batches: Iterable[np.ndarray] | None = None,
    workdir: str = "",
    probes: Sequence[Probe] = (),
    importance: bool = True,
    hessians: bool = False,
    run_tokens: int = RUN_TOKENS,
    hessian_sink: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Importance:
    """Runs ``model`` (not changed) in ONNX Runtime on the calibration tokens and returns the
    importance vectors of its MatMul weights (and with ``hessians`` their inputs' X^T X, for
    GPTQ). ``token_batches`` ([1, T] id arrays) replace the text when given. Sequences of one
    length run together, ``run_tokens`` tokens a run at most. ``probes`` gather
    their own statistics in the same runs; with ``importance=False`` they alone are gathered
    (no vectors).

    Where the X^T X do not fit fastopt.quant.gptq's limit at once, they are collected in groups
    of inputs (gptq.hessian_groups), one pass over the same tokens per group (the first also
    gathers the importance and the probes), and each group's go to ``hessian_sink`` (weight ->
    H) and are freed before the next pass; ``hessians`` then stays empty. ModelError when the
    model cannot run, has no weight MatMul, one input's X^T X alone is over the limit, or the
    groups have no sink."""
    start = time.perf_counter()
    uses = weight_matmuls(model) if importance else []
    if importance and not uses:
        raise _C.ModelError("calibration: the model has no MatMul with a constant 2-D weight")
    groups: list[list[str]] = []
    if hessians:
        from fastopt.quant.gptq import hessian_groups

        groups = hessian_groups(uses)
        if len(groups) > 1 and hessian_sink is None:
            raise _C.ModelError(
                f"calibration: the X^T X take {len(groups)} passes under the limit, and no "
                "sink takes each pass's (hessian_sink)"
            )
    folders = tokenizer_folders(model, hf_config)
    ids_name = ids_input(model)  # (a model without token ids: refused before any run)
    encode, source = None, "token batches given"
    batches: list[np.ndarray] | None = None
    if token_batches is not None:
        batches = [np.asarray(b, np.int64).reshape(1, -1) for b in token_batches]
    elif calibration == SAMPLED:
        source = "--calibration sampled"
    else:
        text = calibration_text(calibration)
        encode, source = find_tokenizer(folders)
        if encode is not None:
            batches = _chunks(encode(text), sequence, max_tokens)
            what = "builtin text" if calibration == BUILTIN else calibration
            source = f"{what} ({source})"
    imp = Importance()
    if batches is None:  # the model writes its own text (before the instrumented session)
        sampled = sample_calibration(model, folders, workdir, source)
        batches, source, imp.sampling_seconds = sampled.batches, sampled.source, sampled.seconds
    batches = _stacked(batches, run_tokens)
    opset = next((v for k, v in model.opset_imports.items() if k in ("", "ai.onnx")), 17)
    skeleton = model.skeleton()
    first = groups[0] if len(groups) > 1 else None
    acc = _Accumulator(uses, hessians, first)
    _pass(model, skeleton, opset, batches, ids_name, workdir, imp, acc, probes)
    imp.tokens = sum(int(ids.size) for ids in batches)
    imp.vectors = acc.vectors()
    if first is None:
        imp.hessians = acc.hessians()
    else:
        assert hessian_sink is not None
        hessian_sink(acc.hessians())
        del acc
        for group in map(set, groups[1:]):
            group_acc = _Accumulator([u for u in uses if u.a in group], True)
            _pass(model, skeleton, opset, batches, ids_name, workdir, imp, group_acc)
            hessian_sink(group_acc.hessians())
    imp.source = source
    imp.seconds = time.perf_counter() - start
    return imp


def _stacked(batches: Sequence[np.ndarray], run_tokens: int) -> list[np.ndarray]:
    """Consecutive [1, T] sequences of one length as [B, T] runs of at most ``run_tokens``."""
    runs: list[np.ndarray] = []
    group: list[np.ndarray] = []
    for ids in batches:
        if group and (ids.shape != group[0].shape or (len(group) + 1) * ids.size > run_tokens):
            runs.append(np.concatenate(group))
            group = []
        group.append(ids)
    return runs + ([np.concatenate(group)] if group else [])


def _pass(
    model: _C.Model,
    skeleton: bytes,
    opset: int,
    batches: Sequence[np.ndarray],
    ids_name: str,
    workdir: str,
    imp: Importance,
    acc: _Accumulator,
    probes: Sequence[Probe] = (),
) -> None:
    """One pass over ``batches``: the graph instrumented for ``acc``'s statistics (and the
    probes'), each activation freed once reduced; its X^T X counted in ``imp``."""
    import onnx

    from fastopt.quant.activation_ranges import _PLACEHOLDER, _session, place_early

    proto = onnx.load_from_string(skeleton)
    plain = len(proto.graph.node)
    _instrument(proto, acc.uses, opset, acc.inputs.values())
    place_early(proto, plain)
    probe_outputs = [p.instrument(proto) for p in probes]
    with ExitStack() as stack, _ort_errors():
        sess = _session(proto, skeleton.count(_PLACEHOLDER), model, stack, workdir)
        del proto
        wanted = {i.name for i in sess.get_inputs()}
        _run_batches(sess, model, ids_name, wanted, batches, acc, probes, probe_outputs, imp)
        _probes_extra(sess, probes, probe_outputs, wanted)
    if acc.inputs:
        imp.hessian_inputs += len(acc.inputs)
        imp.hessian_passes += 1
        imp.hessian_peak_bytes = max(imp.hessian_peak_bytes, acc.peak_bytes)


@contextmanager
def _ort_errors() -> Iterator[None]:
    """ONNX Runtime's failures as the ModelError that names them."""
    from fastopt.verify.check import summarize_error

    try:
        yield
    except _C.ModelError:
        raise
    except Exception as e:
        raise _C.ModelError(
            f"calibration: ONNX Runtime could not run the model: {summarize_error(str(e))}"
        ) from e


def _run_batches(
    sess: Any,
    model: _C.Model,
    ids_name: str,
    wanted: set[str],
    batches: Sequence[np.ndarray],
    acc: _Accumulator,
    probes: Sequence[Probe],
    probe_outputs: Sequence[list[str]],
    imp: Importance,
) -> None:
    """One pass: every batch through ``sess``, its outputs into ``acc`` and the probes."""
    outputs = acc.outputs()
    for ids in batches:
        t0 = time.perf_counter()
        got = sess.run(outputs + _flat(probe_outputs), token_feeds(model, ids_name, ids, wanted))
        imp.forward_seconds += time.perf_counter() - t0
        acc.add(got)
        _probes_add(probes, probe_outputs, got[len(outputs) :], "calibration")
        del got  # (X^T X outputs: not two runs' at once)


def _flat(lists: Sequence[list[str]]) -> list[str]:
    return [x for names in lists for x in names]


def _probes_add(
    probes: Sequence[Probe], outputs: Sequence[list[str]], got: Sequence[Any], source: str
) -> None:
    at = 0
    for p, names in zip(probes, outputs):
        p.add(got[at : at + len(names)], source)
        at += len(names)


def _probes_extra(
    sess: Any, probes: Sequence[Probe], outputs: Sequence[list[str]], wanted: set[str]
) -> None:
    for p, names in zip(probes, outputs):
        for feeds in p.extra_inputs():
            fed = {k: np.asarray(v) for k, v in feeds.items() if k in wanted}
            p.add(sess.run(names, fed), "extra")


def write_importance(vectors: Mapping[str, np.ndarray], path: str | os.PathLike[str]) -> None:
    """The importance file: an ONNX model holding one float32 1-D initializer per weight, named
    as the weight (written atomically; fastopt.quant.importance_file, without onnx)."""
    write_importance_file(vectors, path)


def read_importance(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(os.fspath(path))
    return {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
