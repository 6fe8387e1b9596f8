"""What to feed a model for one benchmark run: its kind, read from its inputs and outputs, and
the arrays of a prefill or a decode step.

Kinds:

``decoder``
    takes ``input_ids`` and returns ``logits``, no KV cache. A decode step has no cache to reuse,
    so it is a full forward over ``seq + 1`` tokens: what recompute costs per generated token.
``decoder_cache``
    also takes ``past*`` inputs (``[batch, kv_heads, past, head_dim]``) and returns the
    matching ``present*`` outputs, which grow. Prefill: ``seq`` tokens, past length 0. Decode:
    one token after a context of ``seq`` (past length ``seq``, mask width ``seq + 1``).
``decoder_inplace``
    past and present have the same shape and share the sequence dim_param (e.g.
    ``max_sequence_length``): one buffer per pair, bound as both input and output. The buffer
    holds ``max_length`` positions (default ``seq + 1``); the mask width is the total length.
``encoder``
    takes ``input_ids`` but returns no logits (e.g. BERT): prefill only.
``other``
    anything else: :func:`fastopt.verify.core.make_inputs` with ``batch`` and ``seq`` for the dims
    named like them; prefill only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from fastopt._lazy import lazy_module
from fastopt.errors import UnsupportedModelError
from fastopt.genai.cache_dims import cache_geometry
from fastopt.genai.config import GENAI_CONFIG
from fastopt.verify.core import make_inputs

if TYPE_CHECKING:
    import numpy as np
else:  # (the CLI imports this module for every command; only bench needs numpy)
    np = lazy_module("numpy")

PHASES = ("prefill", "decode")
KINDS = ("decoder", "decoder_cache", "decoder_inplace", "encoder", "other")

Dim = Union[int, str, None]


@dataclass(frozen=True)
class Port:
    """A graph input or output as ONNX Runtime describes it: name, type
    (``"tensor(float)"``) and shape (ints, dim_param names, or None)."""

    name: str
    type: str
    shape: tuple[Dim, ...]

    @classmethod
    def of(cls, arg: Any) -> Port:
        """From an ``onnxruntime.NodeArg``."""
        return cls(arg.name, arg.type, tuple(arg.shape or ()))


@dataclass
class Workload:
    """The arrays of one run and what they stand for.

    feeds: an array per graph input; for ``decoder_inplace`` the past inputs hold the whole
    buffers. shared: present output name -> past input name, bound to one buffer. dims:
    dim_param -> value, used to pre-allocate outputs. tokens: new tokens a run produces
    (``batch * seq`` for prefill, ``batch`` for decode), for tokens/s.
    """

    kind: str
    phase: str
    batch: int
    seq: int
    feeds: dict[str, np.ndarray]
    tokens: int
    shared: dict[str, str] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def describe(self) -> dict[str, str]:
        """Input name -> "int64[1, 128]", for reports."""
        return {k: f"{v.dtype.name}[{', '.join(map(str, v.shape))}]" for k, v in self.feeds.items()}


def _present_name(past: str) -> str:
    if past.startswith("past_key_values"):
        return "present" + past[len("past_key_values") :]
    return past.replace("past", "present", 1)


def cache_pairs(inputs: Sequence[Port], outputs: Sequence[Port]) -> dict[str, str]:
    """past input name -> present output name, for every rank-4 past input with a present."""
    names = {o.name for o in outputs}
    pairs = {}
    for i in inputs:
        if "past" in i.name.lower() and len(i.shape) == 4 and _present_name(i.name) in names:
            pairs[i.name] = _present_name(i.name)
    return pairs


def detect_kind(inputs: Sequence[Port], outputs: Sequence[Port]) -> str:
    """One of :data:`KINDS` (see the module docstring)."""
    in_names = {i.name for i in inputs}
    pairs = cache_pairs(inputs, outputs)
    if pairs:
        by_name = {o.name: o for o in outputs}
        past_ports = [i for i in inputs if i.name in pairs]
        inplace = all(
            p.shape == by_name[pairs[p.name]].shape and isinstance(p.shape[2], str)
            for p in past_ports
        )
        return "decoder_inplace" if inplace else "decoder_cache"
    if "input_ids" in in_names:
        return "decoder" if any(o.name == "logits" for o in outputs) else "encoder"
    return "other"


def _bind(dims: dict[str, int], dim: Dim, value: int) -> None:
    if isinstance(dim, str):
        dims.setdefault(dim, value)


def _named_dims(ports: Sequence[Port], batch: int, seq: int) -> dict[str, int]:
    """For models of kind ``other``: dims named like a batch or a sequence."""
    dims: dict[str, int] = {}
    for p in ports:
        for d in p.shape:
            if isinstance(d, str):
                low = d.lower()
                if "batch" in low:
                    dims[d] = batch
                elif "seq" in low or "len" in low:
                    dims[d] = seq
    return dims


def make_workload(
    model: Any,
    inputs: Sequence[Port],
    outputs: Sequence[Port],
    *,
    phase: str = "prefill",
    batch: int = 1,
    seq: int = 128,
    max_length: int | None = None,
    seed: int = 0,
) -> Workload:
    """The feeds of one `phase` step for `model` (a path or anything
    :func:`fastopt.verify.core.make_inputs` takes; token ids stay inside its vocabulary), whose
    graph inputs and outputs are `inputs` and `outputs`."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive (got batch={batch}, seq={seq})")
    kind = detect_kind(inputs, outputs)
    if phase == "decode" and kind in ("encoder", "other"):
        raise UnsupportedModelError(
            f"phase 'decode' needs a decoder (input_ids -> logits); this is {kind}"
        )
    by_name = {i.name: i for i in inputs}
    decode = phase == "decode"
    cached = kind in ("decoder_cache", "decoder_inplace")
    new = (1 if cached else seq + 1) if decode else seq
    past = seq if decode and cached else 0
    total = past + new
    dims: dict[str, int] = {}
    note = ""
    shared: dict[str, str] = {}
    if kind == "other":
        dims = _named_dims(inputs, batch, seq)
    else:
        ids = by_name["input_ids"].shape
        if len(ids) == 2:
            _bind(dims, ids[0], batch)
            _bind(dims, ids[1], new)
        if "attention_mask" in by_name and len(by_name["attention_mask"].shape) == 2:
            _bind(dims, by_name["attention_mask"].shape[1], total)
        pairs = cache_pairs(inputs, outputs)
        for name in pairs:
            shape = by_name[name].shape
            _bind(dims, shape[0], batch)
        _bind_cache_geometry(model, [by_name[n] for n in pairs], dims)
        if kind == "decoder_inplace":
            length = max_length if max_length is not None else total
            if length < total:
                raise ValueError(
                    f"max_length {length} is shorter than the {total} positions this step needs"
                )
            for name in pairs:
                _bind(dims, by_name[name].shape[2], length)
            shared = {present: past_name for past_name, present in pairs.items()}
            note = f"in-place cache: one [batch, kv_heads, {length}, head_dim] buffer per pair"
        elif kind == "decoder_cache":
            for name in pairs:
                _bind(dims, by_name[name].shape[2], past)
        elif kind == "decoder" and decode:
            note = f"no KV cache: decode = a full forward over seq+1 = {new} tokens (recompute)"
    feeds = make_inputs(model, dims, seed)
    if kind != "other":
        _fix_llm_inputs(feeds, batch, new, past, total)
    tokens = batch if decode else batch * seq
    return Workload(kind, phase, batch, seq, feeds, tokens, shared, dims, note)


def _bind_cache_geometry(model: Any, pasts: Sequence[Port], dims: dict[str, int]) -> None:
    """Values for past inputs' kv-heads and head-size dims when they are symbolic (the
    onnxruntime-genai builder's ``kv_cache_dim``); see :mod:`fastopt.genai.cache_dims`."""
    symbolic = [p for p in pasts if any(isinstance(p.shape[i], str) for i in (1, 3))]
    if not symbolic:
        return
    geometry = cache_geometry(model)
    if geometry is None:
        dim_names = sorted({str(d) for p in symbolic for d in (p.shape[1], p.shape[3])})
        raise UnsupportedModelError(
            f"{symbolic[0].name} has symbolic kv-heads / head-size dims ({', '.join(dim_names)}) "
            f"and neither a {GENAI_CONFIG} next to the model nor a GroupQueryAttention in it "
            "gives their sizes"
        )
    kv_heads, head_size = geometry
    for p in symbolic:
        _bind(dims, p.shape[1], kv_heads)
        _bind(dims, p.shape[3], head_size)


def _fix_llm_inputs(
    feeds: dict[str, np.ndarray], batch: int, new: int, past: int, total: int
) -> None:
    """Checks the token ids have the asked shape (a model with fixed dims may not), and sets
    the mask and positions of a step after `past` tokens."""
    ids = feeds["input_ids"]
    if ids.shape != (batch, new):
        raise UnsupportedModelError(
            f"input_ids would be {list(ids.shape)}, not [{batch}, {new}]: the model fixes "
            "its batch or sequence size"
        )
    if "attention_mask" in feeds:
        mask = feeds["attention_mask"]
        if mask.ndim == 2:
            feeds["attention_mask"] = np.ones((batch, total), mask.dtype)
    if "position_ids" in feeds:
        pos = feeds["position_ids"]
        if pos.shape == (batch, new):
            row = np.arange(past, past + new, dtype=pos.dtype)
            feeds["position_ids"] = np.ascontiguousarray(np.broadcast_to(row, (batch, new)))


def resolve_shape(shape: Sequence[Dim], dims: Mapping[str, int]) -> list[int] | None:
    """`shape` with its dim_params replaced from `dims`; None when one is unknown."""
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif isinstance(d, str) and d in dims:
            out.append(dims[d])
        else:
            return None
    return out
