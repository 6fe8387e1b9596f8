"""Calibration text the model writes itself: ``--calibration sampled``, and whenever no tokenizer
is found. SEQUENCES continuations of BOS, TOKENS long, sampled at TEMPERATURE (seeded: the same
model gives the same text), EOS never drawn so every sequence runs its full length.

Why this much: GPTQ (``--recipe q4m``) on SmolLM2-135M calibrated on its own samples scored KL
0.220 with 192 tokens, 0.178 with 1,024, 0.140 with 2,048 and 0.124 with 64 x 64 (the built-in
prose: 0.106; round to nearest 0.366; bench/results/quantize_accuracy.md, "No data"): with
enough of it, the model's own text comes close to real prose as a calibration set, and it needs
no data.

Sampling runs batched through a KV cache: a second, in-memory copy of the model (the file mapped
again, no weight copied) gets optimize's default passes and ``add_kv_cache`` (standard form), so
each token costs one decode step instead of a pass over its whole prefix (64 x 64 tokens: 4,096
token steps instead of 133,000). A model exported with a cache goes through add_kv_cache too:
its own cache is not trusted (gemma3's TorchScript cache export decodes other tokens than it
recomputes). Where no cache can be had (the model is not a file, add_kv_cache refuses, the
cache's geometry is not static) the model recomputes each prefix, RECOMPUTED_SEQUENCES x
RECOMPUTED_TOKENS, and the source says why.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastopt import _C
from fastopt._lazy import lazy_module
from fastopt.errors import is_foreign
from fastopt.verify.step_feeds import present_name, step_feeds
from fastopt.verify.text_tokens import config_ids, draw

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")

SEQUENCES = 64
TOKENS = 64
TEMPERATURE = 0.8
SEED = 0
# Without a cache (each step recomputes the prefix: quadratic), a short sample.
RECOMPUTED_SEQUENCES = 4
RECOMPUTED_TOKENS = 48
_IDS = ("input_ids", "attention_mask", "position_ids")
_NP_INT = {"tensor(int64)": "int64", "tensor(int32)": "int32"}
_NP_FLOAT = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}


@dataclass
class SampledText:
    batches: list[np.ndarray]  # [1, T] token ids per sequence
    source: str  # how they were made, for the report
    seconds: float


def sample_calibration(
    model: _C.Model, folders: Sequence[str], workdir: str, why: str
) -> SampledText:
    """The model's own calibration sequences (module docstring); ``why``: why no text was used."""
    start = time.perf_counter()
    bos, eos = _special_id(folders, "bos_token_id"), _special_ids(folders, "eos_token_id")
    rows, how = None, "through a KV cache"
    with ExitStack() as stack:
        try:
            sess = _cached_session(model, stack, workdir)
            rows = _decode(sess, bos, eos, SEQUENCES, TOKENS, np.random.default_rng(SEED))
        except Exception as e:  # (ONNX Runtime's too: said in the source, then recomputed)
            how = f"recomputing each prefix (no KV cache: {_said(e)})"
            if not (isinstance(e, _C.ModelError) or is_foreign(e)):
                raise  # fastopt's own bug: not hidden behind the fallback
    if rows is None:
        with ExitStack() as stack:  # (the cached copy's session released first)
            sess = _plain_session(model, stack, workdir)
            try:
                rows = _recompute(sess, bos, eos, np.random.default_rng(SEED))
            except Exception as e:
                raise _C.ModelError(
                    f"calibration: cannot sample the model's text: {_said(e)}"
                ) from e
    batches = [r[None, :] for r in rows]
    source = (
        f"{len(rows)} sequences of {rows.shape[1]} tokens sampled from the model at temperature "
        f"{TEMPERATURE} {how} ({why})"
    )
    return SampledText(batches, source, time.perf_counter() - start)


def _said(e: Exception) -> str:
    from fastopt.verify.check import summarize_error

    return str(e) if isinstance(e, _C.ModelError) else f"ONNX Runtime: {summarize_error(str(e))}"


def _cached_session(model: _C.Model, stack: ExitStack, workdir: str) -> Any:
    """An ORT session of the model with a standard KV cache; ModelError where none can be had."""
    if not model.path:
        raise _C.ModelError("the model is not a file to map a second copy from")
    from fastopt._io import load
    from fastopt.pipeline.kv_cache import KV_CACHE_MODES, KV_CACHE_PASS, with_kv_cache
    from fastopt.pipeline.manager import run_passes
    from fastopt.pipeline.registry import PassContext, preset

    copy = load(model.path)
    names = with_kv_cache(preset("default"), "standard", "ort")
    ctx = PassContext(model=copy, target="ort", options={"kv_cache": KV_CACHE_MODES["standard"]})
    run_passes(names, ctx)
    outputs = {v.name for v in ctx.model.graph.outputs if v is not None}
    if _C.KV_PRESENT_PREFIX + "0.key" not in outputs:
        raise _C.ModelError(f"{KV_CACHE_PASS} added no cache")
    return _plain_session(ctx.model, stack, workdir)


def _plain_session(model: _C.Model, stack: ExitStack, workdir: str) -> Any:
    import onnx

    from fastopt.quant.activation_ranges import _PLACEHOLDER, _session

    skeleton = model.skeleton()
    return _session(
        onnx.load_from_string(skeleton), skeleton.count(_PLACEHOLDER), model, stack, workdir
    )


def _decode(
    sess: Any, bos: int, eos: Sequence[int], sequences: int, tokens: int, rng: Any
) -> np.ndarray:
    """[sequences, tokens] ids: BOS, then one batched decode step per token through the cache."""
    inputs = {i.name: i for i in sess.get_inputs()}
    pasts = [i for i in inputs.values() if i.name.startswith(_C.KV_PAST_PREFIX)]
    if not pasts:
        raise _C.ModelError("the cached model has no past inputs")
    cache = {p.name: _empty_past(p, sequences) for p in pasts}
    outputs = [o.name for o in sess.get_outputs()]
    logits = _logits_name(sess)
    ids = np.full((sequences, 1), bos, np.int64)
    rows = [ids]
    for past in range(tokens - 1):
        feeds = _step_feeds(inputs, ids, past, cache)
        got = dict(zip(outputs, sess.run(outputs, feeds)))
        ids = draw(got[logits][:, -1], rng, TEMPERATURE, eos)[:, None]
        rows.append(ids)
        for p in pasts:
            cache[p.name] = got[present_name(p.name)]
    return np.concatenate(rows, axis=1)


def _recompute(sess: Any, bos: int, eos: Sequence[int], rng: Any) -> np.ndarray:
    """[RECOMPUTED_SEQUENCES, RECOMPUTED_TOKENS] ids, each step a run over the whole prefix
    (empty pasts where the model was exported with a cache)."""
    inputs = {i.name: i for i in sess.get_inputs()}
    pasts = [i for i in inputs.values() if i.name.startswith(_C.KV_PAST_PREFIX)]
    empty = {p.name: _empty_past(p, RECOMPUTED_SEQUENCES) for p in pasts}
    logits = _logits_name(sess)
    ids = np.full((RECOMPUTED_SEQUENCES, 1), bos, np.int64)
    for _ in range(RECOMPUTED_TOKENS - 1):
        (last,) = sess.run([logits], _step_feeds(inputs, ids, 0, empty))
        ids = np.concatenate([ids, draw(last[:, -1], rng, TEMPERATURE, eos)[:, None]], axis=1)
    return ids


def _step_feeds(
    inputs: dict[str, Any], ids: np.ndarray, past: int, cache: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A step's inputs: ``ids`` [B, T] after ``past`` cached tokens (mask of ones, positions
    past..past+T-1); ModelError for an input a causal LM's step does not have."""
    feeds = {**step_feeds(ids, past), **cache}
    unknown = sorted(set(inputs) - set(feeds))
    if "input_ids" not in inputs or unknown:
        raise _C.ModelError(f"inputs {unknown} beside a causal LM's")
    return {
        k: v.astype(_NP_INT.get(inputs[k].type, "int64")) if k in _IDS else v
        for k, v in feeds.items()
        if k in inputs
    }


def _logits_name(sess: Any) -> str:
    outputs = [o.name for o in sess.get_outputs()]
    return next((n for n in outputs if "logits" in n), outputs[0])


def _empty_past(past: Any, batch: int) -> np.ndarray:
    heads, size = past.shape[1], past.shape[3]
    if len(past.shape) != 4 or not isinstance(heads, int) or not isinstance(size, int):
        raise _C.ModelError(f"{past.name} {past.shape}: the cache's geometry is not static")
    if past.type not in _NP_FLOAT:
        raise _C.ModelError(f"{past.name} is {past.type}")
    return np.zeros((batch, heads, 0, size), _NP_FLOAT[past.type])


def _special_ids(folders: Sequence[str], key: str) -> list[int]:
    """``key``'s ids in the first of ``folders`` whose config files have it
    (fastopt.verify.text_tokens.config_ids, as the real-text check reads its start token)."""
    return next((ids for f in folders if (ids := config_ids(f, key)[0])), [])


def _special_id(folders: Sequence[str], key: str) -> int:
    return next(iter(_special_ids(folders, key)), 0)
