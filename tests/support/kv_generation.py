"""Greedy generation with and without a KV cache, in ONNX Runtime: the proof harness of the
KV-cache rewrite (issue 5), importable by tests and benchmarks.

- ``greedy_no_cache``: the reference. Every step runs the no-cache model on the whole sequence
  (prompt + tokens generated so far) and appends the argmax of the last valid position.
- ``greedy_cached``: prefill with a zero-length past, then one token per step, the presents fed
  back as the next pasts.
  - standard (growing cache, Concat): each step's token is appended after the longest row, so a
    shorter row's cache has a hole (its prompt padding) that the (B, T) attention_mask marks 0;
    positions are cumsum(mask) - 1 (pads at 1), as generate() makes them. This works for right-
    and left-padded prompts alike (the mask carries everything); the batch helpers here pad
    right.
  - in-place (GroupQueryAttention, one (B, Hkv, max_length, D) buffer per layer bound as both
    past input and present output with ORT IO binding, ops.md §3.3): GQA writes row b's new
    token at index seqlens_k[b] = sum(mask[b]) - 1 (derived inside the graph from
    attention_mask), i.e. a row's valid tokens must be contiguous from 0: right padding only, and
    each step's mask is the contiguous one (row b: ones on its first len_b + step + 1 columns,
    width = the longest row's total). The first step's mask width equals the prompt length, which
    is how GQA recognises a prompt.

Prompts are lists of token ids of different lengths; ``right_pad`` batches them. Both functions
return a ``Generation``: tokens (B, steps) and the logits each step picked from (steps, B, vocab),
so step logits can be compared between models.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

ModelLike = str | os.PathLike[str] | bytes | ort.InferenceSession

_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(bfloat16)": np.float32,  # not fed from numpy; kept for completeness
    "tensor(double)": np.float64,
}


@dataclass
class Generation:
    tokens: np.ndarray  # (B, steps) int64
    logits: np.ndarray  # (steps, B, vocab), float32: the logits each token was picked from


def session(model: ModelLike, optimize: bool = False) -> ort.InferenceSession:
    """A CPU session; ORT's own graph optimizations off by default (the graph runs as written)."""
    if isinstance(model, ort.InferenceSession):
        return model
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model if isinstance(model, bytes) else os.fspath(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def right_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask), both (B, max_len) int64, rows padded at the end."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
        mask[b, : len(p)] = 1
    return ids, mask


def positions(mask: np.ndarray) -> np.ndarray:
    """position_ids from an attention mask: cumsum - 1, pads at 1 (as generate() makes them)."""
    pos = np.cumsum(mask, axis=1) - 1
    pos[mask == 0] = 1
    return pos.astype(np.int64)


def _input_names(sess: ort.InferenceSession) -> set[str]:
    return {i.name for i in sess.get_inputs()}


def _cache_layout(sess: ort.InferenceSession) -> tuple[int, int, int, dict[str, type]]:
    """(layers, kv_heads, head_dim, numpy dtype per past input) from the past_key_values inputs.
    Dtypes are per input: a cache takes K's dtype where it is inserted, and an fp16 export may
    compute some layers' K/V in fp32."""
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    keys = [i for i in pasts if i.name.endswith(".key")]
    if not keys:
        raise ValueError("the model has no past_key_values.{i}.key inputs")
    shape = keys[0].shape
    if not (isinstance(shape[1], int) and isinstance(shape[3], int)):
        raise ValueError(f"past_key_values.0.key shape {shape}: kv heads / head dim not numeric")
    return len(keys), shape[1], shape[3], {i.name: _ORT_DTYPES[i.type] for i in pasts}


def greedy_no_cache(
    model: ModelLike, prompt_ids: np.ndarray, attention_mask: np.ndarray, steps: int
) -> Generation:
    """Greedy decoding by full recompute. ``prompt_ids``/``attention_mask`` (B, S0) are right-
    padded prompts. Each step every row is laid out contiguously (its prompt, then its generated
    tokens, then padding), so a row's result does not depend on the others'."""
    sess = session(model)
    names = _input_names(sess)
    lengths = attention_mask.sum(axis=1).astype(np.int64)
    rows = [list(prompt_ids[b, : lengths[b]]) for b in range(len(lengths))]
    tokens, step_logits = [], []
    for _ in range(steps):
        ids, mask = right_pad(rows)
        feed = {"input_ids": ids, "attention_mask": mask}
        if "position_ids" in names:
            feed["position_ids"] = positions(mask)
        (logits,) = sess.run(["logits"], {k: v for k, v in feed.items() if k in names})
        last = np.array([len(r) - 1 for r in rows])
        picked = logits[np.arange(len(rows)), last].astype(np.float32)
        nxt = picked.argmax(axis=-1)
        for b, t in enumerate(nxt):
            rows[b].append(int(t))
        tokens.append(nxt)
        step_logits.append(picked)
    return Generation(np.stack(tokens, axis=1).astype(np.int64), np.stack(step_logits))


def greedy_no_cache_as_cached(
    model: ModelLike, prompts: Sequence[Sequence[int]], steps: int
) -> Generation:
    """Greedy decoding by full recompute on the layout a standard cache sees: the right-padded
    prompts, each step's token appended after the longest row, so a short row keeps its padding
    as a hole the mask marks 0. The no-cache model on the same inputs as ``greedy_cached``
    (standard): where a model's result depends on where padding sits (a sliding window counts
    positions, holes included, as transformers does), this is the reference that applies; for
    causal masks it equals ``greedy_no_cache``."""
    sess = session(model)
    names = _input_names(sess)
    ids, mask = right_pad(prompts)
    batch = len(prompts)
    last = mask.sum(axis=1).astype(np.int64) - 1
    tokens, step_logits = [], []
    for _ in range(steps):
        feed = {"input_ids": ids, "attention_mask": mask}
        if "position_ids" in names:
            feed["position_ids"] = positions(mask)
        (logits,) = sess.run(["logits"], {k: v for k, v in feed.items() if k in names})
        picked = logits[np.arange(batch), last].astype(np.float32)
        nxt = picked.argmax(axis=-1)
        tokens.append(nxt)
        step_logits.append(picked)
        ids = np.concatenate([ids, nxt.astype(np.int64)[:, None]], axis=1)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        last = np.full(batch, ids.shape[1] - 1, np.int64)
    return Generation(np.stack(tokens, axis=1).astype(np.int64), np.stack(step_logits))


def greedy_cached(
    model: ModelLike,
    prompts: Sequence[Sequence[int]],
    steps: int,
    inplace: bool = False,
    max_length: int | None = None,
    prefill_chunk: int | None = None,
) -> Generation:
    """Greedy decoding with the cache: a prefill step (zero-length past, or for ``inplace`` a
    zeroed max-length buffer) and ``steps - 1`` single-token steps. ``max_length`` (inplace) is
    the buffer length, default prompt + steps. ``prefill_chunk`` (standard only): prefill the
    prompts in chunks of that many tokens (multi-token steps with a non-empty past)."""
    sess = session(model)
    names = _input_names(sess)
    layers, kv_heads, head_dim, dtypes = _cache_layout(sess)
    ids, mask = right_pad(prompts)
    batch = len(prompts)
    lengths = mask.sum(axis=1).astype(np.int64)  # valid tokens per row so far
    if inplace:
        if prefill_chunk:
            raise ValueError(
                "prefill_chunk: standard cache only "
                "(in place: tests/kv_cache/test_inplace_chunks.py)"
            )
        return _greedy_inplace(sess, names, ids, lengths, steps, max_length)
    # Each past's own head size: multi-latent attention's values are narrower than its keys.
    dims = {i.name: i.shape[3] for i in sess.get_inputs() if i.name.startswith("past_key_values.")}
    past = {
        f"past_key_values.{i}.{kv}": np.zeros(
            (batch, kv_heads, 0, dims[name] if isinstance(dims[name], int) else head_dim),
            dtypes[name],
        )
        for i in range(layers)
        for kv in ("key", "value")
        for name in [f"past_key_values.{i}.{kv}"]
    }
    out_names = ["logits"] + [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]

    def run(
        step_ids: np.ndarray, mask: np.ndarray, past: dict[str, np.ndarray]
    ) -> list[np.ndarray]:
        feed = {"input_ids": step_ids, "attention_mask": mask, **past}
        if "position_ids" in names:
            feed["position_ids"] = positions(mask)[:, -step_ids.shape[1] :]
        outs: list[np.ndarray] = sess.run(out_names, {k: v for k, v in feed.items() if k in names})
        return outs

    def presents_as_pasts(outs: list[np.ndarray]) -> dict[str, np.ndarray]:
        return {
            f"past_key_values.{n[len('present.') :]}": v for n, v in zip(out_names[1:], outs[1:])
        }

    tokens, step_logits = [], []
    step_ids = ids
    last = lengths - 1  # index, in this step's input, of each row's last valid token
    early = np.zeros(batch, bool)
    if prefill_chunk:  # all chunks but the last; each row's logits come from the chunk
        picked = np.zeros((batch, 0), np.float32)  # holding its last valid token
        done = (ids.shape[1] - 1) // prefill_chunk * prefill_chunk  # start of the last chunk
        for c0 in range(0, done, prefill_chunk):
            c1 = c0 + prefill_chunk
            outs = run(ids[:, c0:c1], mask[:, :c1], past)
            past = presents_as_pasts(outs)
            if picked.shape[1] == 0:
                picked = np.zeros((batch, outs[0].shape[-1]), np.float32)
            for b in range(batch):
                if c0 <= last[b] < c1:
                    picked[b] = outs[0][b, last[b] - c0]
        step_ids = ids[:, done:]
        early = last < done
        last = np.where(early, 0, last - done)
    for step in range(steps):
        outs = run(step_ids, mask, past)
        picked_now = outs[0][np.arange(batch), last].astype(np.float32)
        if step == 0 and early.any():
            picked_now[early] = picked[early]
        picked = picked_now
        nxt = picked.argmax(axis=-1)
        tokens.append(nxt)
        step_logits.append(picked)
        past = {
            f"past_key_values.{n[len('present.') :]}": v for n, v in zip(out_names[1:], outs[1:])
        }
        # The next token goes after the longest row; shorter rows keep a hole the mask marks 0.
        step_ids = nxt.astype(np.int64)[:, None]
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        last = np.zeros(batch, np.int64)
    return Generation(np.stack(tokens, axis=1).astype(np.int64), np.stack(step_logits))


def inplace_buffers(
    sess: ort.InferenceSession, batch: int, max_length: int
) -> dict[tuple[int, str], ort.OrtValue]:
    """One zeroed (batch, kv_heads, max_length, head_dim) buffer per cache input, bound as both
    past and present by run_inplace_step (the in-place cache's contract)."""
    layers, kv_heads, head_dim, dtypes = _cache_layout(sess)
    return {
        (i, kv): ort.OrtValue.ortvalue_from_numpy(
            np.zeros((batch, kv_heads, max_length, head_dim), dtypes[f"past_key_values.{i}.{kv}"])
        )
        for i in range(layers)
        for kv in ("key", "value")
    }


def run_inplace_step(
    sess: ort.InferenceSession,
    names: set[str],
    buffers: dict[tuple[int, str], ort.OrtValue],
    feed: dict[str, np.ndarray],
) -> np.ndarray:
    """One step of an in-place model: `feed` (those of its inputs the model takes) and the
    buffers bound to past and present alike; returns the logits."""
    io = sess.io_binding()
    for k, v in feed.items():
        if k in names:
            io.bind_cpu_input(k, np.ascontiguousarray(v))
    io.bind_output("logits")  # first: copy_outputs_to_cpu() returns in binding order
    for (i, kv), buf in buffers.items():
        io.bind_ortvalue_input(f"past_key_values.{i}.{kv}", buf)
        io.bind_ortvalue_output(f"present.{i}.{kv}", buf)
    sess.run_with_iobinding(io)
    logits: np.ndarray = io.copy_outputs_to_cpu()[0]
    return logits


def _greedy_inplace(
    sess: ort.InferenceSession,
    names: set[str],
    ids: np.ndarray,
    lengths: np.ndarray,
    steps: int,
    max_length: int | None,
) -> Generation:
    batch = ids.shape[0]
    max_length = max_length or ids.shape[1] + steps
    buffers = inplace_buffers(sess, batch, max_length)
    tokens, step_logits = [], []
    step_ids = ids
    last = lengths - 1
    for _ in range(steps):
        # Contiguous mask: row b's tokens fill its first lengths[b] columns (GQA's seqlens_k).
        width = int(lengths.max())
        cur_mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        if width > max_length:
            raise ValueError(f"sequence length {width} exceeds the cache buffer {max_length}")
        feed = {"input_ids": step_ids, "attention_mask": cur_mask}
        if "position_ids" in names:
            feed["position_ids"] = positions(cur_mask)[:, -step_ids.shape[1] :]
            if step_ids.shape[1] == 1:  # the new token's position is the row's length - 1
                feed["position_ids"] = (lengths - 1)[:, None].astype(np.int64)
        logits = run_inplace_step(sess, names, buffers, feed)
        picked = logits[np.arange(batch), last].astype(np.float32)
        nxt = picked.argmax(axis=-1)
        tokens.append(nxt)
        step_logits.append(picked)
        step_ids = nxt.astype(np.int64)[:, None]
        lengths = lengths + 1
        last = np.zeros(batch, np.int64)
    return Generation(np.stack(tokens, axis=1).astype(np.int64), np.stack(step_logits))


def divergence(ref: Generation, got: Generation, step: int) -> tuple[float, float]:
    """At `step`, the first token mismatch: (the reference's margin between its token and the
    other run's, max over the rows that differ; max |logits diff| at that step). A flip whose
    step logits stay within the dtype's bound is a near-tie (margin < 2 x bound), not a wrong
    cache, which moves the logits far more."""
    rows = np.nonzero(ref.tokens[:, step] != got.tokens[:, step])[0]
    logits = ref.logits[step]
    margin = max(
        float(logits[b, ref.tokens[b, step]] - logits[b, got.tokens[b, step]]) for b in rows
    )
    return margin, float(np.abs(ref.logits[step] - got.logits[step]).max())


def compare(ref: Generation, got: Generation) -> tuple[int, float]:
    """(number of steps before the first token mismatch, max |logits diff| over those steps)."""
    same = (ref.tokens == got.tokens).all(axis=0)
    n = int(np.argmin(same)) if not same.all() else len(same)
    diff = float(np.abs(ref.logits[:n] - got.logits[:n]).max()) if n else 0.0
    return n, diff


def genai_greedy(folder: Path, prompt: list[int], reference: np.ndarray) -> list[int]:
    """onnxruntime-genai greedy search for len(reference) tokens. The graph knows no token ids:
    eos is set to an id that neither the prompt nor the reference holds, so it cannot end the
    search early (min_length would mask eos' logit instead, changing the argmax)."""
    import onnxruntime_genai as og
    from fastopt.genai.config import write_genai_config

    cfg_path = folder / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    used = set(prompt) | {int(t) for t in reference}
    cfg["model"]["eos_token_id"] = min(set(range(len(used) + 1)) - used)
    write_genai_config(cfg, cfg_path)
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + len(reference), do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], np.int32))
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out
