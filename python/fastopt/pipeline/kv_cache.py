"""The KV-cache policy of ``optimize(kv_cache=...)``: which form (the option add_kv_cache and the
cache-aware lowerings read), where add_kv_cache goes in the pass list, the refusal an encoder
gets, and the checks of the result (a cache was added; in place, every present is written by the
op that updates its buffer). The forms themselves are C++ (csrc/passes/kv_cache); what
onnxruntime-genai is told about them is fastopt.genai's.
"""

from __future__ import annotations

from typing import Literal

from fastopt import _C
from fastopt.errors import OptionError, UnsupportedModelError
from fastopt.pipeline.registry import place

KvCache = Literal["standard", "inplace"]
# ctx.options["kv_cache"] values read by add_kv_cache and the cache-aware lowerings.
KV_CACHE_MODES: dict[str, int] = {"standard": 1, "inplace": 2}
KV_CACHE_PASS = "add_kv_cache"
# An encoder-decoder's cached decoder (add_kv_cache's seq2seq form) has optimum's names.
SEQ2SEQ_PRESENT_KEY = _C.kv_cache_forms()["seq2seq"].present_key
# Its cross cache (present.<i>.encoder.*) keeps the standard form in place.
_CROSS_SECTION = _C.kv_cache_forms()["seq2seq_cross"].section + "."


def with_kv_cache(names: list[str], kv_cache: str, target: str) -> list[str]:
    """The pass list with add_kv_cache placed by its contract (registry.place): after the pass
    that fuses attention, whose internal Attention ops it edits, before lower_attention."""
    if kv_cache not in KV_CACHE_MODES:
        raise OptionError(f"kv_cache must be 'standard', 'inplace' or None, not {kv_cache!r}")
    if kv_cache == "inplace" and target != "ort":
        raise OptionError(
            "kv_cache='inplace' needs target 'ort' (GroupQueryAttention shares one buffer as "
            "past and present; no standard op does)"
        )
    try:
        return place(names, KV_CACHE_PASS)
    except OptionError as e:
        raise OptionError(f"kv_cache: {e}; the cache is added to the fused attention ops") from None


def refusal(name: str, model: _C.Model, error: _C.ModelError) -> Exception | None:
    """add_kv_cache's error on an encoder, said as what it is (pipeline.manager's FailureFn)."""
    if name == KV_CACHE_PASS and _looks_like_encoder(model):
        return UnsupportedModelError(_encoder_refusal(model, str(error)))
    return None


def is_seq2seq(model: _C.Model) -> bool:
    """An encoder-decoder's decoder: optimum's seq2seq names (present.0.decoder.key, ...)."""
    return SEQ2SEQ_PRESENT_KEY % 0 in {v.name for v in model.graph.outputs if v is not None}


def check_cache(model: _C.Model, kv_cache: str | None, seq2seq: bool) -> None:
    """After the passes: the cache asked for is there, in the form asked for."""
    output_names = {v.name for v in model.graph.outputs if v is not None}
    if kv_cache is not None and _C.KV_PRESENT_PREFIX + "0.key" not in output_names and not seq2seq:
        # A safety net: add_kv_cache should refuse with its own reason; never hand back (or
        # write) a "cached" model without a cache.
        raise UnsupportedModelError(
            f"kv_cache: {KV_CACHE_PASS} added no KV cache (no present.0.key output)"
        )
    if kv_cache == "inplace":
        _check_inplace(model, seq2seq)


def _looks_like_encoder(model: _C.Model) -> bool:
    """No logits out, hidden states instead (BERT and its kin): for the KV-cache refusal's
    wording only; a causal model of this shape (CLIP's text tower) still gets its cache."""
    outputs = {v.name for v in model.graph.outputs if v is not None}
    return "logits" not in outputs and bool(outputs & {"last_hidden_state", "pooler_output"})


def _encoder_refusal(model: _C.Model, reason: str) -> str:
    outputs = ", ".join(v.name for v in model.graph.outputs if v is not None)
    reason = reason.removeprefix(f"{KV_CACHE_PASS}: cannot add a KV cache: ")
    return (
        f"kv_cache: this model looks like an encoder (outputs {outputs}, no logits): an encoder "
        "reads every position at once and has no decoder cache; a KV cache is for a decoder "
        f"that generates token by token ({KV_CACHE_PASS}: {reason})"
    )


def _check_inplace(model: _C.Model, seq2seq: bool) -> None:
    """In place, each present must be written by an op that updates the past buffer it is bound
    to (GroupQueryAttention); a Concat allocates a new tensor that cannot alias its input. A
    seq2seq decoder's cross cache (present.<i>.encoder.*: filled at the first step, passed
    through after) keeps the standard form."""
    for v in model.graph.outputs:
        if v is None or not v.name.startswith(_C.KV_PRESENT_PREFIX):
            continue
        if seq2seq and _CROSS_SECTION in v.name:
            continue
        producer = v.producer
        op = producer.op_type if producer is not None else "a graph input"
        if op != "GroupQueryAttention":
            raise UnsupportedModelError(
                f"kv_cache='inplace': {v.name} is produced by {op}, not GroupQueryAttention: "
                "this model's attention was not lowered to the in-place form (use "
                "kv_cache='standard')"
            )
